"""The benchmarks' pass/fail decisions, as pure functions: the soak's exit (losses equal to the unbroken run's,
stores no larger than at the start beyond the kept losses, every fault recovered) and the fuzzer's inputs
(every body kind of the schema, each a well-formed message)."""

from __future__ import annotations

import random

import pytest

from bench.fuzz_inputs import BODY_KINDS, Hints, RandomChooser, body, message
from bench.soak import executor_exits, verdict
from pathways_torch.wire import pb

pytestmark = pytest.mark.timeout(60)

_RECOVERED = {"kind": "SIGKILL", "executor": "executor-1", "recoveries": 1, "failed_calls": 0}


def _verdict(**changes):
    rows = dict(losses=[1.0, 0.5, 0.25], expected=[1.0, 0.5, 0.25], start_bytes={"executor-0": 1000, "executor-1": 1000},
                end_bytes={"executor-0": 1000, "executor-1": 1000}, kept_start={"executor-0": 4},
                kept_end={"executor-0": 4}, per_fault=[_RECOVERED], leftover=[])
    return verdict(**{**rows, **changes})


def test_a_soak_with_equal_losses_and_stores_passes():
    assert _verdict() == []


def test_a_soak_fails_on_any_loss_that_differs_naming_the_first_step():
    problems = _verdict(losses=[1.0, 0.5000001, 0.25])
    assert len(problems) == 1 and "step 2" in problems[0] and "0.5000001" in problems[0]
    assert _verdict(losses=[1.0, 0.5]) != []            # a step missing is a difference too


def test_a_store_may_grow_by_the_kept_losses_and_not_a_byte_more():
    kept = dict(kept_start={"executor-0": 4}, kept_end={"executor-0": 36})   # 1 kept loss at the start, 9 at the end
    assert _verdict(end_bytes={"executor-0": 1032, "executor-1": 1000}, **kept) == []
    problems = _verdict(end_bytes={"executor-0": 1036, "executor-1": 1000}, **kept)
    assert len(problems) == 1 and "executor-0" in problems[0] and "4 bytes leaked" in problems[0]
    problems = _verdict(end_bytes={"executor-0": 1000, "executor-1": 1004})   # executor-1 keeps no loss
    assert len(problems) == 1 and "executor-1" in problems[0]
    assert _verdict(end_bytes={"executor-0": 996, "executor-1": 1000}) == []  # smaller is fine


def test_an_unrecovered_fault_or_a_leftover_incarnation_fails_but_a_harmless_cut_does_not():
    assert "not recovered" in _verdict(per_fault=[{**_RECOVERED, "recoveries": 0}])[0]
    assert _verdict(per_fault=[{"kind": "cut link", "executor": "link", "recoveries": 0, "failed_calls": 0}]) == []
    assert "pids [123]" in _verdict(leftover=[123])[0]


def test_the_fuzzer_makes_every_body_kind_of_the_schema():
    assert set(BODY_KINDS) == {f.name for f in pb.Envelope.DESCRIPTOR.oneofs_by_name["body"].fields}
    assert {"save_shards", "transfer_lost", "store_request", "cancel", "admit_key", "register_program",
            "transfer_ack"} <= set(BODY_KINDS)
    chooser = RandomChooser(random.Random(0))
    hints = Hints(executor_ids=("executor-0",), addresses=("tcp://127.0.0.1:5000",), epochs=(1,), save_dir="/tmp/x")
    for kind in BODY_KINDS:
        for _ in range(20):
            envelope = pb.Envelope.FromString(body(chooser, hints, kind).SerializeToString())
            assert envelope.WhichOneof("body") == kind
            if kind == "register":      # never the executor's real address: that is a genuine restart
                assert envelope.register.data_address not in hints.addresses
            if kind == "save_shards" and envelope.save_shards.path.startswith("/"):
                assert envelope.save_shards.path.startswith(("/tmp/x/", "/nonexistent/"))
    assert all(isinstance(frame, bytes) for _ in range(200) for frame in message(chooser, hints))


class _Process:
    """Popen's ``pid`` and ``poll`` (None while running, else the return code: negative for a signal)."""

    def __init__(self, pid: int, code: int | None):
        self.pid, self._code = pid, code

    def poll(self):
        return self._code


_FAULTS = [{"kind": "SIGKILL", "executor": "executor-1", "pid": 11}, {"kind": "SIGSTOP", "executor": "executor-1",
                                                                      "pid": 12}, {"kind": "cut link", "pid": None}]


def test_the_soak_accounts_for_every_executor_exit_and_fails_on_one_it_did_not_inject():
    incarnations = [("executor-1", _Process(11, -9)), ("executor-1", _Process(12, 3)),      # the two faults'
                    ("executor-0", _Process(10, -11)),                                        # a survivor's SIGSEGV
                    ("executor-0", _Process(13, None)), ("executor-1", _Process(14, None))]   # running
    exits = executor_exits(incarnations, _FAULTS)
    assert [(e["pid"], e["injected"], e["ended"], e["explained"]) for e in exits] == [
        (11, "SIGKILL", "was killed by SIGKILL", True), (12, "SIGSTOP", "exited with code 3", True),
        (10, "", "was killed by SIGSEGV", False), (13, "", "running", True), (14, "", "running", True)]
    problems = _verdict(exits=exits)
    assert problems == ["executor-0 (pid 10) was killed by SIGSEGV, which no fault of the soak injected: see its log"]
    assert _verdict(exits=[e for e in exits if e["pid"] != 10]) == []


def test_a_fault_explains_only_the_ending_it_causes():
    exits = executor_exits([("executor-1", _Process(11, -11)), ("executor-1", _Process(12, -6)),
                            ("executor-2", _Process(20, 1))], _FAULTS)
    assert [e["explained"] for e in exits] == [False, False, False]   # SIGKILLed, yet a SIGSEGV; a stopped one's abort
    assert _verdict(exits=exits)[0] == ("executor-1 (pid 11) was killed by SIGSEGV, after the soak's SIGKILL: "
                                        "see its log")
