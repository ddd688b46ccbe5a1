"""`pw.Context`: the client's handle on a cluster (by default an embedded controller + local executors).

Only the public surface lives here: meshes, puts, training (`wrap`), stats, traces and closing. What stands
behind it is elsewhere: `session` (bring-up and take-down), `incarnations` (replacing lost executors),
`dispatcher` (the call path of functions, programs and arrays), `client` (the controller, behind the
`controller_api.ControllerClient` protocol) and `config` (`ContextConfig`).
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

from .config import ContextConfig
from .dispatcher import Dispatcher
from .incarnations import Incarnations
from .islands import IslandTable, island_key
from .launch.environment import LaunchEnvironment
from .observe.chrome_trace import chrome_trace
from .placement import Mesh
from .session import Session, attach_to_launch
from .wire import seam

if TYPE_CHECKING:
    from .array import Array

__all__ = ["Context", "ContextConfig"]


class Context:
    """Start a controller in this process and ``num_executors`` executor processes; stop them on exit.

    Use as a context manager. ``backend`` picks how executors compile and run
    functions (XLA by default, through the installed route; ``"eager"`` runs op by
    op, bit-for-bit with eager PyTorch; ``ctx.backend`` names what runs). ``debug=True`` checks that outputs declared ``Replicate()`` are
    identical on every shard. ``islands=[2, 2]`` starts local islands (executors with
    their own collectives and gang order; a mesh spans them only on an outer
    ``"island"`` axis): `islands` describes them.

    Every connection is authenticated with CURVE keys made for this context alone
    (docs/security.md). An executor that dies or hangs is found within 2x
    ``heartbeat_timeout_s`` (at once if its process exits); what depends on it
    fails with `ExecutorLostError`.
    """

    def __init__(self, num_executors: int | None = None, **options):
        islands = options.pop("islands", None)
        if islands is not None:
            islands = tuple(islands)
            num_executors = sum(islands) if num_executors is None else num_executors
        self.launch = LaunchEnvironment.from_environ()
        if self.launch is not None:
            num_executors = attach_to_launch(self.launch, num_executors, islands, options)
        if num_executors is None:   # a remote controller's: at least one of those it has; else four started here
            num_executors = 1 if options.get("controller") else 4
        self.config = ContextConfig(num_executors=num_executors, islands=islands,
                                    **options)
        self._session = Session(self.config, self.launch)   # closes what it started if it fails
        self._client = self._session.client
        self._dispatch = Dispatcher(self._client, self._session.data, debug=self.config.debug)
        self._incarnations = Incarnations(self._session)

    # ------------------------------------------------------------ executors

    @property
    def executor_ids(self) -> list[str]:
        """Every executor's id, in mesh order (executor-0 first)."""
        return [info.executor_id for info in self._client.request(seam.Executors())]

    @property
    def executor_pids(self) -> list[int]:
        """Process ids, in the order of `executor_ids` (as each executor registered itself)."""
        return [info.pid for info in self._client.request(seam.Executors())]

    def is_lost(self, executor_id: str) -> bool:
        """Whether the controller counts ``executor_id`` lost (and not yet replaced)."""
        info = self._client.request(seam.Executor(executor_id))
        if info is None:
            raise KeyError(executor_id)
        return info.lost

    @property
    def link(self):
        """The relay shaping the link between local islands (``link=``), or None."""
        return self._session.link

    @functools.cached_property
    def checkpoint_root(self) -> str | None:
        """A client of a `pathways-controller`: its own folder of the service's checkpoint root, ``DIR/<name>``
        (``--checkpoint-root DIR``), where its checkpoints live and nowhere else. None for the embedded context."""
        return self._client.request(seam.CheckpointRoot())

    def checkpoint_path(self, path):
        """Where checkpoint ``path`` (``checkpoint_dir=``, ``trainer.save``/``load``) is. The embedded context:
        ``path`` itself. A service client: under `checkpoint_root` (a relative path lands there, an absolute one
        must be there already; ``..`` and symbolic links are refused: `CheckpointPathError`), absolute."""
        root = self.checkpoint_root
        if root is None:
            return path
        from .wire.checkpoint_paths import resolve_under_root

        return resolve_under_root(root, path)

    def islands(self) -> "IslandTable":
        """Each island's executors and devices, and how islands are linked (prints as a table)."""
        return IslandTable.of(self._client.request(seam.Executors()), self.link)

    def replace_executor(self, executor_id: str, timeout_s: float = 120.0):
        """Start a new incarnation of the lost executor ``executor_id`` in its place; return its `ExecutorView`.

        The survivors keep their processes, stores and compiled functions. The replacement gets a fresh
        key pair: every process admits the new public key and revokes the old one before it starts, so
        the lost incarnation, should it come back (a stopped process continued), cannot reconnect. It
        registers with the next epoch and takes the lost one's place in every mesh; process groups with it
        are formed anew and functions and programs are loaded onto it at their next call. Its state is
        gone: restore it from a checkpoint (the trainer does, with ``checkpoint_every``; docs/faults.md).
        Raises `ExecutorLostError` if no replacement registers within ``timeout_s``.
        """
        self._dispatch.check_open()
        return self._incarnations.replace(executor_id, timeout_s)

    # ------------------------------------------------------------ meshes and arrays

    def mesh(self, axes: dict[str, int], executors: list[int | str] | None = None) -> Mesh:
        """A mesh with named axes, e.g. ``{"data": 4}``; ``executors`` picks them (indices or ids)."""
        ids = None
        if executors is not None:
            known = self.executor_ids
            ids = [known[e] if isinstance(e, int) else e for e in executors]
        return Mesh(self, self._client.request(seam.AllocateMesh(dict(axes), ids)))

    def put(self, tensor, mesh: Mesh, placements) -> "Array":
        """Place ``tensor`` on ``mesh``: each executor gets its block straight from this client."""
        return self.put_many([(tensor, placements)], mesh)[0]

    def put_many(self, items: list, mesh: Mesh) -> list:
        """`put` several ``(tensor, placements)`` on one mesh with one message per executor."""
        return self._dispatch.put_many(items, mesh)

    def wrap(self, model, *, optimizer, mesh: Mesh, loss_fn=None, plan=None, max_grad_norm: float | None = None,
             seed: int = 0, checkpoint_dir: str | None = None, checkpoint_every: int = 0,
             recover: bool | None = None, replacement_timeout_s: float = 120.0, checkpoint_keep: int = 3):
        """Train ``model`` with ``optimizer`` on ``mesh``: returns a `pw.Trainer` (see docs/training.md).

        ``plan``: ``pw.DataParallel(axis)`` (default, on the mesh's first axis),
        ``pw.ShardedDataParallel(axis)`` or ``pw.Pipeline(...)`` (docs/pipelines.md). ``loss_fn(output, target)`` reduces to a
        mean; ``max_grad_norm`` clips gradients by their global L2 norm; ``seed``
        keys the dropout masks. ``checkpoint_dir``/``checkpoint_every=K``: the executors write a checkpoint every
        K steps, in the background; then a lost executor is replaced and the last checkpoint restored, and at
        most K steps are run again, their loss futures resolving to the re-run values (``recover=False``:
        the steps fail with `ExecutorLostError` instead; docs/faults.md). ``checkpoint_keep``: how many of the
        newest checkpoints stay in ``checkpoint_dir`` (0: all).
        """
        from .training import Trainer

        self._dispatch.check_open()
        # One trainer for every plan: the plan picks the runner that runs its steps (`training.runner`).
        return Trainer(self, model, optimizer=optimizer, loss_fn=loss_fn, mesh=mesh, plan=plan,
                       max_grad_norm=max_grad_norm, seed=seed, checkpoint_dir=checkpoint_dir,
                       checkpoint_every=checkpoint_every, recover=recover,
                       replacement_timeout_s=replacement_timeout_s, checkpoint_keep=checkpoint_keep)

    def lowered(self, program, *arrays) -> str:
        """The lowered form of ``program`` for these inputs, as text (registers it if new)."""
        return self._dispatch.lowered(program, *arrays)

    # ------------------------------------------------------------ for loops that run ahead (trainers)

    def flush_frees(self) -> None:
        """Send the frees still waiting for a message to ride on. Dropped arrays' frees ride on the next call's
        messages; call this before the client idles or measures the executors' memory (``ctx.stats()``, a
        trace), so that what was dropped is gone there too."""
        self._dispatch.flush_frees()

    def batched_release(self):
        """A context manager: arrays this thread drops inside are freed together, one Free per executor. Wrap
        a loop body that drops many arrays at once (a training step drops half a dozen) to send one message
        instead of one per array."""
        return self._dispatch.batched_release()

    def note_runahead_wait(self, start_ns: int, in_flight: int, what: str) -> None:
        """Record in the trace that the client waited from ``start_ns`` until now at its own run-ahead bound
        (``in_flight`` steps; ``what``: what was held back), as the controller records its own: a loop that bounds
        how far it runs ahead of the executors calls it, so the wait shows in ``ctx.trace``."""
        self._dispatch.note_runahead_wait(start_ns, in_flight, what)

    # ------------------------------------------------------------ observability

    @property
    def closed(self) -> bool:
        """Whether `close` has run (the executors are gone; arrays not fetched before cannot be)."""
        return self._dispatch.closed

    @property
    def backend(self) -> str:
        """The backend the executors run, with its route (``"xla:torchax"``, ``"eager"`` ...), as they registered."""
        return ",".join(sorted({info.backend for info in self._client.request(seam.Executors())}))

    def backend_counters(self, kind: str) -> dict[str, int]:
        """One kind of the backends' per-function counts, ``{function name: count}`` (the most any executor saw).

        ``kind``: ``"fallback_ops"`` (ops the XLA route ran outside XLA) or ``"collective_cuts"`` (where a
        compiled graph was cut at a collective); docs/backends.md.
        """
        counts: dict[str, int] = {}
        for stats in self.stats()["executors"].values():
            for key, value in stats["backend_counters"].items():
                prefix, _, function = key.partition(":")
                if prefix == kind:
                    counts[function] = max(counts.get(function, 0), value)
        return counts

    def stats(self) -> dict:
        """Object store bytes and bytes per hop, per executor and in total; queue high-water marks
        (``queue_high_water``: runs queued or running on an executor; ``inflight_high_water``: unfinished
        calls; ``send_backlog_high_water``: messages that waited for one slow peer; ``store_bytes_high_water``:
        the most bytes an executor's store held at once since the previous ``stats()``; ``transfers_lost``: its
        transfers a link lost, not acknowledged in time)."""
        replies = self._client.request(seam.Gather("stats"))
        data = self._session.data
        executors = {}
        hops = {"client->executor": data.bytes_sent, "executor->client": data.bytes_received,
                "executor->executor": 0, "controller relayed": 0}
        for executor_id, envelope in replies.items():
            executors[executor_id] = _executor_stats(envelope.stats)
            hops["executor->executor"] += envelope.stats.hop_bytes.get("executor->executor", 0)
        counters = self._client.request(seam.Counters())
        hops["controller relayed"] = counters.relayed_bytes
        return {"executors": executors, "hops": hops,
                "program_constant_bytes": counters.program_constant_bytes,
                "controller_messages": counters.messages_sent,
                "controller": {"dropped_messages": counters.dropped_messages,
                               "refused_connections": counters.refused_connections,
                               "inflight_high_water": counters.inflight_high_water,
                               "send_backlog_high_water": counters.send_backlog_high_water,
                               "transfers_lost": counters.transfers_lost,
                               "calls_failed_by_lost_transfers": counters.calls_failed_by_lost_transfers,
                               "lost_executors": sorted(e.executor_id for e in self._client.request(seam.Executors())
                                                        if e.lost),
                               # from executors, reached their handler: "control:done" ..., "heartbeat", "store"
                               "handled_messages": counters.handled_messages}}

    def trace(self, path: str) -> dict:
        """Collect every executor's events into one Chrome/Perfetto trace JSON file at ``path``.

        A ``client`` row shows where the client waited at the run-ahead bound (``max_inflight``,
        ``max_inflight_steps``): spans named ``run-ahead wait (...)``."""
        replies = self._client.request(seam.Gather("trace"))
        executors = self._client.request(seam.Executors())
        # Rows island by island, then in registration order.
        ranked = sorted(executors, key=lambda info: (island_key(info.island), info.index))
        order = {info.executor_id: i for i, info in enumerate(ranked)}
        owners = {info.data_address: info.executor_id for info in executors}
        owners.update({info.link_address: info.executor_id for info in executors if info.link_address})
        trace = chrome_trace({executor_id: envelope.trace_reply.events for executor_id, envelope in replies.items()},
                             order, {info.executor_id: info.backend for info in executors},
                             client_waits=list(self._client.request(seam.RunaheadWaits())),
                             islands={info.executor_id: info.island for info in executors}, address_owner=owners)
        with open(path, "w") as f:
            json.dump(trace, f)
        return trace

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(reason="the context closed" if exc_type is None else
                   f"the context closed on {exc_type.__name__}")

    def close(self, reason: str = "the context closed") -> None:
        """Stop every executor and the controller (idempotent).

        Every array still pending fails at once with `ContextClosedError` naming its call site,
        so no ``.result()`` waits forever; an array whose value was fetched stays readable.
        (Nothing is written out in the background yet, so there is nothing to wait for first.)
        """
        if self._dispatch.closed:
            return
        self._dispatch.close()
        self._session.close(reason)


def _executor_stats(s) -> dict:
    """One executor's ``pb.Stats`` as `Context.stats` reports it."""
    hop_bytes = dict(s.hop_bytes)
    return {"store_bytes": s.store_bytes, "store_buffers": s.store_buffers,
            "hop_bytes": hop_bytes, "num_computations": s.num_computations,
            "num_function_loads": s.num_function_loads, "programs_held": s.programs_held,
            "functions_held": s.functions_held,
            "fusion": list(s.fusion),
            "num_compiles": s.num_compiles, "backend": s.backend,
            "backend_counters": dict(s.backend_counters),
            # Counts that ride in hop_bytes until Stats has fields for them.
            "dropped_messages": hop_bytes.pop("dropped_messages", 0),
            "refused_connections": hop_bytes.pop("refused_connections", 0),
            # data messages from a role their kind does not admit (executor/data_roles.py)
            "refused_data_messages": hop_bytes.pop("refused_data_messages", 0),
            # saves refused for their path: a service client's outside its folder of the checkpoint root
            "refused_checkpoint_paths": hop_bytes.pop("refused_checkpoint_paths", 0),
            # run outputs larger than the bytes the controller counts for them, stored as failures instead
            "outputs_over_budget": hop_bytes.pop("outputs_over_budget", 0),
            "queue_high_water": s.queue_high_water,
            # the peak since the previous ctx.stats() (each report starts a period)
            "store_bytes_high_water": s.store_bytes_high_water,
            "send_backlog_high_water": hop_bytes.pop("send_backlog_high_water", 0),
            "transfers_lost": s.transfers_lost,
            # "data:put", "command:run" ...: messages that reached their handler
            "handled_messages": {k.split(":", 1)[1]: hop_bytes.pop(k)
                                 for k in [k for k in hop_bytes if k.startswith("handled:")]},
            "heartbeats_sent": hop_bytes.pop("heartbeats_sent", 0),
            # inputs a computation freed itself at their last use (given up: donate_argnums, or already freed)
            "handed_over": hop_bytes.pop("handed_over", 0)}

