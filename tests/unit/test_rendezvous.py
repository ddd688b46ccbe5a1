"""The controller's rendezvous store: only a group's members use its prefix, a get waits for its key, and
the executor's Store talks to it (in process, over a socket pair)."""

from __future__ import annotations

import threading

import pytest
import zmq

from controller.rendezvous import RendezvousStore
from pathways_torch.wire import decode, encode, pb

pytestmark = pytest.mark.timeout(30)

PREFIX = "group-1/epoch-0"


def _ask(store, executor_id, **fields):
    answers = []
    store.handle(executor_id, pb.StoreRequest(request_id=len(answers) + 1, **fields), answers.append)
    return answers


def test_only_members_use_a_groups_prefix():
    store = RendezvousStore()
    store.allow(PREFIX, ["e0", "e1"])
    assert _ask(store, "e0", op="set", key=f"{PREFIX}/addr0", value=b"x")[0].ok
    refused = _ask(store, "e2", op="get", key=f"{PREFIX}/addr0")[0]
    assert not refused.ok and "e2 may not use store key 'group-1/epoch-0/addr0'" in refused.error
    assert not _ask(store, "e0", op="get", key="elsewhere/addr0")[0].ok
    assert not _ask(store, "e0", op="rename", key=f"{PREFIX}/addr0")[0].ok


def test_a_get_waits_for_its_key_and_add_counts():
    store = RendezvousStore()
    store.allow(PREFIX, ["e0", "e1"])
    waiting = _ask(store, "e1", op="get", key=f"{PREFIX}/addr0")
    assert waiting == []                                   # parked until e0 sets it
    _ask(store, "e0", op="set", key=f"{PREFIX}/addr0", value=b"tcp://127.0.0.1:1")
    assert waiting[0].ok and waiting[0].value == b"tcp://127.0.0.1:1"
    assert _ask(store, "e0", op="add", key=f"{PREFIX}/n", amount=2)[0].number == 2
    assert _ask(store, "e1", op="add", key=f"{PREFIX}/n", amount=3)[0].number == 5
    assert _ask(store, "e1", op="check", key=f"{PREFIX}/n", keys=[f"{PREFIX}/n", f"{PREFIX}/addr0"])[0].found
    store.forget(PREFIX)
    assert not _ask(store, "e0", op="get", key=f"{PREFIX}/n")[0].ok


def test_the_executors_store_speaks_to_it():
    import datetime

    from executor.rendezvous import ControllerStore

    context = zmq.Context()
    server, client = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client.setsockopt(zmq.IDENTITY, b"e0#store")
    client.connect(f"tcp://127.0.0.1:{port}")
    store = RendezvousStore()
    store.allow(PREFIX, ["e0"])
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if server.poll(50):
                identity, *frames = server.recv_multipart()
                envelope, _ = decode(frames)
                store.handle("e0", envelope.store_request, lambda answer: server.send_multipart(
                    [identity, *encode(pb.Envelope(store_reply=answer))]))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        remote = ControllerStore(client, timeout_s=5.0)
        remote.set(f"{PREFIX}/a", "1")
        assert remote.get(f"{PREFIX}/a") == b"1"
        assert remote.add(f"{PREFIX}/c", 4) == 4
        assert remote.check([f"{PREFIX}/a", f"{PREFIX}/c"])
        remote.set_timeout(datetime.timedelta(seconds=0.3))
        with pytest.raises(TimeoutError, match="no answer to get 'group-1/epoch-0/never'"):
            remote.get(f"{PREFIX}/never")
        with pytest.raises(RuntimeError, match="refused get 'other/x'"):
            remote.get("other/x")
    finally:
        stop.set()
        thread.join()
        client.close(0)
        server.close(0)
        context.term()


def test_a_groups_keys_go_once_every_member_has_formed_it():
    from controller.rendezvous import FORMED_KEY
    from executor import collectives

    assert collectives._FORMED_KEY == FORMED_KEY              # the executor's mark is the store's
    store = RendezvousStore()
    store.allow(PREFIX, ["e0", "e1"])
    _ask(store, "e0", op="set", key=f"{PREFIX}/addr0", value=b"x")
    _ask(store, "e1", op="set", key=f"{PREFIX}/addr1", value=b"y")
    assert _ask(store, "e0", op="add", key=f"{PREFIX}/{FORMED_KEY}", amount=1)[0].number == 1
    assert store.sizes() == {"groups": 1, "keys": 3, "waiting": 0}    # e1 may still read e0's address
    assert store.stored_bytes() == len(PREFIX) + len("addr0x") + len("addr1y") + len(FORMED_KEY) + len("1")
    assert _ask(store, "e1", op="add", key=f"{PREFIX}/{FORMED_KEY}", amount=1)[0].number == 2
    assert store.sizes() == {"groups": 0, "keys": 0, "waiting": 0} and store.groups_forgotten == 1
    assert store.stored_bytes() == 0


def test_a_get_parked_past_the_group_timeout_fails_and_its_group_goes():
    now = [0.0]
    store = RendezvousStore(timeout_s=20.0, clock=lambda: now[0])
    store.allow(PREFIX, ["e0", "e1"])
    store.allow("group-2/epoch-0", ["e0", "e1"])
    _ask(store, "e0", op="set", key=f"{PREFIX}/addr0", value=b"x")
    late = _ask(store, "e0", op="get", key=f"{PREFIX}/addr1")      # e1 never comes
    now[0] = 10.0
    fresh = _ask(store, "e0", op="get", key="group-2/epoch-0/addr1")
    assert store.expire() == 0 and late == [] and fresh == []
    now[0] = 20.5
    assert store.expire() == 1
    assert not late[0].ok and "no member answered within the group timeout (20 s)" in late[0].error
    assert fresh == [] and store.sizes() == {"groups": 1, "keys": 0, "waiting": 1}
    now[0] = 31.0
    assert store.expire() == 1 and store.sizes() == {"groups": 0, "keys": 0, "waiting": 0}


def test_abandoned_groups_are_forgotten_and_their_parked_gets_fail_at_once():
    store = RendezvousStore()
    store.allow("group-3/epoch-0", ["e0", "e1"])
    store.allow("group-4/epoch-0", ["e0", "e1"])
    parked = _ask(store, "e0", op="get", key="group-3/epoch-0/addr1")
    _ask(store, "e0", op="set", key="group-4/epoch-0/addr0", value=b"x")
    store.forget_groups([3])
    assert not parked[0].ok and "abandoned" in parked[0].error
    assert store.sizes() == {"groups": 1, "keys": 1, "waiting": 0}
    assert not _ask(store, "e1", op="get", key="group-3/epoch-0/addr1")[0].ok     # no member any more
