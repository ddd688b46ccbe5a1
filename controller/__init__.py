"""The single controller: resource manager, array table, island sequence numbers and dispatch.

Embedded in the client process by default. It talks to executors only over the
wire (``pathways_torch.wire``) and never touches tensor bytes: puts and fetches go
client↔executor, transfers executor→executor.
"""

from .config import ControllerConfig
from .resources import ExecutorInfo, MeshAllocation, ResourceManager
from .arrays import ArrayRecord, ArrayTable
from .call_spec import CallSpec
from .dispatch import Controller
from .server import ControllerServer

__all__ = ["ControllerConfig", "ExecutorInfo", "MeshAllocation", "ResourceManager", "ArrayRecord",
           "ArrayTable", "Controller", "CallSpec", "ControllerServer"]
