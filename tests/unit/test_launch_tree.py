"""Launch trees, without sockets: the tree's shape as text, the merge of an executor's two command orders, and its
Dones batched on the way up (controller/launch_tree.py, executor/launch_tree.py)."""

from __future__ import annotations

import pytest

from controller.launch_tree import build_tree
from executor.launch_tree import TreeIntake
from pathways_torch.wire import pb

pytestmark = pytest.mark.timeout(30)


def test_a_tree_of_ten_with_fanout_three_reads_as_contiguous_subtrees():
    tree = build_tree("0", 1, [f"e{i}" for i in range(10)], 3)
    assert tree.describe() == "\n".join([
        "launch tree of island 0, generation 1: 10 executors, 3 sent to by the controller",
        "  e0 [0, 4) -> 3 children", "    e1 [1, 2)", "    e2 [2, 3)", "    e3 [3, 4)",
        "  e4 [4, 7) -> 2 children", "    e5 [5, 6)", "    e6 [6, 7)",
        "  e7 [7, 10) -> 2 children", "    e8 [8, 9)", "    e9 [9, 10)"])


@pytest.mark.parametrize("n, fanout", [(1024, 32), (1000, 7), (5, 2), (1, 4)])
def test_every_executor_has_one_parent_and_no_one_more_than_fanout_children(n, fanout):
    tree = build_tree("0", 1, [f"e{i}" for i in range(n)], fanout)
    assert len(tree.roots) == min(n, fanout)
    for position in range(n):
        children = tree.children(position)
        assert len(children) <= fanout
        covered = sum(tree.ends[c] - c for c in children)   # the children's subtrees are its own, less itself
        assert covered == tree.ends[position] - position - 1
    assert sum(tree.ends[r] - r for r in tree.roots) == n


def test_a_fanout_below_two_is_refused_with_what_was_expected():
    with pytest.raises(ValueError, match="expected 2 or more children per executor, got 1"):
        build_tree("0", 1, ["a", "b"], 1)


# ------------------------------------------------------------ an executor's intake


class _Outbox:
    def __init__(self):
        self.to_parent, self.up = [], []   # (address, envelope) to peers; envelopes to the controller

    def to_controller(self, envelope, payload=()):
        self.up.append(envelope)

    def to_peer(self, address, envelope, payload=(), public_key=b"", direct=False, tag=None):
        self.to_parent.append((address, envelope))


def _plan(program_id=7, reports=(1,)):
    plan = pb.RegisterProgram(program_id=program_id, num_nodes=2)
    for node in range(2):
        plan.actions.add().run.CopyFrom(pb.ProgramNode(node=node, report=node in reports))
    return plan


def _intake(parent="p", children=("c1",)):
    handled, outbox = [], _Outbox()
    programs = {7: (_plan(), [], [])}
    freed = []

    def handle(envelope, payload):   # as the core's handlers do
        handled.append(envelope)
        if envelope.HasField("launch_tree"):
            intake.tree = envelope.launch_tree

    intake = TreeIntake(executor_id="me", outbox=outbox, handle=handle, programs=programs,
                        free_array=freed.append, drop=lambda why: handled.append(why))
    tree = pb.LaunchTree(generation=1, parent=parent, parent_address="tcp://p" if parent else "", position=1,
                         end=1 + 1 + len(children))
    for i, child in enumerate(children):
        tree.children.add(executor_id=child, data_address=f"tcp://{child}", position=2 + i, end=3 + i)
    return intake, handled, outbox, freed, tree


def _command(index, launches_before, **body):
    return pb.Envelope(command_index=index, launches_before=launches_before, **body)


def _launch(commands_before, base_call=100, generation=1, frees=()):
    launch = pb.TreeLaunch(generation=generation, position=1, prev_collective_seqs=[5, 6],
                           commands_before=[commands_before, 0], free_array_ids=list(frees))
    launch.run.CopyFrom(pb.RunProgram(program_id=7, base_call_id=base_call, base_seq=base_call))
    return launch


def _kinds(handled):
    return [h.WhichOneof("body") if isinstance(h, pb.Envelope) else "drop" for h in handled]


def test_a_launch_that_overtakes_the_commands_before_it_waits_for_them_and_the_next_command_for_it():
    intake, handled, outbox, freed, tree = _intake()
    intake.on_command(_command(1, 0, launch_tree=tree), [])
    intake.on_launch(_launch(commands_before=2), "p")             # came before command 2 (a RegisterProgram)
    assert _kinds(handled) == ["launch_tree"]
    intake.on_command(_command(2, 0, register_program=_plan()), [])
    assert _kinds(handled) == ["launch_tree", "register_program", "run_program"]
    run = handled[2].run_program
    assert run.prev_collective_seq == 5 and run.base_call_id == 100   # its own entry of the table
    forwarded = outbox.to_parent[0]
    assert forwarded[0] == "tcp://c1"
    assert list(forwarded[1].tree_launch.prev_collective_seqs) == [6]   # the child's part, by position
    intake.on_command(_command(3, 2, free=pb.Free()), [])         # sent after a second launch, not come yet
    assert _kinds(handled)[-1] == "run_program"
    intake.on_launch(_launch(commands_before=2, base_call=200), "p")
    assert _kinds(handled)[3:] == ["run_program", "free"]
    assert intake.launches == 2 and intake.last_command == 3


def test_launches_of_a_new_tree_that_come_before_the_old_trees_wait_in_the_controllers_order():
    intake, handled, outbox, freed, tree = _intake(children=())
    intake.on_command(_command(1, 0, launch_tree=tree), [])
    newer = pb.LaunchTree()
    newer.CopyFrom(tree)
    newer.generation, newer.parent = 2, "q"
    second = _launch(commands_before=2, base_call=200, generation=2)
    intake.on_launch(second, "q")                                 # the new parent was faster
    intake.on_command(_command(2, 1, launch_tree=newer), [])      # waits for the first launch
    assert _kinds(handled) == ["launch_tree"]
    intake.on_launch(_launch(commands_before=1), "p")
    assert _kinds(handled)[1:] == ["run_program", "launch_tree", "run_program"]
    assert [h.run_program.base_call_id for h in handled if isinstance(h, pb.Envelope)
            and h.HasField("run_program")] == [100, 200]


def test_a_cancel_that_ends_the_tree_frees_the_commands_waiting_for_launches_that_will_never_come():
    intake, handled, outbox, freed, tree = _intake()
    intake.on_command(_command(1, 0, launch_tree=tree), [])
    intake.on_command(_command(2, 3, run=pb.Run(call_id=9)), [])   # after three launches the parent never sent
    assert _kinds(handled) == ["launch_tree"]
    intake.on_command(pb.Envelope(launches_before=3, cancel=pb.Cancel(call_ids=[100])), [])
    assert _kinds(handled) == ["launch_tree", "cancel", "run"]
    intake.on_launch(_launch(commands_before=1), "p")               # late, of the ended tree: dropped
    assert _kinds(handled) == ["launch_tree", "cancel", "run"]


def test_a_launch_from_anyone_but_the_parent_is_refused_and_runs_nothing():
    intake, handled, outbox, freed, tree = _intake()
    intake.on_command(_command(1, 0, launch_tree=tree), [])
    intake.on_launch(_launch(commands_before=1), "mallory")
    assert _kinds(handled) == ["launch_tree", "drop"]
    assert "expected it from p" in handled[1]
    assert not outbox.to_parent


def test_dones_go_up_in_one_batch_once_the_subtree_is_in_and_a_failure_goes_straight_up():
    intake, handled, outbox, freed, tree = _intake()
    intake.on_command(_command(1, 0, launch_tree=tree), [])
    intake.on_launch(_launch(commands_before=1, frees=(41, 42)), "p")
    assert freed == [41, 42]
    intake.outbox.to_controller(pb.Envelope(done=pb.Done(call_id=101, ok=True, device_ns=3)))
    assert outbox.up == [] and len(outbox.to_parent) == 1          # only the launch to the child so far
    child = pb.DoneBatch(generation=1, base_call_id=100)
    child.groups.add(call_id=101, executor_ids=["c1"], device_ns=5)
    child.dones.add(call_id=101, ok=True, executor_id="c1-child", digests=[b"d"])   # more than success: kept whole
    intake.on_done_batch(child, "c1")
    address, envelope = outbox.to_parent[1]
    assert address == "tcp://p"
    batch = envelope.done_batch
    # Plain successes join one group per call (its device time summed); a Done with more to say goes up whole.
    assert [(g.call_id, list(g.executor_ids), g.device_ns) for g in batch.groups] == [(101, ["me", "c1"], 8)]
    assert [(d.executor_id, d.call_id, list(d.digests)) for d in batch.dones] == [("c1-child", 101, [b"d"])]
    # The next run: a failed step's Done is not held behind the subtree.
    intake.on_launch(_launch(commands_before=1, base_call=200), "p")
    intake.outbox.to_controller(pb.Envelope(done=pb.Done(call_id=201, ok=False)))
    assert [e.done.call_id for e in outbox.up] == [201]
    intake.on_done_batch(child, "stranger")
    assert "does not wait for" in handled[-1]


def test_a_cancel_that_ends_the_tree_skips_the_gang_places_of_runs_that_never_came_before_it_is_handled():
    skipped, order = [], []
    intake = TreeIntake(executor_id="me", outbox=_Outbox(), handle=lambda e, p: order.append(e.WhichOneof("body")),
                        programs={}, free_array=lambda a: None, drop=lambda why: None,
                        skip_gang=lambda prev, last: (skipped.append((prev, last)), order.append("skip")))
    cancel = pb.Cancel(call_ids=[100], skip_collectives=[3, 9, 9, 17])
    intake.on_command(pb.Envelope(launches_before=2, cancel=cancel), [])
    assert skipped == [(3, 9), (9, 17)] and order == ["skip", "skip", "cancel"]
    assert intake.launches == 2


# ------------------------------------------------------------ the controller's side of the batches


class _Sent:
    def __init__(self):
        self.envelopes = []

    def to_executor(self, executor_id, envelope, payload=()):
        self.envelopes.append((executor_id, envelope))


def _controller_running_a_tree(size=8):
    """A controller of ``size`` executors that has launched one run of a 2-node program down a tree of fanout 2."""
    from bench.scale import chain_on_controller, controller_with_executors
    from controller import ControllerConfig

    controller = controller_with_executors(_Sent(), ControllerConfig(launch_fanout=2, launch_tree_min_executors=4),
                                           size)
    lowered, x = chain_on_controller(controller, 2)
    (out,) = controller.call_dispatch.run_program(lowered.program_id, [x.array_id])
    tree = next(iter(controller.launch_trees._trees.values()))
    return controller, tree, max(controller.state.calls), out


def _group_batch(tree, call_id, executor_ids):
    batch = pb.DoneBatch(generation=tree.generation, base_call_id=call_id - 1)
    batch.groups.add(call_id=call_id, executor_ids=executor_ids, device_ns=10)
    return pb.Envelope(done_batch=batch)


def test_a_run_down_a_tree_ends_when_each_root_has_reported_its_subtree_as_one_group():
    controller, tree, call_id, out = _controller_running_a_tree()
    assert tree.roots == (0, 4)
    controller.on_message(tree.members[0], _group_batch(tree, call_id, tree.members[0:4]), [])
    assert call_id in controller.state.calls and out.state != "ready"
    controller.on_message(tree.members[4], _group_batch(tree, call_id, tree.members[4:8]), [])
    assert call_id not in controller.state.calls and controller.arrays.get(out.array_id).state == "ready"
    assert controller.dropped_messages == 0


def test_a_group_naming_an_executor_outside_the_senders_subtree_is_dropped_whole():
    controller, tree, call_id, _ = _controller_running_a_tree()
    controller.on_message(tree.members[0], _group_batch(tree, call_id, [*tree.members[0:4], tree.members[5]]), [])
    assert controller.dropped_messages == 1
    assert controller.state.calls[call_id].waiting == set(tree.members)   # not one of them counted
