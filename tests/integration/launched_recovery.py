"""The script a launch test starts with pathways-run (not a test): trains a small MLP with dropout twice on the
launched executors, unbroken and with a checkpoint every 2 steps, killing (or stopping: argv[3]) executor-1 (on node
1) after step 3 of the second run; prints one JSON record: both loss lists, the trainer's stats and each executor's epoch."""

import json, os, signal, sys, torch, torch.nn as nn
import pathways_torch as pw

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests.handles
from tests.handles import controller_of  # noqa: E402

steps, directory = int(sys.argv[1]), sys.argv[2]
fault = getattr(signal, sys.argv[3] if len(sys.argv) > 3 else "SIGKILL")
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 1, generator=g, dtype=torch.float64))
           for _ in range(steps)]


def trainer(ctx, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 1)).double()
    return ctx.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.MSELoss(),
                    mesh=ctx.mesh({"data": len(ctx.executor_ids)}), **options)


with pw.Context() as ctx:
    unbroken = trainer(ctx)
    expected = [loss.result(120).item() for loss in [unbroken.step(b) for b in batches]]
    recovering = trainer(ctx, checkpoint_dir=directory, checkpoint_every=2, replacement_timeout_s=120)
    victim = controller_of(ctx).resources.executors["executor-1"].pid
    losses = []
    for index, batch in enumerate(batches):
        losses.append(recovering.step(batch))
        if index == 3:
            losses[-1].result(120)
            os.kill(victim, fault)
    print(json.dumps({"expected": expected, "losses": [loss.result(120).item() for loss in losses],
                      "stats": recovering.stats(), "victim": victim,
                      "epochs": {i.executor_id: i.epoch for i in controller_of(ctx).resources.ordered()},
                      "pids": {i.executor_id: i.pid for i in controller_of(ctx).resources.ordered()}}), flush=True)
