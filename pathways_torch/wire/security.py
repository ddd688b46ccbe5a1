"""CURVE keys, allow-lists and authenticated sockets for every ZeroMQ connection.

Executors run code the controller sends, so every socket of the controller, the
executors and the client's data plane speaks CURVE, and a server socket admits a
peer only if its public key is on an allow-list made by the launcher
(``CURVE_ALLOW_ANY`` encrypts but admits anyone: not enough). See docs/security.md.

A *key directory* holds one key pair per *role* (``controller``, ``client``,
each executor id)::

    DIR/            mode 0700
      public/ROLE.key          every role's public key: the allow-list
      secret/ROLE.key_secret   each role's key pair (a host needs only its own)

A `Gatekeeper` runs the ZAP handler of one ``zmq.Context``: it admits exactly
the allow-listed keys and names each admitted connection by its role (the
``User-Id`` property of every message received on it), so a receiver can check
that a peer speaks only as itself.

This module imports no torch (the controller and the simulated executor use it).
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import logging
import os
import re
import shutil
import stat
import struct
import tempfile
from typing import Callable, Iterable, Mapping

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from .put_tokens import PUT_SECRET_BYTES, put_token
from .threads import threads_leave_signals

__all__ = [
    "CONTROLLER", "CLIENT", "ZAP_DOMAIN", "HEARTBEAT_SUFFIX", "STORE_SUFFIX", "SecurityError", "KeyPair", "Credentials", "KeyDirectory",
    "Gatekeeper", "make_server", "make_client", "check_role", "peer_role", "peer_key", "ConnectionWatch",
    "HANDSHAKE_FAILURES", "INCARNATION_MARK", "identity_nonce", "split_identity", "spare_role", "spare_of", "without_replaced_keys",
    "CLIENT_PREFIX", "CLIENT_NAME", "client_name", "is_client", "owner_role", "put_token", "PUT_SECRET_BYTES",
]

log = logging.getLogger(__name__)

CONTROLLER = "controller"
CLIENT = "client"
ZAP_DOMAIN = "pathways"
# An executor's heartbeat connection has ROUTER identity "<executor id>#heartbeat"; roles never contain '#'.
HEARTBEAT_SUFFIX = "#heartbeat"
STORE_SUFFIX = "#store"       # an executor's connection to the controller's rendezvous store
# Each process appends "~<nonce>" to its identities: an old incarnation of an executor that still holds its
# connections (stopped, not dead) and its replacement never share a ROUTER identity (ZeroMQ would refuse the
# replacement's connection while the old one's stays open).
INCARNATION_MARK = "~"


# The clients of a standalone controller (`pathways-controller`): role "client-<name>", one key each
# (`pathways_torch.launch.service_keys` makes them). The embedded run's one client is plain "client".
CLIENT_PREFIX = "client-"
CLIENT_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def client_name(role: str | None) -> str | None:
    """The client name of ``role``: ``"client-alice"`` → ``"alice"``; None for any other role (the embedded
    run's ``"client"``, an executor, the controller, None)."""
    if not isinstance(role, str) or not role.startswith(CLIENT_PREFIX):
        return None
    name = role[len(CLIENT_PREFIX):]
    return name if CLIENT_NAME.match(name) else None


def is_client(role: str | None) -> bool:
    """Whether ``role`` is a client's: the embedded run's ``"client"`` or a service client's ``"client-<name>"``."""
    return role == CLIENT or client_name(role) is not None


def owner_role(owner: str) -> str:
    """The role of the client the controller calls ``owner`` (`controller.arrays.ArrayRecord.owner`): ``""`` (the
    embedded client) → ``"client"``, ``"alice"`` → ``"client-alice"``. Executors know clients by role alone."""
    return CLIENT_PREFIX + owner if owner else CLIENT


_SPARE_MARK = ".r"


def spare_role(executor_id: str, number: int) -> str:
    """The role of ``executor_id``'s spare key pair ``number`` (1, 2 ...), ``executor-1.r1``: a replacement started
    on the executor's node uses the next one (`pathways_torch.launch.keys`)."""
    return f"{executor_id}{_SPARE_MARK}{number}"


def spare_of(role: str) -> str | None:
    """The executor id a spare role belongs to (``executor-1.r2`` → ``executor-1``); None for any other role."""
    base, mark, number = role.rpartition(_SPARE_MARK)
    return base if mark and base and number.isdigit() else None


def _spare_number(role: str, executor_id: str) -> int | None:
    """``n`` of ``executor_id``'s spare role ``<executor_id>.r<n>``; None for any other role."""
    return int(role.rpartition(_SPARE_MARK)[2]) if spare_of(role) == executor_id else None


def without_replaced_keys(allowed: Mapping[str, bytes], executor_id: str, role: str) -> dict[str, bytes]:
    """The allow-list of a replacement speaking for ``executor_id`` with key ``role`` (a spare): without the id's
    other keys, those of the incarnations it replaces (a stopped one that is continued must not reach it)."""
    return {r: key for r, key in allowed.items()
            if r == role or (r != executor_id and spare_of(r) != executor_id)}


def identity_nonce(identity: str) -> str:
    """``"executor-1#heartbeat~3f2a"`` → ``"3f2a"``: the process its connections belong to ("" if none given)."""
    return identity.partition(INCARNATION_MARK)[2]


def split_identity(identity: str) -> tuple[str, str]:
    """``"executor-1#heartbeat~3f2a"`` → ``("executor-1", "#heartbeat")``; the plain control identity → ``(id, "")``."""
    base = identity.split(INCARNATION_MARK, 1)[0]
    for suffix in (HEARTBEAT_SUFFIX, STORE_SUFFIX):
        if base.endswith(suffix):
            return base[:-len(suffix)], suffix
    return base, ""

# Role names become file names and ROUTER identities: keep them plain.
_ROLE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_Z85_KEY_LENGTH = 40

# Monitor events that mean a connection was refused during the CURVE handshake.
HANDSHAKE_FAILURES = frozenset({"HANDSHAKE_FAILED_AUTH", "HANDSHAKE_FAILED_PROTOCOL", "HANDSHAKE_FAILED_NO_DETAIL"})


class SecurityError(RuntimeError):
    """Keys or a key directory that cannot be used as they are; the message names the fix."""


def check_role(role: str) -> str:
    """Return ``role`` if it can name a key (and a ROUTER identity); raise otherwise."""
    if not isinstance(role, str) or not _ROLE.match(role):
        raise SecurityError(f"role: expected letters, digits, '_', '.' or '-' (at most 64, not starting with "
                            f"a symbol), got {role!r}; rename the executor")
    return role


def _check_key(key: bytes, what: str) -> bytes:
    if not isinstance(key, bytes) or len(key) != _Z85_KEY_LENGTH:
        raise SecurityError(f"{what}: expected a {_Z85_KEY_LENGTH}-character Z85 CURVE public key, got {key!r}")
    return key


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyPair:
    """One CURVE key pair, Z85-encoded. The secret never appears in ``repr``."""

    public: bytes
    secret: bytes = dataclasses.field(repr=False)

    def __post_init__(self):
        _check_key(self.public, "public key")
        if not isinstance(self.secret, bytes) or len(self.secret) != _Z85_KEY_LENGTH:
            raise SecurityError("secret key: expected a 40-character Z85 CURVE secret key; "
                                "regenerate the key directory")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Credentials:
    """What one process needs to speak CURVE: its role, its key pair, and the public keys it admits."""

    role: str
    keys: KeyPair
    allowed: Mapping[str, bytes]   # role → public key: the allow-list

    def __post_init__(self):
        check_role(self.role)
        for role, key in self.allowed.items():
            _check_key(key, f"allow-listed key of {role!r}")

    def public_key(self, role: str) -> bytes:
        """The allow-listed public key of ``role``."""
        key = self.allowed.get(role)
        if key is None:
            raise SecurityError(f"no public key for {role!r} on the allow-list (known: {sorted(self.allowed)}); "
                                f"the launcher must create one for every role")
        return key


class KeyDirectory:
    """The launcher's key pairs on disk: ``public/ROLE.key`` and ``secret/ROLE.key_secret``."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self._public = os.path.join(self.path, "public")
        self._secret = os.path.join(self.path, "secret")
        for directory in (self.path, self._public, self._secret):
            _check_private(directory)

    @classmethod
    def create(cls, roles: Iterable[str], parent: str | None = None) -> "KeyDirectory":
        """A new private directory (mode 0700) with a fresh key pair for each role."""
        roles = [check_role(r) for r in roles]
        if len(set(roles)) != len(roles):
            raise SecurityError(f"roles: expected distinct names, got {roles}")
        path = tempfile.mkdtemp(prefix="pathways-keys-", dir=parent)  # mkdtemp makes it 0700
        for sub in ("public", "secret"):
            os.mkdir(os.path.join(path, sub), 0o700)
        keys = cls(path)
        for role in roles:
            keys.add(role)
        return keys

    def add(self, role: str) -> KeyPair:
        """Create a key pair for ``role`` (a new executor); running processes do not see it."""
        check_role(role)
        if os.path.exists(self._public_file(role)):
            raise SecurityError(f"role {role!r} already has a key in {self.path}")
        public_file, secret_file = zmq.auth.create_certificates(self._secret, role)
        os.chmod(secret_file, 0o600)
        os.replace(public_file, self._public_file(role))
        return self.keypair(role)

    def add_public(self, role: str, public_key: bytes) -> None:
        """Allow-list ``role`` with ``public_key`` alone (no secret here): another process holds the pair."""
        from zmq.auth.certs import _write_key_file

        _check_key(public_key, f"public key of {check_role(role)!r}")
        _write_key_file(self._public_file(role), "pathways_torch allow-listed public key", public_key)

    def keypair(self, role: str) -> KeyPair:
        """The key pair of ``role``, read from ``secret/ROLE.key_secret``."""
        path = os.path.join(self._secret, f"{check_role(role)}.key_secret")
        if not os.path.exists(path):
            raise SecurityError(f"expected a secret key for {role!r} at {path}, found none; "
                                f"the launcher must create it (and copy it to this host)")
        public, secret = zmq.auth.load_certificate(path)
        if secret is None:
            raise SecurityError(f"{path} holds no secret key; regenerate the key directory")
        return KeyPair(public=public, secret=secret)

    def public_keys(self) -> dict[str, bytes]:
        """Every role's public key (the allow-list), by role."""
        keys = {}
        for name in sorted(os.listdir(self._public)):
            if name.endswith(".key"):
                role = check_role(name[:-len(".key")])
                keys[role] = _check_key(zmq.auth.load_certificate(os.path.join(self._public, name))[0],
                                        f"public key in {name}")
        return keys

    def credentials(self, role: str) -> Credentials:
        """``role``'s key pair and the allow-list of every role in this directory."""
        return Credentials(role=role, keys=self.keypair(role), allowed=self.public_keys())

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def _public_file(self, role: str) -> str:
        return os.path.join(self._public, f"{role}.key")

    def __repr__(self) -> str:
        return f"KeyDirectory({self.path!r})"


def _check_private(directory: str) -> None:
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        raise SecurityError(f"key directory {directory} does not exist; expected the launcher's "
                            f"directory with public/ and secret/ (pass --keys DIR)") from None
    if not stat.S_ISDIR(info.st_mode):
        raise SecurityError(f"key directory {directory} is not a directory")
    if info.st_mode & 0o077 or info.st_uid != os.getuid():
        raise SecurityError(f"key directory {directory} has mode {stat.S_IMODE(info.st_mode):04o} and owner "
                            f"{info.st_uid}; expected 0700 and owner {os.getuid()}: fix with chmod 700 {directory}")


# ---------------------------------------------------------------- the ZAP handler


class _RoleAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread, naming each admitted connection by its role instead of its key, and attaching the key
    itself as the connection's ``X-Key`` property: a replaced incarnation and its replacement share a role, and
    only the key tells the old one's open connections from the new one's (`peer_key`)."""

    def __init__(self, context: zmq.Context, roles: Mapping[bytes, str]):
        super().__init__(context, log=logging.getLogger(f"{__name__}.zap"))
        self._roles = roles
        self._admitted_key = b""   # the key of the handshake being answered (the ZAP thread answers one at a time)

    def curve_user_id(self, client_public_key: bytes) -> str:
        self._admitted_key = zmq.utils.z85.encode(client_public_key)
        return self._roles[self._admitted_key]

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, status_text: bytes,
                        user_id: str = "anonymous") -> None:
        """pyzmq's reply, with the admitted key as ZAP metadata (ZMTP properties: 1-byte name length, name, 4-byte
        value length, value), which libzmq puts on every message of the connection."""
        admitted = status_code == b"200"
        user = user_id.encode() if admitted and isinstance(user_id, str) else (user_id if admitted else b"")
        metadata = b""
        if admitted and self._admitted_key:
            metadata = bytes([len(_KEY_PROPERTY)]) + _KEY_PROPERTY + struct.pack(">I", len(self._admitted_key)) + \
                self._admitted_key
        self._admitted_key = b""
        self.zap_socket.send_multipart([b"1.0", request_id, status_code, status_text, user, metadata])


_KEY_PROPERTY = b"X-Key"


class Gatekeeper:
    """Admits exactly the allow-listed public keys on every CURVE server socket of one ``zmq.Context``.

    There is one ZAP handler per context, so there is one `Gatekeeper` per
    context; server sockets also set ``ZAP_ENFORCE_DOMAIN``, so if it is not
    running they refuse everyone rather than admit everyone.
    """

    def __init__(self, context: zmq.Context, allowed: Mapping[str, bytes]):
        self._roles = {_check_key(key, f"key of {role!r}"): role for role, key in allowed.items()}
        self.refused = 0
        self._auth = _RoleAuthenticator(context, self._roles)
        with threads_leave_signals():
            self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, self)

    def admit(self, role: str, public_key: bytes) -> None:
        """Admit ``public_key`` as ``role`` from now on, revoking the role's previous key (a replacement executor's
        fresh pair). Connections already made keep their role; new handshakes with the old key fail. Any thread."""
        key = _check_key(public_key, f"key of {role!r}")
        # A spare key (`executor-1.r3`) replaces the role's own and the spares before it: an executor started after
        # an earlier replacement still lists that one's key under its spare role (`executor-1.r2`). Later spares
        # stay: the launcher may start them before this process hears of them.
        rank = _spare_number(self._roles.get(key, ""), role)
        for old in [k for k, r in self._roles.items() if k != key and (
                r == role or (rank is not None and (_spare_number(r, role) or rank) < rank))]:
            self._roles.pop(old, None)
        self._roles[key] = role

    def admits(self, public_key: bytes) -> bool:
        """Whether ``public_key`` (Z85) is on the allow-list now: False for a replaced incarnation's revoked key,
        whose connections made before still deliver (`peer_key` tells their messages apart). Any thread."""
        return public_key in self._roles

    def revoke(self, public_key: bytes) -> None:
        """Refuse ``public_key`` from now on (a replaced incarnation's); connections made before keep working."""
        self._roles.pop(public_key, None)

    def callback(self, domain: str, key: bytes) -> bool:
        """Called by the ZAP thread for each CURVE handshake: is ``key`` (Z85) on the allow-list?"""
        if key in self._roles:
            return True
        self.refused += 1
        if self.refused <= 3 or self.refused % 100 == 0:
            log.warning("refused a connection with a key that is not on the allow-list (%s; %d refused so far)",
                        key.decode(errors="replace"), self.refused)
        return False

    def stop(self) -> None:
        self._auth.stop()


# ---------------------------------------------------------------- sockets

LISTEN_BACKLOG = 4096   # connections waiting to be accepted on a server socket (make_server)


def make_server(socket: zmq.Socket, credentials: Credentials) -> zmq.Socket:
    """Make ``socket`` a CURVE server that admits only what its context's `Gatekeeper` allows."""
    socket.curve_server = True
    socket.curve_publickey = credentials.keys.public
    socket.curve_secretkey = credentials.keys.secret
    socket.zap_domain = ZAP_DOMAIN.encode()
    socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler → refuse, never admit
    # The controller's one socket takes three connections per executor. libzmq's listen backlog of 100 overflowed
    # 15,186 times in one start of 1,024 executors, and each dropped SYN is retried after 1, 3, 7, 15 s: executors
    # registered late and were declared silent. The kernel caps it at net.core.somaxconn (4,096 here).
    socket.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
    return socket


def make_client(socket: zmq.Socket, credentials: Credentials, server_key: bytes) -> zmq.Socket:
    """Make ``socket`` a CURVE client that talks only to the holder of ``server_key``'s secret."""
    socket.curve_serverkey = _check_key(server_key, "server key")
    socket.curve_publickey = credentials.keys.public
    socket.curve_secretkey = credentials.keys.secret
    return socket


def peer_key(frame) -> bytes | None:
    """The public key (Z85) that a received frame's connection authenticated with, or None."""
    try:
        key = frame.get(_KEY_PROPERTY.decode())
    except (AttributeError, zmq.ZMQError):
        return None
    return key.encode() if isinstance(key, str) else key


def peer_role(frame) -> str | None:
    """The role of the peer that sent a received frame (from its authenticated connection), or None."""
    try:
        return frame.get("User-Id")
    except (AttributeError, zmq.ZMQError):
        return None


# ---------------------------------------------------------------- connection events


class ConnectionWatch:
    """Counts a socket's connection events and logs refused handshakes (rate-limited).

    Fed by a socket monitor (`SocketLoop.monitor`); ``on_event(event, watch)``
    runs after each event is counted.
    """

    def __init__(self, name: str, on_event: Callable[[str, "ConnectionWatch"], None] | None = None):
        self.name = name
        self.events: collections.Counter = collections.Counter()
        self._on_event = on_event
        self._failures_in_a_row = 0
        self._last_failure = ""

    @property
    def refused(self) -> int:
        """Accepted connections (of a bound socket) that never completed a CURVE handshake.

        A key not on the allow-list, the NULL mechanism, or bytes that are not
        ZMTP at all (libzmq reports the last only as accepted, then disconnected).
        A connection still in its handshake counts too, for the milliseconds that takes.
        """
        return max(0, self.events["ACCEPTED"] - self.events["HANDSHAKE_SUCCEEDED"])

    @property
    def rejected(self) -> bool:
        """Whether the other end refused us (connecting side), or is not who we expect.

        A refused key or mechanism counts at once. A failure without detail is
        what both an impostor (wrong server key) and a peer dying mid-handshake
        look like, so it counts only three times running, with no success between.
        """
        return self._last_failure in ("HANDSHAKE_FAILED_AUTH", "HANDSHAKE_FAILED_PROTOCOL") or \
            self._failures_in_a_row >= 3

    @property
    def handshake_failures(self) -> int:
        """Handshakes that failed, on either end (libzmq does not report junk bytes as one)."""
        return sum(self.events[e] for e in HANDSHAKE_FAILURES)

    def on_frames(self, frames) -> None:
        message = parse_monitor_message([f.bytes if hasattr(f, "bytes") else bytes(f) for f in frames])
        try:
            name = zmq.Event(message["event"]).name or str(message["event"])
        except ValueError:
            name = str(message["event"])
        self.events[name] += 1
        if name == "HANDSHAKE_SUCCEEDED":
            self._failures_in_a_row, self._last_failure = 0, ""
        if name in HANDSHAKE_FAILURES:
            self._failures_in_a_row += 1
            self._last_failure = name
            failures = self.handshake_failures
            if failures <= 3 or failures % 100 == 0:
                log.warning("%s: %s on %s (%d so far)", self.name, name,
                            message["endpoint"].decode(errors="replace"), failures)
        if self._on_event is not None:
            self._on_event(name, self)
