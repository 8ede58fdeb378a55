"""A local model folder checked at submission, before anything is allocated: its
config.json (readable, not nested without end) and its weights (covering the model)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rp_service.app import create_app
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
