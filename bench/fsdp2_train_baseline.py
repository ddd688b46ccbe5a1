"""torch's FSDP2 (``fully_shard`` per block, then the root) on bench/train.py's Transformer: the sharded plan's
reference in its memory table. ``size`` processes on gloo meet through a FileStore in a private folder (nothing off
loopback); each trains the spec's warm-up and steps on its shard of each batch and reports its VmHWM before the
model was built and after the steps, and rank 0 the steps' time."""

from __future__ import annotations

import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.common import run_ranks  # noqa: E402

__all__ = ["fsdp2_memory"]


def fsdp2_memory(size: int, spec: dict, timeout_s: float = 600.0) -> dict:
    """``spec`` as `bench.ddp_train_baseline.DDPWorkers` takes it. Returns per rank: VmHWM at start and after
    (KiB), and the steps' tokens/s and the last global loss."""
    rows = run_ranks(_rank, size, (size, spec), "pathways-bench-fsdp2-", timeout_s)
    steps_s = rows[0][3]
    tokens = spec["batch"] * spec["config"]["length"] * 2 * spec["steps"] * spec["repeats"]
    return {"system": "fsdp2", "executors": size, "vmhwm_start_kib": [r[1] for r in rows],
            "vmhwm_kib": [r[2] for r in rows], "tokens_per_s": tokens / steps_s if steps_s else None,
            "last_loss": rows[0][4]}


def _rank(rank: int, size: int, spec: dict, store_path: str, results) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, _ROOT)
    sys.path.insert(0, os.path.join(_ROOT, "examples"))
    from bench.ddp_train_baseline import status_field
    from transformer import DecoderOnlyTransformer, ReverseTask, TransformerConfig, loss_fn

    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)   # gloo's "connected to" lines
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, size), rank=rank, world_size=size)
    dist.all_reduce(torch.ones(1))   # gloo's connections are made before the start is read, as DDP's are
    start = status_field(os.getpid(), "VmHWM")
    cfg = TransformerConfig(**spec["config"])
    torch.manual_seed(spec["seed"])
    model = DecoderOnlyTransformer(cfg)
    mesh = init_device_mesh("cpu", (size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    rows, task = spec["batch"] // size, ReverseTask(cfg, spec["seed"])
    total = spec["warmup"] + spec["repeats"] * spec["steps"]
    batches = [tuple(t[rank * rows:(rank + 1) * rows].contiguous() for t in task.batch(i, spec["batch"]))
               for i in range(total)]       # made before, as the DDP ranks make theirs
    began, loss = None, None
    for i, (inputs, targets) in enumerate(batches):
        if i == spec["warmup"]:
            began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
    steps_s = time.perf_counter() - began
    last = loss.detach().reshape(1).clone()
    dist.all_reduce(last)
    results.put((rank, start, status_field(os.getpid(), "VmHWM"), steps_s, last.item() / size))
    dist.barrier()
    os._exit(0)   # skip gloo's teardown (it can block once a peer has gone)
