"""Tiny random Hugging Face causal LMs for the unit, integration and GPU tests.

Every test that needs a `*ForCausalLM` builds it here, so a family's extra fields (sliding
windows, experts) are spelled once. A test states the sizes it depends on; what it leaves
out comes from `TINY` (hidden 32, 2 layers, 4 heads of 8, 2 kv heads). Expected values in
the tests were computed with these exact models: a change of a default or of the seeding
here changes them all.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["FAMILIES", "TINY", "WIDE", "tiny_config", "tiny_model"]

FAMILIES = ("qwen3", "llama", "qwen2", "mistral", "qwen3_moe", "gpt_oss")

# The fields every tiny model has unless the caller names them.
TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "use_cache": False,
}

# Hidden 64 with heads of 16: the width most model tests use (`tiny_model(..., **WIDE)`).
WIDE: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16}

_CLASSES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}


def _family_fields(family: str, window: int) -> dict[str, Any]:
    """The fields a family needs beyond `TINY`: a short sliding window (so the sliding
    masks matter at the tests' lengths; Qwen2 slides on its first layer only) and, for MoE
    families, 4 experts with 2 per token."""
    if family == "qwen2":
        return {"use_sliding_window": True, "sliding_window": window, "max_window_layers": 1}
    if family == "mistral":
        return {"sliding_window": window}
    if family == "qwen3_moe":
        return {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    if family == "gpt_oss":
        return {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": window}
    return {}


def tiny_config(family: str, *, window: int = 16, **fields: Any) -> Any:
    """Returns the `transformers` config of a tiny `family` model.

    Args:
        family: one of `FAMILIES` (the preset names, HF's `model_type`).
        window: the sliding window of the families that have one (qwen2, mistral,
            gpt_oss); ignored by the others.
        **fields: config fields; they win over `TINY` and the family's fields. A field
            set to None is left to the config class's default.
    """
    import transformers

    if family not in _CLASSES:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")
    merged = {**TINY, **_family_fields(family, window), **fields}
    config_class = getattr(transformers, _CLASSES[family][0])
    return config_class(**{k: v for k, v in merged.items() if v is not None})


def tiny_model(
    family: str,
    *,
    seed: int | None = 0,
    dtype: torch.dtype = torch.float32,
    attn: str | None = None,
    window: int = 16,
    **fields: Any,
) -> nn.Module:
    """Returns a random tiny `*ForCausalLM` of `family` in training mode.

    Args:
        seed: `torch.manual_seed` right before the weights are drawn; None draws from
            the global generator as it stands.
        dtype: the parameters' dtype, converted after an fp32 initialisation.
        attn: sets `config._attn_implementation` after construction ("sdpa", "eager").
        window, **fields: as in `tiny_config`.
    """
    import transformers

    config = tiny_config(family, window=window, **fields)
    if seed is not None:
        torch.manual_seed(seed)
    model = getattr(transformers, _CLASSES[family][1])(config)
    if attn is not None:
        model.config._attn_implementation = attn
    return model.to(dtype).train()
