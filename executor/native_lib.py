"""The executor's own native library (``executor/native/*.cpp``): built by ``pathways-build-extensions`` with the
machine's C++ compiler, loaded with ctypes.

It needs no Python, torch or jaxlib headers (a C ABI: ctypes releases the GIL for each call), so one build serves
every Python of the machine. The build goes beside the sources, under a folder named by the sources' digest (an
edited source is never served by an old build). There is no Python twin of what it does: where it cannot be built,
``pathways-build-extensions`` fails and the executor refuses to start (the README's install builds it).

`sanitized_build` makes the native units' program, the library's sources and the units', with
``-fsanitize=address,undefined``
(tests/unit/test_native.py).
"""

from __future__ import annotations

import ctypes
import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import threading

__all__ = ["NativeUnavailable", "build", "library", "library_path", "sanitized_build", "SOURCE_DIR"]

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")
_NAME = "libpathways_native.so"
_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-fvisibility=default")
_lock = threading.Lock()
_library = None


class NativeUnavailable(RuntimeError):
    """The native library is not built here, or does not build."""


def _sources() -> list[str]:
    return sorted(glob.glob(os.path.join(SOURCE_DIR, "*.cpp")))


def _compiler() -> str:
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not found:
        raise NativeUnavailable("no C++ compiler (g++, c++ or clang++) on PATH: install one (Debian: apt-get install "
                                "g++), then run pathways-build-extensions")
    return found


def library_path() -> str:
    """Where the library built from the sources as they are now lives."""
    digest = hashlib.sha256()
    for source in _sources():
        with open(source, "rb") as f:
            digest.update(os.path.basename(source).encode() + b"\0" + f.read())
    return os.path.join(SOURCE_DIR, "build", f"native-{digest.hexdigest()[:12]}", _NAME)


def _compile(output: str, flags: tuple, sources: list[str]) -> None:
    """Compile ``sources`` into ``output`` (written beside it, then renamed: a reader never maps half a file)."""
    partial = f"{output}.{os.getpid()}.partial"
    command = [_compiler(), *flags, *sources, "-o", partial]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise NativeUnavailable(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    os.replace(partial, output)


def build() -> str:
    """Build the library if the sources as they are now have none (a few seconds); its path. One process builds
    while the others wait (a file lock): executors started together do not compile twice."""
    path = library_path()
    if os.path.exists(path):
        return path
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(os.path.dirname(folder), ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            _compile(path, _FLAGS, _sources())
    return path


def library() -> ctypes.CDLL:
    """The library, loaded once per process (built first if it is missing)."""
    global _library
    with _lock:
        if _library is None:
            _library = ctypes.CDLL(build())
        return _library


def sanitized_build(folder: str, test_sources: list[str]) -> str:
    """A program of ``test_sources`` linked with the library's sources, built in ``folder`` with AddressSanitizer
    and UndefinedBehaviorSanitizer (aborting on the first report); its path."""
    flags = ("-std=c++17", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
             "-fno-sanitize-recover=all", "-Wall", "-Wextra", "-Werror")
    program = os.path.join(folder, "native_units")
    _compile(program, flags, [*_sources(), *test_sources])
    return program
