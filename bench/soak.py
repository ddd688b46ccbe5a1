"""Soak: train the example Transformer for a bounded time with a fault every few seconds, and check that every
fault was recovered, the losses are those of an unbroken run, and nothing leaked.

Faults, in turn, on an executor other than executor-0 (taken in turn too): SIGKILL of its process, and
SIGSTOP held past the heartbeat timeout (continued after its replacement registered: the old incarnation
must go away by itself). The trainer writes a checkpoint every ``--checkpoint-every`` steps (the executors
write it) and recovers by itself (docs/faults.md). Reported: steps completed, faults, recoveries, steps
run again and recomputed, the loss curve against an unbroken run of the same steps (same seed, same
batches: on this runtime they should be equal), and the executors' object-store bytes at the end
against the start.

    .venv/bin/python -m bench.soak [--minutes 2] [--fault-every-s 20] [--executors 2] [--backend eager]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import shutil
import signal
import tempfile
import threading
import time

import torch

import pathways_torch as pw
from bench.common import print_table, write_results
from bench.train import ReverseTask, loss_fn, make_config, make_model

__all__ = ["main"]

IN_FLIGHT = 4          # steps dispatched ahead of the loss the loop reads (as the example does)


class FaultInjector:
    """Every ``every_s`` seconds, one fault on the next executor after executor-0 (SIGKILL, then SIGSTOP, ...)."""

    def __init__(self, ctx, every_s: float, hold_s: float):
        self._ctx, self._every_s, self._hold_s = ctx, every_s, hold_s
        self._kinds = itertools.cycle(["SIGKILL", "SIGSTOP"])
        self._victims = itertools.cycle(ctx.executor_ids[1:] or ctx.executor_ids)
        self.faults: list[dict] = []
        self.stopped: list[int] = []         # SIGSTOPped pids, continued later (they must exit)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        for pid in self.stopped:
            _signal(pid, signal.SIGCONT)

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            victim, kind = next(self._victims), next(self._kinds)
            resources = self._ctx.controller.resources
            info = resources.executors[victim]
            if info.lost:            # still being replaced: wait for the next turn
                continue
            _signal(info.pid, getattr(signal, kind))
            self.faults.append({"at_s": time.monotonic(), "kind": kind, "executor": victim, "pid": info.pid,
                                "epoch": info.epoch})
            print(f"fault: {kind} {victim} (pid {info.pid}, incarnation {info.epoch})", flush=True)
            if kind == "SIGSTOP":
                self.stopped.append(info.pid)
                self._continue_after_replacement(victim, info.epoch, info.pid)

    def _continue_after_replacement(self, victim: str, epoch: int, pid: int) -> None:
        deadline = time.monotonic() + self._hold_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if self._ctx.controller.resources.executors[victim].epoch > epoch:
                break
            time.sleep(0.2)
        _signal(pid, signal.SIGCONT)


def _signal(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _store_bytes(ctx) -> dict:
    ctx._flush_frees()
    time.sleep(0.5)      # the frees reach the executors
    return {e: s["store_bytes"] for e, s in ctx.stats()["executors"].items()}


def _trainer(ctx, cfg, args, **options):
    torch.manual_seed(0)
    model, optimizer = make_model(cfg)
    return ctx.wrap(model, optimizer=optimizer, loss_fn=loss_fn, mesh=ctx.mesh({"data": args.executors}), seed=1,
                    **options)


def _train(trainer, task, steps: int | None, until: float | None, batch: int, start: int = 0) -> list[float]:
    """Steps on batches ``start``, ``start + 1`` ... with IN_FLIGHT dispatched ahead; until ``steps`` ran or the
    clock passes ``until``."""
    pending, losses = collections.deque(), []
    for i in itertools.count(start):
        if (steps is not None and i >= steps) or (until is not None and time.monotonic() >= until):
            break
        pending.append(trainer.step(task.batch(i, batch)))
        if len(pending) > IN_FLIGHT:
            losses.append(pending.popleft().result(600).item())
    losses += [loss.result(600).item() for loss in pending]
    return losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="how long the faulty run trains")
    parser.add_argument("--fault-every-s", type=float, default=20.0)
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--backend", default=None, help="default: the default backend (XLA)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=3.0)
    args = parser.parse_args(argv)
    cfg = make_config(args)
    task = ReverseTask(cfg, 0)
    directory = tempfile.mkdtemp(prefix="pathways-soak-")
    try:
        with pw.Context(num_executors=args.executors, backend=args.backend,
                        heartbeat_timeout_s=args.heartbeat_timeout_s) as ctx:
            trainer = _trainer(ctx, cfg, args, checkpoint_dir=directory, checkpoint_every=args.checkpoint_every)
            first = _train(trainer, task, steps=1, until=None, batch=args.batch)   # compiled, state placed
            start_bytes = _store_bytes(ctx)
            faults = FaultInjector(ctx, args.fault_every_s, hold_s=4 * args.heartbeat_timeout_s + 30)
            began = time.monotonic()
            faults.start()
            try:
                losses = first + _train(trainer, task, steps=None, until=began + args.minutes * 60, batch=args.batch,
                                        start=1)
            finally:
                faults.stop()
            took = time.monotonic() - began
            stats = trainer.stats()
            time.sleep(2 * args.heartbeat_timeout_s)   # continued old incarnations exit
            leftover = [pid for pid in faults.stopped if _alive(pid)]
            if trainer._checkpoint is not None:   # a save in flight holds the state it writes: let it end
                trainer._checkpoint.exception()
            end_bytes = _store_bytes(ctx)
            unbroken = _trainer(ctx, cfg, args)
            expected = _train(unbroken, task, steps=len(losses), until=None, batch=args.batch)
            backend = ctx.backend
            epochs = {info.executor_id: info.epoch for info in ctx.controller.resources.ordered()}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    equal = sum(a == b for a, b in zip(losses, expected))
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    print()
    print(f"Soak ({backend}, {args.executors} executors, {took:.0f} s of training, a fault every "
          f"{args.fault_every_s:g} s, checkpoint every {args.checkpoint_every} steps)")
    print_table(["steps", "faults", "recoveries", "steps run again", "steps recomputed", "recovery s (sum)",
                 "losses equal to unbroken", "largest loss difference", "old incarnations left"],
                [[len(losses), len(faults.faults), stats["recoveries"], stats["steps_rerun"],
                  stats["steps_recomputed"], f"{stats['recovery_seconds']:.1f}", f"{equal}/{len(losses)}",
                  f"{worst:.2e}", len(leftover)]])
    print_table(["executor", "incarnations", "store bytes at start", "store bytes at end"],
                [[e, epochs[e], f"{start_bytes.get(e, 0):,}", f"{end_bytes.get(e, 0):,}"] for e in sorted(epochs)])
    curve = [(i, losses[i], expected[i]) for i in range(0, len(losses), max(1, len(losses) // 8))]
    print_table(["step", "loss (faults)", "loss (unbroken)"], [[i + 1, f"{a:.4f}", f"{b:.4f}"] for i, a, b in curve])
    path = write_results("soak", {"backend": backend, "seconds": took, "steps": len(losses), "faults": faults.faults,
                                  "stats": stats, "losses": losses, "unbroken": expected, "equal": equal,
                                  "largest_difference": worst, "store_bytes_start": start_bytes,
                                  "store_bytes_end": end_bytes, "old_incarnations_left": leftover,
                                  "args": vars(args)})
    print(f"written to {path}")
    return 0 if stats["recoveries"] >= len(faults.faults) and not leftover else 1


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
