"""Mesh axes bound to process groups while a computation runs (`AxisBinding`), and why an axis has none: for the
collectives run on the compute thread and for those inside XLA executables (the extension's binding)."""

from __future__ import annotations

__all__ = ["AxisBinding", "AbandonedReason", "CollectiveAbandoned", "native_axes"]


class CollectiveAbandoned(RuntimeError):
    """A collective in a group abandoned after a fault in its island (a lost executor, a transfer lost on a link):
    the run fails at once instead of waiting for a peer that will not come. Its remote type, ``CollectiveAbandoned``,
    tells the trainer that recovery can run the step again (on new groups)."""


class AbandonedReason(str):
    """Why an abandoned group is unusable (a ``str``, as every unusable group's reason, but raised as
    `CollectiveAbandoned`)."""


class AxisBinding:
    """Mesh axes bound to groups (or to why they have none) while a computation runs: for host stages on this
    thread, and for collectives inside XLA executables in the extension (which XLA may call from its threads)."""

    def __init__(self, bound_here: threading.local, native, axis_groups: dict):
        # ``bound_here``: the runtime's per-thread slot the ops read (`CollectiveRuntime._handle`).
        self._bound_here, self._axis_groups = bound_here, axis_groups
        self._native = native
        self._native_axes = native_axes(self._native, axis_groups) if self._native is not None else None

    def __enter__(self):
        self._bound_here.binding = self._axis_groups
        if self._native is not None:
            self._native.bind(self._native_axes)

    def __exit__(self, *exc):
        self._bound_here.binding = None

    def hold(self) -> None:
        """This binding is cached (by a step run again and again): its groups let go of it when abandoned."""
        for bound in set(self._axis_groups.values()):
            if not isinstance(bound, str):    # already let go of (abandoned meanwhile, on the heartbeat thread)
                bound.held_by(self)

    def let_go(self, group: "executor.collectives._Group") -> None:
        """``group`` was abandoned: its axes are bound to why from now on, and the binding keeps it no more (only
        the runtime's retired list does, until it is quiet). Any thread: each entry is replaced whole, so a reader
        sees the group (abandoned: its ops fail) or the reason."""
        for axis, bound in list(self._axis_groups.items()):
            if bound is not group:
                continue
            why = AbandonedReason(f"the process group for axis {axis!r} is unusable: {group.abandoned}")
            self._axis_groups[axis] = why
            if self._native_axes is not None:
                native_id = self._native.axis_id(axis)
                self._native_axes[:] = [(native_id, -1, True, f"axis {axis!r}: {why}") if entry[0] == native_id
                                        else entry for entry in self._native_axes]


def native_axes(native, axis_groups: dict) -> list:
    """The extension's binding of ``axis_groups``: (axis id, slot, abandoned, why not) per axis."""
    axis_id = native.axis_id
    axes = []
    for axis, bound in axis_groups.items():
        if isinstance(bound, str):
            axes.append((axis_id(axis), -1, isinstance(bound, AbandonedReason), f"axis {axis!r}: {bound}"))
        else:
            axes.append((axis_id(axis), bound.slot, False, "" if bound.slot >= 0 else
                         f"axis {axis!r}: its group is not registered with the extension"))
    return axes
