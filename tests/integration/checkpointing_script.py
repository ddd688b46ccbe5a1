"""Trains and writes a checkpoint from the executors every step, until killed (not a test: the kill-during-save
test starts it). ``python checkpointing_script.py DIR``; prints ``saving N`` as each save starts."""

import sys

import torch
import torch.nn as nn

import pathways_torch as pw

directory = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(*[layer for _ in range(3) for layer in (nn.Linear(512, 512), nn.Tanh())],
                      nn.Linear(512, 1)).double()
batch = (torch.randn(8, 512, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64))
with pw.Context(num_executors=2, backend="eager") as ctx:
    trainer = ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=nn.MSELoss(),
                       mesh=ctx.mesh({"data": 2}), checkpoint_dir=directory, checkpoint_every=1)
    while True:
        trainer.step(batch).result(120)
        print(f"saving {trainer.step_count}", flush=True)
