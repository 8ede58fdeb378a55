"""The plan search: layer groups balanced on measured layer times, then tuned on the
pipeline simulation (engine.planning.simulate).

`plan_groups` is what `ModelExecutePlan.auto` runs (through `scheduler.plan_from_times`):
groups grown greedily up to a cap on cost and parameters, lowered until every device has
work; for fused plans on several devices, the best of the balanced and uniform groups
(`_best_seed`) improved one boundary at a time (`_pipeline_search`) and the fused tail
split over the number of jobs whose simulated call is shortest.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..device import get_min_gpu_memory
from .simulate import PlanGroups, _simulate_groups, default_handoff, simulate_plan

if TYPE_CHECKING:
    from ..scheduler import RunType

__all__ = ["group_param_cap", "plan_groups"]


def plan_groups(
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
    fixed_tail: tuple[int | None, int] | None = None,
) -> PlanGroups:
    """The layer groups `ModelExecutePlan.auto` takes, from per-layer costs (forward,
    backward: ms over a call's micro-batches) and parameter sizes (GB, at most `mem_cap`
    per group), for `num_devices` devices; with `num_microbatch`, fused plans for several
    devices are searched on the pipeline simulation (`simulate_plan`: one call, or with
    `overlap` the time between overlapped calls, whose first job waits `publish` ms per
    layer of its group: see `simulate_plan`). A given `fixed_tail` (the fused tail's first
    layer, or None to choose it; its split) is taken as it is instead of searched. `scheduler.plan_from_times`
    makes them a checked ModelExecutePlan."""
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
        # their sum), which changes the last bits of the weights: it is taken only where it
        # pays clearly (3+ devices, a call 5% shorter than the unsplit plan's), and
        # ModelExecutePlan.auto passes the tail it chose from the layer sizes
        # (`fixed_tail`: a split tail's extent decides which layers sum in parts), so
        # measured times never make two identical runs sum differently.
        searched = bool(num_microbatch) and min_stages >= 3
        splits: Sequence[int] = range(1, min_stages + 1) if searched else (1,)
        if fixed_tail is not None:
            start, split = fixed_tail
            tail_start = tail_start if start is None else start
            splits = (max(1, min(split, min_stages, num_microbatch or split)),)
        # Overlapped calls on 3+ devices also try tails holding the last one or two layers
        # before the head: a fused layer runs its forward once instead of a forward and a
        # recompute, and with no fill or drain to keep short the longer tail job pays.
        tails = [tail_start]
        if overlap and searched and (fixed_tail is None or fixed_tail[0] is None):
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
                if len(splits) == 1 and len(tails) == 1:
                    best = (0.0, head, back, split, tail_start)
                    break
                trial = PlanGroups([*head, range(tail_start, n)], list(reversed(back)), split)
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
        _, head, back, tail_split, tail_start = best
        return PlanGroups([*head, range(tail_start, n)], list(reversed(back)), tail_split)
    fwd_plan = _balanced_groups(fwd, mem, min_stages, fwd_cap, mem_cap)
    bwd_plan: list[range] = []
    if run_type == "train":
        bwd_plan = list(reversed(_balanced_groups(bwd, mem, min_stages, bwd_cap, mem_cap)))
    return PlanGroups(fwd_plan, bwd_plan)


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
    improves; from the balanced groups on many simulated GPUs that stops far below what
    one-layer groups with the tail split over the devices reach (bench/RESULTS.md): many
    short jobs fill the round-robin evenly.
    """
    n = tail_start
    candidates_f = [head] + [_uniform_groups(n, k) for k in range(1, 7) if k < n]
    candidates_b = [back] + [_uniform_groups(n, k) for k in range(1, 7) if k < n]

    min_groups = _min_groups(n, num_devices, overlap)

    def fits(groups: list[range], cost: list[float]) -> bool:
        return _groups_fit(groups, cost, mem, min_groups=min_groups, cap=cap, mem_cap=mem_cap)

    tail = range(tail_start, len(fwd))
    balanced = PlanGroups([*head, tail], list(reversed(back)), split)
    # The simulation charges a job boundary its latency only: every boundary also moves
    # each micro-batch's activations through host memory and keeps one more recompute
    # input there. Finer groups are taken only where they shorten the simulated call by 5%
    # or more (many GPUs), so two GPUs keep the coarse groups measured best there
    # (bench/RESULTS.md).
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
            trial = PlanGroups([*f_groups, tail], list(reversed(b_groups)), split)
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
    # single layer left the next device idle half the time (bench/RESULTS.md). One device
    # waits on no one and keeps the smaller groups: less memory.
    back_cap = max(bwd_cap, upper_threshold * tail_job_cost) if min_stages > 1 else bwd_cap
    back = _balanced_groups_from_top(
        bwd[:tail_start], mem[:tail_start], min_stages - 1, back_cap, mem_cap
    )
    return head, back


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


def group_param_cap(model_memory_limit: float | None = None) -> float:
    """The most parameters (GB) one layer group may hold: half of `model_memory_limit`,
    since the next group is prefetched beside it (default: 60% of the smallest device's
    free memory, ModelExecutePlan.auto's)."""
    if model_memory_limit is None:
        model_memory_limit = get_min_gpu_memory() * 0.6
    return model_memory_limit / 2


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
    leave devices idle while the pipeline fills and drains at every call (bench/RESULTS.md,
    scaling over GPUs).
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
