"""Soak: train the example Transformer for a bounded time with a fault every few seconds, and check that every
fault was recovered, the losses are those of an unbroken run, and nothing leaked.

Faults, in turn, on an executor other than executor-0 (taken in turn too): SIGKILL of its process, and
SIGSTOP held past the heartbeat timeout (continued after its replacement registered: the old incarnation
must go away by itself); with ``--islands``, training across islands joined by a link, a cut of that link
too (every connection through it reset, the frames in flight dropped: the transfers they carried are
not acknowledged and fail their step, both executors alive). The trainer writes a checkpoint every ``--checkpoint-every`` steps (the executors
write it) and recovers by itself (docs/faults.md). Reported: steps completed, faults, recoveries, steps
run again and recomputed, the loss curve against an unbroken run of the same steps (same seed, same
batches: on this runtime they should be equal), the executors' object-store bytes at the end
against the start, and how every executor process of the run ended (`executor_exits`). It exits 1 (`verdict`, each
reason printed) when a fault was not recovered, an old incarnation is left, a loss differs from the unbroken run's
at all, an executor's store ends larger than it started by more than the losses the trainer still keeps
(`kept_loss_bytes`: those of the steps since its last checkpoint, held to be run again), or an executor ended in a
way no fault of the soak explains (a survivor's SIGSEGV, issue 47: recovered from, it had passed unnoticed).

    .venv/bin/python -m bench.soak [--minutes 2] [--fault-every-s 20] [--executors 2] [--backend eager]
    .venv/bin/python -m bench.soak --islands 1,1 [--link-delay-ms 20] [--transfer-timeout-s 3]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import math
import os
import shutil
import signal
import tempfile
import threading
import time

import torch

import pathways_torch as pw
from bench.common import add_backend_argument, add_model_arguments, print_table, write_results
from bench.train_setup import ReverseTask, loss_fn, make_config, make_model
from pathways_torch.islands import ISLAND_AXIS
from pathways_torch.local.cluster import describe_exit
from pathways_torch.wire.process_state import is_gone
from tests.handles import cluster_of, controller_of

__all__ = ["main", "verdict", "kept_loss_bytes", "executor_exits"]

IN_FLIGHT = 4          # steps dispatched ahead of the loss the loop reads (as the example does)


CUT = "cut link"


class FaultInjector:
    """Every ``every_s`` seconds, one fault: on the next executor after executor-0, SIGKILL, then SIGSTOP; then a cut
    of the link between islands, when there is one. Each fault notes the trainer's recoveries and the calls failed by lost transfers
    so far (the next fault's counts, less these, are this fault's)."""

    def __init__(self, ctx, trainer, every_s: float, hold_s: float):
        self._ctx, self._trainer, self._every_s, self._hold_s = ctx, trainer, every_s, hold_s
        self._kinds = itertools.cycle(["SIGKILL", "SIGSTOP"] + ([CUT] if ctx.link is not None else []))
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
            kind = next(self._kinds)
            if kind == CUT:
                self._note(kind, "link", None, None)
                self._ctx.link.cut()
                print("fault: the link between the islands is cut", flush=True)
                continue
            victim = next(self._victims)
            resources = controller_of(self._ctx).resources
            info = resources.executors[victim]
            if info.lost:            # still being replaced: wait for the next turn
                continue
            self._note(kind, victim, info.pid, info.epoch)
            _signal(info.pid, getattr(signal, kind))
            print(f"fault: {kind} {victim} (pid {info.pid}, incarnation {info.epoch})", flush=True)
            if kind == "SIGSTOP":
                self.stopped.append(info.pid)
                self._continue_after_replacement(victim, info.epoch, info.pid)

    def _note(self, kind: str, victim: str, pid, epoch) -> None:
        self.faults.append({"at_s": time.monotonic(), "kind": kind, "executor": victim, "pid": pid, "epoch": epoch,
                            "recoveries_before": self._trainer.stats()["recoveries"],
                            "failed_calls_before": controller_of(self._ctx).completion.calls_failed_by_lost_transfers})

    def per_fault(self, recoveries: int, failed_calls: int) -> list[dict]:
        """Each fault with the recoveries and lost transfers that came after it, before the next fault."""
        ends = [(f["recoveries_before"], f["failed_calls_before"]) for f in self.faults[1:]]
        ends.append((recoveries, failed_calls))
        return [{**f, "recoveries": r - f["recoveries_before"], "failed_calls": t - f["failed_calls_before"]}
                for f, (r, t) in zip(self.faults, ends)]

    def _continue_after_replacement(self, victim: str, epoch: int, pid: int) -> None:
        deadline = time.monotonic() + self._hold_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if controller_of(self._ctx).resources.executors[victim].epoch > epoch:
                break
            time.sleep(0.2)
        _signal(pid, signal.SIGCONT)


def _signal(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kept_loss_bytes(trainer) -> dict[str, int]:
    """The bytes each executor holds for the losses of the steps the trainer keeps (since its last checkpoint, to
    run them again after a fault): what its store may hold beyond what it held at the start."""
    held: collections.Counter = collections.Counter()
    recovery = getattr(trainer, "_recovery", None)
    for kept in list(recovery.kept if recovery is not None else ()):
        array = kept.loss.array
        if array.failure is not None:
            continue                    # a failed step's loss holds no bytes
        nbytes = math.prod(array.block_shape) * array.dtype.itemsize
        for executor_id in set(array.mesh.executor_ids):
            held[executor_id] += nbytes
    return dict(held)


def executor_exits(incarnations, faults: list[dict]) -> list[dict]:
    """How each executor process of the run (``incarnations``: (executor id, process) pairs, every incarnation, with
    Popen's ``poll``) has ended so far, the fault of ours that hit it ("" for none), and whether that fault explains
    the ending: a SIGKILLed process died of SIGKILL; a SIGSTOPped one, continued, left by itself (code >= 0); one no
    fault touched is still running. Anything else (a SIGSEGV, an exit with an error) is a failure of the runtime."""
    hit = {fault["pid"]: fault["kind"] for fault in faults if fault.get("pid") is not None}
    exits = []
    for executor_id, process in incarnations:
        code, kind = process.poll(), hit.get(process.pid, "")
        exits.append({"executor": executor_id, "pid": process.pid, "code": code, "injected": kind,
                      "ended": "running" if code is None else describe_exit(code),
                      "explained": _explained(kind, code)})
    return exits


def _explained(kind: str, code: int | None) -> bool:
    if code is None:
        return True     # running (an old incarnation still running is `leftover`'s to report)
    if kind == "SIGKILL":
        return code == -signal.SIGKILL
    if kind == "SIGSTOP":
        return code >= 0
    return False


def verdict(*, losses: list[float], expected: list[float], start_bytes: dict, end_bytes: dict, kept_start: dict,
            kept_end: dict, per_fault: list[dict], leftover: list[int], exits: list[dict] = ()) -> list[str]:
    """Why the soak failed, one line each; empty if it passed. A store may end larger than it started only by
    the kept losses' bytes it gained (``kept_end`` less ``kept_start``, per executor). ``exits``: `executor_exits`."""
    problems = [f"{e['executor']} (pid {e['pid']}) {e['ended']}, " +
                (f"after the soak's {e['injected']}" if e["injected"] else "which no fault of the soak injected") +
                ": see its log" for e in exits if not e["explained"]]
    unrecovered = [f for f in per_fault if not f["recoveries"] and not _harmless(f)]
    if unrecovered:
        problems.append(f"{len(unrecovered)} fault(s) not recovered: "
                        f"{', '.join(f['kind'] + ' ' + f['executor'] for f in unrecovered)}")
    if leftover:
        problems.append(f"old incarnations still running: pids {leftover}")
    if len(losses) != len(expected):
        problems.append(f"{len(losses)} losses against {len(expected)} of the unbroken run")
    differ = [i for i, (a, b) in enumerate(zip(losses, expected)) if a != b]
    if differ:
        i = differ[0]
        problems.append(f"{len(differ)} loss(es) differ from the unbroken run's; the first at step {i + 1}: "
                        f"{losses[i]!r}, expected {expected[i]!r}")
    for executor_id in sorted(end_bytes):
        allowed = start_bytes.get(executor_id, 0) + kept_end.get(executor_id, 0) - kept_start.get(executor_id, 0)
        if end_bytes[executor_id] > allowed:
            problems.append(f"{executor_id}'s store ended at {end_bytes[executor_id]:,} bytes, expected at most "
                            f"{allowed:,} (start {start_bytes.get(executor_id, 0):,}, kept losses "
                            f"{kept_start.get(executor_id, 0)} -> {kept_end.get(executor_id, 0)} bytes): "
                            f"{end_bytes[executor_id] - allowed:,} bytes leaked")
    return problems


def _store_bytes(ctx) -> dict:
    ctx.flush_frees()
    time.sleep(0.5)      # the frees reach the executors
    return {e: s["store_bytes"] for e, s in ctx.stats()["executors"].items()}


def _trainer(ctx, cfg, args, **options):
    torch.manual_seed(0)
    model, optimizer = make_model(cfg)
    if args.islands:        # data parallel across the islands and inside each
        mesh = ctx.mesh({ISLAND_AXIS: len(args.islands), "data": args.islands[0]})
        options["plan"] = pw.DataParallel((ISLAND_AXIS, "data"))
    else:
        mesh = ctx.mesh({"data": args.executors})
    return ctx.wrap(model, optimizer=optimizer, loss_fn=loss_fn, mesh=mesh, seed=1, **options)


def _islands(text: str) -> list[int]:
    sizes = [int(n) for n in text.split(",")]
    if len(sizes) < 2 or len(set(sizes)) != 1 or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"--islands: expected equal island sizes such as 1,1 or 2,2, got {text!r}")
    return sizes


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
    add_backend_argument(parser, help="default: the default backend (XLA)")
    add_model_arguments(parser, width=64, depth=2, batch=16)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=3.0)
    parser.add_argument("--islands", type=_islands, default=None,
                        help="executors per island, e.g. 1,1: train across islands joined by a link (and cut it)")
    parser.add_argument("--link-delay-ms", type=float, default=20.0, help="one-way delay of the link (--islands)")
    parser.add_argument("--transfer-timeout-s", type=float, default=3.0,
                        help="how long a transfer waits for its acknowledgement before it is lost (--islands)")
    args = parser.parse_args(argv)
    cfg = make_config(args)
    task = ReverseTask(cfg, 0)
    directory = tempfile.mkdtemp(prefix="pathways-soak-")
    try:
        topology = (dict(islands=args.islands, link=pw.Link(delay_s=args.link_delay_ms / 1000, shaping="relay"),
                         transfer_timeout_s=args.transfer_timeout_s) if args.islands else
                    dict(num_executors=args.executors))
        with pw.Context(backend=args.backend, heartbeat_timeout_s=args.heartbeat_timeout_s, **topology) as ctx:
            trainer = _trainer(ctx, cfg, args, checkpoint_dir=directory, checkpoint_every=args.checkpoint_every)
            first = _train(trainer, task, steps=1, until=None, batch=args.batch)   # compiled, state placed
            start_bytes, kept_start = _store_bytes(ctx), kept_loss_bytes(trainer)
            faults = FaultInjector(ctx, trainer, args.fault_every_s, hold_s=4 * args.heartbeat_timeout_s + 30)
            began = time.monotonic()
            faults.start()
            try:
                losses = first + _train(trainer, task, steps=None, until=began + args.minutes * 60, batch=args.batch,
                                        start=1)
            finally:
                faults.stop()
            took = time.monotonic() - began
            stats = trainer.stats()
            per_fault = faults.per_fault(stats["recoveries"],
                                         controller_of(ctx).completion.calls_failed_by_lost_transfers)
            time.sleep(2 * args.heartbeat_timeout_s)   # continued old incarnations exit
            leftover = [pid for pid in faults.stopped if not is_gone(pid)]
            exits = executor_exits(_incarnations(ctx), faults.faults)
            if trainer._checkpoint is not None:   # a save in flight holds the state it writes: let it end
                trainer._checkpoint.exception()
            end_bytes, kept_end = _store_bytes(ctx), kept_loss_bytes(trainer)
            unbroken = _trainer(ctx, cfg, args)
            expected = _train(unbroken, task, steps=len(losses), until=None, batch=args.batch)
            backend = ctx.backend
            epochs = {info.executor_id: info.epoch for info in controller_of(ctx).resources.ordered()}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    equal = sum(a == b for a, b in zip(losses, expected))
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    print()
    where = (f"islands {'+'.join(map(str, args.islands))} joined by a {args.link_delay_ms:g} ms link" if args.islands
             else f"{args.executors} executors")
    print(f"Soak ({backend}, {where}, {took:.0f} s of training, a fault every "
          f"{args.fault_every_s:g} s, checkpoint every {args.checkpoint_every} steps)")
    print_table(["steps", "faults", "recoveries", "steps run again", "steps recomputed", "recovery s (sum)",
                 "losses equal to unbroken", "largest loss difference", "old incarnations left"],
                [[len(losses), len(faults.faults), stats["recoveries"], stats["steps_rerun"],
                  stats["steps_recomputed"], f"{stats['recovery_seconds']:.1f}", f"{equal}/{len(losses)}",
                  f"{worst:.2e}", len(leftover)]])
    print_table(["fault", "kind", "on", "at s", "calls failed by lost transfers", "recoveries", "recovered"],
                [[i + 1, f["kind"], f["executor"], f"{f['at_s'] - began:.0f}", f["failed_calls"], f["recoveries"],
                  "yes" if f["recoveries"] else "nothing to recover" if _harmless(f) else "NO"]
                 for i, f in enumerate(per_fault)])
    print_table(["executor", "incarnations", "store bytes at start", "store bytes at end", "kept losses' bytes "
                 "(start -> end)"],
                [[e, epochs[e], f"{start_bytes.get(e, 0):,}", f"{end_bytes.get(e, 0):,}",
                  f"{kept_start.get(e, 0)} -> {kept_end.get(e, 0)}"] for e in sorted(epochs)])
    curve = [(i, losses[i], expected[i]) for i in range(0, len(losses), max(1, len(losses) // 8))]
    print_table(["step", "loss (faults)", "loss (unbroken)"], [[i + 1, f"{a:.4f}", f"{b:.4f}"] for i, a, b in curve])
    print_table(["executor", "pid", "fault injected", "ended", "explained"],
                [[e["executor"], e["pid"], e["injected"] or "-", e["ended"], "yes" if e["explained"] else "NO"]
                 for e in exits])
    problems = verdict(losses=losses, expected=expected, start_bytes=start_bytes, end_bytes=end_bytes,
                       kept_start=kept_start, kept_end=kept_end, per_fault=per_fault, leftover=leftover, exits=exits)
    path = write_results("soak", {"backend": backend, "seconds": took, "steps": len(losses), "faults": per_fault,
                                  "stats": stats, "losses": losses, "unbroken": expected, "equal": equal,
                                  "largest_difference": worst, "store_bytes_start": start_bytes,
                                  "store_bytes_end": end_bytes, "old_incarnations_left": leftover,
                                  "kept_loss_bytes_start": kept_start, "kept_loss_bytes_end": kept_end,
                                  "executor_exits": exits,
                                  "problems": problems, "args": vars(args)})
    print(f"written to {path}")
    for problem in problems:
        print("FAILED:", problem)
    print("soak:", "FAILED" if problems else "passed (exit 0)")
    return 1 if problems else 0


def _incarnations(ctx) -> list:
    """Every executor process the context's local cluster started, replaced ones first, with its executor id."""
    cluster = cluster_of(ctx)   # no public view of the processes: a benchmark's look
    return [*cluster.replaced_incarnations(), *zip(cluster.executor_ids, cluster.processes)]


def _harmless(fault: dict) -> bool:
    """A cut that failed no call (no transfer in flight, or only acknowledgements lost: ZeroMQ reconnects) leaves
    nothing to recover."""
    return fault["kind"] == CUT and fault["failed_calls"] == 0


if __name__ == "__main__":
    raise SystemExit(main())
