"""The key folders of a standalone controller serving many clients:
``pathways-controller --make-keys DIR --clients alice,bob [--executors N]``.

Every connection speaks CURVE and admits only allow-listed keys (`pathways_torch.wire.security`).
As for ``pathways-run --make-keys`` (`pathways_torch.launch.keys`), every pair is made once, on
one machine, and each folder holds only what its holder needs. The operator keeps the
controller's and the executors' folders and hands each client its own folder (a Kubernetes
Secret, a file copied to that user alone): a client's folder holds its own secret and the
public keys of the servers it talks to, never another client's secret, not even the other
clients' public keys (who else uses the service is not a client's business, and a key it
does not hold it cannot leak). The controller and the executors admit every client's key.

    DIR/              0700
      controller/     0700  a key directory: public/ every role's .key (controller, every executor,
                            every client: the allow-list); secret/ controller.key_secret;
                            admin.token (0600): the operator's token, 32 random bytes as hex, that
                            ``pathways-status --keys-dir DIR`` sends with --set-weight, --disconnect
                            and --drain (the controller refuses them without it)
      executors/      0700  public/ the same allow-list (executors admit every client on their data
                            sockets); secret/ executor-0 .. executor-(N-1)
      clients/        0700
        alice/        0700  public/ controller, every executor and client-alice only;
                            secret/ client-alice.key_secret
        bob/          0700  ...

Folders are 0700 and files 0600; each folder loads as a `KeyDirectory`. A client's role is
``client-NAME`` (`client_role`), distinct from the embedded run's single ``client``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shutil
import stat
import types
from typing import Iterable, Mapping

from ..wire.security import CLIENT_NAME, CLIENT_PREFIX, CONTROLLER, KeyDirectory, SecurityError, client_name
from .environment import executor_ids

__all__ = ["ADMIN_TOKEN", "CLIENT_PREFIX", "ServiceKeyFolders", "admin_token", "check_client_names", "client_name",
           "client_role", "make_service_keys", "service_folders"]

_NAME = CLIENT_NAME
_EXPECTED = "1-32 characters of a-z, 0-9 and '_', starting with a letter"
_FIX = "run pathways-controller --make-keys DIR --clients NAME,... (into a new folder)"
ADMIN_TOKEN = "admin.token"   # in DIR/controller/: the operator's token (`admin_token`)
_TOKEN_BYTES = 32


@dataclasses.dataclass(frozen=True)
class ServiceKeyFolders:
    """The folders under one ``--make-keys DIR``. ``clients`` maps each client's name to its folder; it is a
    read-only mapping (`types.MappingProxyType`; a plain dict passed in is copied into one), so instances are
    not hashable."""

    root: str
    controller: str
    executors: str
    clients: Mapping[str, str]

    def __post_init__(self):
        object.__setattr__(self, "clients", types.MappingProxyType(dict(self.clients)))


def _check_name(name, where: str = "client name") -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        hint = re.sub(r"[^a-z0-9_]", "_", name.lower()).lstrip("_0123456789")[:32] if isinstance(name, str) else ""
        raise ValueError(f"{where}: expected {_EXPECTED}, got {name!r}; rename it"
                         + (f" (e.g. {hint!r})" if hint and _NAME.match(hint) else ""))
    return name


def client_role(name: str) -> str:
    """The role of client ``name``: ``"alice"`` → ``"client-alice"``; ValueError for a bad name."""
    return CLIENT_PREFIX + _check_name(name)


def check_client_names(names: Iterable[str] | str) -> tuple[str, ...]:
    """The names of ``--clients``, checked: each valid (`client_role`), none twice, at least one. A single
    string is read as the flag's comma-separated list (``"alice,bob"``)."""
    if isinstance(names, str):
        names = names.split(",") if names else []
    names = tuple(names)
    if not names:
        raise ValueError(f"--clients: expected at least one client name ({_EXPECTED}), got none; "
                         f"pass --clients alice,bob")
    for name in names:
        _check_name(name, "--clients")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--clients: expected distinct names, got {list(names)} ({', '.join(map(repr, twice))} "
                         f"more than once); name each client once")
    return names


def make_service_keys(keys_dir: str, clients: Iterable[str] | str, executors: int = 16) -> ServiceKeyFolders:
    """Write the service's folders under ``keys_dir`` (new or empty) and return them."""
    names = check_client_names(clients)
    if isinstance(executors, bool) or not isinstance(executors, int) or executors < 1:
        raise ValueError(f"--executors: expected an integer >= 1, got {executors!r}; pass --executors N")
    if os.path.exists(keys_dir) and (not os.path.isdir(keys_dir) or os.listdir(keys_dir)):
        held = sorted(os.listdir(keys_dir))[:5] if os.path.isdir(keys_dir) else "a file"
        raise SecurityError(f"--make-keys {keys_dir}: expected a new or empty folder, it holds {held}; "
                            f"a service's keys are made once: pick a new folder")
    os.makedirs(keys_dir, mode=0o700, exist_ok=True)
    os.chmod(keys_dir, 0o700)
    servers = [CONTROLLER, *executor_ids(range(executors))]
    roles = {name: client_role(name) for name in names}
    every = KeyDirectory.create([*servers, *roles.values()], parent=keys_dir)  # scratch, removed below
    try:
        root = os.path.abspath(keys_dir)
        folders = _folders(root, names)
        _write(every, folders.controller, publics=None, secrets=[CONTROLLER])
        _write(every, folders.executors, publics=None, secrets=servers[1:])
        for name, role in roles.items():
            _write(every, folders.clients[name], publics=[*servers, role], secrets=[role])
        _write_admin_token(os.path.join(folders.controller, ADMIN_TOKEN))
    finally:
        every.remove()
    return folders


def service_folders(keys_dir: str) -> ServiceKeyFolders:
    """The folders of an existing ``--make-keys DIR``; SecurityError naming what is missing (or readable by
    others) and the fix."""
    root = os.path.abspath(keys_dir)
    for folder in (root, os.path.join(root, "controller"), os.path.join(root, "executors"),
                   os.path.join(root, "clients")):
        if not os.path.isdir(folder):
            raise SecurityError(f"service keys: expected the folder {folder}, found none; {_FIX}")
    names = sorted(n for n in os.listdir(os.path.join(root, "clients"))
                   if os.path.isdir(os.path.join(root, "clients", n)))
    if not names:
        raise SecurityError(f"service keys: expected a folder per client under {os.path.join(root, 'clients')}, "
                            f"found none; {_FIX}")
    for name in names:
        try:
            _check_name(name, f"client folder {os.path.join(root, 'clients', name)}")
        except ValueError as error:
            raise SecurityError(f"{error}; {_FIX}") from None
    folders = _folders(root, names)
    _check_private(root)
    _check_private(os.path.join(root, "clients"))
    for folder in (folders.controller, folders.executors, *folders.clients.values()):
        KeyDirectory(folder)        # checks public/, secret/ and their modes
    return folders


def _folders(root: str, names: Iterable[str]) -> ServiceKeyFolders:
    return ServiceKeyFolders(root=root, controller=os.path.join(root, "controller"),
                             executors=os.path.join(root, "executors"),
                             clients={name: os.path.join(root, "clients", name) for name in names})


def _check_private(folder: str) -> None:
    mode = os.stat(folder).st_mode & 0o777
    if mode & 0o077:
        raise SecurityError(f"service keys: {folder} has mode {mode:04o}; expected 0700: fix with chmod 700 {folder}")


def _write(every: KeyDirectory, folder: str, publics: list[str] | None, secrets: list[str]) -> None:
    """Copy ``publics`` (None: every role's) and ``secrets`` from ``every`` into the key directory ``folder``."""
    for sub in ("", "public", "secret"):
        os.makedirs(os.path.join(folder, sub), mode=0o700, exist_ok=True)
        os.chmod(os.path.join(folder, sub), 0o700)
    os.chmod(os.path.dirname(folder), 0o700)           # DIR/ or DIR/clients/
    names = sorted(os.listdir(os.path.join(every.path, "public"))) if publics is None else \
        [f"{role}.key" for role in publics]
    files = [("public", n) for n in names] + [("secret", f"{role}.key_secret") for role in secrets]
    for sub, name in files:
        target = os.path.join(folder, sub, name)
        shutil.copyfile(os.path.join(every.path, sub, name), target)
        os.chmod(target, 0o600)
    KeyDirectory(folder)        # checks the modes it will be read with


def admin_token(keys_dir: str, create: bool = False) -> str:
    """The operator's admin token in ``keys_dir`` (the ``--make-keys DIR``, or its ``controller/`` folder):
    ``DIR/controller/admin.token``, private to its owner (0600). ``create``: write one if there is none (the
    controller at start, for keys made before there were tokens). SecurityError naming the file and the fix."""
    folder = os.path.abspath(keys_dir)
    if os.path.isdir(os.path.join(folder, "controller")):
        folder = os.path.join(folder, "controller")
    path = os.path.join(folder, ADMIN_TOKEN)
    if create and not os.path.lexists(path):
        _write_admin_token(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise SecurityError(f"the admin token: expected the file {path}, found none; pass --keys-dir DIR, the folder "
                            f"pathways-controller --make-keys wrote (the controller writes the token at start if "
                            f"its keys have none)") from None
    if not stat.S_ISREG(info.st_mode) or info.st_mode & 0o077 or info.st_uid != os.getuid():
        raise SecurityError(f"the admin token {path}: expected a plain file of mode 0600 owned by uid {os.getuid()}, "
                            f"got mode {stat.S_IMODE(info.st_mode):04o} owned by {info.st_uid}: fix with "
                            f"chmod 600 {path} (and make new keys if others could read it)")
    with open(path, encoding="ascii", errors="replace") as file:
        token = file.read(4 * _TOKEN_BYTES).strip()
    if not re.fullmatch(f"[0-9a-f]{{{2 * _TOKEN_BYTES}}}", token):
        raise SecurityError(f"the admin token {path}: expected {2 * _TOKEN_BYTES} hex digits, got {len(token)} "
                            f"characters that are not; remove the file and start the controller (it writes a new one)")
    return token


def _write_admin_token(path: str) -> None:
    """A new token at ``path``: created 0600 and never through a link, so no one else reads it, even for a moment."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(descriptor, "w", encoding="ascii") as file:
        file.write(secrets.token_hex(_TOKEN_BYTES) + "\n")
    os.chmod(path, 0o600)   # whatever the umask
