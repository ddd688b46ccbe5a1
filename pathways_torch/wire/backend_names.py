"""The names of executor backends, known to the client (to check a request) and to executors (to make one).

``"xla"`` names whichever XLA route is installed, in ``XLA_ROUTES`` order (chosen by
measurement: docs/backends.md); a route's full name forces it.
"""

from __future__ import annotations

import importlib.util

__all__ = ["BACKEND_NAMES", "XLA_ROUTES", "resolve_backend_name", "route_installed", "default_backend"]

BACKEND_NAMES = ("xla", "xla:torchax", "xla:torch_xla", "eager", "inductor", "sim")
XLA_ROUTES = ("xla:torchax", "xla:torch_xla")
_ROUTE_MODULES = {"xla:torchax": ("torchax", "jax"), "xla:torch_xla": ("torch_xla",)}
_ROUTE_EXTRA = {"xla:torchax": "pathways-torch", "xla:torch_xla": "pathways-torch[torch-xla]"}


def default_backend(device: str) -> str:
    """XLA on CPU and TPU hosts; inductor on CUDA (the XLA routes here do not drive CUDA: docs/backends.md)."""
    return "inductor" if device.startswith("cuda") else "xla"


def route_installed(route: str) -> bool:
    """Whether the modules an XLA route needs can be imported here (found, not imported)."""
    return all(importlib.util.find_spec(module) is not None for module in _ROUTE_MODULES[route])


def resolve_backend_name(name: str) -> str:
    """``"xla"`` → the first installed XLA route; any other known name → itself, checked.

    Raises ``ValueError`` for an unknown name or an XLA route that is not installed,
    saying what to install.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend: expected one of {BACKEND_NAMES}, got {name!r}")
    if name == "xla":
        for route in XLA_ROUTES:
            if route_installed(route):
                return route
        raise ValueError("backend 'xla': no XLA route is installed; expected torchax and jax (pip install "
                         "pathways-torch, the default) or torch_xla (pip install 'pathways-torch[torch-xla]')")
    if name in _ROUTE_MODULES and not route_installed(name):
        missing = [m for m in _ROUTE_MODULES[name] if importlib.util.find_spec(m) is None]
        raise ValueError(f"backend {name!r}: {', '.join(missing)} not installed here; "
                         f"fix: pip install '{_ROUTE_EXTRA[name]}', or backend='xla' for the installed route")
    return name
