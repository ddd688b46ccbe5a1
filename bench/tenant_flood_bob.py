"""Bob, the flooding tenant of `bench.tenant_flood`: a process of his own (his CPU is a tenant's, not the
benchmark's) on a raw DEALER with his own client key.

Asked on stdin (a JSON line each: ``{"flood": "big", "nbytes": N, "timeout_s": T}`` or ``{"flood": "junk", "count":
N, "timeout_s": T}``), he connects, sends the flood and then a probe request, pings every heartbeat interval as a
client library does, and reports on stdout (``FLOOD {json}``) when the probe was answered or he was cut off, with a
tally of what came back.

    .venv/bin/python -m bench.tenant_flood_bob KEYS_DIR ADDRESS
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

__all__ = ["junk_messages", "big_message", "answer_label", "flood", "MARK", "PROBE_ID"]

MARK = "FLOOD "               # bob's protocol lines on his stdout start with this
HEARTBEAT_INTERVAL_S = 0.2    # his pings, as often as alice's context pings
BIG_ID, PROBE_ID, FIRST_JUNK_ID = 7, 99, 1000
PING = [b'{"$d":[["r",0],["op","ping"],["a",[]]]}']


def junk_messages(count: int) -> list[list[bytes]]:
    """``count`` small junk messages, four kinds in turn: not JSON (no answer possible), an unknown op, a call with
    wrong arguments, a valid request with an extra frame; the last three carry request ids from `FIRST_JUNK_ID` on,
    so the controller answers each (with its error)."""
    out = []
    for i in range(count):
        r = FIRST_JUNK_ID + i
        out.append([[b"not json"],
                    [b'{"$d":[["r",%d],["op","nope"],["a",[]]]}' % r],
                    [b'{"$d":[["r",%d],["op","call"],["a",[1]]]}' % r],
                    [b'{"$d":[["r",%d],["op","executors"],["a",[]]]}' % r, b"extra"]][i % 4])
    return out


def big_message(nbytes: int, request_id: int = BIG_ID) -> list:
    """A request of ``nbytes`` bytes in all: a short JSON head, then one payload frame its argument refers to."""
    from pathways_torch.wire import seam_codec

    head = seam_codec.encode({"r": request_id, "op": "flush_frees", "a": [b"\0"]})[0]   # as with the payload
    return seam_codec.encode({"r": request_id, "op": "flush_frees", "a": [b"\0" * max(0, nbytes - len(head))]})


def answer_label(answer: dict) -> str:
    """What a reply to bob was, in a few words: ``ok``, an error's type and its first words, or an event."""
    if "ev" in answer:
        return f"event {answer['ev']}" + (f": {str(answer.get('why', ''))[:70]}" if answer.get("why") else "")
    if "err" in answer:
        error = answer["err"]
        return f"{type(error).__name__}: {' '.join(str(error).split()[:6])[:60]}"
    return "ok"


def bob_main(keys: str, address: str) -> int:
    """Serve floods asked for on stdin (a JSON line each), one ``FLOOD {json}`` line on stdout for each."""
    import zmq

    from bench.common import process_cpu_s
    from pathways_torch.wire.security import KeyDirectory

    directory = KeyDirectory(keys)
    credentials = directory.credentials(next(r for r in directory.public_keys() if r.startswith("client-")))
    zctx = zmq.Context()
    print(MARK + json.dumps({"op": "ready", "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        messages = [big_message(cmd["nbytes"])] if cmd["flood"] == "big" else junk_messages(cmd["count"])
        cpu = process_cpu_s(os.getpid())
        report = flood(zctx, address, credentials, messages, cmd["timeout_s"])
        report["bob_cpu_s"] = process_cpu_s(os.getpid()) - cpu
        print(MARK + json.dumps(report), flush=True)
    zctx.term()
    return 0


def _dealer(zctx, address: str, credentials):
    import zmq

    from pathways_torch.wire.security import make_client

    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)     # bob's sends never wait: the whole flood leaves at once
    sock.setsockopt(zmq.RCVHWM, 0)
    make_client(sock, credentials, credentials.public_key("controller"))
    sock.connect(address)
    return sock


def flood(zctx, address: str, credentials, messages: list, timeout_s: float) -> dict:
    """Connect (a ping answered: the handshake is done), send ``messages`` and the probe, then ping every
    heartbeat interval until the probe is answered, bob is disconnected, or ``timeout_s``; say goodbye."""
    from pathways_torch.wire import seam_codec

    sock = _dealer(zctx, address, credentials)
    sock.send_multipart(PING)
    if not sock.poll(int(timeout_s * 1000)):
        sock.close()
        return {"error": f"no answer to a ping within {timeout_s:g} s: the controller did not accept bob"}
    sock.recv_multipart()
    first = time.monotonic()
    for message in messages:
        sock.send_multipart(message)
    sock.send_multipart([b'{"$d":[["r",%d],["op","executors"],["a",[]]]}' % PROBE_ID])
    sent = time.monotonic()
    tally, end, outcome, next_ping = collections.Counter(), None, "timed out", sent
    while end is None and time.monotonic() < first + timeout_s:
        if time.monotonic() >= next_ping:
            sock.send_multipart(PING)
            next_ping += HEARTBEAT_INTERVAL_S
        while end is None and sock.poll(max(1, int(1000 * (next_ping - time.monotonic())))):
            answer = seam_codec.decode(sock.recv_multipart())
            tally["ping answered" if answer.get("r") == 0 and "ok" in answer else answer_label(answer)] += 1
            if answer.get("r") == PROBE_ID or answer.get("ev") == "disconnected":
                end = time.monotonic()
                outcome = "probe answered" if answer.get("r") == PROBE_ID else f"disconnected: {answer.get('why')}"
    sock.send_multipart([b'{"$d":[["r",0],["op","bye"],["a",[]]]}'])   # a clean goodbye before the next flood
    time.sleep(0.05)
    sock.close()
    return {"first_sent": first, "all_sent": sent, "end": end or time.monotonic(), "outcome": outcome,
            "answers": dict(tally), "messages": len(messages)}


if __name__ == "__main__":
    sys.exit(bob_main(*sys.argv[1:3]))
