"""Preset for transformers' `Qwen3ForCausalLM`: embedding, decoder layers, norm + head.

Qwen3's per-head q/k RMSNorm and its optional sliding-window layers live inside the HF
decoder layer and `config.layer_types`, which `DecoderLayer` honours, so the generic
decoder-only layout of `_sequential` covers it.
"""

from __future__ import annotations

import logging

from torch import nn

from ..catalog import FAMILIES
from ._sequential import build_causal_lm_sequential

__all__ = ["MODEL_CLASS", "to_sequential"]

log = logging.getLogger(__name__)

# Matched by name against type(model).__name__ so the registry need not import it eagerly.
MODEL_CLASS = FAMILIES["qwen3"].model_class


def to_sequential(model: nn.Module) -> nn.Sequential:
    """Return the layers of a `Qwen3ForCausalLM` as an `nn.Sequential` over its own modules."""
    return build_causal_lm_sequential(model)
