"""Which fork server an executor comes from (pathways_torch/local/fork_server.py): one without jax for eager and
inductor executors until one with jax runs, which serves every backend; ``PATHWAYS_FORK_SERVER=0``: none."""

from __future__ import annotations

import pytest

from pathways_torch.local import fork_server as forks

pytestmark = pytest.mark.timeout(30)


class _FakeServer:
    def __init__(self, environ, with_jax):
        self.with_jax, self.alive = with_jax, True

    def close(self):
        self.alive = False


@pytest.fixture
def servers(monkeypatch):
    monkeypatch.setattr(forks, "ForkServer", _FakeServer)
    monkeypatch.setattr(forks, "_servers", {})
    monkeypatch.delenv("PATHWAYS_FORK_SERVER", raising=False)
    return forks._servers


def test_eager_alone_never_starts_a_server_with_jax(servers):
    first = forks.fork_server({}, with_jax=False)
    assert first.with_jax is False and forks.fork_server({}, with_jax=False) is first
    assert list(servers) == [False]


def test_a_server_with_jax_serves_eager_executors_too(servers):
    eager = forks.fork_server({}, with_jax=False)
    xla = forks.fork_server({}, with_jax=True)
    assert xla.with_jax and xla is not eager
    assert forks.fork_server({}, with_jax=False) is eager       # the running one without jax is kept
    eager.alive = False
    assert forks.fork_server({}, with_jax=False) is xla         # gone: the one with jax serves


def test_a_dead_server_is_started_again_and_the_switch_turns_them_off(servers, monkeypatch):
    xla = forks.fork_server({}, with_jax=True)
    xla.alive = False
    assert forks.fork_server({}, with_jax=True) is not xla
    monkeypatch.setenv("PATHWAYS_FORK_SERVER", "0")
    assert forks.fork_server({}, with_jax=True) is None
