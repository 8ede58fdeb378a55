"""The grader objects of OpenAI's fine-tuning API, as pydantic models (`GraderSpec`).

Field names and `type` tags are OpenAI's, so a grader written for its API parses here
unchanged. Parsing checks shapes only; whether a spec can run here (a metric we compute, a
formula we parse, python graders allowed) is `build_grader`'s question.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "GraderSpec",
    "LabelModelGrader",
    "MultiGrader",
    "PythonGrader",
    "ScoreModelGrader",
    "StringCheckGrader",
    "TextSimilarityGrader",
]

# Every metric OpenAI names; `text_similarity.py` says which ones are computed here.
EvaluationMetric = Literal[
    "cosine",
    "fuzzy_match",
    "bleu",
    "gleu",
    "meteor",
    "rouge_1",
    "rouge_2",
    "rouge_3",
    "rouge_4",
    "rouge_5",
    "rouge_l",
]


class _Spec(BaseModel):
    # Unknown fields are refused so a typo ("refrence") is a 400, not a silent default.
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256)


class StringCheckGrader(_Spec):
    """Compares the rendered `input` with the rendered `reference`: 1.0 when it holds."""

    type: Literal["string_check"]
    input: str
    reference: str
    operation: Literal["eq", "ne", "like", "ilike"]


class TextSimilarityGrader(_Spec):
    """A similarity metric between the rendered `input` and `reference`, in [0, 1]."""

    type: Literal["text_similarity"]
    input: str
    reference: str
    evaluation_metric: EvaluationMetric
    # Evals' variant of the object carries it; training rewards use the raw score.
    pass_threshold: float | None = None


class PythonGrader(_Spec):
    """The user's `grade(sample, item) -> float`, run in a sandboxed subprocess."""

    type: Literal["python"]
    source: str = Field(min_length=1, max_length=256 * 1024)
    # OpenAI picks a container image by it; here the daemon's own Python runs the source.
    image_tag: str | None = None


class ScoreModelGrader(_Spec):
    """A model that reads `input` messages and answers a score in `range` (not built here)."""

    type: Literal["score_model"]
    model: str
    input: list[dict[str, Any]]
    range: list[float] | None = None
    sampling_params: dict[str, Any] | None = None


class LabelModelGrader(_Spec):
    """A model that picks a label (OpenAI's evals and multi graders; not built here)."""

    type: Literal["label_model"]
    model: str
    input: list[dict[str, Any]]
    labels: list[str]
    passing_labels: list[str]


class MultiGrader(_Spec):
    """Named sub-graders combined by the arithmetic formula `calculate_output`."""

    type: Literal["multi"]
    graders: dict[str, GraderSpec]
    calculate_output: str = Field(min_length=1, max_length=4096)


GraderSpec = Annotated[
    StringCheckGrader
    | TextSimilarityGrader
    | MultiGrader
    | PythonGrader
    | ScoreModelGrader
    | LabelModelGrader,
    Field(discriminator="type"),
]

MultiGrader.model_rebuild()
