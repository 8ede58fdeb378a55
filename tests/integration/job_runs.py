"""Helpers for tests that run real training jobs through a `Daemon` and compare their
results: a tiny fp32 Qwen3 shape, submit, wait for success, read events, losses, weights."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.service_daemon import Daemon

# two decoder layers, every width set: a step takes ~0.1 s on one CPU core
TINY_FP32_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


@contextmanager
def real_worker_daemon(root: Path, env: dict[str, str]) -> Iterator[Daemon]:
    """A daemon that runs the real worker (`rp_service.worker`), stopped on exit."""
    daemon = Daemon(root / "data", {"RP_WORKER_MODULE": "rp_service.worker", **env})
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()


def submit(daemon: Daemon, body: dict[str, Any]) -> str:
    with daemon.client() as c:
        r = c.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        return r.json()["id"]


def finish(daemon: Daemon, job_id: str, timeout_s: float = 180) -> dict[str, Any]:
    """The job once it has ended, which must be in success (its log tail otherwise)."""
    done = daemon.wait_for(job_id, {"succeeded", "failed", "cancelled"}, timeout_s)
    with daemon.client() as c:
        logs = c.get(f"/v1/jobs/{job_id}/logs").text
    assert done["status"] == "succeeded", (done, logs[-4000:])
    return done


def events(daemon: Daemon, job_id: str) -> list[dict[str, Any]]:
    with daemon.client() as c:
        return c.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]


def losses(daemon: Daemon, job_id: str) -> dict[int, float]:
    """Step -> train loss, from the job's metrics events."""
    return {
        e["data"]["step"]: e["data"]["train_loss"]
        for e in events(daemon, job_id)
        if e["type"] == "metrics"
    }


def weights(job: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The trained model's tensors."""
    return load_file(str(Path(job["output_model_path"]) / "model.safetensors"))


def assert_trained_alike(daemon: Daemon, got: dict[str, Any], expected: dict[str, Any]) -> None:
    """Two finished jobs trained the same losses at every step and the same final weights
    (fp32: a tight tolerance, for reductions summed in another order)."""
    got_losses, expected_losses = losses(daemon, got["id"]), losses(daemon, expected["id"])
    assert sorted(got_losses) == sorted(expected_losses)
    for step, loss in expected_losses.items():
        assert got_losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    got_weights, expected_weights = weights(got), weights(expected)
    assert sorted(got_weights) == sorted(expected_weights)
    for name, tensor in expected_weights.items():
        torch.testing.assert_close(got_weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
