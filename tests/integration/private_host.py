"""``python private_host.py KEYS [KEEP ...] -- CMD ...`` (not a test): become a host whose ``/tmp`` holds only KEYS.

Run in a new mount namespace (``unshare --mount --propagation private``, `namespace_hosts.py`): reads the key
folder KEYS into memory, mounts an empty tmpfs on ``/tmp`` (so nothing of the machine's ``/tmp``, and no
other host's keys or files, is visible) — but for the KEEP folders (the checkout and its interpreter, when
they live under /tmp, as a CI clone may), which are bound back at their own paths — writes the keys to
``/tmp/keys`` (0700 folders, 0600 files), then executes CMD with ``{keys}`` replaced by that path.
"""

from __future__ import annotations

import os
import subprocess
import sys


def _read(folder: str) -> dict[str, bytes]:
    files = {}
    for directory, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, folder)] = f.read()
    return files


def _private_tmp(keep: list[str]) -> None:
    """An empty tmpfs on /tmp, but for the folders in ``keep`` under /tmp (the code and its interpreter, where a
    checkout lives in /tmp): bound aside first, moved back onto the same paths after."""
    import tempfile

    keep = sorted({os.path.realpath(p) for p in keep if os.path.realpath(p).startswith("/tmp/")})
    staging = tempfile.mkdtemp(prefix="pathways-host-", dir="/run")
    try:
        for index, path in enumerate(keep):
            os.mkdir(os.path.join(staging, str(index)))
            subprocess.run(["mount", "--bind", path, os.path.join(staging, str(index))], check=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/tmp"], check=True)
        for index, path in enumerate(keep):
            os.makedirs(path, exist_ok=True)
            subprocess.run(["mount", "--move", os.path.join(staging, str(index)), path], check=True)
    finally:
        for index in range(len(keep)):
            try:
                os.rmdir(os.path.join(staging, str(index)))
            except OSError:
                pass
        os.rmdir(staging)


def main() -> None:
    args = sys.argv[1:]
    separator = args.index("--")
    keys, keep, command = args[0], args[1:separator], args[separator + 1:]
    files = _read(keys)
    _private_tmp(keep)
    target = "/tmp/keys"
    for relative, data in files.items():
        path = os.path.join(target, relative)
        parent = os.path.dirname(path)
        os.makedirs(parent, mode=0o700, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o600)
    for directory, _, _ in os.walk(target):
        os.chmod(directory, 0o700)
    os.execvp(command[0], [part.replace("{keys}", target) for part in command])


if __name__ == "__main__":
    main()
