"""The service builds every engine preset family: from `model.preset`, and from a local
directory recognised by its config.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.catalog import FAMILIES
from rp_service.schemas import ModelSection
from rp_service.worker.modeling import build_model

pytest.importorskip("transformers")

TINY: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}
MOE = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2},
}


def test_presets_match_the_engine_and_the_schema() -> None:
    from engine.models import SUPPORTED_MODELS

    assert set(FAMILIES) == set(SUPPORTED_MODELS)
    for name in FAMILIES:
        assert ModelSection(preset=name).preset == name


@pytest.mark.parametrize("name", ["qwen2", "mistral", "qwen3_moe", "gpt_oss"])
def test_new_family_from_preset_and_from_directory(name: str, tmp_path: Path) -> None:
    from engine.models import has_preset

    overrides = {**TINY, **MOE.get(name, {})}
    kwargs: dict[str, Any] = {"dtype": "float32", "vocab_size": 64, "seed": 0}
    model = build_model(preset=name, config_overrides=overrides, path=None, **kwargs)
    assert model.config.model_type == name and has_preset(model)
    model.save_pretrained(tmp_path)
    loaded = build_model(preset=None, config_overrides={}, path=tmp_path, **kwargs)
    assert type(loaded) is type(model) and has_preset(loaded)
