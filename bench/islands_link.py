"""bench/islands.py's link model: the bytes a step sends between islands, what a link's shape adds to a step, and
what a lone relay of that shape delivers."""

from __future__ import annotations

import time

import pathways_torch as pw


def expected_link_bytes(num_islands: int, gradient_bytes: int) -> int:
    """Bytes crossing the link per step: every executor sends its 1/D slice of G to its I - 1 counterparts."""
    return num_islands * (num_islands - 1) * gradient_bytes


def modelled_link_s(link: pw.Link | None, bytes_one_way: float, rate: float | None = None) -> float:
    """What the link's shape adds to a step, in the model: the one-way delay plus one direction's bytes at
    ``rate`` (default the link's nominal bandwidth; both directions run at once)."""
    if link is None:
        return 0.0
    rate = rate or link.bandwidth_bytes_per_s
    return link.delay_s + (bytes_one_way / rate if rate else 0.0)


def relay_rate(link: pw.Link, num_bytes: int) -> float:
    """Bytes per second that a `LinkRelay` of ``link`` delivers from one loopback socket to another (one
    direction, one connection, ``num_bytes`` written at once): what the shape achieves, without executors."""
    import socket
    import threading

    from pathways_torch.local.link import LinkRelay

    server = socket.create_server(("127.0.0.1", 0))
    relay = LinkRelay(link)
    done = []
    try:
        host, port = relay.add(f"tcp://127.0.0.1:{server.getsockname()[1]}").removeprefix("tcp://").rsplit(":", 1)

        def sink():
            connection, _ = server.accept()
            with connection:
                received = 0
                while received < num_bytes:
                    data = connection.recv(1 << 20)
                    if not data:
                        break
                    received += len(data)
                done.append((received, time.perf_counter()))

        reader = threading.Thread(target=sink, daemon=True)
        reader.start()
        with socket.create_connection((host, int(port))) as sender:
            began = time.perf_counter()
            sender.sendall(b"\0" * num_bytes)
            reader.join(60)
    finally:
        relay.close()
        server.close()
    if not done or done[0][0] < num_bytes:
        raise RuntimeError(f"relay_rate: {link}: {done[0][0] if done else 0} of {num_bytes} bytes arrived in 60 s")
    return num_bytes / (done[0][1] - began)
