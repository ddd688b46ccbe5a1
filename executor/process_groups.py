"""Process groups made: gloo (its device bound to one interface) and NCCL, from a rendezvous store given or from a
FileStore (the benchmarks' baselines make theirs here too, so both sides of a comparison use the same gloo). Their
use on an executor (bound per mesh axis, abandoned after a fault) is `executor.collectives`."""

from __future__ import annotations

import datetime

__all__ = ["make_gloo_group", "gloo_group_on", "make_nccl_group", "nccl_group_on"]


def make_gloo_group(store_path: str, prefix: str, rank: int, size: int, timeout_s: float,
                    bind_host: str = "127.0.0.1"):
    """A gloo group from a FileStore (no TCPStore, no world group), its device bound to ``bind_host``.

    Blocks until all ``size`` members have joined (or ``timeout_s``). The benchmarks'
    baselines make their groups here too, so both sides of a comparison use the same gloo.
    """
    import torch.distributed as dist

    return gloo_group_on(dist.PrefixStore(prefix, dist.FileStore(store_path, size)), rank, size, timeout_s,
                         bind_host)


def gloo_group_on(store, rank: int, size: int, timeout_s: float, bind_host: str = "127.0.0.1"):
    """A gloo group meeting through ``store`` (a ``torch.distributed.Store``), its device bound to ``bind_host``."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def make_nccl_group(store_path: str, prefix: str, rank: int, size: int, timeout_s: float, device: str):
    """An NCCL group for executors on CUDA devices, from the same FileStore rendezvous as gloo.

    ``device`` (``cuda:N``) becomes the current device first: NCCL binds a communicator
    to it. Untested on this project's CI machines (no GPU); see docs/backends.md.
    """
    import torch.distributed as dist

    return nccl_group_on(dist.PrefixStore(prefix, dist.FileStore(store_path, size)), rank, size, timeout_s, device)


def nccl_group_on(store, rank: int, size: int, timeout_s: float, device: str):
    """An NCCL group meeting through ``store``, on ``device`` (made the current device first)."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(torch.device(device))
    return dist.ProcessGroupNCCL(store, rank, size, datetime.timedelta(seconds=timeout_s))   # default options
