"""Faults leave nothing behind: the same executor replaced three times in one run, across two islands joined by
the relay, and on one island, and what the run holds afterwards measured after each recovery.

Each replacement used to leave every survivor an open connection to the old address (retried every 100 ms for
good), the relay a port for it, the controller's rendezvous store the groups' keys, and each survivor the gloo
groups it abandoned (their threads and sockets). On one island each survivor also kept the old group through the
binding its step had cached (a gloo device thread and two worker threads, a listening socket, a connection, a pipe
and an epoll per replacement). After the first recovery none of it may grow. The tables are printed (pytest -s) and
written to /tmp/leak_table.json and /tmp/leak_table_one_island_<backend>_<plan>.json. On one island every
plan is measured (data parallel on both backends, the others on eager).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
import time

import pytest
import torch

import pathways_torch as pw
from tests.conftest import REPO_ROOT, dev_shm_names, wait_until
from tests.integration.test_held_futures_recovery import PLANS
from tests.handles import controller_of

sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
from transformer import DecoderOnlyTransformer, ReverseTask, TransformerConfig, loss_fn  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

CFG = TransformerConfig(vocab=12, length=4, width=16, depth=1, heads=2, dropout=0.1)
FAULTS = 3
STEPS_PER_ROUND = 4
TABLE_PATH = "/tmp/leak_table.json"


def _survivor_resources(pids, checkpoints) -> dict:
    """Open file descriptors and threads, summed over ``pids``; not the checkpoint files a save has open (a save
    of the moment, not a leak)."""
    fds = 0
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                fds += not os.readlink(f"/proc/{pid}/fd/{fd}").startswith(str(checkpoints))
            except OSError:
                pass          # closed meanwhile
    threads = sum(len(os.listdir(f"/proc/{pid}/task")) for pid in pids)
    return {"fds": fds, "threads": threads}


def _measure(ctx, survivors, checkpoints) -> dict:
    """What the run holds now, once it is quiet (two readings alike, a moment apart: a save or a reconnect may be
    under way)."""
    def reading():
        sizes = controller_of(ctx).rendezvous.sizes()
        executors = ctx.stats()["executors"]
        peers = sum(executors[e]["hop_bytes"].get("peer_connections", 0) for e in ctx.executor_ids[:3])
        return {**_survivor_resources(survivors, checkpoints), "peer_sockets": peers, "listeners": ctx.link.listeners,
                "keys": sizes["keys"] + sizes["waiting"], "groups_open": sizes["groups"],
                "folders": len([n for n in os.listdir(checkpoints) if n.startswith("step-")])}

    return _quiet(reading)


def test_three_replacements_of_one_executor_across_islands_leave_nothing_behind(tmp_path):
    task = ReverseTask(CFG, seed=5)
    batches = [task.batch(i, 8) for i in range(STEPS_PER_ROUND * (FAULTS + 1))]
    checkpoints = tmp_path / "ckpt"
    with pw.Context(islands=[2, 2], backend="eager", link=pw.Link(delay_s=0.002, shaping="relay"),
                    heartbeat_timeout_s=2.0) as ctx:
        torch.manual_seed(0)
        model = DecoderOnlyTransformer(CFG)
        trainer = ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                           mesh=ctx.mesh({"island": 2, "data": 2}), plan=pw.DataParallel(("island", "data")),
                           seed=3, checkpoint_dir=str(checkpoints), checkpoint_every=2)
        victim = ctx.executor_ids[3]
        survivors = ctx.executor_pids[:3]
        for loss in [trainer.step(b) for b in batches[:STEPS_PER_ROUND]]:
            loss.result(120)
        rows = [{"after": "start", **_measure(ctx, survivors, checkpoints)}]
        for fault in range(1, FAULTS + 1):
            victim_pid = ctx.executor_pids[3]
            os.kill(victim_pid, signal.SIGKILL)
            assert wait_until(lambda: ctx.executor_pids[3] != victim_pid or
                              ctx.is_lost(victim), 30)
            round_ = batches[fault * STEPS_PER_ROUND:(fault + 1) * STEPS_PER_ROUND]
            for loss in [trainer.step(b) for b in round_]:
                loss.result(120)
            assert trainer.stats()["recoveries"] == fault, trainer.stats()
            rows.append({"after": f"fault {fault}", **_measure(ctx, survivors, checkpoints)})
        epochs = [info.epoch for info in controller_of(ctx).resources.ordered()]
    assert epochs == [1, 1, 1, 1 + FAULTS]
    columns = ["after", "fds", "threads", "peer_sockets", "listeners", "keys", "groups_open", "folders"]
    table = "\n".join(["  ".join(f"{c:>9}" for c in columns)] +
                      ["  ".join(f"{row[c]:>9}" for c in columns) for row in rows])
    print(f"\nsurvivors {survivors}: open fds and threads, and ZeroMQ connections to peers, summed over the three; "
          f"the relay's listening ports; the rendezvous store's keys (with parked gets) and open groups; checkpoint "
          f"folders:\n{table}")
    with open(TABLE_PATH, "w") as f:
        json.dump({"survivor_pids": survivors, "rows": rows}, f, indent=1)
    first = rows[1]
    for row in rows[2:]:
        for column in ("fds", "threads", "peer_sockets", "listeners", "keys", "groups_open", "folders"):
            assert row[column] <= first[column], (column, rows)
    assert all(row["listeners"] == 4 for row in rows), rows


def _threads_by_name(pid: int) -> collections.Counter:
    """The threads of ``pid`` by name (``comm``): gloo's ``gloo_tcp_loop`` (one per group's device) and
    ``pt_gloo_runloop`` (its workers), ZeroMQ's ``ZMQbg/*``, ours ``pw-*``."""
    names = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:
            pass          # ended meanwhile
    return names


def _one_island_reading(ctx, survivor: int, checkpoints) -> dict:
    """The survivor's fds (by kind: eventfds are ZeroMQ sockets' mailboxes), its threads by name, its ZeroMQ
    connections to peers, and the rendezvous store's groups, keys and bytes."""
    kinds = collections.Counter()
    for fd in os.listdir(f"/proc/{survivor}/fd"):
        try:
            target = os.readlink(f"/proc/{survivor}/fd/{fd}")
        except OSError:
            continue      # closed meanwhile
        if not target.startswith(str(checkpoints)):
            kinds["eventfds" if target == "anon_inode:[eventfd]" else target.split(":")[0]] += 1
    threads = _threads_by_name(survivor)
    store = controller_of(ctx).rendezvous
    executor = ctx.stats()["executors"][ctx.executor_ids[0]]
    return {"fds": sum(kinds.values()), "sockets": kinds["socket"], "eventfds": kinds["eventfds"],
            "pipes": kinds["pipe"], "threads": sum(threads.values()), "gloo_groups": threads["gloo_tcp_loop"],
            "host_groups": _host_group_mappings(survivor),
            "peer_sockets": executor["hop_bytes"].get("peer_connections", 0),
            "store_keys": store.sizes()["keys"] + store.sizes()["waiting"], "store_groups": store.sizes()["groups"],
            "store_bytes": store.stored_bytes(), "by_name": dict(sorted(threads.items()))}


def _host_group_mappings(pid: int) -> int:
    """The shared mappings of host groups (executor/shm_group.py: a memfd each) that process ``pid`` holds."""
    inodes = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            if "memfd:pathways-group" in line:
                inodes.add(line.split()[4])
    return len(inodes)


def _quiet(read) -> dict:
    """``read()`` once two readings a moment apart agree (a save or a reconnect may be under way), or after 15 s."""
    last = read()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = read()
        if now == last:
            break
        last = now
    return last


ONE_ISLAND_COLUMNS = ["fds", "sockets", "eventfds", "pipes", "threads", "gloo_groups", "host_groups", "peer_sockets",
                      "store_keys", "store_groups", "store_bytes"]


# (backend, plan): every plan on the same two executors (the plans of the held-futures test), data parallel on the
# default backend (what eager holds, it holds too, and the extension's group slots besides), the others on eager
ONE_ISLAND_CASES = [(None, "data-parallel"), ("eager", "sharded-data-parallel"), ("eager", "tensor-parallel"),
                    ("eager", "pipeline-1f1b")]


@pytest.mark.parametrize("backend,plan", ONE_ISLAND_CASES,
                         ids=[f"{backend or 'default'}-{plan}" for backend, plan in ONE_ISLAND_CASES])
def test_three_replacements_of_one_executor_on_one_island_leave_the_survivor_nothing(tmp_path, backend, plan):
    task = ReverseTask(CFG, seed=5)
    batches = [task.batch(i, 8) for i in range(STEPS_PER_ROUND * (FAULTS + 1))]
    checkpoints = tmp_path / "ckpt"
    mesh, make_plan = PLANS[plan]
    in_dev_shm = dev_shm_names()
    with pw.Context(2, backend=backend, heartbeat_timeout_s=2.0) as ctx:
        torch.manual_seed(0)
        model = DecoderOnlyTransformer(CFG)
        trainer = ctx.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                           mesh=ctx.mesh(mesh), plan=make_plan(model), seed=3,
                           checkpoint_dir=str(checkpoints), checkpoint_every=2)
        victim, survivor = ctx.executor_ids[1], ctx.executor_pids[0]
        for loss in [trainer.step(b) for b in batches[:STEPS_PER_ROUND]]:
            loss.result(300)
        rows = [{"after": "start", **_quiet(lambda: _one_island_reading(ctx, survivor, checkpoints))}]
        for fault in range(1, FAULTS + 1):
            victim_pid = ctx.executor_pids[1]
            os.kill(victim_pid, signal.SIGKILL)
            assert wait_until(lambda: ctx.executor_pids[1] != victim_pid or
                              ctx.is_lost(victim), 30)
            for loss in [trainer.step(b) for b in batches[fault * STEPS_PER_ROUND:(fault + 1) * STEPS_PER_ROUND]]:
                loss.result(300)
            assert trainer.stats()["recoveries"] == fault, trainer.stats()
            rows.append({"after": f"fault {fault}", **_quiet(lambda: _one_island_reading(ctx, survivor, checkpoints))})
        name = ctx.backend
    table = "\n".join(["  ".join(f"{c:>12}" for c in ["after", *ONE_ISLAND_COLUMNS])] +
                      ["  ".join(f"{row[c]:>12}" for c in ["after", *ONE_ISLAND_COLUMNS]) for row in rows])
    by_name = "\n".join(f"{row['after']:>12}  {row['by_name']}" for row in rows)
    print(f"\n{name}, {plan}, one island, survivor pid {survivor}: its fds (sockets, eventfds, pipes among them), threads, "
          f"gloo groups (gloo_tcp_loop threads), host groups (mapped memfds), ZeroMQ connections to peers; the rendezvous store's keys (with "
          f"parked gets), open groups and bytes:\n{table}\nits threads by name:\n{by_name}")
    with open(f"/tmp/leak_table_one_island_{name.replace(':', '_')}_{plan}.json", "w") as f:
        json.dump({"survivor_pid": survivor, "rows": rows}, f, indent=1)
    first = rows[1]
    for row in rows[2:]:
        for column in ONE_ISLAND_COLUMNS:
            assert row[column] <= first[column], (column, rows)
        grown = {n: c for n, c in row["by_name"].items() if c > first["by_name"].get(n, 0)}
        assert not grown, (row["after"], grown, rows)
    assert all(row["store_bytes"] == 0 for row in rows), rows
    assert dev_shm_names() <= in_dev_shm   # shared memory of groups and rings: memfds, never named
    if plan == "data-parallel":   # one group: the data axis's (the others' groups are as many as their axes need),
        # on the two executors of this host a shared mapping, not gloo
        assert all(row["host_groups"] == 1 and row["gloo_groups"] == 0 for row in rows), rows
