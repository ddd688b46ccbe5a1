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
    from pathways_torch.process_state import is_gone

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
