"""The daemon's GPU memory cap (RP_GPU_MEMORY_GIB) reaches each worker; a job's
engine.max_gpu_memory_gib reaches RoundPipe, at most the daemon's, 422 when bad."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from engine.errors import ConfigError
from rp_service.app import create_app
from rp_service.errors import InvalidRequest, JobFailure
from rp_service.jobs.pipe import prepare_job_dir
from rp_service.jobs.resolve import SpecResolver
from rp_service.schemas import JobSpec
from rp_service.settings import Settings
from rp_service.spec_to_engine import spec_to_engine
from tests.unit.rp_service.test_one_catalog import AUTH, LOOPBACK, _spec


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        data_dir=tmp_path, gpus="none", host_memory_budget="160GiB", token="tok", gpu_memory_gib=24
    )
    with TestClient(create_app(settings), base_url=LOOPBACK, headers=AUTH) as c:
        yield c


def worker_env(settings: Settings, tmp_path: Path) -> dict[str, str]:
    env, log_file = prepare_job_dir(
        settings,
        job_id="j1",
        job_dir=tmp_path / "j1",
        attempt=1,
        spec=JobSpec.model_validate(_spec()),
        options=spec_to_engine(JobSpec.model_validate(_spec())).to_json(),
        resolved={},
        gpus=[0],
    )
    log_file.close()
    return env


def test_the_setting_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RP_GPU_MEMORY_GIB", "23.5")
    assert Settings().gpu_memory_gib == 23.5
    monkeypatch.setenv("RP_GPU_MEMORY_GIB", "0")
    with pytest.raises(ValidationError, match="gpu_memory_gib"):
        Settings()


def test_each_worker_gets_the_daemons_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = worker_env(Settings(data_dir=tmp_path, gpu_memory_gib=24), tmp_path)
    assert env["RP_GPU_MEMORY_GIB"] == "24.0"
    # Without the setting a worker has no cap, even where the daemon's shell had one that
    # its settings did not take (e.g. settings built by code).
    monkeypatch.setenv("RP_GPU_MEMORY_GIB", "8")
    env = worker_env(Settings(data_dir=tmp_path, gpu_memory_gib=None), tmp_path)
    assert "RP_GPU_MEMORY_GIB" not in env


def test_a_jobs_cap_is_passed_to_roundpipe(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine as engine_package
    from rp_service.worker import engine_setup

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(engine_package, "wrap_model_to_roundpipe", lambda m, **kw: calls.append(kw))
    for engine, expected in (({}, None), ({"max_gpu_memory_gib": 20.5}, 20.5)):
        spec = JobSpec.model_validate(_spec(engine=engine))
        assert spec_to_engine(spec).max_gpu_memory_gib == expected
        engine_setup.wrap(object(), spec_to_engine(spec))
        assert calls.pop()["max_gpu_memory"] == expected
    spec = JobSpec.model_validate(
        _spec(
            model={"dtype": "bfloat16"}, engine={"optim_memory": "compact", "max_gpu_memory_gib": 6}
        )
    )
    engine_setup.wrap(object(), spec_to_engine(spec))
    assert calls.pop()["max_gpu_memory"] == 6


def test_a_cap_below_the_largest_layer_fails_the_job_naming_the_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import engine as engine_package
    from rp_service.worker import engine_setup

    def refuse(model: Any, **kwargs: Any) -> None:
        raise ConfigError("max_gpu_memory=1 GiB cannot hold ...", field="max_gpu_memory")

    monkeypatch.setattr(engine_package, "wrap_model_to_roundpipe", refuse)
    spec = JobSpec.model_validate(_spec(engine={"max_gpu_memory_gib": 1}))
    with pytest.raises(JobFailure) as failure:
        engine_setup.wrap(object(), spec_to_engine(spec))
    assert failure.value.code == "gpu_memory_too_small"
    assert failure.value.param == "engine.max_gpu_memory_gib"
    # the daemon's cap is no field of the job
    with pytest.raises(JobFailure) as failure:
        engine_setup.wrap(object(), spec_to_engine(JobSpec.model_validate(_spec())))
    assert failure.value.param is None


def test_a_job_may_not_ask_more_than_the_daemons_cap(tmp_path: Path) -> None:
    resolver = SpecResolver(
        Settings(data_dir=tmp_path, host_memory_budget="160GiB", gpu_memory_gib=24), None
    )
    resolver.check(JobSpec.model_validate(_spec(engine={"max_gpu_memory_gib": 24})), gpu_count=0)
    with pytest.raises(InvalidRequest) as refused:
        resolver.check(
            JobSpec.model_validate(_spec(engine={"max_gpu_memory_gib": 30})), gpu_count=0
        )
    assert refused.value.param == "engine.max_gpu_memory_gib"
    assert refused.value.code == "gpu_memory_above_limit"
    assert "at most 24" in refused.value.message


@pytest.mark.parametrize("value", [0, -2, "lots", 1 << 21])
def test_a_bad_cap_is_422_naming_the_field(client: TestClient, value: Any) -> None:
    r = client.post("/v1/jobs", json=_spec(engine={"max_gpu_memory_gib": value}))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "engine.max_gpu_memory_gib"


def test_a_cap_over_the_daemons_is_422_through_the_api(client: TestClient) -> None:
    r = client.post("/v1/jobs", json=_spec(engine={"max_gpu_memory_gib": 25}))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "engine.max_gpu_memory_gib"
    assert r.json()["error"]["code"] == "gpu_memory_above_limit"
