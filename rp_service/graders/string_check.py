"""`string_check`: eq, ne, like (substring, case-sensitive) and ilike (case-insensitive)."""

from __future__ import annotations

from collections.abc import Callable

from .base import Sample
from .per_sample import PerSampleGrader
from .spec import StringCheckGrader
from .templates import render_template

__all__ = ["StringCheck"]

_OPERATIONS: dict[str, Callable[[str, str], bool]] = {
    "eq": lambda text, ref: text == ref,
    "ne": lambda text, ref: text != ref,
    "like": lambda text, ref: ref in text,
    "ilike": lambda text, ref: ref.lower() in text.lower(),
}


class StringCheck(PerSampleGrader):
    """1.0 when `operation(input, reference)` holds for the rendered templates, else 0.0."""

    def __init__(self, spec: StringCheckGrader) -> None:
        self.name = spec.name
        self._spec = spec
        self._check = _OPERATIONS[spec.operation]

    def score(self, sample: Sample, item: dict) -> float:
        text = render_template(self._spec.input, sample, item)
        ref = render_template(self._spec.reference, sample, item)
        return 1.0 if self._check(text, ref) else 0.0
