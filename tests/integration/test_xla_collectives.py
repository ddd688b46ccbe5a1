"""The collectives-inside-XLA extension (executor/backends/xla_collectives.py) on two real ranks, over gloo and over
one host's shared mapping (executor/shm_group.py).

Each rank compiles jax functions whose collectives are the extension's custom calls, runs them on its own
inputs, and sends the results back; the test compares them with torch's reduction of both ranks' inputs.
Also: several collectives in one executable (kept in graph order), a group abandoned while a call waits in
it (the call fails within a wait slice, as `CollectiveAbandoned`), an executable run with its axis unbound, and an
op abandoned inside an executable that ends after the executable failed (it must not touch the buffers XLA freed).
"""

from __future__ import annotations

import functools
import time

import pytest
import torch

from bench.common import run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SHAPE = (4, 6)
DTYPES = ("float32", "float64", "bfloat16", "int64")


def _input(rank: int, dtype: str) -> torch.Tensor:
    values = torch.arange(24, dtype=torch.float64).reshape(SHAPE) * (rank + 1) - 5 * rank
    return values.to(getattr(torch, dtype))


def _cases(dtype: str):
    """name -> (the jax function of x, what torch makes of the two ranks' inputs [x0, x1] for rank r)."""
    from executor.backends import xla_collectives as xc

    floating = dtype != "int64"
    cases = {
        "all_reduce sum": (lambda x: xc.all_reduce(x, "data", "sum"), lambda xs, r: xs[0] + xs[1]),
        "all_reduce max": (lambda x: xc.all_reduce(x, "data", "max"), lambda xs, r: torch.maximum(xs[0], xs[1])),
        "all_gather dim 0": (lambda x: xc.all_gather(x, "data", 2, 0), lambda xs, r: torch.cat(xs, 0)),
        "all_gather dim -1": (lambda x: xc.all_gather(x, "data", 2, -1), lambda xs, r: torch.cat(xs, -1)),
        "reduce_scatter sum dim 0": (lambda x: xc.reduce_scatter(x, "data", 2, "sum", 0),
                                     lambda xs, r: (xs[0] + xs[1]).chunk(2, 0)[r]),
        "reduce_scatter max dim 1": (lambda x: xc.reduce_scatter(x, "data", 2, "max", 1),
                                     lambda xs, r: torch.maximum(xs[0], xs[1]).chunk(2, 1)[r]),
        # Three in one executable: they must pair up in graph order on both ranks.
        "three in one": (lambda x: xc.all_gather(xc.all_reduce(x, "data", "sum") * 2, "data", 2, 1)
                         + xc.all_gather(xc.all_reduce(x, "data", "max"), "data", 2, 1),
                         lambda xs, r: torch.cat([(xs[0] + xs[1]) * 2] * 2, 1)
                         + torch.cat([torch.maximum(xs[0], xs[1])] * 2, 1)),
    }
    if floating:
        cases["all_reduce mean"] = (lambda x: xc.all_reduce(x, "data", "mean"), lambda xs, r: (xs[0] + xs[1]) / 2)
        cases["reduce_scatter mean dim 1"] = (lambda x: xc.reduce_scatter(x, "data", 2, "mean", 1),
                                              lambda xs, r: ((xs[0] + xs[1]) / 2).chunk(2, 1)[r])
    return cases


def _rank(rank: int, size: int, store_path: str, results) -> None:
    """Each case compiled once, run on a host group (one host's shared mapping, `executor.shm_group`, as executors
    of one host form) and on a gloo group: the executables name the axis, the binding picks the group."""
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    from executor.backends import xla_collectives as xc

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    module = xc.register_targets()
    if module is None:
        results.put((rank, {"unavailable": xc.unavailable_reason()}))
        return
    jitted = {}
    for dtype in DTYPES:
        for name, (function, _) in _cases(dtype).items():
            def traced(a, function=function):
                xc.reset_order()
                return function(a)

            jitted[(dtype, name)] = jax.jit(traced)

    def all_reduce_sum(a):
        xc.reset_order()
        return xc.all_reduce(a, "data", "sum")

    call_all_reduce = functools.partial(jax.jit(all_reduce_sum), jnp.ones(3, jnp.float32))
    out = {transport: _on_group(rank, size, store_path, module, transport, jitted, call_all_reduce)
           for transport in ("host", "gloo")}
    out["gloo"].update(_late_abandon(rank, size, store_path, module))   # a gloo op outlives its executable
    results.put((rank, out))


def _on_group(rank: int, size: int, store_path: str, module, transport: str, jitted: dict, call_all_reduce) -> dict:
    import jax.numpy as jnp
    import numpy as np
    import torch.distributed as dist

    from executor.backends import xla_collectives as xc
    from executor.backends.xla_collectives import _collective_error
    from executor.collectives import make_gloo_group
    from executor.shm_group import form_host_group

    if transport == "host":
        group = form_host_group(dist.PrefixStore("xla-host", dist.FileStore(store_path, size)), rank, size, 60.0,
                                "xla-host", members=[f"executor-{r}@0" for r in range(size)])
    else:
        group = make_gloo_group(store_path, "xla-collectives", rank, size, 60.0)
    slot = xc.NativeGroups(module).register(group)
    module.bind([(xc.axis_id("data"), slot, False, "")])
    out = {}
    for (dtype, name), function in jitted.items():
        x = jnp.asarray(_input(rank, dtype).float().numpy()).astype(dtype)
        out[(dtype, name)] = np.asarray(function(x).astype(jnp.float64))
    # An axis with no group bound: the executable fails, naming why.
    module.bind([(xc.axis_id("data"), -1, False, "axis 'data': it was never formed")])
    try:
        call_all_reduce()
        out["unbound"] = "no error"
    except Exception as exc:
        error = _collective_error(exc)
        out["unbound"] = f"{type(error).__name__}: {error}"
    module.bind([(xc.axis_id("data"), slot, False, "")])
    if transport == "host":
        group.all_reduce(torch.zeros(1))   # a barrier
    else:
        group.barrier().wait()
    if rank == 0:
        # Rank 1 never joins this all-reduce; the group is abandoned 0.5 s in: the call must end within a slice.
        import threading

        def abandon():   # as executor.collectives._Group.abandon does
            module.abandon(slot, "member executor-1@0 was lost (test)")
            if transport == "host":
                group.abandon()

        threading.Timer(0.5, abandon).start()
        began = time.monotonic()
        try:
            call_all_reduce()
            out["abandoned"] = ("no error", 0.0)
        except Exception as exc:
            error = _collective_error(exc)
            out["abandoned"] = (f"{type(error).__name__}: {error}", time.monotonic() - began)
        out["quiet after abandon"] = module.quiet(slot)
    elif transport == "gloo":
        time.sleep(3.0)   # not joining rank 0's all-reduce until it was given up on (a host group's is broken)
    return out


def test_collectives_inside_xla_match_torch_on_two_ranks_on_gloo_and_on_one_hosts_shared_mapping():
    rows = run_ranks(_rank, 2, (2,), "pathways-test-xla-collectives-", timeout_s=180)
    outs = [row[1] for row in rows]
    assert "unavailable" not in outs[0], (
        f"the extension is not built here ({outs[0].get('unavailable')}): the README's install runs "
        f"pathways-build-extensions")
    _check_host([out["host"] for out in outs])
    _check_gloo([out["gloo"] for out in outs])


def _check_host(outs: list) -> None:
    _check_cases(outs)
    message, waited = outs[0]["abandoned"]
    assert message.startswith("CollectiveAbandoned: all_reduce: the group was abandoned"), message
    assert 0.4 < waited < 1.0, waited    # the abandon at 0.5 s ends the library's wait within its slice
    assert outs[0]["quiet after abandon"] is True   # nothing of a host group outlives its call


def _check_cases(outs: list) -> None:
    inputs = {dtype: [_input(r, dtype) for r in range(2)] for dtype in DTYPES}
    for rank, out in enumerate(outs):
        for dtype in DTYPES:
            for name, (_, expected) in _cases(dtype).items():
                want = expected([x.double() for x in inputs[dtype]], rank)
                if dtype != "float64":
                    want = want.to(getattr(torch, dtype)).double()
                got = torch.from_numpy(out[(dtype, name)])
                tolerance = dict(rtol=1e-2, atol=1e-2) if dtype == "bfloat16" else dict(rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(got, want, **tolerance, msg=f"rank {rank}, {dtype}, {name}")
        assert out["unbound"].startswith("RuntimeError: all_reduce: axis 'data': it was never formed"), out["unbound"]


def _check_gloo(outs: list) -> None:
    _check_cases(outs)
    message, waited = outs[0]["abandoned"]
    assert message.startswith("CollectiveAbandoned: collective abandoned: member executor-1@0 was lost"), \
        message
    assert 0.4 < waited < 2.0, waited    # the abandon at 0.5 s, seen within a 200 ms slice
    assert outs[0]["quiet after abandon"] is False   # the given-up op is pending: rank 1 never joined it
    late, joined = outs
    assert late["late abandoned"].startswith("CollectiveAbandoned: collective abandoned: member executor-1@0"), late
    assert late["late pending"] is True, "the abandon came before the op started: nothing was given up on"
    assert late["late quiet"] is True, "the op given up on never ended"
    # Issue 47: the op given up on ran on the failed executable's buffers, freed by XLA, and wrote into whatever
    # came there next (measured: one of these fills read 9.0, 7 + rank 1's 2), or into unmapped memory: SIGSEGV.
    assert late["late fills"] == [(7.0, 7.0)], f"the late op wrote into buffers it did not own: {late['late fills']}"
    assert joined["late sum"] == (3.0, 3.0), f"rank 0's part of the late op was not its input: {joined['late sum']}"


LATE_ELEMENTS = 1 << 24   # 64 MiB of float32: glibc maps a buffer this large on its own and unmaps it when freed


def _late_abandon(rank: int, size: int, store_path: str, module) -> dict:
    """Rank 0's all-reduce is abandoned before rank 1 joins it; rank 1 joins after rank 0's executable has failed
    and XLA has freed that executable's buffers. The op given up on then runs to its end in gloo's thread, and must
    run on memory of its own (a SIGSTOPped member, continued, finishing its half did this in the soak)."""
    import threading

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch.distributed as dist

    from executor.backends import xla_collectives as xc
    from executor.backends.xla_collectives import _collective_error
    from executor.collectives import make_gloo_group

    group = make_gloo_group(store_path, "xla-collectives-late", rank, size, 30.0)
    turns = dist.PrefixStore("late-turns", dist.FileStore(store_path, size))
    if rank == 1:
        turns.wait(["abandoned"])   # rank 0's executable failed and its buffers are gone
        values = torch.full((LATE_ELEMENTS,), 2.0)
        group.allreduce([values]).wait()
        turns.set("joined", "1")
        return {"late sum": (values.min().item(), values.max().item())}
    out = {}
    slot = module.register_group(group)
    module.bind([(xc.axis_id("data"), slot, False, "")])
    ones = jnp.ones(LATE_ELEMENTS, jnp.float32)
    # Compiled first: the abandon must find the op started in gloo, not the call still compiling.
    call = jax.jit(lambda a: (xc.reset_order(), xc.all_reduce(a, "data", "sum"))[1]).lower(ones).compile()
    threading.Timer(0.5, module.abandon, (slot, "member executor-1@0 was lost (test)")).start()
    try:
        call(ones)
        out["late abandoned"] = "no error"
    except Exception as exc:
        out["late abandoned"] = f"{type(_collective_error(exc)).__name__}: {_collective_error(exc)}"
    out["late pending"] = not module.quiet(slot)
    # Buffers XLA may place where the failed executable's were: the late op must write into none of them.
    fills = [jnp.full(LATE_ELEMENTS, 7.0, jnp.float32) for _ in range(4)]
    turns.set("abandoned", "1")
    turns.wait(["joined"])
    deadline = time.monotonic() + 30.0
    while not module.quiet(slot) and time.monotonic() < deadline:
        time.sleep(0.05)
    out["late quiet"] = module.quiet(slot)
    out["late fills"] = sorted({(float(np.min(f)), float(np.max(f))) for f in fills})
    module.release(slot)
    return out
