"""`ControllerState`: the controller's lock and the tables its parts share, handed to each part it builds.

A part gets the state it works on from here, not by reaching into the `Controller` that built it: the tables are
the controller's (every change under ``lock``); the parts are handlers over them. ``config`` is read here at each
use, never copied: it may be replaced while the controller runs (bench/scale.py sends runs without the launch tree
for a while, `Controller.config`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

from .arrays import ArrayTable
from .config import ControllerConfig
from .rendezvous import RendezvousStore
from .resources import ResourceManager
from .sequencer import Sequencers

__all__ = ["ControllerState"]


@dataclasses.dataclass(eq=False)
class ControllerState:
    """The shared tables, guarded by ``lock`` (an RLock: a handler may call another part's under it)."""

    # Sends one message to an executor on the calling thread's order (`Controller.send`).
    send: Callable
    # Counts and logs a message dropped as malformed or unexpected (`Controller.drop`).
    drop: Callable[[str], None]
    config: ControllerConfig
    rendezvous: RendezvousStore   # where groups meet (on the I/O thread)
    clock: Callable[[], float] = time.monotonic
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    calls: dict = dataclasses.field(default_factory=dict)       # unfinished calls (and program runs' nodes) by id
    functions: dict = dataclasses.field(default_factory=dict)   # registered functions by id
    programs: dict = dataclasses.field(default_factory=dict)    # lowered programs by id
    stale_programs: set = dataclasses.field(default_factory=set)   # to lower again (new groups, a replacement)
    resources: ResourceManager = dataclasses.field(default_factory=ResourceManager)   # the executors, the meshes
    arrays: ArrayTable = dataclasses.field(default_factory=ArrayTable)                # the array records
    sequencers: Sequencers = dataclasses.field(default_factory=Sequencers)   # each island's sequence numbers
