"""engine/catalog.py: torch-free, and the one source of the families' facts the engine uses."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from engine.catalog import (
    FAMILIES,
    LORA_TARGET_MODULES,
    PRESET_NAMES,
    max_lora_rank,
    plannable,
    projection_shapes,
)
from engine.planning.memory_plan import ModelShape
from tests import tiny_models


def test_the_catalog_imports_without_torch() -> None:
    code = "import sys, engine.catalog; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


def test_every_family_has_its_preset_and_transformers_classes() -> None:
    import transformers

    from engine.models import SUPPORTED_MODELS

    assert tuple(SUPPORTED_MODELS) == PRESET_NAMES
    for name, family in FAMILIES.items():
        assert family.name == name
        preset = importlib.import_module(SUPPORTED_MODELS[name])
        assert family.model_class == preset.MODEL_CLASS
        config_cls = getattr(transformers, family.config_class)
        assert config_cls.model_type == name
        assert getattr(transformers, family.model_class).config_class is config_cls


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.config_defaults])
def test_config_defaults_are_transformers_defaults(name: str) -> None:
    import transformers

    family = FAMILIES[name]
    config = getattr(transformers, family.config_class)()
    for key, value in family.config_defaults.items():
        if value is not None:  # None: derived as transformers derives it (head_dim, kv heads)
            assert getattr(config, key, None) == value, (name, key)
    assert ModelShape.from_config(family.config_defaults) == ModelShape.from_config(config)


def test_only_the_moe_families_are_left_out_of_the_plan() -> None:
    assert [n for n, f in FAMILIES.items() if not f.plannable] == ["qwen3_moe", "gpt_oss"]
    assert plannable("qwen3") and plannable("mistral") and plannable(None)
    assert not plannable("gpt_oss")


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen2", "mistral"])
def test_projection_shapes_are_the_hf_layers_and_the_plans(kind: str) -> None:
    model = tiny_models.tiny_model(kind, vocab_size=48, window=8, intermediate_size=40)
    layer = model.model.layers[0]
    modules = {**dict(layer.self_attn.named_children()), **dict(layer.mlp.named_children())}
    want = {
        name: (m.in_features, m.out_features)
        for name, m in modules.items()
        if isinstance(m, torch.nn.Linear)
    }
    config = model.config.to_dict()
    assert projection_shapes(config) == want
    assert tuple(want) == LORA_TARGET_MODULES
    shape = ModelShape.from_config(config)
    assert shape.projection_shapes() == want
    # the plan counts every projection weight of a layer as the model holds it
    weights = [m.weight.numel() for m in modules.values() if isinstance(m, torch.nn.Linear)]
    assert shape.layer_tensors()[: len(weights)] == weights
    if kind != "qwen2":  # Qwen2's q/k/v biases (64 numbers a layer here) are not in the shape
        assert shape.num_params == sum(p.numel() for p in model.parameters())
    rank = 3
    per_layer = sum(rank * (a + b) for a, b in want.values())
    assert shape.lora_params(rank) == per_layer * model.config.num_hidden_layers
    assert shape.lora_params(rank, ["q_proj"]) == rank * sum(want["q_proj"]) * 2


def test_the_engine_refuses_a_rank_above_the_catalog_rule() -> None:
    from engine.adapters.lora import LoraConfig, apply_lora
    from engine.errors import ConfigError

    model = tiny_models.tiny_model("qwen3", vocab_size=48, window=8)
    limit = max_lora_rank(*projection_shapes(model.config.to_dict())["k_proj"])
    assert limit == 16  # 32 -> 2 kv heads x 8
    with pytest.raises(ConfigError, match=f"use rank <= {limit}") as err:
        apply_lora(model, LoraConfig(rank=limit + 1, target_modules=("k_proj",)))
    assert err.value.field == "lora.rank"
    apply_lora(model, LoraConfig(rank=limit, target_modules=("k_proj",)))


def test_recompute_attention_is_a_wrap_option() -> None:
    import engine.models
    from engine import wrap_model_to_roundpipe

    assert not hasattr(engine.models, "RECOMPUTE_ATTENTION")
    for recompute in (False, True):
        model = tiny_models.tiny_model("qwen3", vocab_size=48, window=8)
        rp = wrap_model_to_roundpipe(model, recompute_attention=recompute)
        decoders = [layer for layer in rp.model if hasattr(layer, "recompute_attention")]
        assert len(decoders) == 2
        assert all(layer.recompute_attention is recompute for layer in decoders)
