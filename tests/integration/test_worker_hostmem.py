"""The worker in the 12-bytes-a-parameter mode (issue 15): an fp16 model, the fp16 gradient
read in place (clipped in place), bf16 Adam moments in the checkpoint; a paused and resumed
run ends bit-identical to an uninterrupted one (tests/unit/engine/optim/test_lowp_accuracy.py
measures the accuracy)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_worker import (
    EXIT_PAUSED,
    SMALL,
    assert_same_weights,
    make_job,
    metrics,
    run,
    weights,
)

LOW = {
    **SMALL,
    "model.dtype": "float16",
    "engine.optim_state_dtype": "bfloat16",
    "engine.optim_grad_dtype": "model",
    "engine.pin_model": "arena",
}

# issue 35: bf16 weights as the masters, 8-bit moments (with their block scales) in the
# checkpoint.
COMPACT = {
    **SMALL,
    "model.dtype": "bfloat16",
    "engine.optim_memory": "compact",
    "engine.pin_model": "arena",
}


@pytest.mark.parametrize("mode", [LOW, COMPACT], ids=["lean", "compact"])
def test_low_precision_job_pauses_and_resumes_exactly(tmp_path: Path, mode) -> None:
    straight = make_job(tmp_path / "straight", mode)
    code, straight_events = run(straight)
    assert code == 0, (straight / "worker.log").read_text()[-3000:]

    job_dir = make_job(tmp_path / "paused", mode)

    def pause_early(proc: subprocess.Popen[str], event: dict[str, Any]) -> None:
        if event["type"] == "metrics" and event["data"]["step"] == 3:
            proc.send_signal(signal.SIGUSR1)

    code, first = run(job_dir, pause_early)
    assert code == EXIT_PAUSED, (job_dir / "worker.log").read_text()[-3000:]
    code, second = run(job_dir)
    assert code == 0, (job_dir / "worker.log").read_text()[-3000:]
    resumed = metrics(first) + metrics(second)
    for got, want in zip(resumed, metrics(straight_events), strict=True):
        assert got["train_loss"] == want["train_loss"], got["step"]
        assert got["grad_norm"] == want["grad_norm"], got["step"]
    assert_same_weights(weights(job_dir), weights(straight))


def test_worker_refuses_over_its_budget_before_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RP_HOST_MEMORY_BUDGET", "64KiB")  # the worker inherits it
    job_dir = make_job(tmp_path / "small", LOW)
    code, events = run(job_dir)
    assert code != 0
    error = events[-1]
    assert error["level"] == "error" and error["data"]["code"] == "host_memory_exceeded"
    assert "budget of 0.0 GiB" in error["message"]
    assert error["data"]["param"] == "model"  # no engine option fits in 64 KiB
