"""pw.load_checkpoint: a trainer's checkpoint into a plain eager nn.Module and torch.optim optimizer, after which
eager training goes on with the losses of an uninterrupted run; one that does not match is refused, listing
what differs; an executors' checkpoint whose pieces do not add up is refused, naming the file and the sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import pathways_torch as pw
from pathways_torch.training.checkpoint import write_checkpoint

pytestmark = pytest.mark.timeout(60)


def _model(width: int = 8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.Tanh(), nn.Linear(width, 1)).double()


def _batches(count: int):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(16, 4, generator=g, dtype=torch.float64), torch.randn(16, 1, generator=g, dtype=torch.float64))
            for _ in range(count)]


def _train(model, optimizer, batches) -> list[float]:
    from tests.conftest import train_eagerly

    return train_eagerly(model, optimizer, batches, nn.MSELoss())


def _save_like_a_trainer(path, model, optimizer, step: int, kind: str) -> None:
    """The trainer's format, written from eager state (what trainer.save writes from the executors)."""
    tensors = {f"model/{n}": t.detach().clone() for n, t in model.state_dict().items()}
    params = dict(model.named_parameters())
    for name, p in params.items():
        for state, value in optimizer.state[p].items():
            if state != "step":
                tensors[f"optimizer/{name}/{state}"] = value.clone()
    tensors["rng/torch"] = torch.get_rng_state()
    write_checkpoint(str(path), tensors, {"step": step, "samples_seen": 0, "seed": 0, "optimizer": kind,
                                          "plan": "DataParallel", "data_position": {}})


def _save_like_executors(path, model, optimizer, step: int, kind: str, num_shards: int = 3) -> None:
    """The executors' format (`sharded_checkpoint`) from eager state, as ``num_shards`` executors of a sharded plan
    write it: each bucket's flat padded to a multiple of ``num_shards``, one slice per executor's file."""
    import json
    import os

    from safetensors.torch import save_file

    from pathways_torch.training.buckets import flatten, make_buckets
    from pathways_torch.training.optimizers import read_optimizer
    from pathways_torch.training.sharded_checkpoint import FORMAT, INDEX

    os.makedirs(path, exist_ok=True)
    buckets, _ = make_buckets(model, optimizer)
    params = dict(model.named_parameters())
    files: list[dict] = [{} for _ in range(num_shards)]
    entries = []
    for b, bucket in enumerate(buckets):
        padded = bucket.padded_numel(num_shards)
        each = padded // num_shards
        arrays = {}
        for state in ("param", *read_optimizer(optimizer).state_names):
            named = {s.name: params[s.name].detach() if state == "param" else optimizer.state[params[s.name]][state]
                     for s in bucket.slots}
            flat = flatten(bucket, named, padded)
            for i in range(num_shards):
                files[i][f"bucket{b}/{state}"] = flat[i * each:(i + 1) * each].clone()
            arrays[state] = [{"file": f"executor-{i}.safetensors", "tensor": f"bucket{b}/{state}"}
                             for i in range(num_shards)]
        entries.append({"group": bucket.group, "dtype": str(bucket.dtype).removeprefix("torch."),
                        "numel": bucket.numel, "arrays": arrays,
                        "slots": [[s.name, list(s.shape), s.offset, s.numel] for s in bucket.slots]})
    whole = {}
    for name, buffer in model.named_buffers():
        files[0][f"whole/{name}"] = buffer.clone()
        whole[f"model/{name}"] = {"file": "executor-0.safetensors", "tensor": f"whole/{name}"}
    for i, tensors in enumerate(files):
        save_file(tensors, os.path.join(path, f"executor-{i}.safetensors"))
    save_file({"rng/torch": torch.get_rng_state()}, os.path.join(path, "client.safetensors"))
    meta = {"step": step, "samples_seen": 0, "seed": 0, "optimizer": kind, "plan": "ShardedDataParallel",
            "data_position": {}}
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"format": FORMAT, "buckets": entries, "whole": whole, "client": "client.safetensors",
                   "meta": meta}, f)


@pytest.mark.parametrize("save", [_save_like_a_trainer, _save_like_executors], ids=["client", "executors"])
@pytest.mark.parametrize("make_optimizer,kind", [
    (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01), "adam"),
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), "sgd")], ids=["adamw", "sgd-momentum"])
def test_eager_training_goes_on_as_if_never_interrupted(tmp_path, make_optimizer, kind, save):
    batches = _batches(6)
    whole = _model()
    expected = _train(whole, make_optimizer(whole), batches)
    first = _model()
    optimizer = make_optimizer(first)
    _train(first, optimizer, batches[:3])
    save(tmp_path, first, optimizer, 3, kind)
    resumed = _model()           # the initial weights: only the checkpoint makes it equal the trained one
    resumed_optimizer = make_optimizer(resumed)
    meta = pw.load_checkpoint(str(tmp_path), resumed, resumed_optimizer)
    assert meta["step"] == 3
    assert _train(resumed, resumed_optimizer, batches[3:]) == pytest.approx(expected[3:], abs=1e-12)


def test_a_checkpoint_that_does_not_match_lists_what_differs(tmp_path):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, _batches(1))
    _save_like_a_trainer(tmp_path, model, optimizer, 1, "adam")
    wider = _model(width=16)
    with pytest.raises(ValueError, match=r"other shapes \[model/0.bias: checkpoint \[8\], here \[16\]"):
        pw.load_checkpoint(str(tmp_path), wider, torch.optim.AdamW(wider.parameters()))
    deeper = nn.Sequential(*_model(), nn.Linear(1, 1).double())
    with pytest.raises(ValueError, match=r"missing \[model/4.bias, model/4.weight, optimizer/4.bias/exp_avg"):
        pw.load_checkpoint(str(tmp_path), deeper, torch.optim.AdamW(deeper.parameters()))
    shallower = nn.Sequential(*list(_model())[:3])
    with pytest.raises(ValueError, match=r"unexpected \[model/3.bias, model/3.weight"):
        pw.load_checkpoint(str(tmp_path), shallower)
    with pytest.raises(ValueError, match="saved with a 'adam' optimizer, this one is 'sgd'"):
        pw.load_checkpoint(str(tmp_path), _model(), torch.optim.SGD(_model().parameters(), lr=0.1))
    assert pw.load_checkpoint(str(tmp_path), _model())["step"] == 1     # the model alone, without an optimizer


def test_an_executors_checkpoint_whose_pieces_do_not_add_up_is_refused_and_nothing_loaded(tmp_path):
    """A bucket of 65 elements over 3 executors is padded to 66, 22 per file; one file cut to 21 (a save that
    mixed two runs, a file truncated) used to load silently as shifted values."""
    from safetensors.torch import load_file, save_file

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, _batches(1))
    _save_like_executors(tmp_path, model, optimizer, 1, "adam")
    piece = str(tmp_path / "executor-1.safetensors")
    tensors = load_file(piece)
    tensors["bucket0/param"] = tensors["bucket0/param"][:-1].clone()
    save_file(tensors, piece)
    fresh = _model()
    before = {n: t.clone() for n, t in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=r"bucket 0 'param' has 65 elements, padded to 66 over 3 piece\(s\) of 22, "
                                         r"but its pieces hold 65 in all: executor-1.safetensors holds 21"):
        pw.load_checkpoint(str(tmp_path), fresh, torch.optim.AdamW(fresh.parameters()))
    assert all(torch.equal(before[n], t) for n, t in fresh.state_dict().items())
