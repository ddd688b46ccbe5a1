"""``python private_host.py KEYS -- CMD ...`` (not a test): become a host with a private ``/tmp`` holding only KEYS.

Run in a new mount namespace (``unshare --mount --propagation private``, `namespace_hosts.py`): reads the key
folder KEYS into memory, mounts an empty tmpfs on ``/tmp`` (so nothing of the machine's ``/tmp``, and no
other host's keys or files, is visible), writes the keys to ``/tmp/keys`` (0700 folders, 0600 files), then
executes CMD with ``{keys}`` replaced by that path.
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


def main() -> None:
    keys, separator, *command = sys.argv[1:]
    assert separator == "--", sys.argv
    files = _read(keys)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/tmp"], check=True)
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
