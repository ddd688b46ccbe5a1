"""Which code is the user's: every frame outside torch, the standard library and pathways_torch.

Errors point at the user's line (a capture failure, an op a backend could not compile);
both walk frames and skip these directories. A model library's own code (transformers)
counts as the user's: it is the model the user brought.
"""

from __future__ import annotations

import os

__all__ = ["library_dirs"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def library_dirs() -> tuple[str, ...]:
    """The directories whose frames are not the user's, each ending in a separator (for ``startswith``)."""
    import torch

    dirs = [os.path.dirname(os.path.abspath(torch.__file__)), _PACKAGE_DIR, os.path.dirname(os.__file__)]
    return tuple(d + os.sep for d in dirs)
