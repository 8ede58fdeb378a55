"""engine.matmul_precision: from the JobSpec (and the OpenAI extension) to RoundPipe, refused
at submission (422 naming the field) where the job would not run on FP8 GPUs, and each GPU's
FP8 ability in /v1/system and `rp system`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine.options import AdamOptions, EngineOptions, OptionError, fp8_capable
from rp_service.app import create_app
from rp_service.errors import InvalidRequest, JobFailure
from rp_service.jobs.resolve import SpecResolver
from rp_service.schemas import JobSpec
from rp_service.settings import Settings
from rp_service.spec_to_engine import spec_to_engine
from tests.unit.rp_service.test_one_catalog import AUTH, LOOPBACK, _spec
from tests.unit.rp_service.test_openai_mapping import _plan

FP8 = {"model": {"dtype": "bfloat16"}, "engine": {"gpus": 1, "matmul_precision": "fp8"}}


def _fp8_spec(**sections: Any) -> JobSpec:
    body = _spec(**FP8)
    for key, value in sections.items():
        body[key] = {**body[key], **value}
    return JobSpec.model_validate(body)


@pytest.fixture
def resolver(tmp_path: Path) -> SpecResolver:
    return SpecResolver(Settings(data_dir=tmp_path, host_memory_budget="160GiB"), None)


def test_capability_rule() -> None:
    assert [fp8_capable(c) for c in ("8.9", "9.0", "10.0", "12.1")] == [True] * 4
    assert [fp8_capable(c) for c in ("8.6", "8.0", "7.5", "x", "")] == [False] * 5
    assert fp8_capable((8, 9)) and not fp8_capable((8, 7))


def test_the_field_reaches_roundpipe(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine as engine_package
    from rp_service.worker import engine_setup

    assert JobSpec.model_validate(_spec()).engine.matmul_precision == "bf16"
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(engine_package, "wrap_model_to_roundpipe", lambda m, **kw: calls.append(kw))
    for spec, want in (
        (JobSpec.model_validate(_spec()), ("bf16", "rowwise")),
        (_fp8_spec(engine={"fp8_recipe": "tensorwise"}), ("fp8", "tensorwise")),
        (
            _fp8_spec(engine={"fp8_recipe": "rowwise_with_gw_hp"}),
            ("fp8", "rowwise_with_gw_hp"),
        ),
    ):
        options = spec_to_engine(spec)
        assert (options.matmul_precision, options.fp8_recipe) == want
        engine_setup.wrap(object(), options)
        kwargs = calls.pop()
        assert (kwargs["matmul_precision"], kwargs["fp8_recipe"]) == want


def test_fp8_needs_a_bfloat16_model() -> None:
    with pytest.raises(OptionError) as refused:
        EngineOptions(adam=AdamOptions(lr=1e-4), matmul_precision="fp8")
    assert refused.value.code == "fp8_needs_bfloat16"
    with pytest.raises(JobFailure) as failure:
        spec_to_engine(_fp8_spec(model={"dtype": "float32"}))
    assert failure.value.code == "fp8_needs_bfloat16"
    assert failure.value.param == "engine.matmul_precision"
    assert "model.dtype" in failure.value.message


@pytest.mark.parametrize(
    ("gpu_count", "capabilities", "gpus", "code", "named"),
    [
        (0, None, 0, "fp8_needs_gpu", "this daemon has no GPUs"),
        (2, ["9.0", "9.0"], 0, "fp8_needs_gpu", "engine.gpus is 0"),
        (1, ["8.6"], 1, "fp8_unsupported_gpu", "GPU 0 (8.6)"),
        (2, ["9.0", "8.0"], 1, "fp8_unsupported_gpu", "GPU 1 (8.0)"),
        (1, None, 1, "fp8_unsupported_gpu", "GPU 0 (capability unknown)"),
    ],
)
def test_fp8_off_fp8_gpus_is_refused_naming_the_field(
    resolver: SpecResolver,
    gpu_count: int,
    capabilities: list[str] | None,
    gpus: int,
    code: str,
    named: str,
) -> None:
    spec = _fp8_spec(engine={"gpus": gpus})
    with pytest.raises(InvalidRequest) as refused:
        resolver.check(spec, gpu_count=gpu_count, gpu_capabilities=capabilities)
    assert refused.value.code == code
    assert refused.value.param == "engine.matmul_precision"
    assert named in refused.value.message and "'bf16'" in refused.value.message


def test_fp8_on_fp8_gpus_still_needs_bfloat16(resolver: SpecResolver) -> None:
    with pytest.raises(JobFailure) as failure:
        resolver.check(_fp8_spec(model={"dtype": "float32"}), gpu_count=1, gpu_capabilities=["9.0"])
    assert (failure.value.code, failure.value.param) == (
        "fp8_needs_bfloat16",
        "engine.matmul_precision",
    )


def test_fp8_on_fp8_gpus_and_bf16_anywhere_pass(resolver: SpecResolver) -> None:
    resolver.check(_fp8_spec(), gpu_count=2, gpu_capabilities=["8.9", "9.0"])
    resolver.check(JobSpec.model_validate(_spec()), gpu_count=1, gpu_capabilities=["7.5"])
    resolver.check(JobSpec.model_validate(_spec()), gpu_count=0)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path, gpus="none", host_memory_budget="160GiB", token="tok")
    with TestClient(create_app(settings), base_url=LOOPBACK, headers=AUTH) as c:
        yield c


def test_the_api_answers_422_on_a_daemon_without_gpus(client: TestClient) -> None:
    r = client.post("/v1/jobs", json=_spec(**FP8))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("fp8_needs_gpu", "engine.matmul_precision")
    # the devices first: a float32 model too is told to use GPUs, not to change its dtype
    r = client.post("/v1/jobs", json=_spec(engine={"gpus": 1, "matmul_precision": "fp8"}))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "fp8_needs_gpu"
    r = client.post("/v1/jobs", json=_spec(engine={"matmul_precision": "fp4"}))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "engine.matmul_precision"


def test_the_openai_extension_maps_to_the_field() -> None:
    assert _plan({}, gpu_count=1).spec.engine.matmul_precision == "bf16"
    spec = _plan({"matmul_precision": "fp8"}, gpu_count=1).spec
    assert (spec.engine.matmul_precision, spec.model.dtype) == ("fp8", "bfloat16")


def test_rp_system_shows_fp8_per_gpu() -> None:
    from rp_client.cli.system import _device_line

    line = _device_line(
        {
            "index": 0,
            "name": "H100",
            "total_memory_bytes": 80 * 2**30,
            "capability": "9.0",
            "fp8": True,
        }
    )
    assert line == "0  H100  capability 9.0  80.0 GiB  fp8 yes"
    assert _device_line({"index": 1, "name": "A100", "capability": "8.0", "fp8": False}).endswith(
        "fp8 no"
    )
    assert _device_line({"name": "cpu"}).endswith("fp8 -")  # an older daemon: no such field


def test_the_openai_facade_answers_400_naming_its_field(client: TestClient) -> None:
    lines = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    up = client.post(
        "/v1/files", files={"file": ("d.jsonl", lines * 4)}, data={"purpose": "fine-tune"}
    )
    assert up.status_code == 201, up.text
    body = {"model": "qwen3", "training_file": up.json()["id"], "matmul_precision": "fp8"}
    r = client.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("fp8_needs_gpu", "matmul_precision")


def test_a_daemon_refuses_fp8_for_the_gpu_that_lacks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's capabilities reach the submission check: an H100 and an A100 (8.0)."""
    import rp_service.system

    probed = [
        {"index": 0, "name": "H100", "total_memory_bytes": 2**36, "capability": "9.0"},
        {"index": 1, "name": "A100", "total_memory_bytes": 2**35, "capability": "8.0"},
    ]
    monkeypatch.setattr(rp_service.system, "_CUDA_PROBE", f"print({json.dumps(probed)!r})")
    settings = Settings(data_dir=tmp_path, gpus="all", host_memory_budget="160GiB", token="tok")
    with TestClient(create_app(settings), base_url=LOOPBACK, headers=AUTH) as c:
        devices = c.get("/v1/system").json()["devices"]
        assert [(d["name"], d["fp8"]) for d in devices] == [("H100", True), ("A100", False)]
        r = c.post("/v1/jobs", json=_spec(**FP8))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("fp8_unsupported_gpu", "engine.matmul_precision")
    assert "GPU 1 (8.0)" in error["message"] and "GPU 0" not in error["message"]
