"""Many simulated executors in one process (``pathways-executor --backend sim --sim-count K``).

A simulated executor as a process of its own costs about 31 MB and a sleeping thread per device: 128 of them
take 4 GB, and on 2 cores their wake-ups drown what they simulate. A `SimHost` runs K of them in one process:
one ZeroMQ context (one I/O thread, one ZAP handler), one loop thread that reads every socket of every executor,
and one heap of timers that keeps every simulated device's clock (the deadline of its current job) and every
executor's heartbeat. No thread sleeps per executor.

Each executor is a `SimExecutor`: its own sockets, identity and key, store and run queue, so the controller
cannot tell it from a process of its own. Losing the process loses its K executors at once (the launcher sees the
one exit, the controller's heartbeats the K silences).
"""

from __future__ import annotations

import logging
import os
import resource
import secrets
import time

import zmq

from pathways_torch.wire import SocketLoop
from pathways_torch.wire.process_state import is_alive
from pathways_torch.wire.security import Credentials, Gatekeeper, KeyDirectory

from .config import ExecutorConfig
from .sim_executor import SimExecutor

__all__ = ["SimHost", "check_open_files", "FILES_PER_SIM", "FILES_PER_PROCESS", "sim_ids"]

log = logging.getLogger(__name__)

# Exit codes as `executor.process` (a launcher reads them).
_EXIT_LOST, _EXIT_CONTROLLER_GONE, _EXIT_REFUSED = 3, 4, 5

# Open files per simulated executor, measured (12 each at 16 to a process; tests/integration/test_sim.py checks): per socket its mailbox and per
# connection its TCP socket: the data and command ROUTERs (listener, mailbox, the client's, the controller's and
# peers' connections), the control and heartbeat DEALERs, the control socket's monitor. Rounded up.
FILES_PER_SIM = 16
FILES_PER_PROCESS = 64     # the interpreter, the context's own, the ZAP handler's


def sim_ids(ids: list[str], count: int) -> list[str]:
    """The ids of ``count`` simulated executors: ``ids`` as given when there are ``count`` of them, else one id
    ``X`` becomes ``X.0`` .. ``X.<count-1>``."""
    if len(ids) == count:
        return list(ids)
    if len(ids) == 1:
        return [f"{ids[0]}.{index}" for index in range(count)]
    raise ValueError(f"--id: expected one id or {count} comma-separated ids (one per simulated executor, "
                     f"--sim-count {count}), got {len(ids)}")


def check_open_files(count: int, limit: int | None = None) -> None:
    """Refuse, before anything starts, more simulated executors than the open-file limit leaves room for."""
    if count < 1:
        raise ValueError(f"--sim-count: expected at least 1 simulated executor per process, got {count}")
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if limit is None else limit
    needed = FILES_PER_PROCESS + FILES_PER_SIM * count
    if limit != resource.RLIM_INFINITY and needed > limit:
        fit = max(0, (limit - FILES_PER_PROCESS) // FILES_PER_SIM)
        raise ValueError(f"--sim-count {count}: {count} simulated executors need about {needed} open files "
                         f"({FILES_PER_SIM} each), but this process may open {limit} (its open-file limit); raise "
                         f"it with `ulimit -n {needed}` in the shell that starts it, or run at most {fit} per process")


class SimHost:
    """Runs ``executor_ids`` as simulated executors on one loop until the last is stopped."""

    def __init__(self, config: ExecutorConfig, executor_ids: list[str]):
        check_open_files(len(executor_ids))
        self.config = config
        self.pid = os.getpid()
        self.zmq = zmq.Context()
        self.zmq.set(zmq.MAX_SOCKETS, 16 * len(executor_ids) + 64)   # ZeroMQ's default: 1,023 per context
        keys = KeyDirectory(config.keys_dir)
        allowed = keys.public_keys()    # one allow-list for all: read once, not once per executor
        self.gatekeeper = Gatekeeper(self.zmq, allowed)
        self.loop = SocketLoop(f"sim-host-{executor_ids[0]}", self.zmq, precise_timers=True)
        nonce = secrets.token_hex(4)   # this process's connections are its own (see ExecutorProcess)
        self.executors = [SimExecutor(self, executor_id, Credentials(role=executor_id, keys=keys.keypair(executor_id),
                                                              allowed=allowed),
                                      nonce) for executor_id in executor_ids]
        self._live = len(self.executors)
        self._exit_code = 0
        self.loop.every(1.0, self._check_transfers)

    # ------------------------------------------------------------ what the executors ask of their host

    def at(self, due: float, fn) -> None:
        """Run ``fn`` at ``due`` (`time.monotonic`) on the loop: a simulated device's deadline."""
        self.loop.call_at(due, fn)

    def admit_key(self, role: str, public_key: bytes) -> None:
        """A replacement's fresh key, admitted by every executor of the process (they share one allow-list)."""
        self.gatekeeper.admit(role, public_key)
        self.executors[0].credentials.allowed[role] = public_key
        for executor in self.executors:
            executor.outbox.close_peers_not_admitted(self.gatekeeper.admits)

    def refused(self, executor_id: str, event: str) -> None:
        self._exit(f"{executor_id} could not authenticate with the controller at {self.config.controller_address} "
                   f"({event}): its key in {self.config.keys_dir} is not the controller's, or this executor's key "
                   f"is not on its allow-list; use the key directory the launcher made for this cluster",
                   _EXIT_REFUSED)

    def stopped(self, executor: SimExecutor, reason: str) -> None:
        self._live -= 1
        if reason != "the controller asked":
            self._exit_code = _EXIT_LOST
        if self._live == 0:
            self.loop.stop()

    # ------------------------------------------------------------ liveness

    def _beat(self) -> None:
        """Ping from every live executor, and give up when the controller (or the parent) is gone; then again
        after the interval the controller's Welcome set."""
        interval, timeout = self.executors[0].core.heartbeat_timing(self.config.heartbeat_interval_s,
                                                                     self.config.heartbeat_timeout_s)
        if self.config.parent_pid and not is_alive(self.config.parent_pid):
            self._exit(f"parent process {self.config.parent_pid} is gone", _EXIT_CONTROLLER_GONE)
        now = time.monotonic()
        for executor in self.executors:
            if executor.stopped:
                continue
            # Until the controller first answers, it may still be starting: wait up to join_timeout_s.
            limit = timeout if executor.answered else max(timeout, self.config.join_timeout_s)
            if now - executor.last_answer > limit:
                self._exit(f"no answer from the controller to {executor.executor_id} for "
                           f"{now - executor.last_answer:.1f} s (timeout {limit:g} s)", _EXIT_CONTROLLER_GONE)
            executor.ping(now)
        self.loop.call_later(interval, self._beat)

    def _check_transfers(self) -> None:
        now = time.monotonic()
        for executor in self.executors:
            if not executor.stopped:
                executor.check_transfers(now)

    def _exit(self, reason: str, code: int) -> None:
        log.warning("simulating host %s exits: %s", self.executors[0].executor_id, reason)
        os._exit(code)

    # ------------------------------------------------------------ main

    def run(self) -> int:
        """Register every executor, serve until the last stops; the process's exit code."""
        for executor in self.executors:
            executor.register()
        self._beat()
        self.loop.run_forever()
        self.gatekeeper.stop()
        log.info("simulating host %s stopped (%d executors)", self.executors[0].executor_id, len(self.executors))
        return self._exit_code
