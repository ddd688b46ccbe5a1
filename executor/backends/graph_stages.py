"""Cut an aten graph into stages a compiler takes whole and stages that must run on the host.

A *host* node is a ``pathways::`` collective (it talks to other executors through
gloo/NCCL) that the compiler cannot take (``compiled_collective`` says which it can: on
``xla:torchax`` with the built extension, `xla_collectives`), or an op the compiler cannot
lower (a *fallback*). Every maximal run of
the other nodes between host nodes is one compiled stage. Values cross stages
through numbered *slots*: the graph's inputs first, then its tensor constants,
then every value one stage makes and a later one reads. `StagePlan` prints as
text, one line per stage, so the cut is testable and visible in logs.

Ops that have no lowering but do have a torch decomposition are decomposed first
(the graph is re-traced with exactly those decompositions), so they stay in XLA.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Sequence

__all__ = ["Stage", "StagePlan", "split_stages", "is_collective"]

_MAX_DECOMPOSITION_ROUNDS = 4


@dataclasses.dataclass
class Stage:
    """``kind``: ``"jax"`` (compiled), ``"collective"`` or ``"fallback"`` (host); slots in and out."""

    kind: str
    graph_module: object
    example_inputs: list          # meta/fake tensors with each input's shape and dtype
    input_slots: list[int]
    output_slots: list[int]
    node_names: list[str]         # the aten ops of the stage (fallbacks: what ran outside XLA)
    compiled_collectives: int = 0  # collectives inside a compiled stage (custom calls)
    host_reason: str = ""          # a collective stage: why it is not inside the compiled stage


@dataclasses.dataclass
class StagePlan:
    stages: list[Stage]
    num_inputs: int
    constants: dict[int, object]  # index among the constants -> the tensor
    num_intermediates: int
    output_slots: list[int]

    @property
    def num_constants(self) -> int:
        return len(self.constants)

    def single_jax_stage(self) -> bool:
        """One compiled stage reading every input and constant in order and giving the outputs: no slots needed."""
        return len(self.stages) == 1 and self.stages[0].kind == "jax" and self.stages[0].input_slots == list(
            range(self.num_inputs + self.num_constants))

    def __str__(self) -> str:
        lines = [f"inputs 0..{self.num_inputs - 1}, constants {self.num_constants}"]
        for i, stage in enumerate(self.stages):
            what = f"{len(stage.node_names)} ops" if stage.kind == "jax" else ", ".join(stage.node_names)
            if stage.compiled_collectives:
                what += f", {stage.compiled_collectives} collective(s) inside"
            if stage.host_reason:
                what += f": {stage.host_reason}"
            lines.append(f"stage {i} {stage.kind}: {stage.input_slots} -> {stage.output_slots} ({what})")
        lines.append(f"outputs {self.output_slots}")
        return "\n".join(lines)


def is_collective(node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", "") == "pathways"


def split_stages(graph_module, example_inputs: Sequence, lowerable: Callable[[object], bool],
                 compiled_device=None, collective_refusal: Callable[[object], str] | None = None) -> StagePlan:
    """The stages of ``graph_module`` (an aten fx graph) for inputs shaped like ``example_inputs``.

    ``compiled_device``: the device that constructors inside a compiled stage name (torchax's ``jax``);
    None leaves them as traced. ``collective_refusal(node)``: why a collective node (its shapes in
    ``node.meta["val"]``) cannot run inside a compiled stage, "" where it can; None: every collective is a host
    stage."""
    graph_module = _decompose_unlowerable(graph_module, example_inputs, lowerable)
    _propagate_shapes(graph_module, example_inputs)
    nodes = list(graph_module.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    constants = [n for n in nodes if n.op == "get_attr"]
    slot = {n: i for i, n in enumerate(placeholders + constants)}
    constant_values = {i: _attr(graph_module, n.target) for i, n in enumerate(constants)}
    output = next(n for n in nodes if n.op == "output")
    outputs = _as_list(output.args[0])
    groups = _group(nodes, lowerable, collective_refusal)
    if len(groups) == 1 and groups[0][0] == "jax":
        # The common case: the whole graph is one executable over (inputs, constants).
        stage = _stage("jax", groups[0][1], placeholders + constants, outputs, compiled_device)
        stage.input_slots = list(range(len(slot)))
        stage.output_slots = list(range(len(slot), len(slot) + len(outputs)))
        return StagePlan([stage], len(placeholders), constant_values, len(outputs), stage.output_slots)
    stages = []
    later_uses = _uses_after(groups, outputs)
    for index, (kind, members) in enumerate(groups):
        member_set = set(members)
        inputs = _unique(a for n in members for a in n.all_input_nodes if a not in member_set)
        produced = [n for n in members if later_uses[index].get(n)]
        if kind != "jax":
            tuple_valued = [n for n in produced if not _is_tensor_node(n)]
            if tuple_valued:
                raise NotImplementedError(f"a host stage's tuple output {tuple_valued[0]} is read whole outside it")
        for n in produced:
            slot[n] = len(slot)
        stage = _stage(kind, members, inputs, produced, compiled_device if kind == "jax" else None)
        stage.input_slots = [slot[n] for n in inputs]
        stage.output_slots = [slot[n] for n in produced]
        stages.append(stage)
    num_intermediates = len(slot) - len(placeholders) - len(constants)
    return StagePlan(stages, len(placeholders), constant_values, num_intermediates, [slot[n] for n in outputs])


def _group(nodes, lowerable, collective_refusal=None) -> list[tuple[str, list]]:
    """Consecutive compute nodes in groups of one kind; a host op with its getitems is a group of its own."""
    groups: list[tuple[str, list]] = []
    group_of = {}
    for node in nodes:
        if node.op != "call_function":
            continue
        source = node.args[0] if node.target is operator.getitem else None
        if source is not None and source in group_of and groups[group_of[source]][0] != "jax":
            groups[group_of[source]][1].append(node)     # a host op's tuple element stays with the op
            group_of[node] = group_of[source]
            continue
        kind = _kind(node, lowerable, collective_refusal)
        if kind == "jax" and groups and groups[-1][0] == "jax":
            groups[-1][1].append(node)
        else:
            groups.append((kind, [node]))
        group_of[node] = len(groups) - 1
    return groups or [("jax", [])]


def _kind(node, lowerable, collective_refusal=None) -> str:
    if is_collective(node):
        why = "no custom call for collectives here" if collective_refusal is None else collective_refusal(node)
        node.meta["pathways_host_reason"] = why
        return "collective" if why else "jax"
    target = node.target
    if _is_aten(target) and not lowerable(target):
        return "fallback"
    return "jax"


def _uses_after(groups, outputs) -> list[dict]:
    """Per group: which of its nodes are read by a later group or by the graph's output."""
    owner = {n: i for i, (_, members) in enumerate(groups) for n in members}
    used = [dict() for _ in groups]
    for i, (_, members) in enumerate(groups):
        for n in members:
            for a in n.all_input_nodes:
                if a in owner and owner[a] != i:
                    used[owner[a]][a] = True
    for n in outputs:
        if n in owner:
            used[owner[n]][n] = True
    return used


def _stage(kind: str, members: list, inputs: list, outputs: list, on_device=None) -> Stage:
    """A GraphModule of ``members`` reading ``inputs`` (as placeholders) and returning ``outputs``; constructors
    in it make values on ``on_device`` where one is given."""
    import torch
    import torch.fx

    graph = torch.fx.Graph()
    env = {}
    for i, n in enumerate(inputs):
        env[n] = graph.placeholder(f"in_{i}")
    for n in members:
        copied = graph.node_copy(n, lambda a: env[a])
        if on_device is not None and "device" in copied.kwargs:
            # Constructors inside a compiled stage make the compiler's values (torchax's "jax" device).
            copied.kwargs = {**copied.kwargs, "device": on_device}
        env[n] = copied
    graph.output(tuple(env[n] for n in outputs))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    names = [str(getattr(n.target, "__name__", n.target)) for n in members if n.target is not operator.getitem]
    inside = sum(1 for n in members if is_collective(n)) if kind == "jax" else 0
    why = members[0].meta.get("pathways_host_reason", "") if kind == "collective" else ""
    return Stage(kind, module, [n.meta.get("val") for n in inputs], [], [], names, inside, why)


def _decompose_unlowerable(graph_module, example_inputs, lowerable):
    """Re-trace with torch's decompositions of the aten ops that have no lowering, until none is left to decompose."""
    import torch
    from torch._decomp import decomposition_table
    from torch.fx.experimental.proxy_tensor import make_fx

    for _ in range(_MAX_DECOMPOSITION_ROUNDS):
        missing = {n.target for n in graph_module.graph.nodes
                   if n.op == "call_function" and _is_aten(n.target) and not lowerable(n.target)}
        table = {op: decomposition_table[op] for op in missing if op in decomposition_table}
        if not table:
            return graph_module
        zeros = [torch.empty(t.shape, dtype=t.dtype) for t in example_inputs]
        graph_module = make_fx(graph_module, decomposition_table=table, tracing_mode="fake")(*zeros)
    return graph_module


def _propagate_shapes(graph_module, example_inputs) -> None:
    """Every node's fake value in ``node.meta["val"]``: what stage inputs look like."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    import torch

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:   # CPU fakes (the graph's own constructors make CPU tensors), no memory
        fakes = [torch.empty(t.shape, dtype=t.dtype, device="cpu") for t in example_inputs]
    FakeTensorProp(graph_module, mode).propagate_dont_convert_inputs(*fakes)


def _is_aten(target) -> bool:
    return getattr(target, "namespace", "") == "aten"


def _is_tensor_node(node) -> bool:
    import torch

    return isinstance(node.meta.get("val"), torch.Tensor)


def _attr(module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _unique(items) -> list:
    return list(dict.fromkeys(items))


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]
