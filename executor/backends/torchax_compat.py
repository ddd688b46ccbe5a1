"""What torchax 0.0.13 needs to run here, in one place, each piece with a test that fails once it is not needed.

Never an edit of an installed file: each shim wraps or overrides from the outside.

1. **Removed overloads** (`import_torchax`). torchax names aten overloads in tables
   at import (``torch.ops.aten.prod.dim_Dimname``, ``aten.cholesky`` …) that torch
   2.13 removed; on such a torch, ``import torchax`` raises ``AttributeError``.
   While torchax is imported (and its op tables load), a lookup *from torchax's
   own modules* that finds no such op gets an inert placeholder that matches no
   real op. Lookups from anywhere else are untouched.
2. **Lowerings replaced by torch's decompositions** (`REPLACED_LOWERINGS`): torchax's
   ``native_layer_norm_backward`` has the wrong signature (it fails on every
   LayerNorm backward).
3. **Lowerings added** (`ADDED_LOWERINGS`): ``convolution_backward`` (`convolution.py`: the
   vjp of torchax's own forward), and CPU flash attention (what
   ``F.scaled_dot_product_attention`` traces to on CPU). Its backward has neither a
   torchax lowering nor a torch decomposition (without one every attention backward
   would run outside XLA); its forward has only torch's decomposition, whose second
   output is the attention matrix where the kernel gives the log-sum-exp, which the
   backward reads. Ours compute both in torch ops that torchax lowers.
"""

from __future__ import annotations

import contextlib
import sys
import threading

__all__ = ["import_torchax", "REPLACED_LOWERINGS", "ADDED_LOWERINGS", "removed_names_seen", "has_lowering"]

_lock = threading.Lock()
_removed_seen: list[str] = []
_loaded = None

# aten ops whose torchax lowering is wrong: their torch decomposition runs instead.
REPLACED_LOWERINGS = ("native_layer_norm_backward.default",)
# aten ops torchax cannot lower at all, and ours (below).
ADDED_LOWERINGS = ("_scaled_dot_product_flash_attention_for_cpu.default",
                   "_scaled_dot_product_flash_attention_for_cpu_backward.default",
                   "convolution_backward.default")


class _RemovedOp:
    """Stands for an op or overload this torch no longer has: hashable, matches nothing, calls nothing."""

    def __init__(self, name: str):
        self._name = name

    def name(self) -> str:
        return self._name

    def __getattr__(self, key: str):
        if key.startswith("__"):
            raise AttributeError(key)
        return _removed(f"{self._name}.{key}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} does not exist in this torch (a torchax compatibility placeholder)")

    def __repr__(self) -> str:
        return f"<removed op {self._name}>"


def _removed(name: str) -> _RemovedOp:
    _removed_seen.append(name)
    return _RemovedOp(name)


def _asked_by_torchax(namespace: str) -> bool:
    # Only aten ops were removed; a lookup in another namespace (torch_xla's, torchvision's) is a
    # question torchax asks on purpose and must keep its AttributeError. Two frames up: the caller
    # of the patched __getattr__.
    return namespace == "aten" and sys._getframe(2).f_globals.get("__name__", "").startswith("torchax")


@contextlib.contextmanager
def _placeholders_for_removed_ops():
    import torch._ops as ops

    packet_getattr, namespace_getattr = ops.OpOverloadPacket.__getattr__, ops._OpNamespace.__getattr__

    def overload(self, key):
        try:
            return packet_getattr(self, key)
        except AttributeError:
            if key.startswith("__") or not _asked_by_torchax(self._qualified_op_name.split("::")[0]):
                raise
            return _removed(f"{self}.{key}")

    def packet(self, name):
        try:
            return namespace_getattr(self, name)
        except AttributeError:
            if name.startswith("__") or not _asked_by_torchax(self.name):
                raise
            return _removed(f"{self.name}.{name}")

    ops.OpOverloadPacket.__getattr__, ops._OpNamespace.__getattr__ = overload, packet
    try:
        yield
    finally:
        ops.OpOverloadPacket.__getattr__, ops._OpNamespace.__getattr__ = packet_getattr, namespace_getattr


def import_torchax():
    """``(torchax, environment)``, imported once with the shims above in place."""
    global _loaded
    with _lock:
        if _loaded is None:
            with _placeholders_for_removed_ops():
                import torchax

                _check_version(torchax)

                env = torchax.default_env()   # loads the op tables: more names of removed overloads
            _replace_lowerings(env)
            _add_lowerings(env)
            _loaded = (torchax, env)
        return _loaded


_MIN_VERSION = (0, 0, 13)


def _check_version(torchax) -> None:
    version = getattr(torchax, "__version__", "0")
    parts = tuple(int(p) for p in version.split(".")[:3] if p.isdigit())
    if parts < _MIN_VERSION:
        raise ImportError(
            f"xla:torchax needs torchax >= {'.'.join(map(str, _MIN_VERSION))}, found {version} at "
            f"{torchax.__file__} (torch_xla 2.9's wheel overwrites torchax with its own 0.0.6); fix: "
            f"pip install --force-reinstall --no-deps 'torchax>=0.0.13,<0.1'")


def removed_names_seen() -> list[str]:
    """The op names torchax asked for that this torch does not have (empty on torch ≤ 2.12)."""
    return list(_removed_seen)


def _replace_lowerings(env) -> None:
    import torch
    from torch._decomp import decomposition_table

    for name in REPLACED_LOWERINGS:
        packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet), overload)
        env.override_op_definition(op, decomposition_table[op])


def _add_lowerings(env) -> None:
    import torch
    from torchax.ops import ops_registry

    from .attention import flash_attention_decompositions
    from .convolution import convolution_backward

    for op, implementation in flash_attention_decompositions().items():
        env.override_op_definition(op, implementation)
    # A jax function (torchax hands it jax arrays), not torch code like the two above.
    op = torch.ops.aten.convolution_backward.default
    env._ops[op] = ops_registry.Operator(op, convolution_backward, is_jax_function=True, is_user_defined=True,
                                         needs_env=False, is_view_op=False)


def has_lowering(env, op) -> bool:
    """Whether torchax can run aten ``op`` inside XLA (a lowering or one of its decompositions)."""
    try:
        env._get_op_or_decomp(op)
    except Exception:
        return False
    return True
