"""The wire protocol shared by the client, the controller and the executors.

One `.proto` (``pathways.proto``) defines every message; a message on a socket is
``[Envelope bytes, raw tensor frame, ...]``. Tensors travel as raw bytes with a
dtype/shape header, graphs in the schema of :mod:`.graph_schema`; nothing
received from a socket is ever unpickled.

This package imports no torch at import time: the simulated executor and the
controller use it without paying torch's start-up.
"""

from . import pathways_pb2 as pb
from .framing import decode, encode, body_name
from .loop import SocketLoop

__all__ = ["pb", "encode", "decode", "body_name", "SocketLoop"]
