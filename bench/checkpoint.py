"""Saving a checkpoint: through the client (``trainer.save``) against written by the executors
(``trainer.save_sharded``), side by side on one context.

Same trainer throughout (bench/train.py's Transformer at ``--width``/``--depth``, AdamW, DataParallel over
``--executors``, the default backend): after a few warm-up steps, each round saves once each way (the order
alternating), to a fresh folder under ``--dir`` (default: a temporary folder on this disk). Reported per way:
the wall time from the call until the checkpoint is on disk (median over rounds; a training step before each
save, so that each saves fresh state), the bytes that reached the
client while saving (``ctx.stats()`` executor->client), and the bytes written; for the executors' way also how
long the call itself took (the save runs in the background: the next step can be dispatched after that).

    .venv/bin/python -m bench.checkpoint [--width 512] [--depth 8] [--executors 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import pathways_torch as pw
from bench.common import add_backend_argument, add_model_arguments, print_table, write_results
from bench.train_setup import ReverseTask, loss_fn, make_config, make_model

__all__ = ["main"]


def _client_bytes(ctx) -> int:
    return ctx.stats()["hops"]["executor->client"]


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _through_client(ctx, trainer, path: str) -> dict:
    before = _client_bytes(ctx)
    began = time.perf_counter()
    trainer.save(path)
    wall = time.perf_counter() - began
    return {"wall_s": wall, "call_s": wall, "client_bytes": _client_bytes(ctx) - before,
            "file_bytes": _folder_bytes(path)}


def _by_executors(ctx, trainer, path: str) -> dict:
    before = _client_bytes(ctx)
    began = time.perf_counter()
    future = trainer.save_sharded(path)
    call = time.perf_counter() - began
    future.result(600)
    wall = time.perf_counter() - began
    return {"wall_s": wall, "call_s": call, "client_bytes": _client_bytes(ctx) - before,
            "file_bytes": _folder_bytes(path)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, width=512, depth=8)
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    add_backend_argument(parser)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = make_config(args)
    root = args.dir or tempfile.mkdtemp(prefix="pathways-bench-ckpt-")
    results = {"client": [], "executors": []}
    with pw.Context(num_executors=args.executors, backend=args.backend) as ctx:
        model, optimizer = make_model(cfg)
        trainer = ctx.wrap(model, optimizer=optimizer, loss_fn=loss_fn, mesh=ctx.mesh({"data": args.executors}))
        task = ReverseTask(cfg, 0)
        for i in range(3):
            trainer.step(task.batch(i, 64)).result(600)
        parameters = sum(p.numel() for p in model.parameters())
        for r in range(args.rounds):
            order = [("client", _through_client), ("executors", _by_executors)]
            for name, way in (order if r % 2 == 0 else order[::-1]):
                # A step first: fresh state arrays (a fetched array keeps its value, and would not be fetched again).
                trainer.step(task.batch(3 + r, 64)).result(600)
                path = os.path.join(root, f"{name}-{r}")
                results[name].append(way(ctx, trainer, path))
                shutil.rmtree(path, ignore_errors=True)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {results[n][-1]['wall_s'] * 1e3:.0f} ms" for n in results), flush=True)
        backend = ctx.backend
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    summary = {name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
               for name, runs in results.items()}
    print()
    print(f"Saving a checkpoint ({backend}, {parameters:,} parameters, AdamW: {parameters * 12:,} bytes of float32 "
          f"state; DataParallel over {args.executors} executors; median of {args.rounds} rounds, order alternating)")
    print_table(["way", "until on disk ms", "call returns after ms", "bytes to the client", "bytes on disk"],
                [[name, f"{s['wall_s'] * 1e3:.1f}", f"{s['call_s'] * 1e3:.1f}", f"{int(s['client_bytes']):,}",
                  f"{int(s['file_bytes']):,}"] for name, s in summary.items()])
    ratio = summary["executors"]["wall_s"] / summary["client"]["wall_s"]
    print(f"executors / client, time until on disk: {ratio:.2f}")
    path = write_results("checkpoint", {"backend": backend, "parameters": parameters, "rounds": results,
                                        "summary": summary, "ratio_wall": ratio,
                                        "config": {"width": cfg.width, "depth": cfg.depth,
                                                   "executors": args.executors}})
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
