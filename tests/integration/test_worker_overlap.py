"""engine.overlap_calls in the worker: a job whose calls overlap (each step's backward
behind the next step's forward, as `auto` runs a one-process job on 2 GPUs at staleness one),
paused and resumed, trains the losses and final weights of the same job without it run
straight through, bit for bit, on two CPU devices of one process."""

from __future__ import annotations

import json
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

DEVICES = "cpu:2"  # a pipeline over two devices: what overlapped calls hide the ends of
STALE = {**SMALL, "engine.step_staleness": 1, "train.steps": 14}


def _overlapped(job_dir: Path) -> Path:
    """The job's options as the daemon maps them with overlap_calls decided on."""
    path = job_dir / "spec.json"
    payload = json.loads(path.read_text())
    payload["options"]["overlap_calls"] = True
    path.write_text(json.dumps(payload))
    return job_dir


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    job_dir = make_job(tmp_path_factory.mktemp("overlap") / "plain", STALE)
    code, events = run(job_dir, devices=DEVICES)
    assert code == 0, (job_dir / "worker.log").read_text()[-3000:]
    return job_dir, events


def _same_curve(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(got, want, strict=True):
        assert a["train_loss"] == b["train_loss"], a["step"]
        assert a.get("valid_loss") == b.get("valid_loss"), a["step"]


def test_an_overlapped_job_paused_and_resumed_trains_what_the_plain_one_does(
    plain, tmp_path: Path
) -> None:
    plain_dir, plain_events = plain
    job_dir = _overlapped(make_job(tmp_path / "paused", STALE))

    def pause(proc: subprocess.Popen[str], event: dict[str, Any]) -> None:
        if event["type"] == "metrics" and event["data"]["step"] == 4:
            proc.send_signal(signal.SIGUSR1)

    code, first = run(job_dir, pause, devices=DEVICES)
    assert code == EXIT_PAUSED, (job_dir / "worker.log").read_text()[-3000:]
    assert "overlapped calls" in (job_dir / "worker.log").read_text()
    assert "overlapped calls" not in (plain_dir / "worker.log").read_text()
    assert first[-1]["data"]["status"] == "paused"
    code, second = run(job_dir, devices=DEVICES)
    assert code == 0, (job_dir / "worker.log").read_text()[-3000:]
    _same_curve(metrics(first) + metrics(second), metrics(plain_events))
    assert any("valid_loss" in m for m in metrics(second))  # evaluation ran between calls
    assert_same_weights(weights(job_dir), weights(plain_dir))
