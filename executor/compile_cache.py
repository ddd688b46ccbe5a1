"""The compile cache of one executor: keyed by graph hash + input signature.

A new function is compiled on a background thread (for backends that compile),
so a long compile never blocks the I/O loop, transfers, fetches or other
computations; runs of the function wait until it is ready. The same graph with
the same signature is compiled once, whatever function id it arrives under.
Compile time shows in the trace as a "compile" span.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from typing import Callable

from pathways_torch.wire.threads import name_os_thread

from .allocator import release_free_memory

__all__ = ["CompileCache", "graph_key"]

log = logging.getLogger(__name__)

OnDone = Callable[[object, BaseException | None], None]


def graph_key(graph_bytes: bytes, constants: list) -> str:
    """A digest of a serialized graph (which includes its input signature) and its constants."""
    digest = hashlib.blake2b(graph_bytes, digest_size=20)
    for constant in constants:
        digest.update(memoryview(constant).cast("B") if not isinstance(constant, bytes) else constant)
    return digest.hexdigest()


class _Entry:
    __slots__ = ("compiled", "error", "done", "waiters", "seconds")

    def __init__(self):
        self.compiled, self.error, self.done = None, None, False
        self.waiters: list[OnDone] = []
        self.seconds = 0.0


class CompileCache:
    """Compiles through ``backend``; ``post(fn)`` runs ``fn`` on the owner's thread (the I/O loop)."""

    def __init__(self, backend, trace, post: Callable[[Callable[[], None]], None] | None = None,
                 background: bool | None = None):
        self.backend = backend
        self.trace = trace
        self._post = post or (lambda fn: fn())
        self._background = backend.compiles_in_background if background is None else background
        self._entries: dict[str, _Entry] = {}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.hits = 0
        self.misses = 0

    def request(self, key: str, name: str, graph_module, example_inputs, on_done: OnDone) -> None:
        """Call ``on_done(compiled, error)`` (on the owner's thread) once ``key`` is compiled."""
        entry = self._entries.get(key)
        if entry is not None:
            self.hits += 1
            if entry.done:
                on_done(entry.compiled, entry.error)
            else:
                entry.waiters.append(on_done)
            return
        self.misses += 1
        entry = self._entries[key] = _Entry()
        entry.waiters.append(on_done)
        job = (entry, name, graph_module, example_inputs)
        if self._background:
            self._ensure_thread()
            self._jobs.put(job)
        else:
            self._compile(*job)

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._compile_loop, name="pathways-compile", daemon=True)
            self._thread.start()

    def _compile_loop(self) -> None:
        name_os_thread()
        while (job := self._jobs.get()) is not None:
            self._compile(*job)

    def _compile(self, entry: _Entry, name: str, graph_module, example_inputs) -> None:
        traced = self.backend.compiles_in_background  # eager "compiles" nothing worth a span
        if traced:
            self.trace.record("compile_start", name, detail=self.backend.name)
        began = time.perf_counter()
        try:
            entry.compiled = self.backend.compile(graph_module, example_inputs)
        except Exception as exc:  # the runs of this function fail with it
            log.warning("compile of %s on %s failed: %s", name, self.backend.name, exc)
            entry.error = exc
        entry.seconds = time.perf_counter() - began
        if traced:
            # The compiler's working memory, freed into the heap in small pieces, goes back to the system.
            release_free_memory()
            # What the compiler made of it (stages, cuts at collectives, fallbacks), where the backend says.
            summary = getattr(entry.compiled, "summary", "")
            self.trace.record("compile_end", name,
                              detail=f"{self.backend.name} {entry.seconds:.3f} s" + (f"; {summary}" if summary else ""))
        self._post(lambda: self._finish(entry))

    def _finish(self, entry: _Entry) -> None:
        entry.done = True
        waiters, entry.waiters = entry.waiters, []
        for waiter in waiters:
            waiter(entry.compiled, entry.error)
