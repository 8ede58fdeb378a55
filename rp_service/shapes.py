"""The projection shapes of a job's model, read from its config without importing torch.

The daemon checks a LoRA spec at submission (`lora.rank` against the width of the layers it
adapts) on the request path, where importing transformers (and with it torch) would cost
seconds; so the few config defaults a preset needs are written here, and a unit test holds
them equal to transformers' own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rp_service.errors import InvalidRequest
from rp_service.schemas import LoraSection

__all__ = ["PRESET_DEFAULTS", "check_lora_rank", "projection_shapes"]

# transformers' Qwen3Config() and LlamaConfig() defaults of the shape fields that the LoRA
# rank check and the host-memory plan (rp_service/hostmem.py) read; tests/unit/rp_service/
# test_lora_spec.py and test_hostmem.py check them against transformers.
PRESET_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
    "llama": {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "head_dim": None,
        "tie_word_embeddings": False,
    },
}


def _positive_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def projection_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, int]] | None:
    """`{module name: (in_features, out_features)}` of a decoder layer's projections.

    `config` holds Hugging Face config fields (a config.json, or a preset's defaults with
    the spec's overrides). None when a field the shapes need is missing or not a positive
    integer: the worker's model build then reports what is wrong.
    """
    hidden = _positive_int(config.get("hidden_size"))
    inter = _positive_int(config.get("intermediate_size"))
    heads = _positive_int(config.get("num_attention_heads"))
    if hidden is None or inter is None or heads is None:
        return None
    kv_heads = _positive_int(config.get("num_key_value_heads") or heads)
    head_dim = _positive_int(config.get("head_dim") or hidden // heads)
    if kv_heads is None or head_dim is None:
        return None
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": (hidden, q_width),
        "k_proj": (hidden, kv_width),
        "v_proj": (hidden, kv_width),
        "o_proj": (q_width, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def check_lora_rank(lora: LoraSection, config: Mapping[str, Any]) -> None:
    """Raise InvalidRequest (param ``lora.rank``) when the rank exceeds an adapted layer's width.

    A rank-r adapter of an (in -> out) projection is a product of (in x r) and (r x out)
    matrices; past min(in, out) the extra rank adds parameters but no expressiveness.
    """
    shapes = projection_shapes(config)
    if shapes is None:
        return
    widths = {name: min(shapes[name]) for name in lora.target_modules}
    narrowest = min(widths, key=lambda name: widths[name])
    limit = widths[narrowest]
    if lora.rank > limit:
        fan_in, fan_out = shapes[narrowest]
        raise InvalidRequest(
            f"lora.rank: {lora.rank} is above the width of the model's {narrowest} layers "
            f"({fan_in} -> {fan_out} features); use a rank of at most {limit}",
            code="lora_rank_too_large",
            param="lora.rank",
        )
