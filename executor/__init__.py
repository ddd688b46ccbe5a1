"""The executor: one process per device.

It registers with the controller, keeps a sharded object store, runs each
computation when its inputs are present (in the island's sequence order), and
pushes outputs straight to the executors that consume them. It imports nothing
of ``pathways_torch`` but ``wire`` and ``errors``.
"""

from .config import ExecutorConfig
from .store import ObjectStore
from .core import ExecutorCore

__all__ = ["ExecutorConfig", "ObjectStore", "ExecutorCore"]
