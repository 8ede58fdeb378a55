"""`python -m rp_service.cluster.local JOB_DIR`: a job's data-parallel ranks on this box.

The orchestrator starts this in place of the worker when the job's GPU mode is `ranks`
(rp_service.jobs.gpu_mode) and reads it as it reads a worker: stdout is the event pipe,
the exit status the outcome, SIGTERM cancels and SIGUSR1 pauses. It starts one
`python -m rp_service.cluster.rank JOB_DIR` per GPU of the job, each seeing only its own
GPU (CUDA_VISIBLE_DEVICES, RP_DEVICES=cuda; NCCL between them), or on a daemon without
GPUs one per rank with one CPU device each (RP_DEVICES=cpu:1; gloo). The rendezvous is
torch.distributed's env one on a free 127.0.0.1 port. Then `follow_ranks`, as the Ray
driver does: rank 0's events on stdout, every rank's log on stderr (worker.log), signals
to every rank, rank 0's exit status.

Each rank is the worker's own process (`RankAgent` runs it, without Ray here), which asks
the kernel to kill it when this process dies; this process does the same with the
daemon's, so a daemon killed with -9 leaves no rank behind.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from pathlib import Path

from rp_service.cluster.agent import RankAgent
from rp_service.cluster.follow import Signals, follow_ranks, start_launcher
from rp_service.worker.main import EXIT_FAILED, EventWriter

__all__ = ["main", "rank_envs"]

log = logging.getLogger("rp_service.cluster.local")

_LOOPBACK = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((_LOOPBACK, 0))
        return int(s.getsockname()[1])


def rank_envs(ranks: int, visible: str, devices: str, port: int) -> list[dict[str, str]]:
    """Each rank's environment over this process's.

    Args:
        ranks: The job's rank count (its engine.gpus).
        visible: CUDA_VISIBLE_DEVICES the daemon gave this process: the job's GPUs, one a
            rank; empty on a daemon without GPUs.
        devices: RP_DEVICES the daemon gave: 'cuda', or 'cpu:N' without GPUs.

    Raises:
        ValueError: GPUs given, but not one a rank.
    """
    gpus = [g for g in visible.split(",") if g.strip()]
    on_gpus = devices.startswith("cuda") and bool(gpus)
    if on_gpus and len(gpus) != ranks:
        raise ValueError(f"{ranks} ranks need one GPU each, but the daemon gave GPUs {visible}")
    base = {
        "MASTER_ADDR": _LOOPBACK,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        "GROUP_RANK": "0",
        "PYTHONUNBUFFERED": "1",
    }
    return [
        {
            **base,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "CUDA_VISIBLE_DEVICES": gpus[r] if on_gpus else "",
            "RP_DEVICES": "cuda" if on_gpus else "cpu:1",
        }
        for r in range(ranks)
    ]


def _fail(emit: EventWriter, code: str, message: str, param: str | None = None) -> int:
    emit("message", message, {"code": code, "message": message, "param": param}, level="error")
    return EXIT_FAILED


def run(job_dir: Path, emit: EventWriter, signals: Signals) -> int:
    """Start the ranks and follow them; rank 0's exit status."""
    payload = json.loads((job_dir / "spec.json").read_text())
    ranks = int(payload["spec"]["engine"]["gpus"])
    try:
        envs = rank_envs(
            ranks,
            os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            os.environ.get("RP_DEVICES", "cuda"),
            _free_port(),
        )
    except ValueError as exc:
        return _fail(emit, "internal_error", f"starting the ranks failed: {exc}")
    where = ", ".join(
        f"{r}: GPU {e['CUDA_VISIBLE_DEVICES']}" if e["CUDA_VISIBLE_DEVICES"] else f"{r}: cpu:1"
        for r, e in enumerate(envs)
    )
    emit(
        "message",
        f"{ranks} data-parallel ranks on this box ({where})",
        {"ranks": ranks, "devices": [e["RP_DEVICES"] for e in envs]},
    )
    agents = [RankAgent() for _ in envs]
    for agent, env in zip(agents, envs, strict=True):
        agent.start(str(job_dir), env)
    return follow_ranks(
        agents, emit, signals, lambda c, m, p: _fail(emit, c, m, p), one_device_each=True
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m rp_service.cluster.local JOB_DIR`."""
    from rp_service.worker.main import _die_with_daemon

    _die_with_daemon()
    started = start_launcher(argv, "rp_service.cluster.local")
    if started is None:
        return 2
    job_dir, emit, signals = started
    try:
        return run(job_dir, emit, signals)
    except Exception as exc:
        log.exception("the rank launcher failed")
        return _fail(
            emit, "internal_error", f"the rank launcher failed: {type(exc).__name__}: {exc}"
        )


if __name__ == "__main__":
    sys.exit(main())
