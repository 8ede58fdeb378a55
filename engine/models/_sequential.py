"""A HF `*ForCausalLM` as the preset `nn.Sequential`: embedding, decoder layers, head.

The Sequential is built from the HF module objects themselves, so parameter objects, names
and the HF `save_pretrained` output stay those of the original model. It takes the HF
causal-LM arguments (`input_ids`, `attention_mask`, `position_ids`, `labels`,
`logits_to_keep`, `return_dict`, `num_items_in_batch`, and `output_router_logits` for
mixture-of-experts families) and returns what the HF model returns: a
`CausalLMOutputWithPast`-like object with `.loss` when labels are given and `.logits`
(see `_head.LMHeadLayer` and `_outputs` for what `.loss` means per micro-batch). What flows
between the layers: `_carry`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from ._carry import MoeInfo
from ._decoder import DecoderLayer
from ._embedding import EmbeddingLayer
from ._head import LMHeadLayer

__all__ = ["build_causal_lm_sequential"]

log = logging.getLogger(__name__)


def build_causal_lm_sequential(
    model: nn.Module,
    *,
    decoder_cls: Callable[..., DecoderLayer] | None = None,
    moe: MoeInfo | None = None,
) -> nn.Sequential:
    """Return the `nn.Sequential` of a HF `*ForCausalLM` with the usual `model.*` layout.

    The layout is `model.model.{embed_tokens, layers, norm, rotary_emb}` and `model.lm_head`
    (Qwen2/2.5, Qwen3, Qwen3-MoE, Llama, Mistral, GPT-OSS). The HF modules are reused, not
    copied.

    Args:
        decoder_cls: Makes the decoder-layer wrapper from `(layer, rotary_emb, config,
            layer_idx)` (default `DecoderLayer`; MoE families pass one that also sums the
            router statistics).
        moe: For mixture-of-experts families: what the router auxiliary loss needs.
    """
    base = model.model
    config = model.config
    make_decoder = decoder_cls or DecoderLayer
    layers: list[nn.Module] = [EmbeddingLayer(base.embed_tokens, moe)]
    num_layers = getattr(config, "num_hidden_layers", len(base.layers))
    for idx, layer in enumerate(list(base.layers)[:num_layers]):
        layers.append(make_decoder(layer, base.rotary_emb, config, idx))
    layers.append(LMHeadLayer(base.norm, model.lm_head, moe))
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        log.warning(
            "gradient checkpointing is on in the HF model; RoundPipe recomputes layers "
            "itself, so the HF checkpointing only adds work"
        )
    return nn.Sequential(*layers)
