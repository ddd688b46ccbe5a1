"""The error families of pathways_torch, under one base `PathwaysError`.

The user's bugs (`RemoteError`, `CaptureError`, `PlacementError`, `ReplicationError`)
and infrastructure failures (`ExecutorLostError`) are told apart by type. Every
message says what was expected, what came, and the fix where there is one.
This module imports nothing heavy: the controller uses it too.
"""

from __future__ import annotations

__all__ = [
    "PathwaysError", "RemoteError", "CaptureError", "PlacementError", "DonatedArrayError",
    "ReplicationError", "ExecutorLostError", "ControllerLostError", "AuthenticationError", "ProtocolError", "ContextClosedError",
    "OutOfMemoryError", "TRANSFER_LOST", "COLLECTIVE_ABANDONED", "OUTPUT_OVER_BUDGET",
]

# `RemoteError.remote_type` of the failures the runtime itself makes (not the user's code): a transfer its link lost
# (the controller, from the sender's report), a collective in a group abandoned after a fault in its island (the
# executor's `CollectiveAbandoned`). Training recovers from both (`training.recovery`).
TRANSFER_LOST = "TransferLost"
COLLECTIVE_ABANDONED = "CollectiveAbandoned"
# An output larger than the bytes its call declared, which the controller counts under --executor-memory-bytes: its
# executor stored this failure instead (executor/output_budget.py).
OUTPUT_OVER_BUDGET = "OutputOverBudget"


class PathwaysError(Exception):
    """Base of every error raised by pathways_torch."""


class CaptureError(PathwaysError):
    """A function could not be captured for the given input shapes; raised on the client before dispatch."""


class PlacementError(PathwaysError, ValueError):
    """A placement, mesh or shape that does not fit (e.g. a dimension not divisible by a mesh axis)."""


class DonatedArrayError(PlacementError):
    """An array given up to a call (``donate_argnums``) was used again: its shards were freed by that call."""


class RemoteError(PathwaysError):
    """The user's function raised on an executor.

    ``remote_traceback`` is the executor-side traceback, ``call_site`` the client
    line that made the call, ``executor_id`` where it happened. Every future that
    depends on the failed call raises the same `RemoteError` object.
    """

    def __init__(self, message: str, *, function: str = "", executor_id: str = "",
                 remote_type: str = "", remote_traceback: str = "", call_site: str = "", op: str = "",
                 node_index: int = 0, function_id: int = 0):
        self.function = function
        self.executor_id = executor_id
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        self.call_site = call_site
        self.remote_message = message
        # A backend that could not compile an op names it: ``op`` and its position among the function's
        # calls; the client finds the user's line that made it (`user_line`, filled by `locate`).
        self.op, self.node_index, self.function_id = op, node_index, function_id
        self.user_line = ""
        super().__init__(self._render())

    def locate(self, find_line) -> None:
        """Add the user's line of the failing op: ``find_line(function_id, node_index)`` (run once, lazily:
        it may re-trace the function) returns it or ''."""
        if self.node_index and not self.user_line:
            self.user_line = find_line(self.function_id, self.node_index) or ""
            self.args = (self._render(),)

    def _render(self) -> str:
        lines = [f"{self.remote_type or 'Error'} in function {self.function!r} on executor {self.executor_id}: "
                 f"{self.remote_message}"]
        if self.op:
            lines.append(f"the backend could not compile {self.op}"
                         + (f", made at {self.user_line}" if self.user_line else ""))
        if self.call_site:
            lines.append(f"called from:\n{self.call_site.rstrip()}")
        if self.remote_traceback:
            lines.append(f"executor traceback:\n{self.remote_traceback.rstrip()}")
        return "\n".join(lines)


class ReplicationError(PathwaysError):
    """Debug mode found the shards of an output declared ``Replicate()`` to differ.

    The function computes a different value on each shard (for example a sum over
    a sharded input): reduce it first with ``pw.all_reduce`` or declare the output
    ``Shard``.
    """


class ExecutorLostError(PathwaysError):
    """An executor died or stopped answering; names the executor."""

    def __init__(self, message: str, *, executor_id: str = ""):
        self.executor_id = executor_id
        super().__init__(message)


class ControllerLostError(PathwaysError):
    """The remote controller (``pw.Context(controller=...)``) stopped, or has not answered within the heartbeat
    bound: nothing pending will complete. Names the controller's address and why."""

    def __init__(self, message: str, *, address: str = ""):
        self.address = address
        super().__init__(message)


class OutOfMemoryError(PathwaysError):
    """A call or put would take an executor past the controller's ``--executor-memory-bytes`` and no room came
    within the wait (or it never fits: it asks for more than the limit itself).

    ``client`` asked for ``requested_bytes`` on ``executor_id``, which held ``held_bytes`` of its ``limit_bytes``.
    Only that call (or put) fails; other clients' calls run on. The fix: free arrays you no longer need, fetch
    results and drop their arrays, or ask the controller's operator for more (``--executor-memory-bytes``).
    """

    def __init__(self, message: str, *, client: str = "", executor_id: str = "", requested_bytes: int = 0,
                 held_bytes: int = 0, limit_bytes: int = 0):
        self.client, self.executor_id = client, executor_id
        self.requested_bytes, self.held_bytes, self.limit_bytes = requested_bytes, held_bytes, limit_bytes
        super().__init__(message)


class ContextClosedError(PathwaysError):
    """The context closed while the array was pending, or before its value was fetched: it never will be.

    Names the call that would have made it. Fetch what you need (``.result()``) inside the
    ``with pw.Context(...)`` block; a value fetched there stays readable after it.
    """


class AuthenticationError(PathwaysError):
    """A CURVE handshake failed: a peer refused our key, or does not hold the key we expect of it.

    ``peer`` names the other end (an executor id or ``"controller"``). The usual
    fix is a consistent key directory: every process must use the launcher's keys.
    """

    def __init__(self, message: str, *, peer: str = ""):
        self.peer = peer
        super().__init__(message)


class ProtocolError(PathwaysError):
    """A peer sent a message that breaks the protocol (it is logged and dropped)."""
