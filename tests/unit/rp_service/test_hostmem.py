"""The host-memory plan at submission: 422 over RP_HOST_MEMORY_BUDGET, the budget in
/v1/system, preset shapes that agree with transformers, no torch on the request path."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from engine.catalog import FAMILIES
from engine.planning.memory_plan import ModelShape
from rp_service.app import create_app
from rp_service.jobs.hostmem import _BYTE_VOCAB_ROUNDED, plan_for_spec
from rp_service.schemas import JobSpec
from rp_service.settings import Settings
from rp_service.spec_to_engine import spec_to_engine

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}

# A GRPO spec's grader: the plan does not read it, the JobSpec needs one.
GRADER = {"type": "string_check", "name": "g", "input": "a", "reference": "a", "operation": "eq"}


def _spec(**engine: Any) -> dict[str, Any]:
    """Qwen3's default shape (about 10.8 B parameters with the byte vocabulary)."""
    return {
        "model": {"preset": "qwen3", "dtype": "float16"},
        "data": {"train": "synthetic", "seq_len": 512},
        "train": {"steps": 2, "batch_size": 8},
        "engine": {"gpus": 0, **engine},
    }


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path, gpus="none", host_memory_budget="160GiB", auth="none")
    with TestClient(create_app(settings), base_url="http://127.0.0.1:8321") as c:
        yield c


def test_over_budget_job_is_422_naming_the_field(client: TestClient) -> None:
    r = client.post("/v1/jobs", json=_spec())
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "host_memory_exceeded"
    # 20 bytes a parameter do not fit in 160 GiB; 12 do: the first option is the engine's
    assert err["param"] == "engine.optim_state_dtype"
    assert "over this daemon's budget of 160.0 GiB" in err["message"]
    detail = err["details"][0]
    assert detail["budget_bytes"] == 160 << 30 and detail["need_bytes"] > 160 << 30
    assert detail["parts_bytes"]["optim_state"] > 0
    fields = [o["param"] for o in detail["options"]]
    assert fields[0] == "engine.optim_state_dtype" and "model" in fields  # LoRA
    assert client.get("/v1/jobs").json()["data"] == []  # nothing was queued


def test_the_lower_precision_options_make_it_fit(client: TestClient) -> None:
    spec = _spec(optim_state_dtype="bfloat16", optim_grad_dtype="model", pin_model="arena")
    r = client.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    client.post(f"/v1/jobs/{r.json()['id']}/cancel")


def test_tiny_job_fits_and_system_reports_the_budget(client: TestClient) -> None:
    spec = {**_spec(), "model": {"preset": "qwen3", "config": TINY}}
    r = client.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    client.post(f"/v1/jobs/{r.json()['id']}/cancel")
    assert client.get("/v1/system").json()["host_memory_budget_bytes"] == 160 << 30


def test_default_budget_is_the_available_memory_less_a_margin(tmp_path: Path) -> None:
    from engine.planning.memory_plan import available_host_bytes

    settings = Settings(data_dir=tmp_path, gpus="none", auth="none")
    with TestClient(create_app(settings), base_url="http://127.0.0.1:8321") as c:
        budget = c.get("/v1/system").json()["host_memory_budget_bytes"]
    available = available_host_bytes()
    assert 0.85 * available < budget < available


def test_bad_budget_setting_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="RP_HOST_MEMORY_BUDGET must be a positive size"):
        Settings(data_dir=tmp_path, host_memory_budget="plenty")


@pytest.mark.parametrize(
    "preset", sorted(name for name, f in FAMILIES.items() if f.config_defaults is not None)
)
def test_preset_defaults_are_transformers_defaults(preset: str) -> None:
    import transformers

    from rp_service.data.tokenizer import BYTE_VOCAB_SIZE

    family = FAMILIES[preset]
    config = getattr(transformers, family.config_class)()
    assert ModelShape.from_config(family.config_defaults) == ModelShape.from_config(config)
    assert _BYTE_VOCAB_ROUNDED == -(-BYTE_VOCAB_SIZE // 8) * 8


def test_spec_plan_counts_the_model_the_worker_builds() -> None:
    """The shape the daemon plans is the model rp_service.worker.modeling builds."""
    from rp_service.data.tokenizer import BYTE_VOCAB_SIZE
    from rp_service.worker.modeling import build_model

    model = {"preset": "llama", "config": TINY, "dtype": "float16"}
    spec = JobSpec.model_validate({**_spec(), "model": model})
    plan = plan_for_spec(spec, spec_to_engine(spec), path_config=None, cuda=False)
    assert plan is not None and plan.shape is not None
    model = build_model(
        preset="llama",
        config_overrides=TINY,
        path=None,
        dtype="float16",
        vocab_size=BYTE_VOCAB_SIZE,
        seed=0,
    )
    assert plan.shape.num_params == sum(p.numel() for p in model.parameters())
    assert plan.parts["model"] == 2 * plan.shape.num_params


def test_a_grpo_full_fine_tunes_kl_reference_is_a_second_model_in_the_plan() -> None:
    plans = {}
    for method, kl in (("full", 0.0), ("full", 0.1), ("lora", 0.1)):
        body = _spec()
        body["train"] = {**body["train"], "objective": "grpo", "method": method}
        body["grpo"] = {"kl_coef": kl}
        spec = JobSpec.model_validate({**body, "grader": GRADER})
        plan = plan_for_spec(spec, spec_to_engine(spec), path_config=None, cuda=False)
        assert plan is not None
        plans[method, kl] = plan
    without, with_kl = plans["full", 0.0], plans["full", 0.1]
    assert "frozen_copies" not in without.parts
    assert with_kl.parts["frozen_copies"] == without.parts["model"] == 2 * with_kl.shape.num_params
    assert with_kl.total_bytes == without.total_bytes + with_kl.parts["frozen_copies"]
    assert "frozen_copies" not in plans["lora", 0.1].parts  # its reference: the adapters off


def test_a_grpo_step_is_planned_as_its_groups_of_prompt_and_completion() -> None:
    """A GRPO step trains train.batch_size prompts x group_size completions, each up to
    data.seq_len + max_completion_tokens tokens: the activations the engine keeps."""
    body = _spec()
    sft = JobSpec.model_validate(body)
    grpo = JobSpec.model_validate(
        {
            **body,
            "train": {**body["train"], "objective": "grpo"},
            "grpo": {"group_size": 8, "max_completion_tokens": 512},
            "grader": GRADER,
        }
    )
    plans = [
        plan_for_spec(spec, spec_to_engine(spec), path_config=None, cuda=False)
        for spec in (sft, grpo)
    ]
    assert plans[0] is not None and plans[1] is not None
    assert plans[1].run.seq_len == 512 + 512
    assert plans[1].run.tokens_per_step == 8 * 8 * (512 + 512) == 16 * plans[0].run.tokens_per_step
    assert plans[1].parts["activations"] > 4 * plans[0].parts["activations"]


def test_request_path_does_not_import_torch(tmp_path: Path) -> None:
    code = f"""
import sys
from rp_service.jobs.resolve import SpecResolver
from rp_service.schemas import JobSpec
from rp_service.settings import Settings
from rp_service.errors import HostMemoryExceeded
resolver = SpecResolver(Settings(data_dir={str(tmp_path)!r}, host_memory_budget="1GiB"), None)
spec = JobSpec.model_validate({_spec()!r})
try:
    resolver.check(spec, gpu_count=0)
except HostMemoryExceeded as exc:
    assert exc.code == "host_memory_exceeded", exc.code
else:
    raise SystemExit("not refused")
print("torch" in sys.modules)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(
    "config",
    [
        {"num_attention_heads": 0},
        {"hidden_size": -1},
        {"vocab_size": "many"},
        {"intermediate_size": 10**300},
    ],
)
def test_a_bad_preset_config_is_refused_before_any_plan(config: dict[str, Any]) -> None:
    """A preset's shape overrides are checked where they enter (they used to skip the plan
    and fail in the worker); a model folder's config.json without a shape still gets no
    plan (and no 500): the worker reports it."""
    key = next(iter(config))
    with pytest.raises(ValidationError, match=f"model.config.{key} must be a whole number"):
        JobSpec.model_validate({**_spec(), "model": {"preset": "qwen3", "config": config}})
    spec = JobSpec.model_validate({**_spec(), "model": {"path": "/models/m"}})
    assert (
        plan_for_spec(
            spec, spec_to_engine(spec), path_config={"model_type": "qwen3", **config}, cuda=False
        )
        is None
    )
