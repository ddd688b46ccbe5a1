"""Executor configuration, validated up front."""

from __future__ import annotations

import dataclasses

from pathways_torch.wire.backend_names import BACKEND_NAMES as BACKENDS

from .allocator import DEFAULT_MMAP_THRESHOLD_MB
from pathways_torch.wire.liveness import Liveness

__all__ = ["ExecutorConfig", "BACKENDS"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutorConfig(Liveness):
    """How one executor process runs (its heartbeat: `Liveness`).

    ``controller_address`` is the controller's ZeroMQ endpoint; ``bind_host`` is
    where this executor listens for tensor bytes (loopback unless told otherwise).
    ``parent_pid`` (set by a local launcher) makes the executor exit when that
    process is gone.
    """

    controller_address: str
    executor_id: str
    keys_dir: str                 # the launcher's key directory (see pathways_torch.wire.security)
    # Whose key pair to use: the id's own (""), or one of its spares ("executor-1.r1": a replacement started by
    # pathways-run; pathways_torch.launch.keys)
    key_role: str = ""
    backend: str = "eager"
    device: str = "cpu"
    bind_host: str = "127.0.0.1"
    num_threads: int = 1
    parent_pid: int = 0
    # How long to wait for the controller's first answer (it may start after this executor, under a launcher).
    join_timeout_s: float = 60.0
    max_trace_events: int = 200_000
    # CPU cores this process (and every thread it starts) may run on; empty: all. XLA's CPU runtime
    # keeps its own thread pool whatever num_threads says, so pinning is how it is held to one core.
    cpus: tuple[int, ...] = ()
    island: str = ""                    # the island it belongs to ("" = the default island "0")
    # glibc serves buffers of at least this many MiB with mappings of their own (0: glibc's dynamic default;
    # executor/allocator.py says why and what it costs).
    mmap_threshold_mb: float = DEFAULT_MMAP_THRESHOLD_MB
    # Simulated executors this process runs (executor/sim_host.py): 0, one executor as a process of its own; K >= 1,
    # K simulated ones on one loop, named by ``executor_id`` (K comma-separated ids, or one id X: X.0 .. X.<K-1>).
    sim_count: int = 0
    # Where service clients' checkpoints live, each under DIR/<client name>/ (executor/shard_writer.py): the
    # controller's --checkpoint-root. The embedded run's client writes where it names, as ever.
    checkpoint_root: str = "pathways-checkpoints"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {self.backend!r}")
        if not self.keys_dir:
            raise ValueError("keys_dir: expected the launcher's key directory (--keys DIR), got none; every "
                             "connection is authenticated, see docs/security.md")
        if any(c < 0 for c in self.cpus):
            raise ValueError(f"cpus: expected core numbers >= 0, got {self.cpus}")
        if not self.mmap_threshold_mb >= 0:
            raise ValueError(f"mmap_threshold_mb: expected >= 0 (0: glibc's default), got {self.mmap_threshold_mb}")
        if self.sim_count and self.backend != "sim":
            raise ValueError(f"sim_count={self.sim_count} (--sim-count): only simulated executors share a process; "
                             f"use --backend sim, or drop --sim-count")
        if self.num_threads < 1:
            raise ValueError(f"num_threads: expected >= 1, got {self.num_threads}")
        super().__post_init__()
        if not self.controller_address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"controller_address: expected a ZeroMQ endpoint like tcp://127.0.0.1:5555, "
                             f"got {self.controller_address!r}")
