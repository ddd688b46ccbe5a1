"""`ContextConfig`: how a `pw.Context` starts its cluster, validated up front (``pw.Context(**options)``)."""

from __future__ import annotations

import dataclasses
import os

from .wire.backend_names import BACKEND_NAMES, default_backend, resolve_backend_name
from .wire.liveness import Liveness

__all__ = ["ContextConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContextConfig(Liveness):
    """How `Context` starts its embedded cluster (the heartbeat its processes keep: `Liveness`)."""

    num_executors: int = 4
    # Local islands: executors per island, e.g. (2, 2); named "0", "1", ... (None: one island of num_executors).
    islands: tuple[int, ...] | None = None
    # None: XLA on CPU/TPU (the installed route: "xla:torchax" or "xla:torch_xla"), inductor on CUDA.
    # "eager" runs op by op (debugging); see docs/backends.md.
    backend: str | None = None
    device: str = "cpu"           # "cuda": executor i runs on cuda:i, collectives on NCCL
    debug: bool = False
    executor_threads: int = 1
    # glibc serves an executor's buffers of at least this many MiB with mappings of their own, given back when
    # freed (0: glibc's dynamic default, which keeps them in a heap that fragments; executor/allocator.py).
    executor_mmap_threshold_mb: float = 2.0
    start_timeout_s: float = 120.0
    log_dir: str | None = None
    inject_latency_s: float = 0.0     # tests/benchmarks: delay every controller→executor message
    # Pin executor i to core i mod the core count (benchmarks: XLA's CPU runtime ignores executor_threads
    # and uses every core unless pinned; docs/backends.md).
    pin_executors: bool = False
    # Bounded run-ahead (docs/architecture.md §6.3): a call waits while this many calls are unfinished, a
    # training step while this many steps are (each holds its batch on the executors: lower it for big
    # batches; below about 16 a 2-core host loses throughput, measured).
    max_inflight: int = 256
    max_inflight_steps: int = 16
    # A transfer between executors not acknowledged this long (plus 1 s per MB) fails the call that needs it
    # (a link that failed; None: the loss bound, 2 x heartbeat_timeout_s, at least 20 s).
    transfer_timeout_s: float | None = None
    # With islands: shape the link between them (a relay that delays and counts; the kernel's tbf in a network
    # namespace or the relay's token bucket limits the rate: pathways_torch.local.link).
    link: object | None = None
    # A standalone controller to attach to (``"tcp://HOST:PORT"``, `pathways-controller`) instead of starting one,
    # with this client's key folder (``keys="DIR/clients/NAME"`` of its ``--make-keys``); docs/service.md.
    controller: str | None = None
    keys: str | None = None
    # Simulated executors (backend="sim") to a process: None, a process each; K, K to a process on one loop
    # (executor/sim_host.py): how a thousand of them fit on one machine.
    sims_per_process: int | None = None
    # A program run on every executor of an island, when there are at least ``launch_tree_min_executors``, goes down
    # a tree of ``launch_fanout`` children per executor, its Dones back up it (docs/scale.md); 0: never.
    launch_fanout: int = 32
    launch_tree_min_executors: int = 128
    # Heartbeats per second the controller asks for, all executors together, at most (0: no limit): beyond it each
    # executor pings less often, the loss still declared after heartbeat_timeout_s of silence (docs/scale.md).
    max_heartbeats_per_s: float = 512.0

    def __post_init__(self):
        self._check_remote()
        for name in ("max_inflight", "max_inflight_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if not isinstance(self.num_executors, int) or self.num_executors < 1:
            raise ValueError(f"num_executors: expected a positive int, got {self.num_executors!r}")
        if self.islands is not None:
            if not self.islands or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.islands):
                raise ValueError(f"islands: expected executors per island, positive ints such as [2, 2], got "
                                 f"{self.islands!r}")
            if sum(self.islands) != self.num_executors:
                raise ValueError(f"islands={list(self.islands)} make {sum(self.islands)} executors but "
                                 f"num_executors={self.num_executors}; give one of them, or make them agree")
        if not (isinstance(self.executor_mmap_threshold_mb, (int, float)) and self.executor_mmap_threshold_mb >= 0):
            raise ValueError(f"executor_mmap_threshold_mb: expected a number of MiB >= 0 (0: glibc's default), got "
                             f"{self.executor_mmap_threshold_mb!r}")
        self._check_sims()
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {self.device!r}")
        if self.backend is not None and self.backend not in BACKEND_NAMES:
            raise ValueError(f"backend: expected one of {BACKEND_NAMES} (or None for the default), "
                             f"got {self.backend!r}")
        if self.device == "cuda" and self.backend not in (None, "inductor", "eager"):
            raise ValueError(f"device='cuda' needs backend='inductor' (the default there) or 'eager', got "
                             f"{self.backend!r}: the XLA routes run on CPU and TPU hosts (docs/backends.md)")
        super().__post_init__()

    def _check_sims(self) -> None:
        if self.sims_per_process is None:
            return
        if not isinstance(self.sims_per_process, int) or isinstance(self.sims_per_process, bool) or \
                self.sims_per_process < 1:
            raise ValueError(f"sims_per_process: expected a positive int (simulated executors per process), got "
                             f"{self.sims_per_process!r}")
        if self.backend != "sim":
            raise ValueError(f"sims_per_process={self.sims_per_process} with backend={self.backend!r}: only simulated "
                             f"executors share a process; pass backend='sim', or drop sims_per_process")

    def _check_remote(self) -> None:
        if (self.controller is None) != (self.keys is None):
            raise ValueError(f"controller={self.controller!r}, keys={self.keys!r}: a remote controller needs both, "
                             f"its address and this client's key folder (DIR/clients/NAME of pathways-controller "
                             f"--make-keys); give both or neither")
        if self.controller is None:
            return
        if not isinstance(self.controller, str) or not self.controller.startswith("tcp://"):
            raise ValueError(f"controller: expected an address such as 'tcp://10.0.0.1:5555', got "
                             f"{self.controller!r}")
        started_here = {"islands": self.islands, "link": self.link, "log_dir": self.log_dir,
                        "sims_per_process": self.sims_per_process,
                        "pin_executors": self.pin_executors or None, "device": None if self.device == "cpu" else 1}
        named = sorted(name for name, value in started_here.items() if value is not None)
        if named:
            raise ValueError(f"{', '.join(named)}: these choose how this context starts its executors, but with "
                             f"controller= it starts none (the controller's operator does: pathways-controller); "
                             f"drop them")

    @property
    def resolved_backend(self) -> str:
        """The backend executors are started with: the default for the device, an XLA route resolved to what is
        installed (raises ``ValueError`` saying what to install)."""
        return resolve_backend_name(self.backend or default_backend(self.device))

    def executor_islands(self) -> list[str]:
        """The island of each executor: "0", "1", ... in order (all "" for one island)."""
        if self.islands is None:
            return [""] * self.num_executors
        return [str(index) for index, count in enumerate(self.islands) for _ in range(count)]

    def executor_cpus(self) -> list[tuple[int, ...]]:
        """The cores each executor may use: one each when ``pin_executors``, else all (empty)."""
        if not self.pin_executors:
            return [()] * self.num_executors
        cores = sorted(os.sched_getaffinity(0))
        return [(cores[i % len(cores)],) for i in range(self.num_executors)]

    def executor_devices(self) -> list[str]:
        """The device of each executor: ``cpu``, or one CUDA device each (NCCL needs distinct devices)."""
        if self.device == "cpu":
            return ["cpu"] * self.num_executors
        import torch

        count = torch.cuda.device_count()
        if count < self.num_executors:
            raise ValueError(f"device='cuda': {self.num_executors} executors need as many CUDA devices, this host "
                             f"has {count}; use num_executors <= {count}")
        return [f"cuda:{i}" for i in range(self.num_executors)]
