"""`python -m rp_service.cluster.rank JOB_DIR`: one data-parallel rank of a multi-node job.

The worker (`python -m rp_service.worker`) with one thing before the job: joining the
job's process group through torch.distributed's env rendezvous (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, as torchrun or rp_service.cluster.driver set them). Gloo for
CPU tensors and NCCL for CUDA ones where CUDA is there, named explicitly: without a backend
torch 2.11 builds NCCL alone on a GPU box, and the engine's data parallel takes the
default group. Only rank 0 keeps the event journal; every rank writes its events
on stdout (the driver passes rank 0's on).
"""

from __future__ import annotations

import datetime
import sys

__all__ = ["join_process_group", "main"]

_RENDEZVOUS_TIMEOUT_S = 600.0


def join_process_group() -> int:
    """Join the default process group from the environment; return this rank."""
    import torch
    import torch.distributed as dist

    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=_RENDEZVOUS_TIMEOUT_S))
    return dist.get_rank()


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m rp_service.cluster.rank JOB_DIR`."""
    from rp_service.worker.main import main as worker_main

    return worker_main(argv, join=join_process_group)


if __name__ == "__main__":
    sys.exit(main())
