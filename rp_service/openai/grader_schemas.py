"""OpenAI's grader routes' shapes: `fine_tuning.alpha.graders.validate` and `.run`.

Field names follow OpenAI's API reference (and the `openai` SDK's GraderRunResponse);
unknown request fields are refused with a 400 naming them, as on the other OpenAI routes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rp_service.graders import GraderSpec

__all__ = [
    "GraderRunErrors",
    "GraderRunMetadata",
    "GraderRunRequest",
    "GraderRunResponse",
    "GraderValidateRequest",
    "GraderValidateResponse",
]


class GraderValidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grader: GraderSpec


class GraderValidateResponse(BaseModel):
    grader: GraderSpec


class GraderRunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grader: GraderSpec
    # The completion to grade: `{{sample.output_text}}`, and `{{sample.output_json}}` when
    # it parses as a JSON object.
    model_sample: str = Field(max_length=1 << 20)
    item: dict[str, Any] | None = None


class GraderRunErrors(BaseModel):
    """OpenAI's error flags of one run; at most a few are true at once."""

    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_server_error: bool = False
    model_grader_server_error_details: str | None = None
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False


class GraderRunMetadata(BaseModel):
    errors: GraderRunErrors
    execution_time: float
    name: str
    sampled_model_name: str | None = None
    # Each named grader's score (a multi grader's sub-graders; the grader itself otherwise).
    scores: dict[str, Any]
    token_usage: int | None = None
    type: str


class GraderRunResponse(BaseModel):
    reward: float
    metadata: GraderRunMetadata
    sub_rewards: dict[str, Any]
    model_grader_token_usage_per_model: dict[str, Any] = Field(default_factory=dict)
