"""Train a byte-level GPT on real text — by default the Python standard library's own sources.

    python examples/train_gpt.py                          # 2 executors, the default backend (XLA)
    python examples/train_gpt.py --text-dir ~/books --steps 2000
    python examples/train_gpt.py --mesh data=2,model=2 --plan tp   # layers split over 'model', data parallel beside

The text is on every machine with Python (found through ``sysconfig``); ``--text-dir``
takes any folder of text files. The bytes are split into a training and a validation
stream (the last ``--val-fraction``). The model is the nanoGPT-style GPT of
``gpt.py`` next to this file; the loop keeps steps in flight, shows a tqdm bar,
measures the validation loss with ``trainer.evaluate`` every ``--eval-every`` steps,
writes a checkpoint, and at the end samples text with ``trainer.predict`` through a
fixed window (the last ``--context`` bytes, left-padded), so sampling compiles once.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pathways_torch as pw  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

IN_FLIGHT = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text-dir", default=None, help="a folder of text (default: the standard library's sources)")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="read at most this much text")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--executors", type=int, default=2, help="the data axis, when --mesh is not given")
    p.add_argument("--mesh", default=None, help="axes and sizes, e.g. data=2,model=2 (default: data=--executors)")
    p.add_argument("--plan", choices=("dp", "sdp", "tp"), default="dp",
                   help="data parallel, sharded data parallel, or tensor parallel on the 'model' axis "
                        "(pw.tensor_parallel_plan's proposal) with data parallel on 'data'")
    p.add_argument("--backend", choices=pw.BACKEND_NAMES, default=None)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--context", type=int, default=64, help="bytes per sequence")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--sample-bytes", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=os.path.join("checkpoints", "train_gpt"))
    args = p.parse_args(argv)
    args.mesh = parse_mesh(args.mesh) if args.mesh else {"data": args.executors}
    if args.plan == "tp" and "model" not in args.mesh:
        p.error("--plan tp: give the mesh a model axis, e.g. --mesh data=2,model=2")
    if args.plan != "tp" and set(args.mesh) != {"data"}:
        p.error(f"--plan {args.plan}: give the mesh a data axis only, e.g. --mesh data=4")
    return args


def parse_mesh(text: str) -> dict:
    """``data=2,model=2`` → {"data": 2, "model": 2}."""
    try:
        return {name.strip(): int(size) for name, size in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise SystemExit(f"--mesh: expected axis=size pairs like data=2,model=2, got {text!r}") from None


def make_plan(args, model):
    data = {"dp": pw.DataParallel("data"), "sdp": pw.ShardedDataParallel("data")}
    if args.plan != "tp":
        return data[args.plan]
    proposal = pw.tensor_parallel_plan(model, args.mesh["model"])
    print(f"tensor-parallel plan:\n{proposal}")
    return pw.TensorParallel(proposal, data=data["dp"] if args.mesh.get("data", 1) > 1 else None)


def read_text(folder: str | None, max_bytes: int) -> bytes:
    """Text files under ``folder`` (default: the standard library), in a fixed order, up to ``max_bytes``."""
    folder = folder or sysconfig.get_paths()["stdlib"]
    suffixes = (".py", ".txt", ".md", ".rst") if folder == sysconfig.get_paths()["stdlib"] else None
    chunks, total = [], 0
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__", "test", "tests"))
        for name in sorted(files):
            if suffixes is not None and not name.endswith(suffixes):
                continue
            try:
                with open(os.path.join(root, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if b"\0" in data:
                continue        # not text
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    if not chunks:
        raise SystemExit(f"--text-dir: found no text under {folder}")
    return b"".join(chunks)


class ByteStream:
    """Random windows of a byte string: (inputs, next bytes) batches, reproducible by step."""

    def __init__(self, data: bytes, context: int, seed: int):
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
        self.context, self.seed = context, seed

    def batch(self, index: int, size: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        starts = torch.randint(0, len(self.data) - self.context - 1, (size,), generator=g)
        rows = torch.stack([self.data[s:s + self.context + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]


def learning_rate(args, step: int) -> float:
    import math

    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def validation_loss(trainer, stream: ByteStream, args) -> float:
    losses = [trainer.evaluate(stream.batch(i, args.batch_size)) for i in range(args.eval_batches)]
    return sum(loss.result().item() for loss in losses) / len(losses)


def sample(trainer, prompt: bytes, args) -> bytes:
    """Greedy-free sampling through a fixed window: the same batch shape every call, so one compile."""
    shards = args.mesh.get("data", 1)
    window = torch.zeros(shards, args.context, dtype=torch.int64)   # every row the same: the axis divides it
    text = bytearray(prompt)
    g = torch.Generator().manual_seed(args.seed)
    for _ in range(args.sample_bytes):
        recent = torch.tensor(list(text[-args.context:]), dtype=torch.int64)
        window[:] = 0
        window[:, args.context - len(recent):] = recent                  # left-padded with byte 0
        logits, _ = trainer.predict((window,))
        last = logits.result()[0, -1].float()
        text.append(int(torch.multinomial(torch.softmax(last / 0.8, dim=-1), 1, generator=g)))
    return bytes(text[len(prompt):])


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    began = time.perf_counter()
    data = read_text(args.text_dir, args.max_bytes)
    split = int(len(data) * (1 - args.val_fraction))
    train_stream, val_stream = ByteStream(data[:split], args.context, args.seed), ByteStream(data[split:],
                                                                                            args.context, args.seed + 1)
    cfg = GPTConfig(vocab=256, context=args.context, width=args.width, depth=args.depth, heads=args.heads,
                    dropout=args.dropout)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    print(f"text: {len(data):,} bytes ({split:,} train, {len(data) - split:,} validation); model: "
          f"{sum(p.numel() for p in model.parameters()):,} parameters; mesh {args.mesh}")
    executors = 1
    for size in args.mesh.values():
        executors *= size
    with pw.Context(num_executors=executors, backend=args.backend) as ctx:
        print(f"backend: {ctx.backend}")
        trainer = ctx.wrap(model, optimizer=optimizer, mesh=ctx.mesh(args.mesh), plan=make_plan(args, model),
                           max_grad_norm=1.0, seed=args.seed)
        val = train(args, trainer, train_stream, val_stream)
        path = trainer.save(args.checkpoint)
        text = sample(trainer, b"def ", args)
    print(f"validation loss: {val:.3f} nats/byte ({val / 0.6931:.2f} bits/byte)")
    print(f"checkpoint: {os.path.abspath(path)}")
    print(f"sample:\n{(b'def ' + text).decode('utf-8', errors='replace')}")
    print(f"total time: {time.perf_counter() - began:.0f} s")
    return 0


def train(args, trainer, train_stream: ByteStream, val_stream: ByteStream) -> float:
    pending, val = [], float("nan")
    bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True)
    bar.set_description("first step: capture + compile")
    for step in range(args.steps):
        for group in trainer.optimizer.param_groups:
            group["lr"] = learning_rate(args, step)
        pending.append(trainer.step(train_stream.batch(step, args.batch_size)))
        while len(pending) > IN_FLIGHT or (step == args.steps - 1 and pending):
            loss = pending.pop(0).result().item()
            bar.set_description("train")
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", val=f"{val:.3f}")
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            val = validation_loss(trainer, val_stream, args)
            bar.set_postfix(val=f"{val:.3f}")
    bar.close()
    return val


if __name__ == "__main__":
    sys.exit(main())
