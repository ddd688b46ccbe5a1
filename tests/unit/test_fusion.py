"""Which consecutive steps of a segment fuse into one executable (executor/fusion.py), with fakes, as text."""

from __future__ import annotations

import pytest

from executor import fusion
from executor.segments import Step

pytestmark = pytest.mark.timeout(30)


class _Function:
    def __init__(self, compiled, mutates=frozenset(), failure=None):
        self.compiled, self.mutates, self.failure = compiled, mutates, failure


class _Backend:
    """Fuses functions whose compiled form is an int (its op count); a str is its refusal."""

    def fuse(self, unit, values):
        raise AssertionError("planning compiles nothing")

    def fusion_refusal(self, compiled) -> str:
        return compiled if isinstance(compiled, str) else ""

    def fusion_ops(self, compiled) -> int:
        return compiled


def _chain(n: int, axis_groups=None, first_slot: int = 1) -> list[Step]:
    """n steps, step i reading slot first_slot + i - 1 and writing the next (slot 0 the segment's input)."""
    return [Step(offset=i, function_id=1, inputs=[first_slot + i - 1], outputs=[first_slot + i], collective=True,
                 axis_groups=(axis_groups or {}).get(i, {"data": 1}), report=i == n - 1, digest=False)
            for i in range(n)]


def test_a_chain_of_one_executable_functions_is_one_unit():
    steps = _chain(128)
    plan = fusion.plan_fusion(steps, [_Function(2)] * 128, [128], _Backend())
    assert plan.describe() == "fused n0..n127: 128 steps, one executable (256 ops, 1 in, 1 out)"
    (unit,) = plan.fused
    assert unit.inputs == [0] and unit.outputs == [128]    # the 127 values between steps stay inside it


def test_steps_that_cannot_fuse_say_why_and_split_the_run():
    steps = _chain(6, axis_groups={4: {"data": 2}, 5: {"data": 2}})
    functions = [_Function(1), _Function(1), _Function("not one executable (3 XLA stage(s))"), _Function(1),
                 _Function(1), _Function(1, mutates=frozenset({0}))]
    plan = fusion.plan_fusion(steps, functions, [6], _Backend())
    assert plan.describe() == "\n".join([
        "fused n0..n1: 2 steps, one executable (2 ops, 1 in, 1 out)",
        "n2: not fused: not one executable (3 XLA stage(s))",
        # n3 binds group 1, n4 group 2: one binding per executable, so each is alone.
        "n3: not fused: no neighbour to fuse with (the steps beside it cannot be)",
        "n4: not fused: no neighbour to fuse with (the steps beside it cannot be)",
        "n5: not fused: it consumes (donates) inputs"])


def test_a_value_read_after_the_unit_or_stored_leaves_it():
    steps = _chain(4)
    steps[3].inputs = [2, 1]     # the last step, not fusable below, reads n0's output too
    functions = [_Function(1), _Function(1), _Function(1), _Function("a host stage")]
    plan = fusion.plan_fusion(steps, functions, [4, 2], _Backend())
    (unit,) = plan.fused
    assert (unit.inputs, unit.outputs) == ([0], [1, 2])   # slot 3 is stored by nobody, read by no one after


def test_the_op_limit_starts_a_new_executable(monkeypatch):
    monkeypatch.setattr(fusion, "MAX_FUSED_OPS", 10)
    plan = fusion.plan_fusion(_chain(5), [_Function(4)] * 5, [5], _Backend())
    assert plan.describe() == "\n".join([
        "fused n0..n1: 2 steps, one executable (8 ops, 1 in, 1 out)",
        "fused n2..n3: 2 steps, one executable (8 ops, 1 in, 1 out)",
        "n4: not fused: starts a new executable: one would pass 10 ops"])


def test_a_backend_without_fusion_fuses_nothing():
    plan = fusion.plan_fusion(_chain(3), [_Function(1)] * 3, [3], object())
    assert not plan.fused
    assert plan.describe().splitlines()[0] == "n0: not fused: this backend does not fuse"
