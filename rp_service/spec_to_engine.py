"""The one map from a JobSpec to the engine's options (`engine.options.EngineOptions`).

Called once per job: at submission by `SpecResolver.check` (which plans host memory from
the options). The job's record keeps them (`EngineOptions.to_json`), every launch writes
them into the worker's spec.json, and `worker.main.run` builds them back and hands them to
the training loop; nothing downstream maps the spec or reads its engine, model or
optimizer fields again. (A job queued by a daemon from before the store kept options is
mapped at its launch instead.) The rules between fields are the options' own (checked when they are built, named
here by their JobSpec fields); a refusal is a JobFailure naming the field to change.
Torch-free: the daemon imports this module on its request path.
"""

from __future__ import annotations

from types import MappingProxyType

from engine.options import AdamOptions, EngineOptions, LoraOptions, OptionError
from rp_service.errors import JobFailure
from rp_service.schemas import JobSpec

__all__ = ["SPEC_FIELDS", "spec_to_engine"]

# The JobSpec field of each engine option, as the options' messages and errors name them.
SPEC_FIELDS = MappingProxyType(
    {
        "adam.lr": "train.lr",
        "batch_size": "train.batch_size",
        "num_microbatch": "engine.num_microbatch",
        "recompute_grain": "engine.recompute_grain",
        "optim_dtype": "engine.optim_dtype",
        "optim_grad_dtype": "engine.optim_grad_dtype",
        "pin_model": "engine.pin_model",
        "optim_state_dtype": "engine.optim_state_dtype",
        "optim_memory": "engine.optim_memory",
        "model_dtype": "model.dtype",
        "quantization": "model.quantization",
        # how a JobSpec asks for adapters (the options' `lora`), in a sentence's words
        "lora": "set train.method to 'lora'",
        "max_gpu_memory_gib": "engine.max_gpu_memory_gib",
        "layers_per_group": "engine.layers_per_group",
        "matmul_precision": "engine.matmul_precision",
        "fp8_recipe": "engine.fp8_recipe",
    }
)


def spec_to_engine(spec: JobSpec) -> EngineOptions:
    """The engine options of `spec`.

    Raises:
        JobFailure: the options refused a value (code: the rule's, e.g.
            ``num_microbatch_above_batch_size``, ``nf4_needs_lora``), naming its field.
    """
    engine, train, model = spec.engine, spec.train, spec.model
    lora = None
    if train.method == "lora" and spec.lora is not None:
        lora = LoraOptions(
            rank=spec.lora.rank,
            alpha=spec.lora.alpha,
            dropout=spec.lora.dropout,
            target_modules=tuple(spec.lora.target_modules),
        )
    try:
        return EngineOptions(
            adam=AdamOptions(
                lr=train.lr,
                betas=(train.betas[0], train.betas[1]),
                weight_decay=train.weight_decay,
            ),
            model_dtype=model.dtype,
            batch_size=train.batch_size,
            num_microbatch=engine.num_microbatch,
            recompute_grain=engine.recompute_grain,
            optim_dtype=engine.optim_dtype,
            optim_grad_dtype=model.dtype if engine.optim_grad_dtype == "model" else None,
            pin_model=engine.pin_model,
            recompute_attention=engine.recompute_attention,
            optim_state_dtype=engine.optim_state_dtype,
            optim_memory=engine.optim_memory,
            async_step=engine.async_step,
            lora=lora,
            quantization=model.quantization,
            max_gpu_memory_gib=engine.max_gpu_memory_gib,
            layers_per_group=engine.layers_per_group,
            matmul_precision=engine.matmul_precision,
            fp8_recipe=engine.fp8_recipe,
            names=SPEC_FIELDS,
        )
    except OptionError as exc:
        raise JobFailure(exc.code, str(exc), param=exc.field) from None
