"""Shared test helpers."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time

# Compiled XLA executables persist between runs (PATHWAYS_CACHE_DIR): tests get a cache of their own,
# empty at the start, so a compile measured or awaited in a test is a real one. Executors inherit it.
if "PATHWAYS_CACHE_DIR" not in os.environ:
    os.environ["PATHWAYS_CACHE_DIR"] = tempfile.mkdtemp(prefix="pathways-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PATHWAYS_CACHE_DIR"], True)


def dev_shm_names() -> set[str]:
    """What is named in /dev/shm, but multiprocessing's own semaphores (``sem.mp-*``: a test's queues, maybe on
    another worker, while it runs): executors' shared memory is memfds, never named there."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {name for name in names if not name.startswith("sem.mp-")}


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passes; return its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return bool(value)
        time.sleep(interval_s)


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (a zombie counts as gone)."""
    from pathways_torch.wire.process_state import is_gone

    return is_gone(pid)


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_eagerly(model, optimizer, batches, loss_fn, max_grad_norm: float | None = None) -> list[float]:
    """The correctness oracle for training: ``model`` trained in this process, op by op; the losses."""
    import torch

    losses = []
    for *inputs, target in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        losses.append(loss.item())
    return losses


def listening_tcp(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket that process ``pid`` listens on, IPv4 and IPv6, read from /proc
    (its socket inodes in /proc/PID/fd, their addresses in /proc/PID/net/tcp and tcp6)."""
    import ipaddress
    import sys

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:   # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)   # the header
            for fields in map(str.split, f):
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:   # 0A: LISTEN
                    continue
                address, port = local.split(":")
                raw = bytes.fromhex(address)
                if sys.byteorder == "little":   # the kernel prints each 32-bit word in host order
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found


def on_loopback(address: str) -> bool:
    """Whether ``address`` is on 127.0.0.0/8 or ::1 (an IPv4-mapped IPv6 address by its IPv4 one)."""
    import ipaddress

    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


# The slowest modules (seconds in a fresh-clone run, 2026-12-07): collected first, so that the two pytest workers
# (`--dist loadfile` hands out files in collection order) do not end with one of them alone on a long file.
SLOW_FIRST = ("integration/test_launch.py", "integration/test_train_example.py",
              "integration/test_dropout_awaiting.py", "models/test_pipeline_models.py", "integration/test_fault_leaks.py", "integration/test_tensor_parallel.py",
              "integration/test_pipeline_recovery.py", "integration/test_fuzz_service.py",
              "integration/test_tenant_flood.py", "integration/test_launch_tree.py", "integration/test_compile.py",
              "integration/test_runahead.py")


def _slow_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
    return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.remote_subset(n=(2,))``: of a sweep, the remote client runs only these parameters (it changes
    how calls travel, not what the executors compute: the whole sweep runs embedded). Deselected, not skipped.
    Then the slowest modules first (`SLOW_FIRST`), each module's tests in their own order."""
    items.sort(key=_slow_rank)   # stable: the order within a module, and of the rest, is kept
    kept, dropped = [], []
    for item in items:
        marker = item.get_closest_marker("remote_subset")
        params = getattr(getattr(item, "callspec", None), "params", {})
        if marker is not None and params.get("client_kind") == "remote" and any(
                params.get(name) not in allowed for name, allowed in marker.kwargs.items()):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_generate_tests(metafunc):
    """``client_kind``: run the test (and its module's fixtures) against the embedded controller and a remote one."""
    if "client_kind" in metafunc.fixturenames:
        from tests.service import CLIENT_KINDS

        metafunc.parametrize("client_kind", CLIENT_KINDS, scope="module")


try:
    import pytest
except ImportError:   # conftest is also imported by scripts that need only its helpers
    pytest = None

if pytest is not None:
    @pytest.fixture(scope="session")
    def shared_service(tmp_path_factory):
        """One `pathways-controller` with 4 eager executors, for every remote context of the run (started at the
        first test that needs it)."""
        from tests.service import ControllerProcess

        service = ControllerProcess(str(tmp_path_factory.mktemp("service") / "keys"))
        yield service
        service.stop()

    @pytest.fixture(scope="module")
    def service_if_remote(request, client_kind):
        """The shared service when ``client_kind`` is remote; None when embedded (nothing started)."""
        return request.getfixturevalue("shared_service") if client_kind == "remote" else None
