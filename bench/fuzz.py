"""Fuzz every ZeroMQ port of a local cluster; report inputs, crashes, hangs and peak memory.

Targets: the controller's ROUTER, and each executor's data and command ROUTERs. Senders:
an authenticated peer (the client's CURVE key, as the real client holds it) and
unauthenticated ones (the NULL mechanism, and a CURVE key on no allow-list). Inputs:
valid messages of every kind, then mutated — random bytes, truncated or extended
frames, frames dropped or added, wrong sizes, huge declared shapes, unknown dtypes and
op names, out-of-range ids, valid messages sent where they are not expected (the wrong
port, the wrong order). Every ``--probe-every`` inputs a well-formed call must return the
right result within ``--hang-s`` (else a hang); a process that exits is a crash. At the
end: the executors computed only the probes (nothing ran that the controller did not
send), and each process's peak RSS (VmHWM).

The same generator drives `tests/integration/test_fuzz.py` (a short budget, through
hypothesis); this runs the long one:

    .venv/bin/python -m bench.fuzz [--inputs 100000] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import zmq

import pathways_torch as pw
from bench.common import print_table, write_results
from pathways_torch.wire import pb
from pathways_torch.wire.security import KeyPair

__all__ = ["RandomChooser", "Target", "targets", "message", "send", "probe", "status_kb"]


class RandomChooser:
    """The choices a generator makes, from `random.Random` (the bench); the test draws them from hypothesis."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def choice(self, options):
        return options[self.rng.randrange(len(options))]

    def raw(self, size: int) -> bytes:
        return self.rng.randbytes(size)


def _ref(c, **extra) -> pb.ShardRef:
    ids = (0, 1, 2, 7, 2**31 - 1, 2**32, 2**63 - 1, 2**64 - 1)
    return pb.ShardRef(array_id=c.choice(ids), shard=c.choice((0, 1, 5, 2**32 - 1)), tag=c.choice((0, 1, 2**63)),
                       **extra)


def _meta(c) -> pb.TensorMeta:
    dtype = c.choice(("float32", "float64", "int64", "bool", "bfloat16", "__class__", "", "float32\x00"))
    shape = c.choice(([], [2], [0], [3, 5], [1 << 31, 1 << 31], [2**62], [2**63 - 1]))
    return pb.TensorMeta(dtype=dtype, shape=shape, frame=c.choice((0, 1, 2, 99)))


def _graph(c) -> pb.Graph:
    graph = pb.Graph()
    node = graph.nodes.add()
    node.name, node.op = "n0", c.choice(("call_function", "placeholder", "output", "bogus"))
    node.target = c.choice(("aten.add.Tensor", "os.system", "builtins.eval", "pathways::all_reduce", "", "aten.x.y"))
    return graph


def _body(c) -> pb.Envelope:
    """One valid message of a kind every port might see."""
    kind = c.choice(("put", "fetch", "transfer", "run", "run_program", "load_function", "free", "send_shard",
                     "register", "done", "heartbeat", "stats_request", "trace_request", "shutdown", "form_group",
                     "put_ack", "fetch_reply"))
    if kind == "put":
        put = pb.Put(request_id=c.integer(0, 2**32))
        put.shard.CopyFrom(_ref(c))
        put.tensor.CopyFrom(_meta(c))
        return pb.Envelope(put=put)
    if kind == "fetch":
        fetch = pb.Fetch(request_id=c.integer(0, 2**32))
        fetch.shard.CopyFrom(_ref(c))
        return pb.Envelope(fetch=fetch)
    if kind == "transfer":
        transfer = pb.Transfer(failed=c.choice((False, True)))
        transfer.shard.CopyFrom(_ref(c))
        transfer.tensor.CopyFrom(_meta(c))
        return pb.Envelope(transfer=transfer)
    if kind == "run":
        run = pb.Run(seq=c.integer(0, 2**40), call_id=c.integer(0, 2**40), function_id=c.integer(0, 5),
                     collective=c.choice((False, True)))
        run.inputs.append(_ref(c))
        run.outputs.append(_ref(c))
        return pb.Envelope(run=run)
    if kind == "run_program":
        return pb.Envelope(run_program=pb.RunProgram(program_id=c.integer(0, 5), base_seq=c.integer(0, 2**40)))
    if kind == "load_function":
        load = pb.LoadFunction(function_id=c.integer(0, 5), name="fuzz")
        load.graph.CopyFrom(_graph(c))
        return pb.Envelope(load_function=load)
    if kind == "free":
        return pb.Envelope(free=pb.Free(shards=[_ref(c)]))
    if kind == "send_shard":
        request = pb.SendShard(to_address=c.choice(("tcp://10.0.0.1:1", "tcp://127.0.0.1:1", "", "ipc:///x")))
        request.shard.CopyFrom(_ref(c))
        return pb.Envelope(send_shard=request)
    if kind == "register":
        return pb.Envelope(register=pb.Register(executor_id=c.choice(("executor-0", "client", "x" * 300)),
                                                data_address=c.choice(("tcp://127.0.0.1:1", "junk"))))
    if kind == "done":
        return pb.Envelope(done=pb.Done(call_id=c.integer(0, 2**40), ok=c.choice((False, True))))
    if kind == "shutdown":
        return pb.Envelope(shutdown=pb.Shutdown(reason="fuzz"))
    if kind == "form_group":
        return pb.Envelope(form_group=pb.FormGroup(seq=c.integer(0, 2**40), group_id=c.integer(0, 9), size=2))
    if kind == "put_ack":
        return pb.Envelope(put_ack=pb.PutAck(request_id=c.integer(0, 2**32)))
    if kind == "fetch_reply":
        return pb.Envelope(fetch_reply=pb.FetchReply(request_id=c.integer(0, 2**32)))
    if kind == "heartbeat":
        return pb.Envelope(heartbeat=pb.Heartbeat(sent_at=1.0))
    if kind == "stats_request":
        return pb.Envelope(stats_request=pb.StatsRequest(request_id=c.integer(0, 2**32)))
    return pb.Envelope(trace_request=pb.TraceRequest(request_id=c.integer(0, 2**32)))


def message(c) -> list[bytes]:
    """One input: a valid message of some kind, then (mostly) mutated."""
    frames = [_body(c).SerializeToString()]
    if c.integer(0, 3):
        frames.append(torch.ones(c.choice((0, 1, 2, 3, 1000))).numpy().tobytes())
    for _ in range(c.integer(0, 3)):
        frames = _mutate(c, frames)
    return frames


def _mutate(c, frames: list[bytes]) -> list[bytes]:
    how = c.choice(("random", "truncate", "extend", "flip", "drop frame", "add frame", "empty", "huge frame"))
    index = c.integer(0, len(frames) - 1) if frames else 0
    frames = list(frames) or [b""]
    frame = frames[index]
    if how == "random":
        frames[index] = c.raw(c.integer(0, 64))
    elif how == "truncate":
        frames[index] = frame[:c.integer(0, max(0, len(frame) - 1))]
    elif how == "extend":
        frames[index] = frame + c.raw(c.integer(1, 32))
    elif how == "flip" and frame:
        at = c.integer(0, len(frame) - 1)
        frames[index] = frame[:at] + bytes([frame[at] ^ (1 << c.integer(0, 7))]) + frame[at + 1:]
    elif how == "drop frame" and len(frames) > 1:
        del frames[index]
    elif how == "add frame":
        frames.insert(c.integer(0, len(frames)), c.raw(c.integer(0, 16)))
    elif how == "empty":
        frames = [b""] * c.integer(1, 3)
    elif how == "huge frame":
        frames.append(b"\0" * c.choice((1 << 16, 1 << 20)))
    return frames


class Target:
    """One port and one sender: a DEALER made once and kept (a fresh connection per input would fuzz TCP)."""

    def __init__(self, zctx: zmq.Context, name: str, address: str, server_key: bytes, keys: KeyPair | None,
                 identity: bytes | None = None, admitted: bool = False):
        self.name = name
        self.admitted = admitted      # the port admits this sender's key: its inputs reach our handlers
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
        self.sent = 0

    def drain(self) -> None:
        """Read (and discard) whatever the port answered: replies to our puts and fetches."""
        while self.socket.poll(0):
            self.socket.recv_multipart()


def targets(ctx, zctx: zmq.Context) -> list[Target]:
    """Every port of the cluster, from the client's key, from no key (NULL) and from a key no one allows."""
    client_keys = ctx._data._credentials.keys
    public, secret = zmq.curve_keypair()
    stranger = KeyPair(public=public, secret=secret)
    ports = [("controller", ctx._server.address, ctx._server.credentials.keys.public)]
    for info in ctx.controller.resources.ordered():
        ports += [(f"{info.executor_id} data", info.data_address, info.public_key),
                  (f"{info.executor_id} commands", info.command_address, info.public_key)]
    made = []
    for name, address, key in ports:
        made.append(Target(zctx, f"{name} (client key)", address, key, client_keys,
                           identity=b"client" if name == "controller" else None, admitted=True))
        made.append(Target(zctx, f"{name} (no key)", address, key, None))
        made.append(Target(zctx, f"{name} (unknown key)", address, key, stranger))
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
    """A well-formed call: raises (TimeoutError: a hang) unless it returns the right result in time."""
    x = torch.arange(8.0)
    got = add_one(ctx.put(x, mesh, [pw.Shard(0)])).result(timeout_s=timeout_s)
    if not torch.equal(got, x + 1):
        raise AssertionError(f"a probe after fuzzing returned {got}, expected {x + 1}")


def status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-every", type=int, default=2000)
    parser.add_argument("--hang-s", type=float, default=30.0)
    args = parser.parse_args()
    chooser = RandomChooser(random.Random(args.seed))
    crashes = hangs = probes = 0
    zctx = zmq.Context()
    began = time.monotonic()
    with pw.Context(num_executors=2, backend="eager") as ctx:
        mesh = ctx.mesh({"data": 2})
        add_one = pw.function(lambda x: x + 1, name="add_one")
        probe(ctx, mesh, add_one, args.hang_s)
        pids = {"client+controller": None, **dict(zip(ctx.executor_ids, ctx.executor_pids))}
        rss_start = {name: status_kb(pid or _self_pid(), "VmRSS") for name, pid in pids.items()}
        computed_before = {e: s["num_computations"] for e, s in ctx.stats()["executors"].items()}
        fuzzed = targets(ctx, zctx)
        i = offered = 0
        while i < args.inputs:     # inputs that reached a port that admits the sender
            target = chooser.choice(fuzzed)
            sent = send(target, message(chooser))
            offered += 1
            if not (sent and target.admitted):
                continue
            i += 1
            if i % args.probe_every == 0 or i == args.inputs:
                try:
                    probe(ctx, mesh, add_one, args.hang_s)
                    probes += 1
                except TimeoutError:
                    hangs += 1
                exited = ctx._cluster.newly_exited()
                crashes += len(exited)
                if i % (10 * args.probe_every) == 0 or i == args.inputs:
                    print(f"{i:,} inputs, {time.monotonic() - began:.0f} s: crashes {crashes}, hangs {hangs}",
                          flush=True)
        stats = ctx.stats()
        computed = {e: s["num_computations"] - computed_before[e] for e, s in stats["executors"].items()}
        peak = {name: status_kb(pid or _self_pid(), "VmHWM") for name, pid in pids.items()}
        rss_end = {name: status_kb(pid or _self_pid(), "VmRSS") for name, pid in pids.items()}
        dropped = {"controller": stats["controller"]["dropped_messages"],
                   **{e: s["dropped_messages"] for e, s in stats["executors"].items()}}
    zctx.destroy(linger=0)
    rows = [[name, f"{rss_start[name] / 1024:.0f}", f"{rss_end[name] / 1024:.0f}", f"{peak[name] / 1024:.0f}",
             dropped.get(name.split("+")[-1], dropped.get(name, "")), computed.get(name, "")] for name in pids]
    print()
    print(f"{args.inputs:,} inputs delivered to admitting ports ({offered:,} offered to {len(fuzzed)} (port, sender) "
          f"pairs; the rest went to refused connections) in {time.monotonic() - began:.0f} s; "
          f"crashes {crashes}, hangs {hangs}, probes passed {probes}")
    print("delivered per port:", ", ".join(f"{t.name}: {t.sent:,}" for t in fuzzed if t.admitted))
    print_table(["process", "RSS start MB", "RSS end MB", "peak RSS MB", "dropped messages",
                 "computations (probes only)"], rows)
    print("expected computations per executor (the probes after the first):", probes)
    print("written to", write_results("fuzz", {
        "inputs": args.inputs, "offered": offered, "seed": args.seed, "crashes": crashes, "hangs": hangs, "probes": probes,
        "rss_start_kb": rss_start, "rss_end_kb": rss_end, "peak_rss_kb": peak, "computations": computed,
        "dropped": dropped, "sent": {t.name: t.sent for t in fuzzed}}))


def _self_pid() -> int:
    import os

    return os.getpid()


if __name__ == "__main__":
    main()
