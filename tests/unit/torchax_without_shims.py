"""Run in a subprocess by test_torchax_compat: what torchax does here *without* each of our shims.

Prints one JSON object: whether a plain import works, and for each replaced or added
lowering whether torchax's own (or torch's decomposition) gives the right answer.
"""

from __future__ import annotations

import json
import sys


def plain_import() -> str:
    try:
        import torchax

        torchax.default_env()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def main() -> None:
    report = {"plain_import": plain_import()}
    if report["plain_import"] != "ok":
        for name in [m for m in sys.modules if m.startswith("torchax")]:
            del sys.modules[name]
        from executor.backends.torchax_compat import _placeholders_for_removed_ops

        with _placeholders_for_removed_ops():
            import torchax

            torchax.default_env()
    report.update(own_lowerings())
    print(json.dumps(report))


def own_lowerings() -> dict:
    """Each case through torchax's own lowerings (no override of ours): 'ok', 'wrong' or the error."""
    import jax
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx
    from torchax import interop

    jax.config.update("jax_enable_x64", True)

    def layer_norm_grad(x, w, b):
        return torch.func.grad(lambda x, w, b: F.layer_norm(x, (8,), w, b).pow(2).sum(), argnums=(0, 1, 2))(x, w, b)

    def attention_grad(q, k, v):
        return torch.func.grad(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True).pow(2).sum(),
                               argnums=(0, 1, 2))(q, k, v)

    def convolution_grad(x, w):
        return torch.func.grad(lambda x, w: F.conv2d(x, w, padding=1).pow(2).sum(), argnums=(0, 1))(x, w)

    cases = {"native_layer_norm_backward": (layer_norm_grad, [(4, 8), (8,), (8,)]),
             "flash_attention_for_cpu": (attention_grad, [(1, 2, 4, 8)] * 3),
             "convolution_backward": (convolution_grad, [(2, 3, 6, 6), (4, 3, 3, 3)])}
    results = {}
    for name, (fn, shapes) in cases.items():
        torch.manual_seed(0)
        inputs = [torch.randn(s, dtype=torch.float64) for s in shapes]
        expected = fn(*inputs)
        try:
            graph = make_fx(fn, tracing_mode="fake")(*inputs)
            got = jax.jit(lambda *a: interop.call_torch(graph.forward, *a))(*[np.asarray(t) for t in inputs])
            ok = all(np.allclose(np.asarray(g), e.numpy(), atol=1e-8) for g, e in zip(got, expected))
            results[name] = "ok" if ok else "wrong"
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return results


if __name__ == "__main__":
    main()
