"""Point a capture failure at the user's code: the module and the line that could not be traced."""

from __future__ import annotations

import linecache
import os
import traceback

from ..errors import CaptureError
from ..user_code import library_dirs

__all__ = ["user_frame_summary", "located"]


def located(exc: CaptureError, model, what: str = "the training step") -> CaptureError:
    """``exc`` (a capture of ``what`` that failed) as an error naming ``model``'s module and line where tracing
    stopped; ``exc`` itself when no frame of the user's code is on its traceback."""
    where = user_frame_summary(exc, model)
    if where is None:
        return exc
    return CaptureError(f"{type(model).__name__}: {what} cannot be captured at {where}\n{exc}")


def user_frame_summary(exc: BaseException, model) -> str | None:
    """``module 'blocks.0.attn' (Attention), file F, line N: <code>`` for the innermost user frame, or None."""
    library = library_dirs()
    names = {id(m): name for name, m in model.named_modules()}
    found = None
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for frame, lineno in traceback.walk_tb(exc.__traceback__):
            filename = os.path.abspath(frame.f_code.co_filename)
            if not filename.startswith(library) and not filename.startswith("<"):
                found = (frame, lineno, filename)
        exc = exc.__cause__ or exc.__context__
        if found:
            break
    if found is None:
        return None
    frame, lineno, filename = found
    owner = frame.f_locals.get("self")
    where = ""
    if id(owner) in names:
        qualified = names[id(owner)] or "<root>"
        where = f"module {qualified!r} ({type(owner).__name__}), "
    code = linecache.getline(filename, lineno).strip()
    return f"{where}{filename}, line {lineno}, in {frame.f_code.co_name}: {code}"
