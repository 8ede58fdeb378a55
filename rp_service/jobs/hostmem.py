"""The host-memory plan of a JobSpec, run at submission without importing torch.

`engine.planning.memory_plan` predicts from shapes; this module turns a JobSpec into those
shapes (a preset's config defaults from `engine.catalog` and the overrides, or a model
directory's config.json; the run options `rp_service.spec_to_engine` mapped) and its
refusal into `HostMemoryExceeded`, naming the JobSpec field to change: a 422 at
submission (app.py), the job's error in the worker.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.catalog import FAMILIES, plannable
from engine.errors import ConfigError, HostMemoryError
from engine.options import EngineOptions
from engine.planning.memory_plan import (
    HostMemoryPlan,
    ModelShape,
    default_budget_bytes,
    format_gib,
    parse_bytes,
    plan_host_memory,
    run_shape,
)
from rp_service.errors import HostMemoryExceeded
from rp_service.schemas import JobSpec

__all__ = ["budget_bytes", "check_spec", "plan_for_spec"]

# rp_service.data.tokenizer.BYTE_VOCAB_SIZE rounded up as modeling._preset_config does (that
# module imports torch; the test checks the two agree).
_BYTE_VOCAB_ROUNDED = 264
# JobSpec field that each engine.planning.memory_plan option changes.
_OPTION_FIELDS = {
    "optim_state_dtype": "engine.optim_state_dtype",
    "optim_memory": "engine.optim_memory",
    "recompute_attention": "engine.recompute_attention",
    "layers_per_group": "engine.layers_per_group",
    "lora": "model",
    "tokens_per_step": "train.batch_size",
}


def budget_bytes(setting: str | None) -> int:
    """RP_HOST_MEMORY_BUDGET parsed, or the available memory less the margin (now)."""
    return default_budget_bytes(setting)


def _model_config(spec: JobSpec, path_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The model's config as a dict, or None when the plan cannot count its parameters."""
    if spec.model.preset is not None:
        defaults = FAMILIES[spec.model.preset].config_defaults
        if defaults is None:
            return None  # a preset whose defaults the catalog does not carry (qwen2, MoE, ...)
        config = {**defaults, **spec.model.config}
        if "vocab_size" not in spec.model.config and spec.tokenizer.path is None:
            config["vocab_size"] = _BYTE_VOCAB_ROUNDED  # the built-in byte-level tokenizer
        return config
    config = dict(path_config or {})
    model_type = config.get("model_type")
    return config if plannable(model_type if isinstance(model_type, str) else None) else None


def plan_for_spec(
    spec: JobSpec,
    options: EngineOptions,
    *,
    path_config: dict[str, Any] | None,
    cuda: bool,
    ranks: int = 1,
) -> HostMemoryPlan | None:
    """The plan of `spec`, run with `options` (`spec_to_engine`'s; None when the model's
    config has no transformer shape). With `ranks` > 1: one data-parallel rank's, on one
    device with its share of the batch (each rank holds all of it once)."""
    config = _model_config(spec, path_config)
    if config is None:
        return None
    try:
        shape = ModelShape.from_config(config)
    except ConfigError:
        return None
    seq_len = _sequence_tokens(spec)
    run = run_shape(
        options,
        shape,
        tokens_per_step=spec.train.batch_size * seq_len * _rows_per_item(spec) // ranks,
        seq_len=seq_len,
        num_devices=1 if ranks > 1 else max(spec.engine.gpus, 1),
        cuda=cuda,
        # the worker's step_fn (engine.optim.Adam, its clip, zero_grad) reads no `.grad`;
        # data parallel's shards are plain parameters, whose gradients are copied
        deferred_grads=ranks == 1,
    )
    if spec.grpo is not None and spec.grpo.kl_coef > 0 and spec.train.method != "lora":
        # the KL reference of a full fine-tune: the starting weights, a second wrapped copy
        run = replace(run, frozen_copies=1)
    return plan_host_memory(shape, run)


def check_spec(
    spec: JobSpec,
    options: EngineOptions,
    *,
    path_config: dict[str, Any] | None,
    cuda: bool,
    budget: int,
) -> HostMemoryPlan | None:
    """Raise HostMemoryExceeded (naming the field to change) when `spec`, run with
    `options`, would not fit."""
    plan = plan_for_spec(spec, options, path_config=path_config, cuda=cuda)
    if plan is None:
        return None
    try:
        plan.check(budget)
    except HostMemoryError as exc:
        fields = [_OPTION_FIELDS.get(f, f) for f in exc.option_fields]
        param = fields[0] if fields else "model"
        message = (
            f"{param}: the job needs about {format_gib(exc.need_bytes)} of host memory, over "
            f"this daemon's budget of {format_gib(exc.budget_bytes)} (RP_HOST_MEMORY_BUDGET); "
            + (
                "options that would fit: " + "; ".join(exc.options)
                if exc.options
                else "no engine option fits: a smaller model or a larger budget"
            )
        )
        raise HostMemoryExceeded(
            message,
            param=param,
            need_bytes=exc.need_bytes,
            budget_bytes=exc.budget_bytes,
            parts_bytes=exc.parts,
            options=[
                {"param": f, "change": text} for f, text in zip(fields, exc.options, strict=True)
            ],
        ) from None
    return plan


def parse_budget_setting(value: str | None) -> str | None:
    """Validate RP_HOST_MEMORY_BUDGET at start-up (raises ValueError with what to write)."""
    if value is None or not value.strip():
        return None
    try:
        parse_bytes(value)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return value.strip()


def _rows_per_item(spec: JobSpec) -> int:
    """Sequences a step trains per item of train.batch_size: DPO's chosen and rejected,
    GRPO's group of completions, one otherwise."""
    if spec.grpo is not None:
        return spec.grpo.group_size
    return 2 if spec.train.objective == "dpo" else 1


def _sequence_tokens(spec: JobSpec) -> int:
    """The longest sequence a step trains: data.seq_len, or for GRPO a prompt (at most
    data.seq_len) and its completion."""
    if spec.grpo is not None:
        return spec.data.seq_len + spec.grpo.max_completion_tokens
    return spec.data.seq_len
