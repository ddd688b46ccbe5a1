"""Two islands vs one island of the same total size: tokens/s of data-parallel training across islands, and what
the link between them costs.

The same training everywhere: `bench/train.py`'s Transformer (`examples/transformer.py`, reversal task, dropout
0, ``make_config`` / ``make_model``: the same initial weights, AdamW), the same global batches
(``ReverseTask(cfg, 0).batch(i, B)``, batch i at step i), the same backend (the runtime's default, or
``--backend``), ``executor_threads=1``, every executor pinned (executor i of a context on core i mod the core
count), ``torch.set_num_threads(1)`` in the client. Configurations:

- one island of N: ``pw.Context(num_executors=N)``, ``ctx.mesh({"data": N})``, ``pw.DataParallel("data")``;
- I islands of D: ``pw.Context(islands=[D] * I, link=...)``, ``ctx.mesh({"island": I, "data": D})``,
  ``pw.DataParallel(("island", "data"))`` (reduce-scatter inside each island, the slices sent to the same-rank
  executors of the other islands as program transfers, averaged, all-gathered, applied); ``link=None``: the
  islands' executors talk directly; ``pw.Link()``: through the relay, unshaped; ``pw.Link(delay_s,
  bandwidth_bytes_per_s)``: shaped.

Groups, each compared with its own one-island reference in the same rounds:

(a) gated: 1 + 1 islands (direct, and relayed unshaped) vs one island of 2 — target >= 0.97 relayed unshaped
    (the Pathways paper's 97.2 %);
(b) 2 x 2 islands (relayed unshaped, and direct) vs one island of 4 (reported; two cores for four executors);
(c) 1 + 1 islands at several link shapes (``--shapes``), with the unshaped relay and the one island of 2 in the
    same rounds, so that the fall of the ratio with bandwidth and delay is read side by side.

Method. Every executor is a process importing JAX/torchax (about 1.1 GB resident), so a group's contexts are kept
open together when this machine's available memory allows (``--method open``, the default when it fits: a
context shared by consecutive groups stays open between them), else each window gets its own context (``--method
alternate``: for round r, open each context, warm up, run its window, close). Each context is warmed up
(``--warmup`` steps waited for; the first step — capture, loading, compiling — is reported); then ``--rounds``
rounds, each one window of ``--steps`` steps per configuration (dispatched back to back; the window ends when the
last loss and every island's updated state are ready), the order rotated by one each round, a short pause and a
``gc.collect()`` before each window. Tokens/s = steps x batch x context / window; a configuration's tokens/s is
the median of its windows, its ratio to one island the median (min-max) of the per-round ratios.

Per configuration also:
- bytes crossing the link per step: ``ctx.link.bytes_relayed`` over the timed windows / their steps (every byte
  the relay wrote, both directions); theory: each of the I x D executors sends its 1/D slice of its island's
  reduced gradient (G bytes: the flat gradient buckets, padded to D) to its counterpart in each of the I - 1 other
  islands, so I x D x (I - 1) x G / D = I (I - 1) G bytes per step (2 G for two islands, whatever D) — the same
  as the bandwidth-optimal all-reduce between I parties, 2 (I - 1) / I x G x I, when I = 2;
- the exchange wait per step, from the executors' trace (``ctx.trace``): on each executor, the start of its
  ``island_update`` minus the end of the last of its ``island_grads[k]`` segments of the same step (the backward
  is cut per gradient bucket, ``--bucket-mb``; mean over executors, per step), split into the wait for the other
  island's backward to end (skew) and the time after the last island's backward ended (the last transfers and
  their hand-off); the link transfers' send-to-receive times; and the share of that transfer time during which
  the receiving executor was still computing (its own backward: the exchange hidden behind compute; a bucket's
  slice leaves as soon as its segment ends, so only the last bucket's transfer cannot be hidden);
- what a lone `LinkRelay` of each shape delivers (``relay_rate``: one loopback connection, no executors, measured
  before the groups), so that the link shapes' cost can be modelled at the rate the relay achieves as well as at
  the nominal one;
- the last loss, and the largest |loss difference| to the group's one-island run at the steps both ran: the same
  weights on the same batches, so they must agree to ``LOSS_TOLERANCE`` (checked: the benchmark exits 1 if not,
  after writing its results).

The per-round ratios, not the absolute rates, are what to read: this machine's speed drifts.
Prints tables and writes bench/results/islands.json (or ``--json PATH``).

    .venv/bin/python -m bench.islands [--quick] [--json PATH] [--backend eager] [--rounds 5] [--steps 10]
                                      [--shapes 1000:0,100:0,10:0,1000:1,1000:5,100:5] [--no-2x2]
                                      [--groups gated,shapes,2x2]
                                      [--method auto|open|alternate] [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "examples")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

import pathways_torch as pw  # noqa: E402
from bench.common import (add_backend_argument, add_model_arguments, add_quick_and_json,  # noqa: E402
                          add_trace_dir_argument, print_table, write_results)
from bench.pipeline import rotated  # noqa: E402
from bench.train import make_config, make_model  # noqa: E402
from transformer import ReverseTask, loss_fn  # noqa: E402

SEED = 0
SETTLE_S = 0.05            # a pause before each window: the previous window's trailing frees are done
TARGET = 0.97              # 1 + 1 islands relayed unshaped vs one island of 2 (the paper's 97.2 %)
LOSS_TOLERANCE = 1e-5      # |loss(islands) - loss(one island)| at the same step
EXECUTOR_BYTES = 1.25e9    # resident memory of one executor (JAX/torchax imported, this model trained), before one
MEMORY_MARGIN = 3e9        # what the client and the system keep
DEFAULT_SHAPES = "1000:0,100:0,10:0,1000:1,1000:5,100:5"   # MB/s : ms one-way
SHAPES_PER_GROUP = 3
RATE_PROBE_BYTES = 16 * 2**20   # bytes sent through a lone relay to see what rate a shape achieves ...
RATE_PROBE_S = 0.5              # ... at most this long at the nominal rate


# ------------------------------------------------------------ configurations

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


# ------------------------------------------------------------ helpers (pure, unit-tested)

def expected_link_bytes(num_islands: int, gradient_bytes: int) -> int:
    """Bytes crossing the link per step: every executor sends its 1/D slice of G to its I - 1 counterparts."""
    return num_islands * (num_islands - 1) * gradient_bytes


def spread(values: list[float]) -> dict:
    """Median, min and max (NaN when empty)."""
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def round_ratios(rounds: list[dict], key: str, reference: str) -> list[float]:
    """Per round: tokens/s of ``key`` / tokens/s of ``reference`` (rounds where both ran)."""
    return [r[key] / r[reference] for r in rounds if key in r and reference in r and r[reference]]


def loss_difference(losses: dict, reference: dict) -> tuple[float | None, int]:
    """Largest |loss - reference loss| at the steps both recorded, and how many such steps."""
    common = sorted(set(losses) & set(reference))
    if not common:
        return None, 0
    return max(abs(losses[i] - reference[i]) for i in common), len(common)


def in_windows(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in windows)


def exchange_steps(spans: list[tuple[int, str, float, float]], island_of, segments_per_step: int = 1) -> list[dict]:
    """Per step, from compute spans ``(executor, kind, start, end)`` (kind ``grads``, ``update`` or other
    compute) of the timed steps: on each executor, wait = its update's start - its grads' end of the same step
    (the step's grads are ``segments_per_step`` spans, the backward cut per bucket: the k-th group of them and the
    k-th update of each executor are step k; its grads end is the last one's end); skew = the last grads end of any island -
    this executor's grads end; after_last = update start - that last end; inside = compute that executor ran
    inside its wait. Each value the mean over executors (``max_wait``: the largest)."""
    by_executor: dict[int, dict[str, list]] = {}
    for executor, kind, start, end in spans:
        by_executor.setdefault(executor, {}).setdefault(kind, []).append((start, end))
    if not by_executor:
        return []
    for kinds in by_executor.values():
        for values in kinds.values():
            values.sort()
    per = segments_per_step
    counts = {e: (len(k.get("grads", [])), len(k.get("update", []))) for e, k in by_executor.items()}
    num_steps = min(c[1] for c in counts.values())
    if any(c != (num_steps * per, num_steps) for c in counts.values()):
        raise RuntimeError(f"exchange_steps: expected {per} grads spans per update span on every executor, got "
                           f"(grads, update) = {counts}")
    steps = []
    for k in range(num_steps):
        grads_end = {e: kinds["grads"][k * per + per - 1][1] for e, kinds in by_executor.items()}
        island_end: dict[int, float] = {}
        for e, end in grads_end.items():
            island_end[island_of(e)] = max(end, island_end.get(island_of(e), float("-inf")))
        last_end = max(island_end.values())
        waits, skews, after, inside = [], [], [], []
        for e, kinds in by_executor.items():
            begin, finish = grads_end[e], kinds["update"][k][0]
            if finish < begin:
                raise RuntimeError(f"exchange_steps: executor {e} step {k}: update starts before its grads end")
            waits.append(finish - begin)
            skews.append(max(0.0, last_end - begin))
            after.append(max(0.0, finish - last_end))
            inside.append(sum(max(0.0, min(end, finish) - max(start, begin))
                              for values in kinds.values() for start, end in values))
        n = len(waits)
        steps.append({"wait": sum(waits) / n, "max_wait": max(waits), "skew": sum(skews) / n,
                      "after_last": sum(after) / n, "compute_inside": sum(inside) / n})
    return steps


def link_transfer_times(events: list[dict], windows: list[tuple[float, float]]) -> list[float]:
    """Seconds from each link transfer's send (flow start, ``ph`` s) to its receipt (flow end, f), for the
    transfers sent inside ``windows`` (trace timestamps in microseconds)."""
    starts, ends = {}, {}
    for e in events:
        if e.get("cat") != "link":
            continue
        if e.get("ph") == "s":
            starts[e["id"]] = e["ts"] / 1e6
        elif e.get("ph") == "f":
            ends[e["id"]] = e["ts"] / 1e6
    return [ends[i] - t for i, t in starts.items() if i in ends and in_windows(t, windows)]


def transfer_overlap(events: list[dict], windows: list[tuple[float, float]]) -> tuple[float, float]:
    """(seconds of link transfers during which their receiver was computing, seconds of link transfers), for the
    transfers sent inside ``windows``: a transfer costs the step nothing while the executor that waits for it
    still runs its own backward (the exchange hidden behind compute)."""
    compute: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "compute":
            compute.setdefault(e["pid"], []).append((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
    starts, ends = {}, {}
    for e in events:
        if e.get("cat") == "link" and e.get("ph") in ("s", "f"):
            (starts if e["ph"] == "s" else ends)[e["id"]] = (e["ts"] / 1e6, e["pid"])
    hidden = total = 0.0
    for flow, (sent, _) in starts.items():
        if flow not in ends or not in_windows(sent, windows):
            continue
        received, receiver = ends[flow]
        total += received - sent
        hidden += sum(max(0.0, min(b, received) - max(a, sent)) for a, b in compute.get(receiver, []))
    return hidden, total


def classify(name: str) -> str:
    """A compute span's kind: the cross-island step's ``grads`` and ``update``, else ``other``."""
    if name.startswith("island_grads"):
        return "grads"
    if name == "island_update":
        return "update"
    return "other"


def modelled_link_s(link: pw.Link | None, bytes_one_way: float, rate: float | None = None) -> float:
    """What the link's shape adds to a step, in the model: the one-way delay plus one direction's bytes at
    ``rate`` (default the link's nominal bandwidth; both directions run at once)."""
    if link is None:
        return 0.0
    rate = rate or link.bandwidth_bytes_per_s
    return link.delay_s + (bytes_one_way / rate if rate else 0.0)


def relay_rate(link: pw.Link, num_bytes: int) -> float:
    """Bytes per second that a `LinkRelay` of ``link`` delivers from one loopback socket to another (one
    direction, one connection, ``num_bytes`` written at once): what the shape achieves, without executors."""
    import socket
    import threading

    from pathways_torch.local.link import LinkRelay

    server = socket.create_server(("127.0.0.1", 0))
    relay = LinkRelay(link)
    done = []
    try:
        host, port = relay.add(f"tcp://127.0.0.1:{server.getsockname()[1]}").removeprefix("tcp://").rsplit(":", 1)

        def sink():
            connection, _ = server.accept()
            with connection:
                received = 0
                while received < num_bytes:
                    data = connection.recv(1 << 20)
                    if not data:
                        break
                    received += len(data)
                done.append((received, time.perf_counter()))

        reader = threading.Thread(target=sink, daemon=True)
        reader.start()
        with socket.create_connection((host, int(port))) as sender:
            began = time.perf_counter()
            sender.sendall(b"\0" * num_bytes)
            reader.join(60)
    finally:
        relay.close()
        server.close()
    if not done or done[0][0] < num_bytes:
        raise RuntimeError(f"relay_rate: {link}: {done[0][0] if done else 0} of {num_bytes} bytes arrived in 60 s")
    return num_bytes / (done[0][1] - began)


# ------------------------------------------------------------ one configuration

class Run:
    """One configuration's context and trainer; keeps every window it ran and what its traces said."""

    def __init__(self, setup: Setup, args, cfg, batches):
        self.setup, self.args, self.cfg, self.batches = setup, args, cfg, batches
        self.ctx = self.trainer = None
        self.losses: dict[int, float] = {}
        self.first_step_s: list[float] = []
        self.start_s: list[float] = []
        self.windows: list[dict] = []            # {"group", "round", "wall_s", "tokens_per_s", "bytes"}
        # By group: per timed step (exchange_steps), link transfer times, in-island collective s per executor-step.
        self.exchange: dict[str, list[dict]] = {}
        self.transfers_s: dict[str, list[float]] = {}
        self.overlap_s: dict[str, list[float]] = {}              # by group: [hidden s, transfer s]
        self.segments_per_step = 1
        self.collective_s: dict[str, list[float]] = {}
        self.compute_s: dict[str, dict[str, float]] = {}        # by group: kind -> s per executor-step
        self.backend = self.gradient_bytes = self.num_buckets = self.shaping = None
        self.rss_mb: list[int] = []
        self._wall_spans: list[tuple[str, float, float]] = []     # (group, start, end) of this context's windows

    @property
    def is_open(self) -> bool:
        return self.ctx is not None

    def open(self) -> None:
        """Start the context and the trainer; run the warm-up steps (each waited for)."""
        setup, args = self.setup, self.args
        options = {} if args.backend is None else {"backend": args.backend}
        began = time.perf_counter()
        self.ctx = pw.Context(executor_threads=1, pin_executors=True, start_timeout_s=300,
                              **setup.context_options(), **options)
        self.start_s.append(time.perf_counter() - began)
        self.backend = self.ctx.backend
        model, optimizer = make_model(self.cfg)
        self.trainer = self.ctx.wrap(model, optimizer=optimizer, loss_fn=loss_fn, mesh=self.ctx.mesh(setup.mesh_axes()),
                                     plan=setup.plan(args.bucket_mb))
        layout, shards = self.trainer.layout, self.trainer.num_shards
        self.gradient_bytes = sum(b.padded_numel(shards) * b.dtype.itemsize for b in layout.buckets)
        self.num_buckets = len(layout.buckets)
        self.shaping = None if self.ctx.link is None else self.ctx.link.describe()
        self.index, self._wall_spans = 0, []
        began = time.perf_counter()
        self._step()
        self.first_step_s.append(time.perf_counter() - began)
        for _ in range(1, args.warmup):
            self._step()

    def _step(self) -> None:
        loss = self.trainer.step(self.batches[self.index])
        self.losses[self.index] = loss.result(600).item()
        self._settle()
        self.index += 1

    def _settle(self) -> None:
        """Wait until every island has applied its update (the loss is island 0's: another may still run)."""
        state = getattr(self.trainer, "_state", None)
        arrays = [a for island in state for a in island] if state is not None else list(self.trainer._flats)
        for array in arrays:
            error = array.exception(timeout_s=600)
            if error is not None:
                raise error

    def relayed(self) -> int | None:
        return None if self.ctx.link is None else self.ctx.link.bytes_relayed

    def window(self, group: str, round_index: int) -> float:
        """``--steps`` steps back to back; ends when the last loss and every island's state are ready."""
        steps = self.args.steps
        gc.collect()
        time.sleep(SETTLE_S)
        before = self.relayed()
        wall_began, began = time.time(), time.perf_counter()
        for _ in range(steps):
            loss = self.trainer.step(self.batches[self.index])
            self.index += 1
        value = loss.result(600).item()
        self._settle()
        wall = time.perf_counter() - began
        self._wall_spans.append((group, wall_began, time.time()))
        after = self.relayed()
        self.losses[self.index - 1] = value
        del loss
        rate = steps * self.args.batch * self.cfg.context / wall
        self.windows.append({"group": group, "round": round_index, "wall_s": wall, "tokens_per_s": rate,
                             "link_bytes_per_step": None if before is None else (after - before) / steps})
        return rate

    def close(self, trace_dir: str) -> None:
        """Read the trace of this context's timed steps, then stop it."""
        try:
            self.rss_mb = [_rss_mb(pid) for pid in self.ctx.executor_pids]
            name = f"bench-islands-{self.setup.key}-{len(self.start_s)}.json".replace("+", "p")
            trace = self.ctx.trace(os.path.join(trace_dir, name))
            self._read_trace(trace)
        finally:
            self.ctx.close()
            self.ctx = self.trainer = None
            gc.collect()

    def _read_trace(self, trace: dict) -> None:
        events = trace["traceEvents"]
        spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("compute", "collective")]
        for group in dict.fromkeys(g for g, _, _ in self._wall_spans):
            windows = [(a, b) for g, a, b in self._wall_spans if g == group]
            mine = [e for e in spans if in_windows(e["ts"] / 1e6, windows)]
            if self.setup.islands is not None:
                compute = [(e["pid"], classify(e["name"]), e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
                           for e in mine if e["cat"] == "compute"]
                per = len(self.trainer.bucket_cut.segments)
                self.exchange.setdefault(group, []).extend(exchange_steps(compute, self.setup.island_of, per))
                self.transfers_s.setdefault(group, []).extend(link_transfer_times(events, windows))
                hidden, total = transfer_overlap(events, windows)
                sums = self.overlap_s.setdefault(group, [0.0, 0.0])
                sums[0] += hidden
                sums[1] += total
            per = len(windows) * self.args.steps * self.setup.num_executors
            collective = sum(e["dur"] / 1e6 for e in mine if e["cat"] == "collective")
            self.collective_s.setdefault(group, []).append(collective / per)
            totals = self.compute_s.setdefault(group, {})
            for e in mine:
                if e["cat"] == "compute":
                    kind = classify(e["name"])
                    totals[kind] = totals.get(kind, 0.0) + e["dur"] / 1e6 / per

    def summary(self, group: str) -> dict:
        """This run's windows in ``group``: tokens/s, ms/step, bytes/step (medians)."""
        mine = [w for w in self.windows if w["group"] == group]
        link_bytes = [w["link_bytes_per_step"] for w in mine if w["link_bytes_per_step"] is not None]
        return {"tokens_per_s": spread([w["tokens_per_s"] for w in mine]),
                "ms_per_step": statistics.median([w["wall_s"] for w in mine]) / self.args.steps * 1e3,
                "link_bytes_per_step": statistics.median(link_bytes) if link_bytes else None,
                "windows": len(mine)}


def _rss_mb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


# ------------------------------------------------------------ the measurement

def measure(args, setups: dict, groups: list, method: str, trace_dir: str) -> dict:
    cfg = make_config(args)
    task = ReverseTask(cfg, SEED)
    uses = {key: sum(key in g["keys"] for g in groups) for key in setups}
    windows_per_run = args.warmup + args.rounds * args.steps * max(uses.values())
    batches = [task.batch(i, args.batch) for i in range(windows_per_run)]
    runs = {key: Run(setup, args, cfg, batches) for key, setup in setups.items()}
    last = {}
    for index, group in enumerate(groups):
        for key in group["keys"]:
            last[key] = index
    results = []
    try:
        for index, group in enumerate(groups):
            began = time.perf_counter()
            keys, rounds = group["keys"], []
            if method == "open":
                for key in keys:
                    if not runs[key].is_open:
                        runs[key].open()
                        print(f"  {group['name']}: {key} up in {runs[key].start_s[-1]:.1f} s, first step "
                              f"{runs[key].first_step_s[-1]:.1f} s, {args.warmup} warm-up steps done", flush=True)
            for r in range(args.rounds):
                rates = {}
                for key in rotated(keys, r):
                    run = runs[key]
                    if method == "alternate":
                        run.open()
                    rates[key] = run.window(group["name"], r)
                    if method == "alternate":
                        run.close(trace_dir)
                rounds.append(rates)
                ref = rates[group["reference"]]
                print(f"  {group['name']} round {r + 1}/{args.rounds}: "
                      + ", ".join(f"{k} {rates[k]:,.0f} ({rates[k] / ref:.3f})" for k in keys) + " tokens/s",
                      flush=True)
            if method == "open":
                for key in keys:
                    if last[key] == index:
                        runs[key].close(trace_dir)
            results.append({**group, "rounds": rounds, "wall_s": time.perf_counter() - began})
    finally:
        for run in runs.values():
            if run.is_open:
                try:
                    run.ctx.close()
                except Exception:     # noqa: BLE001 - the first error is the one to see
                    pass
    return {"runs": runs, "groups": results, "cfg": cfg}


def summarize(measured: dict, args, rates: dict) -> dict:
    """The JSON payload: per group, per configuration, everything the tables print (``rates``: `relay_rate`
    of each relayed configuration's link, by key)."""
    runs, cfg = measured["runs"], measured["cfg"]
    groups = []
    for group in measured["groups"]:
        reference = runs[group["reference"]]
        configs = {}
        for key in group["keys"]:
            run, setup = runs[key], runs[key].setup
            ratios = round_ratios(group["rounds"], key, group["reference"])
            diff, common = loss_difference(run.losses, reference.losses)
            theory = expected_link_bytes(setup.num_islands, run.gradient_bytes) if setup.islands else None
            entry = {**run.summary(group["name"]), "setup": {
                "executors": setup.num_executors, "islands": setup.islands, "mesh": setup.mesh_axes(),
                "link": None if setup.link is None else dataclasses.asdict(setup.link)},
                "vs_one_island": spread(ratios), "ratios": ratios,
                "first_step_s": run.first_step_s, "context_start_s": run.start_s,
                "gradient_bytes": run.gradient_bytes, "theory_link_bytes_per_step": theory,
                "last_loss": run.losses[max(run.losses)] if run.losses else None,
                "loss_difference": diff, "loss_steps_compared": common,
                "executor_rss_mb": run.rss_mb,
                "in_island_collectives_ms_per_step": (statistics.median(run.collective_s[group["name"]]) * 1e3
                                                      if run.collective_s.get(group["name"]) else None),
                "compute_ms_per_step": {k: v * 1e3 for k, v in run.compute_s.get(group["name"], {}).items()},
                "relay_rate_bytes_per_s": rates.get(key), "link_in_force": run.shaping}
            if setup.islands is not None:
                steps = run.exchange.get(group["name"], [])
                entry["exchange"] = {
                    "steps": len(steps),
                    "wait_ms": spread([s["wait"] * 1e3 for s in steps]),
                    "max_wait_ms": spread([s["max_wait"] * 1e3 for s in steps]),
                    "skew_ms": spread([s["skew"] * 1e3 for s in steps]),
                    "after_last_grads_ms": spread([s["after_last"] * 1e3 for s in steps]),
                    "compute_inside_wait_ms": sum(s["compute_inside"] for s in steps) * 1e3,
                    "hidden_share": (sum(s["compute_inside"] for s in steps) / sum(s["wait"] for s in steps)
                                     if steps and sum(s["wait"] for s in steps) else 0.0),
                    "link_transfer_ms": spread([t * 1e3 for t in run.transfers_s.get(group["name"], [])]),
                    "buckets": run.num_buckets,
                    "transfer_s": run.overlap_s.get(group["name"], [0.0, 0.0])[1],
                    "transfer_hidden_share": (run.overlap_s[group["name"]][0] / run.overlap_s[group["name"]][1]
                                              if run.overlap_s.get(group["name"], [0, 0])[1] else 0.0),
                    "per_step_wait_ms": [s["wait"] * 1e3 for s in steps]}
            configs[key] = entry
        groups.append({"name": group["name"], "kind": group["kind"], "reference": group["reference"],
                       "keys": group["keys"], "rounds": group["rounds"], "wall_s": group["wall_s"],
                       "configs": configs})
    some = next(iter(runs.values()))
    return {"backend": some.backend, "parameters": sum(p.numel() for p in make_model(cfg)[0].parameters()),
            "config": {"width": cfg.width, "depth": cfg.depth, "heads": cfg.heads, "length": cfg.length,
                       "vocab": cfg.vocab, "context": cfg.context, "batch": args.batch, "steps": args.steps,
                       "warmup": args.warmup, "rounds": args.rounds, "tokens_per_step": args.batch * cfg.context},
            "groups": groups}


# ------------------------------------------------------------ report

def _ratio(r: dict) -> str:
    return f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"


def _ms(r: dict) -> str:
    return f"{r['median']:.1f} ({r['min']:.1f}-{r['max']:.1f})"


def _bytes(c: dict) -> str:
    measured, theory = c["link_bytes_per_step"], c["theory_link_bytes_per_step"]
    if measured is None:
        return "- (no relay)" if theory else "-"
    return f"{measured:,.0f} / {theory:,} = {measured / theory:.4f}"


def _loss_diff(c: dict, is_reference: bool) -> str:
    if is_reference:
        return "(reference)"
    if c["loss_difference"] is None:
        return "no common step"
    return f"{c['loss_difference']:.1e} ({c['loss_steps_compared']} steps)"


def _main_rows(group: dict, setups: dict) -> list[list]:
    rows = []
    for key in group["keys"]:
        c, setup = group["configs"][key], setups[key]
        exchange = c.get("exchange")
        rows.append([setup.describe(), json.dumps(c["setup"]["mesh"]).replace('"', ""),
                     describe_link(setup.link, setup.islands is not None),
                     f"{c['tokens_per_s']['median']:,.0f}",
                     "1 (reference)" if key == group["reference"] else _ratio(c["vs_one_island"]),
                     f"{c['ms_per_step']:.1f}", _bytes(c),
                     "-" if exchange is None else _ms(exchange["wait_ms"]),
                     "-" if exchange is None else f"{exchange['wait_ms']['median'] / c['ms_per_step']:.1%}",
                     " / ".join(f"{s:.1f}" for s in c["first_step_s"][:1]),
                     f"{c['last_loss']:.6f}", _loss_diff(c, key == group["reference"])])
    return rows


MAIN_HEADERS = ["configuration", "mesh", "link", "tokens/s", "vs one island", "ms/step",
                "link bytes/step measured / I(I-1)G", "exchange wait ms/step", "wait / step", "first step s",
                "last loss", "|loss - one island|"]


def report(summary: dict, setups: dict, args, method: str, why: str) -> None:
    c = summary["config"]
    groups = summary["groups"]
    print()
    print(f"Two islands vs one island of the same size ({summary['backend']}, one thread per process, executors "
          f"pinned): tokens/s = median of {c['rounds']} windows of {c['steps']} steps; vs one island = median "
          f"(min-max) of the per-round ratios to the group's one-island run, rounds interleaved, order rotated")
    print(f"model: {summary['parameters']:,} parameters (width {c['width']}, depth {c['depth']}, heads {c['heads']}), "
          f"context {c['context']}, global batch {c['batch']} = {c['tokens_per_step']:,} tokens/step; "
          f"G = {summary['parameters'] * 4:,} gradient bytes (float32)")
    described = ("contexts of a group kept open together, windows interleaved" if method == "open" else
                 "alternate: each window in a context of its own (opened, warmed up, closed)")
    print(f"method: {described} ({why})")
    for group in groups:
        if group["kind"] == "gated":
            print()
            print("(a) gated: 1 + 1 islands vs one island of 2 executors")
            print_table(MAIN_HEADERS, _main_rows(group, setups))
            ratio = group["configs"]["islands-1+1-relay"]["vs_one_island"]
            direct = group["configs"]["islands-1+1-direct"]["vs_one_island"]
            print(f"target: 1 + 1 islands relayed unshaped >= {TARGET:.2f} x one island (the Pathways paper's 97.2 %): "
                  f"{ratio['median']:.3f} — {'met' if ratio['median'] >= TARGET else 'NOT met'}; "
                  f"direct (no relay): {direct['median']:.3f}")
    for group in groups:
        if group["kind"] == "2x2":
            print()
            print(f"(b) 2 x 2 islands vs one island of 4 executors (reported; {os.cpu_count()} cores for 4 executors "
                  f"and the client: expect noise)")
            print_table(MAIN_HEADERS, _main_rows(group, setups))
    shaped = [g for g in groups if g["kind"] == "shapes"]
    if shaped:
        print()
        print("(c) 1 + 1 islands at several link shapes (each group with its own one-island and unshaped-relay runs "
              "in the same rounds; 'relay alone' = what a LinkRelay of that shape delivers, one loopback connection, "
              "no executors; model = the unshaped relay's ms/step + one-way delay + G / rate (nominal, or the "
              "relay's, less the unshaped relay's own G / rate); 'model vs one island' from the relay's rate)")
        rows = []
        for group in shaped:
            unshaped = group["configs"]["islands-1+1-relay"]
            one = group["configs"][group["reference"]]
            for key in group["keys"]:
                if key == group["reference"]:
                    continue
                c, setup = group["configs"][key], setups[key]
                one_way = run_bytes(c) / 2
                rate, base = c["relay_rate_bytes_per_s"], unshaped["relay_rate_bytes_per_s"]
                nominal_ms = unshaped["ms_per_step"] + modelled_link_s(setup.link, one_way) * 1e3
                # The unshaped relay's own transfer time is in its ms/step already.
                model_ms = (unshaped["ms_per_step"] + (modelled_link_s(setup.link, one_way, rate)
                                                       - modelled_link_s(pw.Link(), one_way, base)) * 1e3)
                exchange = c["exchange"]
                rows.append([group["name"], describe_link(setup.link), f"{rate / 1e6:,.0f}" if rate else "-",
                             f"{c['tokens_per_s']['median']:,.0f}",
                             _ratio(c["vs_one_island"]), f"{c['ms_per_step']:.1f}", f"{nominal_ms:.1f}",
                             f"{model_ms:.1f}",
                             f"{one['ms_per_step'] / model_ms:.3f}", _bytes(c), _ms(exchange["wait_ms"]),
                             _ms(exchange["after_last_grads_ms"]), _loss_diff(c, False)])
        print_table(["group", "link", "relay alone MB/s", "tokens/s", "vs one island", "ms/step",
                     "model ms/step (nominal rate)", "model ms/step (relay's rate)", "model vs one island",
                     "link bytes/step measured / I(I-1)G", "exchange wait ms/step", "of which after last grads",
                     "|loss - one island|"], rows)
        print("one island of 2 in these groups: " + ", ".join(
            f"{g['name']} {g['configs'][g['reference']]['tokens_per_s']['median']:,.0f} tokens/s, "
            f"{g['configs'][g['reference']]['ms_per_step']:.1f} ms/step" for g in shaped))
    print()
    print("The exchange between islands, per timed step, from the executors' trace (median (min-max) over steps; "
          "each step's value the mean over executors)")
    rows = []
    for group in groups:
        for key in group["keys"]:
            c = group["configs"][key]
            setup = setups[key]
            exchange = c.get("exchange")
            collectives = c["in_island_collectives_ms_per_step"]
            compute = c["compute_ms_per_step"]
            spent = " + ".join(f"{kind} {ms:.1f}" for kind, ms in sorted(compute.items(), key=_kind_order))
            if exchange is None:
                rows.append([group["name"], setup.describe(), spent.replace("other", "train_step"), "-", "-", "-",
                             "-", "-", "-", "-", "-", "-", "-", "-" if collectives is None else f"{collectives:.1f}"])
                continue
            rows.append([group["name"], f"{setup.describe()}, {describe_link(setup.link)}", spent, exchange["steps"],
                         _ms(exchange["wait_ms"]), _ms(exchange["max_wait_ms"]), _ms(exchange["skew_ms"]),
                         _ms(exchange["after_last_grads_ms"]), _ms(exchange["link_transfer_ms"]),
                         f"{exchange['compute_inside_wait_ms']:.1f}", f"{exchange['hidden_share']:.0%}",
                         exchange["buckets"], f"{exchange['transfer_hidden_share']:.0%}",
                         "-" if collectives is None else f"{collectives:.1f}"])
    print_table(["group", "configuration", "compute ms/step (per executor)", "steps",
                 "wait ms (grads end -> update start)", "slowest executor's wait",
                 "waiting for the other island's grads", "after the last island's grads", "link transfer ms",
                 "compute inside the waits ms (total)", "wait hidden behind compute", "buckets",
                 "link transfer time hidden behind the receiver's compute", "in-island collectives ms/step"],
                rows)
    print("notes: compute = the executors' compute spans per step (one island's train_step holds its all-reduce, "
          "the last column; the islands' grads — the backward cut per bucket, one span per bucket — hold their "
          "in-island reduce-scatters); each bucket's slice leaves when its segment ends, so the exchange of the first "
          "buckets runs during the backward of the rest; 'link transfer time hidden' = the share of the link "
          "transfers' send-to-receipt time during which the receiving executor was still computing (the last "
          "bucket's transfer, after the backward, cannot be hidden); 'wait' = what was not hidden: the last grads "
          "segment's end to the update's start; "
          "'link transfer' = send to receipt of each transfer between islands (both the gradient slices and the "
          "losses); link bytes: every byte the relay wrote (both directions) over the timed steps, against "
          "I(I-1)G = each of the I x D executors sending its G/D slice to each of the I - 1 other islands "
          "(ZeroMQ/CURVE framing and the islands' losses make the rest; '(I-1)/I x G x executors' would count G for "
          "1 + 1, but each island needs the other's whole slice, G/D per executor, so 2G for two islands at any D).")
    worst = [(g["name"], k, c["loss_difference"]) for g in groups for k, c in g["configs"].items()
             if k != g["reference"] and c["loss_difference"] is not None]
    if worst:
        name, key, diff = max(worst, key=lambda t: t[2])
        print(f"losses: every configuration trains the same weights on the same batches; the largest |loss - one "
              f"island| at a common step is {diff:.1e} ({key}, {name}); tolerance {LOSS_TOLERANCE:g}")


def _kind_order(item) -> int:
    return ("grads", "update", "other").index(item[0])


def run_bytes(c: dict) -> float:
    """Bytes per step crossing the link (measured; the theory when there is no relay to count them)."""
    return c["link_bytes_per_step"] if c["link_bytes_per_step"] is not None else c["theory_link_bytes_per_step"]


# ------------------------------------------------------------ main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_and_json(parser, "islands",
                       quick_help="2 rounds of 4 steps, one link shape (100 MB/s, 1 ms), no 2 x 2 (under two minutes)")
    add_backend_argument(parser)
    add_model_arguments(parser, width=128, depth=4, batch=128, batch_help="global batch (rows); divisible by 4")
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="the gradient buckets exchanged between islands, MB (pw.DataParallel's bucket_mb)")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed window (default 10, quick 4)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3, quick 2)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, quick 2)")
    parser.add_argument("--shapes", default=None,
                        help=f"link shapes MB/s:ms, comma-separated (default {DEFAULT_SHAPES}; quick 100:1)")
    parser.add_argument("--no-2x2", dest="with_2x2", action="store_false", help="skip 2 x 2 vs one island of 4")
    parser.add_argument("--groups", default="gated,shapes,2x2",
                        help="which groups to run, comma-separated: gated (a), 2x2 (b), shapes (c)")
    parser.add_argument("--method", choices=("auto", "open", "alternate"), default="auto",
                        help="keep a group's contexts open together, or one context per window (auto: by memory)")
    add_trace_dir_argument(parser)
    args = parser.parse_args()
    quick = args.quick
    args.steps = args.steps or (4 if quick else 10)
    args.warmup = args.warmup or (2 if quick else 3)
    args.rounds = args.rounds or (2 if quick else 5)
    if quick:
        args.with_2x2 = False
    try:
        shapes = parse_shapes(args.shapes or ("100:1" if quick else DEFAULT_SHAPES))
    except ValueError as exc:
        parser.error(str(exc))
    if args.batch % 4:
        parser.error(f"--batch {args.batch}: must divide by 4 (2 islands x 2 executors, and one island of 4)")
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        parser.error("--steps, --warmup and --rounds: at least 1")
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)

    torch.set_num_threads(1)
    started = time.perf_counter()
    load_before = os.getloadavg()
    kinds = {k.strip() for k in args.groups.split(",") if k.strip()}
    if not kinds or kinds - {"gated", "shapes", "2x2"}:
        parser.error(f"--groups: expected some of gated, shapes, 2x2, got {args.groups!r}")
    setups, groups = make_groups(shapes, args.with_2x2 and "2x2" in kinds)
    groups = [g for g in groups if g["kind"] in kinds]
    setups = {k: v for k, v in setups.items() if any(k in g["keys"] for g in groups)}
    method, why = choose_method(args.method, max(open_executors(groups, setups)), available_memory())
    print(f"{len(setups)} configurations in {len(groups)} groups; method: {method} ({why})", flush=True)
    by_link = {}
    for setup in setups.values():
        if setup.link is not None and setup.link not in by_link:
            nominal = setup.link.bandwidth_bytes_per_s
            size = int(min(RATE_PROBE_BYTES, (nominal or 1e12) * RATE_PROBE_S))
            by_link[setup.link] = relay_rate(setup.link, size)
            print(f"  a lone relay, {describe_link(setup.link)}: {by_link[setup.link] / 1e6:,.0f} MB/s "
                  f"({size:,} bytes, one connection)", flush=True)
    rates = {key: by_link[setup.link] for key, setup in setups.items() if setup.link is not None}
    with tempfile.TemporaryDirectory() as scratch:
        measured = measure(args, setups, groups, method, args.trace_dir or scratch)
    summary = summarize(measured, args, rates)
    report(summary, setups, args, method, why)
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()
    print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f} on {os.cpu_count()} cores "
          f"(other work on this machine shows here and in the spread of the per-round ratios)")
    failures = [f"{k} in {g['name']}: |loss difference| {c['loss_difference']:.2e} over {c['loss_steps_compared']} "
                f"steps" for g in summary["groups"] for k, c in g["configs"].items()
                if c["loss_difference"] is not None and c["loss_difference"] > LOSS_TOLERANCE]
    payload = {"args": vars(args), "method": method, "method_why": why,
               "load_average_before": load_before, "load_average_after": load_after,
               "target": TARGET, "loss_tolerance": LOSS_TOLERANCE, "loss_failures": failures, **summary,
               "elapsed_s": elapsed}
    path = write_results("islands", payload, args.json, default=str)
    print(f"\nwritten to {path} ({elapsed:.0f} s)")
    if failures:
        print("LOSSES DISAGREE (same weights, same batches): " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
