"""The torchrun-style baseline of `bench/train.py`: N processes, gloo, `DistributedDataParallel`.

Each process: one compute thread, a gloo group made from a FileStore in a private
temporary directory with its device bound to loopback (`make_gloo_group`, as the
executors make theirs; no TCPStore, no default world group), the same model and
initial weights (``torch.manual_seed``), the same AdamW, and rows
``[rank*B/N, (rank+1)*B/N)`` of every global batch.

The processes stay alive between timed windows, so `bench/train.py` can interleave
them with the other systems' windows (`DDPWorkers`): after the warm-up steps each
rank reports "ready" and blocks on its command pipe (no CPU). On ``"window"`` the
ranks line up on an all-reduce, run ``steps`` steps and report their wall time and
CPU time; on ``"stop"`` they report the last step's global mean loss and their
VmHWM, then exit. Rank 0's times are the result (every rank's are returned too).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback

__all__ = ["DDPWorkers", "status_field"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(rank: int, size: int, store_path: str, spec: dict, commands, result_queue) -> None:
    # gloo prints "[Gloo] Rank r is connected to ..." on stdout; results travel on the queue.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    code = 0
    try:
        _serve(rank, size, store_path, spec, commands, result_queue)
    except BaseException as exc:  # report, so the parent does not wait for the queue's timeout
        result_queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-4)}"))
        code = 1
    result_queue.close()
    result_queue.join_thread()
    sys.stderr.flush()
    # Skip the destructors: tearing down the gloo group (DDP's reducer, the backend) at
    # exit sometimes blocks a rank for good once its peer has gone.
    os._exit(code)


_KEEP_ALIVE: list = []   # the group and the DDP module, never destroyed (see _worker)


def _serve(rank: int, size: int, store_path: str, spec: dict, commands, result_queue) -> None:
    """Warm up, report "ready", then run one timed window per "window" command until "stop"."""
    hang_dump_s = spec.get("hang_dump_s", 300)
    faulthandler.dump_traceback_later(hang_dump_s, exit=False)   # a hang shows where
    import torch
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, os.path.join(_ROOT, "examples"))
    from executor.collectives import make_gloo_group
    from transformer import DecoderOnlyTransformer, ReverseTask, TransformerConfig, loss_fn

    torch.set_num_threads(1)
    cfg = TransformerConfig(**spec["config"])
    hwm_start = status_field(os.getpid(), "VmHWM")      # before the model: what training adds is measured from here
    torch.manual_seed(spec["seed"])
    model = DecoderOnlyTransformer(cfg)
    group = _process_group(make_gloo_group(store_path, "ddp", rank, size, 120.0), rank, size)
    ddp = DistributedDataParallel(model, process_group=group)
    _KEEP_ALIVE.extend([group, ddp])
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=spec["lr"])
    rows = spec["batch"] // size
    task = ReverseTask(cfg, spec["seed"])
    num_batches = spec["warmup"] + spec["repeats"] * spec["steps"]
    batches = [tuple(t[rank * rows:(rank + 1) * rows].contiguous() for t in task.batch(i, spec["batch"]))
               for i in range(num_batches)]

    def one_step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss

    for i in range(spec["warmup"]):
        loss = one_step(*batches[i])
    index = spec["warmup"]
    result_queue.put((rank, "ready", {"pid": os.getpid()}))
    while True:
        faulthandler.cancel_dump_traceback_later()   # waiting for the parent is not a hang of ours
        try:
            command = commands.recv()
        except EOFError:   # the parent is gone
            return
        faulthandler.dump_traceback_later(hang_dump_s, exit=False)
        if command == "window":
            if index + spec["steps"] > num_batches:
                raise RuntimeError(f"more windows than the {spec['repeats']} repeats the batches were made for")
            cpu_began = time.process_time()
            group.allreduce([torch.zeros(1)]).wait()   # start together
            began = time.perf_counter()
            for _ in range(spec["steps"]):
                loss = one_step(*batches[index])
                index += 1
            window_s = time.perf_counter() - began
            # This process's CPU time (every thread) in the window, the start all-reduce included.
            result_queue.put((rank, "window", {"window_s": window_s, "cpu_s": time.process_time() - cpu_began}))
        elif command == "stop":
            # The global mean loss of the last step (the runtime and eager report that one).
            last = loss.detach().reshape(1).clone()
            group.allreduce([last]).wait()
            result_queue.put((rank, "stop", {"last_loss": last.item() / size, "pid": os.getpid(),
                                             "vmhwm_kib": status_field(os.getpid(), "VmHWM"),
                                             "vmhwm_start_kib": hwm_start}))
            return
        else:
            raise ValueError(f"unknown command {command!r}")


def status_field(pid: int, field: str) -> int | None:
    """An integer field of ``/proc/<pid>/status`` (VmHWM: peak resident set in KiB; Threads: a count).

    None if the process or the field is gone.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _process_group(backend, rank: int, size: int):
    """Wrap a bare gloo backend (what `make_gloo_group` returns) in the ``ProcessGroup`` DDP expects.

    What ``init_process_group`` would do for a gloo group, without a world group or a
    second rendezvous: the backend was already formed on the FileStore.
    """
    import torch
    import torch.distributed as dist

    backend._set_sequence_number_for_group()
    group = dist.ProcessGroup(dist.HashStore(), rank, size)   # the store is unused: the backend has its own
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_group_name("ddp-baseline")
    return group


class DDPWorkers:
    """``size`` spawned DDP ranks that stay alive and run one timed window per `window` call.

    ``spec``: ``config`` (TransformerConfig kwargs), ``seed``, ``lr``, ``batch`` (global),
    ``warmup``, ``steps``, ``repeats`` (the most windows: the batches are made for that many).
    Use as a context manager: `start` (spawn, warm up), `window` (x repeats), `stop`; leaving
    the block kills whatever is still running.
    """

    def __init__(self, size: int, spec: dict, timeout_s: float = 600.0):
        self.size, self.spec, self.timeout_s = size, spec, timeout_s
        self._mp = multiprocessing.get_context("spawn")
        self._results = self._mp.Queue()
        self._tmp = tempfile.mkdtemp(prefix="pathways-ddp-")
        self._procs: list = []
        self._commands: list = []
        self.pids: list[int] = []

    def __enter__(self) -> "DDPWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> list[dict]:
        """Spawn the ranks and wait until every one has done its warm-up steps."""
        store_path = os.path.join(self._tmp, "store")
        for rank in range(self.size):
            # One pipe per rank; the rank holds only the read end, so it sees EOF if this process dies.
            reader, writer = self._mp.Pipe(duplex=False)
            proc = self._mp.Process(target=_worker, args=(rank, self.size, store_path, self.spec, reader,
                                                          self._results))
            proc.start()
            reader.close()
            self._procs.append(proc)
            self._commands.append(writer)
        ready = self._collect("ready")
        self.pids = [r["pid"] for r in ready]
        return ready

    def window(self) -> list[dict]:
        """One timed window of ``steps`` steps on every rank; each rank's ``window_s`` and ``cpu_s``."""
        return self._command("window")

    def stop(self) -> list[dict]:
        """Each rank's last-step global loss, pid and VmHWM; the ranks exit."""
        return self._command("stop")

    def _command(self, command: str) -> list[dict]:
        for writer in self._commands:
            try:
                writer.send(command)
            except OSError:   # that rank is gone: _collect says which and how
                pass
        return self._collect(command)

    def _collect(self, kind: str) -> list[dict]:
        """Every rank's ``kind`` report, by rank; fails early if a rank reports an error or exits without one."""
        by_rank: dict = {}
        deadline = time.monotonic() + self.timeout_s
        dead_since = None
        while len(by_rank) < self.size:
            try:
                rank, got, payload = self._results.get(timeout=1.0 if dead_since is None else 0.2)
            except queue.Empty:
                pass
            else:
                if got == "error":
                    raise RuntimeError(f"DDP baseline failed on N={self.size}, rank {rank}: {payload}")
                if got != kind:
                    raise RuntimeError(f"DDP baseline: rank {rank} reported {got!r}, expected {kind!r}")
                by_rank[rank] = payload
                continue
            dead = [(r, p.exitcode) for r, p in enumerate(self._procs)
                    if p.exitcode not in (None, 0) and r not in by_rank]
            if dead:
                # A rank's last report is in the pipe before it exits: read what is left first.
                if dead_since is None:
                    dead_since = time.monotonic()
                elif time.monotonic() - dead_since > 1.0:
                    raise RuntimeError(f"DDP baseline: rank(s) exited without a result (rank, exit code): {dead}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"DDP baseline: no {kind!r} from rank(s) "
                                   f"{sorted(set(range(self.size)) - set(by_rank))} after {self.timeout_s:.0f} s")
        return [by_rank[r] for r in range(self.size)]

    def close(self) -> None:
        for writer in self._commands:
            writer.close()   # a rank still waiting for a command sees EOF and exits
        for p in self._procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
        self._commands, self._procs = [], []
        shutil.rmtree(self._tmp, ignore_errors=True)

