"""Replacing a lost executor with a new incarnation of it: a fresh key, a new process (or a launch's), its place.

Locally the context starts the replacement itself, with a key pair of its own that every process admits
(and the old one revoked) before it starts. Under ``pathways-run`` the executor's node restarts it with a
spare key (``--max-executor-restarts``); the context waits for it to register. Either way the survivors keep
their processes, stores and compiled functions.
"""

from __future__ import annotations

import logging
import threading
import time

from .errors import ExecutorLostError, PathwaysError
from .wire import seam
from .wire.security import KeyDirectory

__all__ = ["Incarnations"]

log = logging.getLogger(__name__)


class Incarnations:
    """Replaces lost executors of one `Session`, one at a time."""

    def __init__(self, session):
        self._session = session
        self._client = session.client
        self._replacing = threading.Lock()

    def replace(self, executor_id: str, timeout_s: float):
        """Start a new incarnation of the lost ``executor_id``; its `ExecutorView` once registered."""
        with self._replacing:   # one replacement at a time: two trainers recovering at once start one process
            return self._replace(executor_id, timeout_s)

    def _replace(self, executor_id: str, timeout_s: float):
        info = self._client.request(seam.Executor(executor_id))
        if info is None:
            known = [view.executor_id for view in self._client.request(seam.Executors())]
            raise ValueError(f"replace_executor: expected one of {known}, got {executor_id!r}")
        if not info.lost:
            raise PathwaysError(f"replace_executor: {executor_id} is alive (incarnation {info.epoch}); only an "
                                f"executor declared lost is replaced")
        if self._session.config.controller is not None:   # a remote controller's: its host replaces it
            return self._client.request(seam.ReplaceExecutor(executor_id, timeout_s))
        cluster = self._session.cluster
        if cluster is None:   # under pathways-run: the executor's node restarts it, with a spare key
            return self._await_launched(executor_id, info, timeout_s)
        keys = self._keys_for(executor_id)
        try:
            public = keys.keypair(executor_id).public
            self._session.gatekeeper.admit(executor_id, public)
            self._client.local.admit_key(executor_id, public)   # the survivors revoke the old key first
            process = cluster.respawn(executor_id, keys.path)
            new = self._wait_for(executor_id, info.epoch + 1, process, timeout_s)
        finally:
            keys.remove()    # read at start-up; as for the first incarnations, no key stays on disk
        log.warning("%s replaced: incarnation %d, pid %d (was pid %d)", executor_id, new.epoch, new.pid, info.pid)
        return new

    def _await_launched(self, executor_id: str, info, timeout_s: float):
        """The replacement a node's pathways-run starts (``--max-executor-restarts``), once it registered."""
        try:
            new = self._client.local.wait_for_incarnation(executor_id, info.epoch + 1, timeout_s)
        except ExecutorLostError:
            raise ExecutorLostError(
                f"no replacement for {executor_id} ({info.label or 'its node'}) registered within {timeout_s:g} s "
                f"(replacement_timeout_s): start that node's pathways-run with --max-executor-restarts N, and see "
                f"its log", executor_id=executor_id) from None
        log.warning("%s replaced by its node: incarnation %d, pid %d (was pid %d)", executor_id, new.epoch, new.pid,
                    info.pid)
        return new

    def _keys_for(self, executor_id: str) -> KeyDirectory:
        """A key folder for a replacement: a fresh pair of its own, every other role's public key."""
        keys = KeyDirectory.create([executor_id])
        for role, public in self._client.local.allowed_keys().items():
            if role != executor_id:
                keys.add_public(role, public)
        return keys

    def _wait_for(self, executor_id: str, epoch: int, process, timeout_s: float):
        cluster = self._session.cluster
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._client.local.wait_for_incarnation(executor_id, epoch, min(0.2, timeout_s))
            except ExecutorLostError:
                if process.poll() is not None:
                    raise ExecutorLostError(
                        f"the replacement of {executor_id} (pid {process.pid}) exited with code {process.returncode} "
                        f"before it registered; its log ends:\n{cluster.log_tail(executor_id)}",
                        executor_id=executor_id) from None
                if time.monotonic() >= deadline:
                    process.kill()
                    raise ExecutorLostError(
                        f"no replacement for {executor_id} registered within {timeout_s:g} s (replacement_timeout_s); "
                        f"its log ends:\n{cluster.log_tail(executor_id)}", executor_id=executor_id) from None
