"""bench/islands.py's configurations: one island or several (and their link), the groups compared in the same
rounds, and whether a group's contexts fit in memory together."""

from __future__ import annotations

import dataclasses

import pathways_torch as pw

EXECUTOR_BYTES = 1.25e9    # resident memory of one executor (JAX/torchax imported, this model trained), before one
MEMORY_MARGIN = 3e9        # what the client and the system keep
SHAPES_PER_GROUP = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """One configuration: one island of ``num_executors`` (``islands`` None), or ``islands`` with ``link``."""

    key: str
    num_executors: int
    islands: tuple[int, ...] | None = None
    link: pw.Link | None = None

    def __post_init__(self):
        if self.islands is not None and sum(self.islands) != self.num_executors:
            raise ValueError(f"Setup {self.key}: islands {self.islands} do not make {self.num_executors} executors")
        if self.islands is None and self.link is not None:
            raise ValueError(f"Setup {self.key}: a link needs islands")

    @property
    def num_islands(self) -> int:
        return 1 if self.islands is None else len(self.islands)

    @property
    def num_shards(self) -> int:
        return self.num_executors // self.num_islands

    def mesh_axes(self) -> dict:
        if self.islands is None:
            return {"data": self.num_executors}
        return {"island": self.num_islands, "data": self.num_shards}

    def plan(self, bucket_mb: float = 25.0):
        return (pw.DataParallel("data") if self.islands is None
                else pw.DataParallel(("island", "data"), bucket_mb=bucket_mb))

    def context_options(self) -> dict:
        if self.islands is None:
            return {"num_executors": self.num_executors}
        return {"islands": list(self.islands), **({"link": self.link} if self.link is not None else {})}

    def island_of(self, executor: int) -> int:
        """The island of the context's ``executor``-th executor (islands fill in executor order)."""
        if self.islands is None:
            return 0
        bound = 0
        for island, count in enumerate(self.islands):
            bound += count
            if executor < bound:
                return island
        raise IndexError(f"executor {executor} of {self.num_executors}")

    def describe(self) -> str:
        if self.islands is None:
            return f"1 island of {self.num_executors}"
        return f"{' + '.join(str(n) for n in self.islands)} islands"


def describe_link(link: pw.Link | None, islands: bool = True) -> str:
    """The link column: ``-`` inside one island, ``direct`` without a relay, else the shape."""
    if not islands:
        return "-"
    if link is None:
        return "direct (no relay)"
    if link.delay_s == 0 and link.bandwidth_bytes_per_s is None:
        return "relay, unshaped"
    rate = f"{link.bandwidth_bytes_per_s / 1e6:g} MB/s" if link.bandwidth_bytes_per_s else "unlimited"
    return f"relay, {rate}, {link.delay_s * 1e3:g} ms"


def parse_shapes(text: str) -> list[pw.Link]:
    """``"1000:0,10:5"`` (MB/s : ms one-way; ``inf`` for no rate limit) -> the links."""
    links = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            rate, delay = item.split(":")
            bandwidth = None if rate.strip().lower() in ("inf", "none", "") else float(rate) * 1e6
            links.append(pw.Link(delay_s=float(delay) / 1e3, bandwidth_bytes_per_s=bandwidth))
        except ValueError as exc:
            raise ValueError(f"--shapes: expected MB/s:ms items such as 100:1, got {item!r} ({exc})") from exc
    if not links:
        raise ValueError(f"--shapes: expected at least one MB/s:ms item, got {text!r}")
    return links


def shape_key(link: pw.Link) -> str:
    rate = f"{link.bandwidth_bytes_per_s / 1e6:g}MBps" if link.bandwidth_bytes_per_s else "inf"
    return f"islands-1+1-{rate}-{link.delay_s * 1e3:g}ms"


def make_groups(shapes: list[pw.Link], with_2x2: bool, per_group: int = SHAPES_PER_GROUP) -> tuple[dict, list]:
    """(setups by key, groups): each group ``{"name", "kind", "reference", "keys"}``, its reference first."""
    setups = {s.key: s for s in [
        Setup(key="one-2", num_executors=2),
        Setup(key="islands-1+1-direct", num_executors=2, islands=(1, 1)),
        Setup(key="islands-1+1-relay", num_executors=2, islands=(1, 1), link=pw.Link()),
        *[Setup(key=shape_key(link), num_executors=2, islands=(1, 1), link=link) for link in shapes],
    ]}
    groups = [{"name": "gated", "kind": "gated", "reference": "one-2",
               "keys": ["one-2", "islands-1+1-direct", "islands-1+1-relay"]}]
    shaped = [shape_key(link) for link in shapes]
    for index in range(0, len(shaped), per_group):
        groups.append({"name": f"link shapes {index // per_group + 1}", "kind": "shapes", "reference": "one-2",
                       "keys": ["one-2", "islands-1+1-relay", *shaped[index:index + per_group]]})
    if with_2x2:
        setups.update({s.key: s for s in [
            Setup(key="one-4", num_executors=4),
            Setup(key="islands-2x2-relay", num_executors=4, islands=(2, 2), link=pw.Link()),
            Setup(key="islands-2x2-direct", num_executors=4, islands=(2, 2)),
        ]})
        groups.append({"name": "2 x 2", "kind": "2x2", "reference": "one-4",
                       "keys": ["one-4", "islands-2x2-relay", "islands-2x2-direct"]})
    return setups, groups


def open_executors(groups: list, setups: dict) -> list[int]:
    """Executors alive during each group when contexts are kept open (a context closes after its last group)."""
    last = {}
    for index, group in enumerate(groups):
        for key in group["keys"]:
            last[key] = index
    counts = []
    for index, group in enumerate(groups):
        alive = {key for key, end in last.items() if end >= index
                 and any(key in g["keys"] for g in groups[:index + 1])}
        counts.append(sum(setups[k].num_executors for k in alive))
    return counts


def choose_method(wanted: str, peak_executors: int, available_bytes: float | None) -> tuple[str, str]:
    """(method, why): ``open`` when every context of the largest group fits in the available memory."""
    need = peak_executors * EXECUTOR_BYTES + MEMORY_MARGIN
    if wanted != "auto":
        return wanted, f"asked for (--method {wanted})"
    if available_bytes is None:
        return "alternate", "available memory unknown"
    if need <= available_bytes:
        return "open", (f"up to {peak_executors} executors x {EXECUTOR_BYTES / 1e9:g} GB + {MEMORY_MARGIN / 1e9:g} GB "
                        f"= {need / 1e9:.1f} GB fit in {available_bytes / 1e9:.1f} GB available")
    return "alternate", (f"{peak_executors} executors would need {need / 1e9:.1f} GB, "
                         f"{available_bytes / 1e9:.1f} GB available")


def available_memory() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    return None
