"""A program is lowered holding no lock of the controller's (controller/lowering.py; issue 46, point 6): while a
client's program is being lowered (seconds, for a large one), another client's call on the same island is
dispatched; an executor replaced meanwhile gets a plan for its new address all the same. Fake outbox, no
processes; the lowering is held on an event to make "meanwhile" certain."""

from __future__ import annotations

import threading

import pytest

import controller.lowering as lowering
from controller import CallSpec, Controller
from controller.program import ProgramSpec
from pathways_torch.wire import pb

pytestmark = pytest.mark.timeout(30)


class _Outbox:
    def __init__(self):
        self.sent: list[tuple[str, pb.Envelope]] = []

    def to_executor(self, executor_id, envelope, payload=()):
        self.sent.append((executor_id, envelope))

    def of(self, kind):
        return [(e, env) for e, env in self.sent if env.WhichOneof("body") == kind]


def _register(controller, executor_id: str, port: int) -> None:
    controller.on_message(executor_id, pb.Envelope(register=pb.Register(
        executor_id=executor_id, data_address=f"tcp://127.0.0.1:{port}", backend="eager")), [])


@pytest.fixture
def held_lowering(monkeypatch):
    """``lower`` waits for ``release`` once it has started (``started``)."""
    started, release = threading.Event(), threading.Event()
    real = lowering.lower

    def slow_lower(*args, **kwargs):
        started.set()
        assert release.wait(10), "the test never released the lowering"
        return real(*args, **kwargs)

    monkeypatch.setattr(lowering, "lower", slow_lower)
    return started, release


def _setup():
    outbox = _Outbox()
    controller = Controller(outbox)
    for i in range(2):
        _register(controller, f"e{i}", 7000 + i)
    function_id = controller.call_dispatch.register_function("f", pb.Graph(), [])
    on_e0, on_e1 = (controller.resources.allocate({"data": 1}, [e]) for e in ("e0", "e1"))
    spec = ProgramSpec(name="p", input_values=(0,), input_meshes=(on_e0,), output_values=(2,), nodes=(
        CallSpec(name="here", function_id=function_id, mesh=on_e0, inputs=(0,), outputs=(1,)),
        CallSpec(name="there", function_id=function_id, mesh=on_e1, inputs=(1,), outputs=(2,))))
    return controller, outbox, function_id, spec


def _in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def test_another_call_is_dispatched_while_a_program_is_lowered(held_lowering):
    started, release = held_lowering
    controller, outbox, function_id, spec = _setup()
    registering, lowered = _in_thread(lambda: controller.call_dispatch.register_program(spec))
    assert started.wait(10)
    mesh = controller.resources.allocate({"data": 2}, ["e0", "e1"])
    g = CallSpec(function_id=function_id, name="g", mesh=mesh, inputs=(), num_outputs=1)
    calling, records = _in_thread(lambda: controller.call_dispatch.call(g, "bob"))
    calling.join(5)
    assert not calling.is_alive() and records[0][0].state == "pending", "the call waited for the lowering's lock"
    assert len(outbox.of("run")) == 2 and not outbox.of("register_program")
    release.set()
    registering.join(10)
    assert len(outbox.of("register_program")) == 2
    _run(controller, outbox, lowered[0])


def test_an_executor_replaced_while_the_program_is_lowered_gets_a_plan_for_its_new_address(held_lowering):
    started, release = held_lowering
    controller, outbox, _, spec = _setup()
    registering, lowered = _in_thread(lambda: controller.call_dispatch.register_program(spec))
    assert started.wait(10)
    controller.members.declare_lost("e1", "killed")
    _register(controller, "e1", 7011)                     # a new incarnation at a new address
    release.set()
    registering.join(10)
    assert controller.call_dispatch.installer.lowered_again_under_lock == 1
    (plan,) = [env.register_program for e, env in outbox.of("register_program") if e == "e0"]
    (send,) = [a.send for a in plan.actions if a.WhichOneof("kind") == "send"]
    assert send.to_address == "tcp://127.0.0.1:7011"
    _run(controller, outbox, lowered[0])


def _run(controller, outbox, lowered) -> None:
    """The installed program runs: one RunProgram to each of its executors."""
    controller.call_dispatch.run_program(lowered.program_id, [controller.lifetimes.new_array(("e0",)).array_id])
    assert sorted(e for e, _ in outbox.of("run_program")) == ["e0", "e1"]
