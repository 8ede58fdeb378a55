"""QLoRA in the service: model.quantization's 422s, its one mapping to the engine and the
host-memory plan, the parameter counts' base bytes, the OpenAI extension and the demo body."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rp_service.api.openai._route import bad_request
from rp_service.app import create_app
from rp_service.errors import BadRequest
from rp_service.jobs.hostmem import plan_for_spec
from rp_service.jobs.pipe import WorkerHandle
from rp_service.openai.mapping import plan_job
from rp_service.openai.schemas import FineTuningJobCreate
from rp_service.schemas import JobSpec, ModelSection
from rp_service.settings import Settings
from rp_service.spec_to_engine import spec_to_engine
from tests.unit.rp_service.test_openai_mapping import _validation_error

BASE = {
    "model": {"preset": "qwen3", "config": {"hidden_size": 64, "head_dim": 16}},
    "data": {"train": "synthetic"},
}
NF4 = {**BASE, "model": {**BASE["model"], "quantization": "nf4"}}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        data_dir=tmp_path / "data", gpus="none", model_roots=[tmp_path], auth="none"
    )
    with TestClient(create_app(settings), base_url="http://127.0.0.1:8321") as c:
        yield c


@pytest.mark.parametrize("train", [None, {"method": "full"}])
def test_nf4_without_lora_is_a_422_naming_model_quantization(
    client: TestClient, train: dict[str, Any] | None
) -> None:
    body = NF4 if train is None else {**NF4, "train": train}
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "model.quantization"
    assert err["message"].startswith("model.quantization: ")
    assert "set train.method to 'lora'" in err["message"]
    assert client.get("/v1/jobs").json()["data"] == []  # nothing was queued


def test_an_unknown_quantization_is_a_422_naming_it(client: TestClient) -> None:
    body = {**BASE, "model": {**BASE["model"], "quantization": "int8"}}
    r = client.post("/v1/jobs", json={**body, "train": {"method": "lora"}})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "model.quantization" and "'none' or 'nf4'" in err["message"]


def test_nf4_maps_to_the_engine_and_packs_the_planned_base() -> None:
    plain = JobSpec.model_validate({**BASE, "train": {"method": "lora"}})
    nf4 = JobSpec.model_validate({**NF4, "train": {"method": "lora"}})
    assert plain.model.quantization == "none"
    assert spec_to_engine(plain).quantization == "none"
    assert spec_to_engine(nf4).quantization == "nf4"
    # the store's copy validates again to the same spec (the worker re-reads it)
    dumped = nf4.model_dump(mode="json")
    assert JobSpec.model_validate(dumped).model_dump(mode="json") == dumped
    want = plan_for_spec(plain, spec_to_engine(plain), path_config=None, cuda=False)
    got = plan_for_spec(nf4, spec_to_engine(nf4), path_config=None, cuda=False)
    assert want is not None and got is not None
    assert got.run.quantization == "nf4" and want.run.quantization == "none"
    assert got.parts["model"] < want.parts["model"]


def test_the_running_event_carries_the_base_host_bytes_to_the_job() -> None:
    handle = WorkerHandle(job_id="job-1", gpus=[])
    counts = {"trainable": 3, "total": 10, "base_host_bytes": 24}
    line = {"type": "status", "message": "running", "data": {"status": "running"}}
    line["data"]["parameters"] = counts
    out = handle.read_line(json.dumps(line).encode())
    assert out is not None and out["job_fields"] == {"parameters": counts}
    line["data"]["parameters"] = {**counts, "base_host_bytes": -1}
    out = handle.read_line(json.dumps(line).encode())
    assert out is not None and "job_fields" not in out


def _openai(body: dict[str, Any]) -> JobSpec:
    request = FineTuningJobCreate(model="tiny", training_file="file-a", **body)
    return plan_job(
        request,
        model=ModelSection(path="/models/tiny"),
        max_positions=4096,
        train_examples=21,
        gpu_count=0,
        seed=7,
    ).spec


def test_openai_quantization_extension_maps_to_a_qlora_job() -> None:
    lora = {"type": "supervised", "supervised": {"lora": {"rank": 8}}}
    spec = _openai({"method": lora, "quantization": "nf4"})
    assert (spec.model.quantization, spec.train.method) == ("nf4", "lora")
    dpo = {"type": "dpo", "dpo": {"lora": {"rank": 8}}}
    assert _openai({"method": dpo, "quantization": "nf4"}).model.quantization == "nf4"
    assert _openai({"method": lora}).model.quantization == "none"


@pytest.mark.parametrize(
    "method", [None, {"type": "supervised"}, {"type": "supervised", "supervised": {}}]
)
def test_openai_nf4_without_lora_is_a_400_naming_quantization(
    method: dict[str, Any] | None,
) -> None:
    body: dict[str, Any] = {"quantization": "nf4"}
    if method is not None:
        body["method"] = method
    with pytest.raises(BadRequest) as info:
        _openai(body)
    assert info.value.status_code == 400 and info.value.param == "quantization"
    assert "method.supervised.lora" in info.value.message


def test_openai_unknown_quantization_is_a_400_naming_it() -> None:
    body = {"model": "m", "training_file": "f", "quantization": "int4"}
    error = bad_request(_validation_error(body))
    assert error.status_code == 400 and error.param == "quantization"
    assert error.code == "invalid_value" and "quantization" in error.message
