"""An executor process: sockets, the compute thread and the liveness watch around `ExecutorCore`."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import zmq

from pathways_torch.wire import SocketLoop, decode, encode, pb
from pathways_torch.wire.framing import FramingError

from .backends import make_backend
from .collectives import CollectiveRuntime
from .compile_cache import CompileCache
from .config import ExecutorConfig
from .trace import TraceRecorder
from .worker import ComputeJob, ExecutorCore

__all__ = ["ExecutorProcess"]

log = logging.getLogger(__name__)

_CONTROL = "control"
_DATA = "data"


class _SocketOutbox:
    def __init__(self, loop: SocketLoop):
        self._loop = loop

    def to_controller(self, envelope, payload=()):
        self._loop.send(_CONTROL, encode(envelope, payload))

    def to_client(self, identity, envelope, payload=()):
        self._loop.send(_DATA, [identity, *encode(envelope, payload)])

    def to_peer(self, address, envelope, payload=()):
        frames = encode(envelope, payload)

        def send():
            key = f"peer:{address}"
            if self._loop.socket(key) is None:
                socket = self._loop.context.socket(zmq.DEALER)
                socket.setsockopt(zmq.LINGER, 0)
                socket.connect(address)
                self._loop.add_socket(key, socket, None)
            self._loop.send_now(key, frames)

        self._loop.call_soon(send)


class ExecutorProcess:
    """Runs one executor until the controller says stop, goes silent, or the parent dies."""

    def __init__(self, config: ExecutorConfig):
        self.config = config
        self.loop = SocketLoop(f"executor-{config.executor_id}")
        self.backend = make_backend(config.backend, config.device)
        trace = TraceRecorder(config.max_trace_events)
        self.compiler = CompileCache(self.backend, trace, post=self.loop.call_soon)
        self.collectives = CollectiveRuntime(config.bind_host)
        from pathways_torch.wire import collective_ops

        collective_ops.set_runtime(self.collectives)
        self.core = ExecutorCore(executor_id=config.executor_id, backend=self.backend,
                                 outbox=_SocketOutbox(self.loop), submit=self._submit, trace=trace,
                                 compiler=self.compiler, collectives=self.collectives)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._last_heard = time.monotonic()
        self._exit_reason = ""
        self.data_address = self._bind_data()
        self._connect_control()

    # ------------------------------------------------------------ sockets

    def _bind_data(self) -> str:
        socket = self.loop.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(f"tcp://{self.config.bind_host}:0")
        self.loop.add_socket(_DATA, socket, self._on_data)
        return socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def _connect_control(self) -> None:
        socket = self.loop.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IDENTITY, self.config.executor_id.encode())
        socket.connect(self.config.controller_address)
        self.loop.add_socket(_CONTROL, socket, self._on_control)

    def _on_control(self, frames) -> None:
        self._last_heard = time.monotonic()
        try:
            envelope, payload = decode(frames)
        except FramingError as exc:
            self.core._drop(str(exc))
            return
        self.core.on_control(envelope, payload)
        if self.core.stopped:
            self._stop("the controller asked")

    def _on_data(self, frames) -> None:
        if len(frames) < 2:
            self.core._drop("data message without identity and envelope")
            return
        try:
            envelope, payload = decode(frames[1:])
            self.core.on_data(frames[0].bytes, envelope, payload)
        except (FramingError, ValueError) as exc:
            self.core._drop(str(exc))

    # ------------------------------------------------------------ compute thread

    def _submit(self, job: ComputeJob) -> None:
        self._jobs.put(job)

    def _compute_loop(self) -> None:
        import torch

        torch.set_num_threads(self.config.num_threads)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self.core.compute(job)
            self.loop.call_soon(lambda job=job: self.core.job_finished(job))

    # ------------------------------------------------------------ liveness

    def _watch(self) -> None:
        """Heartbeats on their own thread, so a long computation never looks like death."""
        interval = self.config.heartbeat_interval_s
        while not self.loop._stopping:
            time.sleep(interval)
            if self.config.parent_pid and not _alive(self.config.parent_pid):
                self._exit(f"parent process {self.config.parent_pid} is gone")
            silent_s = time.monotonic() - self._last_heard
            if silent_s > self.config.heartbeat_timeout_s:
                self._exit(f"no word from the controller for {silent_s:.1f} s")
            self.loop.send(_CONTROL, encode(pb.Envelope(heartbeat=pb.Heartbeat(sent_at=time.time()))))

    def _exit(self, reason: str) -> None:
        log.warning("executor %s exits: %s", self.config.executor_id, reason)
        os._exit(3)

    def _stop(self, reason: str) -> None:
        self._exit_reason = reason
        self._jobs.put(None)
        self.compiler.stop()
        self.loop.stop()

    # ------------------------------------------------------------ main

    def run(self) -> None:
        register = pb.Register(executor_id=self.config.executor_id, data_address=self.data_address,
                               device=self.backend.device, backend=self.config.backend, pid=os.getpid(),
                               store_bytes=self.core.store.bytes)
        self.loop.send(_CONTROL, encode(pb.Envelope(register=register)))
        threading.Thread(target=self._compute_loop, name="pathways-compute", daemon=True).start()
        threading.Thread(target=self._watch, name="pathways-heartbeat", daemon=True).start()
        self.loop.run_forever()
        log.info("executor %s stopped: %s", self.config.executor_id, self._exit_reason)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie parent is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True
