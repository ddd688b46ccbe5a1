"""`Session`: what a `Context` stands on, brought up in order and taken down in reverse.

Keys (made for this context, or a launch's), the client's gatekeeper, the controller behind its
`ControllerClient`, the executors (local processes, or a launch's that join), waiting for and ordering
them, the status service and the shaped link of a launch or of local islands, and the data client that
moves tensor bytes straight to and from the executors. It also hears the controller's events about them
(`ClientEvents`): a loss fails the data client's requests, a new incarnation is reached at its new address.
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from .controller_api import ExecutorView
from .data_client import DataClient
from .errors import ExecutorLostError, PathwaysError, PlacementError
from .launch.environment import executor_ids as launched_ids
from .launch.environment import node_of
from .local.cluster import LocalCluster
from .remote_client import RemoteClient
from .wire import seam
from .wire.crash_stacks import enable_in_client
from .wire.security import CLIENT, CONTROLLER, Gatekeeper, KeyDirectory, SecurityError, client_name

__all__ = ["Session", "attach_to_launch"]

log = logging.getLogger(__name__)


def attach_to_launch(launch, num_executors, islands, options: dict) -> int:
    """Under `pathways-run`: the launched executors are the context's; a count or backend asked for that
    differs from the launch's is an error naming both. Fills ``options`` from the launch; returns the count."""
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


class Session:
    """Starts everything behind one context (``launch``: attach to a `pathways-run` launch instead of
    starting executors); `close` stops it. A failed start closes what it had started and raises."""

    def __init__(self, config, launch=None):
        enable_in_client()   # a native crash of the client (or of the controller in it) leaves every thread's stack
        self.config, self.launch = config, launch
        self.keys = self.gatekeeper = self.client = self.cluster = self.data = self.link = None
        self.status_server = None
        self._started = False   # the events are heard once every executor is connected
        self.zmq = zmq.Context()
        # The controller's command connection and the data client's, per executor: past ZeroMQ's default of 1,023
        # sockets per context from about 500 executors on.
        self.zmq.set(zmq.MAX_SOCKETS, max(1023, 4 * config.num_executors + 256))
        # The same names as a launch's (node k's j-th executor is executor-{k * nproc + j}): one scheme.
        executor_ids = launched_ids(range(config.num_executors))
        try:
            if config.controller is not None:
                self._attach_remote()
                return
            if launch is None:
                # The context's own keys: one pair per role; every socket admits exactly these (docs/security.md).
                self.keys = KeyDirectory.create([CONTROLLER, CLIENT, *executor_ids])
            else:   # the run's keys, made by `pathways-run --make-keys` (node 0's folder): the user's, kept
                self.keys = KeyDirectory(launch.keys_dir)
            self.gatekeeper = Gatekeeper(self.zmq, self.keys.public_keys())
            # Imported here: only an embedded controller needs the controller package (a remote context never loads it)
            from .client import ControllerConfig, InProcessClient

            self.client = InProcessClient.start(ControllerConfig(
                **config.liveness_fields(), inject_latency_s=config.inject_latency_s,
                max_inflight_calls=config.max_inflight, transfer_timeout_s=config.transfer_timeout_s,
                launch_fanout=config.launch_fanout, launch_tree_min_executors=config.launch_tree_min_executors,
                max_heartbeats_per_s=config.max_heartbeats_per_s,
                **({"bind_address": launch.controller_bind} if launch else {})),
                self.keys.credentials(CONTROLLER), self.zmq)
            self.client.subscribe(self)
            if launch is None:
                self.cluster = LocalCluster(
                    self.client.address, executor_ids, keys_dir=self.keys.path, backend=config.resolved_backend,
                    devices=config.executor_devices(), threads=config.executor_threads,
                    mmap_threshold_mb=config.executor_mmap_threshold_mb,
                    **config.liveness_fields(), log_dir=config.log_dir, cpus=config.executor_cpus(),
                    islands=config.executor_islands(), sims_per_process=config.sims_per_process)
            self._wait_for_executors()
            self.client.local.order_executors({e: i for i, e in enumerate(executor_ids)})
            if launch is not None:
                self._label_nodes()
                if launch.status_port:
                    self.status_server = self.client.local.serve_status(launch.status_port, launch.run_id)
            self.link = self._shape_link()
            credentials = self.keys.credentials(CLIENT)
            if launch is None:
                # Every process holds its keys in memory now: none stay on disk, not even if this client is killed.
                self.keys.remove()
            self.data = DataClient(self.zmq, credentials)
            for info in self.client.request(seam.Executors()):
                self.data.connect(info.executor_id, info.data_address, info.public_key)
            self._started = True
            if self.cluster is not None:
                # A dead child is lost at once; the heartbeat timeout catches the hung and the remote.
                self.client.local.watch_exits(self.cluster, config.heartbeat_interval_s)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ bring-up

    def _attach_remote(self) -> None:
        """A client of a standalone controller: its key folder, the controller's executors (at least
        ``num_executors`` of them), and the data client to them. Nothing is started, and nothing is stopped after."""
        config = self.config
        self.keys = KeyDirectory(config.keys)
        role = _client_role_of(self.keys)
        credentials = self.keys.credentials(role)
        self.gatekeeper = Gatekeeper(self.zmq, self.keys.public_keys())
        self.client = RemoteClient(config.controller, credentials, self.zmq, **config.liveness_fields())
        self.client.subscribe(self)
        try:
            self.client.request(seam.WaitForExecutors(config.num_executors, config.start_timeout_s))
        except ExecutorLostError:
            have = [info.executor_id for info in self.client.request(seam.Executors())]
            raise PlacementError(f"pw.Context(num_executors={config.num_executors}): the controller at "
                                 f"{config.controller} has {len(have)} executors ({', '.join(have) or 'none'}) after "
                                 f"{config.start_timeout_s:g} s; ask for at most {len(have)}, or have its operator "
                                 f"add executors") from None
        views = self.client.request(seam.Executors())
        backends = sorted({info.backend for info in views})
        if config.backend is not None and not all(b.split(":")[0] == config.backend.split(":")[0] or b == config.backend
                                                  for b in backends):
            raise ValueError(f"pw.Context(backend={config.backend!r}): the controller at {config.controller} runs "
                             f"executors of {backends}; drop backend= (its operator chooses: pathways-controller "
                             f"--backend)")
        self.data = DataClient(self.zmq, credentials)
        for info in views:
            self.data.connect(info.executor_id, info.data_address, info.public_key)
        self._started = True

    def _wait_for_executors(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            if self.cluster is not None:
                self.cluster.check_alive()
            try:
                self.client.request(seam.WaitForExecutors(self.config.num_executors, 0.2))
                return
            except PathwaysError:
                if time.monotonic() > deadline:
                    if self.launch is not None:
                        raise self._missing_nodes() from None
                    raise

    def _label_nodes(self) -> None:
        """Name each launched executor's node and host in the errors about it."""
        for info in self.client.request(seam.Executors()):
            host = info.data_address.removeprefix("tcp://").rsplit(":", 1)[0]
            self.client.local.label_executor(
                info.executor_id, f"node {node_of(info.executor_id, self.launch.nproc_per_node)} at {host}")

    def _missing_nodes(self) -> PathwaysError:
        """The launched executors that never registered, by node, with the address they were told to reach."""
        registered = {info.executor_id for info in self.client.request(seam.Executors())}
        missing = [e for e in self.launch.executor_ids if e not in registered]
        nodes = sorted({node_of(e, self.launch.nproc_per_node) for e in missing})
        refused = self.client.request(seam.Counters()).refused_connections
        keys = (f"; {refused} connection(s) failed the CURVE handshake meanwhile: a node with the keys of another "
                f"run, or none (give node K the folder node-K of this run's pathways-run --make-keys)"
                if refused else "")
        return ExecutorLostError(
            f"pathways-run: expected {self.launch.num_executors} executors to register within "
            f"{self.config.start_timeout_s:g} s, got {len(registered)}; missing {', '.join(missing)} "
            f"(node(s) {', '.join(map(str, nodes))}), told to reach the controller at {self.launch.controller_bind}: "
            f"check that pathways-run runs on those nodes with --master-addr/--master-port naming this host, that "
            f"the port is open from them, and their logs{keys}")

    def _shape_link(self):
        """With ``link=`` and islands: a relay in front of every executor for transfers from other islands."""
        if self.config.link is None:
            return None
        from .local.link import LinkRelay

        relay = LinkRelay(self.config.link)
        for info in self.client.request(seam.Executors()):
            self.client.local.route_through(info.executor_id, relay.add(info.data_address, owner=info.executor_id))
        return relay

    # ------------------------------------------------------------ the controller's events (ClientEvents)

    def executor_lost(self, executor_id: str, error: BaseException) -> None:
        if self._started:
            self.data.executor_lost(executor_id, error)

    def new_incarnation(self, info: ExecutorView) -> None:
        """An executor registered again (replaced by this context or by its node's launcher): talk to it at its
        new address, with its new key, and route other islands' transfers to it through the link."""
        if not self._started:   # still starting: it is connected with the others
            return
        self.data.reconnect(info.executor_id, info.data_address, info.public_key)
        if self.link is not None:   # the old incarnation's port goes: its address is dead, its peers stop retrying it
            self.client.local.route_through(info.executor_id, self.link.add(info.data_address, owner=info.executor_id))

    def key_revoked(self, public_key: bytes) -> None:
        self.gatekeeper.revoke(public_key)

    # ------------------------------------------------------------ take-down

    def close(self, reason: str = "the context closed") -> None:
        """Fail what is pending, stop the executors, then every socket and thread, in reverse order."""
        try:
            if self.status_server is not None:
                self.status_server.stop(grace=0.2)
            if self.client is not None:
                failed = self.client.fail_pending(reason)
                if failed:
                    log.info("%s: %d pending array(s) failed with ContextClosedError", reason, failed)
                self.client.shutdown_executors("the client closed its context")
        finally:
            if self.cluster is not None:
                self.cluster.stop()
            if self.data is not None:
                self.data.close()
            if self.client is not None:
                self.client.close()
            if self.gatekeeper is not None:
                self.gatekeeper.stop()
            if self.keys is not None and self.launch is None and self.config.controller is None:
                self.keys.remove()   # the context's own; a launch's and a remote client's folder are the user's
            if self.link is not None:
                self.link.close()
            self._close_zmq()

    def _close_zmq(self) -> None:
        # term() waits for every socket of the context: only when both I/O threads are done with theirs.
        if (self.client is not None and self.client.io_running) or (self.data is not None and self.data.loop.running):
            log.warning("an I/O thread did not stop; leaving its ZeroMQ context open")
            return
        self.zmq.term()


def _client_role_of(keys: KeyDirectory) -> str:
    """The one client key pair in a client's folder (``DIR/clients/NAME``)."""
    secret = os.path.join(keys.path, "secret")
    roles = [name.removesuffix(".key_secret") for name in sorted(os.listdir(secret)) if name.endswith(".key_secret")]
    clients = [role for role in roles if client_name(role) is not None]
    if len(clients) != 1:
        raise SecurityError(f"keys={keys.path}: expected a client's folder holding one client key pair "
                            f"(DIR/clients/NAME of pathways-controller --make-keys), found {roles or 'none'}")
    return clients[0]
