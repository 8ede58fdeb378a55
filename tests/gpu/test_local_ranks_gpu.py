"""engine.gpu_mode on 2 GPUs through a real daemon: `auto` takes one rank per GPU for a full
sft job with the staleness-one step (rp_service.cluster.local: CUDA_VISIBLE_DEVICES one GPU
a rank, NCCL), and those ranks train the weights of the same job as one process driving
both GPUs (fp32, the tolerance of the two-node NCCL test). With the default staleness-zero
step `auto` keeps one process (rp_service.jobs.gpu_mode)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.integration.job_runs import (
    TINY_FP32_CONFIG,
    events,
    finish,
    real_worker_daemon,
    submit,
    weights,
)
from tests.integration.service_daemon import Daemon, spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
    pytest.mark.timeout(600),
]

_STEPS = 8


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("ranks-gpu-daemon")
    with real_worker_daemon(root, {"RP_GPUS": "0,1"}) as d:
        yield d


def _run(daemon: Daemon, mode: str) -> dict[str, Any]:
    body = spec(
        model={"preset": "qwen3", "config": TINY_FP32_CONFIG, "dtype": "float32"},
        train={"steps": _STEPS, "batch_size": 8, "checkpoint_interval": 4, "seed": 3},
        engine={"gpus": 2, "gpu_mode": mode, "num_microbatch": 2, "step_staleness": 1},
    )
    return finish(daemon, submit(daemon, body), timeout_s=300)


def test_auto_runs_a_rank_per_gpu_and_trains_as_one_process(daemon: Daemon) -> None:
    ranks = _run(daemon, "auto")  # one after the other: each takes both GPUs
    pipeline = _run(daemon, "pipeline")
    assert ranks["gpu_mode"]["mode"] == "ranks" and ranks["gpu_mode"]["ranks"] == 2
    assert pipeline["gpu_mode"]["mode"] == "pipeline"
    launched = "2 data-parallel ranks on this box (0: GPU"
    assert any(e["message"].startswith(launched) for e in events(daemon, ranks["id"]))
    w2, w1 = weights(ranks), weights(pipeline)
    for name, tensor in w1.items():
        torch.testing.assert_close(w2[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
