"""Tensors as raw frames with a dtype/shape header (`TensorMeta`).

Sending shares the tensor's memory with ZeroMQ (``copy=False``); receiving wraps
the frame's buffer without a copy. Received tensors are read-only views of the
message: the runtime never mutates a stored buffer in place (every computation
is functional), so the zero-copy view is safe.
"""

from __future__ import annotations

import warnings
from typing import Any

from . import pathways_pb2 as pb

__all__ = ["tensor_to_frame", "frame_to_tensor", "frame_buffer", "dtype_name", "dtype_from_name", "WireTensorError"]

# Upper bound on one tensor's element count, to refuse absurd headers before allocating.
_MAX_ELEMENTS = 1 << 40


class WireTensorError(ValueError):
    """A tensor header that does not match its frame, or names an unknown dtype."""


_DTYPE_NAMES: dict = {}   # dtype → its name: str() of a numpy dtype costs about 5 µs, and inputs are checked per run


def dtype_name(dtype) -> str:
    """``torch.float32`` (or numpy's, jax's ``float32``) → ``"float32"``."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        if len(_DTYPE_NAMES) < 256:
            _DTYPE_NAMES[dtype] = name
    return name


def dtype_from_name(name: str):
    """``"float32"`` → ``torch.float32``; refuses anything that is not a dtype."""
    import torch

    value = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(value, torch.dtype):
        raise WireTensorError(f"expected a torch dtype name like 'float32', got {name!r}")
    return value


def tensor_to_frame(tensor, meta: pb.TensorMeta, frame_index: int) -> Any:
    """Fill ``meta`` for ``tensor``; return a buffer ZeroMQ can send without copying."""
    import torch

    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    meta.dtype = dtype_name(tensor.dtype)
    meta.shape[:] = list(tensor.shape)
    meta.frame = frame_index
    # A uint8 view reaches numpy for every dtype (bfloat16 has no numpy twin).
    flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
    return memoryview(flat.numpy())


def frame_buffer(meta: pb.TensorMeta, frames: list, itemsize: int) -> tuple[memoryview, list[int]]:
    """The buffer of the frame named by ``meta`` and its shape, once the header is checked against it (elements
    of ``itemsize`` bytes): the frame exists, no dimension is negative or absurd, the bytes are exactly enough."""
    if meta.frame < 1 or meta.frame > len(frames):
        raise WireTensorError(f"tensor header names frame {meta.frame}, message has frames 1..{len(frames)}")
    shape = list(meta.shape)
    if any(d < 0 for d in shape):
        raise WireTensorError(f"negative dimension in shape {shape}")
    numel = 1
    for d in shape:
        numel *= d
        if numel > _MAX_ELEMENTS:
            raise WireTensorError(f"shape {shape} exceeds {_MAX_ELEMENTS} elements")
    frame = frames[meta.frame - 1]
    buffer = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    expected = numel * itemsize
    if buffer.nbytes != expected:
        raise WireTensorError(
            f"tensor {meta.dtype}{shape} needs {expected} bytes, frame has {buffer.nbytes}")
    return buffer, shape


def frame_to_tensor(meta: pb.TensorMeta, frames: list):
    """Wrap the frame named by ``meta`` as a tensor (no copy); validate the header first."""
    import torch

    dtype = dtype_from_name(meta.dtype)
    buffer, shape = frame_buffer(meta, frames, dtype.itemsize)
    numel = buffer.nbytes // dtype.itemsize
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # ZeroMQ frames are read-only; see the module docstring for why that is safe.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(buffer, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
