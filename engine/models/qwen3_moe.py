"""Preset for transformers' `Qwen3MoeForCausalLM`: embedding, MoE decoder layers, norm + head.

Each decoder layer holds its router (`mlp.gate`, a `Qwen3MoeTopKRouter`) and its experts
(`mlp.experts`: `gate_up_proj` and `down_proj` as 3D parameters, one slice per expert), so
the experts stream with their layer; layers listed in `mlp_only_layers` (or skipped by
`decoder_sparse_step`) keep a dense MLP of `nn.Linear`s. HF's router auxiliary loss is
summed layer by layer (see `_moe`) and added to `.loss` when `output_router_logits` (the
argument or the config) asks for it. The layers run eagerly (see `_moe`).
"""

from __future__ import annotations

import functools

from torch import nn

from ..catalog import FAMILIES
from ._moe import MoeDecoderLayer, moe_info
from ._sequential import build_causal_lm_sequential

__all__ = ["MODEL_CLASS", "to_sequential"]

# Matched by name against type(model).__name__ so the registry need not import it eagerly.
MODEL_CLASS = FAMILIES["qwen3_moe"].model_class


def to_sequential(model: nn.Module) -> nn.Sequential:
    """Return the layers of a `Qwen3MoeForCausalLM` as an `nn.Sequential` over its modules."""
    config = model.config
    top_k = config.num_experts_per_tok
    return build_causal_lm_sequential(
        model,
        decoder_cls=functools.partial(
            MoeDecoderLayer, router_class="Qwen3MoeTopKRouter", top_k=top_k
        ),
        moe=moe_info(model, config.num_experts, top_k),
    )
