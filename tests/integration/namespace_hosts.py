"""Hosts for the multi-host launch test (not a test): each a Linux network namespace with its own address on a
bridge, and a private mount namespace with its own ``/tmp`` holding only its own key folder.

`NamespaceHosts(count, shaped={1: rate})` makes ``pathways-host-<pid>-<k>`` namespaces, each joined to a bridge
in the root namespace by a veth pair (10.214.N.(k+1)/24), ``tc tbf`` on both ends of a host's pair where a rate
is given (the link between islands: every byte to or from that host crosses it). `launch(k, argv, keys)` runs
``argv`` as host k: inside its network namespace, in a new mount namespace whose ``/tmp`` is an empty tmpfs into
which `private_host.py` first copies ``keys`` (``{keys}`` in argv names it there). `close` kills whatever is
left and deletes everything; `pids(k)` lists what still runs in host k.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

__all__ = ["NamespaceHosts", "unavailable"]

PREFIX = "pathways-host-"
_PRIVATE_HOST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "private_host.py")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return f"not root (euid {os.geteuid()}): network and mount namespaces need root"
    for tool in ("ip", "tc", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


class NamespaceHosts:
    def __init__(self, count: int, shaped: dict[int, float] | None = None):
        self.count, pid = count, os.getpid()
        self.names = [f"{PREFIX}{pid}-{k}" for k in range(count)]
        self.bridge = f"pwhb{pid % 100000}"
        self.subnet = f"10.214.{pid % 200 + 20}"
        self._veths = [f"pwh{pid % 100000}x{k}" for k in range(count)]
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "link", "set", self.bridge, "up")
            for k, (name, veth) in enumerate(zip(self.names, self._veths)):
                _run("ip", "netns", "add", name)
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
                _run("ip", "link", "set", veth, "master", self.bridge, "up")
                _run("ip", "-n", name, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
                _run("ip", "-n", name, "link", "set", "eth0", "up")
                _run("ip", "-n", name, "link", "set", "lo", "up")
                rate = (shaped or {}).get(k)
                if rate:   # both directions of this host's traffic: its pair's two egresses
                    tbf = ("tbf", "rate", f"{int(rate * 8)}bit", "burst", "256kb", "latency", "200ms")
                    _run("tc", "qdisc", "add", "dev", veth, "root", *tbf)
                    _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf)
        except BaseException:
            self.close()
            raise

    def address(self, k: int) -> str:
        return f"{self.subnet}.{k + 1}"

    def launch(self, k: int, argv: list[str], keys: str, keep: tuple[str, ...] = (), **popen) -> subprocess.Popen:
        """Run ``argv`` as host k, with ``keys`` copied into its private /tmp (``{keys}`` in argv); ``keep``: the
        folders under /tmp it must still see (the checkout; the interpreter's are added)."""
        keep = (*keep, sys.prefix, os.path.dirname(os.path.abspath(__file__)))
        return subprocess.Popen(["ip", "netns", "exec", self.names[k], "unshare", "--mount", "--propagation",
                                 "private", sys.executable, _PRIVATE_HOST, keys, *keep, "--", *argv], **popen)

    def pids(self, k: int) -> list[int]:
        done = subprocess.run(["ip", "netns", "pids", self.names[k]], capture_output=True, text=True)
        return [int(p) for p in done.stdout.split()]

    def tbf_sent_bytes(self, k: int) -> int:
        out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", self._veths[k]], capture_output=True,
                             text=True).stdout
        for line in out.splitlines():
            if line.strip().startswith("Sent "):
                return int(line.split()[1])
        return 0

    def close(self) -> None:
        for k in range(self.count):
            for pid in self.pids(k):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
