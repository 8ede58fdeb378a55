"""LoRA in the client: parameter counts in `rp status` and the SDK, `rp demo --lora`'s body."""

from __future__ import annotations

import json

import httpx
import pytest
from rp_client import Job
from rp_client.cli import app
from rp_client.cli.demo import _demo_body
from typer.testing import CliRunner

from ._fakes import event_obj, job_obj, sse_body

LORA_SPEC = {"train": {"steps": 3, "method": "lora"}, "lora": {"rank": 8}}


@pytest.fixture
def rp(make_client):
    def invoke(handler, *args):
        client, _ = make_client(handler, max_retries=0)
        return CliRunner().invoke(app, list(args), obj={"client": client})

    return invoke


def test_status_shows_trainable_and_total_parameters(rp):
    counts = {"trainable": 1_234, "total": 98_765}
    job = job_obj(status="running", spec=LORA_SPEC, parameters=counts)
    result = rp(lambda r: httpx.Response(200, json=job), "status", "job-1")
    assert result.exit_code == 0, result.output
    assert "1,234 trainable of 98,765 (1.25%, lora)" in result.stdout
    result = rp(lambda r: httpx.Response(200, json=job), "status", "job-1", "--json")
    assert json.loads(result.stdout)["parameters"] == {**counts, "base_host_bytes": None}


def test_status_shows_the_base_host_bytes_when_reported(rp):
    counts = {"trainable": 1_234, "total": 98_765, "base_host_bytes": 3 * 2**20}
    spec = {**LORA_SPEC, "model": {"preset": "qwen3", "quantization": "nf4"}}
    job = job_obj(status="running", spec=spec, parameters=counts)
    result = rp(lambda r: httpx.Response(200, json=job), "status", "job-1")
    assert result.exit_code == 0, result.output
    assert "(1.25%, lora); base 3.0 MiB on the host, nf4" in result.stdout
    result = rp(lambda r: httpx.Response(200, json=job), "status", "job-1", "--json")
    assert json.loads(result.stdout)["parameters"] == counts


def test_status_without_counts_yet_omits_the_line(rp):
    result = rp(lambda r: httpx.Response(200, json=job_obj()), "status", "job-1")
    assert result.exit_code == 0 and "parameters" not in result.stdout


def test_sdk_job_parses_the_counts() -> None:
    job = Job.model_validate(job_obj(parameters={"trainable": 5, "total": 20}))
    assert job.parameters is not None and job.parameters.trainable_fraction == 0.25
    assert Job.model_validate(job_obj()).parameters is None


def test_lora_job_outcome_names_the_adapter(rp):
    done = job_obj(status="succeeded", spec=LORA_SPEC, output_model_path="/d/output")

    def handler(request):
        if request.url.path.endswith("/events"):
            body = b'retry: 3000\n\nevent: done\ndata: {"status": "succeeded"}\n\n'
            return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=done)

    result = rp(handler, "follow", "job-1")
    assert result.exit_code == 0, result.output
    assert "job-1 succeeded; adapter: /d/output" in result.stdout


def test_demo_body_as_lora_with_fewer_steps() -> None:
    demo = {
        "name": "demo",
        "train": {"steps": 200, "lr": 0.003, "eval_interval": 25, "checkpoint_interval": 50},
        "lora": None,
    }
    body = _demo_body(demo, lora=True, steps=20)
    assert body["train"]["method"] == "lora" and body["train"]["steps"] == 20
    assert body["train"]["eval_interval"] == 20 and body["train"]["checkpoint_interval"] == 20
    assert body["lora"]["merge"] is True and body["lora"]["rank"] > 0
    assert demo["train"]["steps"] == 200  # the fetched spec is not changed
    plain = _demo_body(demo, lora=False, steps=None)
    assert plain == demo


def test_demo_body_as_dpo_on_generated_pairs() -> None:
    demo = {"name": "demo", "data": {"train": "synthetic", "format": "text"}, "train": {"steps": 9}}
    body = _demo_body(demo, lora=False, steps=None, dpo=True)
    assert body["train"]["objective"] == "dpo" and body["dpo"] == {"beta": 0.1}
    assert body["data"] == {"train": "synthetic", "format": "preference"}
    assert demo["data"]["format"] == "text"  # the fetched spec is not changed
    both = _demo_body(demo, lora=True, steps=3, dpo=True)
    assert both["train"]["method"] == "lora" and both["train"]["objective"] == "dpo"


def test_the_progress_bar_shows_dpo_accuracy_and_margin() -> None:
    from rp_client.cli.progress import _loss_text

    assert _loss_text({"train_loss": 0.5}) == "0.5000"
    dpo = {"train_loss": 0.6931, "rewards/accuracies": 0.75, "rewards/margins": 0.0123}
    assert _loss_text(dpo) == "0.6931 acc 0.75 margin +0.012"


def test_follow_shows_a_dpo_jobs_accuracy_and_margin(rp) -> None:
    """The bar of `rp follow` on a DPO job: loss, reward accuracy and margin of the last step."""
    dpo = {"rewards/accuracies": 0.75, "rewards/margins": 0.0123}
    events = [
        event_obj(1, step=1, total_steps=2, train_loss=0.6931, **dpo),
        event_obj(2, step=2, total_steps=2, train_loss=0.6, **{**dpo, "rewards/margins": 0.5}),
        event_obj(3, type="status", status="succeeded", previous="running"),
    ]

    metrics = {"train_loss": 0.7, **dpo}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            body = sse_body(events, done="succeeded")
            return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=job_obj(status="running", metrics=metrics))

    result = rp(handler, "follow", "job-1")
    assert "loss 0.6000 acc 0.75 margin +0.500" in result.stderr
    # joined late: the bar starts from the job's latest metrics, DPO's included
    del events[:2]
    result = rp(handler, "follow", "job-1")
    assert "loss 0.7000 acc 0.75 margin +0.012" in result.stderr


def test_demo_body_as_qlora_and_nf4_needs_lora() -> None:
    demo = {"name": "demo", "model": {"preset": "qwen3", "config": {}}, "train": {"steps": 9}}
    body = _demo_body(demo, lora=True, steps=None, quantization="nf4")
    assert body["model"] == {"preset": "qwen3", "config": {}, "quantization": "nf4"}
    assert body["train"]["method"] == "lora"
    assert "quantization" not in demo["model"]  # the fetched spec is not changed
    assert "quantization" not in _demo_body(demo, lora=True, steps=None)["model"]
    result = CliRunner().invoke(app, ["demo", "--quantization", "nf4"])
    assert result.exit_code == 2 and "add --lora" in result.output
    result = CliRunner().invoke(app, ["demo", "--lora", "--quantization", "int8"])
    assert result.exit_code == 2 and "none or nf4" in result.output


def test_demo_body_as_grpo_on_generated_prompts() -> None:
    demo = {"name": "demo", "data": {"train": "synthetic", "format": "text"}, "train": {"steps": 9}}
    body = _demo_body(demo, lora=False, steps=None, grpo=True)
    assert body["train"]["objective"] == "grpo" and body["train"]["steps"] == 30
    assert body["data"] == {"train": "synthetic", "format": "auto"}
    assert body["grader"]["type"] == "string_check" and body["grpo"]["group_size"] == 8
    assert demo["data"]["format"] == "text" and "grader" not in demo  # not changed
    short = _demo_body(demo, lora=True, steps=4, grpo=True)
    assert short["train"]["steps"] == 4 and short["train"]["method"] == "lora"
    assert short["train"]["eval_interval"] == 4  # an evaluation inside a short run


def test_the_progress_bar_shows_a_grpo_reward() -> None:
    from rp_client.cli.progress import _loss_text

    step = {"train_loss": -0.01, "reward_mean": 0.5}
    assert _loss_text(step) == "-0.0100 reward 0.500"
    assert (
        _loss_text({**step, "valid_reward_mean": 0.9375}) == "-0.0100 reward 0.500 held-out 0.938"
    )
