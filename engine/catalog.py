"""The model families the engine has presets for, as plain data: no torch, no transformers.

One entry per family, keyed by its preset name, which is also the Hugging Face
`config.model_type`: the transformers class names, the released context length, whether
the host-memory plan (`engine.planning.memory_plan`) can count its parameters, and for
the presets a job may build from defaults, transformers' defaults of the shape fields.
Beside the families: the projections LoRA adapts, their shapes, and the rank rule.

The daemon reads this module on its request path, where importing torch would cost
seconds; `engine.models` reads it for its registry. tests/unit/engine/test_catalog.py
holds the defaults equal to transformers' own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = [
    "FAMILIES",
    "LORA_TARGET_MODULES",
    "PRESET_NAMES",
    "ModelFamily",
    "max_lora_rank",
    "plannable",
    "projection_shapes",
    "projection_shapes_of",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFamily:
    """One family of decoder-only causal LMs the engine has a Sequential preset for.

    Attributes:
        name: The preset name and the Hugging Face `model_type`.
        config_class, model_class: The transformers classes (`Qwen3Config`, ...).
        preset_module: The engine module with the family's `to_sequential`.
        max_positions: `max_position_embeddings` of the family's released configs, the
            context length of a preset whose config does not set it.
        plannable: Whether the memory plan counts the family's parameters (not the MoE
            families: routed experts and sinks are not in its shape).
        config_defaults: transformers' `Config()` defaults of the shape fields, for the
            presets a job builds from defaults plus overrides; None: not carried here (no
            plan and no rank check at submission for that preset).
    """

    name: str
    config_class: str
    model_class: str
    preset_module: str
    max_positions: int
    plannable: bool = True
    config_defaults: Mapping[str, Any] | None = None


def _family(name: str, classes: str, max_positions: int, **kwargs: Any) -> ModelFamily:
    defaults = kwargs.pop("config_defaults", None)
    return ModelFamily(
        name=name,
        config_class=f"{classes}Config",
        model_class=f"{classes}ForCausalLM",
        preset_module=f"engine.models.{name}",
        max_positions=max_positions,
        config_defaults=None if defaults is None else MappingProxyType(defaults),
        **kwargs,
    )


# Context lengths: Qwen3's released configs use 40960, Llama 3's 8192, Qwen2.5's and
# Mistral 7B v0.3's 32768, Qwen3-30B-A3B's 40960, gpt-oss's 131072.
FAMILIES: Mapping[str, ModelFamily] = MappingProxyType(
    {
        f.name: f
        for f in (
            _family(
                "qwen3",
                "Qwen3",
                40960,
                config_defaults={
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
            ),
            _family(
                "llama",
                "Llama",
                8192,
                config_defaults={
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
            ),
            _family("qwen2", "Qwen2", 32768),  # Qwen2 and Qwen2.5
            _family("mistral", "Mistral", 32768),
            _family("qwen3_moe", "Qwen3Moe", 40960, plannable=False),
            _family("gpt_oss", "GptOss", 131072, plannable=False),
        )
    }
)
PRESET_NAMES: tuple[str, ...] = tuple(FAMILIES)
"""The preset names, in the catalog's order (a JobSpec's `model.preset` values)."""

LORA_TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
"""The projections of a decoder layer LoRA can adapt, by their Hugging Face name; the
default targets are all of them."""


def plannable(model_type: str | None) -> bool:
    """Whether the memory plan counts a model of this `model_type` (unknown types: it tries)."""
    family = FAMILIES.get(model_type or "")
    return family is None or family.plannable


def projection_shapes_of(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
) -> dict[str, tuple[int, int]]:
    """`{module name: (in_features, out_features)}` of a decoder layer's projections, in
    `LORA_TARGET_MODULES` order."""
    hidden, inter = hidden_size, intermediate_size
    q_width, kv_width = num_attention_heads * head_dim, num_key_value_heads * head_dim
    return {
        "q_proj": (hidden, q_width),
        "k_proj": (hidden, kv_width),
        "v_proj": (hidden, kv_width),
        "o_proj": (q_width, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _positive_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def projection_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, int]] | None:
    """The projection shapes of a model from its Hugging Face config fields.

    `config` is a config.json, or a preset's defaults with a job's overrides. Missing
    `num_key_value_heads` and `head_dim` default as transformers does. None when a field
    the shapes need is missing or not a positive integer: building the model then reports
    what is wrong.
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
    return projection_shapes_of(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )


def max_lora_rank(in_features: int, out_features: int) -> int:
    """The largest rank an adapter of an (in -> out) projection may have: min(in, out).

    A rank-r adapter is the product of (in x r) and (r x out) matrices; past min(in, out)
    more rank adds parameters but no expressiveness.
    """
    return min(in_features, out_features)
