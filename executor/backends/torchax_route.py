"""The ``xla:torchax`` route (the default): torch graphs lowered to XLA through JAX, values kept as jax arrays.

A received aten graph is cut into *stages*: runs of ops that torchax lowers become
one ``jax.jit`` each (compiled ahead of time on the compile thread); a
``pathways::`` collective, or an op with no lowering (a *fallback*, counted and
logged per function), is a host stage that runs in torch on zero-copy views of
the jax arrays. A graph without either is one jitted call, which is the common
case: the store keeps its outputs as jax arrays, so values move between
computations without leaving XLA's buffers. Conversions happen only at host
stages and on the wire, and are counted (`counters`).

Compiled executables go to JAX's persistent compilation cache
(``PATHWAYS_CACHE_DIR``, default ``~/.cache/pathways_torch``), so a second run of
the same program skips XLA's compile.
"""

from __future__ import annotations

import collections
import logging
import os
from typing import Sequence

from pathways_torch.wire.graph_schema import decode_graph
from pathways_torch.wire.tensors import dtype_name, frame_buffer, frame_to_tensor

from .compile_errors import REFUSE_ENV, BackendCompileError, failing_node, refused_lowerings
from . import torchax_fusion, xla_collectives
from .graph_stages import Stage, split_stages
from .torch_based import bytes_digest, meta_examples
from .torchax_compat import has_lowering, import_torchax

__all__ = ["TorchaxBackend", "cache_dir", "cache_dir_refusal"]

log = logging.getLogger(__name__)


def cache_dir() -> str:
    """Where compiled XLA executables persist between runs (``PATHWAYS_CACHE_DIR`` overrides)."""
    root = os.environ.get("PATHWAYS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pathways_torch")
    return os.path.join(root, "jax")


def cache_dir_refusal(path: str) -> str | None:
    """Why the executable cache at ``path`` must not be used (None: it may). An executable loaded from there runs
    as this process: a folder on its way that another user owns, or that others may write to, could hand it theirs.
    """
    path = os.path.abspath(path)
    if not os.path.exists(path):   # made by us, 0700: only the folder it goes in must not let others swap it
        parent = os.path.dirname(path)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        info = os.stat(parent)
        if info.st_mode & 0o022 and not info.st_mode & 0o1000:   # others may write there, and it is not sticky
            return f"{parent} has mode {oct(info.st_mode & 0o777)}: writable by others; chmod go-w it"
        return None
    info = os.stat(path)
    if info.st_uid != os.geteuid():
        return f"{path} is owned by uid {info.st_uid}, expected this user ({os.geteuid()})"
    if info.st_mode & 0o022:
        return f"{path} has mode {oct(info.st_mode & 0o777)}: writable by others; chmod go-w it"
    return None


class _Prepared:
    """A decoded function on its way to the compiler: its graph, its name (for fallback counts) and the inputs
    its callers donate (``Graph.donated_inputs``)."""

    __slots__ = ("graph_module", "name", "donated")

    def __init__(self, graph_module, name: str, donated: frozenset = frozenset()):
        self.graph_module, self.name, self.donated = graph_module, name, donated


class TorchaxBackend:
    """XLA through torchax and JAX; the store holds jax arrays."""

    name = "xla:torchax"
    compiles_in_background = True

    def __init__(self, device: str = "cpu", threads: int = 1):
        if device == "cpu":
            # Only the CPU client: a jax with GPU plugins would otherwise claim the GPUs.
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        self.threads = threads   # not honoured by XLA's CPU runtime (docs/backends.md: use CPU affinity)
        import jax

        # torch semantics: int64 indices and float64 stay 64-bit.
        jax.config.update("jax_enable_x64", True)
        refusal = cache_dir_refusal(cache_dir())
        if refusal is None:
            os.makedirs(cache_dir(), mode=0o700, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", cache_dir())
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            # Bounded: the least recently used executables go once the folder passes this size.
            jax.config.update("jax_compilation_cache_max_size", _CACHE_MAX_BYTES)
        else:
            log.warning("not using the XLA executable cache at %s (every run compiles afresh): %s; set "
                        "PATHWAYS_CACHE_DIR to a folder of your own", cache_dir(), refusal)
        # On CPU an executable runs on the calling thread: a compute span is the computation, and no
        # hand-over to XLA's thread pool (measured: Chained 2,600 -> 3,300 steps/s at N=2).
        jax.config.update("jax_cpu_enable_async_dispatch", False)
        self._async = device != "cpu"
        import warnings

        import jax.numpy as jnp
        import numpy as np
        import torch

        self._jax, self._jnp, self._np, self._torch = jax, jnp, np, torch
        # Host stages read jax buffers through read-only numpy views; they never write them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        # A stage's last read of an intermediate is donated whether or not an output can use its buffer.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        self._torchax, self._env = import_torchax()
        _refuse_for_tests(self._env)
        # Collectives as custom calls inside the executables where the extension is built; else they cut.
        self.collectives_in_xla = xla_collectives.register_lowerings(self._env)
        # What the executor's CollectiveRuntime registers its groups with (None: collectives cut the graph).
        self.native_collectives = xla_collectives.NativeGroups(xla_collectives.load()) if self.collectives_in_xla \
            else None
        if not self.collectives_in_xla:
            log.info("xla:torchax: collectives cut the executables (%s)", xla_collectives.unavailable_reason())
        self._jax_device = jax.devices()[0]
        self.device = f"{self._jax_device.platform}:{self._jax_device.id}"
        self._compiles = 0
        self._counts: collections.Counter = collections.Counter()
        # Counted on every collective: plain ints (a Counter's string-keyed += costs more, per call).
        self.num_to_torch = self.num_from_torch = 0
        self._numpy_dtypes = _numpy_dtypes()
        self._wire_numpy = {dtype_name(d): self._np.dtype(dtype_name(d)) for d in self._numpy_dtypes}

    # ------------------------------------------------------------ functions

    def prepare(self, load, payload):
        return (_Prepared(decode_graph(load.graph, payload), load.name, frozenset(load.graph.donated_inputs)),
                meta_examples(load))

    def compile(self, prepared: _Prepared, example_inputs: Sequence):
        try:
            stages = split_stages(prepared.graph_module, example_inputs,
                                  lowerable=lambda op: has_lowering(self._env, op),
                                  compiled_device=self._torch.device("jax"),   # torchax's device: XLA values
                                  collective_refusal=self._collective_refusal)
        except Exception as exc:
            if not _data_dependent(exc):
                raise
            return self._whole_function_on_host(prepared, exc)
        fallbacks = [s.node_names for s in stages.stages if s.kind == "fallback"]
        cuts = sum(1 for s in stages.stages if s.kind == "collective")
        if fallbacks:
            ops = sorted({op for names in fallbacks for op in names})
            log.warning("xla:torchax: function %s runs %d op(s) outside XLA (no lowering): %s",
                        prepared.name, len(fallbacks), ", ".join(ops))
        self._counts[f"fallback_ops:{prepared.name}"] = len(fallbacks)
        self._counts[f"collective_cuts:{prepared.name}"] = cuts
        self._counts[f"collectives_in_xla:{prepared.name}"] = sum(s.compiled_collectives for s in stages.stages)
        program = _StagedProgram(self, stages, prepared.donated)
        self._compiles += program.num_jitted
        return program

    def _collective_refusal(self, node) -> str:
        """Why collective ``node`` cuts the executable ("" where it runs inside it)."""
        if not self.collectives_in_xla:
            return f"collectives cut executables here ({xla_collectives.unavailable_reason()})"
        return xla_collectives.why_not_compiled(node)

    def _whole_function_on_host(self, prepared: _Prepared, why: BaseException):
        """A function whose output sizes depend on the data (``x[x > 0]``): XLA needs static shapes, so the
        whole function runs in torch, op by op, counted and logged as outside XLA."""
        ops = sum(1 for n in prepared.graph_module.graph.nodes if n.op == "call_function")
        log.warning("xla:torchax: function %s has data-dependent output sizes (%s): its %d ops run in torch, "
                    "outside XLA", prepared.name, type(why).__name__, ops)
        self._counts[f"fallback_ops:{prepared.name}"] = ops
        self._counts[f"collective_cuts:{prepared.name}"] = 0
        return _HostProgram(self, prepared.graph_module, ops)

    def run(self, compiled, inputs):
        outputs = compiled(inputs)
        if self._async:
            # Keep the trace's compute spans (and the executor's idea of "done") true.
            self._jax.block_until_ready(outputs)
        return outputs

    def num_compiles(self) -> int:
        return self._compiles

    # ------------------------------------------------------------ fusion (executor/fusion.py)

    def fusion_refusal(self, compiled) -> str:
        return torchax_fusion.fusion_refusal(compiled)

    def fusion_ops(self, compiled) -> int:
        return torchax_fusion.fusion_ops(compiled)

    def fuse(self, unit, values: list):
        """One executable for the consecutive steps of ``unit`` (`executor.fusion.FusedSteps`)."""
        self._compiles += 1
        executable = torchax_fusion.fuse(self, unit, values)
        self._counts["fused_executables"] += 1
        self._counts["fused_steps"] += len(unit.steps)
        return executable

    @staticmethod
    def fast_call(compiled):
        return _fast_call(compiled)

    def counters(self) -> dict[str, int]:
        return {**self._counts, "conversions:jax->torch": self.num_to_torch,
                "conversions:torch->jax": self.num_from_torch}

    # ------------------------------------------------------------ values

    def from_frame(self, meta, frames):
        """A received frame as a jax array: small ones of a dtype numpy has straight from the frame's bytes (38
        against 99 µs through a torch tensor for a pipeline's 48 KB activation), the rest shared by DLPack."""
        self._counts["conversions:wire->jax"] += 1
        dtype = self._wire_numpy.get(meta.dtype)
        if dtype is not None:
            buffer, shape = frame_buffer(meta, frames, dtype.itemsize)
            if buffer.nbytes <= _COPY_BELOW_BYTES:
                return self._jnp.asarray(self._np.frombuffer(buffer, dtype=dtype).reshape(shape))
        return self.from_torch(frame_to_tensor(meta, frames), counted=False)

    def to_frame(self, value, meta, frame_index):
        self._counts["conversions:jax->wire"] += 1
        array = self._bytes_of(value)
        meta.dtype = str(array.dtype)
        meta.shape[:] = list(array.shape)
        meta.frame = frame_index
        return memoryview(array.reshape(-1).view(self._np.uint8))

    def digest(self, value) -> bytes:
        array = self._bytes_of(value)
        return bytes_digest(array.reshape(-1).view(self._np.uint8), array.shape)

    def _bytes_of(self, value):
        """A dense numpy view of a jax array's buffer (on CPU, no copy), its shape kept (``ascontiguousarray``
        alone would make a 0-d array 1-d)."""
        array = self._np.asarray(value)
        return array if array.flags.c_contiguous else self._np.ascontiguousarray(array)

    def to_torch(self, value):
        """A torch tensor sharing ``value``'s buffer (CPU), for host stages (about 1 µs)."""
        self.num_to_torch += 1
        array = self._np.asarray(value)      # a read-only view: host stages never write their inputs
        if array.dtype.kind in "biufc":
            return self._torch.from_numpy(array)
        return self._torch.from_dlpack(value)  # bfloat16 and other dtypes numpy lacks

    def from_torch(self, tensor, counted: bool = True):
        """A jax array from a torch tensor: a copy when small (faster than DLPack's hand-over), else shared."""
        if counted:
            self.num_from_torch += 1
        tensor = tensor.detach().contiguous()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if tensor.nbytes <= _COPY_BELOW_BYTES and tensor.dtype in self._numpy_dtypes:
            return self._jnp.asarray(tensor.numpy())
        try:
            return self._jax.dlpack.from_dlpack(tensor)
        except Exception:   # an alignment DLPack refuses: copy
            return self._jax.device_put(self._np.array(tensor.numpy()), self._jax_device)

    def host_to_stage(self, tensor):
        """A host stage's output as the argument of the next compiled stage: a numpy view, which the
        executable takes as it is (4 µs against 10-20 µs to make a jax array first)."""
        self.num_from_torch += 1
        if tensor.dtype in self._numpy_dtypes and not tensor.requires_grad and tensor.is_cpu:
            return tensor.contiguous().numpy()
        return self.from_torch(tensor, counted=False)

    def jit(self, graph_module, example_inputs, donate: tuple[int, ...] = ()):
        """``graph_module`` as an ahead-of-time compiled XLA executable taking and returning jax arrays; the
        inputs at ``donate`` are given to it (XLA may write its outputs into their buffers, and deletes them).
        A failure raises `BackendCompileError` naming the op it failed at."""
        try:
            return _fast_call(self._lower(graph_module.forward, example_inputs, donate).compile())
        except Exception as exc:
            node = failing_node(graph_module, lambda run: self._lower(run, example_inputs))
            if node is None:
                raise
            op = str(node.target)
            raise BackendCompileError(f"xla:torchax cannot compile {op} (node {node.name}): "
                                      f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                                      op=op, node_index=node.meta.get("pathways_index", 0)) from exc

    def _lower(self, forward, example_inputs, donate: tuple[int, ...] = ()):
        jax = self._jax
        from torchax import interop

        def traced(*arrays):
            xla_collectives.reset_order()   # this executable's collectives in its graph's order
            return interop.call_torch(forward, *arrays)

        shapes = [jax.ShapeDtypeStruct(tuple(t.shape), _jax_dtype(t.dtype)) for t in example_inputs]
        return jax.jit(traced, donate_argnums=donate).lower(*shapes)

    def copy_value(self, value):
        """A stored value's own copy (an input a computation would consume but does not hold alone)."""
        return self._jnp.array(value, copy=True)


_CACHE_MAX_BYTES = 2 << 30   # the persistent compile cache's bound (2 GiB)

# Below this size a host value is copied into a new jax array (a copy is cheaper than DLPack's
# hand-over, 10 against 20 µs for a scalar); above it the buffer is shared.
_COPY_BELOW_BYTES = 1 << 16


def _numpy_dtypes():
    import torch

    return frozenset((torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
                      torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128))


def _refuse_for_tests(env) -> None:
    """Make the lowerings named in ``PATHWAYS_REFUSE_LOWERING`` fail (tests drive the compile-error path)."""
    import torch

    for name in refused_lowerings():
        packet, _, overload = name.removeprefix("aten.").rpartition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload)

        def refuse(*args, _name=name, **kwargs):
            raise NotImplementedError(f"{_name}: lowering refused ({REFUSE_ENV})")

        env.override_op_definition(op, refuse)


def _fast_call(compiled):
    """The executable's C++ call path itself, without ``Compiled.__call__``'s Python frame (which makes
    the same object on its first call); the ``Compiled`` where this jax has none."""
    try:
        call = compiled._executable.create_cpp_call(compiled._params)
    except Exception:   # a jax without this private path: the public call works the same
        call = None
    return call or compiled


def _jax_dtype(torch_dtype):
    import jax.numpy as jnp

    return jnp.dtype(str(torch_dtype).removeprefix("torch."))


class _StagedProgram:
    """A graph's stages, run in order on jax arrays; host stages in torch on views of them."""

    def __init__(self, backend: TorchaxBackend, stages, donated_inputs: frozenset = frozenset()):
        self._backend = backend
        self._plan = stages
        self.num_jitted = 0
        self.constants = [None] * stages.num_constants   # as jax arrays (a fused executable's arguments too)
        import numpy
        import torch

        self._ndarray = numpy.ndarray
        self._from_numpy, self._to_torch = torch.from_numpy, backend.to_torch
        self._free_slots = [None] * stages.num_intermediates
        self._steps = []
        self._frees, donated = _last_uses(stages), set()
        for stage, frees in zip(stages.stages, self._frees):
            if stage.kind == "jax":
                # What this stage reads last is given to it: its buffers may hold the stage's outputs (a step's
                # update writes the new state where the old one was): an intermediate, or a function input its
                # callers donate; the executor passes a copy of such an input that a run does not hold alone.
                # (``frees`` never holds a constant or a returned value.)
                donate = tuple(i for i, slot in enumerate(stage.input_slots) if slot in frees
                               and stage.input_slots.count(slot) == 1
                               and (slot >= stages.num_inputs or slot in donated_inputs))
                donated.update(stage.input_slots[i] for i in donate if stage.input_slots[i] < stages.num_inputs)
                executable = backend.jit(stage.graph_module, stage.example_inputs, donate)
                if stage.compiled_collectives:
                    executable = xla_collectives.raising_collective_errors(executable)
                self.num_jitted += 1
                self._steps.append((True, executable, stage.input_slots, stage.output_slots))
            else:
                self._steps.append((False, _host_callable(stage), stage.input_slots, stage.output_slots))
        for index, tensor in stages.constants.items():
            self.constants[index] = backend.from_torch(tensor, counted=False)
        host_made = {slot for stage in stages.stages if stage.kind != "jax" for slot in stage.output_slots}
        # Outputs a host stage made are numpy views until stored: only then is a pass over them needed.
        self._host_made_outputs = bool(host_made & set(stages.output_slots))
        self.donated_inputs = frozenset(donated)   # function inputs it consumes (executor: `LoadedFunction.mutates`)
        single = stages.single_jax_stage()
        self._single = self._steps[0][1] if single else None
        self.single_stage = stages.stages[0] if single else None   # what a fused executable traces again
        kinds = collections.Counter(stage.kind for stage in stages.stages)
        inside = sum(stage.compiled_collectives for stage in stages.stages)
        self.summary = (f"{kinds['jax']} XLA stage(s), cut at {kinds['collective']} collective(s), "
                        f"{kinds['fallback']} op(s) outside XLA"
                        + (f", {inside} collective(s) inside XLA" if inside else ""))

    def __call__(self, inputs):
        if self._single is not None:
            return list(self._single(*inputs, *self.constants))
        slots = [*inputs, *self.constants, *self._free_slots]
        inputs.clear()   # the slots hold them now, each until its last stage
        as_torch, host_to_stage = self._as_torch, self._backend.host_to_stage
        for (is_jax, run, input_slots, output_slots), frees in zip(self._steps, self._frees):
            arguments = [slots[i] for i in input_slots]
            for slot in frees:
                slots[slot] = None
            if is_jax:
                outputs = run(*arguments)
            else:
                # A host stage reads views of jax buffers and hands numpy views on (see host_to_stage).
                outputs = [host_to_stage(t) for t in run(*[as_torch(a) for a in arguments])]
            del arguments
            for slot, value in zip(output_slots, outputs):
                slots[slot] = value
        if self._host_made_outputs:
            return [self._stored(slots[i]) for i in self._plan.output_slots]
        return [slots[i] for i in self._plan.output_slots]

    def _as_torch(self, value):
        """A stage input for a host stage: a jax array (viewed) or a numpy view a host stage made."""
        if type(value) is self._ndarray:
            return self._from_numpy(value)
        return self._to_torch(value)

    def _stored(self, value):
        """What the store keeps: jax arrays (a host stage's numpy output becomes one here)."""
        return self._backend.from_torch(self._from_numpy(value), counted=False) \
            if isinstance(value, self._ndarray) else value


def _last_uses(stages) -> list[tuple[int, ...]]:
    """Per stage, the slots no later stage reads and the function does not return (its last use of them)."""
    kept = set(stages.output_slots) | set(range(stages.num_inputs, stages.num_inputs + stages.num_constants))
    last = {slot: index for index, stage in enumerate(stages.stages) for slot in stage.input_slots}
    return [tuple(slot for slot in dict.fromkeys(stage.input_slots) if last[slot] == index and slot not in kept)
            for index, stage in enumerate(stages.stages)]


def _data_dependent(exc: BaseException) -> bool:
    """Whether shape propagation failed because sizes depend on the data (not a bug)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    causes = (DynamicOutputShapeException, DataDependentOutputException, GuardOnDataDependentSymNode)
    while exc is not None:
        if isinstance(exc, causes):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class _HostProgram:
    """A whole function in torch on views of the jax inputs; its outputs stored as jax arrays."""

    def __init__(self, backend: TorchaxBackend, graph_module, num_ops: int):
        from pathways_torch.wire.collective_ops import call_runtime_directly

        self._backend = backend
        self._forward = call_runtime_directly(graph_module).forward
        self.num_jitted = 0
        self.summary = f"data-dependent output sizes: all {num_ops} op(s) outside XLA, in torch"

    def __call__(self, inputs):
        backend = self._backend
        out = self._forward(*[backend.to_torch(v) for v in inputs])
        return [backend.from_torch(t) for t in (out if isinstance(out, (list, tuple)) else [out])]


def _host_callable(stage: Stage):
    """A host stage's nodes in torch (collectives through the runtime, directly): tensors in, a tuple out.

    ``forward`` itself, not the module: ``nn.Module.__call__`` costs microseconds per call."""
    from pathways_torch.wire.collective_ops import call_runtime_directly

    return call_runtime_directly(stage.graph_module).forward

