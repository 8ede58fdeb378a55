"""Call-site naming: a wrapped model's default name is the file:line that created it.

The seed keeps this in utils; it has a module of its own so that roundpipe (which names
its models with it) and wrapper (which re-exports it) both import it without importing
each other.
"""

from __future__ import annotations

import inspect
import os

__all__ = ["get_call_location"]


def get_call_location(depth: int) -> str:
    """'file:line' of the frame `depth` levels above the caller of this function."""
    frame = inspect.currentframe()
    try:
        for _ in range(depth + 1):
            if frame is None or frame.f_back is None:
                break
            frame = frame.f_back
        if frame is None:
            return "<unknown>"
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    finally:
        del frame
