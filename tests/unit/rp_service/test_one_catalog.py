"""The service and the engine read one catalog and one spec-to-engine mapping; the daemon's
request path stays torch-free; more micro-batches than sequences is a 422."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine import catalog
from rp_service.app import create_app
from rp_service.errors import JobFailure
from rp_service.jobs.hostmem import plan_for_spec
from rp_service.schemas import JobSpec, LoraSection, ModelSection
from rp_service.settings import Settings
from rp_service.spec_to_engine import spec_to_engine


def _spec(**sections: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"preset": "qwen3", "config": {"hidden_size": 64, "head_dim": 16}},
        "data": {"train": "synthetic", "seq_len": 64},
        "train": {"steps": 2, "batch_size": 4},
        "engine": {"gpus": 0},
    }
    for key, value in sections.items():
        body[key] = {**body.get(key, {}), **value}
    return body


LOOPBACK = "http://127.0.0.1:8321"
AUTH = {"Authorization": "Bearer tok"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path, gpus="none", host_memory_budget="160GiB", token="tok")
    with TestClient(create_app(settings), base_url=LOOPBACK, headers=AUTH) as c:
        yield c


def test_the_service_has_no_table_of_its_own() -> None:
    import rp_service

    assert not (Path(rp_service.__file__).parent / "shapes.py").exists()
    gone = {
        "rp_service.schemas": ["LORA_TARGET_MODULES"],
        "rp_service.jobs.resolve": ["PRESET_MAX_POSITIONS", "PRESET_DEFAULTS"],
        "rp_service.jobs.hostmem": ["_UNPLANNED_MODEL_TYPES", "PRESET_DEFAULTS"],
        "rp_service.jobs.store": ["TERMINAL"],
    }
    for module, names in gone.items():
        for name in names:
            assert not hasattr(importlib.import_module(module), name), (module, name)
    modeling = importlib.import_module("rp_service.worker.modeling")  # a broken one fails
    assert not hasattr(modeling, "PRESETS")
    # the JobSpec offers the catalog's presets and LoRA targets, in its order
    schema = ModelSection.model_json_schema()["properties"]["preset"]["anyOf"][0]
    assert tuple(schema["enum"]) == catalog.PRESET_NAMES
    assert tuple(LoraSection().target_modules) == catalog.LORA_TARGET_MODULES


def test_the_plan_counts_the_catalogs_projection_shapes() -> None:
    spec = JobSpec.model_validate(_spec(train={"method": "lora"}, lora={"rank": 3}))
    plan = plan_for_spec(spec, spec_to_engine(spec), path_config=None, cuda=False)
    assert plan is not None and plan.shape is not None
    config = {**catalog.FAMILIES["qwen3"].config_defaults, **spec.model.config}
    shapes = catalog.projection_shapes(config)
    assert plan.shape.projection_shapes() == shapes
    per_layer = sum(3 * (fan_in + fan_out) for fan_in, fan_out in shapes.values())
    assert plan.run.trainable_params == per_layer * plan.shape.num_hidden_layers


@pytest.mark.parametrize(
    ("engine", "run"),
    [
        ({}, {"num_microbatch": 2, "optim_grad_dtype": "optim", "saved_attention": True}),
        (
            {"num_microbatch": 3, "optim_grad_dtype": "model", "recompute_attention": True},
            {"num_microbatch": 3, "optim_grad_dtype": "model", "saved_attention": False},
        ),
    ],
)
def test_the_plan_and_the_worker_read_one_mapping(
    engine: dict[str, Any], run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the plan assumes is what rp_service.worker.engine_setup.wrap passes the engine."""
    import engine as engine_package
    from rp_service.worker import engine_setup

    spec = JobSpec.model_validate(_spec(model={"dtype": "bfloat16"}, engine=engine))
    plan = plan_for_spec(spec, spec_to_engine(spec), path_config=None, cuda=True)
    assert plan is not None
    assert {k: getattr(plan.run, k) for k in run} == run
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(engine_package, "wrap_model_to_roundpipe", lambda m, **kw: calls.append(kw))
    options = spec_to_engine(spec)
    engine_setup.wrap(object(), options)
    (kwargs,) = calls
    assert kwargs["recompute_attention"] is (not run["saved_attention"])
    # the worker resolves the default on its own devices, as the plan did on the spec's
    from engine.device import get_num_devices

    want = engine.get("num_microbatch") or options.num_microbatch_on(get_num_devices())
    assert kwargs["model_run_config"].num_microbatch == want
    assert options.num_microbatch_on(1) == run["num_microbatch"]  # gpus 0: one device planned
    in_place = kwargs["optim_grad_dtype"] is not None
    assert in_place is (run["optim_grad_dtype"] == "model")


def test_compact_optimizer_memory_is_one_mapping_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.optim_memory compact: the plan counts compact's bytes, the worker wraps with
    optim_memory='compact' (no fp32 optimizer dtypes) and builds 8-bit Adam moments."""
    import torch

    import engine as engine_package
    from rp_service.worker import engine_setup

    spec = JobSpec.model_validate(
        _spec(model={"dtype": "bfloat16"}, engine={"optim_memory": "compact"})
    )
    options = spec_to_engine(spec)
    assert options.optim_memory == "compact"
    plan = plan_for_spec(spec, spec_to_engine(spec), path_config=None, cuda=False)
    assert plan is not None and plan.run.optim_memory == "compact"
    assert plan.parts["optim_master"] == 0 and plan.parts["optim_state_scales"] > 0
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(engine_package, "wrap_model_to_roundpipe", lambda m, **kw: calls.append(kw))
    engine_setup.wrap(object(), options)
    (kwargs,) = calls
    assert kwargs["optim_memory"] == "compact"
    assert "optim_dtype" not in kwargs and "optim_grad_dtype" not in kwargs
    master = torch.nn.Parameter(torch.zeros(300, dtype=torch.bfloat16))
    optimizer = engine_setup.make_optimizer([master], options)
    assert optimizer.state_dtype == torch.uint8


def test_num_microbatch_up_to_the_batch_size_is_accepted() -> None:
    spec = JobSpec.model_validate(_spec(engine={"num_microbatch": 4}))
    assert spec_to_engine(spec).num_microbatch == 4
    spec = JobSpec.model_validate(_spec(engine={"num_microbatch": 5}))
    with pytest.raises(JobFailure) as failure:
        spec_to_engine(spec)
    assert failure.value.param == "engine.num_microbatch"
    assert failure.value.code == "num_microbatch_above_batch_size"


def test_more_micro_batches_than_sequences_is_422_naming_the_field(client: TestClient) -> None:
    r = client.post("/v1/jobs", json=_spec(engine={"num_microbatch": 5}))
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == "engine.num_microbatch"
    assert err["code"] == "num_microbatch_above_batch_size"
    assert err["message"].startswith("engine.num_microbatch")
    assert "at most 4" in err["message"] and "train.batch_size" in err["message"]
    assert err["details"] == [{"param": "engine.num_microbatch", "message": err["message"]}]


def test_the_request_path_does_not_import_torch(tmp_path: Path) -> None:
    code = f"""
import sys
from fastapi.testclient import TestClient
from rp_service.app import create_app
from rp_service.jobs.hostmem import plan_for_spec
from rp_service.schemas import JobSpec
from rp_service.settings import Settings
from rp_service.spec_to_engine import spec_to_engine
settings = Settings(
    data_dir={str(tmp_path)!r}, gpus="none", host_memory_budget="160GiB", token="tok"
)
app = create_app(settings)
spec = JobSpec.model_validate({_spec(train={"method": "lora"})!r})
assert plan_for_spec(spec, spec_to_engine(spec), path_config=None, cuda=False) is not None
with TestClient(app, base_url={LOOPBACK!r}, headers={AUTH!r}) as client:
    r = client.post("/v1/jobs", json={_spec(engine={"num_microbatch": 5})!r})
    assert r.status_code == 422, r.text
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "[]"
