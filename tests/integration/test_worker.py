"""The job worker as the orchestrator runs it: `python -m rp_service.worker JOB_DIR`.

Each test writes a JOB_DIR/spec.json, starts the worker on RP_DEVICES=cpu:1 and reads its
event pipe. The key test is the pause/resume one: a run paused with SIGUSR1 and started
again ends with bit-identical weights to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rp_service.demo import demo_spec
from rp_service.schemas import JobSpec
from rp_service.spec_to_engine import spec_to_engine

REPO = Path(__file__).resolve().parents[2]
EXIT_PAUSED = 75

# Small enough for a few seconds a run; eval and checkpoint steps are not multiples of each
# other, so sync points of both kinds and plain asynchronous steps all occur.
SMALL = {
    "model.config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 64,
    },
    "data.seq_len": 32,
    "train.batch_size": 4,
    "train.steps": 24,
    "train.warmup_steps": 3,
    "train.eval_interval": 7,
    "train.checkpoint_interval": 10,
    "train.keep_checkpoints": 3,
}


def make_job(job_dir: Path, overrides: dict[str, Any] | None = None, **resolved: Any) -> Path:
    """Write JOB_DIR/spec.json for the demo spec with dotted `overrides`."""
    spec = demo_spec()
    for dotted, value in (overrides or {}).items():
        if "." not in dotted:
            spec[dotted] = value
            continue
        section, key = dotted.split(".", 1)
        spec[section][key] = value
    parsed = JobSpec.model_validate(spec)
    spec = parsed.model_dump(mode="json")
    paths = {
        "train_path": "synthetic",
        "valid_path": None,
        "model_path": None,
        "tokenizer_path": None,
        "output_dir": str(job_dir / "output"),
        "checkpoint_dir": str(job_dir / "checkpoints"),
        **resolved,
    }
    job_dir.mkdir(parents=True, exist_ok=True)
    # the options as the daemon maps them at submission and hands them to every launch
    options = spec_to_engine(parsed).to_json()
    payload = {
        "job_id": job_dir.name,
        "attempt": 1,
        "spec": spec,
        "options": options,
        "resolved": paths,
    }
    (job_dir / "spec.json").write_text(json.dumps(payload))
    return job_dir


def start(job_dir: Path, devices: str = "cpu:1") -> subprocess.Popen[str]:
    env = dict(os.environ, RP_DEVICES=devices, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    log = open(job_dir / "worker.log", "a")  # noqa: SIM115 (the child holds it)
    return subprocess.Popen(
        [sys.executable, "-m", "rp_service.worker", str(job_dir)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
    )


def run(
    job_dir: Path,
    on_event: Callable[[subprocess.Popen[str], dict[str, Any]], None] | None = None,
    timeout_s: float = 300,
    devices: str = "cpu:1",
) -> tuple[int, list[dict[str, Any]]]:
    """Run the worker to its exit; return (exit code, events). Every stdout line is JSON."""
    proc = start(job_dir, devices)
    events = []
    assert proc.stdout is not None
    for line in proc.stdout:
        event = json.loads(line)  # nothing but events may reach stdout
        assert set(event) == {"type", "level", "message", "data"}
        events.append(event)
        if on_event is not None:
            on_event(proc, event)
    code = proc.wait(timeout=timeout_s)
    return code, events


def metrics(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["data"] for e in events if e["type"] == "metrics"]


def weights(job_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(job_dir / "output" / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    job_dir = make_job(tmp_path_factory.mktemp("jobs") / "straight", SMALL)
    code, events = run(job_dir)
    assert code == 0, (job_dir / "worker.log").read_text()[-3000:]
    return job_dir, events


def test_demo_job_end_to_end(tmp_path: Path) -> None:
    job_dir = make_job(tmp_path / "demo")
    started = time.monotonic()
    code, events = run(job_dir)
    elapsed_s = time.monotonic() - started
    assert code == 0, (job_dir / "worker.log").read_text()[-3000:]
    spec = demo_spec()
    total = spec["train"]["steps"]

    assert events[0]["type"] == "status" and events[0]["data"]["status"] == "running"
    assert events[-1]["data"] == {
        "status": "succeeded",
        "step": total,
        "output_model_path": str(job_dir / "output"),
    }
    steps = metrics(events)
    assert [m["step"] for m in steps] == list(range(1, total + 1))
    for m in steps:
        assert m["total_steps"] == total and m["grad_norm"] is not None and m["grad_norm"] > 0
        assert m["tokens_per_second"] > 0 and m["learning_rate"] > 0
        assert 0 < m["step_seconds"] < 60
        # RP_DEVICES=cpu:1: one device's share of each step (docs/API.md, gpu_share)
        (share,) = m["gpu_share"]
        assert share["device"] == "cpu-virtual:0" and 0 <= share["busy_fraction"] <= 1
    assert all(
        m["gpu_share"][0]["busy_fraction"] > 0 and m["gpu_share"][0]["jobs"] > 0 for m in steps
    )
    assert (
        steps[-1]["trained_tokens"] == total * spec["train"]["batch_size"] * spec["data"]["seq_len"]
    )
    # A checkpoint event follows the metrics of its step.
    seen_steps = 0
    for event in events:
        if event["type"] == "metrics":
            seen_steps = event["data"]["step"]
        if event["type"] == "checkpoint":
            assert event["data"]["step"] == seen_steps
            assert event["data"]["size_bytes"] > 0
    ckpts = sorted(p.name for p in (job_dir / "checkpoints").iterdir())
    assert ckpts == [f"step-{total - 50:08d}", f"step-{total:08d}"]  # keep_checkpoints = 2

    # The loss clearly falls, and validation is reported every eval_interval steps.
    first, last = steps[0]["train_loss"], sum(m["train_loss"] for m in steps[-10:]) / 10
    assert first > 5.0 and last < 2.5, (first, last)
    evals = [m for m in steps if m["valid_loss"] is not None]
    assert [m["step"] for m in evals] == list(range(25, total + 1, 25))
    assert evals[-1]["valid_loss"] < evals[0]["valid_loss"]
    assert elapsed_s < 120, elapsed_s

    # The output loads with transformers and gives the reported validation loss.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rp_service.data.datasets import build_blocks
    from rp_service.data.tokenizer import load_tokenizer
    from rp_service.demo import SYNTHETIC_VALID_RECORDS, synthetic_records

    out = job_dir / "output"
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    assert hf_tok.eos_token_id == 256
    blocks = build_blocks(
        synthetic_records(SYNTHETIC_VALID_RECORDS, valid=True),
        "text",
        load_tokenizer(out),
        seq_len=spec["data"]["seq_len"],
        packing=True,
    )
    with torch.no_grad():
        logits = model(input_ids=blocks.input_ids.long()).logits
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), blocks.labels.long().flatten(), ignore_index=-100
    )
    assert abs(loss.item() - evals[-1]["valid_loss"]) < 1e-4


def test_pause_then_resume_matches_uninterrupted(uninterrupted, tmp_path: Path) -> None:
    straight_dir, straight_events = uninterrupted
    job_dir = make_job(tmp_path / "paused", SMALL)

    def pause_early(proc: subprocess.Popen[str], event: dict[str, Any]) -> None:
        if event["type"] == "metrics" and event["data"]["step"] == 3:
            proc.send_signal(signal.SIGUSR1)

    code, first = run(job_dir, pause_early)
    assert code == EXIT_PAUSED, (job_dir / "worker.log").read_text()[-3000:]
    paused = first[-1]["data"]
    assert paused["status"] == "paused" and 3 <= paused["step"] < SMALL["train.steps"]
    assert first[-2]["type"] == "checkpoint" and first[-2]["data"]["step"] == paused["step"]

    code, second = run(job_dir)
    assert code == 0, (job_dir / "worker.log").read_text()[-3000:]
    assert second[0]["data"]["step"] == paused["step"]  # "running" from the checkpoint
    resumed = metrics(first) + metrics(second)
    assert [m["step"] for m in resumed] == list(range(1, SMALL["train.steps"] + 1))
    # The loss curve continues exactly: same losses, lrs and final weights.
    for got, want in zip(resumed, metrics(straight_events), strict=True):
        assert got["train_loss"] == want["train_loss"], got["step"]
        assert got["learning_rate"] == want["learning_rate"]
        assert got["trained_tokens"] == want["trained_tokens"]
    assert_same_weights(weights(job_dir), weights(straight_dir))


def test_resume_after_kill_continues_from_last_checkpoint(uninterrupted, tmp_path: Path) -> None:
    straight_dir, _ = uninterrupted
    job_dir = make_job(tmp_path / "killed", SMALL)

    def kill_after_checkpoint(proc: subprocess.Popen[str], event: dict[str, Any]) -> None:
        if event["type"] == "metrics" and event["data"]["step"] == 13:
            proc.send_signal(signal.SIGKILL)

    code, first = run(job_dir, kill_after_checkpoint)
    assert code == -signal.SIGKILL
    assert [e["data"]["step"] for e in first if e["type"] == "checkpoint"] == [10]

    code, second = run(job_dir)
    assert code == 0, (job_dir / "worker.log").read_text()[-3000:]
    assert second[0]["data"]["step"] == 10
    assert metrics(second)[0]["step"] == 11
    assert_same_weights(weights(job_dir), weights(straight_dir))


def test_sigterm_exits_promptly_without_checkpoint(tmp_path: Path) -> None:
    job_dir = make_job(tmp_path / "cancel", {**SMALL, "train.steps": 100000})
    proc = start(job_dir)
    assert proc.stdout is not None
    for line in proc.stdout:
        if json.loads(line)["type"] == "metrics":
            break
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=10)
    assert time.monotonic() - sent < 5
    assert code == 128 + signal.SIGTERM
    assert not (job_dir / "checkpoints").exists() or not any((job_dir / "checkpoints").iterdir())


def test_malformed_line_gives_error_event(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "good line"}\n\n{"text": "also good"}\n{"text": "broken\n')
    job_dir = make_job(tmp_path / "bad", {"data.train": str(data)}, train_path=str(data))
    code, events = run(job_dir)
    assert code == 1
    (event,) = events
    assert event["type"] == "message" and event["level"] == "error"
    assert event["data"]["code"] == "invalid_data"
    assert event["data"]["param"] == "data.train"
    assert event["data"]["line"] == 4
    assert "line 4" in event["message"]


def test_fine_tunes_a_local_model_directory(uninterrupted, tmp_path: Path) -> None:
    straight_dir, _ = uninterrupted
    model_dir = straight_dir / "output"
    data = tmp_path / "chat.jsonl"
    chat = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a story"}]
    }
    data.write_text("\n".join(json.dumps(chat) for _ in range(40)) + "\n")
    overrides = {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "data.train": str(data),
        "data.valid": None,
        "data.format": "chat",
        "data.seq_len": 32,
        "train.steps": 4,
        "train.batch_size": 2,
        "train.eval_interval": 0,
        "train.checkpoint_interval": 0,
    }
    job_dir = make_job(
        tmp_path / "finetune", overrides, train_path=str(data), model_path=str(model_dir)
    )
    code, events = run(job_dir)
    assert code == 0, (job_dir / "worker.log").read_text()[-3000:]
    assert [m["step"] for m in metrics(events)] == [1, 2, 3, 4]
    assert (job_dir / "output" / "tokenizer.json").is_file()
