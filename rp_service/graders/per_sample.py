"""The batch loop of graders that score one sample at a time, errors counted as zeros."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .base import GradeResult, Sample

__all__ = ["PerSampleGrader"]

log = logging.getLogger(__name__)


class PerSampleGrader:
    """Base of the in-process graders: subclasses give `name` and `score(sample, item)`."""

    name: str

    def score(self, sample: Sample, item: Mapping[str, Any]) -> float:
        raise NotImplementedError

    def grade(self, samples: Sequence[Sample], items: Sequence[Mapping[str, Any]]) -> GradeResult:
        """Scores each sample; one that raises or scores NaN/inf is 0.0 and counted."""
        if len(samples) != len(items):
            raise ValueError(f"{len(samples)} samples but {len(items)} items")
        scores: list[float] = []
        details: list[str | None] = []
        for sample, item in zip(samples, items, strict=True):
            try:
                value = float(self.score(sample, item))
                if not math.isfinite(value):
                    raise ValueError(f"score {value} is not finite")
            except Exception as exc:  # a user's template or text must never stop training
                log.debug("grader %s: sample scored 0 (%s)", self.name, exc)
                scores.append(0.0)
                details.append(f"{type(exc).__name__}: {exc}")
            else:
                scores.append(value)
                details.append(None)
        return GradeResult.of(scores, details, {self.name: list(scores)})

    def close(self) -> None:
        """Nothing to free."""
