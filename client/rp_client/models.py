"""Typed results mirroring docs/API.md; every model keeps fields it does not know."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Generic, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict

__all__ = [
    "TERMINAL_STATUSES",
    "Checkpoint",
    "Cluster",
    "ClusterNode",
    "DataSection",
    "DpoSection",
    "EngineSection",
    "Event",
    "Export",
    "File",
    "FileDeleted",
    "GpuModeChoice",
    "GpuShare",
    "Job",
    "JobDeleted",
    "JobError",
    "JobMetrics",
    "JobProgress",
    "JobSpec",
    "LogChunk",
    "LoraSection",
    "ModelSection",
    "Page",
    "ParameterCounts",
    "System",
    "TokenizerSection",
    "TrainSection",
    "load_spec_file",
]

TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})

T = TypeVar("T")


class _Model(BaseModel):
    # Tolerant of fields a newer daemon adds.
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class JobProgress(_Model):
    step: int = 0
    total_steps: int | None = None
    epoch: float | None = None
    eta_seconds: float | None = None


class JobError(_Model):
    code: str | None = None
    message: str = ""
    param: str | None = None
    details: dict[str, Any] | None = None


class ParameterCounts(_Model):
    """How many parameters the optimizer trains, and how many the model has in all."""

    trainable: int
    total: int
    base_host_bytes: int | None = None  # the weights' host bytes as stored (packed with nf4)

    @property
    def trainable_fraction(self) -> float:
        """trainable / total (0.0 for an empty model)."""
        return self.trainable / self.total if self.total else 0.0


class GpuModeChoice(_Model):
    """How a job runs on its GPUs: one process (pipeline) or data-parallel ranks, and why."""

    mode: str
    ranks: int = 1
    reason: str = ""
    overlap_calls: bool = False  # one process overlapping its calls (engine.overlap_calls)


class Job(_Model):
    id: str
    object: str = "job"
    name: str | None = None
    status: str
    created_at: int | None = None
    started_at: int | None = None
    finished_at: int | None = None
    priority: int = 0
    attempt: int = 0
    restarts: int = 0
    spec: dict[str, Any] = {}
    progress: JobProgress = JobProgress()
    metrics: dict[str, Any] = {}
    trained_tokens: int = 0
    output_model_path: str | None = None
    gpus: list[int] = []
    error: JobError | None = None
    parameters: ParameterCounts | None = None  # null until the worker has built the model
    gpu_mode: GpuModeChoice | None = None  # null for jobs queued by an older daemon

    @property
    def is_terminal(self) -> bool:
        """True once the job succeeded, failed or was cancelled."""
        return self.status in TERMINAL_STATUSES


class Event(_Model):
    id: int
    object: str = "event"
    job_id: str
    created_at: int | None = None
    level: str = "info"
    type: str
    message: str = ""
    data: dict[str, Any] | None = None


class File(_Model):
    id: str
    object: str = "file"
    filename: str = ""
    bytes: int = 0
    sha256: str | None = None
    line_count: int | None = None
    format: str | None = None
    created_at: int | None = None


class FileDeleted(_Model):
    id: str
    object: str = "file"
    deleted: bool = True


class JobDeleted(_Model):
    id: str
    object: str = "job"
    deleted: bool = True


class Checkpoint(_Model):
    object: str = "checkpoint"
    job_id: str
    step: int
    created_at: int | None = None
    path: str | None = None
    size_bytes: int | None = None
    metrics: dict[str, Any] = {}


class Export(_Model):
    """A job's model written in another format on the daemon's disk (`jobs.export`)."""

    object: str = "export"
    job_id: str
    format: str
    type: str
    path: str
    modelfile: str  # the Ollama Modelfile beside a GGUF
    size_bytes: int


class Page(_Model, Generic[T]):
    """One page of a list: `data` plus the cursor to the next page."""

    object: str = "list"
    data: list[T]
    has_more: bool = False
    first_id: Any = None
    last_id: Any = None


class JobMetrics(_Model):
    object: str = "job.metrics"
    job_id: str
    columns: dict[str, list[Any]] = {}


class GpuShare(_Model):
    """One GPU (or a CPU job's virtual device): the job holding it and the share of the
    job's latest step it was busy."""

    gpu: int | None = None
    device: str = ""
    job_id: str | None = None
    busy_fraction: float | None = None
    jobs: int | None = None
    step: int | None = None


class ClusterNode(_Model):
    """One node of the daemon's Ray cluster: its resources and the jobs with a rank on it."""

    node_id: str = ""
    address: str | None = None
    cpus: int = 0
    gpus: int = 0
    memory_bytes: int = 0
    jobs: list[str] = []


class Cluster(_Model):
    address: str = ""
    nodes: list[ClusterNode] = []
    error: str | None = None


class System(_Model):
    version: str | None = None
    versions: dict[str, Any] = {}
    devices: list[Any] = []
    host_memory_bytes: int | None = None
    pinned_budget_bytes: int | None = None
    host_memory_budget_bytes: int | None = None
    adam: dict[str, Any] = {}
    queue_length: int = 0
    jobs: dict[str, int] = {}
    gpu_share: list[GpuShare] = []
    cluster: Cluster | None = None  # the Ray cluster of multi-node jobs; None: one box


class LogChunk(_Model):
    """Bytes of a job's log from an offset, and where the next read starts."""

    text: str
    next_offset: int


# JobSpec: every field optional so that only what the user set is sent; the daemon fills
# the defaults and validates (docs/API.md is the reference for values).


class ModelSection(_Model):
    preset: str | None = None
    config: dict[str, Any] | None = None
    path: str | None = None
    dtype: str | None = None
    quantization: str | None = None  # none | nf4 (needs train.method lora)


class TokenizerSection(_Model):
    path: str | None = None
    chat_template: str | None = None  # 'chatml' or a Jinja file on the daemon's disk


class DataSection(_Model):
    train: str | None = None
    valid: str | None = None
    format: str | None = None
    seq_len: int | None = None
    packing: bool | None = None


class TrainSection(_Model):
    steps: int | None = None
    epochs: float | None = None
    batch_size: int | None = None
    lr: float | None = None
    schedule: str | None = None
    warmup_steps: int | None = None
    weight_decay: float | None = None
    betas: list[float] | None = None
    grad_clip: float | None = None
    seed: int | None = None
    eval_interval: int | None = None
    checkpoint_interval: int | None = None
    keep_checkpoints: int | None = None
    method: str | None = None  # "full" | "lora"
    # "sft" | "dpo" (data format preference, the dpo section) | "grpo" (prompt rows, the
    # grpo section and a grader: docs/RL.md)
    objective: str | None = None
    sample_prompts: list[str] | None = None  # completed at every evaluation (`sample` events)
    sample_max_tokens: int | None = None


class EngineSection(_Model):
    num_microbatch: int | None = None
    recompute_grain: str | None = None
    optim_dtype: str | None = None
    optim_state_dtype: str | None = None  # float32 | bfloat16 (docs/API.md, "Host memory")
    optim_memory: str | None = None  # default | compact (docs/HOST_MEMORY_MODES.md)
    optim_grad_dtype: str | None = None  # float32 | model
    recompute_attention: bool | None = None
    layers_per_group: int | None = None  # null: the automatic plan (docs/API.md)
    pin_model: str | None = None
    gpus: int | None = None  # per node when nodes > 1
    nodes: int | None = None  # machines of the daemon's Ray cluster (docs/SCALING.md)
    gpu_mode: str | None = None  # auto | pipeline | ranks (docs/SCALING.md, "One box")
    overlap_calls: bool | str | None = None  # auto | true | false (docs/SCALING.md)
    async_step: bool | None = None
    step_staleness: int | None = None  # 0 (default) | 1: docs/HOST_MEMORY_MODES.md, "Staleness"
    max_gpu_memory_gib: float | None = None  # GiB a GPU the job may use (docs/API.md)
    matmul_precision: str | None = None  # bf16 | fp8 (docs/PERFORMANCE.md, "FP8")
    fp8_recipe: str | None = None  # rowwise | tensorwise | rowwise_with_gw_hp


class LoraSection(_Model):
    rank: int | None = None
    alpha: float | None = None
    dropout: float | None = None
    target_modules: list[str] | None = None
    merge: bool | None = None


class DpoSection(_Model):
    beta: float | None = None
    label_smoothing: float | None = None


class GrpoSection(_Model):
    """GRPO's options (docs/RL.md): completions per prompt, sampling, the loss."""

    group_size: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_completion_tokens: int | None = None
    kl_coef: float | None = None
    clip_epsilon: float | None = None
    clip_epsilon_high: float | None = None
    loss_type: str | None = None  # dapo | grpo | dr_grpo
    scale_rewards: str | None = None  # group | batch | none
    sample_interval: int | None = None
    eval_prompts: int | None = None
    num_iterations: int | None = None  # optimizer steps on each batch of rollouts
    generation: str | None = None  # auto | streamed | engine


class JobSpec(_Model):
    """What to train; `to_body()` sends only the fields that were set."""

    name: str | None = None
    priority: int | None = None
    model: ModelSection | None = None
    tokenizer: TokenizerSection | None = None
    data: DataSection | None = None
    train: TrainSection | None = None
    engine: EngineSection | None = None
    lora: LoraSection | None = None
    dpo: DpoSection | None = None
    grpo: GrpoSection | None = None
    # An OpenAI grader object (string_check, text_similarity, multi, python): docs/RL.md
    grader: dict[str, Any] | None = None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> JobSpec:
        """Reads a spec from a YAML (or JSON) file."""
        return cls.model_validate(load_spec_file(path))

    def to_body(self) -> dict[str, Any]:
        """The JSON body for POST /v1/jobs: set fields only (an explicit null is kept)."""
        return self.model_dump(mode="json", exclude_unset=True)


def load_spec_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads a job spec mapping from a YAML (or JSON) file, unvalidated: the daemon checks it."""
    text = Path(path).read_text(encoding="utf-8")
    loaded = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: a job spec must be a mapping, got {type(loaded).__name__}")
    return loaded
