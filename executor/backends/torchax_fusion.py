"""``xla:torchax``: consecutive steps of a segment traced into one XLA executable (`executor.fusion`).

Each function the route compiled to one executable keeps its stage's aten graph. A
fused executable traces those graphs one after another inside a single ``jax.jit``,
wiring each step's outputs to the next step's inputs as the segment's slots do; the
functions' constants are its arguments (never baked into the executable). Collectives
inside it (custom calls, `xla_collectives`) keep one order chain across all the steps,
so a fused executable issues them in the program's order, as the steps alone would.
"""

from __future__ import annotations

__all__ = ["fusion_refusal", "fusion_ops", "fuse"]


def fusion_refusal(program) -> str:
    """Why a compiled function cannot be part of a fused executable ("" where it can)."""
    stage = getattr(program, "single_stage", None)
    if stage is None:
        return f"not one executable ({getattr(program, 'summary', type(program).__name__)})"
    if program.donated_inputs:
        return "it consumes (donates) inputs"
    return ""


def fusion_ops(program) -> int:
    return len(program.single_stage.node_names)


def fuse(backend, unit, values: list):
    """One executable for ``unit`` (`FusedSteps`), traced for the shapes of ``values`` (its inputs' values):
    a callable taking the list of input values, returning the list of output values."""
    import jax
    from torchax import interop

    from . import xla_collectives

    members = [(function.compiled, step.inputs, step.outputs) for step, function in zip(unit.steps, unit.functions)]
    constants = [c for program, _, _ in members for c in program.constants]
    input_slots, output_slots, num_inputs = unit.inputs, unit.outputs, len(unit.inputs)

    def traced(*arrays):
        xla_collectives.reset_order()   # one order chain through every step's collectives
        slots = dict(zip(input_slots, arrays[:num_inputs]))
        position = num_inputs
        for program, inputs, outputs in members:
            count = len(program.constants)
            forward = program.single_stage.graph_module.forward
            results = interop.call_torch(forward, *[slots[s] for s in inputs], *arrays[position:position + count])
            position += count
            for slot, value in zip(outputs, results):
                slots[slot] = value
        return tuple(slots[s] for s in output_slots)

    shapes = [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in values]
    shapes += [jax.ShapeDtypeStruct(tuple(c.shape), c.dtype) for c in constants]
    executable = backend.fast_call(jax.jit(traced).lower(*shapes).compile())
    inside = sum(program.single_stage.compiled_collectives for program, _, _ in members)
    if inside:
        executable = xla_collectives.raising_collective_errors(executable)

    def call(arguments: list):
        return list(executable(*arguments, *constants))

    return call
