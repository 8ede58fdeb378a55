"""Translation between OpenAI's fine-tuning shapes and the native JobSpec, job, event and
checkpoint. Pure functions: no store, no filesystem (fine_tuning.py brings those).

docs/API.md ("OpenAI-compatible fine-tuning API") is this module's table; keep them equal.
"""

from __future__ import annotations

import math
import time
from typing import Any

from rp_service.errors import BadRequest
from rp_service.jobs.openai_store import OpenAIJobRecord
from rp_service.jobs.results import result_file_id
from rp_service.jobs.store import CheckpointRecord, EventRecord, JobRecord
from rp_service.openai.schemas import (
    CheckpointMetrics,
    DpoResolvedHyperparameters,
    FineTuningJob,
    FineTuningJobCheckpoint,
    FineTuningJobCreate,
    FineTuningJobEvent,
    Hyperparameters,
    OpenAIStatus,
    ReinforcementMethod,
    ReinforcementResolvedHyperparameters,
    ResolvedHyperparameters,
)
from rp_service.schemas import (
    MAX_INT64,
    TERMINAL_STATUSES,
    DataSection,
    DpoSection,
    EngineSection,
    GrpoSection,
    JobSpec,
    ModelSection,
    TrainSection,
)
from rp_service.serving.models import fine_tuned_id

__all__ = [
    "AUTO_BATCH_SIZE",
    "AUTO_EPOCHS",
    "BASE_LEARNING_RATE",
    "KEEP_CHECKPOINTS",
    "MAX_SEQ_LEN",
    "ORGANIZATION_ID",
    "STATUSES",
    "JobPlan",
    "checkpoint_id",
    "event_id",
    "openai_checkpoint",
    "openai_event",
    "openai_job",
    "parse_cursor",
    "plan_job",
]

# Native status -> OpenAI status. `pausing` still trains until its checkpoint is written
# (a resume is refused until then), so it reads `running`; `cancelling` cannot be undone
# and ends within RP_CANCEL_GRACE_S, so it reads `cancelled`, as OpenAI answers a cancel.
STATUSES: dict[str, OpenAIStatus] = {
    "validating": "validating_files",
    "queued": "queued",
    "running": "running",
    "pausing": "running",
    "paused": "paused",
    "cancelling": "cancelled",
    "cancelled": "cancelled",
    "succeeded": "succeeded",
    "failed": "failed",
}
# What `learning_rate_multiplier` multiplies, by what is trained: all the weights of a
# pretrained model folder (1e-5, the usual full fine-tuning rate of 1B-10B models), or a
# preset's random initialisation (the JobSpec's default 1e-3, a pre-training rate), or LoRA
# adapters (method.supervised.lora: 1e-4, the usual LoRA rate, whatever the base).
BASE_LEARNING_RATE = {"pretrained": 1.0e-5, "preset": 1.0e-3, "lora": 1.0e-4}
# The same for method.type dpo: a tenth (preference tuning moves a trained model a little;
# TRL's DPO default rate is 1e-6 where its SFT default is 1e-5).
DPO_LEARNING_RATE = {k: v / 10 for k, v in BASE_LEARNING_RATE.items()}
DPO_BETA = 0.1  # "auto": the JobSpec's dpo.beta default (TRL's and OpenAI's)
# method.type reinforcement: compute_multiplier scales the completions per prompt from
# GROUP_SIZE (TRL's num_generations default); eval_samples is the validation prompts graded.
GROUP_SIZE = 8
AUTO_COMPUTE_MULTIPLIER = 1.0
AUTO_EVAL_SAMPLES = 64
AUTO_EPOCHS = 3
AUTO_BATCH_SIZE = 8  # the JobSpec's default; at most the training file's example count
AUTO_LEARNING_RATE_MULTIPLIER = 1.0
MAX_SEQ_LEN = 1024  # tokens per example (longer ones are cut); at most the model's context
KEEP_CHECKPOINTS = 3  # OpenAI keeps the checkpoints of the last three epochs
ORGANIZATION_ID = "org-roundpipe"


class JobPlan:
    """A create request translated: the JobSpec to submit and the OpenAI fields to keep."""

    def __init__(self, spec: JobSpec, fields: dict[str, Any]) -> None:
        self.spec = spec
        self.fields = fields


def _hyperparameters(body: FineTuningJobCreate) -> Hyperparameters:
    """The one set of hyperparameters of a request; refuses what this daemon cannot do."""
    if body.integrations:
        raise BadRequest(
            "integrations are not supported by this daemon (it reports to no outside "
            "service); remove integrations and follow the job with list_events",
            code="unsupported_parameter",
            param="integrations",
        )
    method = body.method
    for other in ("supervised", "dpo", "reinforcement"):
        if method is not None and other != method.type and getattr(method, other) is not None:
            raise BadRequest(
                f"method.{other} is not supported with method.type {method.type!r}: give the "
                f"settings under method.{method.type}",
                code="unsupported_method",
                param=f"method.{other}",
            )
    if method is not None and method.type == "reinforcement":
        _check_reinforcement(method.reinforcement)
    inner = _inner(body)
    if body.quantization == "nf4" and (inner is None or inner.lora is None):
        raise BadRequest(
            "quantization 'nf4' freezes the base in 4 bits, which only LoRA adapters can "
            "train on; add method.supervised.lora (or method.dpo.lora), e.g. "
            '{"lora": {"rank": 16}}, or remove quantization',
            code="invalid_value",
            param="quantization",
        )
    nested = inner.hyperparameters if inner is not None else None
    if nested is not None and body.hyperparameters is not None:
        raise BadRequest(
            "give hyperparameters once: in method.supervised.hyperparameters (the top-level "
            "hyperparameters is OpenAI's deprecated form of the same)",
            code="invalid_value",
            param="hyperparameters",
        )
    return nested or body.hyperparameters or Hyperparameters()


def _inner(body: FineTuningJobCreate) -> Any:
    """The settings under method.<type> (None without a method)."""
    method = body.method
    if method is None:
        return None
    return method.supervised or method.dpo or method.reinforcement


def _check_reinforcement(rl: ReinforcementMethod | None) -> None:
    """Refuse what the reinforcement mapping cannot honour (docs/RL.md's table)."""
    if rl is None:
        raise BadRequest(
            "method.type 'reinforcement' needs method.reinforcement with a grader, e.g. "
            '{"grader": {"type": "string_check", "name": "exact", "input": '
            '"{{sample.output_text}}", "reference": "{{item.answer}}", "operation": "eq"}}',
            code="invalid_value",
            param="method.reinforcement",
        )
    if rl.response_format is not None:
        raise BadRequest(
            "method.reinforcement.response_format is not supported: completions are sampled "
            "as free text (a grader can read JSON output through {{sample.output_json}})",
            code="unsupported_parameter",
            param="method.reinforcement.response_format",
        )
    hp = rl.hyperparameters
    if hp is not None and hp.reasoning_effort != "default":
        raise BadRequest(
            "method.reinforcement.hyperparameters.reasoning_effort other than 'default' is "
            "not supported: it applies to OpenAI's reasoning models, and the models here "
            "sample without a reasoning budget; use 'default' or leave it out",
            code="unsupported_parameter",
            param="method.reinforcement.hyperparameters.reasoning_effort",
        )


def _is_dpo(body: FineTuningJobCreate) -> bool:
    return body.method is not None and body.method.type == "dpo"


def _is_reinforcement(body: FineTuningJobCreate) -> bool:
    return body.method is not None and body.method.type == "reinforcement"


def _grpo_section(
    hp: Hyperparameters, rl: ReinforcementMethod
) -> tuple[GrpoSection, dict[str, Any]]:
    """The JobSpec's grpo section of a reinforcement request, and the resolved values of
    OpenAI's reinforcement-only hyperparameters."""
    multiplier = getattr(hp, "compute_multiplier", "auto")
    multiplier = AUTO_COMPUTE_MULTIPLIER if multiplier == "auto" else multiplier
    eval_samples = getattr(hp, "eval_samples", "auto")
    eval_samples = AUTO_EVAL_SAMPLES if eval_samples == "auto" else eval_samples
    mapped: dict[str, Any] = {
        # more compute: more completions explored per prompt
        "group_size": max(2, round(GROUP_SIZE * multiplier)),
        "eval_prompts": eval_samples,
    }
    # This daemon's extension: grpo fields given under method.reinforcement.grpo win.
    given = rl.grpo.model_dump(exclude_unset=True) if rl.grpo is not None else {}
    section = GrpoSection(**{**mapped, **given})
    resolved = {
        "compute_multiplier": multiplier,
        "eval_samples": section.eval_prompts,
        "reasoning_effort": getattr(hp, "reasoning_effort", "default"),
    }
    return section, resolved


def plan_job(
    body: FineTuningJobCreate,
    *,
    model: ModelSection,
    max_positions: int | None,
    train_examples: int,
    gpu_count: int,
    seed: int,
) -> JobPlan:
    """Translate a create request whose model and files the caller has found.

    Args:
        model: the model section `body.model` resolves to.
        max_positions: the model's context length, when known.
        train_examples: records in the training file (one example = one sequence).
        gpu_count: GPUs this daemon schedules (0: CPU devices).
        seed: `body.seed`, or the seed the caller generated for it.
    """
    hp = _hyperparameters(body)
    n_epochs = AUTO_EPOCHS if hp.n_epochs == "auto" else hp.n_epochs
    batch_size = min(AUTO_BATCH_SIZE, train_examples) if hp.batch_size == "auto" else hp.batch_size
    multiplier = (
        AUTO_LEARNING_RATE_MULTIPLIER
        if hp.learning_rate_multiplier == "auto"
        else hp.learning_rate_multiplier
    )
    inner = _inner(body)
    lora = inner.lora if inner is not None else None
    dpo = _is_dpo(body)
    rl = _is_reinforcement(body)
    # reinforcement: the supervised rates (as the JobSpec's objective grpo default)
    rates = DPO_LEARNING_RATE if dpo else BASE_LEARNING_RATE
    if lora is not None:
        base_lr = rates["lora"]
    else:
        base_lr = rates["preset" if model.preset is not None else "pretrained"]
    beta = getattr(hp, "beta", "auto")
    beta = DPO_BETA if beta == "auto" else beta
    steps_per_epoch = max(1, math.ceil(train_examples / batch_size))
    seq_len = min(MAX_SEQ_LEN, max_positions) if max_positions else MAX_SEQ_LEN
    grpo, rl_resolved = _grpo_section(hp, inner) if rl else (None, {})
    eval_interval = getattr(hp, "eval_interval", "auto")
    if eval_interval == "auto":
        eval_interval = steps_per_epoch if body.validation_file else 0
    if rl:
        rl_resolved["eval_interval"] = eval_interval
    spec = JobSpec(
        name=body.suffix,
        model=model.model_copy(
            update={
                "dtype": "bfloat16" if gpu_count else "float32",
                "quantization": body.quantization,
            }
        ),
        data=DataSection(
            train=body.training_file,
            valid=body.validation_file,
            format="auto",
            seq_len=seq_len,
            # One example per sequence, so batch_size and n_epochs count examples as
            # OpenAI's do (packing would count blocks of concatenated examples).
            packing=False,
        ),
        train=TrainSection(
            steps=None,
            epochs=float(n_epochs),
            batch_size=batch_size,
            lr=base_lr * multiplier,
            method="lora" if lora is not None else "full",
            objective="dpo" if dpo else "grpo" if rl else "sft",
            # Linear decay without warm-up: the Hugging Face Trainer's defaults.
            schedule="linear",
            warmup_steps=0,
            seed=seed,
            eval_interval=eval_interval,
            checkpoint_interval=steps_per_epoch,
            keep_checkpoints=KEEP_CHECKPOINTS,
        ),
        engine=EngineSection(gpus=1 if gpu_count else 0, matmul_precision=body.matmul_precision),
        lora=lora,
        dpo=DpoSection(beta=beta) if dpo else None,
        grpo=grpo,
        grader=inner.grader if rl else None,
    )
    resolved = ResolvedHyperparameters(
        n_epochs=n_epochs, batch_size=batch_size, learning_rate_multiplier=multiplier
    )
    fields = {
        "model": body.model,
        "training_file": body.training_file,
        "validation_file": body.validation_file,
        "suffix": body.suffix,
        "metadata": body.metadata,
        "hyperparameters": {**resolved.model_dump(), **rl_resolved},
    }
    return JobPlan(spec, fields)


def _native_fields(job: JobRecord) -> dict[str, Any]:
    """What a job submitted through the native API shows as OpenAI fields."""
    spec = job.spec
    model = spec.get("model", {})
    train = spec.get("train", {})
    epochs = train.get("epochs")
    return {
        "model": model.get("preset") or model.get("path") or "",
        "training_file": spec.get("data", {}).get("train", ""),
        "validation_file": spec.get("data", {}).get("valid"),
        "suffix": None,
        "metadata": None,
        "hyperparameters": {
            "n_epochs": int(epochs)
            if isinstance(epochs, float) and epochs.is_integer()
            else epochs,
            "batch_size": train.get("batch_size"),
            "learning_rate_multiplier": None,
        },
    }


def openai_job(
    job: JobRecord, extra: OpenAIJobRecord | None, *, now: float | None = None
) -> FineTuningJob:
    """The OpenAI object of a native job (made through either API)."""
    fields = extra.fields if extra is not None else _native_fields(job)
    status = STATUSES[job.status]
    eta = job.progress.get("eta_seconds")
    estimated_finish = (
        int((now or time.time()) + eta)
        if status == "running" and isinstance(eta, int | float)
        else None
    )
    hyperparameters = ResolvedHyperparameters.model_validate(fields["hyperparameters"])
    method: dict[str, Any] = {
        "type": "supervised",
        "supervised": {"hyperparameters": hyperparameters},
    }
    if job.spec.get("train", {}).get("objective") == "dpo":
        beta = (job.spec.get("dpo") or {}).get("beta")
        dpo_hp = DpoResolvedHyperparameters(**hyperparameters.model_dump(), beta=beta)
        method = {"type": "dpo", "dpo": {"hyperparameters": dpo_hp}}
    elif job.spec.get("train", {}).get("objective") == "grpo":
        rl_hp = ReinforcementResolvedHyperparameters.model_validate(fields["hyperparameters"])
        method = {
            "type": "reinforcement",
            "reinforcement": {"grader": job.spec.get("grader"), "hyperparameters": rl_hp},
        }
    error = job.error if job.status == "failed" and job.error else None
    return FineTuningJob(
        id=job.id,
        created_at=job.created_at,
        error=error,
        # The id chat.completions takes (rp_service/serving/models.py); the native job
        # keeps the output folder's path in output_model_path.
        fine_tuned_model=fine_tuned_id(job),
        finished_at=job.finished_at if job.status in TERMINAL_STATUSES else None,
        hyperparameters=hyperparameters,
        method=method,
        model=fields["model"],
        organization_id=ORGANIZATION_ID,
        result_files=[result_file_id(job.id)] if job.status == "succeeded" else [],
        seed=int(job.spec.get("train", {}).get("seed", 0)),
        status=status,
        trained_tokens=job.trained_tokens if job.status in TERMINAL_STATUSES else None,
        training_file=fields["training_file"],
        validation_file=fields["validation_file"],
        estimated_finish=estimated_finish,
        metadata=fields["metadata"],
        suffix=fields["suffix"],
        user_provided_suffix=fields["suffix"],
    )


# ---------------------------------------------------------------- events and checkpoints


def _cursor_id(prefix: str, job_id: str, number: int) -> str:
    return f"{prefix}-{job_id.removeprefix('job-')}-{number}"


def event_id(job_id: str, event: int) -> str:
    """`ftevent-<job hex>-<n>`: unique across jobs, and `after` reads its number back."""
    return _cursor_id("ftevent", job_id, event)


def checkpoint_id(job_id: str, step: int) -> str:
    return _cursor_id("ftckpt", job_id, step)


def parse_cursor(value: str, *, prefix: str, job_id: str, param: str = "after") -> int:
    """The number inside an `after` cursor of this job's events or checkpoints."""
    head, _, number = value.rpartition("-")
    if (
        head != f"{prefix}-{job_id.removeprefix('job-')}"
        or not (number.isascii() and number.isdigit())
        or int(number) > MAX_INT64
    ):
        raise BadRequest(
            f"{param}: {value[:80]!r} is not an id of this job's list (expected "
            f"{_cursor_id(prefix, job_id, 1)!r}, the id of the last item of the previous page)",
            code="invalid_value",
            param=param,
        )
    return int(number)


def openai_event(event: EventRecord) -> FineTuningJobEvent:
    return FineTuningJobEvent(
        id=event_id(event.job_id, event.id),
        created_at=event.created_at,
        level="warn" if event.level == "warning" else event.level,  # type: ignore[arg-type]
        message=event.message,
        data=event.data,
        type="metrics" if event.type == "metrics" else "message",
    )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def openai_checkpoint(record: CheckpointRecord) -> FineTuningJobCheckpoint:
    return FineTuningJobCheckpoint(
        id=checkpoint_id(record.job_id, record.step),
        created_at=record.created_at,
        fine_tuned_model_checkpoint=record.path,
        fine_tuning_job_id=record.job_id,
        metrics=CheckpointMetrics(
            step=record.step,
            train_loss=_number(record.metrics.get("train_loss")),
            # On up to the worker's evaluation cap of validation sequences, not always all
            # of them, so OpenAI's full_valid_loss stays unset.
            valid_loss=_number(record.metrics.get("valid_loss")),
        ),
        step_number=record.step,
    )
