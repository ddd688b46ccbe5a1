"""`pw.Context`: the client's handle on a cluster (by default an embedded controller + local executors)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time

import zmq

from controller import CallSpec, ControllerConfig, ControllerServer
from controller.program import ProgramNodeSpec, ProgramSpec

from .array import Array
from .cluster import LocalCluster
from .data_client import DataClient
from .errors import ExecutorLostError, PathwaysError, PlacementError, RemoteError
from .placement import Mesh, Sharding, local_shape, normalize_placements, split_blocks
from .programs import ProgramGraph
from .islands import check_collectives_in_islands
from .trace_export import chrome_trace
from .wire import pb
from .wire.backend_names import BACKEND_NAMES, default_backend, resolve_backend_name
from .wire.security import CLIENT, CONTROLLER, Gatekeeper, KeyDirectory

__all__ = ["Context", "ContextConfig"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContextConfig:
    """How `Context` starts its embedded cluster."""

    num_executors: int = 4
    # Local islands: executors per island, e.g. (2, 2); named "0", "1", ... (None: one island of num_executors).
    islands: tuple[int, ...] | None = None
    # None: XLA on CPU/TPU (the installed route: "xla:torchax" or "xla:torch_xla"), inductor on CUDA.
    # "eager" runs op by op (debugging); see docs/backends.md.
    backend: str | None = None
    device: str = "cpu"           # "cuda": executor i runs on cuda:i, collectives on NCCL
    debug: bool = False
    executor_threads: int = 1
    start_timeout_s: float = 120.0
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0
    log_dir: str | None = None
    inject_latency_s: float = 0.0     # tests/benchmarks: delay every controller→executor message
    # Pin executor i to core i mod the core count (benchmarks: XLA's CPU runtime ignores executor_threads
    # and uses every core unless pinned; docs/backends.md).
    pin_executors: bool = False
    # Bounded run-ahead (docs/architecture.md §6.3): a call waits while this many calls are unfinished, a
    # training step while this many steps are (each holds its batch on the executors: lower it for big
    # batches; below about 16 a 2-core host loses throughput, measured).
    max_inflight: int = 256
    max_inflight_steps: int = 16
    # A transfer between executors not acknowledged this long (plus 1 s per MB) fails the call that needs it
    # (a link that failed; None: the loss bound, 2 x heartbeat_timeout_s, at least 20 s).
    transfer_timeout_s: float | None = None
    # With islands: shape the link between them (a relay that delays and counts; the kernel's tbf in a network
    # namespace or the relay's token bucket limits the rate: pathways_torch.link).
    link: object | None = None

    def __post_init__(self):
        for name in ("max_inflight", "max_inflight_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if not isinstance(self.num_executors, int) or self.num_executors < 1:
            raise ValueError(f"num_executors: expected a positive int, got {self.num_executors!r}")
        if self.islands is not None:
            if not self.islands or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.islands):
                raise ValueError(f"islands: expected executors per island, positive ints such as [2, 2], got "
                                 f"{self.islands!r}")
            if sum(self.islands) != self.num_executors:
                raise ValueError(f"islands={list(self.islands)} make {sum(self.islands)} executors but "
                                 f"num_executors={self.num_executors}; give one of them, or make them agree")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {self.device!r}")
        if self.backend is not None and self.backend not in BACKEND_NAMES:
            raise ValueError(f"backend: expected one of {BACKEND_NAMES} (or None for the default), "
                             f"got {self.backend!r}")
        if self.device == "cuda" and self.backend not in (None, "inductor", "eager"):
            raise ValueError(f"device='cuda' needs backend='inductor' (the default there) or 'eager', got "
                             f"{self.backend!r}: the XLA routes run on CPU and TPU hosts (docs/backends.md)")

    @property
    def resolved_backend(self) -> str:
        """The backend executors are started with: the default for the device, an XLA route resolved to what is
        installed (raises ``ValueError`` saying what to install)."""
        return resolve_backend_name(self.backend or default_backend(self.device))

    def executor_islands(self) -> list[str]:
        """The island of each executor: "0", "1", ... in order (all "" for one island)."""
        if self.islands is None:
            return [""] * self.num_executors
        return [str(index) for index, count in enumerate(self.islands) for _ in range(count)]

    def executor_cpus(self) -> list[tuple[int, ...]]:
        """The cores each executor may use: one each when ``pin_executors``, else all (empty)."""
        if not self.pin_executors:
            return [()] * self.num_executors
        cores = sorted(os.sched_getaffinity(0))
        return [(cores[i % len(cores)],) for i in range(self.num_executors)]

    def executor_devices(self) -> list[str]:
        """The device of each executor: ``cpu``, or one CUDA device each (NCCL needs distinct devices)."""
        if self.device == "cpu":
            return ["cpu"] * self.num_executors
        import torch

        count = torch.cuda.device_count()
        if count < self.num_executors:
            raise ValueError(f"device='cuda': {self.num_executors} executors need as many CUDA devices, this host "
                             f"has {count}; use num_executors <= {count}")
        return [f"cuda:{i}" for i in range(self.num_executors)]


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
        from .launch.environment import LaunchEnvironment
        from .launch.environment import executor_ids as launched_ids

        islands = options.pop("islands", None)
        if islands is not None:
            islands = tuple(islands)
            num_executors = sum(islands) if num_executors is None else num_executors
        self.launch = LaunchEnvironment.from_environ()
        if self.launch is not None:
            num_executors = self._launched_count(num_executors, islands, options)
        self.config = ContextConfig(num_executors=4 if num_executors is None else num_executors, islands=islands,
                                    **options)
        self._closed = False
        self._batched = threading.local()    # see _batched_release
        self._keys = self._gatekeeper = self._server = self._cluster = self._data = self.link = None
        self._status_server = None
        self._replacing = threading.Lock()
        self._zmq = zmq.Context()
        # The same names as a launch's (node k's j-th executor is executor-{k * nproc + j}): one scheme.
        executor_ids = launched_ids(range(self.config.num_executors))
        try:
            if self.launch is None:
                # The context's own keys: one pair per role; every socket admits exactly these (docs/security.md).
                self._keys = KeyDirectory.create([CONTROLLER, CLIENT, *executor_ids])
            else:   # the run's keys, made by `pathways-run --make-keys` (node 0's folder): the user's, kept
                self._keys = KeyDirectory(self.launch.keys_dir)
            self._gatekeeper = Gatekeeper(self._zmq, self._keys.public_keys())
            self._server = ControllerServer(ControllerConfig(
                heartbeat_interval_s=self.config.heartbeat_interval_s,
                heartbeat_timeout_s=self.config.heartbeat_timeout_s, inject_latency_s=self.config.inject_latency_s,
                max_inflight_calls=self.config.max_inflight, transfer_timeout_s=self.config.transfer_timeout_s,
                **({"bind_address": self.launch.controller_bind} if self.launch else {})),
                self._keys.credentials(CONTROLLER), self._zmq)
            self._server.start()
            self.controller = self._server.controller
            self._server.on_key_revoked = self._gatekeeper.revoke
            if self.launch is None:
                self._cluster = LocalCluster(
                    self._server.address, executor_ids, keys_dir=self._keys.path,
                    backend=self.config.resolved_backend, devices=self.config.executor_devices(),
                    threads=self.config.executor_threads, heartbeat_interval_s=self.config.heartbeat_interval_s,
                    heartbeat_timeout_s=self.config.heartbeat_timeout_s, log_dir=self.config.log_dir,
                    cpus=self.config.executor_cpus(), islands=self.config.executor_islands())
            self._wait_for_executors()
            self._order_executors(executor_ids)
            if self.launch is not None:
                self._label_nodes()
                if self.launch.status_port:
                    from .launch.health import serve_status

                    self._status_server = serve_status(self, self.launch.status_port, self.launch.run_id)
            self.link = self._shape_link()
            client = self._keys.credentials(CLIENT)
            if self.launch is None:
                # Every process holds its keys in memory now: none stay on disk, not even if this client is killed.
                self._keys.remove()
            self._data = DataClient(self._zmq, client)
            for info in self.controller.resources.ordered():
                self._data.connect(info.executor_id, info.data_address, info.public_key)
            self.controller.loss_listeners.append(self._data.executor_lost)
            self.controller.incarnation_listeners.append(self._on_new_incarnation)
            if self._cluster is not None:
                # A dead child is lost at once; the heartbeat timeout catches the hung and the remote.
                self._server.loop.every(self.config.heartbeat_interval_s, self._reap_exited)
                self.controller.liveness_probe = self._reap_exited
            self._function_ids: dict[int, tuple] = {}
            self._lowered_programs: dict[int, tuple] = {}
        except BaseException:
            self.close()
            raise

    def _launched_count(self, num_executors, islands, options) -> int:
        """Under `pathways-run`: the launched executors are the context's; a count or backend asked for that
        differs from the launch's is an error naming both."""
        launch = self.launch
        if num_executors is not None and num_executors != launch.num_executors:
            raise ValueError(f"pw.Context(num_executors={num_executors}) under pathways-run, which started "
                             f"{launch.num_executors} executors ({launch.nnodes} node(s) x {launch.nproc_per_node}); "
                             f"drop num_executors (the context attaches to the launched executors) or launch "
                             f"with --nproc-per-node/--nnodes to match")
        if islands is not None:
            raise ValueError("pw.Context(islands=...) under pathways-run: islands come from each node's "
                             "--island flag there; drop islands=")
        backend = options.get("backend")
        if backend is not None and backend != launch.backend:
            raise ValueError(f"pw.Context(backend={backend!r}) under pathways-run, whose executors run "
                             f"{launch.backend!r}; drop backend= or launch with --backend {backend}")
        options["backend"] = launch.backend
        options.setdefault("start_timeout_s", launch.join_timeout_s)
        return launch.num_executors

    def _shape_link(self):
        """With ``link=`` and islands: a relay in front of every executor for transfers from other islands."""
        if self.config.link is None:
            return None
        from .link import LinkRelay

        relay = LinkRelay(self.config.link)
        for info in self.controller.resources.ordered():
            info.link_address = relay.add(info.data_address, owner=info.executor_id)
        return relay

    def _wait_for_executors(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            if self._cluster is not None:
                self._cluster.check_alive()
            try:
                self.controller.wait_for_executors(self.config.num_executors, 0.2)
                return
            except PathwaysError:
                if time.monotonic() > deadline:
                    if self.launch is not None:
                        raise self._missing_nodes() from None
                    raise

    def _order_executors(self, executor_ids: list[str]) -> None:
        """Executors in the order of their ids (executor-0 first, whichever registered first), so that
        `executor_ids` and the meshes made from it are the same run after run."""
        order = {e: i for i, e in enumerate(executor_ids)}
        for info in self.controller.resources.ordered():
            info.index = order.get(info.executor_id, len(order) + info.index)

    def _label_nodes(self) -> None:
        """Name each launched executor's node and host in the errors about it."""
        from .launch.environment import node_of

        for info in self.controller.resources.ordered():
            host = info.data_address.removeprefix("tcp://").rsplit(":", 1)[0]
            self.controller.executor_labels[info.executor_id] = (
                f"node {node_of(info.executor_id, self.launch.nproc_per_node)} at {host}")

    def _missing_nodes(self) -> PathwaysError:
        """The launched executors that never registered, by node, with the address they were told to reach."""
        from .launch.environment import node_of

        registered = set(self.controller.resources.executors)
        missing = [e for e in self.launch.executor_ids if e not in registered]
        nodes = sorted({node_of(e, self.launch.nproc_per_node) for e in missing})
        refused = self._server.refused_connections
        keys = (f"; {refused} connection(s) failed the CURVE handshake meanwhile: a node with the keys of another "
                f"run, or none (give node K the folder node-K of this run's pathways-run --make-keys)"
                if refused else "")
        return ExecutorLostError(
            f"pathways-run: expected {self.launch.num_executors} executors to register within "
            f"{self.config.start_timeout_s:g} s, got {len(registered)}; missing {', '.join(missing)} "
            f"(node(s) {', '.join(map(str, nodes))}), told to reach the controller at {self.launch.controller_bind}: "
            f"check that pathways-run runs on those nodes with --master-addr/--master-port naming this host, that "
            f"the port is open from them, and their logs{keys}")

    def replace_executor(self, executor_id: str, timeout_s: float = 120.0):
        """Start a new incarnation of the lost executor ``executor_id`` in its place; return its `ExecutorInfo`.

        The survivors keep their processes, stores and compiled functions. The replacement gets a fresh
        key pair: every process admits the new public key and revokes the old one before it starts, so
        the lost incarnation, should it come back (a stopped process continued), cannot reconnect. It
        registers with the next epoch and takes the lost one's place in every mesh; process groups with it
        are formed anew and functions and programs are loaded onto it at their next call. Its state is
        gone: restore it from a checkpoint (the trainer does, with ``checkpoint_every``; docs/faults.md).
        Raises `ExecutorLostError` if no replacement registers within ``timeout_s``.
        """
        self._check_open()
        with self._replacing:   # one replacement at a time: two trainers recovering at once start one process
            return self._replace_executor(executor_id, timeout_s)

    def _replace_executor(self, executor_id: str, timeout_s: float):
        info = self.controller.resources.executors.get(executor_id)
        if info is None:
            raise ValueError(f"replace_executor: expected one of {self.executor_ids}, got {executor_id!r}")
        if not info.lost:
            raise PathwaysError(f"replace_executor: {executor_id} is alive (incarnation {info.epoch}); only an "
                                f"executor declared lost is replaced")
        if self._cluster is None:   # under pathways-run: the executor's node restarts it, with a spare key
            return self._await_launched_replacement(executor_id, info, timeout_s)
        keys = self._replacement_keys(executor_id)
        try:
            public = keys.keypair(executor_id).public
            self._gatekeeper.admit(executor_id, public)
            self._server.admit(executor_id, public)
            self.controller.admit_key(executor_id, public)   # the survivors revoke the old key first
            process = self._cluster.respawn(executor_id, keys.path)
            new = self._wait_for_incarnation(executor_id, info.epoch + 1, process, timeout_s)
        finally:
            keys.remove()    # read at start-up; as for the first incarnations, no key stays on disk
        log.warning("%s replaced: incarnation %d, pid %d (was pid %d)", executor_id, new.epoch, new.pid, info.pid)
        return new

    def _on_new_incarnation(self, info) -> None:
        """An executor registered again (replaced by this context or by its node's launcher): talk to it at its
        new address, with its new key, and route other islands' transfers to it through the link."""
        self._data.reconnect(info.executor_id, info.data_address, info.public_key)
        if self.link is not None:   # the old incarnation's port goes: its address is dead, its peers stop retrying it
            info.link_address = self.link.add(info.data_address, owner=info.executor_id)

    def _await_launched_replacement(self, executor_id: str, info, timeout_s: float):
        """The replacement a node's pathways-run starts (``--max-executor-restarts``), once it registered."""
        try:
            new = self.controller.wait_for_incarnation(executor_id, info.epoch + 1, timeout_s)
        except ExecutorLostError:
            raise ExecutorLostError(
                f"no replacement for {executor_id} ({self.controller.executor_labels.get(executor_id, 'its node')}) "
                f"registered within {timeout_s:g} s (replacement_timeout_s): start that node's pathways-run with "
                f"--max-executor-restarts N, and see its log", executor_id=executor_id) from None
        log.warning("%s replaced by its node: incarnation %d, pid %d (was pid %d)", executor_id, new.epoch, new.pid,
                    info.pid)
        return new

    def _replacement_keys(self, executor_id: str) -> KeyDirectory:
        """A key folder for a replacement: a fresh pair of its own, every other role's public key."""
        keys = KeyDirectory.create([executor_id])
        for role, public in self._server.credentials.allowed.items():
            if role != executor_id:
                keys.add_public(role, public)
        return keys

    def _wait_for_incarnation(self, executor_id: str, epoch: int, process, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.controller.wait_for_incarnation(executor_id, epoch, min(0.2, timeout_s))
            except ExecutorLostError:
                if process.poll() is not None:
                    raise ExecutorLostError(
                        f"the replacement of {executor_id} (pid {process.pid}) exited with code {process.returncode} "
                        f"before it registered; its log ends:\n{self._cluster.log_tail(executor_id)}",
                        executor_id=executor_id) from None
                if time.monotonic() >= deadline:
                    process.kill()
                    raise ExecutorLostError(
                        f"no replacement for {executor_id} registered within {timeout_s:g} s (replacement_timeout_s); "
                        f"its log ends:\n{self._cluster.log_tail(executor_id)}", executor_id=executor_id) from None

    def _reap_exited(self, patience_s: float = 0.0, then=None) -> None:
        """Declare lost every executor process that exited. With ``patience_s``: look again every 20 ms until one
        has or the time is up, then call ``then()``. Looked at later on the controller's I/O thread, never slept
        for: the caller holds the controller's lock there, and heartbeats would go unanswered meanwhile."""
        deadline = time.monotonic() + patience_s

        def look() -> None:
            exited = self._cluster.newly_exited()
            for executor_id, why in exited:
                self.controller.declare_lost(executor_id, why)
            if not exited and time.monotonic() < deadline:
                self._server.loop.call_later(0.02, look)
            elif then is not None:
                then()

        look()

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
        if self._closed:
            return
        self._closed = True
        try:
            if self._status_server is not None:
                self._status_server.stop(grace=0.2)
            if self._server is not None:
                failed = self.controller.fail_pending(reason)
                if failed:
                    log.info("%s: %d pending array(s) failed with ContextClosedError", reason, failed)
                self.controller.shutdown_executors("the client closed its context")
        finally:
            if self._cluster is not None:
                self._cluster.stop()
            if self._data is not None:
                self._data.close()
            if self._server is not None:
                self._server.stop()
            if self._gatekeeper is not None:
                self._gatekeeper.stop()
            if self._keys is not None and self.launch is None:
                self._keys.remove()
            if getattr(self, "link", None) is not None:
                self.link.close()
            self._close_zmq()

    def _close_zmq(self) -> None:
        # term() waits for every socket of the context: only when both I/O threads are done with theirs.
        loops = [x.loop for x in (self._server, self._data) if x is not None]
        if any(loop.running for loop in loops):
            log.warning("an I/O thread did not stop; leaving its ZeroMQ context open")
            return
        self._zmq.term()

    @property
    def executor_ids(self) -> list[str]:
        return [e.executor_id for e in self.controller.resources.ordered()]

    @property
    def executor_pids(self) -> list[int]:
        """Process ids, in the order of `executor_ids` (as each executor registered itself)."""
        return [info.pid for info in self.controller.resources.ordered()]

    def islands(self) -> "IslandTable":
        """Each island's executors and devices, and how islands are linked (prints as a table)."""
        from .islands import IslandTable

        return IslandTable.of(self.controller.resources, self.link)

    # ------------------------------------------------------------ meshes and arrays

    def mesh(self, axes: dict[str, int], executors: list[int | str] | None = None) -> Mesh:
        """A mesh with named axes, e.g. ``{"data": 4}``; ``executors`` picks them (indices or ids)."""
        ids = None
        if executors is not None:
            known = self.executor_ids
            ids = [known[e] if isinstance(e, int) else e for e in executors]
        return Mesh(self, self.controller.resources.allocate(dict(axes), ids))

    def put(self, tensor, mesh: Mesh, placements) -> Array:
        """Place ``tensor`` on ``mesh``: each executor gets its block straight from this client."""
        return self.put_many([(tensor, placements)], mesh)[0]

    def put_many(self, items: list, mesh: Mesh) -> list[Array]:
        """`put` several ``(tensor, placements)`` on one mesh with one message per executor."""
        import torch

        arrays, shards_by_position = [], [[] for _ in range(mesh.size)]
        for tensor, placements in items:
            if not isinstance(tensor, torch.Tensor):
                raise PlacementError(f"ctx.put: expected a torch.Tensor, got {type(tensor).__name__}")
            placements = normalize_placements(placements, mesh)
            block_shape = local_shape(tuple(tensor.shape), placements, mesh)
            # One private copy, so later in-place changes to `tensor` cannot race the send.
            blocks = [b.detach().to("cpu", copy=True).contiguous() for b in split_blocks(tensor, placements, mesh)]
            record = self.controller.new_array(mesh.executor_ids, landing=mesh.size)
            for position, block in enumerate(blocks):
                shards_by_position[position].append((pb.ShardRef(array_id=record.array_id, shard=position), block))
            arrays.append(Array(self, record, tuple(tensor.shape), tensor.dtype, Sharding(mesh, placements),
                                block_shape))
        ids = [a.array_id for a in arrays]

        def landed(error):
            for array_id in ids:
                self.controller.landed(array_id, error)

        for executor_id, shards in zip(mesh.executor_ids, shards_by_position):
            self._data.put(executor_id, shards, landed)
        return arrays

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
        from .pipeline import Pipeline, PipelineTrainer
        from .training import DataParallel, Trainer
        from .training.checkpoint_folders import check_keep

        self._check_open()
        check_keep(checkpoint_keep)
        if isinstance(plan, DataParallel) and isinstance(plan.axis, (tuple, list)):
            from .training.cross_island import CrossIslandTrainer

            return CrossIslandTrainer(self, model, optimizer=optimizer, loss_fn=loss_fn, mesh=mesh, plan=plan,
                                      max_grad_norm=max_grad_norm, seed=seed, checkpoint_dir=checkpoint_dir,
                                      checkpoint_every=checkpoint_every, recover=recover,
                                      replacement_timeout_s=replacement_timeout_s, checkpoint_keep=checkpoint_keep)
        if isinstance(plan, Pipeline):
            return PipelineTrainer(self, model, optimizer=optimizer, loss_fn=loss_fn, mesh=mesh, plan=plan,
                                   max_grad_norm=max_grad_norm, seed=seed, checkpoint_dir=checkpoint_dir,
                                   checkpoint_every=checkpoint_every, recover=recover,
                                   replacement_timeout_s=replacement_timeout_s, checkpoint_keep=checkpoint_keep)
        return Trainer(self, model, optimizer=optimizer, loss_fn=loss_fn, mesh=mesh, plan=plan,
                       max_grad_norm=max_grad_norm, seed=seed, checkpoint_dir=checkpoint_dir,
                       checkpoint_every=checkpoint_every, recover=recover,
                       replacement_timeout_s=replacement_timeout_s, checkpoint_keep=checkpoint_keep)

    # ------------------------------------------------------------ used by Function and Array

    def _call(self, version, mesh: Mesh, inputs, layouts: list, call_site: str) -> list[Array]:
        self._check_open()
        check_collectives_in_islands(version, mesh.allocation, self.controller.resources)
        replicated = tuple(sharding.is_replicated for _, _, sharding, _ in layouts)
        spec = CallSpec(function_id=self._function_id(version), name=version.name, mesh=mesh.allocation,
                        inputs=tuple(a.array_id for a in inputs), num_outputs=len(layouts),
                        replicated_outputs=replicated, debug=self.config.debug, call_site=call_site,
                        collective_axes=version.collective_axes, report_shapes=version.data_dependent)
        records = self.controller.call(spec)
        return [Array(self, record, shape, dtype, sharding, block)
                for record, (shape, dtype, sharding, block) in zip(records, layouts)]

    def _run_program(self, program, graph, inputs) -> list[Array]:
        self._check_open()
        records = self.controller.run_program(self._lowered_for(graph).program_id, [a.array_id for a in inputs])
        return [Array(self, record, *graph.layouts[value])
                for record, value in zip(records, graph.output_values)]

    def _register_program(self, graph):
        nodes = []
        for node in graph.nodes:
            check_collectives_in_islands(node.version, node.mesh.allocation, self.controller.resources)
            nodes.append(ProgramNodeSpec(name=node.version.name, function_id=self._function_id(node.version),
                                         mesh=node.mesh.allocation, inputs=node.inputs, outputs=node.outputs,
                                         collective_axes=node.version.collective_axes,
                                         replicated_outputs=tuple(layout[2].is_replicated for layout in node.layouts),
                                         debug=self.config.debug))
        spec = ProgramSpec(name=graph.name, input_values=graph.input_values,
                           input_meshes=tuple(graph.layouts[v][2].mesh.allocation for v in graph.input_values),
                           nodes=tuple(nodes), output_values=graph.output_values)
        return self.controller.register_program(spec)

    def _lowered_for(self, graph):
        """The lowered, registered form of a traced graph (registered on first use)."""
        entry = self._lowered_programs.get(id(graph))
        if entry is None or entry[1] is not graph:   # ids of dead graphs can be reused
            entry = self._lowered_programs[id(graph)] = (self._register_program(graph), graph)
        return entry[0]

    def lowered(self, program, *arrays) -> str:
        """The lowered form of ``program`` for these inputs, as text (registers it if new)."""
        graph = program.graph(*arrays)
        if not isinstance(graph, ProgramGraph):   # a sequential fallback: only its prefix is lowered
            prefix = graph.prefix
            return str(graph) + ("" if prefix is None else "\n" + self._lowered_for(prefix).describe())
        return self._lowered_for(graph).describe()

    def _function_id(self, version) -> int:
        entry = self._function_ids.get(id(version))
        if entry is None or entry[1] is not version:
            function_id = self.controller.register_function(version.name, version.graph, version.constants,
                                                            sim_seconds=version.sim_seconds)
            entry = self._function_ids[id(version)] = (function_id, version)
        return entry[0]

    def _fetch_blocks(self, array: Array, positions: list[int], timeout_s: float | None) -> dict:
        lost = array._record.lost_holders
        if lost:   # a replicated array that lost replicas: every block comes from a replica that is left
            live = next(p for p, e in enumerate(array.mesh.executor_ids) if e not in lost)
            block = self._data.fetch(array.mesh.executor_ids[live], pb.ShardRef(array_id=array.array_id, shard=live))
            return {p: block.result(timeout_s) for p in positions}
        futures = {p: self._data.fetch(array.mesh.executor_ids[p], pb.ShardRef(array_id=array.array_id, shard=p))
                   for p in positions}
        return {p: f.result(timeout_s) for p, f in futures.items()}

    def _release(self, array_id: int) -> None:
        if self._closed:
            return
        batch = getattr(self._batched, "ids", None)
        if batch is not None:
            batch.append(array_id)
        else:
            self.controller.release(array_id)

    def _flush_frees(self) -> None:
        """Send the frees still waiting for a message to ride on (the client is about to idle)."""
        if not self._closed:
            self.controller.flush_frees()

    @contextlib.contextmanager
    def _batched_release(self):
        """Arrays this thread drops inside are freed together: one Free per executor (a training step
        drops half a dozen at once)."""
        if getattr(self._batched, "ids", None) is not None:   # nested: the outer scope frees
            yield
            return
        self._batched.ids = []
        try:
            yield
        finally:
            ids, self._batched.ids = self._batched.ids, None
            if ids and not self._closed:
                self.controller.release_many(ids)

    def _explained(self, error: BaseException) -> BaseException:
        """``error``, with the user's line of the op a backend could not compile when it names one."""
        if isinstance(error, RemoteError) and error.node_index and not error.user_line:
            error.locate(self._user_line)
        # The same object is raised by every future it failed, and the controller keeps it: each raise would add
        # its frames (and their locals: arrays, losses) to one traceback that lives as long as the run.
        error.__traceback__ = None
        return error

    def _user_line(self, function_id: int, node_index: int) -> str:
        for known_id, version in list(self._function_ids.values()):
            if known_id == function_id:
                return version.user_line(node_index)
        return ""

    def _note_runahead_wait(self, start_ns: int, in_flight: int, what: str) -> None:
        """Keep a wait at the run-ahead bound for the trace (the controller keeps its own the same way)."""
        self.controller.runahead_waits.append((start_ns, time.time_ns(), in_flight, what))

    def _check_open(self) -> None:
        if self._closed:
            raise PathwaysError("this context is closed; create a new pw.Context")

    # ------------------------------------------------------------ observability

    @property
    def closed(self) -> bool:
        """Whether `close` has run (the executors are gone; arrays not fetched before cannot be)."""
        return self._closed

    @property
    def backend(self) -> str:
        """The backend the executors run, with its route (``"xla:torchax"``, ``"eager"`` ...), as they registered."""
        names = sorted({info.backend for info in self.controller.resources.ordered()})
        return ",".join(names)

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
        replies = self.controller.gather("stats")
        executors = {}
        hops = {"client->executor": self._data.bytes_sent, "executor->client": self._data.bytes_received,
                "executor->executor": 0, "controller relayed": 0}
        for executor_id, envelope in replies.items():
            s = envelope.stats
            hop_bytes = dict(s.hop_bytes)
            executors[executor_id] = {"store_bytes": s.store_bytes, "store_buffers": s.store_buffers,
                                      "hop_bytes": hop_bytes, "num_computations": s.num_computations,
                                      "num_function_loads": s.num_function_loads,
                                      "num_compiles": s.num_compiles, "backend": s.backend,
                                      "backend_counters": dict(s.backend_counters),
                                      # Counts that ride in hop_bytes until Stats has fields for them.
                                      "dropped_messages": hop_bytes.pop("dropped_messages", 0),
                                      "refused_connections": hop_bytes.pop("refused_connections", 0),
                                      # data messages from a role their kind does not admit (executor/data_roles.py)
                                      "refused_data_messages": hop_bytes.pop("refused_data_messages", 0),
                                      "queue_high_water": s.queue_high_water,
                                      # the peak since the previous ctx.stats() (each report starts a period)
                                      "store_bytes_high_water": s.store_bytes_high_water,
                                      "send_backlog_high_water": hop_bytes.pop("send_backlog_high_water", 0),
                                      "transfers_lost": s.transfers_lost,
                                      # "data:put", "command:run" ...: messages that reached their handler
                                      "handled_messages": {k.split(":", 1)[1]: hop_bytes.pop(k)
                                                           for k in [k for k in hop_bytes if k.startswith("handled:")]},
                                      "heartbeats_sent": hop_bytes.pop("heartbeats_sent", 0)}
            hops["executor->executor"] += s.hop_bytes.get("executor->executor", 0)
        payload = self._server.payload_bytes
        hops["controller relayed"] = payload["sent"] + payload["received"] - self.controller.program_constant_bytes
        return {"executors": executors, "hops": hops,
                "program_constant_bytes": self.controller.program_constant_bytes,
                "controller_messages": dict(self.controller.messages_sent),
                "controller": {"dropped_messages": self._server.dropped_messages + self.controller.dropped_messages,
                               "refused_connections": self._server.refused_connections,
                               "inflight_high_water": self.controller.inflight_high_water,
                               "send_backlog_high_water": self._server.loop.backlog_high_water,
                               "transfers_lost": self.controller.transfers_lost,
                               "calls_failed_by_lost_transfers": self.controller.calls_failed_by_lost_transfers,
                               "lost_executors": sorted(e.executor_id for e in self.controller.resources.ordered()
                                                        if e.lost),
                               # from executors, reached their handler: "control:done" ..., "heartbeat", "store"
                               "handled_messages": {**{f"control:{k}": n for k, n in
                                                       self.controller.handled_messages.items()},
                                                    **self._server.handled_messages}}}

    def trace(self, path: str) -> dict:
        """Collect every executor's events into one Chrome/Perfetto trace JSON file at ``path``.

        A ``client`` row shows where the client waited at the run-ahead bound (``max_inflight``,
        ``max_inflight_steps``): spans named ``run-ahead wait (...)``."""
        replies = self.controller.gather("trace")
        resources = self.controller.resources
        # Rows island by island, then in registration order.
        ranked = sorted(resources.ordered(), key=lambda info: (list(resources.islands()).index(info.island),
                                                               info.index))
        order = {info.executor_id: i for i, info in enumerate(ranked)}
        backends = {info.executor_id: info.backend for info in resources.ordered()}
        owners = {info.data_address: info.executor_id for info in resources.ordered()}
        owners.update({info.link_address: info.executor_id for info in resources.ordered() if info.link_address})
        trace = chrome_trace({executor_id: envelope.trace_reply.events for executor_id, envelope in replies.items()},
                             order, backends, client_waits=list(self.controller.runahead_waits),
                             islands={info.executor_id: info.island for info in resources.ordered()},
                             address_owner=owners)
        with open(path, "w") as f:
            json.dump(trace, f)
        return trace
