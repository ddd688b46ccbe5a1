"""A private network namespace joined to the root one by a veth pair that ``tc tbf`` shapes on both ends: the
kernel's rate limit for the link between islands (`LinkRelay` with shaping "tbf").

Why a namespace: tbf shapes a device's egress, and loopback carries every other socket of the host (the
controller, transfers inside an island); a veth pair carries only what is sent to its far end's address, so
only what crosses islands is shaped. Why both ends: one end's egress is one direction of the link.

Needs root and iproute2 (``ip``, ``tc``). The delay is not the kernel's (netem is missing on the machines this
was built on): the relay adds it. Every namespace is named ``pathways-link-<pid>-<n>``; one whose process is
gone (a crashed run) is deleted when the next one is made, and no other name is ever touched.
"""

from __future__ import annotations

import ctypes
import ipaddress
import itertools
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import weakref

from ..wire.process_state import is_alive

__all__ = ["TbfVeth", "TbfUnavailable", "NAMESPACE_PREFIX", "tbf_unavailable", "remove_stale_namespaces"]

log = logging.getLogger(__name__)

NAMESPACE_PREFIX = "pathways-link-"
_OURS = re.compile(rf"^{re.escape(NAMESPACE_PREFIX)}(\d+)-(\d+)$")
_NETNS_DIR = "/var/run/netns"          # where `ip netns add` mounts a namespace (iproute2's NETNS_RUN_DIR)
_CLONE_NEWNET = 0x40000000
_SUBNETS = ipaddress.ip_network("10.213.0.0/16")   # one /30 per pair, skipping any network the host routes
# Fewer, larger packets: tbf counts the headers too (4.6 % of a 1500-byte packet, 0.7 % of 9000; measured 3.88
# and 4.03 MB/s of payload through a 4 MB/s tbf). The relay's burst (>= 64 KiB) still holds one packet.
_MTU = 9000
# How long tbf may queue: TCP here may put 4 MiB of one socket in a qdisc (net.ipv4.tcp_limit_output_bytes);
# 50 ms dropped 260 packets of a 4 MiB transfer at 4 MB/s, 200 ms none (measured).
_LATENCY = "200ms"
_NS_DEVICE = "pwl0"                   # the namespace's end: the namespace is private, any name is free there
_numbers = itertools.count()
_lock = threading.Lock()              # one pair configured at a time in this process: subnets stay distinct


class TbfUnavailable(Exception):
    """tbf shaping cannot be set up by this process; the message says why (the failing command, its stderr)."""


def tbf_unavailable() -> str | None:
    """Why this process cannot shape with tbf (None: it may try; `ip netns add` has the last word)."""
    if os.geteuid() != 0:
        return f"not root (euid {os.geteuid()}): network namespaces and tc qdiscs need root"
    for tool in ("ip", "tc"):
        if _tool_path(tool) is None:
            return f"`{tool}` is not in {':'.join(_SYSTEM_DIRS)} (it comes with iproute2)"
    return None


def remove_stale_namespaces() -> list[str]:
    """Delete the ``pathways-link-<pid>-<n>`` namespaces whose process is gone; return their names."""
    removed = []
    for name in _namespaces():
        match = _OURS.match(name)
        if match and not is_alive(int(match.group(1))):
            if _command("ip", "netns", "delete", name).returncode == 0:
                removed.append(name)
    if removed:
        log.info("deleted %d network namespace(s) left by runs that are gone: %s", len(removed), ", ".join(removed))
    return removed


class TbfVeth:
    """One namespace, a veth pair into it, and tbf at ``rate_bytes_per_s`` on both ends' egress.

    ``root_address`` is the root namespace's end, ``ns_address`` the namespace's: a socket in the root
    namespace that connects to ``ns_address`` sends over the root end (shaped), and what comes back leaves
    through the namespace's end (shaped). `listen` makes the namespace's listening sockets."""

    def __init__(self, namespace: str, root_device: str, root_address: str, ns_address: str,
                 rate_bytes_per_s: float, burst_bytes: int):
        self.namespace, self.root_device, self.ns_device = namespace, root_device, _NS_DEVICE
        self.root_address, self.ns_address = root_address, ns_address
        self.rate_bytes_per_s, self.burst_bytes = rate_bytes_per_s, burst_bytes
        # Runs once: from close(), or at interpreter exit for a relay never closed (in this process only: a
        # forked child exiting must not delete its parent's namespace).
        self._finalizer = weakref.finalize(self, _delete, namespace, root_device, os.getpid())

    @classmethod
    def create(cls, rate_bytes_per_s: float, burst_bytes: int) -> "TbfVeth":
        """Make the namespace and the shaped pair; raise `TbfUnavailable` (nothing left behind) if it cannot."""
        reason = tbf_unavailable()
        if reason is not None:
            raise TbfUnavailable(reason)
        remove_stale_namespaces()
        with _lock:
            namespace, root_device = _fresh_names()
            root_address, ns_address = _free_subnet()
            _check("ip", "netns", "add", namespace)
            veth = cls(namespace, root_device, root_address, ns_address, rate_bytes_per_s, burst_bytes)
            try:                                   # from here on close() (or the exit) deletes the namespace
                veth.configure()
            except BaseException:
                veth.close()
                raise
        return veth

    def listen(self) -> socket.socket:
        """A TCP socket listening on ``ns_address`` (any port), made inside the namespace: a socket keeps the
        namespace it was made in, so the relay thread, which stays in the root namespace, can serve it."""
        made: dict = {}

        def inside():
            # A thread of its own: setns moves only the calling thread, and this one ends right after.
            try:
                _enter(self.namespace)
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((self.ns_address, 0))
                listener.listen(64)
                made["socket"] = listener
            except BaseException as error:            # re-raised on the caller's thread
                made["error"] = error

        helper = threading.Thread(target=inside, name="pathways-link-netns", daemon=True)
        helper.start()
        helper.join()
        if "error" in made:
            raise made["error"]
        return made["socket"]

    def close(self) -> None:
        """Delete the pair and the namespace. Close the namespace's sockets first: each keeps it alive."""
        self._finalizer()

    def __repr__(self) -> str:
        return (f"TbfVeth({self.root_device} {self.root_address} <-> {self.ns_device} {self.ns_address} in "
                f"{self.namespace}, tbf {self.rate_bytes_per_s / 1e6:g} MB/s both ways)")

    def configure(self) -> None:
        """Make the veth pair, address both ends and shape both ways (the namespace exists)."""
        ns = ("-n", self.namespace)
        _check("ip", "link", "add", self.root_device, "mtu", str(_MTU), "type", "veth",
               "peer", "name", self.ns_device, "mtu", str(_MTU), "netns", self.namespace)
        _check("ip", "addr", "add", f"{self.root_address}/30", "dev", self.root_device)
        _check("ip", *ns, "addr", "add", f"{self.ns_address}/30", "dev", self.ns_device)
        _check("ip", "link", "set", self.root_device, "up")
        _check("ip", *ns, "link", "set", self.ns_device, "up")
        _check("ip", *ns, "link", "set", "lo", "up")
        tbf = ("root", "tbf", "rate", f"{int(self.rate_bytes_per_s * 8)}bit", "burst", str(self.burst_bytes),
               "latency", _LATENCY)
        _check("tc", "qdisc", "add", "dev", self.root_device, *tbf)
        _check("tc", *ns, "qdisc", "add", "dev", self.ns_device, *tbf)


# ---------------------------------------------------------------- commands and names

# Where iproute2 lives. Not PATH: these commands run as root, and a PATH entry someone else can write to would
# run their `ip` instead.
_SYSTEM_DIRS = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")


def _tool_path(tool: str) -> str | None:
    return shutil.which(tool, path=os.pathsep.join(_SYSTEM_DIRS))


def _command(*argv: str) -> subprocess.CompletedProcess:
    """Run one iproute2 command, from the system's folders (tests replace this to fake a host where it fails)."""
    path = _tool_path(argv[0])
    if path is None:
        raise FileNotFoundError(f"`{argv[0]}`: expected it in {':'.join(_SYSTEM_DIRS)} (iproute2), found none there")
    return subprocess.run((path, *argv[1:]), capture_output=True, text=True, timeout=10)


def _check(*argv: str) -> str:
    command = " ".join(argv)
    try:
        done = _command(*argv)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise TbfUnavailable(f"`{command}` could not run: {error}") from error
    if done.returncode != 0:
        raise TbfUnavailable(f"`{command}` failed (exit {done.returncode}): "
                             f"{(done.stderr or '').strip() or '(nothing on stderr)'}")
    return done.stdout


def _delete(namespace: str, root_device: str, owner_pid: int | None = None) -> None:
    if owner_pid is not None and owner_pid != os.getpid():
        return
    # The pair first: deleting the namespace removes it too, but only once the namespace's last socket is
    # gone; deleting the root end removes both ends now.
    for argv in (("ip", "link", "delete", root_device), ("ip", "netns", "delete", namespace)):
        try:
            done = _command(*argv)
        except (OSError, subprocess.TimeoutExpired) as error:
            log.warning("could not run `%s`: %s", " ".join(argv), error)
            continue
        if done.returncode != 0 and argv[1] == "netns":
            log.warning("`%s` failed: %s", " ".join(argv), (done.stderr or "").strip())


def _namespaces() -> list[str]:
    done = _command("ip", "netns", "list")
    # Lines look like "pathways-link-123-0 (id: 3)".
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []



def _fresh_names() -> tuple[str, str]:
    """A namespace name not in use, and its root-side device (at most 15 characters: hex pid, number)."""
    pid, taken = os.getpid(), set(_namespaces())
    while True:
        number = next(_numbers)
        namespace = f"{NAMESPACE_PREFIX}{pid}-{number}"
        if namespace not in taken:
            device = f"pwl{pid:x}.{number}"
            assert len(device) <= 15, device          # Linux's IFNAMSIZ; a pid is at most 6 hex digits
            return namespace, device


def _free_subnet() -> tuple[str, str]:
    """Two addresses of a /30 in 10.213.0.0/16 that overlaps no address or route of the root namespace."""
    used = _networks_in_use()
    blocks = list(_SUBNETS.subnets(new_prefix=30))
    start = (os.getpid() * 61) % len(blocks)          # processes making pairs at once start far apart
    for i in range(len(blocks)):
        block = blocks[(start + i) % len(blocks)]
        if not any(block.overlaps(network) for network in used):
            first, second = list(block.hosts())
            return str(first), str(second)
    raise TbfUnavailable(f"no free /30 in {_SUBNETS}: every one overlaps an address or route of this host")


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    used = []
    for line in _check("ip", "-o", "-4", "addr", "show").splitlines():
        words = line.split()
        if "inet" in words:
            used.append(ipaddress.ip_interface(words[words.index("inet") + 1]).network)
    for line in _check("ip", "-4", "route", "show", "table", "all").splitlines():
        for word in line.split()[:2]:             # "10.0.0.0/8 dev ...", "local 127.0.0.1 dev lo ...", "default via"
            try:
                used.append(ipaddress.ip_network(word, strict=False))
                break
            except ValueError:
                continue
    return used


def _enter(namespace: str) -> None:
    """Move the calling thread into ``namespace`` (Python 3.11 has no os.setns)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(_NETNS_DIR, namespace), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {namespace}: {os.strerror(errno)}")
    finally:
        os.close(fd)
