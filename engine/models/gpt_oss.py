"""Preset for transformers' `GptOssForCausalLM`: embedding, MoE decoder layers, norm + head.

GPT-OSS's attention has learned per-head sinks (an extra logit in the softmax) and
alternates sliding-window and full layers (`config.layer_types`); HF's attention module
computes both, with the mask `DecoderLayer` builds per layer type. HF builds GPT-OSS's
masks without the position ids, and so does this preset. The sinks need HF's eager (or
flex/flash) attention, not "sdpa", so the saved cuDNN attention (see `_attention`) never
applies; the MoE layers (router `mlp.router`, experts as 3D parameters with biases) run
eagerly, with HF's router auxiliary loss as in `_moe`.
"""

from __future__ import annotations

import functools

from torch import nn

from ..catalog import FAMILIES
from ._decoder import DecoderLayer
from ._moe import MoeDecoderLayer, moe_info
from ._sequential import build_causal_lm_sequential

__all__ = ["MODEL_CLASS", "to_sequential"]

# Matched by name against type(model).__name__ so the registry need not import it eagerly.
MODEL_CLASS = FAMILIES["gpt_oss"].model_class


class GptOssDecoderLayer(MoeDecoderLayer):
    """A GPT-OSS decoder layer: its masks ignore the caller's position ids, as in HF."""

    mask_uses_position_ids = False


def to_sequential(model: nn.Module) -> nn.Sequential:
    """Return the layers of a `GptOssForCausalLM` as an `nn.Sequential` over its modules."""
    config = model.config
    top_k = config.num_experts_per_tok
    make: functools.partial[DecoderLayer] = functools.partial(
        GptOssDecoderLayer, router_class="GptOssTopKRouter", top_k=top_k
    )
    return build_causal_lm_sequential(
        model, decoder_cls=make, moe=moe_info(model, config.num_local_experts, top_k)
    )
