"""One copy of the state: an input the store no longer needs is handed over to its computation, which frees it
at its last use; puts travel in bounded messages; outputs own their memory."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.fx

from controller import CallSpec
from controller.program import ProgramSpec, lower
from controller.resources import MeshAllocation
from executor.backends.boxed import boxed
from executor.backends.torch_based import EagerBackend
from executor.segments import plan_segments
from executor.store import ObjectStore
from pathways_torch.dispatcher import _PUT_MESSAGE_BYTES, _messages
from pathways_torch.wire import pb

pytestmark = pytest.mark.timeout(30)

A = (1, 0, 0)
GONE = pb.RemoteFailure(type="ProtocolError", message="handed over")


def _pinned_entry(store, owned: bool, pins: int):
    store.fill(A, torch.zeros(4))
    entry = store.get(A)
    for _ in range(pins):
        store.claim(A, pin=True)
    if not owned:
        store.free(A)
    return entry


def test_an_input_nobody_else_holds_is_handed_over_and_collected_when_the_computation_ends():
    store = ObjectStore()
    entry = _pinned_entry(store, owned=False, pins=1)
    value = store.hand_over(entry, GONE)
    assert torch.equal(value, torch.zeros(4)) and entry.value is None and entry.failure is GONE
    assert store.handed_over == 1 and store.bytes == 0   # the computation's now, not the store's
    store.unpin(A)
    assert A not in store and store.bytes == 0
    store.fill(A, torch.zeros(2))                          # the count goes on from there
    assert store.bytes == 8


@pytest.mark.parametrize("owned, pins", [(True, 1), (False, 2)], ids=["still owned", "another reader"])
def test_an_input_someone_else_may_read_stays_stored(owned, pins):
    store = ObjectStore()
    entry = _pinned_entry(store, owned=owned, pins=pins)
    assert torch.equal(store.hand_over(entry, GONE), torch.zeros(4))
    assert entry.value is not None and entry.failure is None and store.handed_over == 0


def test_a_failed_input_is_passed_on_as_its_failure():
    store = ObjectStore()
    store.fill(A, failure=GONE)
    assert store.hand_over(store.get(A), pb.RemoteFailure(type="Other")) is GONE


def test_a_boxed_graph_frees_each_input_at_its_last_use():
    def f(a, b):
        c = a * 2
        return c + b

    graph_module = boxed(torch.fx.symbolic_trace(f))
    first = torch.ones(3)
    alive = weakref.ref(first)
    seen = []
    args = [first, torch.ones(3)]
    del first
    original_add = torch.Tensor.__add__

    def add(self, other):   # the last use of `a` was `a * 2`: it is gone by the time `c + b` runs
        gc.collect()
        seen.append(alive())
        return original_add(self, other)

    torch.Tensor.__add__ = add
    try:
        out = graph_module.forward(args)
    finally:
        torch.Tensor.__add__ = original_add
    assert torch.equal(out, torch.full((3,), 3.0)) and args == [] and seen == [None]


def test_an_output_that_views_a_big_intermediate_is_stored_as_its_own_tensor():
    def step(x):
        packed = torch.cat([x, x.sum().reshape(1)])
        return packed[:-1] * 2, packed[-1]

    backend = EagerBackend()
    graph_module = torch.fx.symbolic_trace(step)
    compiled = backend.compile(graph_module, [torch.empty(1 << 16)])
    doubled, loss = backend.run(compiled, [torch.ones(1 << 16)])
    assert loss.untyped_storage().nbytes() == 4 and loss.item() == 1 << 16
    assert doubled.untyped_storage().nbytes() == doubled.nbytes   # already its own: not copied again


def test_a_put_travels_in_messages_of_bounded_size_in_order():
    mib = 1 << 20
    sizes = [3 * mib, 3 * mib, 3 * mib, 20 * mib, 1 * mib, 1]
    shards = [(index, torch.empty(size, dtype=torch.uint8), b"") for index, size in enumerate(sizes)]
    messages = _messages(shards)
    assert [[index for index, _, _ in message] for message in messages] == [[0, 1], [2], [3], [4, 5]]
    assert all(sum(s.numel() for _, s, _ in m) <= _PUT_MESSAGE_BYTES or len(m) == 1 for m in messages)


MESH = MeshAllocation(1, (("data", 2),), ("e0", "e1"))


def _node(index, inputs, outputs):
    return CallSpec(name=f"f{index}", function_id=1, mesh=MESH, inputs=inputs, outputs=outputs)


def test_a_segment_empties_each_slot_after_its_last_reader_and_keeps_what_it_stores():
    # n0 reads %0 -> %1; n1 reads %0 and %1 -> %2; n2 reads %1 -> %3 (a program output, as %2 is)
    spec = ProgramSpec(name="p", input_values=(0,), input_meshes=(MESH,), output_values=(2, 3), nodes=(
        _node(0, (0,), (1,)), _node(1, (0, 1), (2,)), _node(2, (1,), (3,))))
    lowered = lower(spec, 1, {"e0": "tcp://127.0.0.1:9000", "e1": "tcp://127.0.0.1:9001"})
    segments = [item for item in plan_segments(lowered.plans["e0"]) if hasattr(item, "steps")]
    # %2 leaves the program, so its segment ends after n1; %1 is stored for n2's segment, which reads it as slot 0
    assert [[step.offset for step in segment.steps] for segment in segments] == [[0, 1], [2]]
    assert {step.offset: step.frees for segment in segments for step in segment.steps} == {0: (), 1: (0,), 2: (0,)}
    assert 1 in {slot for _, _, slot in segments[0].outputs}   # %1 (slot 1): read later, so never emptied


def test_donate_argnums_must_be_argument_positions():
    import pathways_torch as pw

    with pytest.raises(ValueError, match=r"donate_argnums: expected argument positions \(ints >= 0\), got \(-1,\)"):
        pw.function(lambda a: a, donate_argnums=(-1,))
    assert pw.function(lambda a: a, donate_argnums=0).donate_argnums == {0}


def test_bytes_that_arrive_after_their_array_was_freed_do_not_own_it_again():
    store = ObjectStore()
    store.claim(A, pin=True)          # a run that reads A (and was given it) arrived before A's put
    store.free(A)
    store.fill(A, torch.zeros(4))     # the put lands: the run's alone, not the store's
    entry = store.get(A)
    assert not entry.owned and store.hand_over(entry, GONE) is not None and store.handed_over == 1
    store.unpin(A)
    assert A not in store and store.bytes == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weight_decay, decoupled", [(0.0, True), (0.01, True), (0.01, False)],
                         ids=["no decay", "AdamW", "Adam with L2"])
def test_the_in_place_adam_update_is_the_functional_one_bit_for_bit(dtype, weight_decay, decoupled):
    from pathways_torch.training.optimizers import DYNAMIC, GroupHyper, _adam, _adam_in_place

    generator = torch.Generator().manual_seed(3)
    param, grad, exp_avg = (torch.randn(1000, generator=generator, dtype=dtype) for _ in range(3))
    exp_avg_sq = torch.rand(1000, generator=generator, dtype=dtype)
    h = GroupHyper(lr=1e-3, weight_decay=weight_decay, beta1=0.9, beta2=0.999, eps=1e-8, decoupled=decoupled)
    values = dict(zip(DYNAMIC, torch.tensor([1e-3, 0.0, 0.9, 0.999, weight_decay], dtype=torch.float64)))
    step = torch.tensor(7.0, dtype=torch.float64)
    expected, (m, v) = _adam(h, values, param, grad, (exp_avg, exp_avg_sq), step)
    inputs = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    got, (got_m, got_v) = _adam_in_place(h, values, inputs[0], grad.clone(), (inputs[1], inputs[2]), step)
    assert got is inputs[0] and got_m is inputs[1] and got_v is inputs[2]   # written where they lie
    for a, b in ((got, expected), (got_m, m), (got_v, v)):
        assert torch.equal(a, b)


def test_the_inputs_a_graph_writes_in_place_are_found_through_views():
    from torch.fx.experimental.proxy_tensor import make_fx

    from executor.backends.mutated_inputs import mutated_inputs

    def step(flat, state, grad):
        flat.narrow(0, 0, 2).mul_(2)     # through a view
        state.add_(grad)                 # directly
        return flat.sum() + grad.sum()   # grad only read

    graph_module = make_fx(step)(torch.zeros(4), torch.zeros(4), torch.ones(4))
    assert mutated_inputs(graph_module) == {0, 1}
