"""The causal mask HF's attention expects, built by transformers' own mask builders."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["build_causal_mask", "layer_is_sliding"]


def layer_is_sliding(config: Any, layer_idx: int) -> bool:
    """Whether HF gives decoder layer `layer_idx` the sliding-window causal mask.

    Families with `config.layer_types` (Qwen2, Qwen3, GPT-OSS) name it per layer; the
    others (Mistral, Qwen3-MoE) use it for every layer when `config.sliding_window` is set.
    """
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[layer_idx] == "sliding_attention"
    return getattr(config, "sliding_window", None) is not None


@functools.cache
def _parameter_names(fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def build_causal_mask(
    config: Any,
    hidden: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
    *,
    sliding: bool,
) -> Any:
    """Return the mask HF's attention expects for `config._attn_implementation`.

    Calls transformers' own mask builders, so sdpa (None when plain causal), eager (an
    additive float mask), flash_attention_2 (the 2D mask or None) and flex all get what
    their kernels want. Argument names differ across transformers 5.x releases
    (`input_embeds`/`inputs_embeds`, `cache_position`), hence the signature lookup.
    """
    from transformers import masking_utils

    fn = (
        masking_utils.create_sliding_window_causal_mask
        if sliding
        else masking_utils.create_causal_mask
    )
    params = _parameter_names(fn)
    kwargs: dict[str, Any] = {
        "config": config,
        "attention_mask": attention_mask,
        "past_key_values": None,
    }
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = hidden
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    return fn(**kwargs)
