"""The plan lowered into the captured forward: the matched modules run their per-shard forward while it is traced.

Inside `Lowered`, each module the plan names has its ``forward`` replaced (on the instance, put back
after) by one that moves its inputs into the layout the style wants, runs on the shard's local
parameters, and moves its output into the layout the style promises (`layouts.py`): a column-parallel
projection runs the module's own forward on its slice of the weight; a row-parallel one multiplies by
its slice and reduces before adding the bias (added once, not once per shard); a row-parallel embedding
looks up only the rows it holds. The collectives this inserts are ordinary ``pathways::`` ops in the
captured program, every byte of them visible in its text and its trace.
"""

from __future__ import annotations

import contextlib
import threading

from ..errors import CaptureError
from .assign import TensorPlan, module_kind
from ..stop_gradient import stop_gradient
from .layouts import enter, gather, local_slice, reduce, reduce_scatter_to, take_slice
from .styles import P, R, S, Layout

__all__ = ["Lowered"]


class _NoFastPath:
    """``nn.MultiheadAttention``'s fast path off while any `Lowered` is active (in any thread), back as it was
    after the last: the fused kernel computes on whole widths, and a replaced forward adds no hook that would
    keep ``TransformerEncoderLayer`` from calling it in eval mode."""

    _lock = threading.Lock()
    _active = 0
    _saved = True

    @classmethod
    def enter(cls) -> None:
        import torch

        with cls._lock:
            if cls._active == 0:
                cls._saved = torch.backends.mha.get_fastpath_enabled()
                torch.backends.mha.set_fastpath_enabled(False)
            cls._active += 1

    @classmethod
    def exit(cls) -> None:
        import torch

        with cls._lock:
            cls._active -= 1
            if cls._active == 0:
                torch.backends.mha.set_fastpath_enabled(cls._saved)


class _ShardWidth:
    """Within: ``x.size()`` and ``x.shape`` (of this one tensor) give its last dim divided by ``size``."""

    def __init__(self, x, size: int):
        from torch.overrides import TorchFunctionMode

        import torch

        target, sizes = x, (torch.Tensor.size, torch.Tensor.shape.__get__)

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func in sizes and args and args[0] is target:
                    if isinstance(out, int):          # x.size(dim)
                        dim = args[1] if len(args) > 1 else kwargs.get("dim")
                        return out // size if dim % target.dim() == target.dim() - 1 else out
                    return torch.Size([*out[:-1], out[-1] // size])
                return out
        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


class Lowered(contextlib.AbstractContextManager):
    """Within: ``model``'s planned modules compute per shard; ``rank`` is this shard's index on the axis."""

    def __init__(self, model, plan: TensorPlan, rank):
        self.model, self.plan, self.rank = model, plan, rank
        self._restore: list = []
        self._entered: dict = {}    # id(whole input) → (input, its f): one gradient all-reduce per input

    def __enter__(self):
        modules = dict(self.model.named_modules())
        _NoFastPath.enter()
        self._restore.append(_NoFastPath.exit)
        by_path: dict = {}
        for path, style in self.plan.modules:
            by_path.setdefault(path, []).append(style)
        try:
            for path, styles in by_path.items():
                self._lower(path, modules[path], styles)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            while self._restore:
                try:
                    self._restore.pop()()
                except BaseException:      # the others are still put back; the first failure is raised
                    if exc[0] is None:
                        self.__exit__(None, None, None)
                        raise
        finally:
            self._entered.clear()
        return False

    # ------------------------------------------------------------ installing

    def _lower(self, path: str, module, styles: list) -> None:
        size = self.plan.size
        for style in styles:
            for name in style.attributes:
                self._set(module, name, getattr(module, name) // size)
        main = next((s for s in styles if s.kind in ("colwise", "rowwise", "attention")), None)
        if main is not None and main.kind == "colwise" and module_kind(module) == "conv1d":
            self._set(module, "nf", module.nf // size)       # Conv1D shapes its output by nf
        prepares = [s for s in styles if s.kind == "prepare"]
        narrow_input = any(s.input_width for s in styles)
        if main is None and not prepares and not narrow_input:
            return
        original = module.forward
        body = self._main_forward(path, module, main, original) if main is not None else original

        def forward(*args, **kwargs):
            for style in prepares:
                args, kwargs = self._prepare_inputs(path, style, args, kwargs)
            if narrow_input and args:
                with _ShardWidth(args[0], size):
                    out = body(*args, **kwargs)
            else:
                out = body(*args, **kwargs)
            for style in prepares:
                out = self._prepare_outputs(path, style, out)
            return out

        self._set(module, "forward", forward)

    def _set(self, module, name: str, value) -> None:
        had, old = name in module.__dict__, module.__dict__.get(name)
        setattr(module, name, value)

        def restore():
            if had:
                setattr(module, name, old)
            else:
                delattr(module, name)
        self._restore.append(restore)

    # ------------------------------------------------------------ moving between layouts

    def move(self, x, source: Layout | None, target: Layout | None, where: str, chunks: int = 1):
        """``x`` from layout ``source`` to ``target`` (None on either side: left as it is)."""
        import torch

        if source is None or target is None or source == target:
            return x
        if not isinstance(x, torch.Tensor):
            raise CaptureError(f"{where}: a layout move from {source!r} to {target!r} was asked for a "
                               f"{type(x).__name__}, not a tensor; give that position None in the layouts")
        axis, size = self.plan.axis, self.plan.size
        if source.kind == "S" and target.kind == "S":
            if source.dim % x.dim() == target.dim % x.dim():
                return x
            raise CaptureError(f"{where}: moving a tensor from {source!r} to {target!r} (an all-to-all) is not "
                               f"supported; gather it first (Replicate())")
        if source == R:
            return take_slice(x, axis, target.dim, size, self.rank, chunks)
        if source.kind == "S":
            return gather(x, axis, source.dim, size, self.rank, chunks)
        if target == R:          # source is P
            return reduce(x, axis)
        return reduce_scatter_to(x, axis, target.dim, size, self.rank, chunks)

    def reduce_rows(self, partial):
        """A row-parallel product's partial sums, whole."""
        return reduce(partial, self.plan.axis)

    def enter_once(self, x):
        """Megatron's f on ``x``, once per tensor: the modules that read it share one gradient all-reduce."""
        seen = self._entered.get(id(x))
        if seen is None or seen[0] is not x:
            seen = self._entered[id(x)] = (x, enter(x, self.plan.axis))
        return seen[1]

    # ------------------------------------------------------------ styles

    def _main_forward(self, path: str, module, style, original):
        kind = module_kind(module)
        where = f"{path}: {style.source}"
        source, target = style.input_layouts[0], style.output_layouts[0]

        if style.kind == "attention":
            from .attention import sharded_attention

            return sharded_attention(self, module, where)
        if style.kind == "colwise":
            def colwise(x, *args, **kwargs):
                x = self.move(x, source, R, where)
                if kind != "embedding":
                    x = self.enter_once(x)
                return self.move(original(x, *args, **kwargs), S(-1), target, where, style.chunks)
            return colwise

        def rowwise(x, *args, **kwargs):
            if args or kwargs:
                raise CaptureError(f"{where}: a row-parallel module takes one input, got {1 + len(args) + len(kwargs)}")
            if kind == "embedding":
                partial = self._embedding_rows(module, self.move(x, source, R, where))
            else:
                partial = self._rows(module, kind, self.move(x, source, S(-1), where))
            out = self.move(partial, P, target, where)
            bias = getattr(module, "bias", None)
            if bias is not None and target.kind == "S" and target.dim % out.dim() == out.dim() - 1:
                bias = local_slice(bias, 0, self.plan.size, 1, self.rank)    # the output's features are split
            return out if bias is None else out + bias
        return rowwise

    @staticmethod
    def _rows(module, kind: str, x):
        """A row-parallel projection's partial sum: this shard's input slice times its rows of the weight."""
        import torch.nn.functional as F

        if kind == "linear":
            return F.linear(x, module.weight)
        weight = module.weight        # Conv1D: [in / size, out]
        return (x.reshape(-1, x.shape[-1]) @ weight).reshape(*x.shape[:-1], weight.shape[1])

    def _embedding_rows(self, module, ids):
        """This shard's rows of a row-parallel embedding, zero where an id is another shard's."""
        import torch
        import torch.nn.functional as F

        rows = module.weight.shape[0]
        shifted = ids - self.rank * rows
        outside = (shifted < 0) | (shifted >= rows)
        found = F.embedding(shifted.masked_fill(outside, 0), module.weight)
        found = found.masked_fill(outside.unsqueeze(-1), 0)
        if module.padding_idx is not None:     # the padding row is looked up, but learns nothing
            padding = (ids == module.padding_idx % module.num_embeddings).unsqueeze(-1)
            found = torch.where(padding, stop_gradient(found), found)
        return found

    def _prepare_inputs(self, path: str, style, args: tuple, kwargs: dict) -> tuple:
        where = f"{path}: {style.source}"
        if len(style.input_layouts) > len(args):
            raise CaptureError(f"{where}: input_layouts names {len(style.input_layouts)} positional inputs, the "
                               f"module was called with {len(args)} (and keywords {sorted(kwargs)}); name "
                               f"keyword inputs in input_kwarg_layouts")
        moved = [self.move(a, layout, desired, where)
                 for a, layout, desired in zip(args, style.input_layouts, style.desired_inputs)]
        kwargs = dict(kwargs)
        for name, layout, desired in style.kwarg_layouts:
            if name not in kwargs:
                raise CaptureError(f"{where}: input_kwarg_layouts names {name!r}, the module was called with "
                                   f"keywords {sorted(kwargs)}")
            kwargs[name] = self.move(kwargs[name], layout, desired, where)
        return (*moved, *args[len(moved):]), kwargs

    def _prepare_outputs(self, path: str, style, out):
        if not style.output_layouts:
            return out
        where = f"{path}: {style.source}"
        outs = out if isinstance(out, tuple) else (out,)
        if len(outs) < len(style.output_layouts):
            raise CaptureError(f"{where}: output_layouts names {len(style.output_layouts)} outputs, the module "
                               f"returned a {type(out).__name__}{f' of {len(outs)}' if isinstance(out, tuple) else ''}")
        moved = [self.move(o, layout, desired, where)
                 for o, layout, desired in zip(outs, style.output_layouts, style.desired_outputs)]
        return (*moved, *outs[len(moved):]) if isinstance(out, tuple) else moved[0]
