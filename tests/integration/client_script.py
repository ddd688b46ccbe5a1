"""A client process for the lifecycle tests: prints its executors' pids, then ends as told."""

import faulthandler
import os
import signal
import sys
import threading
import time

import torch

import pathways_torch as pw

faulthandler.register(signal.SIGUSR1, all_threads=True)   # a test that waits too long dumps where we are


def thread_names_taking_sigint() -> list[str]:
    """Our Python threads other than the main one that the kernel could hand Ctrl-C to (a main thread asleep
    would then sleep on). Threads of C libraries (OpenBLAS's, started by importing numpy) are not ours."""
    names = []
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.native_id is None:
            continue
        with open(f"/proc/self/task/{thread.native_id}/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        if not int(fields["SigBlk"], 16) >> (signal.SIGINT - 1) & 1:
            names.append(thread.name)
    return names


how = sys.argv[1]
with pw.Context(num_executors=2, backend="eager", heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0) as ctx:
    mesh = ctx.mesh({"data": 2})
    x = ctx.put(torch.ones(4), mesh, [pw.Shard(0)])
    assert x.result(timeout_s=30).sum().item() == 4
    print("PIDS", " ".join(map(str, ctx.executor_pids)), flush=True)
    if how == "exception":
        raise RuntimeError("the user's code failed")
    if how in ("sigint", "sigkill"):
        print("TAKE SIGINT", " ".join(thread_names_taking_sigint()), flush=True)
        print("READY", flush=True)
        # Short sleeps: a SIGINT that lands between the print and one long sleep's start is seen only when that
        # sleep ends (CPython checks for signals between bytecodes, and a sleep starts without looking)
        for _ in range(1200):
            time.sleep(0.1)
print("EXITED CLEANLY", os.getpid(), flush=True)
