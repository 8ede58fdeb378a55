"""JobSpec validation and settings parsing."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rp_service.schemas import JobSpec
from rp_service.settings import Settings
from rp_service.system import load_demo_spec

BASE = {"model": {"preset": "qwen3"}, "data": {"train": "synthetic"}}


def _errors(body: dict) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(body)
    return [(".".join(map(str, e["loc"])), e["msg"]) for e in info.value.errors()]


def test_defaults_are_filled() -> None:
    spec = JobSpec.model_validate(BASE)
    assert spec.train.steps == 300 and spec.train.epochs is None
    assert spec.engine.gpus == 1 and spec.data.seq_len == 256 and spec.model.dtype == "float32"


def test_epochs_replace_the_default_steps() -> None:
    spec = JobSpec.model_validate({**BASE, "train": {"epochs": 2}})
    assert spec.train.steps is None and spec.train.epochs == 2
    assert any("exactly one" in m for _, m in _errors({**BASE, "train": {"epochs": 2, "steps": 3}}))


@pytest.mark.parametrize(
    ("patch", "loc"),
    [
        ({"model": {"preset": "gpt"}}, "model.preset"),
        ({"model": {"preset": "qwen3", "dtype": "int8"}}, "model.dtype"),
        ({"model": {}}, "model"),
        ({"model": {"preset": "qwen3", "path": "/m"}}, "model"),
        ({"train": {"lr": 0}}, "train.lr"),
        ({"train": {"lr": -1e-3}}, "train.lr"),
        ({"train": {"betas": [0.9, 1.0]}}, "train"),
        ({"train": {"batch_size": 0}}, "train.batch_size"),
        ({"data": {"train": "synthetic", "seq_len": 1}}, "data.seq_len"),
        ({"data": {"train": "synthetic", "format": "csv"}}, "data.format"),
        ({"engine": {"recompute_grain": "block"}}, "engine.recompute_grain"),
        ({"engine": {"gpus": -1}}, "engine.gpus"),
        ({"extra": 1}, "extra"),
    ],
)
def test_bad_values_name_their_field(patch: dict, loc: str) -> None:
    assert loc in [where for where, _ in _errors({**BASE, **patch})]


def test_the_demo_spec_is_a_valid_jobspec() -> None:
    spec = load_demo_spec()
    assert spec.data.train == "synthetic" and spec.model.preset is not None


def test_settings_parse_roots_as_json_or_comma_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RP_MODEL_ROOTS", '["/a", "/b"]')
    monkeypatch.setenv("RP_DATASET_ROOTS", "/c, /d")
    monkeypatch.setenv("RP_TOKEN", "")
    monkeypatch.setenv("RP_GPUS", "0, 2")
    s = Settings()
    assert s.model_roots == [Path("/a"), Path("/b")]
    assert s.dataset_roots == [Path("/c"), Path("/d")]
    assert s.token is None
    assert s.gpu_ids(visible=2) == [0]
    monkeypatch.setenv("RP_GPUS", "some")
    with pytest.raises(ValidationError, match="RP_GPUS"):
        Settings()


def test_settings_gpu_selection() -> None:
    assert Settings(gpus="all").gpu_ids(visible=3) == [0, 1, 2]
    assert Settings(gpus="none").gpu_ids(visible=3) == []


def test_the_data_dir_is_absolute_from_the_start(tmp_path, monkeypatch) -> None:
    """Job output paths derive from it: relative, they read `rp-data/jobs/...`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RP_DATA_DIR", raising=False)
    assert Settings().data_dir == tmp_path / "rp-data"
    assert Settings(data_dir="d").jobs_dir == tmp_path / "d" / "jobs"
    monkeypatch.setenv("RP_DATA_DIR", "x/y")
    assert Settings().data_dir == tmp_path / "x" / "y"
