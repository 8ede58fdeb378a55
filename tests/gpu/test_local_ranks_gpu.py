"""engine.gpu_mode on 2 GPUs through a real daemon: `auto` takes one rank per GPU for a full
sft job (rp_service.cluster.local: CUDA_VISIBLE_DEVICES one GPU a rank, NCCL), and those
ranks train the weights of the same job as one process driving both GPUs (fp32, the
tolerance of the two-node NCCL test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.service_daemon import Daemon, spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
    pytest.mark.timeout(600),
]

_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
_STEPS = 8


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("ranks-gpu-daemon")
    d = Daemon(root / "data", {"RP_WORKER_MODULE": "rp_service.worker", "RP_GPUS": "0,1"})
    d.start()
    try:
        yield d
    finally:
        d.stop()


def _run(daemon: Daemon, mode: str) -> dict[str, Any]:
    body = spec(
        model={"preset": "qwen3", "config": _CONFIG, "dtype": "float32"},
        train={"steps": _STEPS, "batch_size": 8, "checkpoint_interval": 4, "seed": 3},
        engine={"gpus": 2, "gpu_mode": mode, "num_microbatch": 2},
    )
    with daemon.client() as c:
        r = c.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
    done = daemon.wait_for(job_id, {"succeeded", "failed", "cancelled"}, 300)
    with daemon.client() as c:
        logs = c.get(f"/v1/jobs/{job_id}/logs").text
    assert done["status"] == "succeeded", (done, logs[-4000:])
    return done


def test_auto_runs_a_rank_per_gpu_and_trains_as_one_process(daemon: Daemon) -> None:
    ranks = _run(daemon, "auto")  # one after the other: each takes both GPUs
    pipeline = _run(daemon, "pipeline")
    assert ranks["gpu_mode"]["mode"] == "ranks" and ranks["gpu_mode"]["ranks"] == 2
    assert pipeline["gpu_mode"]["mode"] == "pipeline"
    with daemon.client() as c:
        events = c.get(f"/v1/jobs/{ranks['id']}/events", params={"limit": 1000}).json()["data"]
    assert any(e["message"].startswith("2 data-parallel ranks on this box (0: GPU") for e in events)
    w2 = load_file(str(Path(ranks["output_model_path"]) / "model.safetensors"))
    w1 = load_file(str(Path(pipeline["output_model_path"]) / "model.safetensors"))
    for name, tensor in w1.items():
        torch.testing.assert_close(w2[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
