"""`python`: the user's `grade(sample, item)` in a sandboxed subprocess (being built)."""

from __future__ import annotations

from pathlib import Path

from .base import GraderConfigError
from .spec import PythonGrader

__all__ = ["PythonSandboxGrader"]


class PythonSandboxGrader:
    """Placeholder until the sandbox lands: refuses like an unbuilt grader."""

    def __init__(self, spec: PythonGrader, *, workdir: Path, field: str = "grader") -> None:
        raise GraderConfigError("python graders are not built yet", field=f"{field}.type")
