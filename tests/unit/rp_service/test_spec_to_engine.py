"""spec_to_engine is the one map from a JobSpec to EngineOptions, called once per job: the
daemon's submission check maps once, the job's record keeps the options, every launch hands
them to the worker in spec.json, and the worker builds them back without mapping again."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path
from typing import Any

import pytest

import rp_service.spec_to_engine as mapping
from engine.options import AdamOptions, EngineOptions, OptionError
from rp_service.errors import JobFailure
from rp_service.schemas import JobSpec
from rp_service.spec_to_engine import spec_to_engine

BODY: dict[str, Any] = {
    "model": {"preset": "qwen3", "config": {"hidden_size": 64, "head_dim": 16}},
    "data": {"train": "synthetic", "seq_len": 64},
    "train": {"steps": 2, "batch_size": 4, "lr": 3e-4, "betas": [0.8, 0.95]},
    "engine": {"gpus": 0, "num_microbatch": 2},
}


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[EngineOptions]:
    """Count spec_to_engine's calls, wherever they look it up from."""
    made: list[EngineOptions] = []
    real = mapping.spec_to_engine

    def counted(spec: JobSpec) -> EngineOptions:
        made.append(real(spec))
        return made[-1]

    monkeypatch.setattr(mapping, "spec_to_engine", counted)
    import rp_service.jobs.resolve as resolve

    monkeypatch.setattr(resolve, "spec_to_engine", counted)
    return made


def test_the_spec_maps_lr_quantization_and_micro_batches() -> None:
    options = spec_to_engine(JobSpec.model_validate(BODY))
    assert options.adam == AdamOptions(lr=3e-4, betas=(0.8, 0.95), weight_decay=0.0)
    assert (options.num_microbatch, options.batch_size) == (2, 4)
    assert options.quantization == "none"


def test_a_refusal_names_the_jobspec_field() -> None:
    body = {**BODY, "model": {**BODY["model"], "quantization": "nf4"}}
    with pytest.raises(JobFailure) as refused:
        spec_to_engine(JobSpec.model_validate(body))
    assert (refused.value.code, refused.value.param) == ("nf4_needs_lora", "model.quantization")
    assert "set train.method to 'lora'" in refused.value.message


def test_compact_with_a_float32_model_is_a_422_naming_the_field(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from rp_service.app import create_app
    from rp_service.settings import Settings

    body = {**BODY, "engine": {**BODY["engine"], "optim_memory": "compact"}}
    settings = Settings(data_dir=tmp_path / "data", gpus="none", auth="none")
    with TestClient(create_app(settings), base_url="http://127.0.0.1:8321") as client:
        r = client.post("/v1/jobs", json=body)
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("engine.optim_memory", "compact_needs_bfloat16")
        assert "set model.dtype to bfloat16 (got float32)" in err["message"]
        assert client.get("/v1/jobs").json()["data"] == []


def test_the_options_survive_json_with_their_names() -> None:
    body = {**BODY, "train": {**BODY["train"], "method": "lora"}, "lora": {"rank": 4}}
    options = spec_to_engine(JobSpec.model_validate(body))
    assert options.lora is not None
    back = EngineOptions.from_json(json.loads(json.dumps(options.to_json())))
    assert back == options
    assert dict(back.names) == dict(options.names) and back.names["adam.lr"] == "train.lr"
    # a rule still holds for a value that did not come from to_json
    bad = {**options.to_json(), "num_microbatch": 8}
    with pytest.raises(OptionError) as refused:
        EngineOptions.from_json(bad)
    assert refused.value.field == "engine.num_microbatch"


def test_the_worker_maps_nothing_and_hands_the_stored_options_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rp_service.worker import main, training
    from rp_service.worker.training import Outcome

    stored = spec_to_engine(JobSpec.model_validate(BODY))
    made = _counting(monkeypatch)
    given: list[EngineOptions] = []

    def run_job(spec: JobSpec, options: EngineOptions, *args: Any) -> Outcome:
        given.append(options)
        return Outcome(status="paused", step=0)

    monkeypatch.setattr(training, "run_job", run_job)
    resolved = {
        "train_path": "synthetic",
        "output_dir": str(tmp_path / "out"),
        "checkpoint_dir": str(tmp_path / "ckpt"),
    }
    payload = {"spec": BODY, "options": stored.to_json(), "resolved": resolved}
    (tmp_path / "spec.json").write_text(json.dumps(payload))
    events = io.StringIO()
    code = main.run(tmp_path, main.EventWriter(events), threading.Event())
    assert code == main.EXIT_PAUSED, events.getvalue()
    assert made == [] and given == [stored]
    # a spec.json without options (not the daemon's) is refused, not mapped
    del payload["options"]
    (tmp_path / "spec.json").write_text(json.dumps(payload))
    code = main.run(tmp_path, main.EventWriter(events), threading.Event())
    assert code == main.EXIT_FAILED and made == []
    assert '"code": "invalid_job_dir"' in events.getvalue().splitlines()[-1]


def _launch_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, legacy: bool
) -> tuple[list[EngineOptions], dict[str, Any]]:
    """Submit BODY to an orchestrator (or store it as a daemon before the options column
    did), let it launch a worker that cannot start, and return the mappings made and the
    options its spec.json handed over."""
    import asyncio

    from rp_service.jobs.events import EventHub
    from rp_service.jobs.orchestrator import Orchestrator
    from rp_service.jobs.store import JobRecord, Store
    from rp_service.settings import Settings

    made = _counting(monkeypatch)
    settings = Settings(
        data_dir=tmp_path,
        gpus="none",
        host_memory_budget="64GiB",
        worker_module="rp_no_such_worker_module",
    )
    store = Store(settings.db_path)
    store.open()
    orchestrator = Orchestrator(settings, store, EventHub())

    async def scenario() -> str:
        if legacy:
            record = JobRecord(id="job-old", status="queued", created_at=0, spec=BODY)
            job_id = store.create_job(record)[0].id
        else:
            job_id = (await orchestrator.submit(JobSpec.model_validate(BODY)))[0].id
        await orchestrator.start(gpu_count=0)
        spec_json = settings.jobs_dir / job_id / "spec.json"
        for _ in range(500):
            if spec_json.exists():
                break
            await asyncio.sleep(0.01)
        await orchestrator.stop()
        return json.loads(spec_json.read_text())["options"]

    options = asyncio.run(scenario())
    store.close()
    return made, options


def test_submission_maps_once_and_each_launch_hands_those_options_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made, handed = _launch_options(tmp_path, monkeypatch, legacy=False)
    assert len(made) == 1
    assert handed == json.loads(json.dumps(made[0].to_json()))


def test_a_job_queued_before_options_were_stored_is_mapped_at_its_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made, handed = _launch_options(tmp_path, monkeypatch, legacy=True)
    assert len(made) == 1
    assert EngineOptions.from_json(handed) == made[0]


def test_the_workers_host_memory_check_takes_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given the options, the check maps nothing again (spec_to_engine would raise)."""
    from rp_service.worker.engine_setup import check_host_memory

    options = spec_to_engine(JobSpec.model_validate(BODY))

    def refuse(spec: JobSpec) -> EngineOptions:
        raise AssertionError("spec_to_engine called again")

    monkeypatch.setattr(mapping, "spec_to_engine", refuse)
    check_host_memory(JobSpec.model_validate(BODY), options, None)


def test_submission_maps_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The submission check (the rules, then the host-memory plan) maps the spec once."""
    from rp_service.jobs.resolve import SpecResolver
    from rp_service.settings import Settings

    made = _counting(monkeypatch)
    settings = Settings(data_dir=tmp_path / "data", gpus="none", host_memory_budget="64GiB")
    resolver = SpecResolver(settings, store=None)  # type: ignore[arg-type]  # synthetic data
    resolver.check(JobSpec.model_validate(BODY), gpu_count=0)
    assert len(made) == 1
