"""Sequential presets for supported Hugging Face models, and the causal-LM loss they use.

`SUPPORTED_MODELS` maps a `config.model_type` to the module holding its preset (Qwen3,
Llama, Qwen2/2.5, Mistral, Qwen3-MoE, GPT-OSS), as `engine.catalog.FAMILIES` lists them;
each preset module names the model class it expects (`MODEL_CLASS`, the catalog's) and
turns such a model into an `nn.Sequential` over the model's own modules (`to_sequential`). `wrap_model` wraps that Sequential in a `RoundPipe` whose
attributes fall through to the original HF model.

A preset model is called like the HF model (see `_sequential`, `_carry` and `_outputs`)::

    rp = wrap_model_to_roundpipe(hf_model, optim_dtype=torch.float32)
    with torch.no_grad():
        logits = rp(input_ids=ids).logits
    loss = rp.forward_backward(
        input_kwargs={"input_ids": ids, "attention_mask": mask, "labels": labels,
                      "num_items_in_batch": count_loss_tokens(labels)},
        loss_fn=lambda out, _: out.loss,  # HF's batch mean, summed over micro-batches
    )

and the original convention still works: `return_logits=False` gives the head's
`(hidden, lm_head_weight)` pair for `causal_lm_loss_fn(labels)`.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

from torch import nn

from ..catalog import FAMILIES
from ..roundpipe import RoundPipe
from ._mlp_chunks import DEFAULT_MLP_CHUNK_SIZE, DEFAULT_MLP_CHUNK_TOKENS
from .loss import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    IGNORE_INDEX,
    causal_lm_loss,
    causal_lm_loss_fn,
    chunked_cross_entropy_sum,
    count_loss_tokens,
)

__all__ = [
    "DEFAULT_LOSS_CHUNK_TOKENS",
    "DEFAULT_MLP_CHUNK_SIZE",
    "DEFAULT_MLP_CHUNK_TOKENS",
    "DISABLE_TORCH_COMPILE",
    "IGNORE_INDEX",
    "MLP_CHUNK_TOKENS",
    "SUPPORTED_MODELS",
    "causal_lm_loss",
    "causal_lm_loss_fn",
    "chunked_cross_entropy_sum",
    "count_loss_tokens",
    "find_preset",
    "has_preset",
    "to_sequential",
    "wrap_model",
]

log = logging.getLogger(__name__)

# When False, fp16/bf16 decoder layers running on CUDA go through one torch.compile'd
# function (see _layer_calls._compiled_decoder_call); fp32 layers and CPU devices run
# eagerly. Set to True before wrapping to run eagerly everywhere (e.g. to debug, or where
# compiling is too slow).
DISABLE_TORCH_COMPILE: bool = False

# Dense decoder layers (Qwen3, Llama, Qwen2, Mistral; not the MoE presets) whose micro-batch
# has more tokens (batch x sequence) than this run their MLP half (post-attention norm,
# MLP, residual) over chunks of DEFAULT_MLP_CHUNK_SIZE tokens, each recomputed in the
# backward, so autograd never keeps the MLP's (tokens, intermediate) tensors of the whole
# micro-batch: they are ~62% of a Qwen3-1.7B layer's saved activations. Same math; it costs
# one more MLP forward per layer and step. None: never chunk. Read when the preset is built
# (set it before wrapping); each layer keeps its own copy in `mlp_chunk_tokens` (and the
# chunk size in `mlp_chunk_size`). torch 2.11 fails such checkpoints around compiled code while
# CUDA memory history is recorded (pytorch/pytorch#179536): set None for those runs.
MLP_CHUNK_TOKENS: int | None = DEFAULT_MLP_CHUNK_TOKENS

SUPPORTED_MODELS: dict[str, str] = {name: f.preset_module for name, f in FAMILIES.items()}


def _model_type(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def find_preset(model: nn.Module) -> ModuleType | None:
    """Return the preset module for `model`'s `config.model_type`, or None if there is none."""
    path = SUPPORTED_MODELS.get(_model_type(model) or "")
    return importlib.import_module(path) if path is not None else None


def has_preset(model: nn.Module) -> bool:
    """Whether a preset exists for `model`'s type and `model` is the class it expects."""
    preset = find_preset(model)
    return preset is not None and type(model).__name__ == preset.MODEL_CLASS


def _unsupported_message(model: nn.Module) -> str:
    supported = ", ".join(
        f"{kind} ({importlib.import_module(path).MODEL_CLASS})"
        for kind, path in sorted(SUPPORTED_MODELS.items())
    )
    return (
        f"no RoundPipe preset for {type(model).__name__} (model_type={_model_type(model)!r}); "
        f"presets exist for: {supported}. Pass use_sequential_preset=None or False to "
        "wrap_model_to_roundpipe for the automatic split, or build an nn.Sequential yourself."
    )


def to_sequential(model: nn.Module, *, recompute_attention: bool = False) -> nn.Sequential:
    """Return the preset `nn.Sequential` for `model`, sharing its modules and parameters.

    Args:
        recompute_attention: False: decoder layers in fp16/bf16 on CUDA keep their
            attention output and log-sum-exp from the forward for the backward, so the
            stage recompute skips the attention kernel (see _attention; same kernels, same
            gradients). It costs host memory: 2 bytes per token x heads x head_dim for
            every layer (15 GB for Qwen3-1.7B at 131k tokens a step, 18 GB for Qwen3-4B at
            65k); what it gains in tokens/s: bench/RESULTS.md ("Figures moved out of engine
            docstrings"). True: recompute attention instead.

    Raises:
        NotImplementedError: No preset for the model type, or the model's class is not the
            one the preset expects (e.g. a bare `Qwen3Model` or a classification head).
    """
    preset = find_preset(model)
    if preset is None:
        raise NotImplementedError(_unsupported_message(model))
    if type(model).__name__ != preset.MODEL_CLASS:
        raise NotImplementedError(
            f"the {_model_type(model)!r} preset expects {preset.MODEL_CLASS}, got "
            f"{type(model).__name__}; load the model with AutoModelForCausalLM, or use "
            "use_sequential_preset=False for the automatic split"
        )
    seq = preset.to_sequential(model)
    for layer in seq:
        if hasattr(layer, "use_compile"):
            layer.use_compile = not DISABLE_TORCH_COMPILE
        if hasattr(layer, "recompute_attention"):
            layer.recompute_attention = recompute_attention
    return seq


def wrap_model(
    model: nn.Module, *, recompute_attention: bool = False, **roundpipe_kwargs: Any
) -> nn.Module:
    """Wrap a supported HF model in a `RoundPipe` over its preset `nn.Sequential`.

    The HF model keeps owning the modules, so after `rp.synchronize()` its
    `save_pretrained` writes the trained weights; its attributes (`config`, ...) stay
    reachable through the returned RoundPipe.

    Args:
        model: A supported model (see `SUPPORTED_MODELS`).
        recompute_attention: As `to_sequential`.
        **roundpipe_kwargs: Forwarded to `RoundPipe` (optim_dtype, name, model_run_config,
            pin_model).

    Raises:
        NotImplementedError: As `to_sequential`.
    """
    seq = to_sequential(model, recompute_attention=recompute_attention)
    log.info("wrapping %s with its preset: %d layers", type(model).__name__, len(seq))
    rp = RoundPipe(seq, **roundpipe_kwargs)
    rp.set_original_model(model)
    return rp
