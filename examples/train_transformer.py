"""Train a decoder-only Transformer to reverse sequences, data-parallel on local executors.

    python examples/train_transformer.py                       # 2 executors, XLA, DataParallel
    python examples/train_transformer.py --plan sharded --executors 4 --backend eager
    python examples/train_transformer.py --plan pipeline --stages 2 --microbatches 8 --timeline step.png
    python examples/train_transformer.py --islands 2,2 --link-delay-ms 2 --link-mb-s 100 --timeline islands.png

The task and model are in ``transformer.py`` next to this file. The loop keeps a
few steps in flight: it reads the loss of step k-4 while steps k-3..k run, so the
client never waits on the executors except to show progress. At the end the
trained weights come back to this process, held-out accuracy is measured here,
and a checkpoint is written (``--resume`` continues from it).
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pathways_torch as pw  # noqa: E402
from transformer import DecoderOnlyTransformer, ReverseTask, TransformerConfig, loss_fn  # noqa: E402

IN_FLIGHT = 4           # steps dispatched ahead of the one whose loss is shown
HELD_OUT_SEED = 10_007  # never used for training batches


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--executors", type=int, default=2, help="local executor processes (the data axis)")
    p.add_argument("--plan", choices=("data", "sharded", "pipeline"), default="data",
                   help="data: pw.DataParallel; sharded: pw.ShardedDataParallel (ZeRO-3-like); pipeline: "
                        "pw.Pipeline over --stages (x a data axis of executors/stages)")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (--plan pipeline)")
    p.add_argument("--microbatches", type=int, default=8, help="pipeline microbatches per batch (--plan pipeline)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), default="1f1b",
                   help="pipeline schedule (--plan pipeline; interleaved uses 2 virtual stages)")
    p.add_argument("--timeline", default=None, help="--plan pipeline or --islands: draw the last step to this PNG")
    p.add_argument("--islands", default=None,
                   help="local islands, executors per island, e.g. 2,2: data parallel across them (plan data or "
                        "sharded), or pipeline stages spread over them (plan pipeline)")
    p.add_argument("--link-delay-ms", type=float, default=0.0, help="--islands: one-way delay of the link")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="--islands: size of the gradient buckets exchanged between islands, MB")
    p.add_argument("--link-mb-s", type=float, default=None, help="--islands: bandwidth of the link, MB/s")
    p.add_argument("--backend", choices=pw.BACKEND_NAMES, default=None,
                   help="default: XLA on CPU (the installed route, xla:torchax or xla:torch_xla), inductor on CUDA")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per executor, NCCL collectives (use --backend inductor)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--length", type=int, default=12, help="symbols to reverse (context = 2 x length)")
    p.add_argument("--vocab", type=int, default=24)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then cosine decay to 10%%")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=os.path.join("checkpoints", "train_transformer"))
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 if held-out accuracy ends below this")
    return p.parse_args(argv)


def make_plan(args, ctx):
    """The mesh and the plan: a data axis over every executor, or pipe stages x a data axis; with --islands,
    data parallel across the islands, or the stages spread over them."""
    if args.islands:
        return make_island_plan(args, ctx)
    if args.plan != "pipeline":
        plan = pw.DataParallel("data") if args.plan == "data" else pw.ShardedDataParallel("data")
        return ctx.mesh({"data": args.executors}), plan
    if args.executors % args.stages:
        raise SystemExit(f"--executors {args.executors} is not a multiple of --stages {args.stages}")
    data = args.executors // args.stages
    axes = {"pipe": args.stages, **({"data": data} if data > 1 else {})}
    virtual = 2 if args.schedule == "interleaved" else 1
    return ctx.mesh(axes), pw.Pipeline(microbatches=args.microbatches, schedule=args.schedule,
                                       virtual_stages=virtual, data=pw.DataParallel("data") if data > 1 else None)


def make_island_plan(args, ctx):
    sizes = [int(n) for n in args.islands.split(",")]
    if len(set(sizes)) != 1:
        raise SystemExit(f"--islands {args.islands}: every island needs the same number of executors")
    count, per = len(sizes), sizes[0]
    if args.plan == "pipeline":
        if per % args.stages and args.stages % count:
            raise SystemExit(f"--plan pipeline --stages {args.stages} over {count} islands of {per}")
        stages_per_island = max(1, args.stages // count)
        data = per // stages_per_island
        axes = {"island": count, "pipe": stages_per_island, **({"data": data} if data > 1 else {})}
        return ctx.mesh(axes), pw.Pipeline(microbatches=args.microbatches, schedule=args.schedule,
                                           data=pw.DataParallel("data") if data > 1 else None)
    kind = pw.DataParallel if args.plan == "data" else pw.ShardedDataParallel
    return ctx.mesh({"island": count, "data": per}), kind(("island", "data"), bucket_mb=args.bucket_mb)


def learning_rate(args, step: int) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    cfg = TransformerConfig(vocab=args.vocab, length=args.length, width=args.width, depth=args.depth,
                            heads=args.heads, dropout=args.dropout)
    model = DecoderOnlyTransformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    task, held_out = ReverseTask(cfg, args.seed), ReverseTask(cfg, HELD_OUT_SEED)
    num_params = sum(p.numel() for p in model.parameters())
    islands = [int(n) for n in args.islands.split(",")] if args.islands else None
    if islands is not None:
        args.executors = sum(islands)
    print(f"model: {num_params:,} parameters (width {cfg.width}, depth {cfg.depth}); task: reverse "
          f"{cfg.length} symbols of {cfg.vocab - 2}; {args.executors} executors, plan {args.plan}")
    link = (pw.Link(delay_s=args.link_delay_ms / 1e3,
                    bandwidth_bytes_per_s=args.link_mb_s * 1e6 if args.link_mb_s else None) if islands else None)
    with pw.Context(num_executors=args.executors, backend=args.backend, device=args.device, islands=islands,
                    link=link) as ctx:
        print(f"backend: {ctx.backend}")
        if islands:
            print(ctx.islands())
        mesh, plan = make_plan(args, ctx)
        trainer = ctx.wrap(model, optimizer=optimizer, loss_fn=loss_fn, mesh=mesh, plan=plan,
                           max_grad_norm=args.max_grad_norm, seed=args.seed)
        if args.resume:
            meta = trainer.load(args.checkpoint)
            print(f"resumed from {args.checkpoint} at step {meta['step']}")
        losses = train(args, trainer, task, cfg)
        if args.plan == "pipeline":
            print(trainer.runner.stages)
            print(trainer.runner.schedule)
        if args.timeline and (args.plan == "pipeline" or islands):
            print(f"timeline of the last step: {trainer.runner.timeline(args.timeline)}")
        state = trainer.state_dict()
        path = trainer.save(args.checkpoint)
        outside = {name: count for name, count in ctx.backend_counters("fallback_ops").items() if count}
        if ctx.backend.startswith("xla"):
            print(f"ops run outside XLA: {sum(outside.values())}" + (f" {outside}" if outside else ""))

    model.load_state_dict(state["model"])
    token_acc, sequence_acc = ReverseTask.accuracy(model, *held_out.batch(0, 1024))
    first, last = losses[0], sum(losses[-10:]) / len(losses[-10:])
    print(f"loss: {first:.3f} -> {last:.4f} (fell {first / last:.0f}x)")
    print(f"held-out accuracy (1024 sequences): {token_acc:.1%} of answer tokens, {sequence_acc:.1%} of "
          f"whole sequences")
    print(f"checkpoint: {os.path.abspath(path)}")
    return 0 if token_acc >= args.min_accuracy else 1


def train(args, trainer, task, cfg) -> list[float]:
    pending: collections.deque = collections.deque()
    losses: list[float] = []
    tokens_per_step = args.batch_size * cfg.context
    start_step = trainer.step_count
    first_done = [0.0]    # when the first step (capture + compile) finished: tokens/s counts from there
    bar = tqdm(total=args.steps, initial=start_step, unit="step", dynamic_ncols=True)
    bar.set_description("first step: capture + compile")   # seconds on XLA; cleared when it is done

    def settle(block: bool):
        while pending and (block or len(pending) > IN_FLIGHT):
            losses.append(pending.popleft().result().item())
            if len(losses) == 1:
                bar.set_description("train")
                first_done[0] = time.perf_counter()
            bar.update(1)
            elapsed = time.perf_counter() - first_done[0]
            rate = (len(losses) - 1) * tokens_per_step / elapsed if elapsed > 0 else 0.0
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{rate:,.0f}")

    for step in range(start_step, args.steps):
        for group in trainer.optimizer.param_groups:
            group["lr"] = learning_rate(args, step)
        pending.append(trainer.step(task.batch(step, args.batch_size)))
        settle(block=False)
    settle(block=True)
    bar.close()
    return losses


if __name__ == "__main__":
    sys.exit(main())
