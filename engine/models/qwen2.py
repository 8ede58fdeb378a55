"""Preset for transformers' `Qwen2ForCausalLM` (Qwen2 and Qwen2.5): embedding, decoder
layers, norm + head.

Qwen2 differs from Llama by its q/k/v biases and its optional sliding-window layers
(`use_sliding_window`, `max_window_layers`), both inside the HF decoder layer and
`config.layer_types`, which `DecoderLayer` honours; the generic layout of `_sequential`
covers it, including the compiled CUDA decoder path.
"""

from __future__ import annotations

from torch import nn

from ..catalog import FAMILIES
from ._sequential import build_causal_lm_sequential

__all__ = ["MODEL_CLASS", "to_sequential"]

# Matched by name against type(model).__name__ so the registry need not import it eagerly.
MODEL_CLASS = FAMILIES["qwen2"].model_class


def to_sequential(model: nn.Module) -> nn.Sequential:
    """Return the layers of a `Qwen2ForCausalLM` as an `nn.Sequential` over its own modules."""
    return build_causal_lm_sequential(model)
