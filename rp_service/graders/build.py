"""`build_grader`: a runnable grader from a spec, or a GraderConfigError naming the field."""

from __future__ import annotations

from pathlib import Path

from ..settings import python_graders_allowed
from .base import Grader, GraderConfigError
from .formula import Formula, FormulaError
from .multi import Multi
from .spec import (
    GraderSpec,
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)
from .string_check import StringCheck
from .templates import check_template
from .text_similarity import TextSimilarity

__all__ = ["build_grader", "python_graders_allowed"]

_PYTHON_OFF = (
    "python graders are off on this box: the daemon runs no code a client sends unless "
    "its operator starts it with RP_ALLOW_PYTHON_GRADERS=1"
)


def build_grader(
    spec: GraderSpec, *, allow_python: bool, workdir: Path, field: str = "grader"
) -> Grader:
    """A grader ready to `grade`; `close()` it when done (a python grader holds a process).

    Args:
        allow_python: whether a python grader may run (the caller passes
            `python_graders_allowed()`); without it a python spec is a GraderConfigError.
        workdir: a directory of this grader's own; a python grader's sandbox works in it.
        field: the dotted path of `spec` in the request, for error messages.
    """
    if isinstance(spec, StringCheckGrader | TextSimilarityGrader):
        for name in ("input", "reference"):
            problem = check_template(getattr(spec, name))
            if problem:
                raise GraderConfigError(problem, field=f"{field}.{name}")
        if isinstance(spec, StringCheckGrader):
            return StringCheck(spec)
        return TextSimilarity(spec, field=field)
    if isinstance(spec, MultiGrader):
        return _build_multi(spec, allow_python=allow_python, workdir=workdir, field=field)
    if isinstance(spec, PythonGrader):
        if not allow_python:
            raise GraderConfigError(_PYTHON_OFF, field=f"{field}.type")
        from .python_grader import PythonSandboxGrader

        return PythonSandboxGrader(spec, workdir=workdir, field=field)
    if isinstance(spec, ScoreModelGrader | LabelModelGrader):
        raise GraderConfigError(
            f"{spec.type} graders are not built on this box yet (no model serves grading); "
            "use string_check, text_similarity, python or multi",
            field=f"{field}.type",
        )
    raise GraderConfigError(f"unknown grader type {spec!r}", field=f"{field}.type")


def _build_multi(spec: MultiGrader, *, allow_python: bool, workdir: Path, field: str) -> Grader:
    if not spec.graders:
        raise GraderConfigError(
            "a multi grader needs at least one grader", field=f"{field}.graders"
        )
    try:
        formula = Formula.parse(spec.calculate_output, frozenset(spec.graders))
    except FormulaError as exc:
        raise GraderConfigError(str(exc), field=f"{field}.calculate_output") from None
    built: dict[str, Grader] = {}
    try:
        for key, sub in spec.graders.items():
            if not key.isidentifier():
                raise GraderConfigError(
                    f"grader key {key!r} must be a name usable in calculate_output "
                    "(letters, digits, underscores)",
                    field=f"{field}.graders",
                )
            built[key] = build_grader(
                sub,
                allow_python=allow_python,
                workdir=workdir / key,
                field=f"{field}.graders.{key}",
            )
    except GraderConfigError:
        for grader in built.values():
            grader.close()
        raise
    return Multi(spec.name, built, formula)
