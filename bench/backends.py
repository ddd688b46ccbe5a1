"""Per-call time and compile time per executor backend, side by side: the default (XLA) against eager.

One executor per backend, every context alive at once, the executor pinned to the
same core in each (XLA's CPU runtime ignores the thread setting; docs/backends.md).
Rounds interleave the backends (the order rotates each round); a round times, per
workload, ``--calls`` *awaited* calls (each call's result is waited for before the
next is made: the latency a user's loop sees) and, from the executor's trace, the
device time per call. Ratios to eager are taken per round; their median is reported.

Workloads: ``x + 1`` on one element (the per-call cost of the runtime and the
backend), the quickstart layer, and a Transformer block's forward + backward.

Compile: the example Transformer's training step (``examples/transformer.py``, the
README's trainer) compiled with an empty persistent compilation cache, then again in
a new context with the cache it left (a second run of the same program).

Prints tables and writes bench/results/backends.json.

    .venv/bin/python -m bench.backends [--calls 200] [--rounds 5] [--backends xla,eager[,inductor]]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import time

import torch

import pathways_torch as pw
from bench.common import median, print_table, spans, write_results

D_MODEL, HEADS, SEQ, BATCH = 64, 4, 32, 8


def tiny(x):
    return x + 1


def layer(x, w):
    return torch.relu(x @ w)


def block_params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = D_MODEL

    def w(*shape):
        return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

    return [torch.ones(d), torch.zeros(d), w(d, 3 * d), w(d, d), torch.ones(d), torch.zeros(d), w(d, 4 * d),
            w(4 * d, d)]


def block_forward(x, params):
    ln1_w, ln1_b, qkv_w, proj_w, ln2_w, ln2_b, fc_w, out_w = params
    b, t, d = x.shape
    h = torch.nn.functional.layer_norm(x, (d,), ln1_w, ln1_b)
    q, k, v = (h @ qkv_w).split(d, dim=-1)
    q, k, v = (z.reshape(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // HEADS)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    attn = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
    x = x + attn.transpose(1, 2).reshape(b, t, d) @ proj_w
    h = torch.nn.functional.layer_norm(x, (d,), ln2_w, ln2_b)
    return x + torch.nn.functional.gelu(h @ fc_w) @ out_w


def block_step(x, *params):
    """Forward + backward: the loss and the gradient of every parameter."""
    grads, loss = torch.func.grad_and_value(lambda p: block_forward(x, p).pow(2).mean())(list(params))
    return (loss, *grads)


class BackendRun:
    """One context on one backend, its workloads loaded and warm, kept alive between rounds."""

    def __init__(self, backend: str):
        self.ctx = pw.Context(num_executors=1, backend=backend, pin_executors=True)
        self.backend = self.ctx.backend
        mesh = self.ctx.mesh({"data": 1})
        rep = [pw.Replicate()]
        put = self.ctx.put
        self.workloads = {
            "x + 1 (1 element)": (pw.function(tiny, name="tiny"), [put(torch.ones(1), mesh, rep)]),
            "quickstart layer": (pw.function(layer, name="layer"),
                                 [put(torch.randn(64, 32), mesh, rep), put(torch.randn(32, 16), mesh, rep)]),
            "transformer block fwd+bwd": (pw.function(block_step, name="block_step"),
                                          [put(torch.randn(BATCH, SEQ, D_MODEL), mesh, rep)]
                                          + [put(p, mesh, rep) for p in block_params()]),
        }
        self.first_call_s, self.awaited_ms = {}, {w: [] for w in self.workloads}
        for label, (fn, inputs) in self.workloads.items():
            began = time.perf_counter()
            _wait(fn(*inputs))
            self.first_call_s[label] = time.perf_counter() - began
            for _ in range(20):     # warm: caches, the executor's start-at-once path
                _wait(fn(*inputs))

    def window(self, label: str, calls: int) -> float:
        """``calls`` awaited calls of one workload; ms per call."""
        fn, inputs = self.workloads[label]
        began = time.perf_counter()
        for _ in range(calls):
            _wait(fn(*inputs))
        per_call = (time.perf_counter() - began) / calls * 1000
        self.awaited_ms[label].append(per_call)
        return per_call

    def finish(self) -> list[dict]:
        trace = self.ctx.trace(os.path.join(tempfile.gettempdir(), f"bench-backends-{self.backend}.json"))
        rows = []
        for label, (fn, _) in self.workloads.items():
            compile_ms = spans(trace, fn.name, "compile")
            rows.append({"backend": self.backend, "workload": label,
                         "compile_s": (compile_ms[0] / 1000) if compile_ms else 0.0,
                         "first_call_s": self.first_call_s[label],
                         "device_ms_per_call": median(spans(trace, fn.name, "compute")[21:]),
                         "awaited_ms_per_call": statistics.median(self.awaited_ms[label]),
                         "awaited_ms_rounds": self.awaited_ms[label]})
        self.ctx.close()
        return rows


def _wait(out) -> None:
    first = out[0] if isinstance(out, tuple) else out
    error = first.exception(timeout_s=600)
    if error is not None:
        raise error


def measure_step_compile(backend: str) -> dict:
    """The example trainer's first step (capture, load, compile, run) with an empty cache, then with the cache it left."""
    from examples.transformer import DecoderOnlyTransformer, ReverseTask, TransformerConfig, loss_fn

    cache = tempfile.mkdtemp(prefix="bench-compile-cache-")
    previous = os.environ.get("PATHWAYS_CACHE_DIR")
    os.environ["PATHWAYS_CACHE_DIR"] = cache   # executors inherit it
    try:
        times = []
        for _ in ("empty cache", "warm cache"):
            torch.manual_seed(0)
            cfg = TransformerConfig()
            model = DecoderOnlyTransformer(cfg)
            with pw.Context(num_executors=1, backend=backend, pin_executors=True) as ctx:
                trainer = ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=loss_fn,
                                   mesh=ctx.mesh({"data": 1}), plan=pw.DataParallel("data"))
                began = time.perf_counter()
                trainer.step(ReverseTask(cfg, seed=0).batch(0, 32)).result(timeout_s=600)
                first = time.perf_counter() - began
                trace = ctx.trace(os.path.join(tempfile.gettempdir(), "bench-backends-compile.json"))
                compile_ms = spans(trace, trainer.runner.function.name, "compile")
                times.append({"first_step_s": first, "compile_s": (compile_ms[0] / 1000) if compile_ms else 0.0,
                              "route": ctx.backend})
        return {"backend": times[0]["route"], "empty_cache": times[0], "warm_cache": times[1]}
    finally:
        if previous is None:
            os.environ.pop("PATHWAYS_CACHE_DIR", None)
        else:
            os.environ["PATHWAYS_CACHE_DIR"] = previous
        shutil.rmtree(cache, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="awaited calls per workload per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", default="xla,eager", help="eager must be one of them (the ratios' base)")
    parser.add_argument("--no-compile", action="store_true", help="skip the example step's compile measurement")
    args = parser.parse_args()
    names = args.backends.split(",")
    if "eager" not in names:
        parser.error("--backends must include eager: every ratio is to eager")
    # An empty persistent compile cache, so the compile column is a real compile (executors inherit it).
    os.environ["PATHWAYS_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-backends-cache-")
    runs = {}
    try:
        for name in names:
            print(f"starting {name} ...", flush=True)
            runs[name] = BackendRun(name)
        labels = list(next(iter(runs.values())).workloads)
        ratios = {(name, label): [] for name in names for label in labels}
        for round_index in range(args.rounds):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            measured = {(name, label): runs[name].window(label, args.calls) for name in order for label in labels}
            for name in names:
                for label in labels:
                    ratios[name, label].append(measured[name, label] / measured["eager", label])
            print(f"round {round_index + 1}/{args.rounds} done", flush=True)
        rows = [row for name in names for row in runs.pop(name).finish()]
    finally:
        for run in runs.values():
            run.ctx.close()
    eager = {r["workload"]: r for r in rows if r["backend"] == "eager"}
    table = []
    for r in rows:
        per_round = ratios[next(n for n in names if pw_name(n, r["backend"])), r["workload"]]
        r["awaited_vs_eager"] = statistics.median(per_round)
        r["awaited_vs_eager_range"] = [min(per_round), max(per_round)]
        r["device_vs_eager"] = r["device_ms_per_call"] / eager[r["workload"]]["device_ms_per_call"]
        table.append([r["workload"], r["backend"], f"{r['compile_s']:.2f}", f"{r['first_call_s']:.2f}",
                      f"{r['device_ms_per_call']:.3f}", f"{r['device_vs_eager']:.2f}",
                      f"{r['awaited_ms_per_call']:.3f}", f"{r['awaited_vs_eager']:.2f}",
                      f"{min(per_round):.2f}-{max(per_round):.2f}"])
    print()
    print(f"One executor per backend, pinned to one core; {args.rounds} interleaved rounds of {args.calls} awaited "
          f"calls per workload; ratios: median of the per-round ratios to eager")
    print_table(["workload", "backend", "compile s", "first call s", "device ms/call", "device / eager",
                 "awaited ms/call", "awaited / eager", "min-max"], table)
    tiny_rows = [r for r in rows if r["workload"].startswith("x + 1") and r["backend"] != "eager"]
    for r in tiny_rows:
        print(f"target awaited x + 1 <= 1.5 x eager ({r['backend']}): "
              f"{'met' if r['awaited_vs_eager'] <= 1.5 else 'NOT met'} ({r['awaited_vs_eager']:.2f})")
    compile_rows = []
    if not args.no_compile:
        print("\nmeasuring the example step's compile (empty cache, then warm) ...", flush=True)
        for name in names:
            if name == "eager":
                continue
            c = measure_step_compile(name)
            compile_rows.append(c)
        print_table(["backend", "compile s (empty cache)", "first step s (empty)", "compile s (warm cache)",
                     "first step s (warm)"],
                    [[c["backend"], f"{c['empty_cache']['compile_s']:.2f}", f"{c['empty_cache']['first_step_s']:.2f}",
                      f"{c['warm_cache']['compile_s']:.2f}", f"{c['warm_cache']['first_step_s']:.2f}"]
                     for c in compile_rows])
    print("written to", write_results("backends", {"rows": rows, "rounds": args.rounds, "calls": args.calls,
                                                    "step_compile": compile_rows}))


def pw_name(asked: str, registered: str) -> bool:
    """Whether a backend name as asked (``xla``) is the one the executors registered (``xla:torchax``)."""
    return asked == registered or registered.startswith(asked + ":")


if __name__ == "__main__":
    main()
