"""Pydantic models of the REST API: the JobSpec sections, the public objects, list pages.

Over ~700 lines: the JobSpec's sections validate against each other (a method's fields, the
engine's options, the data's format) and the public objects embed the JobSpec, so they are
one schema; the OpenAI facade's models live in rp_service/openai/. A split by section
(spec.py, objects.py) is the next step if it grows.
"""

from __future__ import annotations

import math
from typing import Any, Generic, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine import catalog
from engine.options import (
    DtypeName,
    Fp8Recipe,
    MatmulPrecision,
    OptimMemory,
    OptimStateDtype,
    PinModel,
    Quantization,
    RecomputeGrain,
)
from engine.planning.memory_plan import MAX_DIM
from rp_service.graders import GraderSpec

__all__ = [
    "MAX_INT64",
    "MAX_SAMPLE_PROMPTS",
    "MAX_SAMPLE_PROMPT_CHARS",
    "TERMINAL_STATUSES",
    "Checkpoint",
    "DataSection",
    "DpoSection",
    "EngineSection",
    "ErrorBody",
    "ErrorEnvelope",
    "Event",
    "EventType",
    "File",
    "FileDeleted",
    "FileFormat",
    "GpuModeChoice",
    "GpuShare",
    "GrpoSection",
    "Health",
    "Job",
    "JobDeleted",
    "JobError",
    "JobMetrics",
    "JobSpec",
    "JobStatus",
    "ListPage",
    "LoraSection",
    "ModelSection",
    "ParameterCounts",
    "Progress",
    "Ready",
    "SystemInfo",
    "TokenizerSection",
    "TrainSection",
]

# The largest integer SQLite stores: every integer a request gives is bounded by it, so a
# larger one is a 4xx, never an overflow (a 500) further in.
MAX_INT64 = 2**63 - 1
# train.sample_prompts: every evaluation completes each of them, one forward a token.
MAX_SAMPLE_PROMPTS = 8
MAX_SAMPLE_PROMPT_CHARS = 2000

JobStatus = Literal[
    "validating",
    "queued",
    "running",
    "pausing",
    "paused",
    "cancelling",
    "cancelled",
    "succeeded",
    "failed",
]
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
EventType = Literal["status", "metrics", "checkpoint", "sample", "log", "message"]
EventLevel = Literal["info", "warning", "error"]
FileFormat = Literal["text", "chat", "prompt_completion", "preference", "prompt"]
DType = DtypeName
ConfigValue = int | float | str | bool | None | list[int | float | str | bool | None]
# Shape fields of a preset's config: whole numbers the model's tensors are built from (and
# the host-memory plan counts), each in 1..2**31; the two HF derives when null may be null.
_CONFIG_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
)
_CONFIG_NULLABLE = ("num_key_value_heads", "head_dim")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- JobSpec


class ModelSection(_Section):
    """The model to train: a preset with random initialisation, or a local HF directory."""

    preset: Literal[catalog.PRESET_NAMES] | None = Field(  # type: ignore[valid-type]
        None, description="Architecture preset, randomly initialised (exactly one of preset/path)."
    )
    config: dict[str, ConfigValue] = Field(
        default_factory=dict,
        description="Hugging Face config overrides for a preset, e.g. {hidden_size: 64}.",
    )
    path: str | None = Field(
        None,
        max_length=4096,
        description="Absolute local HF directory (config.json + *.safetensors) under RP_MODEL_ROOTS.",
    )
    dtype: DType = Field("float32", description="dtype of the model copy; the optimizer is fp32.")
    quantization: Quantization = Field(
        "none",
        description="nf4: the frozen base's linear weights held 4-bit in host memory "
        "(QLoRA, docs/QLORA.md); needs train.method lora.",
    )

    @field_validator("config")
    @classmethod
    def _sizes_and_finite_numbers(cls, config: dict[str, ConfigValue]) -> dict[str, ConfigValue]:
        for key, value in config.items():
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                raise ValueError(f"model.config.{key} is {value!r}; give a finite number")
            if key not in _CONFIG_SIZES or (value is None and key in _CONFIG_NULLABLE):
                continue
            whole = isinstance(value, int) and not isinstance(value, bool)
            if not whole or not 1 <= value <= MAX_DIM:  # type: ignore[operator]
                raise ValueError(
                    f"model.config.{key} must be a whole number from 1 to {MAX_DIM}, got {value!r}"
                )
        return config

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.preset is None) == (self.path is None):
            raise ValueError(
                "give exactly one of model.preset (e.g. 'qwen3') or model.path "
                "(a local Hugging Face directory)"
            )
        if self.path is not None and self.config:
            raise ValueError(
                "model.config overrides apply to a preset only; remove them or the path"
            )
        return self


class TokenizerSection(_Section):
    path: str | None = Field(
        None,
        max_length=4096,
        description="Local tokenizer dir under RP_MODEL_ROOTS; null: the model dir, "
        "or the built-in byte-level tokenizer for presets.",
    )
    chat_template: str | None = Field(
        None,
        max_length=4096,
        description="'chatml', or a Jinja template file under RP_MODEL_ROOTS: replaces the "
        "tokenizer's chat template and is saved with the trained model; null: the "
        "folder's own (ChatML for presets). docs/CHAT.md.",
    )


class DataSection(_Section):
    train: str = Field(
        ...,
        min_length=1,
        max_length=4096,
        description='"file-..." id, an absolute path under RP_DATASET_ROOTS, or "synthetic".',
    )
    valid: str | None = Field(None, min_length=1, max_length=4096, description="Same forms.")
    format: Literal["auto", "text", "chat", "prompt_completion", "preference", "prompt"] = "auto"
    seq_len: int = Field(256, ge=2, le=1 << 20, description="Tokens per sequence.")
    packing: bool = True


# train.lr when the spec gives none, by what is trained: rates that work on the first try
# (docs/SERVICE.md, "Learning rate").
# DPO moves a trained model a little: a tenth (the OpenAI mapping's rule).
DEFAULT_LR = {
    "lora": 2.0e-4,
    "pretrained": 2.0e-5,
    "preset": 1.0e-3,
    "dpo_lora": 2.0e-5,
    "dpo_pretrained": 2.0e-6,
}
# Objective grpo takes the fine-tune rates: its updates are scaled by group-normalised
# advantages, and a tenth of them barely moves a LoRA adapter in a short run.
_TENTH_RATE_OBJECTIVES = ("dpo",)


def default_lr(method: str, pretrained: bool, objective: str = "sft") -> float:
    """The peak learning rate of a job whose spec gives none: LoRA adapters, a full
    fine-tune of a model folder (pretrained weights), or a preset from random weights
    (today's 1e-3). DPO takes a tenth of a fine-tune's rate."""
    if method != "lora" and not pretrained:
        return DEFAULT_LR["preset"]
    key = "lora" if method == "lora" else "pretrained"
    return DEFAULT_LR["dpo_" + key if objective in _TENTH_RATE_OBJECTIVES else key]


class TrainSection(_Section):
    steps: int | None = Field(300, ge=1, le=10**9, description="Optimizer steps (or epochs).")
    epochs: float | None = Field(None, gt=0, le=10**4)
    batch_size: int = Field(8, ge=1, le=1 << 16, description="Sequences per optimizer step.")
    lr: float = Field(
        DEFAULT_LR["preset"],
        gt=0,
        le=10,
        description="Peak learning rate, > 0. Not given: by what is trained (the job's spec "
        "shows the value chosen): 2e-4 for LoRA adapters, 2e-5 for a full fine-tune of a "
        "model folder (pretrained weights), a tenth of those for objective dpo; 1e-3 for a "
        "full run of a preset (random initialisation).",
    )
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(20, ge=0, le=10**9)
    weight_decay: float = Field(0.0, ge=0, le=10)
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam betas, each in [0, 1).")
    grad_clip: float | None = Field(1.0, gt=0, description="Max grad norm; null: off.")
    seed: int = Field(0, ge=0, le=2**63 - 1)
    eval_interval: int = Field(50, ge=0, description="Steps between evaluations; 0 = never.")
    checkpoint_interval: int = Field(50, ge=0, description="Steps; 0 = only at pause/end.")
    keep_checkpoints: int = Field(2, ge=1, le=1000)
    method: Literal["full", "lora"] = Field(
        "full", description="full: train every weight; lora: frozen base + LoRA adapters."
    )
    objective: Literal["sft", "dpo", "grpo"] = Field(
        "sft",
        description="sft: next-token loss on the trained tokens; dpo: preference pairs "
        "(data format preference), options in the dpo section; grpo: reinforcement with a "
        "grader on prompt rows (data format prompt; batch_size counts prompts), options in "
        "the grpo section, the reward in `grader` (docs/RL.md).",
    )
    sample_prompts: list[str] = Field(
        default_factory=list,
        description=f"Up to {MAX_SAMPLE_PROMPTS} prompts the worker completes greedily with the "
        "current weights at every evaluation and at the last step (`sample` events).",
    )
    sample_max_tokens: int = Field(
        64, ge=1, le=1024, description="Most tokens of each sample completion."
    )

    @field_validator("sample_prompts")
    @classmethod
    def _few_short_prompts(cls, prompts: list[str]) -> list[str]:
        if len(prompts) > MAX_SAMPLE_PROMPTS:
            raise ValueError(
                f"{len(prompts)} prompts given; give at most {MAX_SAMPLE_PROMPTS} (every "
                "evaluation completes each one)"
            )
        for i, prompt in enumerate(prompts):
            if not prompt.strip():
                raise ValueError(f"prompt {i} is empty; give it some text or remove it")
            if len(prompt) > MAX_SAMPLE_PROMPT_CHARS:
                raise ValueError(
                    f"prompt {i} is {len(prompt)} characters; shorten it to at most "
                    f"{MAX_SAMPLE_PROMPT_CHARS}"
                )
        return prompts

    @model_validator(mode="before")
    @classmethod
    def _epochs_replace_steps(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("epochs") is not None and "steps" not in data:
            return {**data, "steps": None}
        return data

    @model_validator(mode="after")
    def _check(self) -> TrainSection:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of train.steps or train.epochs")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"train.betas must each lie in [0, 1), got {list(self.betas)}")
        return self


class EngineSection(_Section):
    num_microbatch: int | None = Field(None, ge=1, le=512, description="null: devices + 1.")
    recompute_grain: RecomputeGrain = "stage"
    optim_dtype: DType = "float32"
    optim_state_dtype: OptimStateDtype = Field(
        "float32",
        description="Adam's exp_avg/exp_avg_sq: float32 (exact) or bfloat16 (4 bytes a "
        "parameter less; stochastic rounding).",
    )
    optim_grad_dtype: Literal["float32", "model"] = Field(
        "float32",
        description="The optimizer's gradient: a float32 buffer, or the model-dtype gradient "
        "the GPUs downloaded, read in place (4 bytes a parameter less).",
    )
    optim_memory: OptimMemory = Field(
        "default",
        description="default: as optim_dtype / optim_state_dtype / optim_grad_dtype say; "
        "compact: the bfloat16 weights are the optimizer's masters (stochastic rounding), "
        "8-bit Adam moments, the bfloat16 gradient read in place: about 6 bytes of host "
        "memory a trainable parameter (12 in the lean default). Needs model.dtype bfloat16; "
        "overrides the other three.",
    )
    recompute_attention: bool = Field(
        False,
        description="Recompute attention in the backward instead of keeping its outputs in "
        "host memory (2 bytes x tokens x heads x head_dim per layer).",
    )
    layers_per_group: int | None = Field(
        None,
        ge=1,
        le=1 << 16,
        description="Decoder layers per upload group (an explicit plan of equal groups, the "
        "last one with the head). Each backward group keeps its input in host memory per "
        "micro-batch for the recompute: two-layer groups keep half of what one-layer groups "
        "do (the automatic plan makes one-layer groups for a 70B model), and two groups are "
        "on the GPU at once. null: the automatic plan.",
    )
    pin_model: PinModel = "alloc"
    gpus: int = Field(
        1, ge=0, le=64, description="How many GPUs (0 = CPU devices); per node with nodes > 1."
    )
    nodes: int = Field(
        1,
        ge=1,
        le=256,
        description="Machines of the daemon's Ray cluster (RP_RAY_ADDRESS) the job spans, one "
        "data-parallel rank each with engine.gpus GPUs; 1: this box (docs/SCALING.md).",
    )
    gpu_mode: Literal["auto", "pipeline", "ranks"] = Field(
        "auto",
        description="How a job on several GPUs of this box runs: pipeline, one process "
        "driving all engine.gpus GPUs round robin; ranks, one data-parallel process per GPU "
        "(each holds a copy of the model in host memory; full fine-tunes with the sft "
        "objective only); auto, ranks on 4 or more GPUs where they can run, their copies "
        "fit the host memory budget and the step is asynchronous with step_staleness 1, "
        "else pipeline. "
        "The job object's gpu_mode says which ran and why (docs/SCALING.md).",
    )
    overlap_calls: bool | Literal["auto"] = Field(
        "auto",
        description="true: each step's backward finishes behind the next step's forward "
        "(the engine's overlap_calls: same results, the pipeline's fill and drain hidden; "
        "a second half-precision copy of the trainable weights in host memory). auto: on "
        "for an sft job run as one process on 2 or more GPUs with async_step and "
        "step_staleness 1, where the copy and a second step's activations fit the host "
        "memory budget. One process only (not with gpu_mode ranks or engine.nodes > 1), "
        "sft only, not with optim_memory compact. The job object's gpu_mode.overlap_calls "
        "says what ran (docs/SCALING.md).",
    )
    async_step: bool = Field(
        True,
        description="true: the optimizer step runs on a host thread while the next step "
        "computes (step_staleness says with which weights); false: every step waits for it.",
    )
    step_staleness: Literal[0, 1] = Field(
        0,
        description="With async_step, the weights the next step computes with: 0, the "
        "updated ones, each layer's upload waiting for that layer's update (the results of "
        "async_step false at nearly the asynchronous speed); 1, those from before the "
        "update (the engine's `is_async=True`; converges worse on short fine-tunes: "
        "docs/HOST_MEMORY_MODES.md). The compact mode is always 0.",
    )
    max_gpu_memory_gib: float | None = Field(
        None,
        gt=0,
        le=1 << 20,
        description="GiB of each GPU the engine may use (its plan sizes for a card that "
        "large; CUDA allocations past it fail). null: the daemon's RP_GPU_MEMORY_GIB, else "
        "the whole GPU. At most the daemon's RP_GPU_MEMORY_GIB where that is set.",
    )
    matmul_precision: MatmulPrecision = Field(
        "bf16",
        description="bf16: the linear layers multiply in the model's dtype; fp8: the decoder's "
        "linear layers multiply in float8, forward and backward (embeddings, norms, "
        "attention, the loss and the output head stay bf16). fp8 needs model.dtype "
        "bfloat16 and GPUs of compute capability >= 8.9 (docs/PERFORMANCE.md, FP8).",
    )
    fp8_recipe: Fp8Recipe = Field(
        "rowwise",
        description="With matmul_precision fp8: rowwise (a scale per row, all e4m3), "
        "tensorwise (a scale per tensor, gradients e5m2) or rowwise_with_gw_hp (rowwise, "
        "the weight gradient's matmul in bf16).",
    )


class LoraSection(_Section):
    """LoRA adapters of a `train.method: lora` job (peft's LoraConfig names)."""

    rank: int = Field(16, ge=1, le=1 << 16, description="Adapter rank r, <= the layer width.")
    alpha: float = Field(32.0, gt=0, le=1e6, description="Scale: updates are alpha/rank * BA.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(catalog.LORA_TARGET_MODULES),
        min_length=1,
        description="Projections to adapt; default all attention and MLP projections.",
    )
    merge: bool = Field(
        False, description="Also save the merged model (adapter folded in, HF format)."
    )

    @field_validator("target_modules")
    @classmethod
    def _known_modules(cls, names: list[str]) -> list[str]:
        unknown = [n for n in names if n not in catalog.LORA_TARGET_MODULES]
        if unknown:
            raise ValueError(
                f"unknown target module(s) {', '.join(map(repr, unknown))}; use any of "
                f"{', '.join(catalog.LORA_TARGET_MODULES)}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"a target module is listed twice in {names}; list each once")
        return names


class DpoSection(_Section):
    """Options of a `train.objective: dpo` job (TRL's and OpenAI's names)."""

    beta: float = Field(
        0.1, gt=0, le=1000, description="Strength of the pull towards the reference."
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="Probability that a pair's label is flipped (cDPO)."
    )


class GrpoSection(_Section):
    """Options of a `train.objective: grpo` job (TRL's GRPOConfig names where they exist)."""

    group_size: int = Field(
        8,
        ge=2,
        le=256,
        description="Completions sampled per prompt (TRL's num_generations); advantages are "
        "relative to the group.",
    )
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1: off).")
    max_completion_tokens: int = Field(
        256, ge=1, le=32768, description="Most tokens of each sampled completion."
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        le=100,
        description="beta: weight of the KL term to the reference (LoRA: the base with the "
        "adapters off; full: the starting weights, a second copy in host memory); 0 (TRL's "
        "default) leaves it out.",
    )
    clip_epsilon: float = Field(0.2, gt=0, lt=1, description="PPO clip range (epsilon).")
    clip_epsilon_high: float | None = Field(
        None, gt=0, le=10, description="Upper clip range (DAPO's clip-higher); null: epsilon."
    )
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = Field(
        "dapo",
        description="How the token losses are averaged (TRL's names and default): dapo, over "
        "every completion token of the batch; grpo, per completion then over completions; "
        "dr_grpo, over completions x max_completion_tokens.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantages (r - group mean) divided by the group's reward std (group), "
        "the batch's (batch), or not divided (none), as TRL's scale_rewards.",
    )
    sample_interval: int = Field(
        10,
        ge=0,
        le=10**9,
        description="Steps between `sample` events showing rollouts with their rewards "
        "(up to 8 rows); 0: none.",
    )
    eval_prompts: int = Field(
        64,
        ge=1,
        le=4096,
        description="Validation prompts completed greedily and graded at each evaluation "
        "(valid_reward_mean).",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        le=64,
        description="Optimizer steps on each batch of rollouts (TRL's num_iterations, mu): "
        "above 1 the rollout policy's log-probabilities are the ratio's denominator and the "
        "clip binds; a batch of prompts then lasts that many steps.",
    )
    generation: Literal["auto", "streamed", "engine"] = Field(
        "auto",
        description="How rollouts are generated: auto, with a KV cache on a copy of the "
        "model on the first GPU where it fits, else with a KV cache there and the decoder "
        "layers kept packed on it (a frozen NF4 base) or streamed from host memory at "
        "every token where those fit, else through the engine; streamed, the streamed "
        "way even where the copy fits (else the engine); engine, always through the "
        "engine's forward (no KV cache, no copy).",
    )


class JobSpec(_Section):
    """What to train and how: the body of `POST /v1/jobs`."""

    name: str | None = Field(None, max_length=200)
    priority: int = Field(0, ge=-1000, le=1000, description="Higher runs first; FIFO within one.")
    model: ModelSection
    tokenizer: TokenizerSection = Field(default_factory=TokenizerSection)
    data: DataSection
    train: TrainSection = Field(default_factory=TrainSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    lora: LoraSection | None = Field(
        None, description="With train.method lora; null there means the defaults."
    )
    dpo: DpoSection | None = Field(
        None, description="With train.objective dpo; null there means the defaults."
    )
    grpo: GrpoSection | None = Field(
        None, description="With train.objective grpo; null there means the defaults."
    )
    grader: GraderSpec | None = Field(
        None,
        validate_default=True,
        description="With train.objective grpo: the reward, an OpenAI grader object "
        "(string_check, text_similarity, multi, python; docs/RL.md#graders).",
    )

    @field_validator("name")
    @classmethod
    def _printable_name(cls, name: str | None) -> str | None:
        # A name is printed by `rp jobs` and the dashboard: no terminal escape sequences,
        # line breaks or invisible characters.
        bad = next((ch for ch in name or "" if not ch.isprintable()), None)
        if bad is not None:
            raise ValueError(
                f"the name holds the control or invisible character {bad!r}; use printable "
                "characters only"
            )
        return name

    @field_validator("lora")
    @classmethod
    def _lora_needs_the_method(
        cls, lora: LoraSection | None, info: ValidationInfo
    ) -> LoraSection | None:
        train = info.data.get("train")  # absent when train itself was invalid
        if lora is not None and isinstance(train, TrainSection) and train.method != "lora":
            raise ValueError(
                "a lora section is given but train.method is 'full'; set train.method to "
                "'lora' or remove the lora section"
            )
        return lora

    @field_validator("dpo")
    @classmethod
    def _dpo_needs_the_objective(
        cls, dpo: DpoSection | None, info: ValidationInfo
    ) -> DpoSection | None:
        train = info.data.get("train")
        if dpo is not None and isinstance(train, TrainSection) and train.objective != "dpo":
            raise ValueError(
                f"a dpo section is given but train.objective is {train.objective!r}; set "
                "train.objective to 'dpo' or remove the dpo section"
            )
        return dpo

    @field_validator("grpo")
    @classmethod
    def _grpo_needs_the_objective(
        cls, grpo: GrpoSection | None, info: ValidationInfo
    ) -> GrpoSection | None:
        train = info.data.get("train")
        if not isinstance(train, TrainSection) or grpo is None:
            return grpo
        if train.objective != "grpo":
            raise ValueError(
                f"a grpo section is given but train.objective is {train.objective!r}; set "
                "train.objective to 'grpo' or remove the grpo section"
            )
        return grpo

    @field_validator("grader")
    @classmethod
    def _grader_with_grpo(cls, grader: Any, info: ValidationInfo) -> Any:
        train = info.data.get("train")
        if not isinstance(train, TrainSection):
            return grader
        if grader is not None and train.objective != "grpo":
            raise ValueError(
                f"a grader is given but train.objective is {train.objective!r}; set "
                "train.objective to 'grpo' or remove the grader"
            )
        if grader is None and train.objective == "grpo":
            raise ValueError(
                "train.objective grpo needs a grader (the reward), e.g. "
                '{"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", '
                '"reference": "{{item.answer}}", "operation": "eq"}'
            )
        return grader

    @model_validator(mode="after")
    def _lr_by_what_is_trained(self) -> JobSpec:
        # Resolved into the spec (and so shown by GET /v1/jobs/{id}); a given lr stays.
        if "lr" not in self.train.model_fields_set:
            self.train.lr = default_lr(
                self.train.method, self.model.path is not None, self.train.objective
            )
        return self

    @model_validator(mode="after")
    def _lora_defaults(self) -> JobSpec:
        if self.train.method == "lora" and self.lora is None:
            self.lora = LoraSection()
        if self.train.objective == "dpo" and self.dpo is None:
            self.dpo = DpoSection()
        if self.train.objective == "grpo" and self.grpo is None:
            self.grpo = GrpoSection()
        return self


# ---------------------------------------------------------------- objects


class Progress(BaseModel):
    step: int = 0
    total_steps: int | None = None
    epoch: float | None = None
    eta_seconds: float | None = None


class ParameterCounts(BaseModel):
    trainable: int = Field(description="Parameters the optimizer updates (the adapters in LoRA).")
    total: int = Field(description="All parameters of the model, adapters included.")
    base_host_bytes: int | None = Field(
        None,
        description="Bytes the host holds for the model's weights as stored (the packed "
        "4-bit base with model.quantization nf4).",
    )


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None
    # The figures behind the cause, e.g. out_of_host_memory's rss_bytes and limit_bytes.
    details: dict[str, Any] | None = None


class GpuModeChoice(BaseModel):
    mode: Literal["pipeline", "ranks"] = Field(
        description="pipeline: one process drives the job's GPUs; ranks: one data-parallel "
        "process per GPU."
    )
    ranks: int = Field(description="Processes that run the job (1 for pipeline).")
    reason: str = Field(description="Why this mode (engine.gpu_mode and the auto rule).")
    overlap_calls: bool = Field(
        False,
        description="Whether one process overlaps each step's backward with the next "
        "step's forward (engine.overlap_calls and its auto rule).",
    )


class Job(BaseModel):
    id: str
    object: Literal["job"] = "job"
    name: str | None
    status: JobStatus
    created_at: int
    started_at: int | None
    finished_at: int | None
    priority: int
    attempt: int
    # Times the job was resumed after a fault that was not its own (RP_MAX_ATTEMPTS bounds it).
    restarts: int = 0
    spec: dict[str, Any]
    progress: Progress
    metrics: dict[str, Any]
    trained_tokens: int
    output_model_path: str | None
    gpus: list[int]
    error: JobError | None
    parameters: ParameterCounts | None = Field(
        None, description="Set once the worker has built the model; null before."
    )
    gpu_mode: GpuModeChoice | None = Field(
        None,
        description="How the job runs on its GPUs, decided at submission from "
        "engine.gpu_mode (docs/SCALING.md); null for jobs queued by an older daemon.",
    )


class Event(BaseModel):
    id: int
    object: Literal["event"] = "event"
    job_id: str
    created_at: int
    level: EventLevel
    type: EventType
    message: str
    data: dict[str, Any]


class File(BaseModel):
    id: str
    object: Literal["file"] = "file"
    filename: str
    bytes: int
    sha256: str
    line_count: int
    format: FileFormat | Literal["csv"] = Field(
        description="csv: a job's results file (purpose fine-tune-results)"
    )
    created_at: int
    # The OpenAI file object's fields, so its SDK reads the same response (docs/API.md).
    purpose: Literal["fine-tune", "fine-tune-results"] = "fine-tune"
    status: Literal["processed"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class JobDeleted(BaseModel):
    id: str
    object: Literal["job"] = "job"
    deleted: bool = True


class Checkpoint(BaseModel):
    object: Literal["checkpoint"] = "checkpoint"
    job_id: str
    step: int
    created_at: int
    path: str
    size_bytes: int
    metrics: dict[str, Any]


class ExportRequest(_Section):
    """`POST /v1/jobs/{id}/export`: the trained model in another runtime's format."""

    format: Literal["gguf"] = Field("gguf", description="gguf: llama.cpp and Ollama.")
    type: Literal["f32", "f16", "q8_0"] = Field(
        "f16", description="Tensor type of the matrices (norms stay f32)."
    )


class Export(BaseModel):
    """A finished export: the file, the Ollama Modelfile beside it, and its size."""

    object: Literal["export"] = "export"
    job_id: str
    format: Literal["gguf"]
    type: Literal["f32", "f16", "q8_0"]
    path: str
    modelfile: str
    size_bytes: int


T = TypeVar("T")


class ListPage(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool
    first_id: str | int | None
    last_id: str | int | None


class JobMetrics(BaseModel):
    object: Literal["job.metrics"] = "job.metrics"
    job_id: str
    columns: dict[str, list[float | int | None]]


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Ready(BaseModel):
    status: Literal["ready"] = "ready"
    store: bool
    orchestrator: bool
    devices: int


class GpuShare(BaseModel):
    """One GPU of the daemon (or one virtual device of a job on the CPU) in GET /v1/system."""

    gpu: int | None = Field(
        None, description="The daemon's GPU index (devices[].index); null: a CPU device."
    )
    device: str = Field(description="'cuda:N' with the daemon's N, or 'cpu-virtual:N'.")
    job_id: str | None = Field(None, description="The job whose worker holds it; null: free.")
    busy_fraction: float | None = Field(
        None,
        description="The job's latest metrics event: the device's compute time over the "
        "step's wall time (0..1); null before the job's first step.",
    )
    jobs: int | None = Field(None, description="Engine jobs it finished in that step.")
    step: int | None = Field(None, description="The step those figures are of.")


class ClusterNode(BaseModel):
    """One live node of the daemon's Ray cluster in GET /v1/system."""

    node_id: str = Field(description="Ray's node id.")
    address: str | None = Field(None, description="The node's IP address.")
    cpus: int
    gpus: int
    memory_bytes: int = Field(description="Host memory Ray may hand out on the node.")
    jobs: list[str] = Field(default_factory=list, description="Jobs with a rank on it.")


class ClusterInfo(BaseModel):
    """The Ray cluster behind RP_RAY_ADDRESS (multi-node jobs, docs/SCALING.md)."""

    address: str
    nodes: list[ClusterNode] = Field(default_factory=list)
    error: str | None = Field(None, description="Why the nodes could not be read now.")


class SystemInfo(BaseModel):
    version: str
    versions: dict[str, str | None]
    devices: list[dict[str, Any]]
    host_memory_bytes: int | None
    pinned_budget_bytes: int | None
    host_memory_budget_bytes: int | None = Field(
        None,
        description="What one job may use (RP_HOST_MEMORY_BUDGET, else available less a margin).",
    )
    adam: dict[str, Any] | None
    queue_length: int
    jobs: dict[str, int]
    gpu_share: list[GpuShare] = Field(
        default_factory=list,
        description="Each GPU: the job holding it and its share of the work (docs/API.md).",
    )
    cluster: ClusterInfo | None = Field(
        None, description="The Ray cluster's nodes (RP_RAY_ADDRESS); null: one box."
    )


class ErrorBody(BaseModel):
    type: str
    code: str
    message: str
    param: str | None = None
    details: Any = None


class ErrorEnvelope(BaseModel):
    error: ErrorBody
