"""The seeds' `profile` module by its name: profiler annotations live with the timers in
`engine.timer` (one function and its setting); importing them from here is the same."""

from __future__ import annotations

from .timer import PROFILER_TYPE, annotate

__all__ = ["PROFILER_TYPE", "annotate"]
