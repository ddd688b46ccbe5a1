"""What a run looks like from the executors' own timestamps.

- `chrome_trace`: the executors' trace events → one Chrome/Perfetto trace (``ctx.trace``);
- `timeline`: one training step picked out of that trace (a pipeline step, or a step across
  islands) as spans on rows: data, text, a PNG and the step's part of the trace;
- `span_math`: the arithmetic on those spans (the bubble, transfer time hidden behind compute,
  the busy share of timed windows), on plain tuples, so the benchmarks use the same formulas.
"""

from .chrome_trace import chrome_trace

__all__ = ["chrome_trace"]
