"""What `pathways-run` tells the script it starts: ``PATHWAYS_*`` variables, read in this one place.

In the single-controller model the user's script runs once, on node 0, and every node runs
executors that join its controller. The launcher sets these variables in the script's
environment (and nothing else: no ``RANK`` or ``WORLD_SIZE``, which user code and libraries
take as a cue to call ``init_process_group``); ``pw.Context()`` reads them with
`LaunchEnvironment.from_environ` and attaches to the launched executors instead of starting
its own. Without them a script starts local executors, as under plain ``python``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

__all__ = ["LaunchEnvironment", "LAUNCH_VARIABLES", "OPTIONAL_VARIABLES", "executor_ids", "node_of"]

# name in the environment -> field
LAUNCH_VARIABLES = {
    "PATHWAYS_CONTROLLER_BIND": "controller_bind",     # tcp://MASTER_ADDR:MASTER_PORT, where the controller listens
    "PATHWAYS_KEYS_DIR": "keys_dir",                   # node 0's key folder (controller, client, allow-list)
    "PATHWAYS_NNODES": "nnodes",
    "PATHWAYS_NPROC_PER_NODE": "nproc_per_node",
    "PATHWAYS_BACKEND": "backend",                     # what every node's executors were started with
    "PATHWAYS_RUN_ID": "run_id",
    "PATHWAYS_JOIN_TIMEOUT_S": "join_timeout_s",       # how long the controller waits for every executor
}
OPTIONAL_VARIABLES = {
    "PATHWAYS_STATUS_PORT": "status_port",             # serve pathways.Status on 127.0.0.1 here (0: no)
}


@dataclasses.dataclass(frozen=True)
class LaunchEnvironment:
    """The launched job as the script on node 0 sees it."""

    controller_bind: str
    keys_dir: str
    nnodes: int
    nproc_per_node: int
    backend: str
    run_id: str = "none"
    join_timeout_s: float = 300.0
    status_port: int = 0

    def __post_init__(self):
        if not self.controller_bind.startswith("tcp://"):
            raise ValueError(f"PATHWAYS_CONTROLLER_BIND: expected tcp://HOST:PORT, got {self.controller_bind!r}")
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ValueError(f"PATHWAYS_NNODES / PATHWAYS_NPROC_PER_NODE: expected >= 1, got {self.nnodes} / "
                             f"{self.nproc_per_node}")

    @property
    def num_executors(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def executor_ids(self) -> list[str]:
        return executor_ids(range(self.num_executors))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "LaunchEnvironment | None":
        """The launch this process runs under, or None (no ``PATHWAYS_CONTROLLER_BIND``: not launched)."""
        environ = os.environ if environ is None else environ
        if "PATHWAYS_CONTROLLER_BIND" not in environ:
            return None
        missing = [name for name in LAUNCH_VARIABLES if name not in environ]
        if missing:
            raise ValueError(f"a pathways-run launch sets {', '.join(LAUNCH_VARIABLES)}; this environment lacks "
                             f"{', '.join(missing)}: start the script with pathways-run, or unset "
                             f"PATHWAYS_CONTROLLER_BIND to start local executors")
        values = {field: environ[name] for name, field in LAUNCH_VARIABLES.items()}
        try:
            return cls(controller_bind=values["controller_bind"], keys_dir=values["keys_dir"],
                       nnodes=int(values["nnodes"]), nproc_per_node=int(values["nproc_per_node"]),
                       backend=values["backend"], run_id=values["run_id"],
                       join_timeout_s=float(values["join_timeout_s"]),
                       status_port=int(environ.get("PATHWAYS_STATUS_PORT", "0")))
        except ValueError as exc:
            raise ValueError(f"the PATHWAYS_* launch variables do not parse: {exc}") from exc

    def to_environ(self) -> dict[str, str]:
        values = dataclasses.asdict(self)
        out = {name: str(values[field]) for name, field in LAUNCH_VARIABLES.items()}
        if self.status_port:
            out["PATHWAYS_STATUS_PORT"] = str(self.status_port)
        return out


def executor_ids(indices) -> list[str]:
    """Global executor numbers -> ids: node k's j-th executor is ``executor-{k * nproc + j}``, as local ones."""
    return [f"executor-{i}" for i in indices]


def node_of(executor_id: str, nproc_per_node: int) -> int:
    return int(executor_id.rsplit("-", 1)[1]) // nproc_per_node
