"""Which layer groups run, in what order: execution plans, the tracker, the backward rotation."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import torch

from .errors import ConfigError
from .threads import AnnotatedSemaphore

if TYPE_CHECKING:
    from .roundpipe import RoundPipe

__all__ = [
    "BackwardScheduleSimulator",
    "ModelExecutePlan",
    "ModelTracker",
    "RunType",
    "chunk_layer_params",
    "default_handoff",
    "group_param_cap",
    "pipeline_makespan",
    "plan_from_times",
    "plan_job_costs",
    "publish_wait_ms_per_gb",
    "rotation_calls",
    "simulate_plan",
]

log = logging.getLogger(__name__)

RunType = Literal["infer", "train", "fused"]


class ModelExecutePlan:
    """Layer groups for forward (`fwd_plan`) and backward (`bwd_plan`).

    `fwd_plan` lists ascending ranges covering every layer in order. `bwd_plan` lists the
    backward groups in execution order (last layers first), each range ascending:
    - 'infer': no backward; `bwd_plan` is empty;
    - 'train' (forward, then backward through autograd): `bwd_plan` covers every layer;
    - 'fused' (forward_backward): the last forward group runs forward and backward in one
      job, so `bwd_plan` covers the layers before it.

    `tail_split` (fused only) spreads that fused tail over several jobs on consecutive
    devices, job s taking micro-batches s, s + tail_split, ...: the tail (the head with its
    loss: ~575 ms of a 3.5 s Qwen3-1.7B step) is then no longer one job that is longer
    than a GPU's share of the step when there are many GPUs. Results are the same; the
    tail's parameter gradients are summed over its jobs.
    """

    def __init__(self) -> None:
        self.fwd_plan: list[range] = []
        self.bwd_plan: list[range] = []
        self.tail_split = 1

    def __repr__(self) -> str:
        def fmt(plan: list[range]) -> str:
            return "[" + ", ".join(f"{r.start}-{r.stop - 1}" for r in plan) + "]"

        split = f", tail_split={self.tail_split}" if self.tail_split != 1 else ""
        return f"ModelExecutePlan(fwd={fmt(self.fwd_plan)}, bwd={fmt(self.bwd_plan)}{split})"

    @classmethod
    def from_ranges(
        cls, fwd_plan: Sequence[range], bwd_plan: Sequence[range] = (), tail_split: int = 1
    ) -> ModelExecutePlan:
        """A plan from explicit ranges (and the number of jobs of the fused tail)."""
        plan = cls()
        plan.fwd_plan = list(fwd_plan)
        plan.bwd_plan = list(bwd_plan)
        plan.tail_split = tail_split
        return plan

    def check_valid(self, num_layers: int, run_type: RunType) -> None:
        """Raise ConfigError unless the plans cover the layers exactly once, in order."""
        if not self.fwd_plan:
            raise ConfigError("execute_plan.fwd_plan is empty")
        split = self.tail_split
        if isinstance(split, bool) or not isinstance(split, int) or split < 1:
            raise ConfigError(f"execute_plan.tail_split must be an int >= 1, got {split!r}")
        _check_cover(self.fwd_plan, 0, num_layers, "fwd_plan", ascending=True)
        if run_type == "infer":
            return
        stop = num_layers if run_type == "train" else self.fwd_plan[-1].start
        if stop == 0:
            if self.bwd_plan:
                raise ConfigError(
                    "execute_plan.bwd_plan must be empty when one fused group covers all layers"
                )
            return
        _check_cover(list(reversed(self.bwd_plan)), 0, stop, "bwd_plan", ascending=True)

    @classmethod
    def auto(
        cls,
        run_type: RunType,
        /,
        *models: RoundPipe,
        min_stages: int | None = None,
        upper_threshold: float = 1.1,
        model_memory_limit: float | None = None,
        num_microbatch: int | None = None,
        overlap: bool = False,
        by_size: bool = False,
    ) -> ModelExecutePlan:
        """A plan balanced on the models' measured (or size-estimated) layer times.

        Stages are grown greedily up to `upper_threshold` times the slowest layer, lowered
        until there are at least `min_stages` (default: the number of devices), and no
        stage holds more than `model_memory_limit / 2` GB of parameters (default: 60% of
        the smallest device's free memory), since the next stage is prefetched. With
        'fused' and more than one stage wanted, backward groups grow up to the fused
        tail's cost instead, so no device waits on a slower stage before it; and given
        measured times and `num_microbatch`, the group boundaries are then moved to where
        a simulation of the round-robin pipeline finishes the call soonest (short groups
        first and last fill and drain the pipeline faster; see `_pipeline_search`), and
        the fused tail is split over the number of jobs (`tail_split`, at most one per
        device) whose simulated call is shortest (with `overlap`, the shortest time between
        overlapped calls: RoundPipe overlap_calls). With `by_size`, the sizes stand for the
        times even once measured (one GPU: engine.planning.one_device). See `plan_from_times`.
        """
        from .device import get_num_devices

        if not models:
            raise ConfigError("ModelExecutePlan.auto needs at least one RoundPipe model")
        n = models[0].num_layers
        if any(m.num_layers != n for m in models):
            raise ConfigError(
                "ModelExecutePlan.auto: the models must have the same number of layers"
            )
        if min_stages is None:
            min_stages = get_num_devices()
        fwd = [0.0] * n
        bwd = [0.0] * n
        mem = [0.0] * n
        measured = True
        for m in models:
            timer = m.model_timer
            source, f, b = timer.size_estimate() if by_size else timer.get_estimate(run_type)
            measured = measured and source == "time"
            for i in range(n):
                fwd[i] += f[i]
                bwd[i] += b[i]
                mem[i] += m.layer_size[i]
        publish = None
        if overlap:
            ms_per_gb = (
                models[0].publish_ms_per_gb() if hasattr(models[0], "publish_ms_per_gb") else None
            )
            publish = [g * (ms_per_gb or DEFAULT_PUBLISH_MS_PER_GB) for g in mem]
        return plan_from_times(
            run_type,
            fwd,
            bwd,
            mem,
            num_devices=min_stages,
            num_microbatch=num_microbatch if measured else None,
            upper_threshold=upper_threshold,
            mem_cap=group_param_cap(model_memory_limit),
            overlap=overlap,
            publish=publish,
        )


def plan_from_times(
    run_type: RunType,
    fwd: Sequence[float],
    bwd: Sequence[float],
    mem: Sequence[float],
    *,
    num_devices: int,
    num_microbatch: int | None = None,
    upper_threshold: float = 1.1,
    mem_cap: float = float("inf"),
    overlap: bool = False,
    publish: Sequence[float] | None = None,
) -> ModelExecutePlan:
    """`ModelExecutePlan.auto` on given per-layer costs (forward, backward: ms over a call's
    micro-batches) and parameter sizes (GB, at most `mem_cap` per group), for `num_devices`
    devices; with `num_microbatch`, fused plans for several devices are searched on the
    pipeline simulation (`simulate_plan`: one call, or with `overlap` the time between
    overlapped calls, whose first job waits `publish` ms per layer of its group: see
    `simulate_plan`). bench/simulate.py plans hypothetical machines with it."""
    if not overlap:
        publish = None
    n = len(fwd)
    fwd, bwd, mem = list(fwd), list(bwd), list(mem)
    min_stages = num_devices
    # The slowest single layer (usually the head with its loss) is the pipeline's
    # smallest unit of work; grouping the other layers up to that size keeps stages
    # balanced while moving as few activations as possible between them.
    fwd_cap = upper_threshold * max(fwd)
    bwd_cap = upper_threshold * max(bwd)
    plan = ModelExecutePlan()
    if run_type == "fused":
        # The fused tail: the longest suffix within the cap on forward + backward cost.
        fused_cost = [f + b for f, b in zip(fwd, bwd, strict=True)]
        fused_cap = upper_threshold * max(fused_cost)
        tail_start = n - 1
        acc, acc_mem = fused_cost[-1], mem[-1]
        while tail_start > 0:
            c, m = fused_cost[tail_start - 1], mem[tail_start - 1]
            if acc + c > fused_cap or acc_mem + m > mem_cap:
                break
            acc, acc_mem, tail_start = acc + c, acc_mem + m, tail_start - 1
        if tail_start == 0 and min_stages > 1:
            tail_start = n - 1  # leave work for the other devices
        best: tuple[float, list[range], list[range], int, int] | None = None
        # One device runs everything in turn: the tail stays one job. With several, each
        # split of the tail over 1..devices jobs gets its groups and its simulated call.
        # A split sums the tail's parameter gradients in another order (part sums, then
        # their sum), which changes the last bits of fp16 weights: since plans follow
        # measured times, it is taken only where it pays clearly (3+ devices, a call 5%
        # shorter than the unsplit plan's), so 1- and 2-GPU training stays reproducible
        # bit for bit whatever the timings.
        searched = bool(num_microbatch) and min_stages >= 3
        splits = range(1, min_stages + 1) if searched else (1,)
        # Overlapped calls on 3+ devices also try tails holding the last one or two layers
        # before the head: a fused layer runs its forward once instead of a forward and a
        # recompute, and with no fill or drain to keep short the longer tail job pays.
        tails = [tail_start]
        if overlap and searched:
            tails += [t for t in (n - 2, n - 3) if 0 < t < tail_start]
        for tail_start in tails:
            acc = sum(fused_cost[tail_start:])
            if sum(mem[tail_start:]) > mem_cap and tail_start != tails[0]:
                continue
            for split in splits:
                if num_microbatch and split > num_microbatch:
                    break
                head, back = _fused_groups(
                    fwd,
                    bwd,
                    mem,
                    tail_start,
                    acc / split,
                    min_stages,
                    fwd_cap,
                    bwd_cap,
                    upper_threshold,
                    mem_cap,
                )
                cap = max(bwd_cap, upper_threshold * acc / split, fwd_cap)
                if overlap:
                    # The cap keeps a call's stages no longer than the tail so no device
                    # waits on a slower one; overlapped calls fill such waits with the
                    # other call's jobs, and the simulation judges the groups.
                    cap = float("inf")
                if num_microbatch and min_stages > 1 and head and back:
                    head, back = _best_seed(
                        fwd,
                        bwd,
                        mem,
                        tail_start,
                        head,
                        back,
                        split=split,
                        num_devices=min_stages,
                        num_microbatch=num_microbatch,
                        cap=cap,
                        mem_cap=mem_cap,
                        overlap=overlap,
                        publish=publish,
                    )
                    head, back = _pipeline_search(
                        fwd[:tail_start],
                        bwd[:tail_start],
                        mem[:tail_start],
                        acc,
                        head,
                        back,
                        num_devices=min_stages,
                        num_microbatch=num_microbatch,
                        cap=cap,
                        mem_cap=mem_cap,
                        tail_split=split,
                        overlap=overlap,
                        publish=publish,
                    )
                if len(splits) == 1:
                    best = (0.0, head, back, split, tail_start)
                    break
                trial = ModelExecutePlan.from_ranges(
                    [*head, range(tail_start, n)], list(reversed(back)), split
                )
                span = simulate_plan(
                    trial,
                    fwd,
                    bwd,
                    min_stages,
                    num_microbatch or 1,
                    overlapped=overlap,
                    publish=publish,
                )
                if best is None:  # the first tail, unsplit: the bar to beat
                    best = (span * _CLEAR_GAIN, head, back, split, tail_start)
                elif span < best[0]:
                    best = (span, head, back, split, tail_start)
        assert best is not None
        _, head, back, plan.tail_split, tail_start = best
        plan.fwd_plan = [*head, range(tail_start, n)]
        plan.bwd_plan = list(reversed(back))
    else:
        plan.fwd_plan = _balanced_groups(fwd, mem, min_stages, fwd_cap, mem_cap)
        if run_type == "train":
            plan.bwd_plan = list(reversed(_balanced_groups(bwd, mem, min_stages, bwd_cap, mem_cap)))
    plan.check_valid(n, run_type)
    return plan


# A split of the fused tail, or finer groups than the balanced ones, must make the
# simulated call at least this much shorter (both cost what the simulation does not see).
_CLEAR_GAIN = 0.95


def _uniform_groups(n: int, size: int) -> list[range]:
    """Groups of `size` layers from the top down (the short remainder at the bottom)."""
    cuts = range(n - size, 0, -size)
    return _cuts_to_groups(list(cuts), n)


def _best_seed(
    fwd: list[float],
    bwd: list[float],
    mem: list[float],
    tail_start: int,
    head: list[range],
    back: list[range],
    *,
    split: int,
    num_devices: int,
    num_microbatch: int,
    cap: float,
    mem_cap: float,
    overlap: bool = False,
    publish: Sequence[float] | None = None,
) -> tuple[list[range], list[range]]:
    """The balanced groups, or uniform groups of 1..6 layers per pass, whichever has the
    shortest simulated call: the start of `_pipeline_search`.

    The hill-climb moves one boundary at a time and stops at the first plan no single move
    improves; from the balanced groups on 8 simulated GPUs that was 58% of perfect
    scaling, where one-layer groups with the tail split 8 ways reach 89% (Qwen3-1.7B,
    16 micro-batches): many short jobs fill the round-robin evenly.
    """
    n = tail_start
    candidates_f = [head] + [_uniform_groups(n, k) for k in range(1, 7) if k < n]
    candidates_b = [back] + [_uniform_groups(n, k) for k in range(1, 7) if k < n]

    min_groups = _min_groups(n, num_devices, overlap)

    def fits(groups: list[range], cost: list[float]) -> bool:
        return _groups_fit(groups, cost, mem, min_groups=min_groups, cap=cap, mem_cap=mem_cap)

    tail = range(tail_start, len(fwd))
    balanced = ModelExecutePlan.from_ranges([*head, tail], list(reversed(back)), split)
    # The simulation charges a job boundary its latency only: every boundary also moves
    # each micro-batch's activations through host memory and keeps one more recompute
    # input there (0.5 GiB per layer for Qwen3-1.7B at 131,072 tokens). Finer groups are
    # taken only where they shorten the simulated call by 5% or more (many GPUs), so two
    # GPUs keep the measured coarse groups (1.92x on two H200s).
    best = (
        simulate_plan(
            balanced, fwd, bwd, num_devices, num_microbatch, overlapped=overlap, publish=publish
        )
        * _CLEAR_GAIN,
        head,
        back,
    )
    for f_groups in candidates_f[1:]:
        if not fits(f_groups, fwd):
            continue
        for b_groups in candidates_b[1:]:
            if not fits(b_groups, bwd):
                continue
            trial = ModelExecutePlan.from_ranges([*f_groups, tail], list(reversed(b_groups)), split)
            span = simulate_plan(
                trial, fwd, bwd, num_devices, num_microbatch, overlapped=overlap, publish=publish
            )
            if span < best[0]:
                best = (span, f_groups, b_groups)
    return best[1], best[2]


def _fused_groups(
    fwd: list[float],
    bwd: list[float],
    mem: list[float],
    tail_start: int,
    tail_job_cost: float,
    min_stages: int,
    fwd_cap: float,
    bwd_cap: float,
    upper_threshold: float,
    mem_cap: float,
) -> tuple[list[range], list[range]]:
    """Balanced forward groups before the fused tail and backward groups (ascending)."""
    head = _balanced_groups(fwd[:tail_start], mem[:tail_start], min_stages - 1, fwd_cap, mem_cap)
    # With several devices, each backward group runs on another device than the group
    # before it and gets its micro-batches no faster than that group finishes them; the
    # first waits on the fused tail (the head and its loss: the slowest stage by far).
    # Groups as long as one tail job keep both sides busy, where groups of the slowest
    # single layer left the next device idle half the time (2 H200s). One device waits on
    # no one and keeps the smaller groups: less memory.
    back_cap = max(bwd_cap, upper_threshold * tail_job_cost) if min_stages > 1 else bwd_cap
    back = _balanced_groups_from_top(
        bwd[:tail_start], mem[:tail_start], min_stages - 1, back_cap, mem_cap
    )
    return head, back


def _check_cover(plan: list[range], start: int, stop: int, what: str, *, ascending: bool) -> None:
    pos = start
    for r in plan:
        if not isinstance(r, range) or r.step != 1 or r.start != pos or r.stop <= r.start:
            raise ConfigError(
                f"execute_plan.{what} must be contiguous non-empty ranges covering layers "
                f"{start}..{stop - 1} exactly once, got {plan}"
            )
        pos = r.stop
    if pos != stop:
        raise ConfigError(
            f"execute_plan.{what} must cover layers {start}..{stop - 1} exactly once, got {plan}"
        )


def _greedy(cost: list[float], mem: list[float], cap: float, mem_cap: float) -> list[range]:
    groups: list[range] = []
    start, acc, acc_mem = 0, 0.0, 0.0
    for i, (c, m) in enumerate(zip(cost, mem, strict=True)):
        if i > start and (acc + c > cap or acc_mem + m > mem_cap):
            groups.append(range(start, i))
            start, acc, acc_mem = i, 0.0, 0.0
        acc += c
        acc_mem += m
    groups.append(range(start, len(cost)))
    return groups


def _balanced_groups(
    cost: list[float], mem: list[float], min_stages: int, cap: float, mem_cap: float
) -> list[range]:
    """Contiguous groups of at most `cap` cost and `mem_cap` GB, at least `min_stages` of
    them where the layer count allows (the cap is lowered by bisection until there are)."""
    n = len(cost)
    if n == 0:
        return []
    groups = _greedy(cost, mem, cap, mem_cap)
    want = min(max(min_stages, 1), n)
    if len(groups) >= want:
        return groups
    lo, hi = 0.0, cap
    best = [range(i, i + 1) for i in range(n)]
    for _ in range(50):
        mid = (lo + hi) / 2
        trial = _greedy(cost, mem, mid, mem_cap)
        if len(trial) >= want:
            best, lo = trial, mid
        else:
            hi = mid
    return best


def _balanced_groups_from_top(
    cost: list[float], mem: list[float], min_stages: int, cap: float, mem_cap: float
) -> list[range]:
    """`_balanced_groups` filled from the last layer down (returned in ascending order).

    Backward runs the last layers first: filling from the top leaves the short remainder
    group for the end of the backward (the shortest drain) instead of right after the
    fused tail, where a short group would wait on the tail.
    """
    n = len(cost)
    top_down = _balanced_groups(cost[::-1], mem[::-1], min_stages, cap, mem_cap)
    return [range(n - r.stop, n - r.start) for r in reversed(top_down)]


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
    plan: ModelExecutePlan,
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
    it, in the costs' unit; by default the median layer's forward for one micro-batch (on
    the H100/H200 the device -> host -> device round trip of a Qwen3-1.7B micro-batch, 5
    ms, is about one decoder layer's forward, 6 ms). Each job also costs its device one
    handoff (`pipeline_makespan`'s job_overhead), so plans of many tiny jobs pay for them.

    `calls` > 1: the duration of that many calls back to back, each call's first job
    starting once the previous call's last job has started and the device is free
    (`pipeline_makespan`'s `call_jobs`; the device rotation runs on from call to call, as
    the engine's does): how RoundPipe(overlap_calls=True) runs consecutive calls, one
    call's drain overlapping the next call's fill. `overlapped`: the steady-state time
    between two such calls instead (past `OVERLAP_FILL_CALLS` calls, over whole rotations
    of the devices: `rotation_calls`). `publish`: per layer, what the step takes to publish its new weights and a
    device to upload them (ms): an overlapped call's first job waits for those of its
    layers, since they come after the previous call's last job started.
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
    plan: ModelExecutePlan, fwd: Sequence[float], bwd: Sequence[float]
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
        # A period over part of a rotation could land on the lighter devices (0.453 s
        # instead of 0.476 s for Qwen3-1.7B on 8 GPUs at 16 micro-batches).
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
# publish_ms_per_gb): on the H100 box the fp32 -> fp16 publish of Qwen3-1.7B took
# 0.16-0.33 s for its 3.4 GB (50-100 ms/GB), the upload ~20 ms/GB at 50 GB/s.
DEFAULT_PUBLISH_MS_PER_GB = 100.0


def group_param_cap(model_memory_limit: float | None = None) -> float:
    """The most parameters (GB) one layer group may hold: half of `model_memory_limit`,
    since the next group is prefetched beside it (default: 60% of the smallest device's
    free memory, ModelExecutePlan.auto's)."""
    if model_memory_limit is None:
        from .device import get_min_gpu_memory

        model_memory_limit = get_min_gpu_memory() * 0.6
    return model_memory_limit / 2


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


def _min_groups(n: int, num_devices: int, overlap: bool) -> int:
    """The fewest groups a pass of `n` layers is searched with: one per device but the
    tail's, so every device has a job in a call. Overlapped calls need none: the next
    call's jobs fill the devices this call's do not reach."""
    return 1 if overlap else min(max(num_devices - 1, 1), n)


def _groups_fit(
    groups: Sequence[range],
    cost: Sequence[float],
    mem: Sequence[float],
    *,
    min_groups: int,
    cap: float,
    mem_cap: float,
) -> bool:
    """At least `min_groups` groups, each a single layer or within `cap` cost and `mem_cap`
    memory: the groups a search may propose."""
    return len(groups) >= min_groups and all(
        len(g) == 1 or (sum(cost[i] for i in g) <= cap and sum(mem[i] for i in g) <= mem_cap)
        for g in groups
    )


def _cuts_to_groups(cuts: Sequence[int], n: int) -> list[range]:
    bounds = [0, *sorted(cuts), n]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def _pipeline_search(
    fwd: list[float],
    bwd: list[float],
    mem: list[float],
    tail_cost: float,
    head: list[range],
    back: list[range],
    *,
    num_devices: int,
    num_microbatch: int,
    cap: float,
    mem_cap: float,
    tail_split: int = 1,
    overlap: bool = False,
    publish: Sequence[float] | None = None,
) -> tuple[list[range], list[range]]:
    """Forward and backward groups (ascending) with the shortest simulated call (with
    `overlap`: the shortest time between overlapped calls).

    Hill-climbing from the balanced groups: add, remove or move one group boundary of
    either pass while `pipeline_makespan` improves, keeping every group within `cap` cost
    and `mem_cap` memory and at least `num_devices - 1` groups per pass. Balanced groups
    leave devices idle while the pipeline fills and drains at every call: measured on two
    H200s, 84% of twice one GPU's tokens/s.
    """
    n = len(fwd)
    min_groups = _min_groups(n, num_devices, overlap)
    handoff = default_handoff(fwd, num_microbatch)

    def ok(groups: list[range], cost: list[float]) -> bool:
        return _groups_fit(groups, cost, mem, min_groups=min_groups, cap=cap, mem_cap=mem_cap)

    def makespan(fcuts: frozenset[int], bcuts: frozenset[int]) -> float:
        return _simulate_groups(
            fwd,
            bwd,
            _cuts_to_groups(fcuts, n),
            tail_cost,
            reversed(_cuts_to_groups(bcuts, n)),
            num_devices=num_devices,
            num_microbatch=num_microbatch,
            handoff=handoff,
            tail_split=tail_split,
            overlapped=overlap,
            publish=publish,
        )

    def neighbours(cuts: frozenset[int]) -> list[frozenset[int]]:
        out = [cuts - {c} for c in cuts]
        out += [cuts | {c} for c in range(1, n) if c not in cuts]
        for c in cuts:
            for d in (-2, -1, 1, 2):
                if 0 < c + d < n and c + d not in cuts:
                    out.append((cuts - {c}) | {c + d})
        return out

    fcuts = frozenset(g.start for g in head[1:])
    bcuts = frozenset(g.start for g in back[1:])
    best = makespan(fcuts, bcuts)
    for _ in range(4 * n):  # each round improves or stops; bounded for safety
        improved = False
        for which in ("fwd", "bwd"):
            cost = fwd if which == "fwd" else bwd
            for cand in neighbours(fcuts if which == "fwd" else bcuts):
                if not ok(_cuts_to_groups(cand, n), cost):
                    continue
                trial = makespan(cand, bcuts) if which == "fwd" else makespan(fcuts, cand)
                if trial < best * (1 - 1e-6):
                    best, improved = trial, True
                    if which == "fwd":
                        fcuts = cand
                    else:
                        bcuts = cand
        if not improved:
            break
    return _cuts_to_groups(fcuts, n), _cuts_to_groups(bcuts, n)


class ModelTracker:
    """Counters that let a group start micro-batch i once the group before it finished it."""

    def __init__(
        self,
        execute_plan: ModelExecutePlan,
        num_layers: int | None = None,
        recompute_grain: str = "stage",
    ) -> None:
        self.fwd_plan = execute_plan.fwd_plan
        self.bwd_plan = execute_plan.bwd_plan
        self.fwd_sem = [AnnotatedSemaphore(f"fwd_group{g}.done") for g in range(len(self.fwd_plan))]
        self.bwd_sem = [AnnotatedSemaphore(f"bwd_group{g}.done") for g in range(len(self.bwd_plan))]
        self.fused_fwd_sem = AnnotatedSemaphore("fused.forward_done")
        if recompute_grain == "layer":
            if num_layers is None:
                num_layers = max((r.stop for r in execute_plan.fwd_plan), default=0)
            self._need_input = set(range(num_layers))
        else:
            self._need_input = {r.start for r in self.bwd_plan}

    def backward_need_input(self, layer_id: int) -> bool:
        """Whether the backward re-runs from this layer's input (so forward keeps it)."""
        return layer_id in self._need_input

    def forward_notify(self, layer_group_id: int) -> None:
        """A forward group finished one more micro-batch."""
        self.fwd_sem[layer_group_id].release()

    def backward_notify(self, layer_group_id: int) -> None:
        """A backward group finished one more micro-batch."""
        self.bwd_sem[layer_group_id].release()

    def fused_forward_notify(self) -> None:
        """The fused group finished the forward part of one more micro-batch."""
        self.fused_fwd_sem.release()


class BackwardScheduleSimulator:
    """Keeps the device rotation going across backward jobs launched by autograd.

    Backward groups run on the next devices in the same round-robin as forward, so a
    backward launched later by autograd continues where the forward left off; `reset`
    starts a fresh rotation.
    """

    def __init__(self) -> None:
        from .device import get_num_devices

        self.n_devices = get_num_devices()
        self.cur_device = 0
        self.tags = [torch.zeros(()) for _ in range(self.n_devices)]

    def get_next_tag(self) -> torch.Tensor:
        """The tag of the next device in rotation."""
        tag = self.tags[self.cur_device]
        self.cur_device = (self.cur_device + 1) % self.n_devices
        return tag

    def update_current_tag(self, new_tag: torch.Tensor) -> None:
        """Remember the tag produced by the latest backward."""
        self.tags[(self.cur_device - 1) % self.n_devices] = new_tag

    def reset(self) -> None:
        """Start a new rotation."""
        self.cur_device = 0


def chunk_layer_params(
    tensor_pair: list[tuple[torch.Tensor, torch.Tensor]], n_chunks: int
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Spread copy work over `n_chunks` with the greedy largest-first partition."""
    chunks: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(max(1, n_chunks))]
    load = [0] * len(chunks)
    for pair in sorted(tensor_pair, key=lambda p: -p[0].numel() * p[0].element_size()):
        i = load.index(min(load))
        chunks[i].append(pair)
        load[i] += pair[0].numel() * pair[0].element_size()
    return chunks
