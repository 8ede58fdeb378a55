"""engine.gpu_mode on 2 GPUs through a real daemon: ranks asked for run one rank per GPU
(rp_service.cluster.local: CUDA_VISIBLE_DEVICES one GPU a rank, NCCL) and train the weights
of the same job as one process driving both GPUs (fp32, the tolerance of the two-node NCCL
test). `auto` on 2 GPUs with the staleness-one step keeps one process and overlaps its
calls (rp_service.jobs.gpu_mode, session 28's measurements), with the weights of the same
process without overlapped calls, bit for bit."""

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


def _run(daemon: Daemon, mode: str, **engine: Any) -> dict[str, Any]:
    body = spec(
        model={"preset": "qwen3", "config": TINY_FP32_CONFIG, "dtype": "float32"},
        train={"steps": _STEPS, "batch_size": 8, "checkpoint_interval": 4, "seed": 3},
        engine={"gpus": 2, "gpu_mode": mode, "num_microbatch": 2, "step_staleness": 1, **engine},
    )
    return finish(daemon, submit(daemon, body), timeout_s=300)


def test_ranks_train_as_one_process_and_auto_overlaps_one_process(daemon: Daemon) -> None:
    ranks = _run(daemon, "ranks")  # one after the other: each takes both GPUs
    auto = _run(daemon, "auto")
    plain = _run(daemon, "pipeline", overlap_calls=False)
    assert ranks["gpu_mode"]["mode"] == "ranks" and ranks["gpu_mode"]["ranks"] == 2
    assert auto["gpu_mode"]["mode"] == "pipeline" and auto["gpu_mode"]["overlap_calls"] is True
    assert plain["gpu_mode"]["overlap_calls"] is False
    launched = "2 data-parallel ranks on this box (0: GPU"
    assert any(e["message"].startswith(launched) for e in events(daemon, ranks["id"]))
    w2, w1, overlapped = weights(ranks), weights(plain), weights(auto)
    for name, tensor in w1.items():
        torch.testing.assert_close(w2[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
        assert torch.equal(overlapped[name], tensor), name
