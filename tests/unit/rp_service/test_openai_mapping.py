"""The OpenAI API's translation: requests to JobSpecs, jobs/events/checkpoints to OpenAI
objects, validation errors to 400s, its store table on a database from before it existed,
and the results CSV."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from rp_service.api.openai._route import bad_request
from rp_service.errors import BadRequest
from rp_service.jobs.openai_store import OpenAIJobRecord, OpenAIStore
from rp_service.jobs.results import ResultFiles, is_result_file_id, result_file_id
from rp_service.jobs.store import CheckpointRecord, EventRecord, JobRecord, Store
from rp_service.openai.mapping import (
    BASE_LEARNING_RATE,
    STATUSES,
    checkpoint_id,
    event_id,
    openai_checkpoint,
    openai_event,
    openai_job,
    parse_cursor,
    plan_job,
)
from rp_service.openai.schemas import FineTuningJobCreate
from rp_service.schemas import JobSpec, JobStatus, ModelSection

FOLDER = ModelSection(path="/models/tiny")


def _plan(body: dict[str, Any], **kwargs: Any) -> Any:
    args: dict[str, Any] = {
        "model": FOLDER,
        "max_positions": 4096,
        "train_examples": 21,
        "gpu_count": 0,
        "seed": 7,
    }
    args.update(kwargs)
    return plan_job(FineTuningJobCreate(model="tiny", training_file="file-a", **body), **args)


def test_auto_hyperparameters_resolve_to_the_documented_values() -> None:
    plan = _plan({})
    train, data = plan.spec.train, plan.spec.data
    assert (train.epochs, train.steps, train.batch_size) == (3.0, None, 8)
    assert train.lr == BASE_LEARNING_RATE["pretrained"]
    assert (train.schedule, train.warmup_steps, train.seed) == ("linear", 0, 7)
    assert train.checkpoint_interval == 3  # ceil(21 / 8): one checkpoint per epoch
    assert train.keep_checkpoints == 3 and train.eval_interval == 0
    assert (data.train, data.valid, data.packing, data.seq_len) == ("file-a", None, False, 1024)
    assert plan.spec.model.path == "/models/tiny" and plan.spec.model.dtype == "float32"
    assert plan.spec.engine.gpus == 0
    assert plan.fields["hyperparameters"] == {
        "n_epochs": 3,
        "batch_size": 8,
        "learning_rate_multiplier": 1.0,
    }
    JobSpec.model_validate(plan.spec.model_dump(mode="json"))  # what the orchestrator re-reads


def test_explicit_hyperparameters_and_the_method_form_map_the_same() -> None:
    hp = {"n_epochs": 2, "batch_size": 5, "learning_rate_multiplier": 0.5}
    top = _plan({"hyperparameters": hp, "validation_file": "file-v", "suffix": "s"})
    nested = _plan(
        {
            "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
            "validation_file": "file-v",
            "suffix": "s",
        }
    )
    for plan in (top, nested):
        train = plan.spec.train
        assert (train.epochs, train.batch_size) == (2.0, 5)
        assert train.lr == pytest.approx(0.5 * BASE_LEARNING_RATE["pretrained"])
        assert train.eval_interval == train.checkpoint_interval == 5  # ceil(21 / 5)
        assert plan.spec.data.valid == "file-v" and plan.spec.name == "s"
    assert top.spec == nested.spec


def test_auto_batch_size_never_exceeds_the_examples_and_presets_use_their_rate() -> None:
    plan = _plan({}, model=ModelSection(preset="qwen3"), train_examples=3, max_positions=128)
    assert plan.spec.train.batch_size == 3 and plan.spec.train.checkpoint_interval == 1
    assert plan.spec.train.lr == BASE_LEARNING_RATE["preset"]
    assert plan.spec.data.seq_len == 128
    gpu = _plan({}, gpu_count=2)
    assert gpu.spec.model.dtype == "bfloat16" and gpu.spec.engine.gpus == 1


_RL = {
    "grader": {
        "type": "string_check",
        "name": "exact",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}}",
        "operation": "eq",
    }
}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"integrations": [{"type": "wandb", "wandb": {"project": "p"}}]}, "integrations"),
        ({"method": {"type": "dpo", "supervised": {}}}, "method.supervised"),
        ({"method": {"type": "supervised", "dpo": {}}}, "method.dpo"),
        ({"method": {"type": "supervised", "reinforcement": _RL}}, "method.reinforcement"),
        (
            {"method": {"type": "reinforcement", "reinforcement": {**_RL, "response_format": {}}}},
            "method.reinforcement.response_format",
        ),
        (
            {
                "method": {
                    "type": "reinforcement",
                    "reinforcement": {**_RL, "hyperparameters": {"reasoning_effort": "high"}},
                }
            },
            "method.reinforcement.hyperparameters.reasoning_effort",
        ),
        (
            {
                "hyperparameters": {"n_epochs": 1},
                "method": {"type": "supervised", "supervised": {"hyperparameters": {}}},
            },
            "hyperparameters",
        ),
    ],
)
def test_unsupported_options_are_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        _plan(body)
    assert info.value.status_code == 400 and info.value.param == param
    assert "not supported" in info.value.message or "once" in info.value.message


def test_supervised_lora_maps_to_a_lora_job_at_the_lora_rate() -> None:
    lora = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "merge": True}
    method = {
        "type": "supervised",
        "supervised": {"hyperparameters": {"learning_rate_multiplier": 2}, "lora": lora},
    }
    spec = _plan({"method": method}).spec
    assert spec.train.method == "lora"
    assert spec.lora is not None
    assert (spec.lora.rank, spec.lora.alpha, spec.lora.target_modules, spec.lora.merge) == (
        8,
        16.0,
        ["q_proj", "v_proj"],
        True,
    )
    assert spec.train.lr == pytest.approx(2 * BASE_LEARNING_RATE["lora"])
    full = _plan({"method": {"type": "supervised"}}).spec
    assert (full.train.method, full.lora) == ("full", None)


def _validation_error(body: dict[str, Any]) -> RequestValidationError:
    with pytest.raises(ValidationError) as info:
        FineTuningJobCreate.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    return RequestValidationError(errors)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": "m", "training_file": "f", "foo": 1}, "foo", "unsupported_parameter"),
        ({"model": "m"}, "training_file", "missing_required_parameter"),
        (
            {"model": "m", "training_file": "f", "hyperparameters": {"n_epochs": 0}},
            "hyperparameters.n_epochs",
            "invalid_value",
        ),
        (
            {"model": "m", "training_file": "f", "hyperparameters": {"warmup": 3}},
            "hyperparameters.warmup",
            "unsupported_parameter",
        ),
        (
            {
                "model": "m",
                "training_file": "f",
                "method": {"type": "supervised", "supervised": {"lora": {"rank": 0}}},
            },
            "method.supervised.lora.rank",
            "invalid_value",
        ),
        (
            {
                "model": "m",
                "training_file": "f",
                "method": {
                    "type": "supervised",
                    "supervised": {"lora": {"target_modules": ["fc"]}},
                },
            },
            "method.supervised.lora.target_modules",
            "invalid_value",
        ),
        (
            {"model": "m", "training_file": "f", "metadata": {f"k{i}": "v" for i in range(17)}},
            "metadata",
            "invalid_value",
        ),
        (
            {
                "model": "m",
                "training_file": "f",
                "method": {
                    "type": "reinforcement",
                    "reinforcement": {**_RL, "grpo": {"num_iterations": 0}},
                },
            },
            "method.reinforcement.grpo.num_iterations",
            "invalid_value",
        ),
    ],
)
def test_validation_errors_become_400s_naming_the_parameter(
    body: dict[str, Any], param: str, code: str
) -> None:
    error = bad_request(_validation_error(body))
    assert error.status_code == 400 and error.param == param and error.code == code
    assert error.message.startswith(f"unsupported parameter {param!r}") or param in error.message


def _job(status: str = "running", **kwargs: Any) -> JobRecord:
    spec = JobSpec.model_validate(
        {
            "model": {"preset": "llama"},
            "data": {"train": "file-t", "valid": "file-v"},
            "train": {"epochs": 2, "batch_size": 4, "seed": 11},
        }
    ).model_dump(mode="json")
    return JobRecord(id="job-abc", status=status, created_at=100, spec=spec, **kwargs)


@pytest.mark.parametrize("status", JobStatus.__args__)  # type: ignore[attr-defined]
def test_every_native_status_has_an_openai_status(status: str) -> None:
    job = openai_job(_job(status, finished_at=200, trained_tokens=50), None)
    assert job.status == STATUSES[status]
    terminal = status in ("succeeded", "failed", "cancelled")
    assert job.finished_at == (200 if terminal else None)
    assert job.trained_tokens == (50 if terminal else None)
    assert job.result_files == (["file-results-abc"] if status == "succeeded" else [])


def test_a_native_job_reads_as_an_openai_job() -> None:
    job = openai_job(_job("running", progress={"eta_seconds": 30.0}), None, now=1000.0).model_dump()
    assert job["model"] == "llama" and job["training_file"] == "file-t"
    assert job["validation_file"] == "file-v" and job["seed"] == 11
    assert job["hyperparameters"] == {
        "n_epochs": 2,
        "batch_size": 4,
        "learning_rate_multiplier": None,
    }
    assert job["estimated_finish"] == 1030 and job["object"] == "fine_tuning.job"
    failed = openai_job(_job("failed", error={"code": "oom", "message": "m", "param": None}), None)
    assert failed.error is not None and failed.error.code == "oom"


def test_an_openai_job_shows_the_fields_it_was_created_with() -> None:
    fields = {
        "model": "tiny",
        "training_file": "file-t",
        "validation_file": None,
        "suffix": "mine",
        "metadata": {"team": "a"},
        "hyperparameters": {"n_epochs": 3, "batch_size": 8, "learning_rate_multiplier": 1.0},
    }
    extra = OpenAIJobRecord(job_id="job-abc", body_sha256="x", created_at=100, fields=fields)
    job = openai_job(_job("succeeded", output_model_path="/out"), extra)
    assert (job.model, job.suffix, job.metadata) == ("tiny", "mine", {"team": "a"})
    # The model id chat.completions takes; the folder stays on the native job.
    assert job.fine_tuned_model == f"ft:llama:{job.id}"
    assert job.method.supervised.hyperparameters.n_epochs == 3


def test_cursors_round_trip_and_refuse_another_jobs_ids() -> None:
    assert parse_cursor(event_id("job-abc", 17), prefix="ftevent", job_id="job-abc") == 17
    assert parse_cursor(checkpoint_id("job-abc", 5), prefix="ftckpt", job_id="job-abc") == 5
    for bad in (event_id("job-other", 3), "ftevent-abc-x", "17", checkpoint_id("job-abc", 2)):
        with pytest.raises(BadRequest):
            parse_cursor(bad, prefix="ftevent", job_id="job-abc")


def test_events_and_checkpoints_in_openai_shapes() -> None:
    event = openai_event(
        EventRecord(
            id=4,
            job_id="job-abc",
            created_at=5,
            level="warning",
            type="metrics",
            message="m",
            data={"step": 2},
        )
    )
    assert (event.id, event.level, event.type) == ("ftevent-abc-4", "warn", "metrics")
    checkpoint = openai_checkpoint(
        CheckpointRecord(
            job_id="job-abc",
            step=6,
            created_at=9,
            path="/c",
            size_bytes=1,
            metrics={"train_loss": 0.5, "valid_loss": None},
        )
    )
    assert checkpoint.id == "ftckpt-abc-6" and checkpoint.step_number == 6
    assert checkpoint.metrics.model_dump() == {
        "step": 6,
        "train_loss": 0.5,
        "valid_loss": None,
        "full_valid_loss": None,
    }


def test_the_openai_table_is_added_to_a_database_from_before(tmp_path: Path) -> None:
    path = tmp_path / "rp.sqlite3"
    old = Store(path)
    old.open()
    old.create_job(_job("queued"))
    old.close()
    assert "openai_jobs" not in {
        r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master")
    }
    store = Store(path)
    store.open()
    openai = OpenAIStore(store)
    fields = {"model": "m"}
    openai.add_job(OpenAIJobRecord(job_id="job-abc", body_sha256="h", created_at=50, fields=fields))
    assert openai.get_jobs(["job-abc", "job-none"])["job-abc"].fields == fields
    assert openai.find_retried_job("h", since=50) is not None
    assert openai.find_retried_job("h", since=51) is None
    assert openai.find_retried_job("other", since=0) is None
    for _ in range(4):
        store.append_event("job-abc", type_="log", level="info", message="x", data={})
    assert [e.id for e in openai.list_events_desc("job-abc", before=None, limit=3)] == [5, 4, 3]
    assert [e.id for e in openai.list_events_desc("job-abc", before=3, limit=9)] == [2, 1]
    assert store.get_job("job-abc") is not None  # the native side is untouched
    store.close()


def test_results_csv_has_one_row_per_metrics_event(tmp_path: Path) -> None:
    store = Store(tmp_path / "rp.sqlite3")
    store.open()
    store.create_job(_job("queued"))
    rows = [{"step": 1, "train_loss": 2.5}, {"step": 2, "train_loss": 2.0, "valid_loss": 2.25}]
    for data in rows:
        store.append_event("job-abc", type_="metrics", level="info", message="m", data=data)
    results = ResultFiles(store)
    assert results.csv_bytes("job-abc") == b"step,train_loss,valid_loss\n1,2.5,\n2,2.0,2.25\n"
    file_id = result_file_id("job-abc")
    assert is_result_file_id(file_id) and file_id == "file-results-abc"
    with pytest.raises(Exception, match="no file"):
        results.record(file_id)  # not succeeded yet
    store.transition("job-abc", ["queued"], "succeeded")
    record, content = results.record(file_id)
    assert record.bytes == len(content) and record.line_count == 2 and record.format == "csv"
    store.close()


def test_a_deleted_job_leaves_the_openai_listing(tmp_path: Path) -> None:
    store = Store(tmp_path / "rp.sqlite3")
    store.open()
    openai = OpenAIStore(store)
    store.create_job(_job("succeeded"))
    assert [j.id for j in openai.list_jobs_by_metadata(None, after=None, limit=10)[0]] == [
        "job-abc"
    ]
    assert store.mark_deleted("job-abc") is not None
    assert openai.list_jobs_by_metadata(None, after=None, limit=10) == ([], False)
    store.close()


def test_dpo_maps_onto_a_dpo_job_and_reads_back_as_dpo() -> None:
    from rp_service.openai.mapping import DPO_LEARNING_RATE

    method = {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.25, "batch_size": 2}}}
    plan = _plan({"method": method})
    spec = plan.spec
    assert spec.train.objective == "dpo" and spec.train.method == "full"
    assert spec.dpo is not None and (spec.dpo.beta, spec.dpo.label_smoothing) == (0.25, 0.0)
    assert spec.train.batch_size == 2 and spec.train.lr == DPO_LEARNING_RATE["pretrained"]
    auto = _plan({"method": {"type": "dpo"}}).spec
    assert auto.dpo is not None and auto.dpo.beta == 0.1
    lora = _plan({"method": {"type": "dpo", "dpo": {"lora": {"rank": 4}}}}).spec
    assert lora.train.method == "lora" and lora.train.lr == DPO_LEARNING_RATE["lora"]

    record = JobRecord(
        id="job-abc", status="running", created_at=100, spec=spec.model_dump(mode="json")
    )
    extra = OpenAIJobRecord(job_id="job-abc", body_sha256="x", created_at=100, fields=plan.fields)
    out = openai_job(record, extra).model_dump()
    assert out["method"]["type"] == "dpo" and "supervised" not in out["method"]
    assert out["method"]["dpo"]["hyperparameters"] == {
        "n_epochs": 3,
        "batch_size": 2,
        "learning_rate_multiplier": 1.0,
        "beta": 0.25,
    }
    with pytest.raises(ValidationError):
        FineTuningJobCreate(
            model="m",
            training_file="f",
            method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0}}},
        )


def test_reinforcement_maps_to_a_grpo_job_with_openais_hyperparameters() -> None:
    hp = {
        "n_epochs": 2,
        "batch_size": 4,
        "learning_rate_multiplier": 3,
        "compute_multiplier": 0.5,
        "eval_interval": 5,
        "eval_samples": 10,
    }
    method = {
        "type": "reinforcement",
        "reinforcement": {**_RL, "hyperparameters": hp, "lora": {"rank": 4}},
    }
    plan = _plan({"method": method, "validation_file": "file-v"})
    spec = plan.spec
    assert spec.train.objective == "grpo" and spec.train.method == "lora"
    assert (spec.train.epochs, spec.train.batch_size, spec.train.eval_interval) == (2.0, 4, 5)
    assert spec.train.lr == pytest.approx(BASE_LEARNING_RATE["lora"] * 3)
    assert spec.grpo is not None and (spec.grpo.group_size, spec.grpo.eval_prompts) == (4, 10)
    assert spec.grader is not None and spec.grader.type == "string_check"
    assert plan.fields["hyperparameters"]["compute_multiplier"] == 0.5
    assert plan.fields["hyperparameters"]["eval_samples"] == 10
    # the daemon's extension: the grpo section's own fields win over the mapped ones
    assert spec.grpo.num_iterations == 1  # OpenAI has no name for it: TRL's default
    method["reinforcement"]["grpo"] = {
        "group_size": 3,
        "max_completion_tokens": 9,
        "num_iterations": 2,
    }
    del hp["eval_interval"]
    spec = _plan({"method": method}).spec
    assert spec.grpo is not None and (spec.grpo.group_size, spec.grpo.max_completion_tokens) == (
        3,
        9,
    )
    assert spec.grpo.num_iterations == 2

    assert spec.train.eval_interval == 0  # auto without a validation file: no evaluation
