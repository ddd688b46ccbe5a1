"""An executor's heartbeat says how many of its island's faults it was told; the answer names only later ones."""

from __future__ import annotations

import types

import pytest

from executor.endpoint import CoreEndpoint
from pathways_torch.wire import decode, encode, pb

pytestmark = pytest.mark.timeout(30)


class _Collectives:
    def __init__(self):
        self.abandoned: dict[str, int | None] = {}

    def abandon(self, peer, why, before_group=None):
        self.abandoned[peer] = before_group
        return []


class _Executor(CoreEndpoint):
    executor_id = "e0"

    def __init__(self):
        self.retired: list[str] = []
        self.core = types.SimpleNamespace(data_gate=types.SimpleNamespace(retire=self.retired.append))
        self.outbox = types.SimpleNamespace(epoch=3)
        self.collectives = _Collectives()


def _answer(entries, told) -> list[bytes]:
    return encode(pb.Envelope(heartbeat=pb.Heartbeat(lost_peers=entries, lost_peers_told=told)))


def test_the_ping_echoes_the_count_the_last_answer_gave_and_each_fault_is_acted_on():
    executor = _Executor()
    ping, _ = decode([executor.heartbeat()])
    assert (ping.heartbeat.epoch, ping.heartbeat.lost_peers_told) == (3, 0)
    assert executor._heartbeat_answer(_answer(["e1@1<4", "transfer:9.0:e0->e2<5"], 2)) is None
    assert executor.collectives.abandoned == {"e1@1": 4, "transfer:9.0:e0->e2": 5}
    assert executor.retired == ["e1@1", "transfer:9.0:e0->e2"]
    ping, _ = decode([executor.heartbeat()])
    assert ping.heartbeat.lost_peers_told == 2
    executor._heartbeat_answer(_answer([], 2))       # nothing new: nothing done, the count stays
    assert executor.lost_peers_told == 2 and len(executor.retired) == 2
