"""Local islands on real executors (eager): each executor registers with its island, meshes map island by
island, collectives stay inside an island (no process group spans two), and one across islands is refused
before anything is sent."""

from __future__ import annotations

import time

import pytest
import torch

import pathways_torch as pw
from tests.handles import controller_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ctx():
    with pw.Context(islands=[2, 2], backend="eager") as context:
        yield context


def test_executors_register_with_their_island(ctx):
    table = ctx.islands()
    assert [island.name for island in table] == ["0", "1"]
    assert [len(island.executors) for island in table] == [2, 2]
    assert str(table).splitlines()[0] == "2 islands; link between islands: ZeroMQ over loopback (one host)"
    resources = controller_of(ctx).resources
    assert {e: resources.island_of(e) for e in ctx.executor_ids} == {
        "executor-0": "0", "executor-1": "0", "executor-2": "1", "executor-3": "1"}
    # in the order of their ids, whichever registered first: meshes are the same run after run
    assert ctx.executor_ids == ["executor-0", "executor-1", "executor-2", "executor-3"]


def test_a_collective_inside_each_island_and_none_across(ctx):
    mesh = ctx.mesh({"island": 2, "data": 2})

    @pw.function(out={"island": pw.Shard(0)})
    def total(x):
        return pw.all_reduce(x, "data", "sum")

    x = ctx.put(torch.arange(4.0), mesh, {"island": pw.Shard(0), "data": pw.Shard(0)})
    # Each island sums its own two shards: [0+1] in island 0, [2+3] in island 1 (replicated on "data").
    blocks = total(x)
    assert blocks.shape == (2,) and torch.equal(blocks.result(), torch.tensor([1.0, 5.0]))
    resources = controller_of(ctx).resources
    for members in controller_of(ctx).groups.by_members:
        assert len({resources.island_of(e) for e in members}) == 1, members

    @pw.function(out=pw.Replicate())
    def across(x):
        return pw.all_reduce(x, "island", "sum")

    sent = dict(controller_of(ctx).messages_sent)
    with pytest.raises(pw.PlacementError, match=r"collective over axis 'island' would join executors of islands "
                                                r"\['0', '1'\]"):
        across(x)
    assert dict(controller_of(ctx).messages_sent) == sent        # refused before anything was sent


def test_a_mesh_that_does_not_fit_the_islands_is_refused(ctx):
    with pytest.raises(pw.PlacementError, match=r"needs 4 executors in one island"):
        ctx.mesh({"data": 4})
    with pytest.raises(pw.PlacementError, match=r"asks for 3 islands"):
        ctx.mesh({"island": 3, "data": 1})
    model = torch.nn.Linear(2, 1)
    with pytest.raises(pw.PlacementError, match=r"expected \('island', <data axis>\) on a mesh with exactly those"):
        ctx.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=torch.nn.MSELoss(),
                 mesh=ctx.mesh({"island": 2, "data": 2}), plan=pw.DataParallel(("data", "island")))


def test_each_island_has_its_own_sequencer(ctx):
    """Island 1's calls are dispatched and run while island 0's sequencer is held; island 0's wait for it."""
    import threading

    island0, island1 = ctx.mesh({"data": 2}, executors=["executor-0", "executor-1"]), ctx.mesh(
        {"data": 2}, executors=["executor-2", "executor-3"])

    @pw.function(out=pw.Replicate())
    def total(x):
        return pw.all_reduce(x, "data", "sum")

    x0 = ctx.put(torch.ones(2), island0, {"data": pw.Shard(0)})
    x1 = ctx.put(torch.ones(2), island1, {"data": pw.Shard(0)})
    results = {}
    with controller_of(ctx).sequencers.of("0").held():
        worker = threading.Thread(target=lambda: results.setdefault("0", total(x0).result(60)))
        worker.start()
        worker.join(1.0)
        assert worker.is_alive() and "0" not in results     # island 0 waits for its sequencer
        assert total(x1).result(60).item() == 2.0           # island 1 runs meanwhile
        assert "0" not in results
    worker.join(60)
    assert results["0"].item() == 2.0
    seq0 = controller_of(ctx).sequencers.of("0")
    seq1 = controller_of(ctx).sequencers.of("1")
    assert set(seq0.last_collective) <= {"executor-0", "executor-1"}
    assert set(seq1.last_collective) <= {"executor-2", "executor-3"}


def test_a_pipeline_across_islands_equals_eager(ctx):
    """2 islands x 2 stages each (4 stages), activations and gradients crossing between islands; float64."""
    import torch.nn as nn

    from tests.conftest import train_eagerly

    def blocks():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)],
                             nn.Linear(6, 3)).double()

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g,
                                                                                dtype=torch.float64))
               for _ in range(3)]
    reference = blocks()
    expected = train_eagerly(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches, nn.MSELoss())
    model = blocks()
    mesh = ctx.mesh({"island": 2, "pipe": 2})
    trainer = ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=nn.MSELoss(),
                       mesh=mesh, plan=pw.Pipeline(microbatches=4, schedule="1f1b"))
    losses = [loss.result(120).item() for loss in [trainer.step(b) for b in batches]]
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-9, (losses, expected)
    state = trainer.state_dict()["model"]
    assert max((state[n] - p.detach()).abs().max().item() for n, p in reference.state_dict().items()) < 1e-9
    resources = controller_of(ctx).resources
    assert [resources.island_of(m.executor_ids[0]) for m in trainer.runner.stage_meshes] == ["0", "0", "1", "1"]


@pytest.fixture(scope="module")
def shaped():
    with pw.Context(islands=[2, 1], backend="eager", link=pw.Link(delay_s=0.005, bandwidth_bytes_per_s=50e6)) as c:
        yield c


def test_transfers_between_islands_cross_the_shaped_link_and_in_island_ones_do_not(shaped, ctx):
    import torch.nn as nn

    from pathways_torch.local import netns
    from tests.conftest import train_eagerly

    described = str(shaped.islands()).splitlines()[0]
    assert "5 ms one-way" in described and "50 MB/s" in described, described
    if netns.tbf_unavailable() is None:       # root with iproute2 (CI): the kernel's tbf sets the rate
        assert shaped.link.shaping == "tbf", shaped.link.shaping_reason
        assert f"tbf on veth (namespace {shaped.link.veth.namespace}), 5 ms one-way (relay)" in described
    else:
        assert shaped.link.shaping == "relay" and "the relay's token bucket" in described
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g,
                                                                                dtype=torch.float64))
               for _ in range(3)]
    expected = train_eagerly(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches, nn.MSELoss())
    trainer = shaped.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.MSELoss(),
                          mesh=shaped.mesh({"island": 2, "pipe": 1}), plan=pw.Pipeline(microbatches=2))
    losses = [loss.result(120).item() for loss in [trainer.step(b) for b in batches]]
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-9
    # Per step, 2 microbatches send an activation (4 rows x 6 float64) forward and its gradient back.
    assert shaped.link.bytes_relayed >= 3 * 2 * 2 * 4 * 6 * 8
    # In the other context (no link) nothing is relayed; here, a copy inside one island is not either.
    trainer.state_dict()                     # the first stage's update read the last gradients: all arrived
    before = _settled(shaped.link)           # and their acknowledgements came back over the link
    here, there = (shaped.mesh({"data": 1}, executors=[e]) for e in ("executor-0", "executor-1"))
    x = shaped.put(torch.ones(3), here, {"data": pw.Replicate()})
    twice = pw.function(lambda t: t * 2).on(there)      # x moves executor-0 -> executor-1, inside island 0
    moved = shaped.stats()["hops"]["executor->executor"]
    assert torch.equal(twice(x).result(60), torch.full((3,), 2.0))
    assert shaped.stats()["hops"]["executor->executor"] > moved
    assert shaped.link.bytes_relayed == before
    assert ctx.link is None


def _settled(link, quiet_s: float = 0.3, timeout_s: float = 10.0) -> int:
    """The link's byte count once nothing crossed it for ``quiet_s`` (transfer acknowledgements cross it after
    the transfers they acknowledge)."""
    deadline = time.monotonic() + timeout_s
    count = link.bytes_relayed
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        if link.bytes_relayed == count:
            return count
        count = link.bytes_relayed
    return count


def _mlp():
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batches(count, rows):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 6, generator=g, dtype=torch.float64), torch.randn(rows, 3, generator=g,
                                                                                dtype=torch.float64))
            for _ in range(count)]


@pytest.mark.parametrize("plan,clip", [(pw.DataParallel(("island", "data")), None),
                                       (pw.ShardedDataParallel(("island", "data")), None),
                                       (pw.DataParallel(("island", "data")), 0.05),
                                       (pw.DataParallel(("island", "data"), bucket_mb=1e-4), None),
                                       (pw.ShardedDataParallel(("island", "data"), bucket_mb=1e-4), 0.05)],
                         ids=["dp", "sdp", "dp-clipped", "dp-4-buckets", "sdp-4-buckets-clipped"])
def test_data_parallel_across_islands_equals_eager(ctx, plan, clip):
    import torch.nn as nn

    from tests.conftest import train_eagerly

    batches = _batches(3, rows=8)
    reference = _mlp()
    expected = train_eagerly(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches, nn.MSELoss(),
                             max_grad_norm=clip)
    model = _mlp()
    trainer = ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=nn.MSELoss(),
                       mesh=ctx.mesh({"island": 2, "data": 2}), plan=plan, max_grad_norm=clip)
    losses = [loss.result(120).item() for loss in [trainer.step(b) for b in batches]]
    assert len(trainer.runner.bucket_cut.segments) == len(trainer.layout.buckets) == (4 if plan.bucket_mb < 1 else 1)
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-9, (losses, expected)
    state = trainer.state_dict()["model"]
    assert max((state[n] - p.detach()).abs().max().item() for n, p in reference.state_dict().items()) < 1e-9
    resources = controller_of(ctx).resources
    for members in controller_of(ctx).groups.by_members:       # the reductions stayed inside each island
        assert len({resources.island_of(e) for e in members}) == 1


def test_gradients_cross_the_link_between_islands(shaped):
    """At least (I-1)/I of each step's gradient bytes cross the relay (I = 2, one executor per island)."""
    import torch.nn as nn

    from tests.conftest import train_eagerly

    batches = _batches(3, rows=8)
    reference = _mlp()
    expected = train_eagerly(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches, nn.MSELoss())
    model = _mlp()
    trainer = shaped.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.MSELoss(),
                          mesh=shaped.mesh({"island": 2, "data": 1}), plan=pw.DataParallel(("island", "data")))
    trainer.step(batches[0]).result(120)
    _wait_for_every_island(trainer)
    before = shaped.link.bytes_relayed
    losses = [loss.result(120).item() for loss in [trainer.step(b) for b in batches[1:]]]
    _wait_for_every_island(trainer)
    # Each island's one executor holds its whole reduced gradient (D = 1) and sends it to the other island:
    # (I - 1) / I of the island's gradients reach each executor, over the link, each step.
    gradient_bytes = sum(p.numel() for p in model.parameters()) * 8
    assert shaped.link.bytes_relayed - before >= 2 * 2 * gradient_bytes     # 2 steps, both directions
    assert max(abs(a - b) for a, b in zip(losses, expected[1:])) < 1e-9


def _wait_for_every_island(trainer):
    """Every island's update has run: it read what the other islands sent it."""
    for island_state in trainer.runner.island_states:
        for array in island_state:
            array.result(60)


def test_the_trace_groups_rows_by_island_and_draws_link_transfers(shaped, tmp_path):
    import torch.nn as nn

    model = _mlp()
    trainer = shaped.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.MSELoss(),
                          mesh=shaped.mesh({"island": 2, "data": 1}), plan=pw.DataParallel(("island", "data")))
    trainer.step(_batches(1, rows=8)[0]).result(60)
    _wait_for_every_island(trainer)
    trace = shaped.trace(str(tmp_path / "trace.json"))
    rows = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "process_name" and "executor" in e["args"]["name"]}
    assert [rows[pid].split(" · ")[0] for pid in sorted(rows)] == ["island 0", "island 0", "island 1"]
    link = [e for e in trace["traceEvents"] if e.get("cat") == "link"]
    assert link and {e["ph"] for e in link} == {"s", "f"}
    starts = {e["id"]: rows[e["pid"]] for e in link if e["ph"] == "s"}
    ends = {e["id"]: rows[e["pid"]] for e in link if e["ph"] == "f"}
    assert all(starts[i].split(" · ")[0] != ends[i].split(" · ")[0] for i in starts)   # each crosses islands


def _deep_mlp():
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(5) for layer in (nn.Linear(64, 64), nn.Tanh())],
                         nn.Linear(64, 3)).double()


def test_buckets_leave_while_the_backward_of_the_rest_runs(shaped, tmp_path):
    """Cut per bucket, the step sends the first bucket's gradient across before the island's backward ends, and
    the losses stay eager's."""
    import torch.nn as nn

    from tests.conftest import train_eagerly

    batches = [(torch.randn(16, 64, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)) for _ in range(2)]
    reference = _deep_mlp()
    expected = train_eagerly(reference, torch.optim.SGD(reference.parameters(), lr=0.05), batches, nn.MSELoss())
    model = _deep_mlp()
    plan = pw.DataParallel(("island", "data"), bucket_mb=0.02)      # 20 KB: one 64 x 64 float64 layer a bucket
    trainer = shaped.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=nn.MSELoss(),
                          mesh=shaped.mesh({"island": 2, "data": 1}), plan=plan)
    losses = [loss.result(120).item() for loss in [trainer.step(b) for b in batches]]
    _wait_for_every_island(trainer)
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-9
    assert len(trainer.layout.buckets) >= 5 and len(trainer.runner.bucket_cut.segments) == len(trainer.layout.buckets)
    assert str(trainer.runner.bucket_cut).startswith("segment 0 (bucket 0): ")
    trace = shaped.trace(str(tmp_path / "trace.json"))["traceEvents"]
    segments = [e for e in trace if e.get("ph") == "X" and e.get("name", "").startswith("island_grads[")]
    sends = [e for e in trace if e.get("cat") == "link" and e.get("ph") == "s"]
    per_step = len(trainer.runner.bucket_cut.segments)
    overlapped = 0
    for pid in {e["pid"] for e in segments}:
        # this trainer's steps: the last ones in the trace of this module's shared context
        mine = sorted((e for e in segments if e["pid"] == pid), key=lambda e: e["ts"])[-per_step * len(batches):]
        assert [e["name"] for e in mine] == [f"island_grads[{k}]" for k in range(per_step)] * len(batches)
        for step in range(len(batches)):
            spans = mine[step * per_step:(step + 1) * per_step]
            began, ended = spans[0]["ts"], spans[-1]["ts"] + spans[-1]["dur"]
            # a bucket this executor sent while its backward of that step still ran
            overlapped += any(began < e["ts"] < ended for e in sends if e["pid"] == pid)
    assert overlapped == 2 * len(batches), (overlapped, [(e["pid"], e["ts"]) for e in sends])


def test_timeline_draws_the_step_across_islands(shaped, tmp_path):
    import torch.nn as nn

    from pathways_torch.observe.timeline import describe, island_picture as step_picture

    model = _deep_mlp()
    trainer = shaped.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=nn.MSELoss(),
                          mesh=shaped.mesh({"island": 2, "data": 1}),
                          plan=pw.DataParallel(("island", "data"), bucket_mb=0.02))
    with pytest.raises(pw.PlacementError, match="no step has run yet"):
        trainer.runner.timeline(str(tmp_path / "none.png"))
    trainer.step((torch.randn(16, 64, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64))).result(60)
    path = trainer.runner.timeline(str(tmp_path / "step.png"), trace_path=str(tmp_path / "step.json"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    import json

    with open(tmp_path / "step.json") as f:
        spans, flows = step_picture(json.load(f), len(trainer.runner.bucket_cut.segments))
    text = describe(spans, flows).splitlines()
    segments = " ".join(f"G{k}" for k in range(len(trainer.runner.bucket_cut.segments)))
    assert [line.split(": ")[1] for line in text[:2]] == [f"{segments} U"] * 2
    assert text[0].startswith("island 0 · ") and text[1].startswith("island 1 · ")
    assert len(flows) >= 2 * len(trainer.layout.buckets)     # every bucket's slice, both ways (and the losses)


def _dropout_mlp():
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 64), nn.ReLU(),
                         nn.Dropout(0.2), nn.Linear(64, 3)).double()


def test_across_islands_with_dropout_equals_one_island_and_leaves_nothing_behind(shaped):
    """Cut per bucket, with dropout: two islands of one executor give the losses of one island of two (the
    masks are keyed by step and global shard), and the executors' stores do not grow from step to step (the
    values the segments carry are freed)."""
    import torch.nn as nn

    batches = [(torch.randn(16, 64, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)) for _ in range(6)]

    def train(mesh, plan):
        model = _dropout_mlp()
        trainer = shaped.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                              loss_fn=nn.MSELoss(), mesh=mesh, plan=plan)
        losses, stored = [], []
        for batch in batches:
            losses.append(trainer.step(batch).result(120).item())
            if hasattr(trainer.runner, "island_states"):
                _wait_for_every_island(trainer)
            stored.append(sum(e["store_bytes"] for e in shaped.stats()["executors"].values()))
        return losses, stored, trainer

    island_0 = [e for e in controller_of(shaped).resources.ordered() if e.island == "0"]
    one, _, _ = train(shaped.mesh({"data": 2}, executors=[e.executor_id for e in island_0]), pw.DataParallel("data"))
    two, stored, trainer = train(shaped.mesh({"island": 2, "data": 1}),
                                 pw.DataParallel(("island", "data"), bucket_mb=0.02))
    assert len(trainer.runner.bucket_cut.segments) >= 4
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-12, (one, two)
    assert stored[-1] <= stored[1], stored     # steady: nothing carried piles up


def test_tensor_parallelism_inside_islands_and_data_parallelism_across_equals_eager(ctx):
    """nanoGPT under ShardedDataParallel with clipping: every path of the runner (split and whole buckets, sliced
    flats, the norm over the model axis). Llama (SDP, clipping) and GPT-2 also ran equal to eager by hand."""
    from tests.integration.test_tensor_parallel import CASE, _oracle, _relative, check_islands_trainer

    case = CASE["nanogpt"]

    def make_model():
        return case.make_model().double()
    expected_losses, expected = _oracle(make_model, case.batches(), case.loss_fn, max_grad_norm=0.05)
    losses, state, trainer = check_islands_trainer(ctx, make_model, case, pw.ShardedDataParallel, 0.05)
    assert _relative(losses, expected_losses) < 1e-9, (losses, expected_losses)
    assert max(_relative(state[n], v) for n, v in expected.items()) < 1e-9
    assert "in each of 2 islands" in str(trainer.runner.placements)
    resources = controller_of(ctx).resources
    for members in controller_of(ctx).groups.by_members:       # the model axis's collectives stayed inside each island
        assert len({resources.island_of(e) for e in members}) == 1


def test_a_checkpoint_of_tensor_parallel_islands_loads_into_eager(ctx, tmp_path):
    from tests.integration.test_tensor_parallel import CASE, _adamw, _loss, _oracle, _relative, check_islands_trainer

    case = CASE["nanogpt"]

    def make_model():
        return case.make_model().double()
    batches = case.batches()
    expected, _ = _oracle(make_model, batches, case.loss_fn)
    first, _, trainer = check_islands_trainer(ctx, make_model, case, pw.ShardedDataParallel, None, batches[:2])
    trainer.save_sharded(str(tmp_path)).result(120)
    model = make_model()
    optimizer = _adamw(model)
    assert pw.load_checkpoint(str(tmp_path), model, optimizer)["step"] == 2
    rest = []
    for batch in batches[2:]:
        optimizer.zero_grad()
        loss = _loss(model, case.loss_fn, batch)
        loss.backward()
        optimizer.step()
        rest.append(loss.item())
    assert _relative(first + rest, expected) < 1e-9
