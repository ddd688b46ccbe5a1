"""The service fuzzer's hostile client (`bench.fuzz_service`): a raw DEALER on a client's own key that sends
`bench.fuzz_seam` inputs, learns its own ids from the answers, and tallies what came back, per op."""

from __future__ import annotations

import collections
import re
import time

import zmq

from bench import fuzz_seam
from bench.fuzz_seam import Input, Pools
from pathways_torch.wire import seam_codec
from pathways_torch.wire.security import KeyDirectory, make_client

__all__ = ["Bob"]

_SIGNATURE_REFUSAL = re.compile(r"^request '.*' with \[")


class Bob:
    """A raw DEALER on bob's key: sends `Input`s, matches answers to them by r, and tallies what came back."""

    def __init__(self, zctx: zmq.Context, address: str, keys: str, pools: Pools, templates: list[dict]):
        directory = KeyDirectory(keys)
        role = next(r for r in directory.public_keys() if r.startswith("client-"))
        self.credentials = directory.credentials(role)
        self.zctx, self.address, self.pools, self.templates = zctx, address, pools, templates
        self.socket = self.monitor = None
        self.next_r = 1000
        self.waiting: dict[int, tuple[Input, int]] = {}    # r → (input, its index): answers awaited
        self.sent_r: dict[int, Input] = {}                  # every r sent, until its answer
        self.tally: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.reasons: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.hangs: list[dict] = []
        self.disconnections: list[str] = []
        self.connection_drops = 0
        self.session_ended = False
        self._pinged = 0.0
        self.sent = 0
        self.recent: collections.deque = collections.deque(maxlen=256)   # (index, input): a hang's suspects
        self.last_answered = 0   # the index of the latest input answered (its worker had got that far)
        self.pids: dict[str, int] = {}
        self.epochs: dict[str, int] = {}

    def connect(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
            self.monitor.close(linger=0)
        self.socket = self.zctx.socket(zmq.DEALER)
        self.socket.linger = 0
        make_client(self.socket, self.credentials, self.credentials.public_key("controller"))
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.socket.connect(self.address)

    def fresh_r(self) -> int:
        self.next_r += 1
        return self.next_r

    def send(self, item: Input, *, expect: bool | None = None) -> None:
        """Send ``item``; ``expect``: the service must answer it (default: it decodes, names r != 0, fits the
        cap)."""
        self.socket.send_multipart(item.frames, copy=False)
        self.sent += 1
        size = sum(len(f) for f in item.frames)
        # A large one's bytes are not kept (it may never be answered): its head is enough to show it.
        kept = item if size < (1 << 20) else Input(item.op, [bytes(item.frames[0][:300])], item.r, item.note)
        self.recent.append((self.sent, kept))
        self.tally[item.op]["sent"] += 1
        if item.r:
            self.sent_r[item.r] = (kept, self.sent)
            readable = item.clean or fuzz_seam.readable_r(item.frames) == item.r
            if expect if expect is not None else (size <= self.pools.cap_bytes and readable):
                self.waiting[item.r] = (kept, self.sent)

    def _keep_alive(self) -> None:
        """A ping now and then while bob waits (as a real client's heartbeat): silence would end his session."""
        now = time.monotonic()
        if now - self._pinged > 1.0:
            self._pinged = now
            self.socket.send_multipart(fuzz_seam.encode({"r": 0, "op": "ping", "a": []}))

    def poll(self, timeout_ms: int) -> None:
        self._keep_alive()
        if self.monitor.poll(0):
            self.monitor.recv_multipart()
            self.connection_drops += 1
        if not self.socket.poll(timeout_ms):
            return
        while self.socket.poll(0):
            self._on_message(seam_codec.decode(self.socket.recv_multipart()))

    def _on_message(self, message: dict) -> None:
        if "ev" in message:
            if message["ev"] == "disconnected":
                self.disconnections.append(str(message.get("why")))
                self.session_ended = True
                for r, (item, _) in list(self.waiting.items()):
                    self.tally[item.op]["disconnected"] += 1
                    del self.waiting[r]
            return
        r = message.get("r")
        sent = self.sent_r.pop(r, None) if isinstance(r, int) else None
        self.waiting.pop(r, None) if isinstance(r, int) else None
        if sent is None:
            self.tally["<answers to no request sent>"]["answered"] += 1
            return
        self.last_answered = max(self.last_answered, sent[1])
        self._answered(sent[0], message)

    def _answered(self, item: Input, message: dict) -> None:
        if "err" not in message:
            self.tally[item.op]["ok"] += 1
            self._learn(item, message.get("ok"))
            return
        error = message["err"]
        text = str(error)
        column = "refused: signature" if _SIGNATURE_REFUSAL.match(text) else "refused: handler"
        self.tally[item.op][column] += 1
        self.reasons[item.op][_reason(error)] += 1
        expected_next = re.search(r"expected the next id this client was granted \((\d+|none)", text)
        if expected_next:
            self.pools.resync(int(expected_next.group(1)) if expected_next.group(1).isdigit() else None)

    def _learn(self, item: Input, value) -> None:
        """Its own ids from the service's answers: functions, programs, meshes, arrays, grants."""
        pools = self.pools
        if item.op == "register_function" and isinstance(value, int):
            pools.functions.append(value)
        elif item.op == "register_program" and isinstance(value, int):
            pools.programs.append(value)
        elif item.op == "allocate_mesh" and hasattr(value, "mesh_id"):
            pools.meshes[:] = (pools.meshes + [value])[-4:]
        elif item.op == "grant_ids" and isinstance(value, tuple) and len(value) == 2:
            pools.grants.append([value[0], value[0] + value[1]])
        elif item.op in ("call", "run_program", "new_array"):
            settled = value if isinstance(value, tuple) and not hasattr(value, "array_id") else (value,)
            pools.arrays[:] = (pools.arrays + [s.array_id for s in settled if hasattr(s, "array_id")])[-32:]

    def request(self, op: str, *args, timeout_s: float = 30.0):
        """A well-formed request, waited for (the setup's): its answer, or raises."""
        r = self.fresh_r()
        item = Input(op, fuzz_seam.encode({"r": r, "op": op, "a": list(args)}), r)
        self.send(item, expect=True)
        deadline = time.monotonic() + timeout_s
        while r in self.waiting and time.monotonic() < deadline:
            self.poll(50)
        if r in self.waiting:
            raise TimeoutError(f"bob's setup request {op} was not answered in {timeout_s:g} s")
        return item

    def setup(self) -> None:
        """Connect, and make what a client has: executors known, functions, a mesh, granted ids, arrays, a
        program (each learnt from its answer, as the templates' ids are not his on this connection)."""
        self.connect()
        self.waiting.clear()
        self.session_ended = False
        pools = self.pools
        pools.functions.clear(), pools.meshes.clear(), pools.grants.clear(), pools.arrays.clear()
        pools.programs.clear()
        self.request("ping")
        views = self._value_of("executors")
        pools.executor_ids = tuple(v.executor_id for v in views)
        if not self.pids:
            self.pids = {v.executor_id: v.pid for v in views}
            self.epochs = {v.executor_id: v.epoch for v in views}
        self.request("allocate_mesh", {"data": len(views)}, None)
        for message in self.templates:
            if message["op"] == "register_function":
                self.request("register_function", *message["a"])
        self.request("grant_ids", 4096)
        self.request("new_array", list(pools.executor_ids), len(views), 32)
        if pools.arrays:
            self.send(Input("landed", fuzz_seam.encode({"r": 0, "op": "landed", "a": [pools.arrays[-1], None]})))
        if pools.calls and pools.functions:
            spec = fuzz_seam.call_spec(_Plain(), pools)
            self.request("call", spec, pools.next_ids(spec.num_outputs))
            self.request("register_program", fuzz_seam.program_spec(_Plain(), pools))

    def _value_of(self, op: str):
        r = self.fresh_r()
        self.socket.send_multipart(fuzz_seam.encode({"r": r, "op": op, "a": []}))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self._keep_alive()
            if self.socket.poll(100):
                message = seam_codec.decode(self.socket.recv_multipart())
                if message.get("r") == r:
                    if "err" in message:
                        raise message["err"]
                    return message["ok"]
        raise TimeoutError(f"bob's {op} was not answered in 30 s")

    def settle(self, timeout_s: float) -> bool:
        """Wait for every awaited answer; False (a hang, recorded) if some did not come in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.waiting and time.monotonic() < deadline:
            self.poll(20)
        if not self.waiting:
            return True
        first = min(self.waiting.values(), key=lambda w: w[1])
        # The worker serves in order: the culprit is the first unanswered request or one sent just before it with
        # r = 0 (no answer to wait for), after the last one answered.
        suspects = [f"#{i} {_shown(item)}" for i, item in self.recent if self.last_answered < i < first[1]][-5:]
        self.hangs.append({"first_unanswered": first[0].op, "index": first[1], "note": first[0].note,
                           "message": _shown(first[0]), "sent_just_before_without_answer": suspects,
                           "unanswered": len(self.waiting), "connection_drops": self.connection_drops})
        self.tally[first[0].op]["hung (no answer)"] += 1
        for item, index in self.waiting.values():
            if index != first[1]:
                self.tally[item.op]["queued behind a hang"] += 1
        self.waiting.clear()
        return False


class _Plain:
    """The choices of a legit request: always the first option (its own function, mesh and arrays)."""

    def integer(self, low: int, high: int) -> int:
        return low

    def choice(self, options):
        return options[0]


def _reason(error: BaseException) -> str:
    """An error grouped by its type and first words (numbers and quoted names folded)."""
    text = re.sub(r"'[^']*'", "'…'", str(error))
    text = re.sub(r"\d+", "N", text)
    return f"{type(error).__name__}: {' '.join(text.split()[:6])[:70]}"


def _shown(item: Input) -> str:
    sizes = [len(f) for f in item.frames]
    head = bytes(item.frames[0][:300]).decode("utf-8", "replace")
    return f"{head}{'…' if sizes[0] > 300 else ''} (frames of {sizes} bytes){' ' + item.note if item.note else ''}"
