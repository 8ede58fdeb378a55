"""LoRA in the JobSpec: defaults, 422s naming the field, layer widths, parameter counts."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine.catalog import FAMILIES, LORA_TARGET_MODULES, projection_shapes
from rp_service.app import create_app
from rp_service.jobs.pipe import WorkerHandle
from rp_service.jobs.store import SCHEMA_VERSION, JobRecord, Store
from rp_service.schemas import Job, JobSpec
from rp_service.settings import Settings

BASE = {
    "model": {"preset": "qwen3", "config": {"hidden_size": 64, "head_dim": 16}},
    "data": {"train": "synthetic"},
}
LORA = {**BASE, "train": {"method": "lora"}}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        data_dir=tmp_path / "data", gpus="none", model_roots=[tmp_path], auth="none"
    )
    with TestClient(create_app(settings), base_url="http://127.0.0.1:8321") as c:
        yield c


def test_full_is_the_default_and_lora_without_a_section_gets_the_defaults() -> None:
    full = JobSpec.model_validate(BASE)
    assert full.train.method == "full" and full.lora is None
    lora = JobSpec.model_validate(LORA).lora
    assert lora is not None
    assert (lora.rank, lora.alpha, lora.dropout, lora.merge) == (16, 32.0, 0.0, False)
    assert tuple(lora.target_modules) == LORA_TARGET_MODULES
    # what the store keeps validates again to the same spec (the worker re-reads it)
    dumped = JobSpec.model_validate(LORA).model_dump(mode="json")
    assert JobSpec.model_validate(dumped).model_dump(mode="json") == dumped
    assert JobSpec.model_validate(full.model_dump(mode="json")).lora is None


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({**LORA, "lora": {"rank": 0}}, "lora.rank", "greater than or equal to 1"),
        ({**LORA, "lora": {"rank": -4}}, "lora.rank", "greater than or equal to 1"),
        ({**LORA, "lora": {"dropout": 1.0}}, "lora.dropout", "less than 1"),
        ({**LORA, "lora": {"alpha": 0}}, "lora.alpha", "greater than 0"),
        ({**LORA, "lora": {"target_modules": []}}, "lora.target_modules", "at least 1"),
        ({**LORA, "lora": {"bias": "all"}}, "lora.bias", "Extra inputs"),
        ({**LORA, "train": {"method": "qlora"}}, "train.method", "'full' or 'lora'"),
        ({**BASE, "lora": {"rank": 8}}, "lora", "train.method is 'full'"),
        ({**BASE, "train": {"method": "full"}, "lora": {}}, "lora", "remove the lora section"),
    ],
)
def test_bad_lora_specs_are_422_naming_the_field(
    client: TestClient, body: dict, param: str, words: str
) -> None:
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"] and err["message"].startswith(param)


def test_unknown_target_module_lists_the_valid_ones(client: TestClient) -> None:
    body = {**LORA, "lora": {"target_modules": ["q_proj", "qkv_proj"]}}
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["param"] == "lora.target_modules"
    assert "'qkv_proj'" in err["message"]
    assert all(name in err["message"] for name in LORA_TARGET_MODULES)
    r = client.post("/v1/jobs", json={**LORA, "lora": {"target_modules": ["v_proj", "v_proj"]}})
    assert r.status_code == 422 and "twice" in r.json()["error"]["message"]


def test_rank_above_a_preset_layer_width_is_422(client: TestClient) -> None:
    # hidden 64, one kv head of 16: k_proj and v_proj are 64 -> 16...
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1}
    body = {**LORA, "model": {"preset": "qwen3", "config": {**config, "head_dim": 16}}}
    r = client.post("/v1/jobs", json={**body, "lora": {"rank": 17}})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "lora.rank" and err["code"] == "lora_rank_too_large"
    assert "k_proj" in err["message"] and "at most 16" in err["message"]
    # ...but adapting only the MLP, whose narrowest side is the hidden size, allows 64
    mlp = {"target_modules": ["gate_proj", "up_proj", "down_proj"]}
    assert _rank_error(client, {**body, "lora": {**mlp, "rank": 64}})
    err = client.post("/v1/jobs", json={**body, "lora": {**mlp, "rank": 65}}).json()["error"]
    assert err["param"] == "lora.rank" and "at most 64" in err["message"]


def _rank_error(client: TestClient, body: dict) -> str:
    """The error param of a submission that passes the LoRA checks ('' if accepted)."""
    # An unknown file id fails after the LoRA checks: no worker starts.
    r = client.post("/v1/jobs", json={**body, "data": {"train": "file-none"}})
    assert r.status_code == 422
    return r.json()["error"]["param"]


def test_rank_above_a_local_model_layer_width_is_422(client: TestClient, tmp_path: Path) -> None:
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    config = {
        "model_type": "llama",
        "hidden_size": 48,
        "intermediate_size": 40,
        "num_attention_heads": 4,
        "max_position_embeddings": 4096,
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    body = {**LORA, "model": {"path": str(model_dir)}, "data": {"train": "synthetic"}}
    err = client.post("/v1/jobs", json={**body, "lora": {"rank": 41}}).json()["error"]
    assert err["param"] == "lora.rank"
    assert "gate_proj" in err["message"] and "at most 40" in err["message"]
    assert _rank_error(client, {**body, "lora": {"rank": 40}}) == "data.train"


def test_preset_defaults_are_transformers_defaults() -> None:
    import transformers

    for preset, class_name in (("qwen3", "Qwen3Config"), ("llama", "LlamaConfig")):
        config = getattr(transformers, class_name)()
        assert FAMILIES[preset].config_class == class_name
        got = projection_shapes(FAMILIES[preset].config_defaults)
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        assert got == {
            "q_proj": (config.hidden_size, q),
            "k_proj": (config.hidden_size, kv),
            "v_proj": (config.hidden_size, kv),
            "o_proj": (q, config.hidden_size),
            "gate_proj": (config.hidden_size, config.intermediate_size),
            "up_proj": (config.hidden_size, config.intermediate_size),
            "down_proj": (config.intermediate_size, config.hidden_size),
        }, preset


def test_projection_shapes_match_the_hf_modules() -> None:
    import torch

    from tests.tiny_models import tiny_model

    fields = {
        "hidden_size": 24,
        "intermediate_size": 40,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 10,
        "num_hidden_layers": 1,
        "vocab_size": 16,
    }
    with torch.device("meta"):
        model = tiny_model("qwen3", seed=None, **fields)
    layer = model.model.layers[0]
    modules = {**dict(layer.self_attn.named_children()), **dict(layer.mlp.named_children())}
    want = {
        name: (m.in_features, m.out_features)
        for name, m in modules.items()
        if isinstance(m, torch.nn.Linear)
    }
    assert projection_shapes(fields) == want


def test_worker_running_event_sets_the_job_parameter_counts() -> None:
    handle = WorkerHandle(job_id="job-1", gpus=[])
    line = {
        "type": "status",
        "message": "running",
        "data": {"status": "running", "parameters": {"trainable": 3, "total": 10}},
    }
    out = handle.read_line(json.dumps(line).encode())
    assert out is not None and out["job_fields"] == {"parameters": {"trainable": 3, "total": 10}}
    line["data"]["parameters"] = {"trainable": "3", "total": 10}
    out = handle.read_line(json.dumps(line).encode())
    assert out is not None and "job_fields" not in out


def test_store_migrates_a_version_1_database_to_keep_parameter_counts(tmp_path: Path) -> None:
    from rp_service.jobs.store import _MIGRATIONS

    path = tmp_path / "rp.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(f"{_MIGRATIONS[0]}\nPRAGMA user_version = 1;")
    conn.execute(
        "INSERT INTO jobs (id, status, created_at, spec) VALUES ('job-old', 'succeeded', 1, '{}')"
    )
    conn.commit()
    conn.close()
    store = Store(path)
    store.open()
    assert store.schema_version() == SCHEMA_VERSION
    old = store.get_job("job-old")
    assert old is not None and old.parameters is None
    store.create_job(JobRecord(id="job-new", status="queued", created_at=2, spec={}))
    store.update_job("job-new", parameters={"trainable": 5, "total": 50})
    new = store.get_job("job-new")
    assert new is not None
    job = Job.model_validate(new, from_attributes=True)
    assert job.parameters is not None and (job.parameters.trainable, job.parameters.total) == (
        5,
        50,
    )
    store.close()
