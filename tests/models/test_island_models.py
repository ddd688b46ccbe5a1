"""Model code written elsewhere trains across two islands as in eager PyTorch: ``DataParallel(("island", "data"))``
with the step cut per gradient bucket (small buckets, so that each model's backward is cut in several
places), on the default backend, against the single-process oracle (DDP's, for
BatchNorm's per-shard statistics)."""

from __future__ import annotations

import pytest

import pathways_torch as pw
from tests.models.cases import CASES, ddp_oracle, eager_oracle
from tests.models.test_conformance import _adamw, _relative

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# On the default backend: a transformers model (GPT-2, its tied head a parameter two buckets read), the nanoGPT-style
# GPT, the ResNet with BatchNorm (DDP's per-shard statistics) and the frozen parameter with a buffer. Llama and
# nn.TransformerEncoder are left to tests/models/test_conformance.py (the same plans on one island): the cut per
# bucket is the same code for them. Eager executors train across islands in tests/integration/test_islands.py (the
# same bucket cut, the same link). SyncBatchNorm is refused across islands (below).
ISLAND_CASES = [c for c in CASES if c.name in ("hf-gpt2", "nanogpt", "resnet-batchnorm", "frozen-and-buffer")]


@pytest.fixture(scope="module")
def ctx():
    with pw.Context(islands=[1, 1]) as ctx:
        yield ctx


@pytest.mark.parametrize("case", ISLAND_CASES, ids=[c.name for c in ISLAND_CASES])
def test_trains_like_the_oracle_across_two_islands(ctx, case):
    expected_losses, expected_params = (ddp_oracle(case, _adamw, 2) if case.ddp_buffers else
                                        eager_oracle(case, _adamw))
    model = case.make_model()
    quarter_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 4 / 2**20   # about 4 buckets
    trainer = ctx.wrap(model, optimizer=_adamw(model), loss_fn=case.loss_fn, mesh=ctx.mesh({"island": 2, "data": 1}),
                       plan=pw.DataParallel(("island", "data"), bucket_mb=quarter_mb))
    losses = [loss.result(240).item() for loss in [trainer.step(b) for b in case.batches()]]
    assert len(trainer.runner.bucket_cut.segments) == len(trainer.layout.buckets) >= 2, str(trainer.runner.bucket_cut)
    assert _relative(losses, expected_losses) < case.tolerance, (ctx.backend, losses, expected_losses)
    state = trainer.state_dict()["model"]
    for name, value in expected_params.items():
        assert _relative(state[name], value) < case.tolerance, (ctx.backend, name)
    outside = {k: v for k, v in ctx.backend_counters("fallback_ops").items() if k.startswith("island_grads") and v}
    assert not outside, outside


def test_sync_batchnorm_across_islands_is_refused(ctx):
    case = next(c for c in CASES if c.name == "resnet-syncbatchnorm")
    model = case.make_model()
    with pytest.raises(pw.PlacementError, match=r"SyncBatchNorm .*one island only.*nn.BatchNorm"):
        ctx.wrap(model, optimizer=_adamw(model), loss_fn=case.loss_fn, mesh=ctx.mesh({"island": 2, "data": 1}),
                 plan=pw.DataParallel(("island", "data")))
