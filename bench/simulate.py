"""Predict RoundPipe's tokens/s on 1, 2, 4 and 8 GPUs from per-layer times measured on one.

Input: result lines of `bench/train.py` (JSON, one per run) that carry `layer_times_ms`
(the engine's smoothed per-layer forward and backward times over a step's micro-batches),
`num_microbatch`, `num_devices` and `step_s_median`. From the one-GPU runs of each
micro-batch count it takes:
- the per-layer times, every decoder layer set to the median decoder layer (the engine's
  timer splits a group's time evenly among its layers, and a group that waits on an
  upload inflates all of its layers: uniform layers remove that noise; `--raw` keeps them);
- the per-call overhead: the measured step less the simulated one-GPU call (the first
  upload, the last download, the step's Python around the jobs);
- with `--dispatch`, the host's issue time per step: the step time of the same layer
  structure with tiny matrices (`bench/train.py --model tiny28`), where the GPU work is
  negligible and the step measures how long the Python threads take to issue it. All
  device threads of one process share the interpreter lock, so no number of GPUs makes a
  step shorter than that.

For each GPU count it plans the step as the engine would (`engine.scheduler.plan_from_times`,
which also picks how many jobs the head with its loss is split over), simulates the
round-robin pipeline (`simulate_plan`), and predicts

    step(D) = max(simulated call(D) + overhead, dispatch floor, optimizer floor)

The optimizer floor is the optimizer thread's work per step as the one-GPU run measured it
(`optimizer_thread_s`: publishing the weights, folding the gradients, step_fn): the
asynchronous step hides it behind the next call only while the call is longer.
`--no-optimizer-floor` leaves it out (a host with more cores and memory bandwidth).

Checks: every multi-GPU run in the input (with the plan it ran, from its `plan` field) is
simulated with the one-GPU times of its own file and micro-batch count; the result lines
say how far the prediction is from the measurement (against the steps that compiled
nothing, `tokens_per_s_steps_without_compile`, where the run reports it).

`--fit-handoff` recalibrates the model on those multi-GPU runs: one constant, the handoff
between two jobs (per micro-batch, also charged once per job: `simulate_plan`'s `handoff`),
is chosen to fit the runs with the plans they ran (least squares on the log of the step),
every prediction on several GPUs then uses it (`handoff_ms`
in the rows, one `kind: calibration` row per input). The engine still plans with its own
default handoff (`engine.planning.simulate.default_handoff`): the fit prices the engine's
plans, it does not change them. A run that overlapped its calls (`overlap_calls` in its line) is checked, and fitted, as
the steady period of overlapped calls of the plan it ran. `--fit-call-gap` fits, beside the
handoff, a plain call's gap on several GPUs (`call_gap_ms`: the host issuing the pipeline's
fill and drain at the call's ends, which overlapped calls hide); it needs plain and
overlapped multi-GPU runs in the input (`bench/sim_inputs/h200x2-overlap-2026-11-29.jsonl`).
`--uniform-plans` adds to each prediction the fastest plan
of evenly sized groups under the simulated costs (`uniform_*` fields): what a plan made for
the fitted handoff could reach.

    python bench/simulate.py bench/sim_inputs/h100-2026-11-23.jsonl
    python bench/simulate.py bench/sim_inputs/h200x4-2026-11-28.jsonl --fit-handoff --uniform-plans
    python bench/simulate.py RUNS.jsonl --devices 1 2 4 8 --dispatch DISPATCH.jsonl

Prints one JSON line per prediction (`kind: prediction`), per check (`kind: check`) and a
summary per GPU count of the best micro-batch count (`kind: best`).

`--overlap` adds to each prediction the step with RoundPipe(overlap_calls=True)
(`overlap_*` fields, and `kind: best_overlap`): the next call's first jobs fill the
pipeline while this call's last jobs drain it. The plan is made for it
(`plan_from_times(overlap=True)`), the period is the steady state of calls back to back
(`simulate_plan(overlapped=True)`: past the first calls, over whole rotations of the
devices): the next call's first job starts once this call's last job has started and
the step has published its layers' weights (the run's publish time per GB, plus their
upload; with double-buffered weights the publish is a swap), every device running its jobs
in launch order. `busy_*` is the busiest device's work over a rotation with no waiting at
all: a bound no order of jobs can beat.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.planning.simulate import (
    default_handoff,
    plan_job_costs,
    publish_wait_ms_per_gb,
    simulate_plan,
)
from engine.planning.simulate import rotation_calls as scheduler_rotation_calls
from engine.scheduler import ModelExecutePlan, plan_from_times


@dataclass
class Measured:
    """One GPU's per-layer times and step at one micro-batch count."""

    num_microbatch: int
    fwd: list[float]
    bwd: list[float]
    step_s: float
    tokens_per_step: int
    source: str
    # The optimizer thread's work per step (publish + fold + step_fn, s) and the publish
    # time per GB of weights plus their upload (ms), where the run reported them.
    optimizer_s: float | None = None
    publish: list[float] | None = None  # per layer, ms (simulate_plan's `publish`)
    # The handoff between jobs on different devices (ms a micro-batch; None:
    # simulate_plan's default), as `fit_handoff` fitted it. One device's layer times add
    # up to its step (they run back to back, the next job's inputs prefetched), so its
    # prediction keeps the default.
    handoff_ms: float | None = None
    # What a call on several GPUs costs beyond its jobs when calls run one after the other
    # (ms): the host issuing the pipeline's fill and drain at the call's ends, which
    # overlapped calls hide (session 28: +5% on 2 GPUs where the model had predicted
    # nothing). 0 unless `fit_handoff(..., call_gap=True)` fitted it to plain and
    # overlapped runs.
    call_gap_ms: float = 0.0

    @classmethod
    def of(cls, run: dict[str, Any], fwd: list[float], bwd: list[float]) -> Measured:
        phases = run.get("optimizer_thread_s") or {}
        work = [phases.get(k) for k in ("publish_s", "fold_s", "step_fn_s")]
        optimizer_s = sum(work) if all(w is not None for w in work) else None  # type: ignore[misc]
        publish = None
        layer_gb = run.get("layer_gb")
        if layer_gb and phases.get("publish_s") and len(layer_gb) == len(fwd):
            # as RoundPipe.publish_ms_per_gb measures it
            ms_per_gb = publish_wait_ms_per_gb(phases["publish_s"], sum(layer_gb))
            publish = [g * ms_per_gb for g in layer_gb]
        return cls(
            int(run["num_microbatch"]),
            fwd,
            bwd,
            float(run["step_s_median"]),
            int(run["tokens_per_step"]),
            run["_file"],
            optimizer_s,
            publish,
        )

    def one_gpu_call_s(self) -> float:
        """The simulated one-GPU call (s) of these times."""
        m = self.num_microbatch
        mem = [0.0] * len(self.fwd)
        one = plan_from_times("fused", self.fwd, self.bwd, mem, num_devices=1, num_microbatch=m)
        return simulate_plan(one, self.fwd, self.bwd, 1, m) / 1000

    def handoff_on(self, devices: int) -> float | None:
        """The handoff (ms a micro-batch) to simulate `devices` GPUs with (None: the
        default)."""
        return self.handoff_ms if devices > 1 else None

    def calibrate(self) -> None:
        """Where the simulated one-GPU call is longer than the measured step, scale the
        layer times down to it. The engine's per-layer times are moving averages that
        still carry the slower first iterations: added up they overshoot the step (by 4%
        in the overlapped 2026-11-24 runs), and a negative per-call overhead subtracted
        from every prediction would inflate the multi-GPU ones by as much per call."""
        call_s = self.one_gpu_call_s()
        if call_s > self.step_s:
            scale = self.step_s / call_s
            self.fwd = [t * scale for t in self.fwd]
            self.bwd = [t * scale for t in self.bwd]
        self.__dict__.pop("overhead_s", None)

    @functools.cached_property
    def overhead_s(self) -> float:
        """The measured step less the simulated one-GPU call (0 once calibrated down):
        what a call costs besides its jobs (the first upload, the last download, the
        Python around the jobs)."""
        return max(self.step_s - self.one_gpu_call_s(), 0.0)


def uniform_layers(times: list[float]) -> list[float]:
    """First and last layer as measured, every layer between them the median of those."""
    if len(times) < 3:
        return list(times)
    mid = statistics.median(times[1:-1])
    return [times[0], *([mid] * (len(times) - 2)), times[-1]]


def load_runs(paths: list[Path]) -> list[dict[str, Any]]:
    runs = []
    for path in paths:
        for line in path.read_text().splitlines():
            line = line.strip()
            if line.startswith("{"):
                row = json.loads(line)
                row["_file"] = path.name
                runs.append(row)
    return runs


def one_gpu_times(runs: list[dict[str, Any]], raw: bool) -> dict[tuple[str, int], Measured]:
    """(file, micro-batches) -> the one-GPU measurement (the latest line wins)."""
    out = {}
    for r in runs:
        times = r.get("layer_times_ms")
        if r.get("num_devices") != 1 or not times:
            continue
        fwd, bwd = times["fwd"], times["bwd"]
        if not raw:
            fwd, bwd = uniform_layers(fwd), uniform_layers(bwd)
        meas = Measured.of(r, fwd, bwd)
        meas.calibrate()
        out[(r["_file"], int(r["num_microbatch"]))] = meas
    return out


def dispatch_floor(runs: list[dict[str, Any]]) -> dict[int, float]:
    """Micro-batches -> the step time (s) of the tiny-matrix run of the same structure."""
    return {int(r["num_microbatch"]): float(r["step_s_median"]) for r in runs}


_RANGE = re.compile(r"(\d+)-(\d+)")


def parse_plan(text: str) -> ModelExecutePlan:
    """The plan from its repr: `ModelExecutePlan(fwd=[0-6, ...], bwd=[...], tail_split=2)`."""
    fwd_text, _, rest = text.partition("bwd=")
    split = re.search(r"tail_split=(\d+)", rest)

    def ranges(part: str) -> list[range]:
        return [range(int(a), int(b) + 1) for a, b in _RANGE.findall(part.split("]")[0])]

    return ModelExecutePlan.from_ranges(
        ranges(fwd_text), ranges(rest), int(split.group(1)) if split else 1
    )


def rotation_calls(plan: ModelExecutePlan, devices: int, m: int) -> int:
    """Calls after which the engine's device rotation starts over for `plan`
    (`engine.planning.simulate.rotation_calls`; a split tail runs on at most `m` devices)."""
    jobs = len(plan.fwd_plan) - 1 + min(plan.tail_split, m) + len(plan.bwd_plan)
    return scheduler_rotation_calls(jobs, devices)


def busy_bound_s(
    plan: ModelExecutePlan,
    fwd: list[float],
    bwd: list[float],
    devices: int,
    m: int,
    handoff: float | None = None,
) -> float:
    """The busiest device's work per call (s) over a whole rotation of calls: its jobs'
    micro-batches plus one handoff per job (ms; `simulate_plan`'s default without), as
    `simulate_plan` costs them, with no waiting.
    The device rotation runs on from call to call as the engine's does, so a call's jobs
    land on other devices the next time. No overlap of calls can make a call's share
    shorter."""
    calls = rotation_calls(plan, devices, m)
    if handoff is None:
        handoff = default_handoff(fwd, m)
    jobs = plan_job_costs(plan, fwd, bwd)
    tail = len(plan.fwd_plan) - 1
    busy = [0.0] * devices
    device = 0
    for _ in range(calls):
        for k, cost in enumerate(jobs):
            parts = min(plan.tail_split, m) if k == tail else 1
            for part in range(parts):
                busy[device] += handoff + cost / m * len(range(part, m, parts))
                device = (device + 1) % devices
    return max(busy) / calls / 1000


def uniform_plans(n_layers: int, devices: int) -> list[ModelExecutePlan]:
    """Plans of evenly sized groups: the first layer alone, forward groups of g decoder
    layers, the last layer as the fused tail split over up to `devices` jobs, backward
    groups of b layers (g, b from 1 to 14): the family `--uniform-plans` searches, to see
    what a plan made for the fitted handoff could reach (the engine plans with its default)."""
    last = n_layers - 1
    plans = []
    for g in (1, 2, 3, 4, 5, 7, 10, 14, last - 1):
        fwd = [range(0, 1), *(range(i, min(i + g, last)) for i in range(1, last, g))]
        for b in (1, 2, 3, 4, 5, 7, 10, 14):
            bwd = [range(max(i - b, 0), i) for i in range(last, 0, -b)]
            for split in (1, 2, 4, 8):
                if split <= devices:
                    plans.append(
                        ModelExecutePlan.from_ranges([*fwd, range(last, n_layers)], bwd, split)
                    )
    return plans


def _bounded(
    call_s: float, overhead: float, floor: float | None, optimizer_s: float | None = None
) -> tuple[float, str]:
    """The step from a simulated call, its overhead, the host's issue time and the
    optimizer thread's work per step (the asynchronous step hides it only up to a step)."""
    step, bound = call_s + overhead, "pipeline"
    for limit, name in ((floor, "dispatch"), (optimizer_s, "optimizer")):
        if limit is not None and limit > step:
            step, bound = limit, name
    return step, bound


def predict(
    meas: Measured,
    devices: int,
    floor: float | None,
    plan: ModelExecutePlan | None = None,
    *,
    overlap: bool = False,
    optimizer_floor: bool = True,
    uniform: bool = False,
) -> dict[str, Any]:
    """The predicted step on `devices` GPUs from one GPU's measurement; with `overlap`,
    also the step with RoundPipe(overlap_calls=True): the plan made for overlapped calls,
    their steady period, an overlapped call's first job waiting for its layers' publish;
    with `uniform`, also the fastest of `uniform_plans` (its step without the optimizer
    floor)."""
    m = meas.num_microbatch
    mem = [0.0] * len(meas.fwd)  # parameter memory does not bind for these shapes
    overhead = meas.overhead_s
    opt = meas.optimizer_s if optimizer_floor else None
    if plan is None:
        plan = plan_from_times(
            "fused", meas.fwd, meas.bwd, mem, num_devices=devices, num_microbatch=m
        )
    h = meas.handoff_on(devices)
    call_s = _plain_call_s(meas, devices, plan)
    step, bound = _bounded(call_s, overhead, floor, opt)
    row = {
        "devices": devices,
        "num_microbatch": m,
        "step_s": round(step, 4),
        "tokens_per_s": round(meas.tokens_per_step / step, 1),
        "call_s": round(call_s, 4),
        "overhead_s": round(overhead, 4),
        "dispatch_floor_s": floor,
        "optimizer_floor_s": None if opt is None else round(opt, 4),
        "bound": bound,
        "handoff_ms": round(default_handoff(meas.fwd, m) if h is None else h, 3),
        "call_gap_ms": round(meas.call_gap_ms, 3),
        "plan": repr(plan),
    }
    if uniform:
        u_step, u_plan = min(
            (_step_s(meas, devices, u, floor), repr(u))
            for u in uniform_plans(len(meas.fwd), devices)
        )
        row.update(
            uniform_plan=u_plan,
            uniform_step_s=round(u_step, 4),
            uniform_tokens_per_s=round(meas.tokens_per_step / u_step, 1),
        )
    if overlap:
        o_plan = plan_from_times(
            "fused",
            meas.fwd,
            meas.bwd,
            mem,
            num_devices=devices,
            num_microbatch=m,
            overlap=True,
            publish=meas.publish,
        )
        period = (
            simulate_plan(
                o_plan, meas.fwd, meas.bwd, devices, m, h, overlapped=True, publish=meas.publish
            )
            / 1000
        )
        step, bound = _bounded(period, overhead, floor, opt)
        busy = busy_bound_s(o_plan, meas.fwd, meas.bwd, devices, m, h)
        busy_step, busy_limit = _bounded(busy, overhead, floor, opt)
        row.update(
            overlap_plan=repr(o_plan),
            overlap_call_s=round(period, 4),
            overlap_step_s=round(step, 4),
            overlap_tokens_per_s=round(meas.tokens_per_step / step, 1),
            overlap_bound=bound,
            busy_call_s=round(busy, 4),
            busy_tokens_per_s=round(meas.tokens_per_step / busy_step, 1),
            busy_bound=busy_limit,
        )
    return row


def steady_tokens_per_s(run: dict[str, Any]) -> float:
    """A run's tokens/s over its measured steps in which torch.compile built nothing
    (bench/train.py's `tokens_per_s_steps_without_compile`), else over all of them."""
    return float(run.get("tokens_per_s_steps_without_compile") or run["tokens_per_s"])


def _plain_call_s(meas: Measured, devices: int, plan: ModelExecutePlan) -> float:
    """One call of `plan` when calls run one after the other (s): the simulated pipeline,
    plus the call's gap on several GPUs (`Measured.call_gap_ms`)."""
    m, h = meas.num_microbatch, meas.handoff_on(devices)
    gap_ms = meas.call_gap_ms if devices > 1 else 0.0
    return (simulate_plan(plan, meas.fwd, meas.bwd, devices, m, h) + gap_ms) / 1000


def _step_s(
    meas: Measured,
    devices: int,
    plan: ModelExecutePlan,
    floor: float | None,
    *,
    overlapped: bool = False,
) -> float:
    """`predict`'s step (s) of a given plan, unrounded (the optimizer floor left out: the
    fit is about the pipeline); `overlapped`: the steady period of overlapped calls of it
    (no call gap)."""
    if overlapped:
        m, h = meas.num_microbatch, meas.handoff_on(devices)
        call_s = (
            simulate_plan(
                plan, meas.fwd, meas.bwd, devices, m, h, overlapped=True, publish=meas.publish
            )
            / 1000
        )
    else:
        call_s = _plain_call_s(meas, devices, plan)
    return _bounded(call_s, meas.overhead_s, floor)[0]


def _overlapped(run: dict[str, Any]) -> bool:
    """Whether a bench/train.py run overlapped its calls (RoundPipe overlap_calls)."""
    return bool(run.get("overlap_calls"))


# `fit_handoff(..., call_gap=True)` tries call gaps on this grid (ms).
CALL_GAP_GRID_MS = [5.0 * i for i in range(61)]


def fit_handoff(
    meas: Measured, runs: list[dict[str, Any]], floor: float | None, *, call_gap: bool = False
) -> tuple[Measured, float]:
    """`meas` with the handoff between devices that best fits the multi-GPU `runs` (the
    plans they ran, as they ran them: overlapped calls as their steady period; their
    steady steps; least squares on the log of the step), and that fit's root mean square
    relative error. Searched from a quarter to 16 times the default handoff, on a grid,
    then by golden section between the best point's neighbours (the step grows with the
    handoff). `call_gap`: also the plain call's gap (`Measured.call_gap_ms`, on
    `CALL_GAP_GRID_MS`), the handoff fitted for each: it needs plain and overlapped runs
    to be told apart from the handoff."""
    if call_gap:
        fits = [fit_handoff(replace(meas, call_gap_ms=g), runs, floor) for g in CALL_GAP_GRID_MS]
        return min(fits, key=lambda fit: fit[1])
    targets = [
        (
            parse_plan(r["plan"]),
            int(r["num_devices"]),
            r["tokens_per_step"] / steady_tokens_per_s(r),
            _overlapped(r),
        )
        for r in runs
    ]

    def cost(h: float) -> float:
        cand = replace(meas, handoff_ms=h)
        return sum(
            math.log(_step_s(cand, d, plan, floor, overlapped=ov) / step) ** 2
            for plan, d, step, ov in targets
        )

    base = default_handoff(meas.fwd, meas.num_microbatch)
    grid = [base * 2 ** (i / 8) for i in range(-16, 33)]
    costs = [cost(h) for h in grid]
    k = costs.index(min(costs))
    lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(30):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if cost(a) <= cost(b):
            hi = b
        else:
            lo = a
    best = (lo + hi) / 2
    return replace(meas, handoff_ms=best), math.expm1(math.sqrt(cost(best) / len(targets)))


def _key(run: dict[str, Any]) -> tuple[str, int]:
    """The (file, micro-batches) of a run: which one-GPU measurement it compares with."""
    return run["_file"], int(run.get("num_microbatch") or 0)


def _multi_gpu_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs on several GPUs that say which plan they ran (the checks)."""
    return [r for r in runs if (r.get("num_devices") or 1) >= 2 and r.get("plan")]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("runs", nargs="+", type=Path, help="bench/train.py result lines (JSON)")
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--dispatch", type=Path, help="result lines of the tiny-matrix runs")
    p.add_argument("--raw", action="store_true", help="per-layer times as measured")
    p.add_argument(
        "--overlap",
        action="store_true",
        help="also predict RoundPipe(overlap_calls=True): one call's drain overlapping the "
        "next call's fill, with plans made for it",
    )
    p.add_argument(
        "--no-optimizer-floor",
        action="store_true",
        help="leave out the optimizer thread's measured time per step (a host with more "
        "cores and memory bandwidth than the one measured)",
    )
    p.add_argument(
        "--fit-handoff",
        action="store_true",
        help="fit the handoff between jobs to the input's multi-GPU runs (the plans they "
        "ran) and predict with it",
    )
    p.add_argument(
        "--fit-call-gap",
        action="store_true",
        help="with --fit-handoff, also fit a plain call's gap on several GPUs, which "
        "overlapped calls hide (needs plain and overlapped multi-GPU runs in the input)",
    )
    p.add_argument(
        "--uniform-plans",
        action="store_true",
        help="also the fastest plan of evenly sized groups on each GPU count (uniform_* "
        "fields): what a plan made for the simulated costs could reach",
    )
    args = p.parse_args(argv)

    runs = load_runs(args.runs)
    measured = one_gpu_times(runs, args.raw)
    if not measured:
        raise SystemExit("no one-GPU run with layer_times_ms in the input (bench/train.py)")
    floors = dispatch_floor(load_runs([args.dispatch])) if args.dispatch else {}
    if args.fit_handoff:
        for key, meas in sorted(measured.items()):
            several = [r for r in _multi_gpu_runs(runs) if _key(r) == key]
            if not several:
                continue
            default_ms = default_handoff(meas.fwd, meas.num_microbatch)
            measured[key], rms = fit_handoff(
                meas, several, floors.get(key[1]), call_gap=args.fit_call_gap
            )
            row = {
                "kind": "calibration",
                "input": key[0],
                "num_microbatch": key[1],
                "handoff_ms": round(measured[key].handoff_ms or 0.0, 3),
                "default_handoff_ms": round(default_ms, 3),
                "call_gap_ms": round(measured[key].call_gap_ms, 3),
                "fit_runs": [int(r["num_devices"]) for r in several],
                "fit_rms_error": round(rms, 4),
            }
            print(json.dumps(row), flush=True)
    best: dict[tuple[str, int], dict[str, Any]] = {}
    base = {}  # file -> the best measured one-GPU tokens/s (the efficiency's reference)
    for meas in measured.values():
        rate = meas.tokens_per_step / meas.step_s
        base[meas.source] = max(base.get(meas.source, 0.0), rate)
    for (source, _), meas in sorted(measured.items()):
        for d in args.devices:
            row = predict(
                meas,
                d,
                floors.get(meas.num_microbatch),
                overlap=args.overlap,
                optimizer_floor=not args.no_optimizer_floor,
                uniform=args.uniform_plans,
            )
            row.update(kind="prediction", input=source)
            row["speedup_vs_1gpu"] = round(row["tokens_per_s"] / base[source], 3)
            row["efficiency"] = round(row["speedup_vs_1gpu"] / d, 3)
            if args.overlap:
                for prefix in ("overlap", "busy"):
                    row[f"{prefix}_efficiency"] = round(
                        row[f"{prefix}_tokens_per_s"] / base[source] / d, 3
                    )
            print(json.dumps(row), flush=True)
            for kind, rate in (("best", "tokens_per_s"), ("best_overlap", "overlap_tokens_per_s")):
                key = (kind, source, d)
                if rate in row and (key not in best or row[rate] > best[key][rate]):
                    best[key] = row
    for r in _multi_gpu_runs(runs):
        d = int(r["num_devices"])
        meas = measured.get(_key(r))
        if meas is None:
            continue
        plan, floor = parse_plan(r["plan"]), floors.get(meas.num_microbatch)
        row = predict(meas, d, floor, plan, optimizer_floor=not args.no_optimizer_floor)
        if _overlapped(r):  # the run's plan as it ran: overlapped calls' steady period
            step = _step_s(meas, d, plan, floor, overlapped=True)
            row.update(
                overlapped=True,
                step_s=round(step, 4),
                tokens_per_s=round(meas.tokens_per_step / step, 1),
            )
        measured_rate = steady_tokens_per_s(r)
        row.update(
            kind="check",
            input=r["_file"],
            measured_tokens_per_s=measured_rate,
            measured_tokens_per_s_all_steps=float(r["tokens_per_s"]),
            error=round(row["tokens_per_s"] / measured_rate - 1, 4),
        )
        print(json.dumps(row), flush=True)
    for (kind, _, _), row in sorted(best.items()):
        print(json.dumps({**row, "kind": kind}), flush=True)


if __name__ == "__main__":
    main()
