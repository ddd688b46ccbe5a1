"""The torchrun-style baseline of `bench/train.py`: N processes, gloo, `DistributedDataParallel`.

Each process: one compute thread, a gloo group made from a FileStore in a private
temporary directory with its device bound to loopback (`make_gloo_group`, as the
executors make theirs; no TCPStore, no default world group), the same model and
initial weights (``torch.manual_seed``), the same AdamW, and rows
``[rank*B/N, (rank+1)*B/N)`` of every global batch. After the warm-up steps, the
processes line up on an all-reduce and time ``repeats`` windows of ``steps`` steps
each. Rank 0's times are the result (every rank's are returned too).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import sys
import tempfile
import time
import traceback

__all__ = ["run_ddp", "status_field", "process_cpu_s"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(rank: int, size: int, store_path: str, spec: dict, result_queue) -> None:
    # gloo prints "[Gloo] Rank r is connected to ..." on stdout; results travel on the queue.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    faulthandler.dump_traceback_later(spec.get("hang_dump_s", 300), exit=False)   # a hang shows where
    try:
        result = _train(rank, size, store_path, spec)
    except BaseException as exc:  # report, so the parent does not wait for the queue's timeout
        result = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-4)}"}
    result_queue.put((rank, result))
    result_queue.close()
    result_queue.join_thread()
    sys.stderr.flush()
    # Skip the destructors: tearing down the gloo group (DDP's reducer, the backend) at
    # exit sometimes blocks a rank for good once its peer has gone.
    os._exit(0 if "error" not in result else 1)


_KEEP_ALIVE: list = []   # the group and the DDP module, never destroyed (see _worker)


def _train(rank: int, size: int, store_path: str, spec: dict) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, os.path.join(_ROOT, "examples"))
    from executor.collectives import make_gloo_group
    from transformer import DecoderOnlyTransformer, ReverseTask, TransformerConfig, loss_fn

    torch.set_num_threads(1)
    cfg = TransformerConfig(**spec["config"])
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
        one_step(*batches[i])
    windows = []
    index = spec["warmup"]
    cpu_began = time.process_time()
    for _ in range(spec["repeats"]):
        group.allreduce([torch.zeros(1)]).wait()   # start together
        began = time.perf_counter()
        for _ in range(spec["steps"]):
            loss = one_step(*batches[index])
            index += 1
        windows.append(time.perf_counter() - began)
    cpu_s = time.process_time() - cpu_began   # this process's CPU time (every thread) in the windows
    # The global mean loss of the last step (the runtime and eager report that one).
    last = loss.detach().reshape(1).clone()
    group.allreduce([last]).wait()
    return {"windows_s": windows, "last_loss": last.item() / size, "pid": os.getpid(), "cpu_s": cpu_s,
            "vmhwm_kib": status_field(os.getpid(), "VmHWM")}


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


def _collect(procs, results, timeout_s: float) -> dict:
    """Every rank's result; fails early if a process exits without one (or at ``timeout_s``)."""
    import queue

    by_rank: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(by_rank) < len(procs):
        try:
            rank, result = results.get(timeout=1.0)
            by_rank[rank] = result
            continue
        except queue.Empty:
            pass
        dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in by_rank]
        if dead:
            raise RuntimeError(f"DDP baseline: rank(s) exited without a result (rank, exit code): {dead}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"DDP baseline: no result from rank(s) {sorted(set(range(len(procs))) - set(by_rank))} "
                               f"after {timeout_s:.0f} s")
    return by_rank


def run_ddp(size: int, spec: dict, timeout_s: float = 600.0) -> list[dict]:
    """Run the DDP baseline on ``size`` spawned processes; returns each rank's result, by rank.

    ``spec``: ``config`` (TransformerConfig kwargs), ``seed``, ``lr``, ``batch`` (global),
    ``warmup``, ``steps``, ``repeats``.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="pathways-ddp-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(rank, size, store_path, spec, results)) for rank in range(size)]
        for p in procs:
            p.start()
        try:
            by_rank = _collect(procs, results, timeout_s)
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    errors = {r: v["error"] for r, v in by_rank.items() if "error" in v}
    if errors:
        raise RuntimeError(f"DDP baseline failed on N={size}: {errors}")
    return [by_rank[r] for r in range(size)]


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (every thread), from ``/proc/<pid>/stat``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime (fields 14, 15)
