"""The controller believes a report on a lost transfer only from that copy's sender or receiver
(controller/transfer_reports.py): by the call's routes, or by its program's plan."""

from __future__ import annotations

import pytest

from controller import CallSpec
from pathways_torch.wire import pb
from tests.unit.test_incarnations import _missing, _two_island_program, setup  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(60)


def _plain_call_with_a_copy(controller, outbox, function_id):
    """A call on e1 reading an array on e0: e0 pushes it a copy."""
    a, b = (controller.resources.allocate({"data": 1}, [e]) for e in ("e0", "e1"))
    x = controller.lifetimes.new_array(a.executor_ids)
    [out] = controller.call_dispatch.call(CallSpec(function_id=function_id, name="f", mesh=b, inputs=(x.array_id,),
                                                   num_outputs=1))
    ((_, send),) = outbox.of("send_shard")
    return out, send.send_shard


def _failed_copy(copy, sender):
    return pb.Transfer(failed=True, shard=copy, failure=pb.RemoteFailure(type="TransferLost", executor_id=sender,
                                                                          origin_call_id=copy.tag))


def test_a_report_on_a_plain_calls_copy_from_an_executor_on_no_route_of_it_changes_nothing(setup):  # noqa: F811
    controller, outbox, function_id = setup
    out, send = _plain_call_with_a_copy(controller, outbox, function_id)
    lost = pb.TransferLost(to_address=send.to_address, waited_s=21, nbytes=24)
    lost.shard.CopyFrom(send.as_ref)
    controller.on_message("e2", pb.Envelope(transfer_lost=lost), [])            # e2 sent no such copy
    # e2 says e1 lacked it; e1 names a sender that sent it nothing; e0 (the sender) speaks for the receiver.
    controller.on_message("e2", pb.Envelope(transfer_lost=_missing(_failed_copy(send.as_ref, "e0"))), [])
    controller.on_message("e1", pb.Envelope(transfer_lost=_missing(_failed_copy(send.as_ref, "e2"))), [])
    controller.on_message("e0", pb.Envelope(transfer_lost=_missing(_failed_copy(send.as_ref, "e0"))), [])
    assert outbox.of("transfer") == [] and out.state == "pending"
    assert all(controller.members.heard_from(e, 1)[1] == [] for e in ("e0", "e1", "e2"))   # no group abandoned
    assert (controller.completion.transfers_lost, controller.completion.calls_failed_by_lost_transfers) == (0, 0)
    assert controller.completion.refused_reports == controller.dropped_messages == 4
    # The ends themselves are believed.
    controller.on_message("e0", pb.Envelope(transfer_lost=lost), [])
    ((to, failed),) = outbox.of("transfer")
    assert to == "e1"
    controller.on_message("e1", pb.Envelope(transfer_lost=_missing(failed.transfer)), [])
    assert out.state == "failed" and out.error.remote_type == "TransferLost"
    assert (controller.completion.transfers_lost, controller.completion.calls_failed_by_lost_transfers) == (1, 1)


def test_a_report_on_a_program_runs_copy_is_believed_only_from_the_ends_its_plan_names():
    controller, outbox, lowered, out = _two_island_program()
    # e0 pushes its shard of the first node's output to e2, e1 to e3 (across the islands).
    copy = pb.ShardRef(array_id=99, shard=0, tag=out.producer_call)
    for reporter, sender in (("e3", "e0"), ("e2", "e1"), ("e0", "e0")):
        controller.on_message(reporter, pb.Envelope(transfer_lost=_missing(_failed_copy(copy, sender))), [])
    assert out.state == "pending"
    assert controller.members.heard_from("e0", 1)[1] == controller.members.heard_from("e2", 1)[1] == []
    assert controller.groups.by_members and controller.completion.refused_reports == 3
    controller.on_message("e2", pb.Envelope(transfer_lost=_missing(_failed_copy(copy, "e0"))), [])
    assert out.state == "failed" and controller.members.heard_from("e0", 1)[1] == ["transfer:99.0:e0->e2<3"]
