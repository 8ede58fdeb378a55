"""train.lr when the spec gives none (issue 44): by what is trained, resolved into the spec.

LoRA adapters 2e-4, a full fine-tune of a model folder 2e-5, a preset from random weights
1e-3 (the old single default), a tenth of a fine-tune's for DPO; a given lr is kept; the resolved value is in the spec the
job object shows (its model_dump) and survives a second validation.
"""

from __future__ import annotations

from typing import Any

import pytest

from rp_service.schemas import DEFAULT_LR, JobSpec


def _spec(model: dict[str, Any], **train: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": model, "data": {"train": "synthetic"}}
    if train:
        spec["train"] = train
    return spec


PRESET = {"preset": "qwen3"}
FOLDER = {"path": "/models/qwen3-0.6b"}


@pytest.mark.parametrize(
    ("model", "train", "lr"),
    [
        (PRESET, {}, 1e-3),
        (FOLDER, {}, 2e-5),
        (FOLDER, {"steps": 10}, 2e-5),
        (FOLDER, {"method": "lora"}, 2e-4),
        (PRESET, {"method": "lora"}, 2e-4),
        (FOLDER, {"lr": 3e-3}, 3e-3),
        (FOLDER, {"method": "lora", "lr": 1e-3}, 1e-3),
        (PRESET, {"lr": 1e-3}, 1e-3),
        (FOLDER, {"objective": "dpo"}, 2e-6),
        (FOLDER, {"objective": "dpo", "method": "lora"}, 2e-5),
    ],
)
def test_lr_by_what_is_trained(model: dict[str, Any], train: dict[str, Any], lr: float) -> None:
    spec = JobSpec.model_validate(_spec(model, **train))
    assert spec.train.lr == lr
    shown = spec.model_dump(mode="json")
    assert shown["train"]["lr"] == lr  # what GET /v1/jobs/{id} shows
    assert JobSpec.model_validate(shown).train.lr == lr


def test_the_table_and_the_field_agree() -> None:
    assert DEFAULT_LR == {
        "lora": 2e-4,
        "pretrained": 2e-5,
        "preset": 1e-3,
        "dpo_lora": 2e-5,
        "dpo_pretrained": 2e-6,
    }
    assert (
        JobSpec.model_json_schema()["$defs"]["TrainSection"]["properties"]["lr"]["default"]
        == DEFAULT_LR["preset"]
    )


def test_the_step_defaults_to_staleness_zero() -> None:
    spec = JobSpec.model_validate(_spec(PRESET))
    assert spec.engine.async_step is True and spec.engine.step_staleness == 0
    stale = JobSpec.model_validate({**_spec(PRESET), "engine": {"step_staleness": 1}})
    assert stale.engine.step_staleness == 1
    with pytest.raises(ValueError, match="step_staleness"):
        JobSpec.model_validate({**_spec(PRESET), "engine": {"step_staleness": 2}})
