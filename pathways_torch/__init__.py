"""pathways_torch: one Python client drives many executors through a single controller.

Importing this package is light: it starts no sockets and imports neither torch_xla
nor (until a name that needs it is used) torch. Public names are resolved lazily.
"""

from __future__ import annotations

import importlib

__all__ = [
    # context and placement
    "Context", "Mesh", "Shard", "Replicate", "Sharding",
    # functions and arrays
    "function", "Function", "Array", "program", "Program",
    # collectives (inside a function)
    "all_reduce", "all_gather", "reduce_scatter",
    # training
    "DataParallel", "ShardedDataParallel", "Trainer", "UnsupportedOptimizerError", "load_checkpoint",
    # pipelines
    "Pipeline", "pipe_split",
    # tensor parallelism
    "TensorParallel", "tensor_parallel_plan", "FusedColwiseParallel", "ShardedAttributes",
    "MultiheadAttentionParallel",
    # islands
    "Link",
    # errors
    "PathwaysError", "RemoteError", "CaptureError", "ExecutorLostError", "ReplicationError",
    "PlacementError", "DonatedArrayError", "AuthenticationError", "ContextClosedError", "ControllerLostError", "OutOfMemoryError",
    # backends
    "BACKEND_NAMES",
]

_WHERE = {
    "Context": "pathways_torch.context",
    "Mesh": "pathways_torch.placement",
    "Shard": "pathways_torch.placement",
    "Replicate": "pathways_torch.placement",
    "Sharding": "pathways_torch.placement",
    "function": "pathways_torch.functions",
    "Function": "pathways_torch.functions",
    "Array": "pathways_torch.array",
    "program": "pathways_torch.programs",
    "Program": "pathways_torch.programs",
    "all_reduce": "pathways_torch.collectives",
    "all_gather": "pathways_torch.collectives",
    "reduce_scatter": "pathways_torch.collectives",
    "DataParallel": "pathways_torch.training",
    "ShardedDataParallel": "pathways_torch.training",
    "Trainer": "pathways_torch.training",
    "UnsupportedOptimizerError": "pathways_torch.training",
    "load_checkpoint": "pathways_torch.training.checkpoint",
    "Link": "pathways_torch.local.link",
    "TensorParallel": "pathways_torch.tensor_parallel",
    "tensor_parallel_plan": "pathways_torch.tensor_parallel",
    "FusedColwiseParallel": "pathways_torch.tensor_parallel",
    "ShardedAttributes": "pathways_torch.tensor_parallel",
    "MultiheadAttentionParallel": "pathways_torch.tensor_parallel",
    "Pipeline": "pathways_torch.pipeline",
    "pipe_split": "pathways_torch.pipeline",
    "PathwaysError": "pathways_torch.errors",
    "RemoteError": "pathways_torch.errors",
    "CaptureError": "pathways_torch.errors",
    "ExecutorLostError": "pathways_torch.errors",
    "ReplicationError": "pathways_torch.errors",
    "PlacementError": "pathways_torch.errors",
    "DonatedArrayError": "pathways_torch.errors",
    "AuthenticationError": "pathways_torch.errors",
    "ContextClosedError": "pathways_torch.errors",
    "ControllerLostError": "pathways_torch.errors",
    "OutOfMemoryError": "pathways_torch.errors",
    "BACKEND_NAMES": "pathways_torch.wire.backend_names",
}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'pathways_torch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
