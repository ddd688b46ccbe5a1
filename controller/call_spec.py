"""What a call of a function on a mesh is: its spec, and the controller's record of one in flight.

One `CallSpec` serves both ways a function runs: called alone (`CallDispatch.call`: its inputs and outputs are
arrays) and as a node of a program (`ProgramSpec.nodes`: its inputs and outputs are the program's values).
"""

from __future__ import annotations

import dataclasses

from pathways_torch.wire import pb
from pathways_torch.wire.seam import CallSpec

from .arrays import ArrayRecord

__all__ = ["CallSpec", "InFlightCall", "RegisteredFunction"]


@dataclasses.dataclass
class InFlightCall:
    """A call (or a program run's reporting node) the controller waits on: who has yet to report, and how."""

    spec: CallSpec
    call_id: int
    seq: int
    outputs: list[ArrayRecord]
    waiting: set[str]
    digests: dict[str, list[bytes]] = dataclasses.field(default_factory=dict)
    shapes: dict[str, list[tuple[int, ...]]] = dataclasses.field(default_factory=dict)  # reported output shapes
    failed: bool = False
    routes: list[tuple[str, str, pb.ShardRef]] = dataclasses.field(default_factory=list)  # (from, to, copy) pushes
    depends_on: frozenset[str] = frozenset()   # executors beyond its mesh it may need (a program's others)
    # A failure that looks like a lost peer ("connection closed by peer") while other members have yet to report:
    # held until they do, or until one is declared lost, which fails the call with ExecutorLostError instead.
    held_failure: pb.RemoteFailure | None = None
    run_base: int = 0        # a program run's node: the run's first call id (a Cancel names the run by it)
    run_nodes: int = 0       # ... and how many call ids the run holds (run_base .. run_base + run_nodes - 1)
    program_id: int = 0      # ... and its program, whose plan names who sends each copy to whom
    admitted: object = None  # its `admission.Admitted` when the controller serves many clients (shared by a run's nodes)
    owner: str = ""          # the client whose call it is ("": the embedded one): run-ahead is bounded per client
    device_s: float = 0.0    # device time its executors measured (their Done reports)


@dataclasses.dataclass
class RegisteredFunction:
    """A captured function's graph and constants, and the executors that have loaded it."""

    name: str
    graph: pb.Graph
    constants: list
    loaded_on: set[str] = dataclasses.field(default_factory=set)
    sim_seconds: float = 0.0
