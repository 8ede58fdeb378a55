"""engine.gpu_mode ranks through a real daemon on CPU devices: two data-parallel rank
processes (rp_service.cluster.local, one cpu:1 device each, gloo) with the real worker.

The oracle is the same job as one process (gpu_mode pipeline, the same global batch):
the ranks train the same losses and final weights (fp32, the tolerance of the Ray
cluster's test); a ranks job paused and resumed, and one whose rank 1 was killed with -9
(retried from its checkpoint), end with exactly the weights of the uninterrupted one.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.job_runs import (
    TINY_FP32_CONFIG,
    assert_trained_alike,
    events,
    finish,
    losses,
    real_worker_daemon,
    submit,
    weights,
)
from tests.integration.service_daemon import Daemon, spec

pytestmark = pytest.mark.timeout(300)

_STEPS = 32  # a step takes ~0.1 s: room to pause and to kill mid-job
_LAUNCHED = "2 data-parallel ranks on this box"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("ranks-daemon")
    with real_worker_daemon(root, {"RP_MAX_CPU_JOBS": "4"}) as d:
        yield d


def _job(mode: str) -> dict[str, Any]:
    return spec(
        model={"preset": "qwen3", "config": TINY_FP32_CONFIG, "dtype": "float32"},
        train={"steps": _STEPS, "batch_size": 4, "checkpoint_interval": 4, "seed": 3},
        engine={"gpus": 2, "gpu_mode": mode, "num_microbatch": 2},
    )


def _rank_pid(job_id: str, rank: int) -> int | None:
    """The pid of `rank`'s process of the job (`python -m rp_service.cluster.rank JOB_DIR`),
    or None while there is none."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        ours = b"rp_service.cluster.rank" in argv and any(job_id.encode() in a for a in argv)
        if ours and f"RANK={rank}".encode() in env:
            return int(proc.name)
    return None


def _kill_rank_past_first_checkpoint(daemon: Daemon, job_id: str, rank: int) -> None:
    """SIGKILL `rank` of the job as soon as a checkpoint before its last step is committed.

    The pid is taken while the job starts and the checkpoints are watched on disk, not
    through the daemon's progress: on a busy two-core machine the reported step lags the
    ranks by seconds, long enough for a 32-step job to end before the kill. Any committed
    checkpoint before the last step will do, not the first only: the job keeps two, so
    step 4's is gone by step 12, which a fast run reached while the caller was still
    pausing another job (session 25, an idle CI machine)."""
    checkpoints = daemon.data_dir / "jobs" / job_id / "checkpoints"
    last = f"step-{_STEPS:08d}"
    deadline = time.monotonic() + 120
    pid = None
    committed: list[str] = []
    while time.monotonic() < deadline:
        pid = pid or _rank_pid(job_id, rank)
        names = [p.name for p in checkpoints.glob("step-*")] if checkpoints.is_dir() else []
        committed = [n for n in names if re.fullmatch(r"step-\d{8}", n) and n != last]
        if pid is not None and committed:
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.01)
    with daemon.client() as c:
        job = c.get(f"/v1/jobs/{job_id}").json()
    raise AssertionError(f"rank {rank} pid {pid}, checkpoints {committed}; job {job}")


@pytest.fixture(scope="module")
def runs(daemon: Daemon) -> dict[str, Any]:
    """The ranks job and the pipeline job run through; a ranks job paused after its first
    step and resumed; a ranks job whose rank 1 is killed with -9 past its first
    checkpoint. All four side by side: their processes start in the same seconds, which is
    most of a run's time."""
    ranks, pipeline, paused, killed = (
        submit(daemon, _job(m)) for m in ("ranks", "pipeline", "ranks", "ranks")
    )
    daemon.wait_for_step(paused, 1, timeout_s=120)
    with daemon.client() as c:
        assert c.post(f"/v1/jobs/{paused}/pause").status_code == 200
    _kill_rank_past_first_checkpoint(daemon, killed, 1)
    stopped = daemon.wait_for(paused, {"paused", "failed", "succeeded"}, timeout_s=120)
    assert stopped["status"] == "paused" and stopped["progress"]["step"] < _STEPS, stopped
    with daemon.client() as c:
        assert c.post(f"/v1/jobs/{paused}/resume").status_code == 200
    return {
        "ranks": finish(daemon, ranks),
        "pipeline": finish(daemon, pipeline),
        "paused": finish(daemon, paused),
        "killed": finish(daemon, killed),
    }


def test_two_ranks_train_as_one_process(daemon: Daemon, runs: dict[str, Any]) -> None:
    ranks, pipeline = runs["ranks"], runs["pipeline"]
    assert ranks["gpu_mode"] == {
        "mode": "ranks",
        "ranks": 2,
        "reason": "engine.gpu_mode is 'ranks'",
        "overlap_calls": False,  # ranks never overlap calls
    }
    assert pipeline["gpu_mode"]["mode"] == "pipeline"
    assert sorted(losses(daemon, ranks["id"])) == list(range(1, _STEPS + 1))
    assert_trained_alike(daemon, ranks, pipeline)
    seen = events(daemon, ranks["id"])
    assert sum(e["message"].startswith(_LAUNCHED) for e in seen) == 1
    # rank 0's metrics carry both ranks' device shares, as the job's devices 0 and 1
    shares = [e["data"].get("gpu_share") or [] for e in seen if e["type"] == "metrics"]
    assert any(
        [d["device"] for d in share] == [f"cpu-virtual:{r}" for r in (0, 1)] for share in shares
    ), shares
    # the optimizer thread's seconds: the step, and data parallel's collectives (the
    # gradients' reduction during each backward); one process has no collectives
    timings = [e["data"]["optimizer"] for e in seen if e["type"] == "metrics"]
    assert all(t["step_s"] > 0 and t["reduce_s"] > 0 and "publish_s" in t for t in timings)
    single = [
        e["data"]["optimizer"] for e in events(daemon, pipeline["id"]) if e["type"] == "metrics"
    ]
    assert single and all(set(t) == {"step_s"} for t in single), single
    assert not any(e["message"].startswith(_LAUNCHED) for e in events(daemon, pipeline["id"]))
    # every rank's optimizer shard is in the committed checkpoint
    last = sorted((Path(ranks["output_model_path"]).parent / "checkpoints").glob("step-*"))[-1]
    assert (last / "rank-00001.shard").is_file() and (last / "optimizer.safetensors").is_file()


def test_a_paused_ranks_job_resumes_as_ranks_to_the_same_weights(
    daemon: Daemon, runs: dict[str, Any]
) -> None:
    done = runs["paused"]
    assert done["attempt"] == 2 and done["gpu_mode"]["mode"] == "ranks"
    messages = [e["message"] for e in events(daemon, done["id"])]
    assert sum(m.startswith(_LAUNCHED) for m in messages) == 2, messages
    expected, got = weights(runs["ranks"]), weights(done)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name  # resumed bit for bit


def test_a_rank_killed_mid_job_is_retried_from_the_checkpoint(
    daemon: Daemon, runs: dict[str, Any]
) -> None:
    done = runs["killed"]
    assert done["restarts"] == 1 and done["attempt"] == 2
    requeued = [e for e in events(daemon, done["id"]) if "re-queued" in e["message"]]
    assert len(requeued) == 1 and "rank 1 was killed by signal 9" in requeued[0]["message"]
    expected, got = weights(runs["ranks"]), weights(done)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
