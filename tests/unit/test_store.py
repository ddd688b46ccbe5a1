"""The executor's object store: placeholders, ownership, pins and byte accounting."""

import pytest
import torch

from executor.store import ObjectStore
from pathways_torch.wire import pb

pytestmark = pytest.mark.timeout(60)

A = (1, 0, 0)
B = (2, 0, 0)
T = (1, 0, 77)  # a transient copy of A for call 77


def test_fill_then_free_returns_bytes_to_zero():
    store = ObjectStore()
    store.fill(A, torch.zeros(4, dtype=torch.float32))
    assert A in store and len(store) == 1
    assert store.bytes == 16
    assert store.get(A).ready and store.get(A).owned
    store.free(A)
    assert A not in store and len(store) == 0
    assert store.bytes == 0


def test_byte_accounting_across_dtypes_and_entries():
    store = ObjectStore()
    store.fill(A, torch.zeros(3, dtype=torch.float64))
    store.fill(B, torch.zeros(2, 5, dtype=torch.bfloat16))
    store.fill(T, torch.zeros((), dtype=torch.int64))
    assert store.bytes == 24 + 20 + 8
    store.free(B)
    assert store.bytes == 32
    store.free(A)
    store.free(T)
    assert store.bytes == 0 and len(store) == 0


def test_claim_creates_placeholder_that_is_not_ready():
    store = ObjectStore()
    entry = store.claim(A)
    assert A in store
    assert not entry.ready and entry.value is None and entry.pins == 0 and not entry.owned
    assert store.bytes == 0
    assert store.claim(A) is entry


def test_claim_flags_accumulate():
    store = ObjectStore()
    store.claim(A, pin=True)
    store.claim(A, pin=True)
    entry = store.claim(A, owned=True)
    assert entry.pins == 2 and entry.owned


def test_pinned_entry_survives_free_until_unpinned():
    store = ObjectStore()
    store.fill(A, torch.ones(8, dtype=torch.float32))
    store.claim(A, pin=True)
    store.free(A)
    assert A in store and store.bytes == 32  # pinned: still here
    assert not store.get(A).owned
    store.unpin(A)
    assert A not in store and store.bytes == 0


def test_two_pins_need_two_unpins():
    store = ObjectStore()
    store.fill(A, torch.ones(2))
    store.claim(A, pin=True)
    store.claim(A, pin=True)
    store.free(A)
    store.unpin(A)
    assert A in store
    store.unpin(A)
    assert A not in store and store.bytes == 0


def test_unpin_of_owned_entry_keeps_it():
    store = ObjectStore()
    store.fill(A, torch.ones(2))
    store.claim(A, pin=True)
    store.unpin(A)
    assert A in store and store.bytes == 8
    store.unpin(A)  # extra unpin does not go negative
    assert store.get(A).pins == 0
    store.free(A)
    assert A not in store


def test_unpin_and_free_of_unknown_keys_are_noops():
    store = ObjectStore()
    store.unpin(A)
    store.free(A)
    assert len(store) == 0 and store.bytes == 0


def test_placeholder_then_fill_wakes_waiters_in_order():
    store = ObjectStore()
    seen = []
    store.claim(A, owned=True)
    store.when_ready(A, lambda e: seen.append(("first", e.value.tolist())))
    store.when_ready(A, lambda e: seen.append(("second", e.value.tolist())))
    assert seen == []
    store.fill(A, torch.tensor([1.0, 2.0]))
    assert seen == [("first", [1.0, 2.0]), ("second", [1.0, 2.0])]
    assert store.get(A).waiters == []


def test_when_ready_on_ready_entry_calls_now():
    store = ObjectStore()
    store.fill(A, torch.tensor([5]))
    seen = []
    store.when_ready(A, lambda e: seen.append(e.value.item()))
    assert seen == [5]


def test_when_ready_creates_placeholder():
    store = ObjectStore()
    seen = []
    store.when_ready(B, seen.append)
    assert B in store and not store.get(B).ready
    store.fill(B, torch.zeros(1))
    assert len(seen) == 1 and seen[0] is store.get(B)


def test_free_before_fill_with_a_pin():
    """The controller frees an array whose bytes have not arrived while a computation pins it."""
    store = ObjectStore()
    store.claim(A, pin=True)
    store.free(A)
    assert A in store  # a placeholder that is pinned stays
    seen = []
    store.when_ready(A, lambda e: seen.append(e.value.sum().item()))
    store.fill(A, torch.ones(4), owned=False)
    assert seen == [4.0]
    assert A in store and store.bytes == 16  # still pinned
    store.unpin(A)
    assert A not in store and store.bytes == 0


def test_free_of_unpinned_placeholder_keeps_it_until_ready():
    store = ObjectStore()
    store.claim(A)
    store.free(A)
    # Not ready: a placeholder is never collected.
    assert A in store
    store.fill(A, torch.ones(2), owned=False)
    # Filled, not owned, not pinned: collected at once.
    assert A not in store and store.bytes == 0


def test_duplicate_fill_is_ignored():
    store = ObjectStore()
    calls = []
    store.when_ready(A, lambda e: calls.append(1))
    store.fill(A, torch.tensor([1.0, 2.0]))
    store.fill(A, torch.tensor([9.0, 9.0, 9.0, 9.0]))
    assert store.get(A).value.tolist() == [1.0, 2.0]
    assert store.bytes == 8
    assert calls == [1]
    store.free(A)
    assert store.bytes == 0


def test_fill_with_failure():
    store = ObjectStore()
    failure = pb.RemoteFailure(type="ValueError", message="boom", origin_call_id=3)
    seen = []
    store.when_ready(A, lambda e: seen.append(e.failure.message))
    store.fill(A, failure=failure)
    entry = store.get(A)
    assert entry.ready and entry.value is None and entry.failure.origin_call_id == 3
    assert seen == ["boom"] and store.bytes == 0
    # A later value does not replace the failure.
    store.fill(A, torch.ones(3))
    assert store.get(A).value is None and store.bytes == 0
    store.free(A)
    assert A not in store


def test_full_lifecycle_many_keys_returns_to_zero():
    store = ObjectStore()
    keys = [(i, s, 0) for i in range(5) for s in range(3)]
    for n, key in enumerate(keys):
        store.claim(key, pin=True)
        store.fill(key, torch.zeros(n + 1))
    assert store.bytes == 4 * sum(range(1, len(keys) + 1))
    for key in keys:
        store.free(key)
    assert len(store) == len(keys)
    for key in keys:
        store.unpin(key)
    assert len(store) == 0 and store.bytes == 0


def test_waiter_that_releases_the_entry_during_fill():
    store = ObjectStore()
    store.claim(A, pin=True)        # a pending send pins A before it is produced
    store.free(A)                   # the controller drops A meanwhile
    sent = []

    def push(entry):
        sent.append(entry.value.tolist())
        store.unpin(A)              # the send is done: nothing needs A any more

    store.when_ready(A, push)
    store.fill(A, torch.ones(2), owned=False)
    assert sent == [[1.0, 1.0]]
    assert A not in store and store.bytes == 0


def test_giving_up_on_a_put_that_never_came_fails_its_waiters_and_spares_computed_and_ready_entries():
    store = ObjectStore()
    woken = []
    store.claim(A, pin=True)                              # a run waits for a put
    store.when_ready(A, woken.append)
    failure = pb.RemoteFailure(type="PutAbandoned", message="freed before its put came")
    store.give_up(A, failure)
    assert len(woken) == 1 and woken[0].failure.type == "PutAbandoned"
    computing = B
    store.claim(computing).computing = True               # a run makes it: it will be filled
    store.give_up(computing, failure)
    assert not store.get(computing).ready
    ready = (3, 0, 0)
    store.fill(ready, torch.ones(2))
    store.give_up(ready, failure)
    assert store.get(ready).failure is None
