"""Pipeline schedules as printable actions, and a validator that simulates them.

A pipeline has ``S`` pipe ranks; the model is cut into ``C = S * V`` chunks (``V``
virtual stages per rank) and chunk ``c`` lives on rank ``c % S``. ``M`` microbatches
flow through it. Each rank runs a list of actions, written like
``torch.distributed.pipelining`` writes them: ``{chunk}{kind}{microbatch}``:

- ``0F3``: forward of chunk 0 on microbatch 3; ``1B2``: its backward (which also
  accumulates the chunk's parameter gradients);
- ``0SEND_F3`` sends chunk 0's output of microbatch 3 to chunk 1's rank, where
  ``1RECV_F3`` receives it as the input of ``1F3``;
- ``1SEND_B2`` sends the gradient wrt chunk 1's input to chunk 0's rank, where
  ``0RECV_B2`` receives it as the gradient of chunk 0's output.

Consecutive chunks share a rank only when ``S == 1``; then no communication is needed.

The generators (:func:`gpipe`, :func:`one_f_one_b`, :func:`interleaved`) return
compute-only schedules; :func:`with_communication` inserts the sends and receives,
and :func:`simulate` checks a schedule and times it. This package imports no torch:
a schedule is a plan, tested as text in, text out.

- `ir`: `Action` and `Schedule`, the schedule's text form (printed and parsed), `ScheduleError`;
- `communication`: where the sends and receives go (`with_communication`);
- `generators`: GPipe, 1F1B and interleaved 1F1B, and their theoretical bubble;
- `simulation`: the validator, which checks a schedule and runs it on a model clock.
"""

from .communication import with_communication
from .generators import SCHEDULE_NAMES, gpipe, interleaved, make_schedule, one_f_one_b, theoretical_bubble
from .ir import ACTION_KINDS, Action, Schedule, ScheduleError
from .simulation import Simulation, simulate

__all__ = [
    "ACTION_KINDS", "SCHEDULE_NAMES", "Action", "Schedule", "ScheduleError", "Simulation",
    "with_communication", "gpipe", "one_f_one_b", "interleaved", "make_schedule", "simulate",
    "theoretical_bubble",
]
