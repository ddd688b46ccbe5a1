"""Fuzz a `pathways-controller`'s client socket from a client key (issue 46, point 10).

A `pathways-controller` (eager backend, local executors) serves two clients. "alice" runs a small known
computation over and over through ``pw.Context(controller=..., keys=...)`` and checks each result equals eager's,
exactly. "bob", with a valid key of his own, sends raw seam_codec messages on a DEALER (`bench.fuzz_seam`): every
op the socket serves, ``ping`` and unknown ops, with mutated fields, wrong types, NaN/inf/huge numbers, deep nests,
bad tags, garbage protobufs, frames added and missing, messages up to the size cap and a few over it; and the ids
of alice's arrays. He learns his own ids from the answers first (a legit session's messages are the templates), so
that a request gets past the ownership checks to the code behind them.

Each answer is recorded, not expected: per op, how many were answered ok, refused by the signature check, refused
in the handler (grouped by the error's first words), or not answered. The invariants: no process exits, no
executor is lost or replaced, alice's results stay equal, every request the service can read with r != 0 is
answered (or bob is disconnected with a reason). A request left unanswered for ``--answer-timeout-s`` is a hang:
its message is recorded, and bob reconnects (a new connection takes the key's session over).

    .venv/bin/python -m bench.fuzz_service [--messages 100000] [--seed 0] [--executors 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import signal
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch
import zmq

import pathways_torch as pw
from bench import fuzz_seam
from bench.common import free_port, write_results
from bench.fuzz_inputs import RandomChooser
from bench.fuzz_seam import Pools
from bench.fuzz_service_client import Bob
from pathways_torch.remote_client import RemoteClient
from pathways_torch.wire import seam

__all__ = ["Service", "served_ops", "Alice", "recorded", "seed_session", "fuzz", "end_checks", "markdown", "run", "main"]

_READY = "pathways-controller: serving clients at "


def _say(line: str) -> None:
    print(line, flush=True)


class Service:
    """A ``pathways-controller`` on loopback (keys made with --make-keys first), its status on a loopback port."""

    def __init__(self, workdir: str, executors: int, args=(), timeout_s: float = 120.0):
        self.keys_dir = os.path.join(workdir, "keys")
        main = [sys.executable, "-m", "pathways_torch.launch.controller_main"]
        subprocess.run([*main, "--make-keys", self.keys_dir, "--clients", "alice,bob", "--executors",
                        str(executors)], check=True, capture_output=True)
        port = free_port()
        self.status_address = f"127.0.0.1:{port}"
        self.process = subprocess.Popen([*main, "--keys-dir", self.keys_dir, "--num-executors", str(executors),
                                         "--backend", "eager", "--bind", "tcp://127.0.0.1:0", "--status-port",
                                         str(port), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        self.output: list[str] = []
        self.address = ""
        ready = threading.Event()

        def read() -> None:   # keep draining: a full pipe would stop the controller
            for line in self.process.stdout:
                self.output.append(line)
                if line.startswith(_READY):
                    self.address = line[len(_READY):].split()[0]
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout_s) or not self.address.startswith("tcp://127.0.0.1:"):
            self.stop()
            raise RuntimeError("pathways-controller did not start on loopback:\n" + "".join(self.output[-40:]))

    def keys(self, client: str) -> str:
        return os.path.join(self.keys_dir, "clients", client)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


# ------------------------------------------------------------ alice: the other client, whose results must not change

def _alice_step(x):
    return x * 2 + 1


class Alice(threading.Thread):
    """Runs two chained calls and a fresh put over and over; every result must equal eager's exactly."""

    def __init__(self, address: str, keys: str, executors: int, hang_s: float = 60.0):
        super().__init__(name="fuzz-alice", daemon=True)
        self.address, self.keys, self.executors, self.hang_s = address, keys, executors, hang_s
        self.ready, self.stop_event = threading.Event(), threading.Event()
        self.array_ids: tuple[int, ...] = ()
        self.steps, self.latencies, self.baseline = 0, [], []
        self.failures: list[str] = []
        self.clock_mark = lambda: 0   # bob's message count, to date a failure
        self.pause_s = 0.05

    def run(self) -> None:
        try:
            with pw.Context(controller=self.address, keys=self.keys) as ctx:
                self._loop(ctx)
        except Exception as exc:   # noqa: BLE001 - a failure of alice's is the finding
            self.failures.append(f"at bob's message {self.clock_mark()}: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            self.ready.set()

    def _loop(self, ctx) -> None:
        mesh = ctx.mesh({"data": self.executors})
        step = pw.function(_alice_step, name="alice_step")
        n = 0
        while not self.stop_event.is_set():
            host = torch.arange(8.0 * self.executors, dtype=torch.float64) + n
            start = time.monotonic()
            try:
                x = ctx.put(host, mesh, [pw.Shard(0)])
                y = step(x)
                z = step(y)
                got = z.result(timeout_s=self.hang_s)
                self.array_ids = (x.array_id, y.array_id, z.array_id)
                if not torch.equal(got, _alice_step(_alice_step(host))):
                    self.failures.append(f"at bob's message {self.clock_mark()}: step {n} returned {got}")
            except Exception as exc:   # noqa: BLE001
                self.failures.append(f"at bob's message {self.clock_mark()}: step {n}: {type(exc).__name__}: "
                                     f"{str(exc)[:300]}")
            (self.baseline if not self.ready.is_set() else self.latencies).append(time.monotonic() - start)
            self.stop_event.wait(self.pause_s)   # a steady client, not a busy loop (the machine is shared)
            self.steps += 1
            n += 1
            if n == 10:
                self.ready.set()


# ------------------------------------------------------------ a legit session's messages: the templates

@contextlib.contextmanager
def recorded():
    """Every message a `RemoteClient` of this process sends meanwhile, in order (pings aside)."""
    messages: list[dict] = []
    original = RemoteClient._send

    def send(self, message: dict) -> None:
        messages.append(message)
        original(self, message)

    RemoteClient._send = send
    try:
        yield messages
    finally:
        RemoteClient._send = original


def seed_session(address: str, keys: str, executors: int) -> list[dict]:
    """Bob as a legit client once (a put, calls, a program, stats): the messages it sent."""
    with recorded() as messages, pw.Context(controller=address, keys=keys) as ctx:
        mesh = ctx.mesh({"data": executors})
        x = ctx.put(torch.arange(4.0 * executors), mesh, [pw.Shard(0)])
        inc = pw.function(lambda v: v + 1, name="bob_inc")
        inc(inc(x)).result(timeout_s=60)
        twice = pw.program(lambda v: inc(inc(v)), name="bob_program")
        twice(x).result(timeout_s=60)
        ctx.stats()
    return messages


# ------------------------------------------------------------ the run

def served_ops() -> dict:
    """The ops the client socket serves, and their argument types: the seam's own table (`seam.OPS`, each
    operation's ``FIELD_TYPES``), so that an op added there is fuzzed at once (and a test can check each was)."""
    return {name: op.FIELD_TYPES for name, op in seam.OPS.items()}


def _ops() -> tuple[dict, list]:
    """The served ops (their argument types), and the op list drawn from: each op once, bye rarely (each one ends
    the session: bob reconnects), pings and unknown ops."""
    signatures = served_ops()
    ops = [op for op in signatures if op != "bye"] + ["ping", "<unknown op>"]
    return signatures, ops


def _next_input(c, i: int, bob: Bob, signatures: dict, ops: list, hazards: dict) -> Input:
    pools = bob.pools
    r = bob.fresh_r() if c.integer(0, 6) else 0
    if i in hazards:
        name, op, make = hazards[i]
        return fuzz_seam.hazard(name, op, make, pools, bob.fresh_r())
    roll = c.integer(0, 1999)
    if roll < 2:
        return fuzz_seam.big(c, pools, bob.fresh_r())
    if roll < 6:
        return fuzz_seam.request(c, "bye", (), pools, bob.fresh_r())
    if roll < 200:
        return fuzz_seam.junk(c, bob.fresh_r())
    op = c.choice(ops)
    if op == "<unknown op>":
        item = fuzz_seam.request(c, c.choice(fuzz_seam.UNKNOWN_OPS), None, pools, r)
        item.op = "<unknown op>"
    else:
        item = fuzz_seam.request(c, op, signatures.get(op, ()), pools, r)
    return fuzz_seam.mutate(c, item) if c.integer(0, 2) == 0 else item


def _set_up(bob: Bob, index: int, tries: int = 3) -> bool:
    """Bob's session made anew; a try the service does not answer is a hang (recorded); False after ``tries``."""
    for attempt in range(tries):
        try:
            bob.setup()
            return True
        except (TimeoutError, zmq.ZMQError) as exc:
            bob.hangs.append({"first_unanswered": "<setup of a new session>", "index": index, "note": str(exc),
                              "attempt": attempt + 1, "connection_drops": bob.connection_drops})
    return False


def fuzz(service, alice: Alice, bob: Bob, messages: int, seed: int, *, max_seconds: float, batch: int = 100,
         answer_timeout_s: float = 10.0, progress=_say) -> dict:
    """Send ``messages`` inputs (stopping early at ``max_seconds``), settling every ``batch``; the run's facts."""
    c = RandomChooser(random.Random(seed))
    signatures, ops = _ops()
    spread = max(1, messages // (len(fuzz_seam.HAZARDS) + 1))
    hazards = {spread * (k + 1): h for k, h in enumerate(fuzz_seam.HAZARDS)}
    alice.clock_mark = lambda: bob.sent
    began = time.monotonic()
    i = 0
    if not _set_up(bob, i):
        return {"messages": i, "seconds": time.monotonic() - began, "seed": seed}
    while i < messages and time.monotonic() - began < max_seconds:
        bob.pools.others = alice.array_ids   # the other client's ids, as a shared trace would show them
        item = _next_input(c, i, bob, signatures, ops, hazards)
        bob.send(item)
        ended = fuzz_seam.ends_session(item.frames)
        if (i + 1) % batch == 0 or ended or i in hazards:
            settled = bob.settle(answer_timeout_s)
            if not settled and service.process.poll() is None:   # a hang: every controller stack into its log
                os.kill(service.process.pid, signal.SIGUSR1)
            if (not settled or ended or bob.session_ended) and not _set_up(bob, i):
                break   # a hang, a bye or a disconnection: a new connection, a new session (none: the end)
        i += 1
        if i % (20 * batch) == 0:
            progress(f"{i:,} messages, {time.monotonic() - began:.0f} s: hangs {len(bob.hangs)}, alice steps "
                     f"{alice.steps}, alice failures {len(alice.failures)}, controller "
                     f"{'alive' if service.process.poll() is None else 'EXITED'}")
    bob.settle(answer_timeout_s)
    return {"messages": i, "seconds": time.monotonic() - began, "seed": seed}


# ------------------------------------------------------------ the end: invariants and the table

def _process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _status(address: str):
    """The controller's status (what ``pathways-status`` reads; read-only, open on loopback)."""
    import grpc

    from pathways_torch.wire import pb
    from pathways_torch.wire.status_service import STATUS_METHOD

    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(STATUS_METHOD, request_serializer=pb.StatusRequest.SerializeToString,
                                   response_deserializer=pb.StatusReply.FromString)
        return call(pb.StatusRequest(with_stats=False), timeout=30)


def end_checks(service, alice: Alice, bob: Bob) -> dict:
    """The invariants, as facts: processes alive, executors alive with their first epoch, alice's results equal,
    every readable request answered (or the session ended with a reason)."""
    facts: dict = {"controller_exit": service.process.poll(),
                   "executors_exited": sorted(e for e, pid in bob.pids.items() if not _process_alive(pid))}
    try:
        reply = _status(service.status_address)
        states = {e.executor_id: (e.state, e.epoch) for e in reply.executors}
        facts["status"] = {e: s for e, (s, _) in states.items()}
        facts["executors_lost"] = sorted(e for e, (s, epoch) in states.items()
                                         if s != "alive" or epoch != bob.epochs.get(e))
        facts["executors_missing"] = sorted(set(bob.epochs) - set(states))
        facts["dropped_client_messages"] = reply.dropped_client_messages
    except Exception as exc:   # noqa: BLE001 - no status answer is a finding
        facts["status_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        facts["executors_lost"] = sorted(bob.epochs)
    facts["controller_log_losses"] = [line.strip()[:200] for line in service.output
                                      if "lost" in line and "executor" in line][:10]
    facts["alice_steps"], facts["alice_failures"] = alice.steps, alice.failures[:10]
    facts["hangs"] = bob.hangs
    facts["disconnections"] = collections.Counter(bob.disconnections)
    facts["connection_drops"] = bob.connection_drops
    facts["ok"] = (facts["controller_exit"] is None and not facts["executors_exited"] and not facts["executors_lost"]
                   and not facts.get("executors_missing") and "status_error" not in facts and not alice.failures
                   and alice.steps > 0 and not bob.hangs)
    return facts


_COLUMNS = ("sent", "ok", "refused: signature", "refused: handler", "hung (no answer)", "queued behind a hang",
            "disconnected")


def table_rows(bob: Bob) -> list[list]:
    """Per op (or kind of message that is no request): sent, answered ok, refused (where, and the commonest
    reasons), unanswered, lost to a disconnection, and no answer to a request that wanted none or was unreadable."""
    rows = []
    for op in sorted(bob.tally, key=lambda o: (o.startswith("<"), o)):
        counts = bob.tally[op]
        counted = sum(counts[k] for k in _COLUMNS[1:])
        reasons = "; ".join(f"{reason} ({n:,})" for reason, n in bob.reasons[op].most_common(3))
        rows.append([op, *(f"{counts[k]:,}" for k in _COLUMNS), f"{max(0, counts['sent'] - counted):,}", reasons])
    return rows


def markdown(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c).replace("|", "\\|") for c in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


HEADERS = ["op", *_COLUMNS, "no answer (r=0 or unreadable)", "commonest refusals"]


def run(messages: int, seed: int, executors: int, *, max_seconds: float, answer_timeout_s: float = 10.0,
        service=None, progress=_say) -> dict:
    """The whole fuzz: start a service (unless given one), seed, alice, bob; the results (``ok``: invariants hold)."""
    workdir = tempfile.mkdtemp(prefix="pathways-fuzz-service-")
    owned = service is None
    zctx = zmq.Context()
    alice = None
    try:
        service = service or Service(workdir, executors)
        templates = seed_session(service.address, service.keys("bob"), executors)
        pools = Pools(graphs=[m["a"][1] for m in templates if m["op"] == "register_function"],
                      calls=[m["a"][0] for m in templates if m["op"] == "call"])
        alice = Alice(service.address, service.keys("alice"), executors)
        alice.start()
        alice.ready.wait(120)
        bob = Bob(zctx, service.address, service.keys("bob"), pools, templates)
        facts = fuzz(service, alice, bob, messages, seed, max_seconds=max_seconds, answer_timeout_s=answer_timeout_s,
                     progress=progress)
        time.sleep(1.0)   # alice's steps after the last message
        alice.stop_event.set()
        alice.join(120)
        facts.update(end_checks(service, alice, bob))
        facts["alice_latency_s"] = {"undisturbed_median": _median(alice.baseline), "fuzzed_median":
                                    _median(alice.latencies), "fuzzed_max": max(alice.latencies or [0])}
        facts["table"] = {row[0]: dict(zip(HEADERS[1:], row[1:])) for row in table_rows(bob)}
        facts["rows"] = table_rows(bob)
        return facts
    finally:
        if alice is not None:
            alice.stop_event.set()
        zctx.destroy(linger=0)
        if owned and service is not None:
            service.stop()
            if os.environ.get("PATHWAYS_FUZZ_CONTROLLER_LOG"):   # the controller's log (stacks at each hang)
                with open(os.environ["PATHWAYS_FUZZ_CONTROLLER_LOG"], "w") as log_file:
                    log_file.writelines(service.output)
        shutil.rmtree(workdir, ignore_errors=True)


def _median(values: list) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--executors", type=int, default=2, help="local executors of the service (2-4)")
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="stop sending after this long")
    parser.add_argument("--answer-timeout-s", type=float, default=10.0, help="an answer later than this: a hang")
    parser.add_argument("--json", default=None, help="where to write the results (default bench/results/"
                                                     "fuzz_service.json)")
    args = parser.parse_args(argv)
    facts = run(args.messages, args.seed, args.executors, max_seconds=args.max_seconds,
                answer_timeout_s=args.answer_timeout_s)
    rows = facts.pop("rows")
    print()
    print(f"{facts['messages']:,} messages from bob's key in {facts['seconds']:.0f} s (seed {facts['seed']}); "
          f"controller exit {facts['controller_exit']}, executors exited {facts['executors_exited']}, lost "
          f"{facts['executors_lost']}; alice: {facts['alice_steps']} steps, {len(facts['alice_failures'])} failed; "
          f"hangs {len(facts['hangs'])}; bob's sessions ended by the service: {dict(facts['disconnections'])}; "
          f"connection drops {facts['connection_drops']}")
    print(markdown(HEADERS, rows))
    for hang in facts["hangs"][:10]:
        print("hang:", hang)
    for failure in facts["alice_failures"]:
        print("alice:", failure)
    print("written to", write_results("fuzz_service", facts, args.json, default=str))
    print("ok" if facts["ok"] else "FAILED: an invariant does not hold")
    return 0 if facts["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
