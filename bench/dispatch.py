"""The paper's Figure 5: dispatch throughput of trivial gang-scheduled computations.

One computation = a scalar all-reduce (max) followed by a scalar add on all N
executors, its output feeding the next input. Modes:
- OpByOp: one client call per computation, awaited before the next;
- Chained: one client call runs a program of 128 such nodes (128 sequence numbers);
- Fused: one function holding 128 computations (one sequence number);
- Chained, pipelined: Chained calls, each fed the previous call's future without waiting
  for it (one wait per window), so the next run is queued on the executors while the
  current one computes — the control plane running ahead, as a Pathways client would.
  OpByOp, Chained and Fused await every call, as the issue defines them.
Baselines, with the same eager compute, the same gloo all-reduce and one thread per
process: multi-controller (N processes running the loop themselves); Ray actors when
``PATHWAYS_RAY_PYTHONPATH`` names a directory where Ray is importable (``pip install
--target DIR ray msgpack click jsonschema aiosignal frozenlist``); Monarch actors when
``PATHWAYS_MONARCH_PYTHONPATH`` names one where Monarch is (``pip install --target DIR
torchmonarch==0.7.0``, keeping the project's torch).

This machine's speed drifts by up to 30 % within a minute, so every system stays up
for the whole of one N and the timed windows alternate: each round times every
mode of ours and every baseline once, back to back, starting one window later each round
(the window after a switch runs slower). Outside its own windows a baseline's process
tree is stopped (SIGSTOP), so Ray's and Monarch's idle daemons do not slow the others'
windows; ours are never stopped. Rates are medians over rounds;
ratios are medians of the per-round ratios. The last column compares our OpByOp
with the faster of the Ray and Monarch OpByOp of the same round. Metric:
computations per second. Prints a table, writes bench/results/dispatch.json.

Collectives: our executors of one host reduce through one shared mapping (executor/shm_group.py, issue 49);
``--gloo-modes`` (default OpByOp,Chained) also runs those modes on a third context whose executors use gloo within
the host (``PATHWAYS_SHM_COLLECTIVES=0``, what they did before), its windows in the same rounds, and reports each
against the same mode on the shared mapping. The baselines keep gloo, as they would run.

Backends: our modes run on eager executors (like with like: the baselines compute with
eager torch). ``--xla-modes`` (default Chained) also runs those modes on a second
context with the default backend (XLA), its windows in the same rounds, and reports
each against the same mode on eager (the target: Chained within 10 % of eager).

    .venv/bin/python -m bench.dispatch [--sizes 1,2,4,8] [--steps 200] [--repeats 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics

import torch

import pathways_torch as pw
from bench.baseline_server import BaselineProcess
from bench.common import add_run_arguments, print_table, timed_calls, write_results
from bench.gloo_loop import CHAIN
from bench.multicontroller import MultiController



@pw.function(out=pw.Replicate())
def step(x):
    return pw.all_reduce(x, axis="data", op="max") + 1


@pw.function(out=pw.Replicate())
def fused(x):
    for _ in range(CHAIN):
        x = pw.all_reduce(x, axis="data", op="max") + 1
    return x


@pw.program
def chained(x):
    for _ in range(CHAIN):
        x = step(x)
    return x


MODES = ("OpByOp", "Chained", "Fused", "Chained pipelined")
BASELINES = {"ray": ("ray_baseline", "PATHWAYS_RAY_PYTHONPATH"),
             "monarch": ("monarch_baseline", "PATHWAYS_MONARCH_PYTHONPATH")}


class PathwaysLoops:
    """Our modes on one context's N executors, warmed up (traced, loaded, group formed)."""

    def __init__(self, ctx, size: int):
        mesh = ctx.mesh({"data": size})
        self.x = ctx.put(torch.zeros(()), mesh, [pw.Replicate()])
        for _ in range(3):
            self.x = step(self.x)
        for program in (chained, fused):
            program(self.x).exception(timeout_s=60)
        self.x.exception(timeout_s=60)

    def window(self, mode: str, count: int) -> float:
        """Computations per second: OpByOp runs ``count`` awaited computations; the others ``count`` calls."""
        if mode == "OpByOp":   # awaited: one computation per client call
            return count / timed_calls(step, self.x, count, awaited=True, timeout_s=60)
        run = fused if mode == "Fused" else chained
        return count * CHAIN / timed_calls(run, self.x, count, awaited=mode != "Chained pipelined", timeout_s=300)


def _xla_modes(args) -> list[str]:
    return _modes(args.xla_modes, "--xla-modes")


def _gloo_modes(args) -> list[str]:
    return _modes(args.gloo_modes, "--gloo-modes")


def _modes(text: str, flag: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"{flag}: expected names from {MODES}, got {unknown}")
    return modes


@contextlib.contextmanager
def _gloo_within_host():
    """Executors started inside use gloo even among themselves (the executor reads the switch at group formation;
    local executors take the client's environment when they start)."""
    from executor.shm_group import ENABLE_ENV

    before = os.environ.get(ENABLE_ENV)
    os.environ[ENABLE_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENABLE_ENV)
        else:
            os.environ[ENABLE_ENV] = before


def _baseline_processes(size: int, stack: contextlib.ExitStack) -> dict:
    """The Ray and Monarch servers for ``size`` whose environment variable is set."""
    processes = {}
    for name, (module, env_var) in BASELINES.items():
        path = os.environ.get(env_var)
        if path:
            print(f"N={size}: starting {name} ...", flush=True)
            processes[name] = stack.enter_context(BaselineProcess(module, size, path))
            processes[name].pause()   # stopped outside its own windows (see bench/baseline_server.py)
    return processes


def _one_round(ours: PathwaysLoops, loops: MultiController, baselines: dict, args, index: int,
               xla: PathwaysLoops | None = None, gloo: PathwaysLoops | None = None) -> dict:
    """Every window once. The order rotates from round to round: the window after a switch
    runs measurably slower (5-10 % after 200 OpByOp calls, measured), so no system may
    always sit in the same place."""
    windows = [(mode, lambda m=mode: ours.window(m, args.steps if m == "OpByOp" else args.repeats))
               for mode in MODES]
    if xla is not None:
        windows += [(f"{mode} (xla)", lambda m=mode: xla.window(m, args.steps if m == "OpByOp" else args.repeats))
                    for mode in _xla_modes(args)]
    if gloo is not None:
        windows += [(f"{mode} (gloo)", lambda m=mode: gloo.window(m, args.steps if m == "OpByOp" else args.repeats))
                    for mode in _gloo_modes(args)]
    windows.append(("multi-controller", lambda: loops.window(CHAIN * args.repeats)))
    for name, process in baselines.items():
        windows.append((f"{name} OpByOp", lambda p=process: p.window("OpByOp", args.steps)))
        windows.append((f"{name} Fused", lambda p=process: p.window("Fused", args.repeats)))
    shift = index % len(windows)
    rates = {key: window() for key, window in windows[shift:] + windows[:shift]}
    return {key: rates[key] for key, _ in windows}


def measure(size: int, args) -> dict:
    """Every system's rate per round, rounds interleaved; medians and per-round ratios."""
    with contextlib.ExitStack() as stack:
        ctx = stack.enter_context(pw.Context(num_executors=size, backend="eager"))
        ours = PathwaysLoops(ctx, size)
        xla = None
        if _xla_modes(args):
            xla_ctx = stack.enter_context(pw.Context(num_executors=size, backend="xla"))
            print(f"N={size}: our modes {_xla_modes(args)} on {xla_ctx.backend} too", flush=True)
            xla = PathwaysLoops(xla_ctx, size)
        gloo = None
        if _gloo_modes(args) and size > 1:
            with _gloo_within_host():
                gloo_ctx = stack.enter_context(pw.Context(num_executors=size, backend="eager"))
            gloo = PathwaysLoops(gloo_ctx, size)
            print(f"N={size}: our modes {_gloo_modes(args)} with gloo within the host too", flush=True)
        loops = MultiController(size)
        stack.callback(loops.close)
        baselines = _baseline_processes(size, stack)
        rounds = []
        for index in range(args.rounds):
            rounds.append(_one_round(ours, loops, baselines, args, index, xla, gloo))
            print(f"N={size} round {index + 1}/{args.rounds}: "
                  + ", ".join(f"{k} {v:,.0f}" for k, v in rounds[-1].items()), flush=True)
    return summarize(size, rounds)


def summarize(size: int, rounds: list[dict]) -> dict:
    rates = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    ratios = {f"{mode} / multi-controller": [r[mode] / r["multi-controller"] for r in rounds] for mode in MODES}
    for key in rounds[0]:
        if key.endswith(" (xla)"):
            ratios[f"{key} / eager"] = [r[key] / r[key.removesuffix(" (xla)")] for r in rounds]
            ratios[f"{key} / multi-controller"] = [r[key] / r["multi-controller"] for r in rounds]
        if key.endswith(" (gloo)"):
            ratios[f"{key.removesuffix(' (gloo)')} shared mapping / gloo"] = [
                r[key.removesuffix(" (gloo)")] / r[key] for r in rounds]
    if any(f"{name} OpByOp" in rounds[0] for name in BASELINES):
        ratios["OpByOp / best baseline OpByOp"] = [
            r["OpByOp"] / max(r[f"{name} OpByOp"] for name in BASELINES if f"{name} OpByOp" in r) for r in rounds]
    return {"executors": size, "rates": rates, "rounds": rounds,
            "ratios": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in ratios.items()}}


def _table_row(result: dict) -> list[str]:
    rates, ratios = result["rates"], result["ratios"]

    def vs_mc(mode: str) -> str:
        ratio = ratios[f"{mode} / multi-controller"]
        return f"{rates[mode]:,.0f} ({ratio['median']:.2f}x, {ratio['min']:.2f}-{ratio['max']:.2f})"

    cells = [str(result["executors"]), f"{rates['multi-controller']:,.0f}"] + [vs_mc(m) for m in MODES]
    for name in BASELINES:
        for loop in ("OpByOp", "Fused"):
            rate = rates.get(f"{name} {loop}")
            cells.append(f"{rate:,.0f}" if rate is not None else "not run")
    best = ratios.get("OpByOp / best baseline OpByOp")
    cells.append(f"{best['median']:.2f}x ({best['min']:.2f}-{best['max']:.2f})" if best else "not run")
    return cells


def _ratio_text(ratio: dict) -> str:
    return f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, sizes="1,2,4,8", steps=200, repeats=4)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per executor count")
    parser.add_argument("--xla-modes", default="Chained",
                        help="our modes to run on the default (XLA) backend too, comma-separated ('' for none)")
    parser.add_argument("--gloo-modes", default="OpByOp,Chained",
                        help="our modes to run with gloo within the host too (before issue 49's host groups), "
                             "comma-separated ('' for none)")
    args = parser.parse_args()
    results = [measure(int(size), args) for size in args.sizes.split(",")]
    print_table(["N", "multi-controller /s", "OpByOp /s (vs MC)", "Chained /s (vs MC)", "Fused /s (vs MC)",
                 "Chained pipelined /s (vs MC)",
                 "Ray OpByOp /s", "Ray Fused /s", "Monarch OpByOp /s", "Monarch Fused /s",
                 "OpByOp / best baseline OpByOp"], [_table_row(r) for r in results])
    print("(x: median of the per-round ratios, then their range)")
    xla_rows = [[str(r["executors"]), key.removesuffix(" / eager"), f"{r['rates'][key.removesuffix(' / eager')]:,.0f}",
                 f"{r['rates'][key.removesuffix(' (xla) / eager')]:,.0f}",
                 f"{v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})", _ratio_text(
                     r["ratios"][key.removesuffix(" / eager") + " / multi-controller"])]
                for r in results for key, v in r["ratios"].items() if key.endswith("(xla) / eager")]
    if xla_rows:
        print("\nThe default backend (XLA) against eager executors and the multi-controller loop, same rounds:")
        print_table(["N", "mode", "xla /s", "eager /s", "xla / eager", "xla / multi-controller"], xla_rows)
        for r in results:
            chained = r["ratios"].get("Chained (xla) / eager")
            if chained:
                print(f"target N={r['executors']} Chained xla within 10 % of eager: "
                      f"{'met' if chained['median'] >= 0.9 else 'NOT met'} ({chained['median']:.2f})")
    gloo_rows = [[str(r["executors"]), key.removesuffix(" shared mapping / gloo"),
                  f"{r['rates'][key.removesuffix(' shared mapping / gloo')]:,.0f}",
                  f"{r['rates'][key.removesuffix(' shared mapping / gloo') + ' (gloo)']:,.0f}", _ratio_text(v)]
                 for r in results for key, v in r["ratios"].items() if key.endswith(" shared mapping / gloo")]
    if gloo_rows:
        print("\nCollectives within the host: one shared mapping against gloo, eager executors, same rounds:")
        print_table(["N", "mode", "shared mapping /s", "gloo /s", "shared mapping / gloo"], gloo_rows)
    print("written to", write_results("dispatch", {"results": results, "chain": CHAIN, "steps": args.steps,
                                                    "repeats": args.repeats}))


if __name__ == "__main__":
    main()
