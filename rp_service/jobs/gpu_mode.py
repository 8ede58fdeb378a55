"""How a job on several GPUs of this box runs: one process (pipeline) or one rank per GPU,
and whether one process overlaps its calls.

`engine.gpu_mode` asks; `choose_gpu_mode` decides once, at submission, and the job keeps
the decision (its `gpu_mode`: mode, ranks, reason) for every launch, resumes included. The
rule rests on issue 43's measurements (docs/SCALING.md), Qwen3-1.7B full, 262,144 tokens a
step: on 4 x H100, 4 NCCL ranks ran 89,107 tokens/s against 72,711-81,124 for one process
on the same 4 GPUs (staleness one, calls not overlapped). On 2 x H200 (session 28) one
process with overlapped calls ran 80,433 against 74,253 for the service's 2 ranks at
staleness one, and 74,183 against 73,769 at staleness zero. Ranks also cost host memory
(each holds the model), so `auto` takes them where

1. the job runs on >= 2 GPUs of this box (engine.nodes 1; a daemon with GPUs),
2. data-parallel ranks can run it (full fine-tune, sft: `data_parallel_refusal`),
3. the step is asynchronous with staleness one (`engine.async_step`, `step_staleness: 1`)
   and the job has at least 4 GPUs (below, one process with overlapped calls is faster),
4. the batch splits into equal shares of at least num_microbatch rows a rank,
5. N times one rank's host-memory plan fits the daemon's budget (conservative: each
   rank's optimizer state is counted whole, though a rank keeps only its shard);

else the pipeline, with the first reason that failed. `ranks` asked explicitly and not
runnable is a 422 naming engine.gpu_mode and the fix (on a daemon without GPUs it runs:
one CPU device a rank, gloo, as the CI tests do).

`overlap_refusal` and `overlap_by_default` decide `engine.overlap_calls` once the mode is
known: the engine's overlapped calls hide a call's pipeline fill and drain where the next
forward does not wait for the step (staleness one), at the cost of a second half-precision
copy of the trainable weights (the double buffer the optimizer writes).
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

__all__ = ["GpuMode", "choose_gpu_mode", "overlap_by_default", "overlap_refusal"]

_FIELD = "engine.gpu_mode"


@dataclass(frozen=True, slots=True)
class GpuMode:
    """What runs the job: `pipeline` (one process, `ranks` is 1) or `ranks` processes."""

    mode: Literal["pipeline", "ranks"]
    ranks: int
    reason: str
    overlap_calls: bool = False  # engine.overlap_calls as decided (one process only)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "ranks": self.ranks,
            "reason": self.reason,
            "overlap_calls": self.overlap_calls,
        }


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


# Below this many GPUs `auto` keeps one process (rule 3 of the module doc).
_RANKS_FROM_GPUS = 4


def _step_obstacle(spec: JobSpec) -> str | None:
    """Why `auto` keeps one process for this job's step and GPUs (ranks asked for still
    run)."""
    engine = spec.engine
    if not _next_forward_skips_the_step(spec):
        step = "step_staleness 0" if engine.async_step else "async_step false"
        return (
            f"with engine.{step} one process is as fast as ranks (measured on 2 GPUs: "
            "74,183 against 73,769 tokens/s; docs/SCALING.md) and holds one copy of the "
            "model; engine.gpu_mode 'ranks' takes them anyway"
        )
    if engine.gpus < _RANKS_FROM_GPUS:
        return (
            f"on {engine.gpus} GPUs one process with overlapped calls outruns ranks "
            "(measured on 2: 80,433 against 74,253 tokens/s; docs/SCALING.md); "
            "engine.gpu_mode 'ranks' takes them anyway"
        )
    return None


def overlap_refusal(spec: JobSpec, mode: GpuMode) -> str | None:
    """Why the job cannot overlap its calls (engine.overlap_calls true is then a 422), or
    None."""
    engine = spec.engine
    if engine.nodes > 1:
        return f"engine.nodes {engine.nodes}: the nodes' data-parallel ranks run without overlapped calls"
    if mode.mode == "ranks":
        return "data-parallel ranks run without overlapped calls; set engine.gpu_mode to 'pipeline'"
    if spec.train.objective != "sft":
        return f"train.objective {spec.train.objective!r} runs without overlapped calls (sft only)"
    if engine.optim_memory == "compact":
        return "engine.optim_memory 'compact' computes with each update: nothing to overlap"
    return None


def overlap_by_default(spec: JobSpec, mode: GpuMode, *, on_gpus: bool) -> bool:
    """Whether `engine.overlap_calls: auto` turns overlapped calls on (before the host
    memory check of their second copy): one process on >= 2 GPUs whose next forward does
    not wait for the step."""
    return (
        on_gpus
        and spec.engine.gpus >= 2
        and _next_forward_skips_the_step(spec)
        and overlap_refusal(spec, mode) is None
    )


def _next_forward_skips_the_step(spec: JobSpec) -> bool:
    """The asynchronous step at staleness one: the next forward computes with the weights
    from before it, so it need not wait for the step (what ranks and overlapped calls
    both want)."""
    return spec.engine.async_step and spec.engine.step_staleness == 1


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
