"""Islands: groups of executors with their own collectives and gang order, joined by a slower link.

An executor declares its island when it registers (``pathways-executor --island NAME``;
``pw.Context(islands=[2, 2])`` starts local ones). A mesh lies in one island or spans
islands only on its outermost ``"island"`` axis (`controller.resources`); a collective
runs inside an island — one whose axis would cross islands is refused before anything
is sent (`check_collectives_in_islands`), so no process group ever has members in two
islands. Data exchanged between islands travels as executor-to-executor transfers over
ZeroMQ (the link).
"""

from __future__ import annotations

import dataclasses

from .errors import PlacementError

__all__ = ["IslandTable", "Island", "check_collectives_in_islands", "island_key", "ISLAND_AXIS"]

ISLAND_AXIS = "island"   # the one mesh axis that may span islands (the outermost); as controller/resources.py


@dataclasses.dataclass(frozen=True)
class Island:
    name: str
    executors: tuple[str, ...]
    devices: tuple[str, ...]
    lost: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class IslandTable:
    """What ``ctx.islands()`` returns: every island, by name."""

    islands: tuple[Island, ...]
    link: str

    @classmethod
    def of(cls, executors, link=None) -> "IslandTable":
        """The table of ``executors`` (`ExecutorView`s in order, or anything with ``ordered()`` giving them)."""
        executors = list(executors.ordered() if hasattr(executors, "ordered") else executors)
        by_island: dict[str, list] = {}
        for info in executors:
            by_island.setdefault(info.island, []).append(info)
        islands = []
        for name in sorted(by_island, key=island_key):
            members = by_island[name]
            islands.append(Island(name, tuple(m.executor_id for m in members), tuple(m.device for m in members),
                                  tuple(m.executor_id for m in members if m.lost)))
        hosts = {m.data_address.rsplit(":", 1)[0] for m in executors}
        described = ("ZeroMQ over loopback (one host)" if hosts <= {"tcp://127.0.0.1", "tcp://localhost"}
                     else f"ZeroMQ over TCP ({len(hosts)} hosts)")
        if link is not None:
            described += f", {link.describe()} ({link.bytes_relayed:,} bytes so far)"   # the shaping in force
        return cls(tuple(islands), described)

    def __len__(self) -> int:
        return len(self.islands)

    def __getitem__(self, index: int) -> Island:
        return self.islands[index]

    def __str__(self) -> str:
        lines = [f"{len(self.islands)} island{'s' if len(self.islands) != 1 else ''}; link between islands: "
                 f"{self.link}"]
        for island in self.islands:
            lost = f" (lost: {', '.join(island.lost)})" if island.lost else ""
            devices = ", ".join(f"{e} [{d}]" for e, d in zip(island.executors, island.devices))
            lines.append(f"island {island.name}: {len(island.executors)} executors: {devices}{lost}")
        return "\n".join(lines)


def island_key(name: str) -> tuple:
    """How islands are ordered: numbers by value ("2" before "10"), then the other names."""
    return (not name.isdigit(), int(name) if name.isdigit() else 0, name)


def check_collectives_in_islands(version, allocation, island_of) -> None:
    """Refuse a function whose collective axis would join executors of two islands (before it is sent).
    ``island_of(executor_id)``: the executor's island (the controller's answer)."""
    for axis in getattr(version, "collective_axes", ()):
        names = [name for name, _ in allocation.axes]
        if axis not in names:
            continue
        for position in range(allocation.size):
            members = allocation.axis_members(axis, position)
            islands = sorted({island_of(e) for e in members})
            if len(islands) > 1:
                raise PlacementError(
                    f"{version.name}: its collective over axis {axis!r} would join executors of islands "
                    f"{islands} ({', '.join(members)}); collectives run inside an island — reduce over an inner "
                    f"axis, and exchange across islands with transfers (a function on each island's mesh)")
