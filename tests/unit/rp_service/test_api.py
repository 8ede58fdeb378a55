"""The app in-process (ASGI): error envelope, auth, limits. Lifespan runs for each test."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from starlette.datastructures import UploadFile

from rp_service.app import create_app
from rp_service.settings import Settings

LOOPBACK = "http://127.0.0.1:8321"  # TestClient's own "testserver" is not an allowed Host


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path, gpus="none", token="tok", max_request_bytes=4096)
    with TestClient(
        create_app(settings), base_url=LOOPBACK, headers={"Authorization": "Bearer tok"}
    ) as c:
        yield c


def test_no_import_time_app() -> None:
    import rp_service.app as module

    assert not hasattr(module, "app")


def test_validation_errors_use_the_envelope(client: TestClient) -> None:
    r = client.post("/v1/jobs", json={"model": {"preset": "qwen3"}, "data": {"train": 5}})
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "data.train"
    assert err["details"][0] == {"param": "data.train", "message": "Input should be a valid string"}
    assert "data.train" in err["message"]


def test_malformed_json_is_422_not_500(client: TestClient) -> None:
    r = client.post("/v1/jobs", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert "not valid JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/fine_tuning/jobs"])
def test_a_body_that_is_no_json_object_says_to_send_json(client: TestClient, route: str) -> None:
    """A form-encoded body (curl -d without a content type) or a JSON list: the error says
    to send a JSON object, not pydantic's "valid dictionary or object"."""
    for request in ({"data": {"model": "x"}}, {"json": [1, 2]}):
        r = client.post(route, **request)  # type: ignore[arg-type]
        assert r.status_code in (400, 422), r.text
        error = r.json()["error"]
        assert "must be a JSON object" in error["message"], error
        assert "Content-Type: application/json" in error["message"]


def test_unknown_route_and_method_use_the_envelope(client: TestClient) -> None:
    r = client.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = client.put("/v1/jobs")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_token_checked_with_healthz_exempt(client: TestClient) -> None:
    assert client.get("/healthz", headers={"Authorization": ""}).status_code == 200
    r = client.get("/readyz", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert client.get("/readyz").json()["status"] == "ready"


def test_body_over_the_limit_is_413(client: TestClient) -> None:
    r = client.post("/v1/jobs", content=b"x" * 5000, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_bad_last_event_id_is_422(client: TestClient) -> None:
    r = client.get(
        "/v1/jobs/job-x/events", headers={"Accept": "text/event-stream", "Last-Event-ID": "abc"}
    )
    assert r.status_code == 422 and r.json()["error"]["param"] == "Last-Event-ID"


def test_openapi_declares_bearer_auth_and_docs_are_served(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert "/v1/jobs/{job_id}/events" in schema["paths"]
    # /docs is the dashboard's API view (no Swagger UI from a CDN)
    r = client.get("/docs", follow_redirects=False)
    assert (r.status_code, r.headers["location"]) == (307, "/#/api")
    assert client.get("/docs").status_code == 200  # the page


def test_a_job_in_steps_shows_its_total_from_submission(client: TestClient) -> None:
    """progress.total_steps is known at submission when train.steps is given (it was null
    until the worker started); in epochs it waits for the data."""
    spec = {
        "model": {"preset": "qwen3", "config": {"hidden_size": 32, "head_dim": 8}},
        "data": {"train": "synthetic", "seq_len": 32},
        "train": {"steps": 7, "batch_size": 2},
        "engine": {"gpus": 0},
    }
    r = client.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    assert r.json()["progress"] == {
        "step": 0,
        "total_steps": 7,
        "epoch": None,
        "eta_seconds": None,
    }
    epochs = {**spec, "train": {"epochs": 1, "batch_size": 2}}
    r = client.post("/v1/jobs", json=epochs)
    assert r.status_code == 201, r.text
    assert r.json()["progress"]["total_steps"] is None
    for job in client.get("/v1/jobs").json()["data"]:
        client.post(f"/v1/jobs/{job['id']}/cancel")


def test_deleting_a_file_a_queued_job_uses_is_409_naming_the_job(client: TestClient) -> None:
    upload = client.post("/v1/files", files={"file": ("d.jsonl", b'{"text": "hi"}\n')})
    file_id = upload.json()["id"]
    spec = {
        "model": {"preset": "qwen3", "config": {"hidden_size": 32, "head_dim": 8}},
        "data": {"train": file_id, "seq_len": 32},
        "train": {"steps": 7, "batch_size": 2},
        "engine": {"gpus": 0},
    }
    job = client.post("/v1/jobs", json=spec)
    assert job.status_code == 201, job.text
    client.post(f"/v1/jobs/{job.json()['id']}/pause")
    r = client.delete(f"/v1/files/{file_id}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "file_in_use"
    assert job.json()["id"] in r.json()["error"]["message"]
    assert client.get(f"/v1/files/{file_id}").status_code == 200
    client.post(f"/v1/jobs/{job.json()['id']}/cancel")
    assert client.delete(f"/v1/files/{file_id}").status_code == 200


def test_an_upload_that_would_go_below_the_free_space_floor_is_507(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100 KiB free and a 64 KiB floor: a 50 KiB upload would leave 50 KiB, so it is
    refused before it is stored; a 10 KiB one is stored (it used to be accepted either way)."""
    settings = Settings(data_dir=tmp_path, gpus="none", token="tok", min_free_bytes=64 << 10)
    real = shutil.disk_usage

    def usage(path: object) -> object:
        return real(path)._replace(free=100 << 10)

    with TestClient(
        create_app(settings), base_url=LOOPBACK, headers={"Authorization": "Bearer tok"}
    ) as c:
        monkeypatch.setattr(shutil, "disk_usage", usage)
        line = b'{"text": "' + b"x" * 1000 + b'"}\n'
        r = c.post("/v1/files", files={"file": ("big.jsonl", line * 50)})
        assert r.status_code == 507 and r.json()["error"]["code"] == "disk_full", r.text
        assert "RP_MIN_FREE_BYTES=65536" in r.json()["error"]["message"]
        assert c.get("/v1/files").json()["data"] == []
        assert c.post("/v1/files", files={"file": ("small.jsonl", line * 10)}).status_code == 201


def test_a_multipart_spool_out_of_space_is_507_not_400(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def full(self: UploadFile, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(UploadFile, "write", full)
    r = client.post("/v1/files", files={"file": ("d.jsonl", b'{"text": "hi"}\n')})
    assert r.status_code == 507, r.text
    assert r.json()["error"]["code"] == "disk_full" and "spool" in r.json()["error"]["message"]
