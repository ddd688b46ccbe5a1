"""The script the launch tests start with pathways-run (not a test): trains a small MLP for ``steps`` steps with
``pause`` seconds between them, on every launched executor (``islands``: across the launch's two islands), and
prints one JSON record per line: the executors, each step, the losses, or the ExecutorLostError it met."""

import json, os, sys, time, torch, torch.nn as nn
import pathways_torch as pw

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests.handles
from tests.handles import controller_of  # noqa: E402

steps, pause = int(sys.argv[1]), float(sys.argv[2])
across_islands = len(sys.argv) > 3 and sys.argv[3] == "islands"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 1, generator=g, dtype=torch.float64))
           for _ in range(steps)]
# A test that stops a node sets a short heartbeat bound (the loss is declared within twice it; 10 s by default).
heartbeat = {"heartbeat_timeout_s": float(os.environ["LAUNCHED_HEARTBEAT_TIMEOUT_S"])} \
    if "LAUNCHED_HEARTBEAT_TIMEOUT_S" in os.environ else {}
with pw.Context(**heartbeat) as ctx:
    print(json.dumps({"executors": ctx.executor_ids, "backend": ctx.backend,
                      "torchrun_variables": [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if v in os.environ]}),
          flush=True)
    if across_islands:
        per = len(ctx.executor_ids) // 2
        mesh, plan = ctx.mesh({"island": 2, "data": per}), pw.DataParallel(("island", "data"))
    else:
        mesh, plan = ctx.mesh({"data": len(ctx.executor_ids)}), pw.DataParallel("data")
    trainer = ctx.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.MSELoss(),
                       mesh=mesh, plan=plan)
    losses = []
    try:
        for batch in batches:
            losses.append(trainer.step(batch).result(120).item())
            print(json.dumps({"step": len(losses)}), flush=True)
            time.sleep(pause)
    except pw.ExecutorLostError as exc:
        print(json.dumps({"lost": str(exc)}), flush=True)
        sys.exit(7)
    print(json.dumps({"losses": losses, "islands": sorted({i.island for i in controller_of(ctx).resources.ordered()}),
                      "groups": len(controller_of(ctx).groups.by_members),
                      "store_requests": controller_of(ctx).rendezvous.requests_served}), flush=True)
