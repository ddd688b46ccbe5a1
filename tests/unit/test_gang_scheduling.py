"""Gang scheduling: collective actions run in the island's order on every executor.

In-process executors (an ExecutorCore each, threaded as a process threads it)
get the controller's messages in a different order each; an in-process fake
collective blocks like gloo (every member must arrive) and checks that members
agree on which computation they are in. Two clients submit collective programs
concurrently on two meshes whose groups are different (ranks reversed), so a
wrong order is a real deadlock.
"""

from __future__ import annotations

import collections
import queue
import random
import threading
import time

import pytest
import torch

from controller import CallSpec, Controller
from controller.client_ops import ClientOps
from executor.backends.torch_based import EagerBackend
from executor.core import ExecutorCore
from pathways_torch.capture import InputSpec, capture
from pathways_torch.collectives import all_reduce, tracing_mesh
from pathways_torch.wire import collective_ops, pb
from pathways_torch.wire.tensors import tensor_to_frame
from pathways_torch.wire.seam import AllocateMesh, Call, NewArray, RegisterFunction

pytestmark = pytest.mark.timeout(60)

EXECUTORS = ("a", "b")
CALLS_PER_CLIENT = 6


class FakeGroups:
    """Rendezvous like gloo: a member blocks until every member calls; members must be in the same computation."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._lock = threading.Condition()
        self._sizes: dict[int, int] = {}
        self._rounds: dict[int, list] = {}
        self._local = threading.local()

    # the CollectiveRuntime protocol the core uses
    def form(self, group_id, rank, size, store_path, timeout_s, members=()):
        # Like gloo's rendezvous: blocks until every member has come. A member that times out leaves, and
        # the group never forms (a later member times out too): as with gloo, not a group that heals.
        with self._lock:
            self._sizes[group_id] = size
            joined = self._joined = getattr(self, "_joined", {})
            broken = self._broken = getattr(self, "_broken", set())
            joined[group_id] = joined.get(group_id, 0) + 1
            self._lock.notify_all()
            if group_id in broken or not self._lock.wait_for(lambda: joined[group_id] >= size, self.timeout_s):
                joined[group_id] -= 1
                broken.add(group_id)
                raise TimeoutError(f"forming group {group_id} timed out: a member never came (deadlock)")

    def bind(self, axis_groups, seq=0, cache=None):
        groups = self

        class Binding:
            def __enter__(self):
                groups._local.binding, groups._local.seq = dict(axis_groups), seq

            def __exit__(self, *exc):
                groups._local.binding = None

        return Binding()

    # the op runtime
    def run(self, name, x, axis, op="sum", **kwargs):
        binding = getattr(self._local, "binding", None)
        if binding is None:
            return torch.zeros_like(x)
        group_id, seq = binding[axis], self._local.seq
        with self._lock:
            if group_id in getattr(self, "_broken", set()):
                raise TimeoutError(f"collective on group {group_id}: the group timed out while forming (deadlock)")
            joined = getattr(self, "_joined", {})
            if not self._lock.wait_for(lambda: joined.get(group_id, 0) >= self._sizes.get(group_id, 1 << 30),
                                       self.timeout_s):
                raise TimeoutError(f"collective on group {group_id} timed out waiting for the group (deadlock)")
            current = self._rounds.setdefault(group_id, [])
            current.append((seq, x))
            my_round = current
            if len(current) == self._sizes[group_id]:
                self._rounds[group_id] = []
                self._lock.notify_all()
            elif not self._lock.wait_for(lambda: len(my_round) == self._sizes[group_id], self.timeout_s):
                raise TimeoutError(f"collective on group {group_id} timed out: a member never came (deadlock)")
        seqs = {s for s, _ in my_round}
        if len(seqs) != 1:
            raise RuntimeError(f"collective mismatch on group {group_id}: members were in computations {seqs}")
        return sum(t for _, t in my_round)


class InProcessExecutor:
    """One ExecutorCore threaded as in ExecutorProcess: a compute thread reads the control messages
    and runs the jobs (every waiting message first, then one job), an I/O thread the data messages."""

    def __init__(self, executor_id, controller, runtime, gang_order):
        self.control: queue.Queue = queue.Queue()   # control messages; None: a job was queued (a wake-up)
        self.data: queue.Queue = queue.Queue()
        self.jobs: collections.deque = collections.deque()
        self.lock = threading.RLock()
        outbox = self

        self.controller = controller
        self.core = ExecutorCore(executor_id=executor_id, backend=EagerBackend(), outbox=outbox,
                                 submit=self._submit, collectives=runtime, gang_order=gang_order)
        self._compute = threading.Thread(target=self._compute_loop, daemon=True)
        for thread in (self._compute, threading.Thread(target=self._io_loop, daemon=True)):
            thread.start()

    def to_controller(self, envelope, payload=()):
        self.controller.on_message(self.core.executor_id, envelope, [])

    def to_peer(self, *args, **kwargs):
        raise AssertionError("no transfers expected")

    def to_client(self, *args):
        pass

    def post_control(self, fn):
        self.control.put(fn)

    def post_data(self, fn):
        self.data.put(fn)

    def _submit(self, job):
        self.jobs.append(job)
        if threading.current_thread() is not self._compute:
            self.control.put(None)

    def _io_loop(self):
        while True:
            fn = self.data.get()
            with self.lock:
                fn()

    def _compute_loop(self):
        # As ComputeLoop: a collective blocks this thread, and what arrives meanwhile waits.
        while True:
            while True:
                try:
                    fn = self.control.get_nowait()
                except queue.Empty:
                    break
                if fn is not None:
                    with self.lock:
                        fn()
            if not self.jobs:
                fn = self.control.get()
                if fn is not None:
                    with self.lock:
                        fn()
                continue
            job = self.jobs.popleft()
            self.core.compute(job)
            with self.lock:
                self.core.finish(job)


class FakeOutbox:
    def __init__(self):
        self.by_executor = {e: [] for e in EXECUTORS}

    def to_executor(self, executor_id, envelope, payload=()):
        self.by_executor[executor_id].append((envelope, list(payload)))


def _program():
    def step(x):
        return all_reduce(x, axis="data") + 1

    with tracing_mesh({"data": 2}):
        return capture(step, "step", [InputSpec((1,), torch.float32)], lambda t: (t, {}))


def _opposed(actions, first_group):
    """Every action of one group first, then the other's: the two executors are given opposite orders."""
    def group_of(envelope):
        return (envelope.form_group.group_id if envelope.WhichOneof("body") == "form_group"
                else envelope.run.axis_groups["data"])

    def seq_of(envelope):
        return getattr(envelope, envelope.WhichOneof("body")).seq

    return sorted(actions, key=lambda m: (group_of(m[0]) != first_group, seq_of(m[0])))


def _run(gang_order: bool, seed: int = 0, order: str = "shuffled", service_clients: bool = False):
    """order: "shuffled" (a seeded shuffle, reversed on the second executor) or "opposed" (each executor
    gets one client's actions first: without gang order both block in different groups, every time).
    ``service_clients``: the two clients are a standalone controller's (`ClientOps` of clients alice and bob,
    each with its own function and mesh, their calls admitted at proportional shares), not two threads of one."""
    outbox = FakeOutbox()
    controller = Controller(outbox)
    for i, executor_id in enumerate(EXECUTORS):
        controller.on_message(executor_id, pb.Envelope(register=pb.Register(
            executor_id=executor_id, data_address=f"inproc://{executor_id}")), [])
    version = _program()
    if service_clients:
        controller.admission.enabled = True
        for name, weight in (("alice", 1.0), ("bob", 2.0)):
            controller.admission.add_client(name, weight)
        owners = [ClientOps(controller, None, owner=name) for name in ("alice", "bob")]
    else:   # the embedded client's operations, both calling threads
        owners = [ClientOps(controller, None)] * 2
    function_ids = [owner.handle(RegisterFunction("step", version.graph, version.constants)) for owner in owners]
    meshes = [controller.resources.allocate({"data": 2}, ["a", "b"]),
              controller.resources.allocate({"data": 2}, ["b", "a"])]   # another group: ranks reversed
    meshes = [owner.handle(AllocateMesh({"data": 2}, mesh.executor_ids)) for owner, mesh in zip(owners, meshes)]
    starts = [owner.handle(NewArray(mesh.executor_ids, landing=0))[0] for owner, mesh in zip(owners, meshes)]
    results: dict[int, list] = {0: [], 1: []}
    barrier = threading.Barrier(2)

    def client(index):
        barrier.wait()                          # both clients submit at the same time
        array = starts[index]
        for _ in range(CALLS_PER_CLIENT):
            [array] = owners[index].handle(Call(CallSpec(
                function_id=function_ids[index], name="step", mesh=meshes[index], inputs=(array.array_id,),
                num_outputs=1, collective_axes=version.collective_axes)))
            results[index].append(array)
            time.sleep(0.002)                   # let the other client in between calls

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seq_of = {env.run.call_id: env.run.seq for env, _ in outbox.by_executor["a"] if env.WhichOneof("body") == "run"}
    seqs = [[seq_of[r.producer_call] for r in results[i]] for i in range(2)]
    # Both clients' work was queued at once: their sequence numbers interleave.
    assert min(seqs[0]) < max(seqs[1]) and min(seqs[1]) < max(seqs[0]), seqs
    run_of = {env.run.call_id: env.run for env, _ in outbox.by_executor["a"] if env.WhichOneof("body") == "run"}
    groups = [run_of[results[i][0].producer_call].axis_groups["data"] for i in range(2)]
    assert groups[0] != groups[1]
    runtime = FakeGroups(timeout_s=1.0)
    collective_ops.set_runtime(runtime)
    try:
        executors = {e: InProcessExecutor(e, controller, runtime, gang_order) for e in EXECUTORS}
        rng = random.Random(seed)
        for position, executor_id in enumerate(EXECUTORS):
            messages = outbox.by_executor[executor_id]
            loads = [m for m in messages if m[0].WhichOneof("body") == "load_function"]
            actions = [m for m in messages if m[0].WhichOneof("body") in ("run", "form_group")]
            assert len(actions) == 2 * CALLS_PER_CLIENT + 2       # every call of both clients, and 2 groups
            if order == "opposed":
                actions = _opposed(actions, first_group=groups[position])
            else:
                rng.shuffle(actions)
                if position == 1:
                    actions.reverse()        # a different order on every executor
            core = executors[executor_id].core
            for mesh, start in zip(meshes, starts):
                shard = mesh.executor_ids.index(executor_id)
                put = pb.Put(request_id=1)
                put.shard.CopyFrom(pb.ShardRef(array_id=start.array_id, shard=shard))
                frame = bytes(memoryview(tensor_to_frame(torch.ones(1), put.tensor, 1)))
                executors[executor_id].post_data(lambda core=core, put=put, frame=frame: core.on_data(
                    b"client", pb.Envelope(put=put), [frame], role="client"))
            for envelope, payload in loads + actions:
                executors[executor_id].post_control(lambda core=core, e=envelope, p=payload: core.on_control(e, p))
        finished = all(r.event.wait(10) for rs in results.values() for r in rs)
        return finished, results, executors
    finally:
        collective_ops.set_runtime(collective_ops._NoRuntime())


@pytest.mark.parametrize("clients", ["threads of one client", "clients of a service"])
@pytest.mark.parametrize("order", ["shuffled", "opposed"])
def test_collectives_in_a_random_order_per_executor_still_match_eager(order, clients):
    finished, results, executors = _run(gang_order=True, order=order,
                                        service_clients=clients == "clients of a service")
    assert finished
    expected = torch.ones(1)
    for _ in range(CALLS_PER_CLIENT):
        expected = expected * 2 + 1          # all_reduce over 2 equal blocks, then + 1
    for index, records in results.items():
        assert all(r.error is None for r in records), [r.error for r in records]
        final = records[-1]
        for executor_id in EXECUTORS:
            entry = executors[executor_id].core.store.get((final.array_id, final.executor_ids.index(executor_id), 0))
            assert torch.equal(entry.value, expected)


def test_without_gang_order_the_same_run_deadlocks_or_mismatches():
    # The opposed order, not a shuffle: a shuffle can happen to leave both executors in step (a flake).
    finished, results, _ = _run(gang_order=False, order="opposed")
    errors = [r.error for rs in results.values() for r in rs if r.error is not None]
    assert not finished or errors
    assert any(isinstance(e, Exception) and ("timed out" in str(e) or "mismatch" in str(e)) for e in errors)


def test_an_out_of_order_collective_arrival_is_held_back():
    version = _program()
    runtime = FakeGroups(timeout_s=1.0)
    jobs = []
    sink = type("Sink", (), {"to_controller": lambda *a: None, "to_client": lambda *a: None,
                             "to_peer": lambda *a: None})()
    core = ExecutorCore(executor_id="a", backend=EagerBackend(), outbox=sink, submit=jobs.append,
                        collectives=runtime)
    load = pb.LoadFunction(function_id=1, name="step")
    load.graph.CopyFrom(version.graph)
    core.on_control(pb.Envelope(load_function=load), [])
    put = pb.Put(request_id=1)
    put.shard.CopyFrom(pb.ShardRef(array_id=1, shard=0))
    frame = bytes(memoryview(tensor_to_frame(torch.ones(1), put.tensor, 1)))
    core.on_data(b"c", pb.Envelope(put=put), [frame], role="client")
    late = pb.Run(seq=5, call_id=2, function_id=1, collective=True, prev_collective_seq=3,
                  inputs=[pb.ShardRef(array_id=1, shard=0)], outputs=[pb.ShardRef(array_id=2, shard=0)])
    late.axis_groups["data"] = 1
    core.on_control(pb.Envelope(run=late), [])
    assert jobs == []                                   # seq 5 arrived first: held back, inputs notwithstanding
    core.on_control(pb.Envelope(form_group=pb.FormGroup(seq=3, group_id=1, rank=0, size=2)), [])
    assert [job.seq for job in jobs] == [3, 5]      # the group first, then the computation
