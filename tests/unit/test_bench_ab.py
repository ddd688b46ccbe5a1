"""bench/ab.py's arithmetic: the columns it reads from each benchmark's JSON, and when new is called worse."""

from __future__ import annotations

import pytest

from bench.ab import columns, compare

pytestmark = pytest.mark.timeout(30)


def test_columns_are_the_higher_is_better_numbers_of_each_benchmark():
    dispatch = {"results": [{"executors": 2, "rates": {"OpByOp": 900.0, "Chained": 4000.0}}]}
    assert columns("dispatch", dispatch) == {"N=2 OpByOp /s": 900.0, "N=2 Chained /s": 4000.0}
    train = {"runtime": [{"executors": 1, "plan": "DataParallel", "tokens_per_s": 1e5}]}
    assert columns("train", train) == {"N=1 DataParallel tokens/s": 1e5}


def test_new_is_worse_only_below_the_lowest_old_run():
    old = [{"a": 100.0, "b": 100.0}, {"a": 90.0, "b": 110.0}, {"a": 95.0, "b": 105.0}]
    new = [{"a": 91.0, "b": 80.0}, {"a": 89.0, "b": 85.0}, {"a": 92.0, "b": 120.0}]
    rows = {r["column"]: r for r in compare(old, new)}
    assert not rows["a"]["worse"] and rows["a"]["old_min"] == 90.0 and rows["a"]["new_median"] == 91.0
    assert rows["b"]["worse"] and rows["b"]["new_over_old"] == pytest.approx(85.0 / 105.0)
