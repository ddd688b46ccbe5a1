"""What a call of a function on a mesh is: its spec, and the controller's record of one in flight.

One `CallSpec` serves both ways a function runs: called alone (`Controller.call`: its inputs and outputs are
arrays) and as a node of a program (`ProgramSpec.nodes`: its inputs and outputs are the program's values).
"""

from __future__ import annotations

import dataclasses

from pathways_torch.wire import pb

from .arrays import ArrayRecord
from .resources import MeshAllocation

__all__ = ["CallSpec", "InFlightCall", "RegisteredFunction"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallSpec:
    """One call of a captured function on a mesh.

    Called alone, ``inputs`` are array ids and ``num_outputs`` says how many arrays it makes. As a program's
    node, ``inputs`` and ``outputs`` are the program's value ids, and ``num_outputs`` defaults to how many
    ``outputs`` it names.
    """

    function_id: int
    name: str
    mesh: MeshAllocation
    inputs: tuple[int, ...]
    outputs: tuple[int, ...] = ()     # a program's node: the values it makes
    num_outputs: int | None = None    # None: len(outputs)
    replicated_outputs: tuple[bool, ...] = ()   # outputs declared Replicate()
    debug: bool = False               # digest replicated outputs and compare them
    call_site: str = ""
    collective_axes: tuple[str, ...] = ()
    report_shapes: bool = False       # output sizes depend on the data: executors report them
    # Where output i sits among the function's outputs (its Done digests): a program node's
    # call covers only the outputs that are program outputs. Empty: output i is output i.
    output_positions: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_outputs is None:
            object.__setattr__(self, "num_outputs", len(self.outputs))


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


@dataclasses.dataclass
class RegisteredFunction:
    """A captured function's graph and constants, and the executors that have loaded it."""

    name: str
    graph: pb.Graph
    constants: list
    loaded_on: set[str] = dataclasses.field(default_factory=set)
    sim_seconds: float = 0.0
