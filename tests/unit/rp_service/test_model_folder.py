"""A local model folder checked at submission, before anything is allocated: its
config.json (readable, not nested without end) and its weights (covering the model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save_file

from engine.catalog import FAMILIES
from rp_service.app import create_app
from rp_service.errors import InvalidRequest
from rp_service.jobs.weights import check_weights_cover, safetensors_names
from rp_service.settings import Settings


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        data_dir=tmp_path / "data", gpus="none", model_roots=[tmp_path], auth="none"
    )
    with TestClient(create_app(settings), base_url="http://127.0.0.1:8321") as c:
        yield c


def _submit(client: TestClient, folder: Path) -> dict:
    r = client.post(
        "/v1/jobs", json={"model": {"path": str(folder)}, "data": {"train": "synthetic"}}
    )
    assert r.status_code == 422, r.text
    return r.json()["error"]


def test_a_config_nested_without_end_is_422_not_500(client: TestClient, tmp_path: Path) -> None:
    folder = tmp_path / "deep"
    folder.mkdir()
    (folder / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    error = _submit(client, folder)
    assert error["param"] == "model.path" and "not readable JSON" in error["message"]


def _tiny(model_type: str, *, tied: bool) -> Any:
    import transformers

    family = FAMILIES[model_type]
    config = getattr(transformers, family.config_class)(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=tied,
    )
    return getattr(transformers, family.model_class)(config)


@pytest.mark.parametrize(("model_type", "tied"), [("qwen3", True), ("llama", False)])
def test_a_whole_folder_passes_and_its_expected_names_are_the_model_classs(
    tmp_path: Path, model_type: str, tied: bool
) -> None:
    """What the check asks for is a subset of what transformers saves (a tied head is
    not saved and not asked for); a folder missing one projection is refused."""
    model = _tiny(model_type, tied=tied)
    model.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    check_weights_cover(tmp_path / "m", config, param="model.path")  # no raise
    saved = safetensors_names(tmp_path / "m" / "model.safetensors")
    assert ("lm_head.weight" in saved) is not tied
    state = model.state_dict()
    del state["model.layers.1.mlp.down_proj.weight"]
    state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "m" / "model.safetensors")
    with pytest.raises(InvalidRequest) as refused:
        check_weights_cover(tmp_path / "m", config, param="model.path")
    missing = ["layers.1.mlp.down_proj.weight"] + ([] if tied else ["lm_head.weight"])
    assert refused.value.details == {"missing_count": len(missing), "missing": missing}


def test_a_folder_with_one_of_its_tensors_is_422_invalid_model(
    client: TestClient, tmp_path: Path
) -> None:
    folder = tmp_path / "partial"
    folder.mkdir()
    config = {
        "model_type": "qwen3",
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "tie_word_embeddings": True,
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(64, 16)}, folder / "model.safetensors")
    error = _submit(client, folder)
    assert error["code"] == "invalid_model" and error["param"] == "model.path"
    assert error["details"]["missing_count"] == 21  # 3 layers x 7 projections
    assert "21 of 22 tensors are missing (layers.0.mlp.down_proj.weight" in error["message"]
    assert "and 16 more" in error["message"]
    (folder / "model.safetensors").write_bytes(b"\xff" * 16)
    error = _submit(client, folder)
    assert error["code"] == "invalid_model" and "not a readable safetensors" in error["message"]
