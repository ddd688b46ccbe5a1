"""Per-call time of a small function and a Transformer block forward+backward, per executor backend.

One executor with one compute thread per backend (eager, xla, inductor). For each
workload: the compile time (the executor's compile span), the device time per call
(the executor's compute spans, median), and the client's time per call for a
batch of calls issued without waiting (wall / calls). Prints a table and writes
bench/results/backends.json.

    .venv/bin/python -m bench.backends [--calls 50] [--backends eager,xla,inductor]
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import torch

import pathways_torch as pw
from bench.common import median, print_table, spans, write_results

D_MODEL, HEADS, SEQ, BATCH = 64, 4, 32, 8


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


def measure(backend: str, calls: int) -> list[dict]:
    rows = []
    with pw.Context(num_executors=1, backend=backend) as ctx:
        mesh = ctx.mesh({"data": 1})
        rep = [pw.Replicate()]
        workloads = {
            "quickstart layer": (pw.function(layer, name="layer"),
                                 [ctx.put(torch.randn(64, 32), mesh, rep), ctx.put(torch.randn(32, 16), mesh, rep)]),
            "transformer block fwd+bwd": (pw.function(block_step, name="block_step"),
                                          [ctx.put(torch.randn(BATCH, SEQ, D_MODEL), mesh, rep)]
                                          + [ctx.put(p, mesh, rep) for p in block_params()]),
        }
        for label, (fn, inputs) in workloads.items():
            began = time.perf_counter()
            first = fn(*inputs)
            _wait(first)
            first_call_s = time.perf_counter() - began
            del first
            began = time.perf_counter()
            outs = [fn(*inputs) for _ in range(calls)]
            for out in outs:
                _wait(out)
            client_ms = (time.perf_counter() - began) / calls * 1000
            del outs
            trace = ctx.trace(os.path.join(tempfile.gettempdir(), f"bench-backends-{backend}.json"))
            compile_ms = spans(trace, fn.name, "compile")
            device_ms = spans(trace, fn.name, "compute")
            rows.append({"backend": backend, "workload": label, "compile_s": (compile_ms[0] / 1000) if compile_ms else 0.0,
                         "first_call_s": first_call_s, "device_ms_per_call": median(device_ms[1:]),
                         "client_ms_per_call": client_ms, "calls": calls})
    return rows


def _wait(out) -> None:
    first = out[0] if isinstance(out, tuple) else out
    error = first.exception(timeout_s=600)
    if error is not None:
        raise error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--backends", default="eager,xla,inductor")
    args = parser.parse_args()
    rows = []
    for backend in args.backends.split(","):
        print(f"measuring {backend} ...", flush=True)
        rows += measure(backend, args.calls)
    eager = {r["workload"]: r for r in rows if r["backend"] == "eager"}
    table = []
    for r in rows:
        base = eager.get(r["workload"])
        ratio = r["device_ms_per_call"] / base["device_ms_per_call"] if base else float("nan")
        r["device_time_vs_eager"] = ratio
        table.append([r["workload"], r["backend"], f"{r['compile_s']:.2f}", f"{r['first_call_s']:.2f}",
                      f"{r['device_ms_per_call']:.3f}", f"{r['client_ms_per_call']:.3f}", f"{ratio:.2f}"])
    print_table(["workload", "backend", "compile s", "first call s", "device ms/call", "client ms/call",
                 "device time / eager"], table)
    print("written to", write_results("backends", {"rows": rows}))


if __name__ == "__main__":
    main()
