"""The seam's messages on the wire (`pathways_torch.wire.seam_codec`): every kind round-trips, and decoding builds
nothing it was not told to (no pickle, no lookup beyond its tables)."""

from __future__ import annotations

import json

import pytest

import pathways_torch as pw
from pathways_torch.wire import pb, seam_codec
from pathways_torch.wire.seam import ArraySettled, CallSpec, ExecutorView, MeshAllocation, ProgramSpec

pytestmark = pytest.mark.timeout(30)

MESH = MeshAllocation(mesh_id=3, axes=(("data", 2),), executor_ids=("executor-0", "executor-1"))


def _round_trip(message, **kwargs):
    frames = seam_codec.encode(message, **{k: v for k, v in kwargs.items() if k == "names"})
    return seam_codec.decode(frames, kwargs.get("interned"))


def test_every_seam_message_round_trips_equal():
    call = CallSpec(function_id=7, name="f", mesh=MESH, inputs=(1, 2), num_outputs=1, replicated_outputs=(True,),
                    collective_axes=("data",), output_positions=(0,))
    program = ProgramSpec(name="p", input_values=(1,), input_meshes=(MESH,), nodes=(call,), output_values=(2,))
    view = ExecutorView(executor_id="executor-0", index=0, pid=12, island="0", device="cpu", backend="eager",
                        lost=False, epoch=1, data_address="tcp://127.0.0.1:1", public_key=b"k" * 40)
    message = {"r": 4, "ok": [call, program, view, ArraySettled(5, "ready", None, (2, 3), ("executor-1",)),
                              {"axes": {"data": 2}, 3: (1.5, None, True)}, b"\x00\x01", b""]}
    assert _round_trip(message) == message


def test_protobuf_bodies_and_constants_travel_as_frames():
    graph = pb.Envelope(epoch=3)
    frames = seam_codec.encode({"a": [graph, memoryview(b"abcd")]})
    assert len(frames) == 3 and bytes(frames[2]) == b"abcd"
    decoded = seam_codec.decode(frames)
    assert decoded["a"][0] == graph and decoded["a"][1] == b"abcd"


def test_errors_keep_their_type_and_attributes_and_unknown_types_become_a_family():
    lost = pw.ExecutorLostError("gone", executor_id="executor-3")
    back = _round_trip(lost)
    assert type(back) is pw.ExecutorLostError and back.executor_id == "executor-3" and str(back) == "gone"

    class Strange(KeyError):
        pass

    converted = _round_trip(Strange("x"))
    assert type(converted) is KeyError and "Strange" in str(converted)
    assert type(_round_trip(ZeroDivisionError("y"))) is pw.PathwaysError


def test_one_error_reaching_many_arrays_stays_one_object():
    names, interned = seam_codec.ErrorNames(), seam_codec.Interned()
    error = pw.RemoteError("boom", function="f", executor_id="executor-1")
    first = seam_codec.decode(seam_codec.encode(error, names), interned)
    second = seam_codec.decode(seam_codec.encode(error, names), interned)
    other = seam_codec.decode(seam_codec.encode(pw.RemoteError("boom"), names), interned)
    assert first is second and first is not other
    # built-in errors cannot be held weakly: they are not interned, and still decode
    assert str(seam_codec.decode(seam_codec.encode(ValueError("v"), names), interned)) == "v"


@pytest.mark.parametrize("tree, says", [
    ({"$c": "Popen", "f": {}}, "names type 'Popen'"),
    ({"$pb": "os", "b": 0}, "not one of pathways.proto"),
    ({"$e": "SystemExit", "a": []}, "names error 'SystemExit'"),
    ({"$b": 5}, "refers to frame 5"),
    ({"$c": "MeshAllocation", "f": {"nope": 1}}, "MeshAllocation with fields"),
    ({"x": 1}, "expected $t, $d, $b, $c, $pb or $e"),
])
def test_decoding_builds_only_what_its_tables_name(tree, says):
    with pytest.raises(seam_codec.SeamCodecError, match=says.replace("$", r"\$")):
        seam_codec.decode([json.dumps(tree).encode()])


def test_a_deep_or_unencodable_message_is_refused_with_what_is_allowed():
    deep: list = []
    for _ in range(seam_codec.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(seam_codec.SeamCodecError, match="nested deeper"):
        seam_codec.decode([json.dumps(deep).encode()])
    with pytest.raises(seam_codec.SeamCodecError, match="cannot send a object"):
        seam_codec.encode(object())
    with pytest.raises(seam_codec.SeamCodecError, match="not JSON"):
        seam_codec.decode([b"\x80pickle"])
