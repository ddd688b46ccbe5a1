"""Executors forked from the client's fork server (pathways_torch/local/fork_server.py) behave as processes
started with Popen: their pid, their exit status (a SIGKILL reads as -9), and ``PATHWAYS_FORK_SERVER=0`` starts
them with Popen instead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

import pathways_torch as pw
from pathways_torch.local.fork_server import ForkedProcess
from tests.conftest import REPO_ROOT
from tests.handles import cluster_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_forked_executor_computes_and_its_sigkill_reads_as_popens_returncode():
    with pw.Context(num_executors=2, backend="eager") as ctx:
        processes = cluster_of(ctx).processes
        assert all(isinstance(p, ForkedProcess) for p in processes), processes
        x = ctx.put(torch.arange(4.0), ctx.mesh({"data": 2}), [pw.Shard(0)])
        assert torch.equal(pw.function(lambda a: a * 2, name="double")(x).result(60), torch.arange(4.0) * 2)
        victim = processes[1]
        assert victim.poll() is None
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(30) == -signal.SIGKILL


def test_pathways_fork_server_0_starts_executors_with_popen():
    script = ("import torch, pathways_torch as pw\n"
              "from tests.handles import cluster_of\n"
              "with pw.Context(num_executors=1, backend='eager') as ctx:\n"
              "    x = ctx.put(torch.ones(2), ctx.mesh({'data': 1}), [pw.Replicate()])\n"
              "    print(type(cluster_of(ctx).processes[0]).__name__, pw.function(lambda a: a + 1, name='inc')(x)"
              ".result(60).tolist())\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100,
                            cwd=REPO_ROOT, env=dict(os.environ, PATHWAYS_FORK_SERVER="0", PYTHONPATH=REPO_ROOT))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[0] == "Popen [2.0, 2.0]", result.stdout


def test_an_eager_client_forks_from_a_server_without_jax_and_an_xla_context_gets_one_with_it():
    """jax is 1.5 s of a server's start; only the XLA route's executors use it."""
    script = ("import torch, pathways_torch as pw\n"
              "from tests.handles import cluster_of\n"
              "def jax_mapped(ctx):\n"
              "    server = cluster_of(ctx).processes[0]._forks._process.pid\n"
              "    return 'jaxlib' in open(f'/proc/{server}/maps').read()\n"
              "with pw.Context(num_executors=1, backend='eager') as ctx:\n"
              "    print('eager', jax_mapped(ctx))\n"
              "with pw.Context(num_executors=1, backend='xla') as ctx:\n"
              "    print('xla', jax_mapped(ctx))\n"
              "with pw.Context(num_executors=1, backend='eager') as ctx:\n"
              "    print('eager again', jax_mapped(ctx))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100,
                            cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert result.returncode == 0, result.stderr[-3000:]
    # The eager contexts' server never imported jax (the second eager context reuses it: tests/unit/
    # test_fork_server_choice.py); the XLA context got a server of its own that did.
    assert result.stdout.splitlines() == ["eager False", "xla True", "eager again False"], result.stdout
