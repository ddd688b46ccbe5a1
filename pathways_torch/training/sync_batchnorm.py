"""``nn.SyncBatchNorm`` in a captured step: batch statistics over the whole data axis.

torch's ``SyncBatchNorm`` synchronises through ``torch.distributed``, which the client
does not run; without a process group it silently normalises with each shard's own
statistics. While the step is traced, `global_batch_norm` gives each ``SyncBatchNorm``
module a forward whose statistics are all-reduced over the plan's axis (one collective
of sum, sum of squares and count), so training matches one process with the whole batch,
and the running statistics update from the global ones (the variance unbiased over the
global count) — identical on every shard.
"""

from __future__ import annotations

import contextlib
import types

__all__ = ["global_batch_norm"]


def _summed(x, axis: str):
    """``pw.all_reduce(x, axis, "sum")`` with a gradient (the sum of every shard's output gradient).

    An ``autograd.Function`` with ``setup_context``, the form ``torch.func.grad`` (which the
    step uses) accepts; a custom op's ``register_autograd`` is refused under it."""
    import torch

    from ..collectives import all_reduce

    def below_autograd(t):
        # The custom op's own autograd entry would refuse torch.func's transforms: this Function is the
        # gradient, so the op runs below autograd.
        with torch._C._AutoDispatchBelowAutograd():
            return all_reduce(t, axis, "sum")

    class Summed(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return below_autograd(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, grad):
            return Summed.apply(grad)

    return Summed.apply(x)


def _forward(self, x, *, axis: str, num_shards: int):
    import torch
    import torch.nn.functional as F

    if not self.training:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
    dims = [0, *range(2, x.dim())]
    count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype)
    stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
    if num_shards > 1:
        stats = _summed(stats, axis)
    channels = x.shape[1]
    total, squares, n = stats[:channels], stats[channels:2 * channels], stats[-1]
    mean = total / n
    var = squares / n - mean * mean
    shape = [1, channels] + [1] * (x.dim() - 2)
    y = (x - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps)
    if self.affine:
        y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
    if self.track_running_stats:
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked + 1)
        with torch.no_grad():
            self.running_mean.mul_(1 - momentum).add_(mean.detach() * momentum)
            self.running_var.mul_(1 - momentum).add_(var.detach() * (n / (n - 1)) * momentum)
            self.num_batches_tracked.add_(1)
    return y


@contextlib.contextmanager
def global_batch_norm(model, axis: str, num_shards: int):
    """Within: every ``nn.SyncBatchNorm`` of ``model`` normalises with statistics over ``axis``."""
    import torch.nn as nn

    patched = [m for m in model.modules() if isinstance(m, nn.SyncBatchNorm)]
    for module in patched:
        module.forward = types.MethodType(lambda self, x: _forward(self, x, axis=axis, num_shards=num_shards),
                                          module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward     # the class's own again
