"""`multi`: named sub-graders, combined per sample by the `calculate_output` formula."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .base import Grader, GradeResult, Sample
from .formula import Formula

__all__ = ["Multi"]

log = logging.getLogger(__name__)


class Multi:
    """Grades with every sub-grader, then evaluates the formula over their scores.

    A sample that a sub-grader failed enters the formula with that grader's 0.0 and counts
    as one error; a formula that fails on a sample (a division by zero) scores it 0.0, counted.
    """

    def __init__(self, name: str, graders: Mapping[str, Grader], formula: Formula) -> None:
        self.name = name
        self._graders = dict(graders)
        self._formula = formula

    def grade(self, samples: Sequence[Sample], items: Sequence[Mapping[str, Any]]) -> GradeResult:
        """The formula's value per sample; `by_grader` has each sub-grader's scores."""
        by_grader: dict[str, list[float]] = {}
        details: list[str | None] = [None] * len(samples)
        own: dict[str, list[float]] = {}
        for key, grader in self._graders.items():
            result = grader.grade(samples, items)
            own[key] = result.scores
            by_grader[key] = result.scores
            # A nested multi's own sub-graders show under dotted names.
            for sub, scores in result.by_grader.items():
                if sub != grader.name:
                    by_grader.setdefault(f"{key}.{sub}", scores)
            for i, bad in enumerate(result.failed):
                if bad and details[i] is None:
                    why = result.error_details[i] if result.error_details else None
                    details[i] = f"{key}: {why or 'failed'}"
        scores: list[float] = []
        for i in range(len(samples)):
            try:
                value = self._formula.evaluate({key: own[key][i] for key in own})
                if not math.isfinite(value):
                    raise ValueError(f"{value} is not finite")
            except Exception as exc:  # whatever the formula meets on a sample: 0, counted
                log.debug("grader %s: formula failed on sample %d (%s)", self.name, i, exc)
                value = 0.0
                details[i] = details[i] or f"FormulaError: calculate_output failed ({exc})"
            scores.append(value)
        return GradeResult.of(scores, details, by_grader)

    def close(self) -> None:
        """Closes every sub-grader."""
        for grader in self._graders.values():
            grader.close()
