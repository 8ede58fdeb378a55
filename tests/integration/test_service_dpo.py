"""DPO jobs through the daemon with the real worker: the stored reference of a full
fine-tuning job survives a `kill -9` of the daemon and the resume bit for bit, and the
TRL-named metrics reach the events and the /metrics series."""

from __future__ import annotations

import hashlib
import json
import math
import random

import torch
from prometheus_client.parser import text_string_to_metric_families

from rp_service.demo import demo_spec
from tests.integration.service_daemon import Daemon, spec


def preference_lines(count: int, seed: int = 0) -> bytes:
    """OpenAI-format pairs: continue a count (preferred) or repeat its last number."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        start = rng.randrange(100)
        prompt = " ".join(str(start + i) for i in range(4))
        record = {
            "input": {"messages": [{"role": "user", "content": prompt}]},
            "preferred_output": [{"role": "assistant", "content": f"{start + 4} {start + 5}"}],
            "non_preferred_output": [{"role": "assistant", "content": f"{start + 3} {start + 3}"}],
        }
        lines.append(json.dumps(record).encode() + b"\n")
    return b"".join(lines)


def test_the_full_tuning_reference_survives_a_daemon_kill_and_the_resume(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_WORKER_MODULE="rp_service.worker")
    with daemon.client() as c:
        upload = c.post("/v1/files", files={"file": ("pairs.jsonl", preference_lines(48))})
        assert upload.status_code == 201, upload.text
        assert upload.json()["format"] == "preference"
        body = spec(
            model=demo_spec()["model"],
            data={"train": upload.json()["id"], "seq_len": 64},
            train={
                "steps": 24,
                "batch_size": 4,
                "checkpoint_interval": 4,
                "eval_interval": 0,
                "objective": "dpo",
            },
            dpo={"beta": 0.5},
        )
        r = c.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        job = r.json()
    job_dir = daemon.data_dir / "jobs" / job["id"]
    reference = job_dir / "reference_logps.safetensors"
    daemon.wait_for_step(job["id"], 5, timeout_s=120)
    before = reference.read_bytes()
    inode = reference.stat().st_ino
    daemon.kill()
    daemon.start()
    done = daemon.wait_for(job["id"], {"succeeded", "failed"}, timeout_s=240)
    assert done["status"] == "succeeded", done
    assert done["attempt"] == 2
    # The same file, never rewritten: the resumed attempt loaded it.
    assert reference.stat().st_ino == inode
    assert hashlib.sha256(reference.read_bytes()).digest() == hashlib.sha256(before).digest()
    log = (job_dir / "worker.log").read_text()
    assert log.count("DPO reference: 48 pairs scored") == 1
    assert "DPO reference: loaded" in log

    with daemon.client() as c:
        series = c.get(f"/v1/jobs/{job['id']}/metrics").json()["columns"]
        events = c.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    assert series["step"] == list(range(1, 25))
    assert math.isclose(series["train_loss"][0], math.log(2), abs_tol=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"):
        assert all(isinstance(v, float) for v in series[name]), name
    assert set(series["rewards/accuracies"]) <= {0.0, 0.25, 0.5, 0.75, 1.0}
    first = next(e["data"] for e in events if e["type"] == "metrics")
    assert first["rewards/margins"] == 0.0 and first["rewards/accuracies"] == 0.0
    # it learned the preference: the last steps' rewards favour the chosen completions
    assert sum(series["rewards/margins"][-6:]) > 0


def test_an_sft_job_has_no_preference_columns(make_daemon) -> None:
    daemon: Daemon = make_daemon()  # the fake worker
    with daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(train={"steps": 3})).json()
        daemon.wait_for(job["id"], {"succeeded"})
        columns = c.get(f"/v1/jobs/{job['id']}/metrics").json()["columns"]
    assert "rewards/chosen" not in columns and "train_loss" in columns


def _samples(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text: {metric name: {job_id: value}} of the samples labelled by job."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "job_id" in sample.labels:
                out.setdefault(sample.name, {})[sample.labels["job_id"]] = sample.value
    return out


def test_prometheus_shows_a_running_dpo_jobs_trl_metrics(make_daemon) -> None:
    from rp_service.api.metrics import preference_series_name
    from tests.integration.fake_worker import FAKE_DPO_METRICS

    names = {preference_series_name(k): k for k in FAKE_DPO_METRICS}
    assert set(names) == {
        "rp_job_rewards_chosen",
        "rp_job_rewards_rejected",
        "rp_job_rewards_accuracies",
        "rp_job_rewards_margins",
        "rp_job_logps_chosen",
        "rp_job_logps_rejected",
    }
    daemon: Daemon = make_daemon(FAKE_STEP_S="0.2")  # the fake worker
    with daemon.client() as c:
        sft = c.post("/v1/jobs", json=spec(name="sft", train={"steps": 500})).json()
        daemon.wait_for_step(sft["id"], 2)
        samples = _samples(c.get("/metrics").text)
        assert sft["id"] in samples["rp_job_tokens_per_second"]
        assert not set(names) & set(samples), "an SFT job has no DPO series"
        c.post(f"/v1/jobs/{sft['id']}/cancel")
        daemon.wait_for(sft["id"], {"cancelled"})

        body = spec(
            name="dpo",
            data={"format": "preference"},
            train={"steps": 500, "objective": "dpo"},
        )
        dpo = c.post("/v1/jobs", json=body).json()
        daemon.wait_for_step(dpo["id"], 2)
        samples = _samples(c.get("/metrics").text)
        for name, key in names.items():
            assert samples[name] == {dpo["id"]: FAKE_DPO_METRICS[key]}, name
        job = c.get(f"/v1/jobs/{dpo['id']}").json()
        assert job["metrics"]["rewards/margins"] == FAKE_DPO_METRICS["rewards/margins"]
        c.post(f"/v1/jobs/{dpo['id']}/cancel")
        daemon.wait_for(dpo["id"], {"cancelled"})
        # a job that no longer runs leaves the series
        assert not set(names) & set(_samples(c.get("/metrics").text))


def test_a_lora_dpo_job_scores_its_reference_each_step(tmp_path) -> None:
    from tests.integration.test_worker import make_job, metrics, run

    job = make_job(
        tmp_path / "lora",
        {
            "train.objective": "dpo",
            "train.method": "lora",
            "train.steps": 4,
            "train.batch_size": 3,
            "train.eval_interval": 2,
            "train.checkpoint_interval": 2,
            "train.lr": 0.01,
            "data.format": "preference",
            "data.seq_len": 48,
            "dpo": {"beta": 2.0, "label_smoothing": 0.1},
        },
        valid_path="synthetic",
    )
    code, events = run(job)
    assert code == 0, (job / "worker.log").read_text()[-3000:]
    steps = metrics(events)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    # B = 0 at the start: the policy is the reference; the default step (staleness zero)
    # gives step 2 the weights step 1 updated, so it is the policy's own loss already
    assert math.isclose(steps[0]["train_loss"], math.log(2), abs_tol=1e-6)
    assert not math.isclose(steps[1]["train_loss"], math.log(2), abs_tol=1e-6)
    assert steps[1]["valid_loss"] is not None and steps[3]["valid_loss"] is not None
    assert not (job / "reference_logps.safetensors").exists()  # nothing stored for LoRA
    assert (job / "output" / "adapter_model.safetensors").is_file()


def test_a_resumed_full_job_without_its_reference_fails_rather_than_rescoring(tmp_path) -> None:
    from tests.integration.test_worker import make_job, run

    job = make_job(
        tmp_path / "full",
        {
            "train.objective": "dpo",
            "train.steps": 2,
            "train.batch_size": 2,
            "train.checkpoint_interval": 1,
            "data.format": "preference",
            "data.seq_len": 32,
        },
    )
    code, _ = run(job)
    assert code == 0, (job / "worker.log").read_text()[-3000:]
    (job / "reference_logps.safetensors").unlink()
    code, events = run(job)  # resumes from the step-2 checkpoint
    assert code != 0
    error = next(e for e in events if e["level"] == "error")
    assert error["data"]["code"] == "reference_mismatch"
    assert "reference" in error["message"]


def test_a_paused_dpo_job_resumes_exactly_as_it_would_have_run(tmp_path) -> None:
    import signal

    from tests.integration.test_worker import EXIT_PAUSED, make_job, metrics, run, weights

    overrides = {
        "train.objective": "dpo",
        "train.steps": 8,
        "train.batch_size": 2,
        "train.checkpoint_interval": 4,
        "train.eval_interval": 0,
        "data.format": "preference",
        "data.seq_len": 32,
    }
    straight = make_job(tmp_path / "straight", overrides)
    code, straight_events = run(straight)
    assert code == 0, (straight / "worker.log").read_text()[-3000:]

    job = make_job(tmp_path / "paused", overrides)

    def pause_early(proc, event) -> None:
        if event["type"] == "metrics" and event["data"]["step"] == 2:
            proc.send_signal(signal.SIGUSR1)

    code, first = run(job, pause_early)
    assert code == EXIT_PAUSED, (job / "worker.log").read_text()[-3000:]
    stored = (job / "reference_logps.safetensors").read_bytes()
    code, second = run(job)
    assert code == 0, (job / "worker.log").read_text()[-3000:]
    assert (job / "reference_logps.safetensors").read_bytes() == stored
    # the uninterrupted run's reference: the same numbers, bit for bit
    from rp_service.worker.objectives.reference import read_reference

    ours = read_reference(job / "reference_logps.safetensors")
    theirs = read_reference(straight / "reference_logps.safetensors")
    assert ours is not None and theirs is not None and ours[1] == theirs[1]
    assert ours[0].keys() == theirs[0].keys() == {"train", "valid"}
    assert all(torch.equal(ours[0][k], theirs[0][k]) for k in ours[0])
    resumed = metrics(first) + metrics(second)
    assert [m["step"] for m in resumed] == list(range(1, 9))
    for got, want in zip(resumed, metrics(straight_events), strict=True):
        for key in ("train_loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
            assert got[key] == want[key], (got["step"], key)
    got, want = weights(job), weights(straight)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in got)
