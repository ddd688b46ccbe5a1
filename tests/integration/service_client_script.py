"""A remote client process for tests/integration/test_service.py: holds arrays and queued work, then waits to be
killed. ``python service_client_script.py ADDRESS KEYS``."""

import sys
import time

import torch

import pathways_torch as pw

address, keys = sys.argv[1], sys.argv[2]
with pw.Context(controller=address, keys=keys, backend="eager", heartbeat_interval_s=0.2,
                heartbeat_timeout_s=2.0) as ctx:
    mesh = ctx.mesh({"data": 2}, executors=[0, 1])
    held = [ctx.put(torch.full((1024, 256), float(i)), mesh, [pw.Shard(0)]) for i in range(4)]   # 1 MiB each

    @pw.function
    def grow(a):
        return a * 2

    outs = [grow(h) for h in held]
    assert outs[-1].result(timeout_s=60)[0, 0].item() == 6.0
    print("READY", flush=True)
    time.sleep(300)
