"""The pipeline simulator: how long a fused plan's call takes on the round-robin devices.

The engine hands each job (a layer group over every micro-batch) to the next device in
rotation; `pipeline_makespan` replays that from per-job costs, `simulate_plan` from a
plan's groups and per-layer costs. The plan search (engine.planning.search) ranks plans
with it, and bench/simulate.py predicts machines the engine has not run on.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from ..scheduler import ModelExecutePlan

__all__ = [
    "DEFAULT_PUBLISH_MS_PER_GB",
    "OVERLAP_FILL_CALLS",
    "OVERLAP_STEADY_CALLS",
    "UPLOAD_MS_PER_GB",
    "PlanGroups",
    "default_handoff",
    "pipeline_makespan",
    "plan_job_costs",
    "publish_wait_ms_per_gb",
    "rotation_calls",
    "simulate_plan",
]


class PlanGroups(NamedTuple):
    """A fused plan's layer groups, as a `ModelExecutePlan` holds them (forward groups
    ascending, the last one the fused tail; backward groups in execution order)."""

    fwd_plan: list[range]
    bwd_plan: list[range]
    tail_split: int = 1


def pipeline_makespan(
    job_costs: Sequence[float],
    num_devices: int,
    num_microbatch: int,
    handoff: float = 0.0,
    *,
    split_job: int | Collection[int] | None = None,
    split: int = 1,
    job_overhead: float = 0.0,
    call_jobs: int | None = None,
    call_delay: float = 0.0,
    call_ends: list[float] | None = None,
) -> float:
    """When the last of a call's jobs finishes, in the engine's round-robin pipeline.

    Job k (in launch order: forward groups, the fused tail, backward groups) runs on the
    next device in rotation after that device's previous job, and its micro-batch i
    `handoff` after micro-batch i of the job before finished (the download and upload of
    the activations in between); `job_costs` are per micro-batch. With `split_job` (one
    job index or several), that job is `split` jobs on consecutive devices, job s taking
    micro-batches s, s + split, ... (ModelExecutePlan.tail_split). Every job also costs its
    device `job_overhead` before its first micro-batch (its setup and the part of its
    upload that is not hidden).

    `call_jobs`: `job_costs` are several calls of that many jobs back to back, and a
    call's first job depends on the call before only through the weights: it starts
    `handoff` after the previous call's last job started (that job has taken its copy of
    the first layers' weights, so the next ones may be published), not micro-batch by
    micro-batch (see `simulate_plan`'s `calls`). `call_delay`: what that first job waits
    beyond the handoff (the step publishing its layers' weights, then their upload, which
    cannot be prefetched before). `call_ends`: gets, after each call's jobs, when the
    calls so far are done (a job never changes an earlier one, so the first c values are
    the makespans of the first c calls alone).
    """
    split_jobs = {split_job} if isinstance(split_job, int) else set(split_job or ())
    free = [0.0] * num_devices
    prev: list[float] | None = None
    prev_start = 0.0
    device = 0
    for k, cost in enumerate(job_costs):
        parts = split if k in split_jobs else 1
        new_call = call_jobs is not None and k > 0 and k % call_jobs == 0
        done = [0.0] * num_microbatch
        start = float("inf")
        for part in range(parts):
            t = free[device] + job_overhead
            if new_call:
                t = max(t, prev_start + handoff + call_delay)
            for i in range(part, num_microbatch, parts):
                if not new_call and prev is not None and prev[i] + handoff > t:
                    t = prev[i] + handoff
                start = min(start, t)
                t += cost
                done[i] = t
            free[device] = t
            device = (device + 1) % num_devices
        prev, prev_start = done, start
        if call_ends is not None and call_jobs is not None and (k + 1) % call_jobs == 0:
            call_ends.append(max(free))
    return max(free)


def simulate_plan(
    plan: ModelExecutePlan | PlanGroups,
    fwd: Sequence[float],
    bwd: Sequence[float],
    num_devices: int,
    num_microbatch: int,
    handoff: float | None = None,
    *,
    calls: int = 1,
    overlapped: bool = False,
    publish: Sequence[float] | None = None,
) -> float:
    """The simulated duration of one `forward_backward` call of a fused plan, from
    per-layer forward and backward costs over the call's micro-batches (`pipeline_makespan`).

    `handoff` is the time between one job finishing a micro-batch and the next starting
    it, in the costs' unit; by default the median layer's forward for one micro-batch (the
    device -> host -> device round trip of a micro-batch takes about one decoder layer's
    forward: bench/RESULTS.md). Each job also costs its device one handoff
    (`pipeline_makespan`'s job_overhead), so plans of many tiny jobs pay for them.

    `calls` > 1: the duration of that many calls back to back, each call's first job
    starting once the previous call's last job has started and the device is free
    (`pipeline_makespan`'s `call_jobs`; the device rotation runs on from call to call, as
    the engine's does): how RoundPipe(overlap_calls=True) runs consecutive calls, one
    call's drain overlapping the next call's fill. `overlapped`: the steady-state time
    between two such calls instead (past `OVERLAP_FILL_CALLS` calls, over whole rotations
    of the devices: `rotation_calls`). `publish`: per layer, what the step takes to
    publish its new weights and a device to upload them (ms): an overlapped call's first
    job waits for those of its layers, since they come after the previous call's last job
    started.
    """
    if handoff is None:
        handoff = default_handoff(fwd, num_microbatch)
    return _simulate_jobs(
        plan_job_costs(plan, fwd, bwd),
        len(plan.fwd_plan) - 1,
        num_devices=num_devices,
        num_microbatch=num_microbatch,
        handoff=handoff,
        tail_split=plan.tail_split,
        calls=calls,
        overlapped=overlapped,
        call_delay=_call_delay(publish, plan.fwd_plan[0]) if calls > 1 or overlapped else 0.0,
    )


def default_handoff(fwd: Sequence[float], num_microbatch: int) -> float:
    """`simulate_plan`'s default handoff: the median layer's forward for one micro-batch."""
    return sorted(fwd)[len(fwd) // 2] / num_microbatch


def plan_job_costs(
    plan: ModelExecutePlan | PlanGroups, fwd: Sequence[float], bwd: Sequence[float]
) -> list[float]:
    """A fused plan's jobs in launch order (forward groups, the fused tail as one job before
    its split, backward groups), each its cost over all micro-batches: what `simulate_plan`
    runs."""
    tail_cost = sum(fwd[i] + bwd[i] for i in plan.fwd_plan[-1])
    return _job_costs(fwd, bwd, plan.fwd_plan[:-1], tail_cost, plan.bwd_plan)


def _job_costs(
    fwd: Sequence[float],
    bwd: Sequence[float],
    fwd_groups: Sequence[range],
    tail_cost: float,
    bwd_groups: Iterable[range],
) -> list[float]:
    jobs = [sum(fwd[i] for i in g) for g in fwd_groups]
    jobs.append(tail_cost)
    jobs += [sum(bwd[i] for i in g) for g in bwd_groups]
    return jobs


def _simulate_groups(
    fwd: Sequence[float],
    bwd: Sequence[float],
    fwd_groups: Sequence[range],
    tail_cost: float,
    bwd_groups: Iterable[range],
    *,
    num_devices: int,
    num_microbatch: int,
    handoff: float,
    tail_split: int,
    overlapped: bool = False,
    publish: Sequence[float] | None = None,
) -> float:
    """`_simulate_jobs` of forward groups, the fused tail (`tail_cost`) and backward groups."""
    first = fwd_groups[0] if fwd_groups else range(len(fwd))
    return _simulate_jobs(
        _job_costs(fwd, bwd, fwd_groups, tail_cost, bwd_groups),
        len(fwd_groups),
        num_devices=num_devices,
        num_microbatch=num_microbatch,
        handoff=handoff,
        tail_split=tail_split,
        overlapped=overlapped,
        call_delay=_call_delay(publish, first),
    )


def _call_delay(publish: Sequence[float] | None, first_group: range) -> float:
    """What an overlapped call's first job waits for its layers' weights (see
    `simulate_plan`'s `publish`)."""
    return 0.0 if publish is None else sum(publish[i] for i in first_group)


def _simulate_jobs(
    jobs: list[float],
    tail_index: int,
    *,
    num_devices: int,
    num_microbatch: int,
    handoff: float,
    tail_split: int,
    calls: int = 1,
    overlapped: bool = False,
    call_delay: float = 0.0,
) -> float:
    """`pipeline_makespan` of one call's jobs (costs over all micro-batches, in launch order;
    job `tail_index` split over `tail_split` jobs), `calls` times back to back; with
    `overlapped`, the steady-state period of overlapped calls instead."""
    ends: list[float] | None = None
    if overlapped:
        # A period over part of a rotation could land on the lighter devices and come out
        # short (bench/RESULTS.md, 2026-11-24 evening).
        rotation = rotation_calls(len(jobs) - 1 + tail_split, num_devices)
        steady = rotation * -(-OVERLAP_STEADY_CALLS // rotation)
        calls, ends = OVERLAP_FILL_CALLS + steady, []
    span = pipeline_makespan(
        [j / num_microbatch for j in jobs] * calls,
        num_devices,
        num_microbatch,
        handoff,
        split_job=[c * len(jobs) + tail_index for c in range(calls)],
        split=tail_split,
        job_overhead=handoff,
        call_jobs=len(jobs) if calls > 1 else None,
        call_delay=call_delay,
        call_ends=ends,
    )
    if ends is None:
        return span
    return (ends[-1] - ends[OVERLAP_FILL_CALLS - 1]) / (len(ends) - OVERLAP_FILL_CALLS)


# What the step takes to publish a layer's new weights and a device to upload them, per GB
# of the layer's parameters, before the engine has measured its own (RoundPipe
# publish_ms_per_gb): the top of the fp32 -> fp16 publish rates measured on an H100 box,
# plus the upload (bench/RESULTS.md, "Figures moved out of engine docstrings").
DEFAULT_PUBLISH_MS_PER_GB = 100.0

# A device's upload of a GB of weights from pinned host memory (~50 GB/s).
UPLOAD_MS_PER_GB = 20.0


def publish_wait_ms_per_gb(publish_s: float, model_gb: float) -> float:
    """What an overlapped call's first job waits per GB of its layers' weights, from a
    step's measured publish of the whole model (`publish_s` for `model_gb`): the publish
    at that rate, then the upload."""
    return publish_s * 1000 / model_gb + UPLOAD_MS_PER_GB


# The overlapped period is taken past this many calls (the first calls' fill; two were
# too few for 8 GPUs at 16 micro-batches), over whole rotations of at least this many.
OVERLAP_FILL_CALLS = 4
OVERLAP_STEADY_CALLS = 4


def rotation_calls(jobs_per_call: int, num_devices: int) -> int:
    """Calls after which the device rotation starts over: the engine hands each job (and
    each part of a split tail) to the next device, so the calls' jobs land on the same
    devices again after lcm(jobs a call, devices) jobs."""
    return num_devices // math.gcd(jobs_per_call, num_devices)
