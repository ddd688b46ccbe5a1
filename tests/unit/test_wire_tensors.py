"""Raw tensor frames (wire/tensors.py) and multipart framing (wire/framing.py)."""

import pytest
import torch

from pathways_torch.wire import framing, pb
from pathways_torch.wire.framing import FramingError, body_name
from pathways_torch.wire.tensors import (
    WireTensorError, dtype_from_name, dtype_name, frame_to_tensor, tensor_to_frame,
)

pytestmark = pytest.mark.timeout(60)


def round_trip(tensor, *, as_bytes=True):
    meta = pb.TensorMeta()
    frame = tensor_to_frame(tensor, meta, 1)
    meta = pb.TensorMeta.FromString(meta.SerializeToString())
    frames = [bytes(memoryview(frame))] if as_bytes else [frame]
    return frame_to_tensor(meta, frames), meta


@pytest.mark.parametrize("tensor", [
    torch.tensor([[1.5, -2.0, 3.25], [0.0, 1e-30, -7.0]], dtype=torch.float32),
    torch.tensor([1.0 / 3.0, -1e300, 2.0], dtype=torch.float64),
    torch.tensor([-(2 ** 62), 0, 2 ** 62 + 1], dtype=torch.int64),
    torch.tensor([1.0, -2.5, 3.0e10, 0.0078125], dtype=torch.bfloat16),
    torch.tensor([True, False, True, True]),
    torch.tensor([1, 2, 255], dtype=torch.uint8),
    torch.tensor([1.0, 2.0], dtype=torch.float16),
], ids=["float32", "float64", "int64", "bfloat16", "bool", "uint8", "float16"])
@pytest.mark.parametrize("as_bytes", [True, False], ids=["bytes", "memoryview"])
def test_round_trip_dtypes(tensor, as_bytes):
    back, meta = round_trip(tensor, as_bytes=as_bytes)
    assert meta.dtype == dtype_name(tensor.dtype)
    assert list(meta.shape) == list(tensor.shape)
    assert meta.frame == 1
    assert back.dtype == tensor.dtype
    assert back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_round_trip_zero_d():
    back, meta = round_trip(torch.tensor(3.5, dtype=torch.float64))
    assert list(meta.shape) == []
    assert back.shape == () and back.item() == 3.5


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2)])
def test_round_trip_empty(shape):
    tensor = torch.empty(shape, dtype=torch.float32)
    meta = pb.TensorMeta()
    frame = tensor_to_frame(tensor, meta, 1)
    assert memoryview(frame).nbytes == 0
    back = frame_to_tensor(meta, [bytes(memoryview(frame))])
    assert back.shape == shape and back.dtype == torch.float32


def test_round_trip_non_contiguous():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = base.t()
    assert not view.is_contiguous()
    back, meta = round_trip(view)
    assert list(meta.shape) == [4, 3]
    assert torch.equal(back, view)


def test_frame_index_is_recorded_and_used():
    a, b = torch.tensor([1, 2], dtype=torch.int64), torch.tensor([3.0, 4.0, 5.0])
    meta_a, meta_b = pb.TensorMeta(), pb.TensorMeta()
    frames = [bytes(memoryview(tensor_to_frame(a, meta_a, 1))), bytes(memoryview(tensor_to_frame(b, meta_b, 2)))]
    assert meta_b.frame == 2
    assert torch.equal(frame_to_tensor(meta_b, frames), b)
    assert torch.equal(frame_to_tensor(meta_a, frames), a)


def test_frame_size_mismatch():
    meta = pb.TensorMeta(dtype="float32", shape=[2, 3], frame=1)
    with pytest.raises(WireTensorError) as info:
        frame_to_tensor(meta, [b"\0" * 20])
    assert "needs 24 bytes" in str(info.value) and "frame has 20" in str(info.value)


def test_shape_claims_bytes_for_empty_frame():
    meta = pb.TensorMeta(dtype="int64", shape=[1], frame=1)
    with pytest.raises(WireTensorError, match="needs 8 bytes"):
        frame_to_tensor(meta, [b""])


def test_unknown_dtype_name():
    meta = pb.TensorMeta(dtype="os", shape=[1], frame=1)
    with pytest.raises(WireTensorError, match="'os'"):
        frame_to_tensor(meta, [b"\0" * 4])
    for bad in ("os", "float32; import os", "Tensor", "", "__class__"):
        with pytest.raises(WireTensorError):
            dtype_from_name(bad)
    assert dtype_from_name("bfloat16") is torch.bfloat16


@pytest.mark.parametrize("index", [0, 2, 5])
def test_frame_index_out_of_range(index):
    meta = pb.TensorMeta(dtype="float32", shape=[1], frame=index)
    with pytest.raises(WireTensorError) as info:
        frame_to_tensor(meta, [b"\0" * 4])
    assert f"names frame {index}" in str(info.value)


def test_huge_shape_refused_before_allocation():
    meta = pb.TensorMeta(dtype="float32", shape=[1 << 30, 1 << 30], frame=1)
    with pytest.raises(WireTensorError, match="exceeds"):
        frame_to_tensor(meta, [b""])


def test_negative_shape_refused():
    meta = pb.TensorMeta(dtype="float32", shape=[-1], frame=1)
    with pytest.raises(WireTensorError, match="negative"):
        frame_to_tensor(meta, [b""])


# ---------------------------------------------------------------- framing

def test_framing_round_trip():
    meta = pb.TensorMeta()
    frame = tensor_to_frame(torch.tensor([1.0, 2.0]), meta, 1)
    put = pb.Put(request_id=9, tensor=meta)
    put.shard.array_id = 4
    frames = framing.encode(pb.Envelope(put=put), [frame])
    assert isinstance(frames[0], bytes) and len(frames) == 2
    envelope, payload = framing.decode([frames[0], bytes(memoryview(frames[1]))])
    assert body_name(envelope) == "put"
    assert envelope.put.request_id == 9 and envelope.put.shard.array_id == 4
    assert frame_to_tensor(envelope.put.tensor, payload).tolist() == [1.0, 2.0]


@pytest.mark.parametrize("junk", [b"\xff\xff\xff\xff", b"\x0a\x05abc", b"\x08"])
def test_framing_decode_junk_raises(junk):
    with pytest.raises(FramingError):
        framing.decode([junk])


def test_framing_decode_no_frames():
    with pytest.raises(FramingError, match="at least one frame"):
        framing.decode([])


def test_framing_decode_empty_envelope():
    # Zero bytes parse as an Envelope with no body: refused as carrying no message.
    with pytest.raises(FramingError, match="no known message type"):
        framing.decode([b""])


def test_framing_decode_unknown_field_only():
    # A valid protobuf with only an unknown field number: parses, but has no body.
    with pytest.raises(FramingError, match="no known message type"):
        framing.decode([b"\xf8\x3e\x01"])  # field 999, varint 1


def test_framing_decode_oversized_envelope(monkeypatch):
    monkeypatch.setattr(framing, "MAX_ENVELOPE_BYTES", 4)
    with pytest.raises(FramingError, match="exceeds 4"):
        framing.decode([pb.Envelope(heartbeat=pb.Heartbeat(sent_at=1.0)).SerializeToString()])


def test_body_name_empty_envelope():
    assert body_name(pb.Envelope()) == ""
    assert body_name(pb.Envelope(free=pb.Free())) == "free"
