"""OpenAI-shaped graders for reinforcement fine-tuning: specs, templates, scoring, sandbox.

Torch-free and engine-free: the daemon validates specs with it, the job worker grades with
it. See docs/RL.md#graders.
"""

from __future__ import annotations

from .base import Grader, GraderConfigError, GradeResult, Sample
from .build import build_grader, python_graders_allowed
from .spec import (
    GraderSpec,
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)
from .templates import TemplateError, render_template

__all__ = [
    "GradeResult",
    "Grader",
    "GraderConfigError",
    "GraderSpec",
    "LabelModelGrader",
    "MultiGrader",
    "PythonGrader",
    "Sample",
    "ScoreModelGrader",
    "StringCheckGrader",
    "TemplateError",
    "TextSimilarityGrader",
    "build_grader",
    "python_graders_allowed",
    "render_template",
]
