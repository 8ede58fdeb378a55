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

    step(D) = max(simulated call(D) + overhead, dispatch floor)

Checks: every multi-GPU run in the input (with the plan it ran, from its `plan` field) is
simulated with the one-GPU times of its own file and micro-batch count; the result lines
say how far the prediction is from the measurement.

    python bench/simulate.py bench/sim_inputs/h100-2026-11-23.jsonl
    python bench/simulate.py RUNS.jsonl --devices 1 2 4 8 --dispatch DISPATCH.jsonl

Prints one JSON line per prediction (`kind: prediction`), per check (`kind: check`) and a
summary per GPU count of the best micro-batch count (`kind: best`).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.scheduler import ModelExecutePlan, plan_from_times, simulate_plan


@dataclass
class Measured:
    """One GPU's per-layer times and step at one micro-batch count."""

    num_microbatch: int
    fwd: list[float]
    bwd: list[float]
    step_s: float
    tokens_per_step: int
    source: str

    @functools.cached_property
    def overhead_s(self) -> float:
        """The measured step less the simulated one-GPU call: what a call costs besides its
        jobs (the first upload, the last download, the Python around the jobs)."""
        m = self.num_microbatch
        mem = [0.0] * len(self.fwd)
        one = plan_from_times("fused", self.fwd, self.bwd, mem, num_devices=1, num_microbatch=m)
        return self.step_s - simulate_plan(one, self.fwd, self.bwd, 1, m) / 1000


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
        m = int(r["num_microbatch"])
        out[(r["_file"], m)] = Measured(
            m, fwd, bwd, float(r["step_s_median"]), int(r["tokens_per_step"]), r["_file"]
        )
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


def predict(
    meas: Measured, devices: int, floor: float | None, plan: ModelExecutePlan | None = None
) -> dict[str, Any]:
    """The predicted step on `devices` GPUs from one GPU's measurement."""
    m = meas.num_microbatch
    mem = [0.0] * len(meas.fwd)  # parameter memory does not bind for these shapes
    overhead = meas.overhead_s
    if plan is None:
        plan = plan_from_times(
            "fused", meas.fwd, meas.bwd, mem, num_devices=devices, num_microbatch=m
        )
    call_s = simulate_plan(plan, meas.fwd, meas.bwd, devices, m) / 1000
    step = call_s + overhead
    bound = "pipeline"
    if floor is not None and floor > step:
        step, bound = floor, "dispatch"
    return {
        "devices": devices,
        "num_microbatch": m,
        "step_s": round(step, 4),
        "tokens_per_s": round(meas.tokens_per_step / step, 1),
        "call_s": round(call_s, 4),
        "overhead_s": round(overhead, 4),
        "dispatch_floor_s": floor,
        "bound": bound,
        "plan": repr(plan),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("runs", nargs="+", type=Path, help="bench/train.py result lines (JSON)")
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--dispatch", type=Path, help="result lines of the tiny-matrix runs")
    p.add_argument("--raw", action="store_true", help="per-layer times as measured")
    args = p.parse_args(argv)

    runs = load_runs(args.runs)
    measured = one_gpu_times(runs, args.raw)
    if not measured:
        raise SystemExit("no one-GPU run with layer_times_ms in the input (bench/train.py)")
    floors = dispatch_floor(load_runs([args.dispatch])) if args.dispatch else {}
    best: dict[tuple[str, int], dict[str, Any]] = {}
    base = {}  # file -> the best measured one-GPU tokens/s (the efficiency's reference)
    for meas in measured.values():
        rate = meas.tokens_per_step / meas.step_s
        base[meas.source] = max(base.get(meas.source, 0.0), rate)
    for (source, _), meas in sorted(measured.items()):
        for d in args.devices:
            row = predict(meas, d, floors.get(meas.num_microbatch))
            row.update(kind="prediction", input=source)
            row["speedup_vs_1gpu"] = round(row["tokens_per_s"] / base[source], 3)
            row["efficiency"] = round(row["speedup_vs_1gpu"] / d, 3)
            print(json.dumps(row), flush=True)
            key = (source, d)
            if key not in best or row["tokens_per_s"] > best[key]["tokens_per_s"]:
                best[key] = row
    for r in runs:
        d = r.get("num_devices") or 1
        meas = measured.get((r["_file"], int(r.get("num_microbatch") or 0)))
        if d < 2 or meas is None or not r.get("plan"):
            continue
        row = predict(meas, d, floors.get(meas.num_microbatch), parse_plan(r["plan"]))
        measured_rate = float(r["tokens_per_s"])
        row.update(
            kind="check",
            input=r["_file"],
            measured_tokens_per_s=measured_rate,
            error=round(row["tokens_per_s"] / measured_rate - 1, 4),
        )
        print(json.dumps(row), flush=True)
    for _, row in sorted(best.items()):
        print(json.dumps({**row, "kind": "best"}), flush=True)


if __name__ == "__main__":
    main()
