"""Fuzz every ZeroMQ port of a local cluster from every kind of sender; report, per port, the inputs sent, how
many reached a handler and how many were refused before one, and crashes, hangs and peak memory.

Ports: the controller's ROUTER, on each of its three connections (control: Register, Done, Stats, TransferLost,
trace replies, heartbeats; heartbeat; rendezvous store), and each executor's data and command ROUTERs.
Senders: each executor's own CURVE key (read from the key folder the context made, before it is deleted),
speaking under an identity the controller accepts (``<id><connection>~<nonce>``), to the controller and to
the *other* executors' data and command ports; the client's key, to every port; and unauthenticated ones
(the NULL mechanism, and a key on no allow-list). Inputs (`bench.fuzz_inputs`): a message of every body kind
of the schema, fields drawn from edge values and the cluster's real ids, then mostly mutated.

Every ``--probe-every`` inputs a well-formed call must return the right result within ``--hang-s`` (else a
hang); an executor process that exits is a crash. The runtime counts the messages that reach each handler
(``ctx.stats()[...]["handled_messages"]``); the fuzzer reads them around each batch of inputs and subtracts
the cluster's own traffic in that window (its executors' heartbeats, the stats requests that read them).
At the end a small model trains on the fuzzed cluster; its losses must equal eager training's (1e-9).
An executor's key may legitimately disturb its own calls: that is what the probes and the training check
measure, on calls made after the inputs that could disturb them.

    .venv/bin/python -m bench.fuzz [--inputs 100000] [--seed 0]

A `pathways-controller`'s client socket (seam_codec requests from a client key) is fuzzed by `bench.fuzz_service`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import shutil
import tempfile
import time

import torch
import zmq

import pathways_torch as pw
from bench.common import print_table, write_results
from bench.fuzz_inputs import BODY_KINDS, Hints, RandomChooser, hints_of, message
from pathways_torch.wire.security import (CLIENT, HEARTBEAT_SUFFIX, INCARNATION_MARK, STORE_SUFFIX, KeyDirectory,
                                          KeyPair)
from tests.handles import client_credentials_of, cluster_of, controller_of, server_of

__all__ = ["RandomChooser", "Target", "targets", "message", "send", "probe", "status_kb", "keys_kept", "Window",
           "alive", "trains_like_eager", "BODY_KINDS", "Hints", "hints_of"]

CONTROLLER_CONNECTIONS = {"control": "", "heartbeat": HEARTBEAT_SUFFIX, "store": STORE_SUFFIX}
# The kinds each port's handlers take (half of a port's inputs are of these; the rest of any kind).
HANDLED_KINDS = {"controller control": ("register", "done", "transfer_lost", "stats", "trace_reply", "heartbeat"),
                 "controller heartbeat": ("heartbeat",), "controller store": ("store_request",),
                 "data": ("put", "fetch", "transfer", "save_shards"),
                 "command": tuple(k for k in BODY_KINDS if k not in ("put", "fetch", "save_shards", "register"))}


@contextlib.contextmanager
def keys_kept():
    """While a `pw.Context` starts inside: every key pair of its key folder, read (into the dict yielded) just
    before the context deletes the folder. The fuzzer speaks with the executors' own keys."""
    pairs: dict[str, KeyPair] = {}
    original = KeyDirectory.remove

    def remove(self) -> None:
        KeyDirectory.remove = original       # the first removal only (a context removes its folder twice)
        with contextlib.suppress(OSError):
            for role in self.public_keys():
                pairs[role] = self.keypair(role)
        original(self)

    KeyDirectory.remove = remove
    try:
        yield pairs
    finally:
        KeyDirectory.remove = original


class Target:
    """One port and one sender: a DEALER made once and kept (a fresh connection per input would fuzz TCP)."""

    def __init__(self, zctx: zmq.Context, port: str, sender: str, address: str, server_key: bytes,
                 keys: KeyPair | None, identity: bytes | None = None, admitted: bool = False):
        self.port, self.sender = port, sender
        self.kinds = HANDLED_KINDS.get(port) or HANDLED_KINDS[port.rsplit(" ", 1)[-1]]
        self.name = f"{port} ({sender})"
        self.admitted = admitted      # the port's allow-list holds this sender's key: its inputs arrive
        self.socket = zctx.socket(zmq.DEALER)
        self.socket.linger = 0
        # A few queued messages at most: a port that refused us never takes them, and they are our memory.
        self.socket.sndhwm = 8
        if identity:
            self.socket.identity = identity
        if keys is not None:
            self.socket.curve_serverkey, self.socket.curve_publickey = server_key, keys.public
            self.socket.curve_secretkey = keys.secret
        self.socket.connect(address)
        self.sent = self.answers = 0

    def drain(self) -> None:
        """Read (and count, and discard) whatever the port answered: acks, replies, heartbeat echoes."""
        while self.socket.poll(0):
            self.socket.recv_multipart()
            self.answers += 1


def targets(ctx, zctx: zmq.Context, keys: dict[str, KeyPair]) -> list[Target]:
    """Every (port, sender) pair: executor keys to the controller's three connections and to the other
    executors' data and command ports; the client's key to every port; no key and an unknown key to every
    port. ``keys``: the cluster's key pairs by role (`keys_kept`)."""
    client_keys = client_credentials_of(ctx).keys
    public, secret = zmq.curve_keypair()
    stranger = KeyPair(public=public, secret=secret)
    infos = controller_of(ctx).resources.ordered()
    controller = (server_of(ctx).address, server_of(ctx).credentials.keys.public)
    made = []
    for connection, suffix in CONTROLLER_CONNECTIONS.items():
        port = f"controller {connection}"
        for info in infos:
            identity = f"{info.executor_id}{suffix}{INCARNATION_MARK}fuzz".encode()
            made.append(Target(zctx, port, f"{info.executor_id} key", *controller, keys[info.executor_id],
                               identity=identity, admitted=True))
    made.append(Target(zctx, "controller control", "client key", *controller, client_keys, identity=CLIENT.encode(),
                       admitted=True))
    ports = [("controller control", *controller)]
    for info in infos:
        for kind, address in (("data", info.data_address), ("command", info.command_address)):
            port = f"{info.executor_id} {kind}"
            ports.append((port, address, info.public_key))
            made.append(Target(zctx, port, "client key", address, info.public_key, client_keys, admitted=True))
            for other in infos:
                if other.executor_id != info.executor_id:
                    made.append(Target(zctx, port, f"{other.executor_id} key", address, info.public_key,
                                       keys[other.executor_id], admitted=True))
    for port, address, key in ports:
        made.append(Target(zctx, port, "no key", address, key, None))
        made.append(Target(zctx, port, "unknown key", address, key, stranger))
    return made


def send(target: Target, frames: list[bytes]) -> bool:
    """Send one input; True if it left. To an admitting port it waits (up to 5 s) for room: every input
    counted reached the port. To a refusing one it never waits: those never leave (the handshake failed)."""
    target.drain()
    if target.admitted and not target.socket.poll(5000, zmq.POLLOUT):
        return False
    try:
        target.socket.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        return False
    target.sent += 1
    return True


def probe(ctx, mesh, add_one, timeout_s: float) -> None:
    """A well-formed call: raises (TimeoutError: a hang) unless it returns the right result in time. Returns once
    the controller has handled every Done of it (so none arrives in the next fuzzing window)."""
    x = torch.arange(8.0)
    got = add_one(ctx.put(x, mesh, [pw.Shard(0)])).result(timeout_s=timeout_s)
    if not torch.equal(got, x + 1):
        raise AssertionError(f"a probe after fuzzing returned {got}, expected {x + 1}")
    deadline = time.monotonic() + timeout_s
    while controller_of(ctx).state.calls and time.monotonic() < deadline:
        time.sleep(0.005)


def alive(ctx) -> list[str]:
    """Executors whose process exited, or that the controller declared lost: crashes."""
    gone = [e for e, p in zip(ctx.executor_ids, cluster_of(ctx).processes) if p.poll() is not None]
    return sorted(set(gone) | set(ctx.stats()["controller"]["lost_executors"]))


def _counts(ctx, sent_to: collections.Counter) -> dict:
    """Handled and dropped messages per port, and the cluster's own traffic, as of now (one ctx.stats()).
    ``sent_to``: the controller's messages to each executor so far."""
    stats, sent = _stats_with_nothing_else_sent(ctx, sent_to)
    controller = stats["controller"]["handled_messages"]
    counts = collections.Counter({
        "controller control": sum(n for k, n in controller.items() if k.startswith("control:")),
        "controller heartbeat": controller.get("heartbeat", 0), "controller store": controller.get("store", 0),
        "controller dropped": stats["controller"]["dropped_messages"],
        "legit heartbeats": sum(s["heartbeats_sent"] for s in stats["executors"].values())})
    counts.update({f"{e} command sent": n for e, n in sent.items()})
    for executor_id, s in stats["executors"].items():
        for key, n in s["handled_messages"].items():
            counts[f"{executor_id} {key.split(':', 1)[0]}"] += n
        counts[f"{executor_id} dropped"] = s["dropped_messages"]
        counts[f"{executor_id} refused"] = s["refused_data_messages"]
    return counts


def _stats_with_nothing_else_sent(ctx, sent_to: collections.Counter, tries: int = 20):
    """``ctx.stats()`` and the controller's messages to each executor so far, read when the controller sent nothing
    but the Stats requests while they were answered: a message sent then (a Free, say) would be counted as sent
    but not yet as handled, and seen as one the fuzzer got through the command port at the next count."""
    for _ in range(tries):
        before = collections.Counter(sent_to)
        stats = ctx.stats()
        after = collections.Counter(sent_to)
        if all(after[e] - before[e] == 1 for e in stats["executors"]):   # the Stats request alone
            return stats, after
        time.sleep(0.01)
    raise AssertionError(f"the controller kept sending while its executors' counts were read ({tries} tries)")


class Window:
    """Counts what reached each port's handlers between `open` and `close` (no probe in between), less the
    cluster's own traffic then: its executors' heartbeats, the Stats replies `close` reads, and on each command
    port every message the controller sent it (counted here, at the controller's one way out)."""

    def __init__(self, ctx):
        self.ctx, self.reached = ctx, collections.Counter()
        self._before = None
        self._sent_to: collections.Counter = collections.Counter()
        server, send = server_of(ctx), server_of(ctx).to_executor

        def counted(executor_id, envelope, payload=()):
            self._sent_to[executor_id] += 1
            send(executor_id, envelope, payload)

        server.to_executor = counted

    def open(self) -> None:
        self._before = _counts(self.ctx, self._sent_to)

    def close(self, settle_s: float = 0.2, limit_s: float = 10.0) -> None:
        """Counts once the fuzzed ports' counts stopped moving: on a loaded machine an executor may handle the
        inputs later than ``settle_s``, and whatever it handles after `close` (during the next probe) would go
        uncounted."""
        after, deadline = None, time.monotonic() + limit_s
        while True:
            time.sleep(settle_s)     # inputs still on their way are handled
            latest = _counts(self.ctx, self._sent_to)
            if after is not None and _settled(after) == _settled(latest) or time.monotonic() > deadline:
                break
            after = latest
        after = latest
        delta = collections.Counter({k: after[k] - self._before.get(k, 0) for k in after})
        delta["controller control"] -= len(self.ctx.executor_ids)   # the Stats replies `close` read
        delta["controller heartbeat"] -= delta.pop("legit heartbeats")
        for executor_id in self.ctx.executor_ids:
            # What the controller sent it (the stats request, failed copies fuzzed reports caused ...).
            delta[f"{executor_id} controller's"] = delta.pop(f"{executor_id} command sent", 0)
            delta[f"{executor_id} command"] -= delta[f"{executor_id} controller's"]
        self.reached.update(delta)


def _settled(counts: dict) -> dict:
    """The counts that move only with fuzzed inputs (not with heartbeats or the Stats requests reading them)."""
    return {k: n for k, n in counts.items()
            if k.endswith((" data", " dropped", " refused")) or k in ("controller store",)}


def trains_like_eager(ctx, mesh, steps: int = 5) -> float:
    """Train a small float64 model on ``mesh`` (data parallel: a collective group forms through the controller's
    store) and in this process; the largest relative difference of the losses."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()

    def loss_fn(out, target):
        return torch.nn.functional.mse_loss(out, target)

    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=generator, dtype=torch.float64),
                torch.randn(8, 1, generator=generator, dtype=torch.float64)) for _ in range(steps)]
    eager, expected = model(), []
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(eager(x), y)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    remote = model()
    trainer = ctx.wrap(remote, optimizer=torch.optim.SGD(remote.parameters(), lr=0.1), loss_fn=loss_fn, mesh=mesh,
                       plan=pw.DataParallel("data"))
    got = [trainer.step(b).result(60).item() for b in batches]
    return max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got, expected))


def status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def port_rows(fuzzed: list[Target], reached: collections.Counter) -> list[list]:
    """One row per port: inputs sent by authenticated senders (by sender), reached a handler, refused before one;
    attempts of unauthenticated senders (refused in the handshake: they never leave)."""
    rows = []
    for port in dict.fromkeys(t.port for t in fuzzed):
        mine = [t for t in fuzzed if t.port == port]
        sent = sum(t.sent for t in mine if t.admitted)
        by = ", ".join(f"{t.sender} {t.sent:,}" for t in mine if t.admitted)
        got = reached.get(port, 0)
        rows.append([port, f"{sent:,}", by, f"{got:,}", f"{sent - got:,}",
                     f"{sum(t.answers for t in mine):,}", f"{sum(t.sent for t in mine if not t.admitted):,}"])
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-every", type=int, default=2000)
    parser.add_argument("--hang-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    chooser = RandomChooser(random.Random(args.seed))
    crashes, hangs, wrong, probes = [], 0, [], 0
    zctx = zmq.Context()
    save_dir = tempfile.mkdtemp(prefix="pathways-fuzz-")
    began = time.monotonic()
    try:
        with keys_kept() as keys, pw.Context(num_executors=2, backend="eager") as ctx:
            mesh = ctx.mesh({"data": 2})
            add_one = pw.function(lambda x: x + 1, name="add_one")
            probe(ctx, mesh, add_one, args.hang_s)
            pids = {"client+controller": os.getpid(), **dict(zip(ctx.executor_ids, ctx.executor_pids))}
            rss_start = {name: status_kb(pid, "VmRSS") for name, pid in pids.items()}
            fuzzed = targets(ctx, zctx, keys)
            window, i, offered = Window(ctx), 0, 0
            window.open()
            while i < args.inputs:     # inputs that reached a port whose allow-list holds the sender
                hints = hints_of(ctx, save_dir)
                for _ in range(args.probe_every):
                    target = chooser.choice(fuzzed)
                    offered += 1
                    if send(target, message(chooser, hints, target.kinds)) and target.admitted:
                        i += 1
                        if i >= args.inputs:
                            break
                window.close()
                try:
                    probe(ctx, mesh, add_one, args.hang_s)
                    probes += 1
                except TimeoutError:
                    hangs += 1
                except Exception as exc:   # noqa: BLE001 - a wrong or failed probe is a finding, not the end
                    wrong.append(f"after {i:,} inputs: {type(exc).__name__}: {str(exc)[:300]}")
                crashes = alive(ctx)
                window.open()
                if i % (10 * args.probe_every) == 0 or i >= args.inputs:
                    print(f"{i:,} inputs, {time.monotonic() - began:.0f} s: crashes {len(crashes)}, hangs {hangs}, "
                          f"failed probes {len(wrong)}", flush=True)
            for target in fuzzed:
                target.drain()
            largest = trains_like_eager(ctx, mesh)
            crashes = alive(ctx)
            stats = ctx.stats()
            peak = {name: status_kb(pid, "VmHWM") for name, pid in pids.items()}
            rss_end = {name: status_kb(pid, "VmRSS") for name, pid in pids.items()}
    finally:
        zctx.destroy(linger=0)
        shutil.rmtree(save_dir, ignore_errors=True)
    reached = window.reached
    controllers = sum(reached[f"{e} controller's"] for e in ctx.executor_ids)
    print()
    print(f"{i:,} inputs sent by admitted keys ({offered:,} offered to {len(fuzzed)} (port, sender) pairs; the rest "
          f"went to connections refused in the handshake) in {time.monotonic() - began:.0f} s; body kinds: "
          f"{len(BODY_KINDS)}; crashes {len(crashes)} {crashes or ''}, hangs {hangs}, probes passed {probes}, "
          f"failed {len(wrong)}; trained after fuzzing: largest relative loss difference to eager {largest:.1e}")
    print_table(["port", "sent", "sent by", "reached a handler", "refused before one", "answers", "unauth. attempts"],
                port_rows(fuzzed, reached))
    print(f"command ports: 'reached' is what they handled less the controller's own messages to them meanwhile "
          f"({controllers:,}: stats requests, and failed copies that fuzzed TransferLost reports caused)")
    print_table(["process", "RSS start MB", "RSS end MB", "peak RSS MB", "dropped messages (all)"],
                [[name, f"{rss_start[name] / 1024:.0f}", f"{rss_end[name] / 1024:.0f}", f"{peak[name] / 1024:.0f}",
                  stats["controller"]["dropped_messages"] if name == "client+controller"
                  else stats["executors"][name]["dropped_messages"]] for name in pids])
    for line in wrong[:5]:
        print("failed probe:", line)
    past_role_check = sum(reached[f"{e} command"] for e in ctx.executor_ids)
    ok = not crashes and not hangs and largest < 1e-9 and past_role_check == 0
    print("written to", write_results("fuzz", {
        "inputs": i, "offered": offered, "seed": args.seed, "crashes": crashes, "hangs": hangs, "probes": probes,
        "failed_probes": wrong, "train_relative_difference": largest, "reached": dict(reached),
        "ports": {r[0]: {"sent": r[1], "reached": r[3], "refused": r[4], "answers": r[5]}
                  for r in port_rows(fuzzed, reached)},
        "sent": {t.name: t.sent for t in fuzzed}, "answers": {t.name: t.answers for t in fuzzed},
        "rss_start_kb": rss_start, "rss_end_kb": rss_end, "peak_rss_kb": peak, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
