"""OpenAI's fine-tuning shapes: the create request as this daemon accepts it, the objects
it returns. Field names, types and ranges follow OpenAI's API reference; what this daemon
does not implement is refused (extra="forbid" and checks in `mapping`), never ignored."""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.options import MatmulPrecision, Quantization
from rp_service.graders import GraderSpec
from rp_service.schemas import GrpoSection, LoraSection

__all__ = [
    "DpoHyperparameters",
    "DpoMethod",
    "FineTuningJob",
    "FineTuningJobCheckpoint",
    "FineTuningJobCreate",
    "FineTuningJobEvent",
    "Hyperparameters",
    "Method",
    "OpenAIList",
    "OpenAIStatus",
    "ReinforcementHyperparameters",
    "ReinforcementMethod",
    "ReinforcementResolvedHyperparameters",
    "ResolvedHyperparameters",
    "SupervisedMethod",
]

OpenAIStatus = Literal[
    "validating_files", "queued", "running", "succeeded", "failed", "cancelled", "paused"
]
_METADATA_KEYS = 16
_METADATA_KEY_CHARS = 64
_METADATA_VALUE_CHARS = 512


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hyperparameters(_Request):
    """OpenAI's supervised hyperparameters; "auto" lets the daemon choose (docs/API.md)."""

    n_epochs: Literal["auto"] | Annotated[int, Field(ge=1, le=50)] = "auto"
    batch_size: Literal["auto"] | Annotated[int, Field(ge=1, le=1 << 16)] = "auto"
    learning_rate_multiplier: Literal["auto"] | Annotated[float, Field(gt=0, le=10)] = "auto"


class SupervisedMethod(_Request):
    hyperparameters: Hyperparameters | None = None
    # This daemon's extension of OpenAI's shape (the SDK passes the key through): train
    # LoRA adapters on a frozen base instead of every weight (the JobSpec's `lora` section).
    lora: LoraSection | None = None


class DpoHyperparameters(Hyperparameters):
    """OpenAI's DPO hyperparameters: the supervised ones and `beta` (the JobSpec's
    dpo.beta; "auto" is its default, 0.1)."""

    beta: Literal["auto"] | Annotated[float, Field(gt=0, le=1000)] = "auto"


class DpoMethod(_Request):
    hyperparameters: DpoHyperparameters | None = None
    # As in SupervisedMethod: this daemon's LoRA extension.
    lora: LoraSection | None = None


class ReinforcementHyperparameters(Hyperparameters):
    """OpenAI's reinforcement hyperparameters (docs/RL.md says what each maps to)."""

    compute_multiplier: Literal["auto"] | Annotated[float, Field(gt=0, le=32)] = "auto"
    eval_interval: Literal["auto"] | Annotated[int, Field(ge=1, le=10**6)] = "auto"
    eval_samples: Literal["auto"] | Annotated[int, Field(ge=1, le=4096)] = "auto"
    reasoning_effort: Literal["default", "low", "medium", "high"] = "default"


class ReinforcementMethod(_Request):
    grader: GraderSpec
    hyperparameters: ReinforcementHyperparameters | None = None
    # OpenAI's structured-output schema for the sampled completions: not supported here
    # (mapping.py refuses it by name rather than failing on an unknown field).
    response_format: dict[str, Any] | None = None
    # As in SupervisedMethod: this daemon's LoRA extension, and its GRPO settings (the
    # JobSpec's grpo section: group_size, max_completion_tokens, temperature, kl_coef, ...).
    lora: LoraSection | None = None
    grpo: GrpoSection | None = None


class Method(_Request):
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None
    reinforcement: ReinforcementMethod | None = None


class FineTuningJobCreate(_Request):
    """The body of `POST /v1/fine_tuning/jobs` (the SDK's `fine_tuning.jobs.create`)."""

    model: str = Field(..., min_length=1, max_length=4096)
    training_file: str = Field(..., min_length=1, max_length=200)
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    suffix: str | None = Field(None, min_length=1, max_length=64)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    validation_file: str | None = Field(None, min_length=1, max_length=200)
    metadata: dict[str, str] | None = None
    integrations: list[Any] | None = None
    # This daemon's extension (the SDK's extra_body): the JobSpec's model.quantization;
    # "nf4" holds the frozen base 4-bit (QLoRA) and needs method.<type>.lora.
    quantization: Quantization = "none"
    # This daemon's extension (extra_body): the JobSpec's engine.matmul_precision; "fp8"
    # multiplies the decoder's linear layers in float8 (GPUs of compute capability >= 8.9).
    matmul_precision: MatmulPrecision = "bf16"

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > _METADATA_KEYS:
            raise ValueError(f"at most {_METADATA_KEYS} keys, got {len(value)}")
        for key, item in value.items():
            if len(key) > _METADATA_KEY_CHARS:
                raise ValueError(f"key {key[:20]!r}... is over {_METADATA_KEY_CHARS} characters")
            if len(item) > _METADATA_VALUE_CHARS:
                raise ValueError(f"the value of {key!r} is over {_METADATA_VALUE_CHARS} characters")
        return value


# ---------------------------------------------------------------- objects


class ResolvedHyperparameters(BaseModel):
    """The values a job runs with ("auto" resolved); None where a native job has none."""

    n_epochs: int | float | None = None
    batch_size: int | None = None
    learning_rate_multiplier: float | None = None


class _SupervisedOut(BaseModel):
    hyperparameters: ResolvedHyperparameters


class _MethodOut(BaseModel):
    type: Literal["supervised"] = "supervised"
    supervised: _SupervisedOut


class DpoResolvedHyperparameters(ResolvedHyperparameters):
    beta: float | None = None


class _DpoOut(BaseModel):
    hyperparameters: DpoResolvedHyperparameters


class _DpoMethodOut(BaseModel):
    type: Literal["dpo"] = "dpo"
    dpo: _DpoOut


class ReinforcementResolvedHyperparameters(ResolvedHyperparameters):
    compute_multiplier: float | None = None
    eval_interval: int | None = None
    eval_samples: int | None = None
    reasoning_effort: str | None = None


class _ReinforcementOut(BaseModel):
    grader: dict[str, Any] | None = None
    hyperparameters: ReinforcementResolvedHyperparameters


class _ReinforcementMethodOut(BaseModel):
    type: Literal["reinforcement"] = "reinforcement"
    reinforcement: _ReinforcementOut


class _JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class FineTuningJob(BaseModel):
    """OpenAI's `fine_tuning.job`; its `id` is the native job id, so both APIs share it."""

    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: _JobError | None
    fine_tuned_model: str | None = Field(
        description="The trained model's id (ft:<base>:<job-id>) once the job succeeded: the "
        "model chat.completions.create takes; the native job's output_model_path is its folder."
    )
    finished_at: int | None
    hyperparameters: ResolvedHyperparameters
    method: _MethodOut | _DpoMethodOut | _ReinforcementMethodOut
    model: str
    organization_id: str
    result_files: list[str]
    seed: int
    status: OpenAIStatus
    trained_tokens: int | None
    training_file: str
    validation_file: str | None
    estimated_finish: int | None
    integrations: list[Any] = Field(default_factory=list)
    metadata: dict[str, str] | None
    suffix: str | None
    user_provided_suffix: str | None


class FineTuningJobEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict[str, Any]
    type: Literal["message", "metrics"]


class CheckpointMetrics(BaseModel):
    step: int
    train_loss: float | None = None
    valid_loss: float | None = None
    full_valid_loss: float | None = None


class FineTuningJobCheckpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str = Field(description="The checkpoint's directory.")
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int


T = TypeVar("T")


class OpenAIList(BaseModel, Generic[T]):
    """A cursor page: the next page is `after=<last id>` while `has_more`."""

    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None
