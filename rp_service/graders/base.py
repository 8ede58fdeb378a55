"""What every grader shares: the sample it reads, its result, its protocol and its error."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["GradeResult", "Grader", "GraderConfigError", "Sample"]


@dataclass(frozen=True, slots=True)
class Sample:
    """One completion to grade: its text and, when that text is a JSON object, the object."""

    output_text: str
    output_json: dict[str, Any] | None = None


@dataclass(slots=True)
class GradeResult:
    """Scores of one batch: the top grader's and each named sub-grader's, one per sample."""

    scores: list[float]
    by_grader: dict[str, list[float]] = field(default_factory=dict)
    # Samples whose grading raised or timed out; each scored 0.0.
    errors: int = 0
    # Which samples those are (empty when `errors` is 0 and the grader did not say).
    failed: list[bool] = field(default_factory=list)
    # Why each failed sample failed ("TemplateError: ...", "TimeoutError: ..."), else None.
    error_details: list[str | None] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        scores: list[float],
        details: list[str | None],
        by_grader: dict[str, list[float]],
    ) -> GradeResult:
        """A result whose failures are the samples with a detail (each scored 0.0)."""
        failed = [detail is not None for detail in details]
        return cls(
            scores=scores,
            by_grader=by_grader,
            errors=sum(failed),
            failed=failed,
            error_details=details,
        )


class GraderConfigError(Exception):
    """A grader spec that cannot run here; `field` is the dotted path of the value to change."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@runtime_checkable
class Grader(Protocol):
    """Scores batches of samples against their dataset items."""

    name: str

    def grade(self, samples: Sequence[Sample], items: Sequence[Mapping[str, Any]]) -> GradeResult:
        """One score per sample (`items[i]` belongs to `samples[i]`); never raises for a
        sample: a failing one scores 0.0 and counts in `errors`."""
        ...

    def close(self) -> None:
        """Frees what the grader holds (a sandbox process); safe to call twice."""
        ...
