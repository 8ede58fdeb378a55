"""How a job on several GPUs of this box runs: one process (pipeline) or one rank per GPU.

`engine.gpu_mode` asks; `choose_gpu_mode` decides once, at submission, and the job keeps
the decision (its `gpu_mode`: mode, ranks, reason) for every launch, resumes included. The
rule rests on issue 43's measurements (docs/SCALING.md): on 4 x H100, Qwen3-1.7B full,
2 NCCL ranks ran 76,688 tokens/s against 65,250 for one process on the same 2 GPUs, 4
ranks 89,107 against 72,711-81,124, all with the asynchronous step at staleness one. At
staleness zero (the service's default) the data-parallel step's collectives were on the
step's path: 2 ranks of the service's job ran 1.24x one rank (2 x H200, session 27), where
one process drives 2 GPUs at 1.81x one. Ranks also cost host memory (each holds the
model), so `auto` takes them where

1. the job runs on >= 2 GPUs of this box (engine.nodes 1; a daemon with GPUs),
2. data-parallel ranks can run it (full fine-tune, sft: `data_parallel_refusal`),
3. the step is asynchronous with staleness one (`engine.async_step`, `step_staleness: 1`),
4. the batch splits into equal shares of at least num_microbatch rows a rank,
5. N times one rank's host-memory plan fits the daemon's budget (conservative: each
   rank's optimizer state is counted whole, though a rank keeps only its shard);

else the pipeline, with the first reason that failed. `ranks` asked explicitly and not
runnable is a 422 naming engine.gpu_mode and the fix (on a daemon without GPUs it runs:
one CPU device a rank, gloo, as the CI tests do).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from engine.options import EngineOptions
from engine.planning.memory_plan import format_gib
from rp_service.cluster.nodes import data_parallel_refusal
from rp_service.errors import InvalidRequest
from rp_service.schemas import JobSpec

__all__ = ["GpuMode", "choose_gpu_mode"]

_FIELD = "engine.gpu_mode"


@dataclass(frozen=True, slots=True)
class GpuMode:
    """What runs the job: `pipeline` (one process, `ranks` is 1) or `ranks` processes."""

    mode: Literal["pipeline", "ranks"]
    ranks: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "ranks": self.ranks, "reason": self.reason}


def choose_gpu_mode(
    spec: JobSpec,
    options: EngineOptions,
    *,
    on_gpus: bool,
    rank_plan_bytes: Callable[[int], int | None],
    budget: int,
) -> GpuMode:
    """The job's mode (InvalidRequest when `engine.gpu_mode: ranks` cannot run).

    Args:
        on_gpus: Whether the job gets GPUs of this daemon (False: CPU devices).
        rank_plan_bytes: One rank's predicted host bytes for N ranks (None: unknown).
        budget: Host bytes the daemon lets a job use (RP_HOST_MEMORY_BUDGET).
    """
    asked = spec.engine.gpu_mode
    gpus = spec.engine.gpus
    if asked == "pipeline":
        return GpuMode("pipeline", 1, "engine.gpu_mode is 'pipeline'")
    obstacle = _obstacle(spec, options)
    if obstacle is None and asked == "auto" and not on_gpus:
        obstacle = "this daemon has no GPUs: its CPU devices run as one process"
    if obstacle is None and asked == "auto":
        obstacle = _step_obstacle(spec)
    if obstacle is None:
        need = rank_plan_bytes(gpus)
        if need is not None and need * gpus > budget:
            obstacle = (
                f"{gpus} ranks would hold {gpus} copies of the model in host memory, about "
                f"{format_gib(need * gpus)}, over this daemon's budget of {format_gib(budget)} "
                "(RP_HOST_MEMORY_BUDGET)"
            )
    if asked == "ranks":
        if obstacle is not None:
            raise InvalidRequest(
                f"{_FIELD}: 'ranks' cannot run this job: {obstacle}; set {_FIELD} to 'auto' "
                "or 'pipeline'",
                code="ranks_not_possible",
                param=_FIELD,
            )
        return GpuMode("ranks", gpus, f"{_FIELD} is 'ranks'")
    if obstacle is not None:
        return GpuMode("pipeline", 1, obstacle)
    return GpuMode(
        "ranks",
        gpus,
        f"{gpus} data-parallel ranks outrun one process on {gpus} GPUs (docs/SCALING.md) and "
        "their model copies fit host memory",
    )


def _step_obstacle(spec: JobSpec) -> str | None:
    """Why `auto` keeps one process for this job's step (ranks asked for still run)."""
    engine = spec.engine
    if engine.async_step and engine.step_staleness == 1:
        return None
    step = "step_staleness 0" if engine.async_step else "async_step false"
    return (
        f"with engine.{step} the data-parallel step's collectives wait on the step's path "
        "(measured: 2 ranks 1.24x one GPU, one process on 2 GPUs 1.81x; docs/SCALING.md); "
        "engine.gpu_mode 'ranks' takes them anyway"
    )


def _obstacle(spec: JobSpec, options: EngineOptions) -> str | None:
    """Why ranks cannot run the job (before host memory), or None."""
    gpus, nodes = spec.engine.gpus, spec.engine.nodes
    if gpus < 2:
        return f"engine.gpus is {gpus}: ranks need at least 2 GPUs"
    if nodes > 1:
        return (
            f"engine.nodes is {nodes}: a multi-node job is one rank a node, each node's GPUs "
            "one pipeline"
        )
    refused = data_parallel_refusal(spec)
    if refused is not None:
        param, value, allowed = refused
        return f"{param} {value!r}: data-parallel ranks train {param} {allowed!r} only"
    batch = spec.train.batch_size
    if batch % gpus:
        return f"train.batch_size {batch} does not split into {gpus} equal rank shares"
    per_rank, microbatches = batch // gpus, options.num_microbatch_on(1)
    if per_rank < microbatches:
        return (
            f"each of {gpus} ranks would get {per_rank} of train.batch_size {batch} rows, "
            f"fewer than its {microbatches} micro-batches (engine.num_microbatch)"
        )
    return None
