"""Programs on the controller: lowering a traced program into per-executor plans, and its runs.

Lowering passes, each printable:
1. placement — which executor runs which node, on which shard;
2. transfers — for every input that lives on another executor, a push from its
   owner (executor→executor, never through the controller);
3. buffer plan — which values are program outputs (kept), and which are
   intermediates each executor frees once their last local use is done;
plus the gang order of collective nodes on each executor.
"""

from __future__ import annotations

import collections
import dataclasses

from pathways_torch.wire import pb
from pathways_torch.wire.seam import ProgramSpec

from .plan_bytes import PlanWriter


__all__ = ["ProgramSpec", "LoweredProgram", "lower"]


@dataclasses.dataclass
class LoweredProgram:
    """Per-executor plans (``RegisterProgram`` messages) and the text of each pass."""

    spec: ProgramSpec
    program_id: int
    plans: dict[str, pb.RegisterProgram]
    last_collective_node: dict[str, int]     # executor → 1 + index of its last collective node (0: none)
    reporting_nodes: list[int]
    function_ids: dict[str, frozenset[int]] = dataclasses.field(default_factory=dict)   # executor → what it runs

    def describe(self) -> str:
        lines = [f"lowered {self.spec.name}: {len(self.spec.nodes)} nodes on {len(self.plans)} executors"]
        for executor_id, plan in self.plans.items():
            lines.append(f"executor {executor_id}:")
            for action in plan.actions:
                if action.WhichOneof("kind") == "run":
                    run = action.run
                    ins = ", ".join(f"%{r.value}[{r.shard}]{' (copy)' if r.copy else ''}" for r in run.inputs)
                    outs = ", ".join(f"%{v}[{run.shard}]" for v in run.outputs)
                    flags = []
                    if run.collective:
                        prev = (f"after n{run.prev_collective_node - 1}" if run.prev_collective_node
                                else "first here in the run")
                        flags.append(f"collective, {prev}")
                    if run.report:
                        flags.append("report")
                    if run.digest_outputs:
                        flags.append("digest")   # debug mode: replicated outputs compared across shards
                    suffix = f"  [{'; '.join(flags)}]" if flags else ""
                    name = self.spec.nodes[run.node].name
                    lines.append(f"  n{run.node}: {outs} = {name}({ins}){suffix}")
                else:
                    send = action.send
                    lines.append(f"  send %{send.value}[{send.shard}] -> n{send.to_node} at {send.to_address}")
            if plan.local_intermediates:
                freed = ", ".join(f"%{r.value}[{r.shard}]" for r in plan.local_intermediates)
                lines.append(f"  free after use: {freed}")
        return "\n".join(lines)


def lower(spec: ProgramSpec, program_id: int, addresses, keys: dict[str, bytes] | None = None,
          axis_groups: dict[int, dict[str, list[int]]] | None = None) -> LoweredProgram:
    """Lower ``spec``: ``addresses`` gives each executor's data address (a dict), or where a source sends to a
    destination and whether that is its transfer inbox (a callable: `ResourceManager.route`; across islands, the
    link's); ``axis_groups[node][axis][position]`` the group of each collective node's shards."""
    route = addresses if callable(addresses) else (lambda source, destination: (addresses[destination], False))
    keys = keys or {}
    axis_groups = axis_groups or {}
    where = spec.value_meshes()
    outputs = set(spec.output_values)
    inputs = set(spec.input_values)
    writer = PlanWriter(pb.RegisterProgram(program_id=program_id, name=spec.name, input_values=spec.input_values,
                                           output_values=spec.output_values, num_nodes=len(spec.nodes)))
    last_collective: dict[str, int] = collections.defaultdict(int)
    produced_here: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    functions: dict[str, set[int]] = collections.defaultdict(set)

    reporting = []
    for index, node in enumerate(spec.nodes):
        report = any(v in outputs for v in node.outputs)
        if report:
            reporting.append(index)
        template = PlanWriter.node_template(pb.ProgramNode(
            node=index, function_id=node.function_id, outputs=node.outputs, report=report,
            digest_outputs=report and node.debug and any(node.replicated_outputs)))
        kept = [PlanWriter.value_key(v) for v in node.outputs if v not in outputs and v not in inputs]
        input_meshes = [(PlanWriter.value_key(value), value, where[value].executor_ids) for value in node.inputs]
        for position, executor_id in enumerate(node.mesh.executor_ids):
            run_inputs = []
            for key, value, sources in input_meshes:
                source = sources[position]
                run_inputs.append((key, source != executor_id))
                if source != executor_id:   # pass 2: the owner pushes its shard here
                    address, to_inbox = route(source, executor_id)
                    writer.add_send(source, pb.ProgramSend(
                        value=value, shard=position, to_node=index, to_address=address,
                        to_public_key=keys.get(executor_id, b""), to_inbox=to_inbox))
            chaining = None
            if node.collective_axes:
                chaining = pb.ProgramNode(collective=True, prev_collective_node=last_collective[executor_id])
                last_collective[executor_id] = index + 1
                for axis in node.collective_axes:
                    chaining.axis_groups[axis] = axis_groups[index][axis][position]
            writer.add_run(executor_id, template, position, run_inputs, chaining)
            functions[executor_id].add(node.function_id)
            for value in kept:
                produced_here[executor_id].append((value, position))
    for executor_id, shards in produced_here.items():   # pass 3: the buffer plan
        for value, position in shards:
            writer.add_intermediate(executor_id, value, position)
    plans = writer.plans()
    return LoweredProgram(spec, program_id, plans, dict(last_collective), reporting,
                          {e: frozenset(f) for e, f in functions.items()})
