"""One mapping from a JobSpec to the engine: run config values, wrap options, adapters.

The host-memory plan (`rp_service.jobs.hostmem`) and the worker
(`rp_service.worker.training`) both read a spec through `spec_to_engine`, so what the
daemon plans at submission is what the worker runs. Plain values (dtype names, not torch
dtypes): the daemon imports this module on its request path, without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.planning.memory_plan import default_num_microbatch
from rp_service.errors import JobFailure
from rp_service.schemas import JobSpec

__all__ = ["EngineOptions", "LoraOptions", "spec_to_engine"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraOptions:
    """`engine.adapters.lora.LoraConfig`'s values for a `train.method: lora` job."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineOptions:
    """What the engine is given for a job, by the names of the engine's options.

    Attributes:
        model_dtype: dtype of the model copy ('float32', 'float16', 'bfloat16').
        num_microbatch: RoundPipeRunConfig.num_microbatch; None: the engine's default
            (`default_num_microbatch` of the devices).
        recompute_grain: RoundPipeRunConfig.recompute_grain.
        optim_dtype: wrap_model_to_roundpipe's optim_dtype.
        optim_grad_dtype: wrap_model_to_roundpipe's optim_grad_dtype: None for a buffer
            in optim_dtype, else the model's dtype (the downloaded gradient read in place).
        pin_model: wrap_model_to_roundpipe's pin_model.
        recompute_attention: wrap_model_to_roundpipe's recompute_attention.
        optim_state_dtype: engine.optim.Adam's state_dtype.
        optim_memory: wrap_model_to_roundpipe's optim_memory: 'default', or 'compact' (the
            bf16 weights are the masters, the gradient read in place, Adam's moments in
            8 bits: docs/HOST_MEMORY_MODES.md), which supersedes optim_dtype,
            optim_grad_dtype and optim_state_dtype (the plan counts compact's own bytes).
        async_step: RoundPipe.step's is_async.
        lora: The adapters, or None for a full fine-tune.
        base_quantization: 'none', or 'nf4' (the frozen base's linear weights packed
            4-bit: engine.adapters.nf4; the schema allows it with lora only).
        max_gpu_memory_gib: RoundPipe's max_gpu_memory (GiB); None: the engine's default,
            the RP_GPU_MEMORY_GIB the daemon gives the worker.
        layers_per_group: RoundPipeRunConfig.execute_plan =
            ModelExecutePlan.grouped(layers, layers_per_group); None: the automatic plan.
    """

    model_dtype: str
    num_microbatch: int | None
    recompute_grain: str
    optim_dtype: str
    optim_grad_dtype: str | None
    pin_model: str
    recompute_attention: bool
    optim_state_dtype: str
    optim_memory: str
    async_step: bool
    lora: LoraOptions | None
    base_quantization: str = "none"
    max_gpu_memory_gib: float | None = None
    layers_per_group: int | None = None

    @property
    def run_config(self) -> dict[str, Any]:
        """The keyword arguments of the job's model-level RoundPipeRunConfig."""
        return {"num_microbatch": self.num_microbatch, "recompute_grain": self.recompute_grain}

    def num_microbatch_on(self, num_devices: int) -> int:
        """The micro-batches per step the engine will use on `num_devices` devices."""
        return self.num_microbatch or default_num_microbatch(num_devices)


def spec_to_engine(spec: JobSpec) -> EngineOptions:
    """The engine options of `spec`.

    Raises:
        JobFailure: `engine.num_microbatch` is above `train.batch_size` (a micro-batch
            holds at least one sequence), code ``num_microbatch_above_batch_size``.
    """
    engine, train = spec.engine, spec.train
    if engine.num_microbatch is not None and engine.num_microbatch > train.batch_size:
        raise JobFailure(
            "num_microbatch_above_batch_size",
            f"engine.num_microbatch: {engine.num_microbatch} micro-batches cannot be cut from "
            f"train.batch_size {train.batch_size} sequences; set engine.num_microbatch to at "
            f"most {train.batch_size} (or null for the default), or raise train.batch_size "
            f"to at least {engine.num_microbatch}",
            param="engine.num_microbatch",
        )
    lora = None
    if train.method == "lora" and spec.lora is not None:
        lora = LoraOptions(
            rank=spec.lora.rank,
            alpha=spec.lora.alpha,
            dropout=spec.lora.dropout,
            target_modules=tuple(spec.lora.target_modules),
        )
    return EngineOptions(
        model_dtype=spec.model.dtype,
        num_microbatch=engine.num_microbatch,
        recompute_grain=engine.recompute_grain,
        optim_dtype=engine.optim_dtype,
        optim_grad_dtype=spec.model.dtype if engine.optim_grad_dtype == "model" else None,
        pin_model=engine.pin_model,
        recompute_attention=engine.recompute_attention,
        optim_state_dtype=engine.optim_state_dtype,
        optim_memory=engine.optim_memory,
        async_step=engine.async_step,
        lora=lora,
        base_quantization=spec.model.quantization,
        max_gpu_memory_gib=engine.max_gpu_memory_gib,
        layers_per_group=engine.layers_per_group,
    )
