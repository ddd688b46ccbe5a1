"""Tensor parallelism: layers split over a mesh axis by torch's own ``parallelize_module`` plans (DESIGN §10)."""

from .plan import TensorParallel
from .styles import FusedColwiseParallel, MultiheadAttentionParallel, ShardedAttributes

__all__ = ["TensorParallel", "FusedColwiseParallel", "ShardedAttributes", "MultiheadAttentionParallel",
           "tensor_parallel_plan"]


def __getattr__(name: str):
    if name == "tensor_parallel_plan":      # imports torch: only when asked for
        from .proposal import tensor_parallel_plan

        return tensor_parallel_plan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
