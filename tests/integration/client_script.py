"""A client process for the lifecycle tests: prints its executors' pids, then ends as told."""

import faulthandler
import os
import signal
import sys
import time

import torch

import pathways_torch as pw

faulthandler.register(signal.SIGUSR1, all_threads=True)   # a test that waits too long dumps where we are
how = sys.argv[1]
with pw.Context(num_executors=2, backend="eager", heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0) as ctx:
    mesh = ctx.mesh({"data": 2})
    x = ctx.put(torch.ones(4), mesh, [pw.Shard(0)])
    assert x.result(timeout_s=30).sum().item() == 4
    print("PIDS", " ".join(map(str, ctx.executor_pids)), flush=True)
    if how == "exception":
        raise RuntimeError("the user's code failed")
    if how in ("sigint", "sigkill"):
        print("READY", flush=True)
        time.sleep(120)
print("EXITED CLEANLY", os.getpid(), flush=True)
