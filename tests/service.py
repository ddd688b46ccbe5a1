"""A `pathways-controller` process for tests, and contexts of either kind: embedded, or a client of it.

The integration tests of the public API run against both `ControllerClient` implementations through one
parametrised fixture (`client_kind` and `open_context`): ``pw.Context(...)`` as usual, or the same options with
``controller=`` and ``keys=`` of a shared standalone controller (`shared_service` in conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading

from tests.conftest import REPO_ROOT

__all__ = ["ControllerProcess", "open_context", "client_fixture", "free_port", "CLIENT_KINDS"]

CLIENT_KINDS = ("embedded", "remote")
_READY = "pathways-controller: serving clients at "


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ControllerProcess:
    """``pathways-controller`` serving ``num_executors`` local executors, its keys in ``keys_dir``."""

    def __init__(self, keys_dir: str, *, clients=("alice", "bob", "carol"), num_executors: int = 4,
                 backend: str = "eager", args=(), timeout_s: float = 120.0, executor_keys: int | None = None,
                 status_port: bool = False):
        """``num_executors=0``: none started here; they join (keys for ``executor_keys`` of them). Clients'
        checkpoints go under ``checkpoint_root`` (``--checkpoint-root`` in ``args``; default: beside the keys, never
        the repository). ``status_port``: serve the status on a free loopback port, its address in ``status``."""
        self.keys_dir = keys_dir
        if status_port:
            port = free_port()
            self.status = f"127.0.0.1:{port}"
            args = ("--status-port", str(port), *args)
        if "--checkpoint-root" not in args:
            args = ("--checkpoint-root", os.path.abspath(keys_dir) + "-checkpoints", *args)
        self.checkpoint_root = os.path.abspath(args[list(args).index("--checkpoint-root") + 1])
        self._run(["--make-keys", keys_dir, "--clients", ",".join(clients), "--executors",
                   str(executor_keys or num_executors)])
        command = [sys.executable, "-m", "pathways_torch.launch.controller_main", "--keys-dir", keys_dir,
                   "--num-executors", str(num_executors), "--backend", backend, *args]
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        self.output: list[str] = []
        self.address = ""
        ready = threading.Event()

        def read() -> None:   # keep draining: a full pipe would stop the controller
            for line in self.process.stdout:
                self.output.append(line)
                if line.startswith(_READY):
                    words = line[len(_READY):].split()
                    self.address, self.executor_address = words[0], words[3]   # "ADDR executors at ADDR"
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout_s) or not self.address:
            self.stop()
            raise RuntimeError("pathways-controller did not start:\n" + "".join(self.output[-40:]))

    @staticmethod
    def _run(args) -> None:
        subprocess.run([sys.executable, "-m", "pathways_torch.launch.controller_main", *args], cwd=REPO_ROOT,
                       check=True, capture_output=True, text=True)

    def keys(self, client: str) -> str:
        return os.path.join(self.keys_dir, "clients", client)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


@contextlib.contextmanager
def open_context(kind: str, service: "ControllerProcess | None", client: str = "alice", **options):
    """A `pw.Context` with ``options``: embedded (``kind="embedded"``) or a client of ``service``."""
    import pathways_torch as pw

    if kind == "remote":
        options = {"controller": service.address, "keys": service.keys(client), **options}
    with pw.Context(**options) as context:
        yield context


def client_fixture(client: str, service: str, **options):
    """A module-scoped fixture: a remote context of ``client`` on the fixture named ``service``."""
    import pytest

    @pytest.fixture(scope="module")
    def fixture(request):
        with open_context("remote", request.getfixturevalue(service), client=client, **options) as context:
            yield context

    return fixture
