"""Counter-based dropout: random masks that are a pure function of (seed, step, shard, call site).

(Pipeline steps key by the sample's global row instead of the shard: `sample_keyed_rng`.)

A captured step cannot use the executor's global generator: its state would
differ between XLA and eager, could not be checkpointed from the client, and
would make a resumed run diverge. Like JAX's keyed PRNG, the mask here is a hash
of an integer counter — the trainer's seed, the step number, the shard's rank
on the data axis, the dropout call's position in the step, and the element
index — computed with int64 tensor ops that every backend evaluates exactly. A
run stopped at step k and resumed from a checkpoint draws the same masks.

`counter_rng` is a ``TorchFunctionMode`` active while the step is traced: it
replaces ``F.dropout`` and refuses every other random function by name.
"""

from __future__ import annotations

import contextlib

from ..attention import math_attention, sdpa_arguments
from ..errors import CaptureError

__all__ = ["counter_rng", "sample_keyed_rng", "uniform_from_counter", "RANDOM_FUNCTIONS"]

_MASK32 = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B   # a well-mixing 32-bit hash multiplier; products stay below 2**63 in int64

# Random functions the mode refuses (dropout itself is replaced).
RANDOM_FUNCTIONS = ("rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
                    "bernoulli", "multinomial", "normal", "poisson", "alpha_dropout", "feature_alpha_dropout",
                    "dropout1d", "dropout2d", "dropout3d", "rrelu")


def _hash32(x):
    """A 32-bit integer mix (values kept in [0, 2**32) inside int64)."""
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK32
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK32
    return (x >> 16) ^ x


def uniform_from_counter(key, shape, dtype):
    """Uniform [0, 1) values of ``shape``, one per element index, from an int64 0-d ``key``."""
    bits = _hash32(_hash32(_element_index(shape, key.device) ^ key) + key & _MASK32)
    return (bits >> 8).to(dtype) * (1.0 / (1 << 24))


def _element_index(shape, device):
    """The row-major index of every element, as a sum of one small arange per dimension.

    (One ``arange`` over all elements costs about 20 ms per 74k elements on torch_xla's
    CPU device — it is built on the host — while per-dimension ones cost well under 1 ms.)
    """
    import torch

    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[dim] = shape[dim]
        index = index + (torch.arange(shape[dim], dtype=torch.int64, device=device) * stride).view(view)
        stride *= shape[dim]
    return index.expand(shape)


class _CounterRng:
    def __init__(self, seed: int, step, rank):
        import torch

        # step and rank are traced tensors; the seed and the call counter are graph constants.
        self._base = (step.to(torch.int64) * 0x2545F491 + rank.to(torch.int64).reshape(()) * 0x9E3779B
                      + (seed & _MASK32)) & _MASK32
        self._calls = 0

    def next_key(self):
        self._calls += 1
        return _hash32(self._base ^ (self._calls * 0x632BE5AB & _MASK32))

    def uniform(self, shape, dtype):
        """The next dropout call's uniform values (a mask per element of this shard's tensor)."""
        return uniform_from_counter(self.next_key(), shape, dtype)


class _SampleKeyedRng(_CounterRng):
    """Masks keyed by the sample's global row instead of the shard: a microbatched, pipelined step draws
    for every sample what the whole batch in one process draws for it (dim 0 is the batch)."""

    def __init__(self, seed: int, step, row_offset):
        # Kept raw; each call derives its key from them, so a dropout in a later pipeline chunk reads the
        # chunk's own key input rather than a value computed in the first chunk.
        self._seed, self._step, self._row_offset, self._calls = seed, step, row_offset, 0

    def next_key(self):
        import torch

        self._base = (self._step.to(torch.int64) * 0x2545F491 + (self._seed & _MASK32)) & _MASK32
        return super().next_key()

    def uniform(self, shape, dtype):
        import math

        import torch

        key = self.next_key()
        per_row = math.prod(shape[1:]) if len(shape) > 1 else 1
        index = _element_index(shape, key.device) + self._row_offset.to(torch.int64).reshape(()) * per_row
        bits = _hash32(_hash32(index ^ key) + key & _MASK32)
        return (bits >> 8).to(dtype) * (1.0 / (1 << 24))


def _make_mode(rng: _CounterRng):
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    refused = {getattr(torch, n, None) for n in RANDOM_FUNCTIONS} | {getattr(F, n, None) for n in RANDOM_FUNCTIONS}
    refused |= {getattr(torch.Tensor, n, None) for n in ("bernoulli_", "uniform_", "normal_", "random_",
                                                         "exponential_", "geometric_", "cauchy_", "log_normal_")}
    refused.discard(None)

    class CounterRngMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.dropout:
                return _dropout(rng, *args, **kwargs)
            if func is F.scaled_dot_product_attention and _sdpa_dropout(args, kwargs):
                # The reference math, with this step's counter-based dropout on the attention weights.
                return math_attention(sdpa_arguments(args, kwargs), lambda w, p: _dropout(rng, w, p))
            if func in refused:
                name = getattr(func, "__name__", str(func))
                raise CaptureError(f"random function {name!r} cannot be captured in a training step (only "
                                   f"dropout is supported, with counter-based masks); compute it outside the step")
            return func(*args, **kwargs)

    return CounterRngMode()


def _sdpa_dropout(args, kwargs) -> bool:
    return bool(sdpa_arguments(args, kwargs)["dropout_p"])


def _dropout(rng: _CounterRng, input, p: float = 0.5, training: bool = True, inplace: bool = False):
    if p < 0 or p > 1:
        raise CaptureError(f"dropout probability has to be between 0 and 1, got {p}")
    if not training or p == 0:
        return input
    if p == 1:
        return input * 0
    keep = rng.uniform(tuple(input.shape), input.dtype) >= p
    return input * keep.to(input.dtype) * (1.0 / (1 - p))


@contextlib.contextmanager
def sample_keyed_rng(seed: int, step, row_offset):
    """Within: ``F.dropout`` draws masks keyed by (seed, step, call number, global row, element in the row):
    ``row_offset`` is the global index of this tensor's first row. Pipeline steps use it; run a model eagerly
    inside it (offset 0, the whole batch) to get the same masks in one process."""
    with _make_mode(_SampleKeyedRng(seed, step, row_offset)):
        yield


@contextlib.contextmanager
def counter_rng(seed: int, step, rank):
    """Within: ``F.dropout`` draws counter-based masks keyed by (seed, step, rank, call number)."""
    with _make_mode(_CounterRng(seed, step, rank)):
        yield
