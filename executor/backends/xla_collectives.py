"""The ``pathways::`` collectives inside XLA executables, through XLA FFI custom calls into the executor's groups.

On the ``xla:torchax`` route a collective used to cut a function into two
executables with a host stage between them (`graph_stages`). With this module's
compiled extension (``native/xla_collectives.cpp``) a collective is a custom call
inside the executable instead: the call runs the executor's own gloo group (torch's
c10d ``Backend``) on copies of the executable's buffers (an op given up on may outlive
them), with no Python, no conversion and no second executable. Measured in docs/backends.md
("Collectives inside the executable").

- **Built, not shipped**: the extension compiles from the project's own C++ against the
  installed torch and jaxlib headers (``torch.utils.cpp_extension``, the machine's g++),
  into ``native/build/<python>-<torch>-<jaxlib>-<source digest>`` beside the source; `ensure_built` builds it
  (``pathways-build-extensions``, which the README's install commands run). An executor
  never builds it: where it is missing, or ``PATHWAYS_COLLECTIVES_IN_XLA=0``, collectives cut
  the graph as before (the pure-Python path), and the stage plan says so.
- **Groups by slot, axes by binding**: a formed group is registered (`register_group`) and
  gets a slot; before the compute thread calls an executable, the axes it names are bound
  to slots (`bind`). The executable names an axis by a small id fixed at compile time
  (`axis_id`), so one executable serves every group a recovery forms.
- **In graph order**: each custom call takes and gives an int32 *order* scalar, so an
  executable's collectives run in its graph's order on every member.
- **Abandoned groups** fail the call within one 200 ms wait slice (``ABORTED``), which the
  backend raises as `CollectiveAbandoned`, as a host stage would.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading

__all__ = ["ENABLE_ENV", "available", "ensure_built", "load", "axis_id", "register_lowerings", "reset_order",
           "extension_dir", "unavailable_reason", "register_targets", "why_not_compiled", "NativeGroups",
           "raising_collective_errors", "all_reduce", "all_gather", "reduce_scatter"]

log = logging.getLogger(__name__)

ENABLE_ENV = "PATHWAYS_COLLECTIVES_IN_XLA"   # "0": collectives cut the graph (the pure-Python path)
_SOURCE = os.path.join(os.path.dirname(__file__), "native", "xla_collectives.cpp")
_HEADER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "native", "shm_collectives.h")   # host groups
_NAME = "pathways_xla_collectives"
_REDUCE_IDS = {"sum": 0, "mean": 1, "max": 2}

_lock = threading.Lock()
_loaded = None            # the extension module, once imported
_why_not = ""             # why it is not (unavailable_reason)
_targets_registered = False
_axis_ids: dict[str, int] = {}
_order = threading.local()   # the order token of the executable being traced on this thread


def extension_dir() -> str:
    """Where the built extension for this torch, jaxlib and source lives."""
    import jaxlib
    import torch

    digest = hashlib.sha256()
    for path in (_SOURCE, _HEADER):
        with open(path, "rb") as source:
            digest.update(source.read())
    digest = digest.hexdigest()[:12]
    # Everything the binary's ABI depends on: Python (a module built for 3.11 must not load in 3.12), torch, jaxlib.
    python = f"py{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}"
    version = f"{python}-torch{torch.__version__.replace('+', '_')}-jaxlib{jaxlib.__version__}-{digest}"
    return os.path.join(os.path.dirname(_SOURCE), "build", version)   # beside the source, in the install


def _library_path() -> str:
    return os.path.join(extension_dir(), f"{_NAME}.so")   # where torch.utils.cpp_extension.load puts it


def ensure_built(verbose: bool = False):
    """Build the extension if this torch/jaxlib/source has none yet (about 40 s on 2 cores); return the module.
    Raises what the compiler said where it fails."""
    import jax.ffi
    import torch.utils.cpp_extension as cpp_extension

    folder = extension_dir()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    module = cpp_extension.load(_NAME, [_SOURCE], extra_include_paths=[jax.ffi.include_dir()],
                                extra_cflags=["-O2", "-Wno-return-type"], build_directory=folder, verbose=verbose)
    global _loaded, _why_not
    with _lock:
        _loaded, _why_not = module, ""
    return module


def load(path: str | None = None):
    """The built extension, imported (None where it is not built, disabled, or fails to import: see
    `unavailable_reason`). Never builds. ``path``: another build of it to import instead, before any other call
    (the sanitizer test's)."""
    global _loaded, _why_not
    with _lock:
        if _loaded is not None or _why_not:
            return _loaded
        if os.environ.get(ENABLE_ENV, "1") == "0":
            _why_not = f"{ENABLE_ENV}=0"
            return None
        try:
            path = path or _library_path()
        except Exception as exc:    # no jaxlib / torch headers: the XLA route is not installed
            _why_not = f"{type(exc).__name__}: {exc}"
            return None
        if not os.path.exists(path):
            _why_not = f"not built for this torch and jaxlib ({path} is missing): run pathways-build-extensions"
            return None
        try:
            import importlib.util

            import torch

            del torch   # imported first: the extension links against torch's libraries

            spec = importlib.util.spec_from_file_location(_NAME, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception as exc:
            _why_not = f"{path} did not load ({type(exc).__name__}: {exc}): rebuild with pathways-build-extensions"
            log.warning("collectives inside XLA are off: %s", _why_not)
            return None
        _loaded = module
        return module


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str:
    load()
    return _why_not


def axis_id(axis: str) -> int:
    """The small integer an executable names ``axis`` by (the same in every executable of this process; another
    process may number its axes otherwise, and its executables, traced there, carry its own numbers)."""
    with _lock:
        found = _axis_ids.get(axis)
        if found is None:
            limit = _loaded.max_axes() if _loaded is not None else 64
            if len(_axis_ids) >= limit:   # checked before recording: a refused name must stay refused
                raise ValueError(f"more than {limit} mesh axis names in one executor ({sorted(_axis_ids)} and "
                                 f"{axis!r}); collectives inside XLA take at most {limit}")
            found = _axis_ids[axis] = len(_axis_ids)
        return found


def reset_order() -> None:
    """Start a new executable's trace on this thread: its first collective takes a fresh order token."""
    _order.token = None


def _take_order():
    import jax.numpy as jnp

    token = getattr(_order, "token", None)
    return jnp.zeros((), jnp.int32) if token is None else token


def register_targets():
    """Tell jax of the extension's custom call targets (once); the extension module, or None where it is not
    available."""
    global _targets_registered
    import jax.ffi

    module = load()
    if module is None:
        return None

    with _lock:
        if _targets_registered:
            return module
        for name, capsule in module.handlers().items():
            jax.ffi.register_ffi_target(name, capsule, platform="cpu", api_version=1)
        _targets_registered = True
    return module


def all_reduce(x, axis, op):
    import jax
    import jax.numpy as jnp

    out, _order.token = jax.ffi.ffi_call(
        "pathways_all_reduce", (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((), jnp.int32)),
        has_side_effect=False, input_output_aliases={0: 0})(x, _take_order(), axis=_i64(axis_id(axis)),
                                                            op=_i64(_REDUCE_IDS[op]))
    return out


def all_gather(x, axis, size, dim):
    import jax
    import jax.numpy as jnp

    dim = dim % x.ndim
    stacked, _order.token = jax.ffi.ffi_call(
        "pathways_all_gather", (jax.ShapeDtypeStruct((size, *x.shape), x.dtype), jax.ShapeDtypeStruct((), jnp.int32)),
        has_side_effect=False)(x, _take_order(), axis=_i64(axis_id(axis)))
    # Member i's part at [i]; torch's cat along `dim` puts it at the i-th block of that dimension.
    moved = jnp.moveaxis(stacked, 0, dim)
    return moved.reshape(*x.shape[:dim], size * x.shape[dim], *x.shape[dim + 1:])


def reduce_scatter(x, axis, size, op, dim):
    import jax
    import jax.numpy as jnp

    dim = dim % x.ndim
    chunk = x.shape[dim] // size
    # torch's chunk(size, dim): member i keeps the i-th block along `dim`; the call takes them blocks first.
    blocks = jnp.moveaxis(x.reshape(*x.shape[:dim], size, chunk, *x.shape[dim + 1:]), dim, 0)
    out_shape = (*x.shape[:dim], chunk, *x.shape[dim + 1:])
    out, _order.token = jax.ffi.ffi_call(
        "pathways_reduce_scatter", (jax.ShapeDtypeStruct(out_shape, x.dtype), jax.ShapeDtypeStruct((), jnp.int32)),
        has_side_effect=False)(blocks, _take_order(), axis=_i64(axis_id(axis)), op=_i64(_REDUCE_IDS[op]))
    return out


def _i64(value: int):
    import numpy as np

    return np.int64(value)


def register_lowerings(env) -> bool:
    """Give torchax's environment ``env`` lowerings of the ``pathways::`` ops as the custom calls above. False (and
    nothing registered) where the extension is not available."""
    if register_targets() is None:
        return False
    import torch
    from torchax.ops import ops_registry

    from pathways_torch.wire import collective_ops

    del collective_ops   # imported for its side effect: it defines the torch.ops.pathways ops

    for op, lowering in ((torch.ops.pathways.all_reduce.default, all_reduce),
                         (torch.ops.pathways.all_gather.default, all_gather),
                         (torch.ops.pathways.reduce_scatter.default, reduce_scatter)):
        env._ops[op] = ops_registry.Operator(op, lowering, is_jax_function=True, is_user_defined=True,
                                             needs_env=False, is_view_op=False)
    return True


_GLOO_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int8", "uint8")   # ProcessGroupGloo's


def why_not_compiled(node) -> str:
    """Why the collective ``node`` (shapes in ``meta["val"]``) must stay a host stage; "" where a custom call
    takes it."""
    value = getattr(node.args[0], "meta", {}).get("val") if node.args else None
    if value is None or not hasattr(value, "dtype"):
        return "its input's shape is not known"
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype not in _GLOO_DTYPES:
        return f"gloo takes no {dtype} inside an executable"
    name = node.target.name().split("::")[-1].split(".")[0]
    arguments = dict(zip(("x", "axis", "size", "op", "dim") if name == "reduce_scatter" else
                         ("x", "axis", "size", "dim") if name == "all_gather" else ("x", "axis", "op"), node.args))
    arguments.update(node.kwargs)
    if arguments.get("op") == "mean" and not (value.is_floating_point()):
        return "a mean of integers is a float of another dtype"
    if name in ("all_gather", "reduce_scatter"):
        dim, size = arguments.get("dim", 0), arguments.get("size", 1)
        dim = dim + value.dim() if dim < 0 else dim
        if not 0 <= dim < value.dim():
            return f"dim {dim} is outside a {value.dim()}-d input"
        if name == "reduce_scatter" and value.shape[dim] % size:
            return f"dim {dim} of size {value.shape[dim]} does not split into {size}"
    return ""


class NativeGroups:
    """The extension's side of an executor's process groups, as `executor.collectives` uses it (a group registered
    gets a slot; abandoned, quiet and released by slot; axes bound before each computation)."""

    def __init__(self, module):
        self._module = module
        self.axis_id = axis_id

    def register(self, group) -> int:
        from executor.shm_group import ShmGroup

        if isinstance(group, ShmGroup):   # members of one host: the library runs it, on the executable's buffers
            return self._module.register_host_group(group.handle, group.run_address, group.rank(), group.size,
                                                    group.timeout_s)
        return self._module.register_group(group)

    def abandon(self, slot: int, reason: str) -> None:
        self._module.abandon(slot, reason)

    def quiet(self, slot: int) -> bool:
        return self._module.quiet(slot)

    def release(self, slot: int) -> None:
        self._module.release(slot)

    def bind(self, axes: list) -> None:
        self._module.bind(axes)


def raising_collective_errors(executable):
    """An executable with collectives inside, whose custom call failures raise as a host stage's would: a group
    abandoned after a fault (``ABORTED``) as `CollectiveAbandoned`, which recovery runs again."""
    def call(*arguments):
        try:
            return executable(*arguments)
        except Exception as exc:
            error = _collective_error(exc)
            if error is exc:
                raise
            raise error from exc

    return call


def _collective_error(exc: Exception) -> Exception:
    from executor.collectives import CollectiveAbandoned   # the executor's, as a host stage raises it

    text = str(exc)
    for code, kind in (("ABORTED: ", CollectiveAbandoned), ("FAILED_PRECONDITION: ", RuntimeError)):
        if code in text:
            return kind(text[text.index(code) + len(code):].strip())
    return exc
