"""Preset for transformers' `LlamaForCausalLM`: embedding, decoder layers, norm + head.

Llama's rope scaling variants (llama3, linear, dynamic, yarn) are all inside its rotary
embedding module, which `DecoderLayer` calls, so the generic layout of `_sequential` covers it.
"""

from __future__ import annotations

import logging

from torch import nn

from ..catalog import FAMILIES
from ._sequential import build_causal_lm_sequential

__all__ = ["MODEL_CLASS", "to_sequential"]

log = logging.getLogger(__name__)

# Matched by name against type(model).__name__ so the registry need not import it eagerly.
MODEL_CLASS = FAMILIES["llama"].model_class


def to_sequential(model: nn.Module) -> nn.Sequential:
    """Return the layers of a `LlamaForCausalLM` as an `nn.Sequential` over its own modules."""
    if getattr(model.config, "pretraining_tp", 1) > 1:
        log.warning("pretraining_tp > 1 is ignored: logits are computed with one matmul")
    return build_causal_lm_sequential(model)
