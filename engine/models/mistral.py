"""Preset for transformers' `MistralForCausalLM`: embedding, decoder layers, norm + head.

Mistral is Llama's layout with a sliding window on every layer when
`config.sliding_window` is set (HF then builds the sliding-window mask for all layers, as
`DecoderLayer` does); the compiled CUDA decoder path applies, and the saved attention
(see `_attention`) where the window covers the whole sequence.
"""

from __future__ import annotations

from torch import nn

from ..catalog import FAMILIES
from ._sequential import build_causal_lm_sequential

__all__ = ["MODEL_CLASS", "to_sequential"]

# Matched by name against type(model).__name__ so the registry need not import it eagerly.
MODEL_CLASS = FAMILIES["mistral"].model_class


def to_sequential(model: nn.Module) -> nn.Sequential:
    """Return the layers of a `MistralForCausalLM` as an `nn.Sequential` over its own modules."""
    return build_causal_lm_sequential(model)
