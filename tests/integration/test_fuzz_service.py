"""The service's client socket fuzzed from a client key (issue 46, point 10): the short version of
`bench/fuzz_service.py`.

Bob, with his own valid key, sends 1,200 seeded seam messages on a raw DEALER: every op the socket serves, pings and
unknown ops, mutated fields and wrong types, NaN/inf/huge numbers, deep nests, bad tags, garbage protobufs, frames
added and missing, a few messages up to the cap and over it, the ids of alice's arrays, and the requests that may
hold the service (`bench.fuzz_seam.HAZARDS`: waits of 1e308, inf and NaN seconds, a 16 MiB message, 12 MB of
``[[],[],...]``). Meanwhile alice computes through her own context. At the end: the controller and every executor
still run, none was lost or replaced, alice's results all equal eager's, and every request the service could read
was answered. The answers themselves are recorded, not expected: the service's refusals change as it hardens.
"""

from __future__ import annotations

import pytest

from bench import fuzz_service
from bench.fuzz_service import HEADERS, markdown
from tests.service import ControllerProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MESSAGES = 1200
EXECUTORS = 2


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    port = fuzz_service.free_port()
    process = ControllerProcess(str(tmp_path_factory.mktemp("fuzz-service") / "keys"), clients=("alice", "bob"),
                                num_executors=EXECUTORS, args=("--status-port", str(port)))
    process.status_address = f"127.0.0.1:{port}"
    yield process
    process.stop()


def test_a_fuzzing_client_costs_no_process_no_executor_and_no_other_clients_result(service):
    facts = fuzz_service.run(MESSAGES, seed=0, executors=EXECUTORS, max_seconds=150, answer_timeout_s=10,
                             service=service, progress=lambda line: None)
    table = markdown(HEADERS, facts["rows"])
    print(table)
    assert facts["messages"] == MESSAGES, f"sent only {facts['messages']} messages in the time allowed"
    assert facts["controller_exit"] is None, "the controller exited"
    assert facts["executors_exited"] == [] and facts["executors_lost"] == [], facts
    assert "status_error" not in facts, facts["status_error"]
    assert facts["alice_steps"] > 0 and facts["alice_failures"] == [], facts["alice_failures"]
    assert facts["hangs"] == [], f"requests the service read and never answered: {facts['hangs']}"
    served = set(fuzz_service.served_ops())
    sent = {op for op, row in facts["table"].items() if row["sent"] != "0"}
    assert served <= sent, f"ops never fuzzed: {sorted(served - sent)}"
    reached = {op for op, row in facts["table"].items() if row["ok"] != "0" or row["refused: handler"] != "0"}
    assert len(reached & served) >= len(served) - 3, f"ops that never got past the signature check: " \
                                                     f"{sorted(served - reached)}\n{table}"
