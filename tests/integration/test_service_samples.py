"""Samples during training with the real worker: a demo-sized job with train.sample_prompts
writes one `sample` event at each evaluation step, exactly those steps, and a pause and a
resume keep the earlier ones listed while the resumed attempt adds the rest."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.integration.service_daemon import Daemon

PROMPTS = ["a story about anna.", "counting: one"]
EVERY, STEPS, MAX_TOKENS = 4, 24, 6


def events(c: httpx.Client, job_id: str, type_: str) -> list[dict[str, Any]]:
    page = c.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    return [e for e in page if e["type"] == type_]


def test_sample_events_come_at_the_evaluation_steps_and_survive_a_pause(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_WORKER_MODULE="rp_service.worker")
    with daemon.client() as c:
        demo = c.get("/v1/demo").json()
        demo["model"]["config"]["max_position_embeddings"] = 136  # prompt + 6 < 136 always
        demo["train"].update(
            steps=STEPS,
            eval_interval=EVERY,
            checkpoint_interval=0,
            sample_prompts=PROMPTS,
            sample_max_tokens=MAX_TOKENS,
        )
        job = c.post("/v1/jobs", json=demo).json()
        deadline = time.monotonic() + 300
        while not events(c, job["id"], "sample"):  # the first evaluation's samples
            assert time.monotonic() < deadline, c.get(f"/v1/jobs/{job['id']}/logs").text
            time.sleep(0.1)
        assert c.post(f"/v1/jobs/{job['id']}/pause").status_code == 200
        paused = daemon.wait_for(job["id"], {"paused", "failed"}, timeout_s=300)
        assert paused["status"] == "paused", c.get(f"/v1/jobs/{job['id']}/logs").text
        at_pause = events(c, job["id"], "sample")
        assert [e["data"]["step"] for e in at_pause] == list(
            range(EVERY, paused["progress"]["step"] + 1, EVERY)
        )
        assert paused["progress"]["step"] < STEPS

        assert c.post(f"/v1/jobs/{job['id']}/resume").status_code == 200
        done = daemon.wait_for(job["id"], {"succeeded", "failed"}, timeout_s=300)
        assert done["status"] == "succeeded", c.get(f"/v1/jobs/{job['id']}/logs").text
        samples = events(c, job["id"], "sample")
        metrics = events(c, job["id"], "metrics")

    evaluated = [e["data"]["step"] for e in metrics if e["data"]["valid_loss"] is not None]
    assert evaluated == list(range(EVERY, STEPS + 1, EVERY))
    assert [e["data"]["step"] for e in samples] == evaluated  # one each, at exactly those
    assert samples[: len(at_pause)] == at_pause  # the earlier ones, unchanged
    assert {e["data"]["attempt"] for e in at_pause} == {1}
    assert {e["data"]["attempt"] for e in samples[len(at_pause) :]} == {2}
    for event in samples:
        data = event["data"]
        assert [s["prompt"] for s in data["samples"]] == PROMPTS
        for s in data["samples"]:
            assert isinstance(s["completion"], str)
            assert 0 <= s["tokens"] <= MAX_TOKENS and s["finish_reason"] in ("stop", "length")
            assert s["tokens"] == MAX_TOKENS or s["finish_reason"] == "stop"
        assert data["tokens"] == sum(s["tokens"] for s in data["samples"])
    # a demo trained this long writes letters, not nothing, by the last step
    assert any(s["completion"].strip() for s in samples[-1]["data"]["samples"])


def test_a_qlora_dpo_job_samples_through_its_packed_base(tmp_path) -> None:
    from tests.integration.test_worker import make_job, metrics, run

    config = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 80,
    }
    job = make_job(
        tmp_path / "qlora-dpo",
        {
            "model.config": config,
            "model.quantization": "nf4",
            "train.method": "lora",
            "train.objective": "dpo",
            "train.steps": 5,
            "train.batch_size": 2,
            "train.eval_interval": 2,
            "train.checkpoint_interval": 0,
            "train.sample_prompts": ["hello", "what is two and two?"],
            "train.sample_max_tokens": 5,
            "data.format": "preference",
            "data.seq_len": 48,
        },
        valid_path="synthetic",
    )
    code, events = run(job)
    assert code == 0, (job / "worker.log").read_text()[-3000:]
    evaluated = [m["step"] for m in metrics(events) if m["valid_loss"] is not None]
    samples = [e["data"] for e in events if e["type"] == "sample"]
    assert evaluated == [2, 4, 5] and [s["step"] for s in samples] == evaluated
    for data in samples:
        assert [s["prompt"] for s in data["samples"]] == ["hello", "what is two and two?"]
        assert all(0 <= s["tokens"] <= 5 for s in data["samples"])
