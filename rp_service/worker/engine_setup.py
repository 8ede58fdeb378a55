"""A job's model in the engine: the host-memory check, the adapters, the wrap, the optimizer.

Each step takes the job's `engine.options.EngineOptions`, mapped once from the spec by
`rp_service.spec_to_engine` at submission (where the daemon planned host memory with
them) and read back from spec.json by `worker.main`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.options import EngineOptions, LoraOptions

from ..errors import JobFailure
from ..schemas import JobSpec
from .modeling import DTYPES

if TYPE_CHECKING:
    from engine.optim import Adam

__all__ = ["apply_lora", "check_host_memory", "make_optimizer", "wrap", "wrap_frozen"]

log = logging.getLogger(__name__)


def check_host_memory(spec: JobSpec, options: EngineOptions, model_path: str | None) -> None:
    """The submission's host-memory plan again, against what this box has now (another job
    may hold memory the daemon could not count at submission): refuse before allocating
    rather than be ended by the OOM killer.

    Raises:
        JobFailure: code ``host_memory_exceeded``, naming the field to change.
    """
    from engine.device import host_memory_budget_setting
    from engine.planning.memory_plan import default_budget_bytes, process_rss_bytes

    from ..errors import HostMemoryExceeded
    from ..jobs.hostmem import check_spec

    config = None
    if model_path is not None:
        config = json.loads((Path(model_path) / "config.json").read_text())
    budget = default_budget_bytes(host_memory_budget_setting(), in_use_bytes=process_rss_bytes())
    cuda = torch.cuda.is_available() and spec.engine.gpus > 0
    try:
        check_spec(spec, options, path_config=config, cuda=cuda, budget=budget)
    except HostMemoryExceeded as exc:
        # The error event keeps the message (which has the figures) and the field.
        raise JobFailure(exc.code, exc.message, param=exc.param) from None


def apply_lora(hf_model: torch.nn.Module, lora: LoraOptions, *, seed: int | None) -> list[str]:
    """Add the adapters in place and freeze the base; return the adapters' state_dict names.

    Args:
        seed: seeds the adapters' random init; None continues the generator's stream (a
            preset's build seeded it; seeding again would start the base and the adapters
            from the same random numbers).

    Raises:
        JobFailure: code ``invalid_lora``, naming the lora field the engine refused.
    """
    from engine.adapters.lora import LoraConfig
    from engine.adapters.lora import apply_lora as engine_apply_lora
    from engine.errors import ConfigError

    config = LoraConfig(
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=lora.target_modules,
    )
    if seed is not None:
        torch.manual_seed(seed)  # the adapters' init is part of the job's reproducible state
    try:
        engine_apply_lora(hf_model, config)
    except ConfigError as exc:
        raise JobFailure("invalid_lora", str(exc), param=exc.field or "lora") from exc
    adapter_keys = [n for n, p in hf_model.named_parameters() if p.requires_grad]
    if not adapter_keys:
        raise JobFailure(
            "invalid_lora",
            f"lora.target_modules {list(lora.target_modules)} matched no layer of the model",
            param="lora.target_modules",
        )
    log.info("LoRA: %d adapter tensors on %s", len(adapter_keys), list(lora.target_modules))
    return adapter_keys


def wrap(hf_model: torch.nn.Module, options: EngineOptions, *, frozen: bool = False) -> Any:
    """The job's RoundPipe over `hf_model`, with the options' run config and wrap options
    (`frozen`: without the optimizer's, see `wrap_frozen`).

    Raises:
        JobFailure: code ``gpu_memory_too_small``: the GPU memory cap (the job's
            engine.max_gpu_memory_gib, else the daemon's RP_GPU_MEMORY_GIB) cannot hold the
            model's largest layer; the message names the smallest cap that can.
    """
    from engine.errors import ConfigError

    try:
        rp = _wrap(hf_model, options, frozen=frozen)
    except ConfigError as exc:
        if exc.field != "max_gpu_memory":
            raise
        param = "engine.max_gpu_memory_gib" if options.max_gpu_memory_gib is not None else None
        raise JobFailure("gpu_memory_too_small", str(exc), param=param) from exc
    return rp


def wrap_frozen(hf_model: torch.nn.Module, options: EngineOptions) -> Any:
    """A RoundPipe over `hf_model` for forwards only (a GRPO job's reference): its weights
    frozen, in eval mode, with the job's run config and no optimizer's options; raises as
    `wrap`."""
    hf_model.requires_grad_(False)
    hf_model.eval()
    return wrap(hf_model, options, frozen=True)


def _wrap(hf_model: torch.nn.Module, options: EngineOptions, *, frozen: bool = False) -> Any:
    from engine import RoundPipeRunConfig, wrap_model_to_roundpipe
    from engine.device import get_num_devices

    kwargs: dict[str, Any] = {
        # the micro-batches the daemon planned with, on the devices this worker has
        "model_run_config": RoundPipeRunConfig(
            num_microbatch=options.num_microbatch_on(get_num_devices()),
            recompute_grain=options.recompute_grain,
        ),
        "pin_model": options.pin_model,
        "recompute_attention": options.recompute_attention,
        "max_gpu_memory": options.max_gpu_memory_gib,
        "layers_per_group": options.layers_per_group,
        "matmul_precision": options.matmul_precision,
        "fp8_recipe": options.fp8_recipe,
    }
    if frozen:
        # Nothing trains: no masters, no optimizer memory mode; and no data parallel (each
        # rank scores its own rows, so the reference needs no collective of its own).
        return wrap_model_to_roundpipe(hf_model, process_group=None, **kwargs)
    # engine.overlap_calls, decided at submission (rp_service.jobs.resolve's overlap_calls)
    if options.overlap_calls:
        kwargs["overlap_calls"] = True
    if options.optim_memory == "compact":  # the bf16 weights are the masters
        return wrap_model_to_roundpipe(hf_model, optim_memory="compact", **kwargs)
    grad_dtype = options.optim_grad_dtype
    return wrap_model_to_roundpipe(
        hf_model,
        optim_dtype=DTYPES[options.optim_dtype],
        optim_grad_dtype=None if grad_dtype is None else DTYPES[grad_dtype],
        **kwargs,
    )


def make_optimizer(masters: list[torch.Tensor], options: EngineOptions) -> Adam:
    """The C Adam over the master weights, with the options' hyperparameters (8-bit moments
    with optim_memory compact)."""
    from engine.optim import Adam

    adam = options.adam
    return Adam(
        masters,
        lr=adam.lr,
        betas=adam.betas,
        weight_decay=adam.weight_decay,
        decoupled_weight_decay=True,
        state_dtype=torch.uint8
        if options.optim_memory == "compact"
        else DTYPES[options.optim_state_dtype],
    )
