"""``trainer.evaluate`` and ``trainer.predict`` (issue 14): on the parameters where they live, in eval mode.

Against eager: the loss and the outputs of the same model in ``eval()`` under
``no_grad``, fresh and after training (BatchNorm on its running statistics, dropout
off); captured once per shape; only the batch crosses to the executors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import pathways_torch as pw
from tests.models.cases import NanoGPT, ResidualCNN, _gpt2, _image_batches, _next_token_batches

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ctx():
    with pw.Context(num_executors=2) as ctx:      # the default backend
        yield ctx


def _eager_eval(model, fn):
    model = copy.deepcopy(model).eval()
    with torch.no_grad():
        return fn(model)


def test_evaluate_and_predict_match_eager_eval_after_training(ctx):
    torch.manual_seed(0)
    model = ResidualCNN().double()
    trainer = ctx.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy,
                       mesh=ctx.mesh({"data": 2}))
    batches = _image_batches()
    for batch in batches:
        trainer.step(batch)
    images, labels = batches[0]
    trained = copy.deepcopy(model)
    trained.load_state_dict(trainer.state_dict()["model"])   # the parameters and running statistics now
    expected_loss = _eager_eval(trained, lambda m: F.cross_entropy(m(images), labels)).item()
    expected_logits = _eager_eval(trained, lambda m: m(images))
    sent = ctx.stats()["hops"]["client->executor"]
    loss = trainer.evaluate((images, labels))
    logits = trainer.predict(images)
    assert isinstance(logits, pw.Array) and logits.shape == expected_logits.shape
    assert loss.result(120).item() == pytest.approx(expected_loss, rel=1e-12)
    torch.testing.assert_close(logits.result(120), expected_logits, rtol=1e-12, atol=1e-12)
    batch_bytes = 2 * images.nbytes + labels.nbytes          # the batch twice, the labels once: no parameters
    assert ctx.stats()["hops"]["client->executor"] - sent == batch_bytes
    for _ in range(2):
        trainer.evaluate((images, labels))
    assert trainer.runner.forwards["loss"].num_traces == 1 and trainer.runner.forwards["predict"].num_traces == 1
    # Evaluation changed nothing: the next step still matches a model trained without it.
    assert torch.equal(trainer.state_dict()["model"]["bn1.running_mean"], trained.bn1.running_mean)


def test_dropout_is_off_and_outputs_keep_their_structure(ctx):
    torch.manual_seed(0)
    model = NanoGPT().double()
    for module in model.modules():            # a model with dropout, in training mode
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, i, out: F.dropout(out, 0.5, m.training))
    trainer = ctx.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), mesh=ctx.mesh({"data": 2}))
    ids, targets = _next_token_batches()[0]
    expected = _eager_eval(model, lambda m: m(ids, targets))
    logits, loss = trainer.predict((ids, targets))             # (logits, loss): a tuple of arrays, as returned
    torch.testing.assert_close(logits.result(120), expected[0], rtol=1e-12, atol=1e-12)
    per_shard = [_eager_eval(model, lambda m, rows=rows: m(ids[rows], targets[rows])[1])
                 for rows in (slice(0, 2), slice(2, 4))]
    torch.testing.assert_close(loss.result(120), torch.stack(per_shard), rtol=1e-12, atol=1e-12)   # 0-d: stacked
    first, second = trainer.evaluate((ids, targets)), trainer.evaluate((ids, targets))
    assert first.result(120).item() == second.result(120).item()   # no dropout: deterministic
    assert model.training                                          # the user's mode is left as it was


def test_predict_returns_a_transformers_output(ctx):
    model = _gpt2()
    trainer = ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters()), mesh=ctx.mesh({"data": 2}))
    ids = _next_token_batches()[0][0]
    output = trainer.predict({"input_ids": ids})
    expected = _eager_eval(model, lambda m: m(input_ids=ids).logits)
    torch.testing.assert_close(output.logits.result(120), expected, rtol=1e-4, atol=1e-4)
