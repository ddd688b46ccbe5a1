"""An executor's order is the schedule: a program run's actions start in the order the lowering lists them,
and a collective never starts ahead of earlier work of the same executor.

The first tests drive one `ExecutorCore` synchronously (the fakes of `test_executor_core.py`). The last
runs a 2-stage x 2-data pipeline on four in-process executors (threaded as `test_gang_scheduling.py`
threads them, with the blocking fake collective from there and an in-process network for the
stage-to-stage copies) and delivers every message in many seeded random orders.
"""

from __future__ import annotations

import collections
import queue
import random
import threading
import time

import pytest
import torch

from controller import CallSpec, Controller, ControllerConfig
from controller.client_ops import ClientOps
from controller.program import ProgramSpec, lower
from controller.resources import MeshAllocation
from executor.backends.torch_based import EagerBackend
from executor.core import ExecutorCore
from pathways_torch.capture import InputSpec, capture
from pathways_torch.collectives import all_reduce, tracing_mesh
from pathways_torch.wire import collective_ops, pb
from pathways_torch.wire.tensors import tensor_to_frame
from tests.unit.test_executor_core import FakeOutbox, fetch_tensor, load, make_core, put, ref, run
from tests.unit.test_gang_scheduling import FakeGroups
from pathways_torch.wire.seam import AllocateMesh, NewArray, RegisterFunction, RegisterProgram, RunProgram

V = torch.tensor([1.0, 2.0])


def _starts(core) -> list[tuple[str, int]]:
    """(name, seq) of every "start" record in the executor's trace, in order."""
    reply = pb.TraceReply()
    core.trace.fill(reply)
    return [(event.name, event.seq) for event in reply.events if event.kind == "start"]


def _first_seq(segment) -> int:
    return segment.ids(segment.steps[0])[0]


def _transfer(core, shard_ref, tensor) -> None:
    msg = pb.Transfer()
    msg.shard.CopyFrom(shard_ref)
    frame = tensor_to_frame(tensor, msg.tensor, 1)
    core.on_data(b"peer", pb.Envelope(transfer=msg), [bytes(memoryview(frame))], role="e1")


def _abc_on_e0():
    """An executor e0 holding program 7, "abc": e0 lists A, B, C; B reads a copy pushed from e1 (made by P there), C
    reads only a value stored here (array 50). (core, outbox)."""
    e0, e1 = MeshAllocation(1, (("data", 1),), ("e0",)), MeshAllocation(2, (("data", 1),), ("e1",))
    spec = ProgramSpec(name="abc", input_values=(0, 1), input_meshes=(e0, e1), output_values=(4, 5), nodes=(
        CallSpec(name="A", function_id=1, mesh=e0, inputs=(0,), outputs=(2,)),
        CallSpec(name="P", function_id=4, mesh=e1, inputs=(1,), outputs=(3,)),
        CallSpec(name="B", function_id=2, mesh=e0, inputs=(2, 3), outputs=(4,)),
        CallSpec(name="C", function_id=3, mesh=e0, inputs=(0,), outputs=(5,))))
    plan = lower(spec, 7, {"e0": "inproc://e0", "e1": "inproc://e1"}).plans["e0"]
    core, outbox = make_core()
    load(core, 1, lambda x: x + 1, V, name="A")
    load(core, 2, lambda a, b: a * b, V, V.clone(), name="B")   # two tensors: one would trace as a * a
    load(core, 3, lambda x: x * 10, V, name="C")
    put(core, ref(50), V)
    core.on_control(pb.Envelope(register_program=plan), [])
    return core, outbox


# ---------------------------------------------------------------- one executor, one run

@pytest.mark.timeout(30)
def test_a_later_local_segment_of_a_run_does_not_pass_one_waiting_for_a_copy():
    # Before: C started as soon as it was queued, ahead of B ([A, C, B]).
    core, outbox = _abc_on_e0()
    run = pb.RunProgram(program_id=7, base_seq=10, base_call_id=100, input_array_ids=[50, 51],
                        output_array_ids=[60, 61], first_intermediate_id=1000)
    core.on_control(pb.Envelope(run_program=run), [])
    assert _starts(core) == [("A", 10)]           # B waits for its copy; C, listed after B, waits for B
    queue = core.run_queue
    assert [_first_seq(segment) for segment in queue.queued] == [12]   # C is parked on B, out of every pass
    assert _first_seq(queue.queued[0].parked) == 13 and queue.queue_high_water >= 2
    _transfer(core, ref(1003, tag=102), V * 3)     # %3 for node 2 (call 102) arrives late
    assert _starts(core) == [("A", 10), ("B", 12), ("C", 13)]
    torch.testing.assert_close(fetch_tensor(core, outbox, ref(60)), (V + 1) * V * 3)
    torch.testing.assert_close(fetch_tensor(core, outbox, ref(61), request_id=101), V * 10)
    assert sorted(d.call_id for d in outbox.dones() if d.ok) == [102, 103]


# ---------------------------------------------------------------- collectives behind earlier work

def _collective_core():
    """A core whose jobs are only recorded (a collective would block in them), and a collective function."""
    jobs = []
    core = ExecutorCore(executor_id="e0", backend=EagerBackend(), outbox=FakeOutbox(), submit=jobs.append,
                        collectives=FakeGroups(timeout_s=1.0))
    load(core, 1, lambda x: x + 1, V)
    with tracing_mesh({"data": 2}):
        version = capture(lambda x: all_reduce(x, axis="data"), "ar", [InputSpec((2,), torch.float32)],
                          lambda t: (t, {}))
    core.on_control(pb.Envelope(load_function=pb.LoadFunction(function_id=2, name="ar", graph=version.graph)), [])
    put(core, ref(1), V)
    return core, jobs


def _collective_run(seq, call_id, prev, inputs, outputs):
    run = pb.Run(seq=seq, call_id=call_id, function_id=2, collective=True, prev_collective_seq=prev,
                 inputs=inputs, outputs=outputs)
    run.axis_groups["data"] = 1
    return pb.Envelope(run=run)


@pytest.mark.timeout(30)
def test_a_cancelled_run_drops_its_parked_segments_too_and_reports_each():
    core, outbox = _abc_on_e0()
    for base in (100, 200):   # two runs: each one's A starts, its B waits for its copy, its C for its B
        core.on_control(pb.Envelope(run_program=pb.RunProgram(
            program_id=7, base_seq=base // 10, base_call_id=base, input_array_ids=[50, 51],
            output_array_ids=[60 + base, 61 + base], first_intermediate_id=1000 + base)), [])
    queue = core.run_queue
    assert [_first_seq(segment) for segment in queue.queued] == [12, 22]   # each run's C parked on its B
    assert [_first_seq(segment.parked) for segment in queue.queued] == [13, 23]
    core.on_control(pb.Envelope(cancel=pb.Cancel(call_ids=[100], lost_executor="e1@0", reason="lost")), [])
    failed = sorted(d.call_id for d in outbox.dones() if not d.ok)
    assert failed == [102, 103], failed                  # run 1's B and its parked C, each reported
    assert [_first_seq(segment) for segment in queue.queued] == [22] and _first_seq(queue.queued[0].parked) == 23
    assert _starts(core) == [("A", 10), ("A", 20)]


@pytest.mark.timeout(30)
def test_a_collective_does_not_start_while_earlier_work_waits_for_an_input():
    core, jobs = _collective_core()
    core.on_control(pb.Envelope(run=pb.Run(seq=1, call_id=1, function_id=1, inputs=[ref(9)], outputs=[ref(2)])), [])
    core.on_control(_collective_run(2, 2, 0, [ref(1)], [ref(3)]), [])   # in gang order, its input here
    assert jobs == []                             # before: the collective started, ahead of seq 1
    put(core, ref(9), V)
    assert [job.seq for job in jobs] == [1, 2]


@pytest.mark.timeout(30)
def test_a_group_formation_does_not_start_while_earlier_work_waits_for_an_input():
    core, jobs = _collective_core()
    core.on_control(pb.Envelope(run=pb.Run(seq=1, call_id=1, function_id=1, inputs=[ref(9)], outputs=[ref(2)])), [])
    core.on_control(pb.Envelope(form_group=pb.FormGroup(seq=2, group_id=1, rank=0, size=2)), [])
    assert jobs == []                             # its rendezvous would block the compute thread too
    put(core, ref(9), V)
    assert [job.seq for job in jobs] == [1, 2]


@pytest.mark.timeout(30)
def test_work_that_arrives_out_of_order_is_queued_in_sequence_order():
    # Delivered 5, 4, 3: seq 5 (a collective after seq 3 in gang order) waits for 3; seq 4 waits for an
    # input and, though it came after 5, is before it: once 3 has started, 5 still waits for 4.
    core, jobs = _collective_core()
    core.on_control(_collective_run(5, 5, 3, [ref(1)], [ref(5)]), [])
    core.on_control(pb.Envelope(run=pb.Run(seq=4, call_id=4, function_id=1, inputs=[ref(9)], outputs=[ref(4)])), [])
    core.on_control(_collective_run(3, 3, 0, [ref(1)], [ref(3)]), [])
    assert [job.seq for job in jobs] == [3]
    put(core, ref(9), V)
    assert [job.seq for job in jobs] == [3, 4, 5]


class _HeldCompiler:
    """Compiles at once but reports it only on `release` (a background compile still running)."""

    def __init__(self, backend):
        self.backend, self.held = backend, []

    def request(self, key, name, graph_module, example_inputs, on_done):
        self.held.append((on_done, self.backend.compile(graph_module, example_inputs)))

    def release(self):
        for on_done, compiled in self.held:
            on_done(compiled, None)
        self.held = []


@pytest.mark.timeout(30)
def test_independent_work_still_passes_a_call_waiting_for_its_compile_and_a_collective_does_not():
    jobs = []
    backend = EagerBackend()
    compiler = _HeldCompiler(backend)
    core = ExecutorCore(executor_id="e0", backend=backend, outbox=FakeOutbox(), submit=jobs.append,
                        compiler=compiler, collectives=FakeGroups(timeout_s=1.0))
    load(core, 1, lambda x: x * 2, V)             # still "compiling"
    slow = compiler.held[:]
    compiler.held = []
    load(core, 2, lambda x: x + 1, V)
    compiler.release()                            # function 2 is ready
    compiler.held = slow
    put(core, ref(1), V)
    core.on_control(pb.Envelope(run=pb.Run(seq=1, call_id=1, function_id=1, inputs=[ref(1)], outputs=[ref(2)])), [])
    core.on_control(pb.Envelope(run=pb.Run(seq=2, call_id=2, function_id=2, inputs=[ref(1)], outputs=[ref(3)])), [])
    core.on_control(pb.Envelope(form_group=pb.FormGroup(seq=3, group_id=1, rank=0, size=2)), [])
    assert [job.seq for job in jobs] == [2]       # seq 2 passed seq 1 (compiling); the formation did not
    compiler.release()
    assert [job.seq for job in jobs] == [2, 1, 3]


# ---------------------------------------------------------------- a 2-stage x 2-data pipeline, random orders

STAGE0, STAGE1 = ("e0", "e1"), ("e2", "e3")
NUM_RUNS = 2


def _f0(x, w):
    return x * w + 1


def _f1(h, w):
    return h * w, h + w


def _b1(y, a, w):
    return y * w, y * a


def _b0(g, x, w):
    return g * x + w


def _add(a, b):
    return a + b


def _norm(w):
    return all_reduce(w * w, axis="data")


def _reduce(g):
    return all_reduce(g, axis="data")


FUNCTIONS = {"F0": (_f0, 2), "F1": (_f1, 2), "B1": (_b1, 3), "B0": (_b0, 3), "ADD": (_add, 2),
             "NORM": (_norm, 1), "AR": (_reduce, 1)}

# Values: %0 w0, %1 x0, %2 x1 (stage 0); %3 w1 (stage 1). Node order is the island's order; each
# executor's list is the nodes on its stage, in that order:
#   stage 0: F0 F0 NORM B0 B0 ADD AR          stage 1: F1 B1 F1 AR(mb0) B1 AR ADD
# Stage-1 AR(mb0) (a gradient bucket reduced early) reads only local values, listed after F1(mb1),
# which waits for a copy: it is the later work that must not pass.
NODES = (
    ("F0", 0, (1, 0), (4,)),            # n0  h0 -> stage 1
    ("F0", 0, (2, 0), (5,)),            # n1  h1 -> stage 1
    ("NORM", 0, (0,), (6,)),            # n2  (output) a collective in the middle of stage 0
    ("F1", 1, (4, 3), (7, 8)),          # n3  y0 (output), a0
    ("B1", 1, (7, 8, 3), (9, 10)),      # n4  gh0 -> stage 0, g1_0
    ("F1", 1, (5, 3), (11, 12)),        # n5  y1 (output), a1
    ("AR", 1, (10,), (13,)),            # n6  g1_0 reduced (output): in the middle of stage 1
    ("B1", 1, (11, 12, 3), (14, 15)),   # n7  gh1 -> stage 0, g1_1
    ("B0", 0, (9, 1, 0), (16,)),        # n8  g0_0
    ("B0", 0, (14, 2, 0), (17,)),       # n9  g0_1
    ("AR", 1, (15,), (18,)),            # n10 g1_1 reduced
    ("ADD", 1, (13, 18), (19,)),        # n11 gw1 (output)
    ("ADD", 0, (16, 17), (20,)),        # n12
    ("AR", 0, (20,), (21,)),            # n13 gw0 (output)
)
OUTPUTS = (6, 7, 11, 13, 19, 21)


def _eager(inputs: dict[str, list]) -> dict[int, list]:
    """The oracle: the same functions in one process, per data rank; all_reduce sums over the pair."""
    values = {0: inputs["w0"], 1: inputs["x0"], 2: inputs["x1"], 3: inputs["w1"]}
    for name, _, ins, outs in NODES:
        args = [values[v] for v in ins]
        if name == "NORM":
            results = [(sum(w * w for w in args[0]),)] * 2
        elif name == "AR":
            results = [(sum(args[0]),)] * 2
        else:
            results = [FUNCTIONS[name][0](*(a[rank] for a in args)) for rank in range(2)]
            results = [r if isinstance(r, tuple) else (r,) for r in results]
        for index, value in enumerate(outs):
            values[value] = [results[rank][index] for rank in range(2)]
    return values


class _Network:
    """Executor-to-executor copies in flight, delivered by the test's driver."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pending: list = []   # (destination executor, envelope, frames)

    def send(self, address, envelope, payload):
        frames = [bytes(memoryview(p)) for p in payload]
        with self.lock:
            self.pending.append((address.removeprefix("inproc://"), envelope, frames))


class _Executor:
    """One ExecutorCore threaded as in ExecutorProcess (as `test_gang_scheduling.InProcessExecutor`),
    counting the work it has not finished: at 0 it does nothing until a message comes."""

    def __init__(self, executor_id, controller, runtime, network, program_order):
        self.controller, self.network = controller, network
        self.control: queue.Queue = queue.Queue()
        self.data: queue.Queue = queue.Queue()
        self.jobs: collections.deque = collections.deque()
        self.lock = threading.RLock()
        self._count_lock = threading.Lock()
        self.outstanding = 0           # messages posted and jobs submitted, not yet handled
        self.core = ExecutorCore(executor_id=executor_id, backend=EagerBackend(), outbox=self,
                                 submit=self._submit, collectives=runtime, program_order=program_order)
        self._compute = threading.Thread(target=self._compute_loop, daemon=True)
        self._io = threading.Thread(target=self._io_loop, daemon=True)
        self._compute.start()
        self._io.start()

    # the outbox
    def to_controller(self, envelope, payload=()):
        self.controller.on_message(self.core.executor_id, envelope, [])

    def to_peer(self, address, envelope, payload=(), public_key=b"", direct=False, tag=None):
        self.network.send(address, envelope, payload)

    def to_client(self, *args):
        pass

    def idle(self) -> bool:
        with self._count_lock:
            return self.outstanding == 0

    def _count(self, delta):
        with self._count_lock:
            self.outstanding += delta

    def post_control(self, fn):
        self._count(1)
        self.control.put(fn)

    def post_data(self, fn):
        self._count(1)
        self.data.put(fn)

    def close(self):
        self.control.put(False)
        self.data.put(False)

    def _submit(self, job):
        self._count(1)    # counted before the message or job that submits it is done: never a false 0
        self.jobs.append(job)
        if threading.current_thread() is not self._compute:
            self.control.put(None)

    def _handle(self, fn):
        with self.lock:
            fn()
        self._count(-1)

    def _io_loop(self):
        while (fn := self.data.get()) is not False:
            self._handle(fn)

    def _compute_loop(self):
        while True:
            while True:
                try:
                    fn = self.control.get_nowait()
                except queue.Empty:
                    break
                if fn is False:
                    return
                if fn is not None:
                    self._handle(fn)
            if not self.jobs:
                fn = self.control.get()
                if fn is False:
                    return
                if fn is not None:
                    self._handle(fn)
                continue
            job = self.jobs.popleft()
            self.core.compute(job)
            with self.lock:
                self.core.finish(job)
            self._count(-1)


class _ControllerOutbox:
    def __init__(self):
        self.by_executor = collections.defaultdict(list)

    def to_executor(self, executor_id, envelope, payload=()):
        self.by_executor[executor_id].append((envelope, list(payload)))


def _pipeline(seed: int, late: bool, program_order: bool = True, clients: int = 1):
    """Run the pipeline program NUM_RUNS times; every message delivered in an order drawn from ``seed``.

    The driver interleaves the four executors' control streams at random (each stream keeps the
    controller's order, as one connection does, except that group formations may come late) and
    delivers the copies between stages at random moments or, with ``late``, only to an executor that
    has all its control messages and nothing left to do (the latest a copy can come).
    """
    rng = random.Random(seed)
    outbox = _ControllerOutbox()
    # Every run is dispatched before any executor starts: the admission window must hold them all.
    controller = Controller(outbox, ControllerConfig(share_window_calls=1000))
    for executor_id in STAGE0 + STAGE1:
        controller.on_message(executor_id, pb.Envelope(register=pb.Register(
            executor_id=executor_id, data_address=f"inproc://{executor_id}")), [])
    if clients == 1:
        owners = [ClientOps(controller, None)]   # the embedded client's operations
    else:   # clients of a standalone controller: each its own functions, meshes and program; runs interleaved
        controller.admission.enabled = True
        names = [f"client{i}" for i in range(clients)]
        for i, name in enumerate(names):
            controller.admission.add_client(name, float(i + 1))
        owners = [ClientOps(controller, None, owner=name) for name in names]
    value_mesh = {0: 0, 1: 0, 2: 0, 3: 1}
    inputs = {"w0": [V + 1, V - 3], "x0": [V * 2, -V], "x1": [V / 2, V + 5], "w1": [V * 0.5, V - 1]}
    programs, all_records = [], []
    for owner in owners:
        meshes = [owner.handle(AllocateMesh({"data": 2}, list(STAGE0))),
                  owner.handle(AllocateMesh({"data": 2}, list(STAGE1)))]
        function_ids, axes = {}, {}
        with tracing_mesh({"data": 2}):
            for name, (fn, num_inputs) in FUNCTIONS.items():
                version = capture(fn, name, [InputSpec((2,), torch.float32)] * num_inputs, lambda t: (t, {}))
                function_ids[name] = owner.handle(RegisterFunction(name, version.graph, version.constants))
                axes[name] = version.collective_axes
        spec = ProgramSpec(
            name="pipeline", input_values=(0, 1, 2, 3), input_meshes=tuple(meshes[value_mesh[v]] for v in range(4)),
            output_values=OUTPUTS, nodes=tuple(
                CallSpec(name=name, function_id=function_ids[name], mesh=meshes[stage], inputs=ins, outputs=outs,
                         collective_axes=axes[name]) for name, stage, ins, outs in NODES))
        program_id = owner.handle(RegisterProgram(spec))
        programs.append(program_id)
        all_records.append([owner.handle(NewArray(meshes[value_mesh[v]].executor_ids, landing=0))[0]
                            for v in range(4)])
    lowered = controller.state.programs[programs[0]]
    runs = [owner.handle(RunProgram(program_id, [r.array_id for r in records]))
            for _ in range(NUM_RUNS) for owner, program_id, records in zip(owners, programs, all_records)]
    records = [r for records in all_records for r in records]
    inputs_of = [inputs[name] for _ in owners for name in inputs]

    runtime = FakeGroups(timeout_s=5.0)
    collective_ops.set_runtime(runtime)
    network = _Network()
    executors = {e: _Executor(e, controller, runtime, network, program_order) for e in STAGE0 + STAGE1}
    try:
        for record, shards in zip(records, inputs_of):
            for shard, executor_id in enumerate(record.executor_ids):
                msg = pb.Put(request_id=1)
                msg.shard.CopyFrom(pb.ShardRef(array_id=record.array_id, shard=shard))
                frame = bytes(memoryview(tensor_to_frame(shards[shard], msg.tensor, 1)))
                core = executors[executor_id].core
                executors[executor_id].post_data(
                    lambda core=core, msg=msg, frame=frame: core.on_data(b"client", pb.Envelope(put=msg), [frame], role="client"))
        streams = {}
        for executor_id, messages in outbox.by_executor.items():
            forms = [m for m in messages if m[0].WhichOneof("body") == "form_group"]
            rest = [m for m in messages if m[0].WhichOneof("body") != "form_group"]
            for form in forms:   # a group formation may come after later work (gang order holds it)
                rest.insert(rng.randint(0, len(rest)), form)
            streams[executor_id] = rest
        cursor = dict.fromkeys(streams, 0)
        pending = [r for rs in runs for r in rs]
        deadline = time.monotonic() + 20
        while not all(r.event.is_set() for r in pending) and time.monotonic() < deadline:
            choices = [("control", e) for e, stream in streams.items() if cursor[e] < len(stream)]
            with network.lock:
                for index, (destination, _, _) in enumerate(network.pending):
                    if not late or (cursor[destination] == len(streams[destination])
                                    and executors[destination].idle()):
                        choices.append(("copy", index))
            if not choices:
                time.sleep(0.0005)
                continue
            kind, what = rng.choice(choices)
            if kind == "control":
                envelope, payload = streams[what][cursor[what]]
                cursor[what] += 1
                core = executors[what].core
                executors[what].post_control(lambda core=core, e=envelope, p=payload: core.on_control(e, p))
            else:
                with network.lock:
                    destination, envelope, frames = network.pending.pop(what)
                core = executors[destination].core
                executors[destination].post_data(
                    lambda core=core, e=envelope, f=frames: core.on_data(b"peer", e, f, role="e1"))
            if not late and rng.random() < 0.3:
                time.sleep(rng.random() * 0.002)
        finished = all(r.event.wait(5) for r in pending)
        return finished, lowered, runs, outbox, executors, inputs
    finally:
        for executor in executors.values():
            executor.close()
        collective_ops.set_runtime(collective_ops._NoRuntime())


def _listed_order(lowered, executor_id) -> list[int]:
    return [a.run.node for a in lowered.plans[executor_id].actions if a.WhichOneof("kind") == "run"]


def _started_order(outbox, executors, executor_id) -> list[list[int]]:
    """Per run (in run order), the nodes of its "start" records on this executor, in the order they started."""
    bases = [env.run_program.base_seq for env, _ in outbox.by_executor[executor_id]
             if env.WhichOneof("body") == "run_program"]
    starts = _starts(executors[executor_id].core)
    return [[seq - base for _, seq in starts if base <= seq < base + len(NODES)] for base in bases]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed, clients", [(seed, 1) for seed in range(20)] + [(seed, 2) for seed in range(6)])
def test_a_pipeline_with_stage_copies_and_data_parallel_collectives_keeps_the_listed_order(seed, clients):
    """Also with two clients of a standalone controller whose programs' runs interleave on the same executors."""
    finished, lowered, runs, outbox, executors, inputs = _pipeline(seed, late=seed % 2 == 0, clients=clients)
    assert finished, "a deadlock: some run never finished"
    errors = [r.error for rs in runs for r in rs if r.error is not None]
    assert not errors, errors
    expected = _eager(inputs)
    for records in runs:
        for value, record in zip(OUTPUTS, records):
            for shard, executor_id in enumerate(record.executor_ids):
                entry = executors[executor_id].core.store.get((record.array_id, shard, 0))
                torch.testing.assert_close(entry.value, expected[value][shard])
    for executor_id in STAGE0 + STAGE1:
        listed = _listed_order(lowered, executor_id)
        assert _started_order(outbox, executors, executor_id) == [listed] * (NUM_RUNS * clients), executor_id


@pytest.mark.timeout(60)
def test_without_the_order_rules_the_latest_copies_break_the_listed_order():
    # Copies come only once their executor has nothing else to do: whatever it can start then (stage 1's
    # AR(mb0), or F1(mb1) whose copy came first) has started ahead of the listed order.
    finished, lowered, runs, outbox, executors, _ = _pipeline(0, late=True, program_order=False)
    broken = [e for e in STAGE1 if _started_order(outbox, executors, e)[0] != _listed_order(lowered, e)]
    assert broken == list(STAGE1)


# ---------------------------------------------------------------- the queue's passes

@pytest.mark.timeout(30)
def test_a_job_with_many_outputs_wakes_one_pass_over_the_queue_and_a_pass_looks_past_inputs_seen_ready():
    # Eight runs wait, each for one output of the job at seq 1 and for a value of its own (sent later). The job's
    # eight outputs used to wake a full pass over the queue each (a pipeline stage's fused job has 33: 33 passes over
    # every queued segment of the steps run ahead), and each pass looked every input up again.
    n = 8
    jobs = []   # run by hand, as the compute thread runs them: after the pass that started them
    core = ExecutorCore(executor_id="e0", backend=EagerBackend(), outbox=(outbox := FakeOutbox()), submit=jobs.append)

    def run_jobs():
        while jobs:
            core.finish(core.compute(jobs.pop(0)))

    load(core, 1, lambda x: tuple(x + i for i in range(n)), V, name="spread")
    load(core, 2, lambda a, b: a * b, V, V.clone(), name="mul")
    run(core, seq=1, call_id=1, function_id=1, inputs=[ref(9)], outputs=[ref(100 + i) for i in range(n)])
    for i in range(n):
        run(core, seq=2 + i, call_id=2 + i, function_id=2, inputs=[ref(100 + i), ref(200 + i)], outputs=[ref(300 + i)])
    queue_, store = core.run_queue, core.run_queue.store
    passes, lookups = [0], collections.Counter()
    pump_once, get = queue_._pump_once, store.get

    def counted_pass():
        passes[0] += 1
        return pump_once()

    def counted_get(key):
        lookups[key] += 1
        return get(key)

    queue_._pump_once, store.get = counted_pass, counted_get
    put(core, ref(9), V)                  # seq 1 runs; its outputs fill while all eight wait
    passes[0] = 0
    run_jobs()
    assert _starts(core) == [("spread", 1)]
    assert passes[0] == 1, f"expected one pass for one job's {n} outputs, counted {passes[0]}"
    for i in range(n - 1):                # seven more passes, each started by one run's second value
        put(core, ref(200 + i), V, request_id=10 + i)
        run_jobs()
    # (100, 0, 0) was seen ready at the first pass after seq 1 ended: looked up then and when its run started.
    assert lookups[(100, 0, 0)] <= 3, lookups[(100, 0, 0)]
    assert lookups[(100 + n - 1, 0, 0)] <= 2, lookups[(100 + n - 1, 0, 0)]   # behind a missing one: not again
    put(core, ref(200 + n - 1), V, request_id=99)
    run_jobs()
    assert [name for name, _ in _starts(core)] == ["spread"] + ["mul"] * n
    torch.testing.assert_close(fetch_tensor(core, outbox, ref(300 + 3)), (V + 3) * V)
