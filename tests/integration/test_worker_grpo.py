"""GRPO jobs in the real worker (`python -m rp_service.worker`, RP_DEVICES=cpu:1) on the
demo's tiny model: it learns a task its grader rewards, its metrics and rollout tables
follow the contract, and a `kill -9` mid-job resumes bit for bit (sampler, prompt order,
the adapters-off reference of the KL term).

The task: answer prompts with text containing the letter "y" (string_check `like`); the
untrained model's greedy answers never do, a dozen steps of GRPO make nearly all of them.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.integration.test_worker import make_job as make_worker_job
from tests.integration.test_worker import metrics, run

GRADER = {
    "type": "string_check",
    "name": "has_y",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "like",
}
CONTRACT = (
    "reward_mean",
    "reward_std",
    "rewards",
    "kl",
    "clip_fraction",
    "completion_tokens_mean",
    "grader_errors",
)


def prompt_lines(count: int, seed: int) -> str:
    rng = random.Random(seed)
    rows = [
        {"messages": [{"role": "user", "content": f"say y {rng.randrange(1000)}"}], "answer": "y"}
        for _ in range(count)
    ]
    return "".join(json.dumps(r) + "\n" for r in rows)


def make_job(job_dir: Path, overrides: dict[str, Any]) -> Path:
    job_dir.mkdir(parents=True)
    (job_dir / "train.jsonl").write_text(prompt_lines(64, seed=0))
    (job_dir / "valid.jsonl").write_text(prompt_lines(16, seed=1))
    spec = {
        "data.format": "auto",
        "data.seq_len": 64,
        "train.objective": "grpo",
        "train.batch_size": 8,
        "train.lr": 0.003,
        "train.warmup_steps": 0,
        "train.eval_interval": 0,
        "train.checkpoint_interval": 0,
        "grpo": {"group_size": 8, "max_completion_tokens": 12, "sample_interval": 4},
        "grader": GRADER,
        **overrides,
    }
    return make_worker_job(
        job_dir,
        spec,
        train_path=str(job_dir / "train.jsonl"),
        valid_path=str(job_dir / "valid.jsonl"),
    )


def test_grpo_raises_the_held_out_reward_to_0_9(tmp_path: Path) -> None:
    job = make_job(tmp_path / "learn", {"train.steps": 12})
    code, events = run(job)
    assert code == 0, (job / "worker.log").read_text()[-3000:]
    steps = metrics(events)
    assert [m["step"] for m in steps] == list(range(1, 13))
    for name in CONTRACT:
        assert name in steps[0], name
    assert steps[0]["kl"] is None  # no KL term: kl_coef 0
    assert steps[0]["rewards"] == {"has_y": steps[0]["reward_mean"]}
    assert all(m["clip_fraction"] == 0.0 and m["grader_errors"] == 0 for m in steps)
    assert 0 < steps[0]["completion_tokens_mean"] <= 12
    # held out: the untrained model's greedy answers, then the trained one's
    assert steps[0]["valid_reward_initial"] < 0.5
    assert steps[-1]["valid_reward_mean"] >= 0.9
    assert steps[-1]["reward_mean"] > steps[0]["reward_mean"]

    tables = [e["data"] for e in events if e["type"] == "sample"]
    assert [t["step"] for t in tables] == [4, 8, 12]
    row = tables[0]["samples"][0]
    assert len(tables[0]["samples"]) == 8
    assert set(row) >= {"prompt", "completion", "tokens", "finish_reason", "reward", "rewards"}
    assert row["reward"] == float("y" in row["completion"])
    assert row["rewards"] == {"has_y": row["reward"]}
    assert (job / "output" / "model.safetensors").is_file()


def test_streamed_rollouts_train_as_the_engines_do(tmp_path: Path) -> None:
    """`grpo.generation: streamed` in the real worker: the layers streamed with a KV cache
    draw the engine path's rollouts token for token, so both jobs train alike, exactly."""
    grpo = {"group_size": 4, "max_completion_tokens": 8, "sample_interval": 0}
    runs = {}
    for generation in ("streamed", "engine"):
        job = make_job(
            tmp_path / generation,
            {"train.steps": 3, "train.method": "lora", "grpo": {**grpo, "generation": generation}},
        )
        code, events = run(job)
        assert code == 0, (job / "worker.log").read_text()[-3000:]
        runs[generation] = metrics(events)
        log = (job / "worker.log").read_text()
        assert f"rollout sampler on cpu: {generation}" in log or generation == "engine", log
    keys = ("train_loss", "reward_mean", "completion_tokens_mean", "valid_reward_initial")
    assert len(runs["streamed"]) == 3 and runs["streamed"][0]["train_loss"] is not None
    for ours, theirs in zip(runs["streamed"], runs["engine"], strict=True):
        assert {k: ours.get(k) for k in keys} == {k: theirs.get(k) for k in keys}


# Two updates per batch of rollouts (num_iterations 2): the checkpoint at step 3 falls
# between the two steps of the batch made at step 3, so the resumed attempt must train step
# 4 on that batch, which it can only read from the checkpoint.
LORA_KL = {
    "train.steps": 6,
    "train.method": "lora",
    "train.checkpoint_interval": 3,
    "train.lr": 0.01,
    "grpo": {
        "group_size": 4,
        "max_completion_tokens": 6,
        "kl_coef": 0.05,
        "sample_interval": 0,
        "num_iterations": 2,
    },
}


@pytest.fixture(scope="module")
def uninterrupted_lora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    job = make_job(tmp_path_factory.mktemp("grpo") / "straight", LORA_KL)
    code, events = run(job)
    assert code == 0, (job / "worker.log").read_text()[-3000:]
    return job, events


def killed_and_resumed(job: Path, *, checkpoint: int) -> list[dict[str, Any]]:
    """The metrics of `job` run with a `kill -9` right after step `checkpoint` + 1 (the
    step after its last checkpoint) and run again to the end: the killed attempt's steps up
    to the checkpoint, then the resumed attempt's."""

    def kill_after_checkpoint(proc: subprocess.Popen[str], event: dict[str, Any]) -> None:
        if event["type"] == "metrics" and event["data"]["step"] == checkpoint + 1:
            proc.send_signal(signal.SIGKILL)

    code, first = run(job, kill_after_checkpoint)
    assert code == -signal.SIGKILL
    code, second = run(job)
    assert code == 0, (job / "worker.log").read_text()[-3000:]
    assert second[0]["data"]["step"] == checkpoint
    return metrics(first)[:checkpoint] + metrics(second)


def test_kill_9_mid_job_resumes_bit_for_bit(uninterrupted_lora, tmp_path: Path) -> None:
    straight, straight_events = uninterrupted_lora
    want = metrics(straight_events)
    assert all(isinstance(m["kl"], float) for m in want)
    assert any(m["kl"] > 0 for m in want[1:])  # the adapters moved away from the base
    # steps 2, 4, 6 reuse the batch of 1, 3, 5: same rewards, no sampling, a ratio off 1
    for made, reused in zip(want[::2], want[1::2], strict=True):
        assert reused["reward_mean"] == made["reward_mean"]
        assert reused["completion_tokens_mean"] == made["completion_tokens_mean"]
        assert reused["rollout_seconds"] == 0.0 < made["rollout_seconds"]
    assert all(m["clip_fraction"] == 0.0 for m in want[::2])
    assert any(m["clip_fraction"] > 0.0 for m in want[1::2])
    job = make_job(tmp_path / "killed", LORA_KL)
    got = killed_and_resumed(job, checkpoint=3)
    assert [m["step"] for m in got] == list(range(1, 7))
    for a, b in zip(got, want, strict=True):
        for key in ("train_loss", "reward_mean", "kl", "clip_fraction", "completion_tokens_mean"):
            assert a[key] == b[key], (a["step"], key)
    ours = load_file(str(job / "output" / "adapter_model.safetensors"))
    theirs = load_file(str(straight / "output" / "adapter_model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].equal(theirs[name]), name


def test_the_static_decode_step_makes_the_same_job_as_the_eager_loop(
    uninterrupted_lora, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's sampler through the static-cache decode step (replayed as a CUDA graph
    on a GPU; on the CPU forced, uncaptured): the same rollouts, so the same job, step for
    step."""
    _, want_events = uninterrupted_lora
    monkeypatch.setenv("RP_GRAPH_ROLLOUTS", "force")
    job = make_job(tmp_path / "graphs", LORA_KL)
    code, events = run(job)
    assert code == 0, (job / "worker.log").read_text()[-3000:]
    assert "a static-cache decode step" in (job / "worker.log").read_text()
    assert "graph rollouts failed" not in (job / "worker.log").read_text()
    keys = ("train_loss", "reward_mean", "kl", "clip_fraction", "completion_tokens_mean")
    got, want = metrics(events), metrics(want_events)
    assert [{k: m[k] for k in keys} for m in got] == [{k: m[k] for k in keys} for m in want]


# A full fine-tune's KL reference is its starting weights, built again by each attempt (a
# resumed one holds the checkpoint's weights): a kill -9 must not move it.
FULL_KL = {
    "train.steps": 4,
    "train.checkpoint_interval": 2,
    "train.lr": 0.01,
    "grpo": {"group_size": 4, "max_completion_tokens": 6, "kl_coef": 0.05, "sample_interval": 0},
}


def test_a_full_fine_tunes_kl_reference_is_its_start_and_survives_kill_9(tmp_path: Path) -> None:
    straight = make_job(tmp_path / "straight", FULL_KL)
    code, events = run(straight)
    assert code == 0, (straight / "worker.log").read_text()[-3000:]
    want = metrics(events)
    assert "building the KL reference" in (straight / "worker.log").read_text()
    # step 1: the policy is the reference (the same weights, two wraps): the KL is ~0
    assert abs(want[0]["kl"]) < 1e-6
    assert all(m["kl"] > 1e-4 for m in want[1:])  # the weights moved, the reference did not
    got = killed_and_resumed(make_job(tmp_path / "killed", FULL_KL), checkpoint=2)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    for a, b in zip(got, want, strict=True):
        for key in ("train_loss", "reward_mean", "kl", "clip_fraction"):
            assert a[key] == b[key], (a["step"], key)
