"""Tensor parallelism on eager executors: every mesh of every case, checkpoints that reshard, recovery.

The float64 runs of test_tensor_parallel.py on ``{model: 2}``, ``{data: 2, model: 2}`` and the pipeline's
``{pipe: 2, data: 1, model: 2}``; evaluate and predict on the split parameters; a checkpoint saved under
TP x sharded data parallelism loads under ``{data: 4}``, ``{model: 4}``, TP x DP, a pipeline of TP stages
``{pipe: 2, model: 2}`` and into eager PyTorch, each going on with the losses of an uninterrupted run (and one
saved by that pipeline loads under ``{data: 4}``); a SIGKILLed executor under TP, and under a pipeline of TP
stages, is replaced and the run goes on with exactly the losses of an unbroken one.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

import pathways_torch as pw
from tests.integration.test_tensor_parallel import (CASE, HF_FLOAT64, MESHES, NAMES, PIPELINE_NAMES, _adamw,
                                                    _gpt2_batches, _loss, _oracle, _relative, _tensor_parallel, _train,
                                                    check_trains_like_eager_in_float64)
from tests.unit.test_tensor_parallel import _llama_sequence_parallel_plan

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ctx():
    with pw.Context(num_executors=4, backend="eager") as ctx:
        yield ctx


@pytest.mark.parametrize("name, mesh", [(n, m) for m in sorted(MESHES) for n in NAMES
                                        if "pipe" not in MESHES[m] or n in PIPELINE_NAMES])
def test_the_proposed_plan_trains_like_eager_in_float64(ctx, name, mesh):
    check_trains_like_eager_in_float64(ctx, name, mesh)


def test_a_checkpoint_saved_under_one_mesh_loads_under_others_and_into_eager(ctx, tmp_path):
    case = CASE["hf-gpt2"]

    def make_model():
        return case.make_model().double()
    batches = _gpt2_batches(6)
    expected, _ = _oracle(make_model, batches, None)
    model = make_model()
    saver = ctx.wrap(model, optimizer=_adamw(model), mesh=ctx.mesh(MESHES["2x2"]),
                     plan=_tensor_parallel(model, MESHES["2x2"], data=pw.ShardedDataParallel("data")))
    first = [loss.result(240).item() for loss in [saver.step(b) for b in batches[:3]]]
    saver.save_sharded(str(tmp_path)).result(120)
    del saver
    assert _relative(first, expected[:3]) < HF_FLOAT64
    for mesh, plan in (({"data": 4}, pw.DataParallel("data")), ({"model": 4}, None),
                       ({"data": 2, "model": 2}, pw.ShardedDataParallel("data")), ({"pipe": 2, "model": 2}, None)):
        model = make_model()
        plan = plan if "model" not in mesh else _tensor_parallel(model, mesh, data=plan)
        trainer = ctx.wrap(model, optimizer=_adamw(model), mesh=ctx.mesh(mesh), plan=plan)
        assert trainer.load(str(tmp_path))["step"] == 3
        rest = [loss.result(240).item() for loss in [trainer.step(b) for b in batches[3:]]]
        assert _relative(rest, expected[3:]) < HF_FLOAT64, (mesh, rest, expected[3:])
        del trainer
    model = make_model()
    optimizer = _adamw(model)
    pw.load_checkpoint(str(tmp_path), model, optimizer)
    rest = []
    for batch in batches[3:]:
        optimizer.zero_grad()
        loss = _loss(model, None, batch)
        loss.backward()
        optimizer.step()
        rest.append(loss.item())
    assert _relative(rest, expected[3:]) < HF_FLOAT64


def test_a_checkpoint_saved_by_a_pipeline_of_tensor_parallel_stages_loads_under_data_parallelism(ctx, tmp_path):
    case = CASE["hf-llama"]

    def make_model():
        return case.make_model().double()
    batches = _gpt2_batches(5)
    expected, _ = _oracle(make_model, batches, None)
    model = make_model()
    mesh = {"pipe": 2, "model": 2}
    saver = ctx.wrap(model, optimizer=_adamw(model), mesh=ctx.mesh(mesh), plan=_tensor_parallel(model, mesh))
    first = [loss.result(240).item() for loss in [saver.step(b) for b in batches[:3]]]
    saver.save_sharded(str(tmp_path)).result(120)
    assert "Shard(0)" in str(saver.runner.placements)
    del saver
    model = make_model()
    trainer = ctx.wrap(model, optimizer=_adamw(model), mesh=ctx.mesh({"data": 4}), plan=pw.DataParallel("data"))
    assert trainer.load(str(tmp_path))["step"] == 3
    rest = [loss.result(240).item() for loss in [trainer.step(b) for b in batches[3:]]]
    assert _relative(first + rest, expected) < HF_FLOAT64, (first + rest, expected)


@pytest.mark.parametrize("mesh", ["2x2", "2x1x2"])
def test_a_lost_executor_under_tensor_parallelism_is_recovered_with_the_losses_of_an_unbroken_run(tmp_path, mesh):
    case = CASE["hf-gpt2"]
    batches = _gpt2_batches(9)
    with pw.Context(num_executors=4, backend="eager", heartbeat_timeout_s=2.0) as ctx:
        expected, _, _ = _train(ctx, case.make_model, batches, None, MESHES[mesh])
        model = case.make_model()
        trainer = ctx.wrap(model, optimizer=_adamw(model), mesh=ctx.mesh(MESHES[mesh]),
                           plan=_tensor_parallel(model, MESHES[mesh]), checkpoint_dir=str(tmp_path),
                           checkpoint_every=3)
        losses = [trainer.step(b) for b in batches[:5]]
        losses[-1].result(120)
        trainer._checkpoint.result(120)
        os.kill(ctx.executor_pids[3], signal.SIGKILL)       # model shard 1 of data shard 1, or of the last stage
        losses += [trainer.step(b) for b in batches[5:]]
        got = [loss.result(120).item() for loss in losses]
        assert trainer.stats()["recoveries"] == 1
    assert got == expected


def test_evaluate_and_predict_run_on_the_split_parameters(ctx):
    case = CASE["nanogpt"]
    model = case.make_model().double()
    reference = case.make_model().double()
    trainer = ctx.wrap(model, optimizer=_adamw(model), mesh=ctx.mesh(MESHES["2x2"]),
                       plan=_tensor_parallel(model, MESHES["2x2"]))
    batch = case.batches()[0]
    logits, loss = reference(*batch)
    assert abs(trainer.evaluate(batch).result(240).item() - loss.item()) < 1e-9 * abs(loss.item())
    predicted, _ = trainer.predict(batch)
    assert torch.allclose(predicted.result(240), logits.detach(), rtol=1e-9, atol=1e-12)


def test_evaluate_runs_on_a_pipeline_of_tensor_parallel_stages(ctx):
    case = CASE["nanogpt"]
    model = case.make_model().double()
    reference = case.make_model().double()
    trainer = ctx.wrap(model, optimizer=_adamw(model), mesh=ctx.mesh(MESHES["2x1x2"]),
                       plan=_tensor_parallel(model, MESHES["2x1x2"]))
    batch = case.batches()[0]
    _, loss = reference(*batch)
    assert abs(trainer.evaluate(batch).result(240).item() - loss.item()) < 1e-9 * abs(loss.item())


def test_a_sequence_parallel_plan_in_pipeline_stages_with_clipping_and_sharded_data_matches_eager(ctx):
    case = CASE["hf-llama"]

    def make_model():
        return case.make_model().double()
    expected_losses, expected = _oracle(make_model, case.batches(), None, max_grad_norm=0.05)
    model = make_model()
    plan = pw.Pipeline(microbatches=2, data=pw.ShardedDataParallel("data"),
                       tensor=pw.TensorParallel(_llama_sequence_parallel_plan()))
    trainer = ctx.wrap(model, optimizer=_adamw(model), mesh=ctx.mesh(MESHES["2x1x2"]), plan=plan, max_grad_norm=0.05)
    losses = [loss.result(240).item() for loss in [trainer.step(b) for b in case.batches()]]
    assert _relative(losses, expected_losses) < HF_FLOAT64
    state = trainer.state_dict()["model"]
    assert max(_relative(state[n], v) for n, v in expected.items()) < 1e-9     # clipping bounds the float32 loss
    assert "gradient summed over the axis" in str(trainer.runner.placements)
