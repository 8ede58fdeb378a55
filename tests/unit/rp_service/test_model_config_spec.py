"""A preset's model.config overrides are checked where they enter: shape sizes whole numbers
in range, every number finite (they were taken, then the job failed in its worker with an
internal error, and the host-memory plan was skipped)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rp_service.app import create_app
from rp_service.settings import Settings
from tests.unit.rp_service.test_one_catalog import AUTH, LOOPBACK, _spec


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path, gpus="none", host_memory_budget="160GiB", token="tok")
    with TestClient(create_app(settings), base_url=LOOPBACK, headers=AUTH) as c:
        yield c


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"hidden_size": "big"}, "hidden_size must be a whole number"),
        ({"hidden_size": -5}, "hidden_size must be a whole number"),
        ({"num_hidden_layers": True}, "num_hidden_layers must be a whole number"),
        ({"vocab_size": 10**18}, "vocab_size must be a whole number from 1 to 2147483648"),
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps is inf; give a finite number"),
    ],
)
def test_a_bad_model_config_is_422_at_submission(
    client: TestClient, config: dict[str, Any], message: str
) -> None:
    r = client.post(
        "/v1/jobs",
        content=json.dumps(_spec(model={"preset": "qwen3", "config": config})),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "model.config" and message in err["message"], err
    # the HF defaults that may be null stay allowed
    ok = _spec(model={"preset": "llama", "config": {"head_dim": None, "num_key_value_heads": None}})
    assert client.post("/v1/jobs", json=ok).status_code == 201
