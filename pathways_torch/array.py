"""`Array`: a future for a sharded array with a known global shape, dtype and sharding."""

from __future__ import annotations

import math
import weakref

from .placement import Sharding, assemble_blocks, global_shape, positions_needed

__all__ = ["Array"]

_IDLE_FLUSH_S = 0.05


class Array:
    """A logical array whose shards live on executors; returned at once by calls and ``ctx.put``.

    ``shape``, ``dtype`` and ``sharding`` are known before anything runs. ``result()``
    waits and assembles the shards into one ``torch.Tensor`` on the client; ``del``
    (or losing every reference) frees the shards on the executors.
    """

    def __init__(self, dispatcher, state, shape, dtype, sharding: Sharding, block_shape):
        self.dispatcher = dispatcher   # its context's call path (pathways_torch.dispatcher): calls on it go there
        self._state = state   # the client's own ArrayState (pathways_torch.controller_api), kept by its events
        self.shape = tuple(shape)
        self.dtype = dtype
        self.sharding = sharding
        self.block_shape = tuple(block_shape)
        self._value = None    # the assembled tensor, once fetched: readable after the context closes
        self._finalizer = weakref.finalize(self, dispatcher.release, state.array_id, _nbytes(shape, dtype))
        self._donated_to = ""  # the call it was given up to (donate_argnums): its shards are that call's to free
        self._holds = 0        # readers that need it kept (a checkpoint being written): not donated meanwhile

    @property
    def array_id(self) -> int:
        return self._state.array_id

    @property
    def mesh(self):
        return self.sharding.mesh

    def done(self) -> bool:
        """True once the array is computed (or has failed)."""
        return self._state.done()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until the array is computed or failed; True if it settled within ``timeout_s``. Never raises
        the array's error (`exception` and `result` do)."""
        try:
            self._wait(timeout_s)
        except TimeoutError:
            return False
        return True

    @property
    def completion(self):
        """What to wait on without keeping the array: ``done()`` and ``wait(timeout_s)`` (never raises, never
        sends the pending frees). Holding it keeps no shard alive (the trainer's run-ahead bound holds these)."""
        return self._state

    @property
    def failure(self) -> BaseException | None:
        """The error the array settled with, as the controller reported it (not waited for; None while running
        or after success). Recovery compares these by identity: one fault fails many arrays with one error."""
        return self._state.error

    @property
    def lost_holders(self) -> tuple[str, ...]:
        """The executors that held a shard of this array and were lost (its shards there are gone)."""
        return self._state.lost_holders

    def hold(self) -> None:
        """Keep the array's shards from being given up to a call that donates it (``donate_argnums``) until
        `release_hold`: a reader that needs them meanwhile holds it (a checkpoint being written holds its step's
        state, which the next step would otherwise free as it runs). Holds count: each needs its release."""
        self._holds += 1

    def release_hold(self) -> None:
        """Undo one `hold`."""
        self._holds -= 1

    @property
    def held(self) -> bool:
        """Whether a reader holds the array (`hold`): a call then keeps it, though it donates it."""
        return self._holds > 0

    def exception(self, timeout_s: float | None = None, *, timeout: float | None = None) -> BaseException | None:
        """Wait for the array; return the error it failed with, or None. ``timeout`` is the
        ``concurrent.futures`` spelling of ``timeout_s``."""
        self._wait(_timeout(timeout_s, timeout))
        return self.dispatcher.explained(self._state.error) if self._state.error is not None else None

    def result(self, timeout_s: float | None = None, *, timeout: float | None = None):
        """Wait, then fetch the shards straight from their executors and assemble them.

        Raises ``TimeoutError`` after ``timeout_s`` (or ``timeout``, the ``concurrent.futures``
        spelling) and stays usable; raises `ContextClosedError` once the context is closed,
        unless the value was fetched before. Each call returns a tensor the caller owns.
        """
        timeout_s = _timeout(timeout_s, timeout)
        if self._value is not None:
            return self._value.clone()
        self.check_not_donated("result()")
        self._wait(timeout_s)
        if self._state.error is not None:
            raise self.dispatcher.explained(self._state.error)
        if self.dispatcher.closed:
            from .errors import ContextClosedError

            raise ContextClosedError(f"array {self.array_id} was never fetched and its context is closed: its "
                                     f"shards are gone; fetch it (.result()) inside the `with pw.Context` block")
        self.learn_shape()
        positions = positions_needed(self.block_shape, self.sharding.placements, self.mesh)
        blocks = self.dispatcher.fetch_blocks(self, positions, self._state.lost_holders, timeout_s)
        # Kept as assembled (a lone block is a read-only view of the received message: no copy to keep it);
        # the caller always gets a copy of its own.
        self._value = assemble_blocks(blocks, self.block_shape, self.sharding.placements, self.mesh)
        return self._value.clone()

    def mark_donated(self, call: str) -> None:
        """The array was given up to a call of ``call`` (``donate_argnums``), which frees its shards: any later use
        raises `DonatedArrayError` (`check_not_donated`)."""
        self._donated_to = call

    def check_not_donated(self, use: str) -> None:
        """Raise `DonatedArrayError` naming ``use`` if the array was donated to a call (its shards are gone)."""
        if self._donated_to:
            from .errors import DonatedArrayError

            raise DonatedArrayError(f"{use}: array {self.array_id} was donated to a call of {self._donated_to!r} "
                                    f"(donate_argnums), which freed its shards; use that call's outputs instead, "
                                    f"or leave the argument out of donate_argnums")

    @property
    def shape_known(self) -> bool:
        """False while a size of this array waits for the data (a function with data-dependent output sizes)."""
        return None not in self.block_shape

    def learn_shape(self, timeout_s: float | None = None) -> None:
        """Wait for the producer to report the sizes the data decided; raise its error if it failed."""
        if self.shape_known:
            return
        self._wait(timeout_s)
        if self._state.error is not None:
            raise self.dispatcher.explained(self._state.error)
        self.block_shape = tuple(self._state.block_shape)
        self.shape = global_shape(self.block_shape, self.sharding.placements, self.mesh)

    def _wait(self, timeout_s: float | None) -> None:
        state = self._state
        if state.done():
            return
        # Frees of dropped arrays ride on the client's next call; a client that waits a
        # while sends them now (when they hold a megabyte or more), so the executors do not
        # hold that memory meanwhile.
        # With none worth sending, the wait is one: its thread blocks once and wakes once, at the settle (a
        # timed first wait woke it again after 50 ms: a 128-node program's wait, measured, woke 1.8 times).
        first = 0.0
        if self.dispatcher.frees_worth_flushing():
            first = _IDLE_FLUSH_S if timeout_s is None else min(timeout_s, _IDLE_FLUSH_S)
            if state.wait(first):
                return
            self.dispatcher.flush_frees()
        if not state.wait(None if timeout_s is None else timeout_s - first):
            raise TimeoutError(f"array {self.array_id} not ready within {timeout_s} s")

    def __repr__(self) -> str:
        state = self._state.state
        return f"Array(id={self.array_id}, shape={self.shape}, dtype={self.dtype}, {self.sharding}, {state})"


def _timeout(timeout_s: float | None, timeout: float | None) -> float | None:
    """One of the two spellings of a timeout (``timeout_s``, ours; ``timeout``, ``concurrent.futures``')."""
    if timeout_s is not None and timeout is not None and timeout_s != timeout:
        raise TypeError(f"result/exception: give timeout_s or timeout, not both (got {timeout_s} and {timeout})")
    return timeout_s if timeout_s is not None else timeout


def _nbytes(shape, dtype) -> int:
    """The bytes of an array of ``shape`` and ``dtype`` (one copy); sizes that depend on the data count as big
    (its frees are sent when the client waits)."""
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        return 1 << 30
    return math.prod(shape) * getattr(dtype, "itemsize", 1)
