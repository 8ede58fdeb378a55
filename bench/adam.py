"""Benchmark the C Adam against torch's AdamW (fused and foreach) on the same fp32 params.

Prints one JSON line per result: the host memory bandwidth of a torch copy (the ceiling),
then params/s and bytes/s for each implementation, best of `--repeats` steps after a
warm-up. Adam reads param, grad, m, v and writes param, m, v: 28 bytes per parameter and
step, 30 when it also writes a half-precision model copy.

`--fold-params N` times instead what stands, with `step_staleness=0`, between RoundPipe's
last gradient download (Qwen3-1.7B's tied embedding, 311,164,928 parameters) and the next
call's first upload (issue 44), for one bf16 gradient of N elements with fp32 masters:
the fold (the call's end waits for it: engine.fold_ahead) and the parameter's update
(engine.optim.Adam, fp32 moments, no model copy: bench/train.py's defaults), copied as
before (the bf16 download into the reused fp32 gradient, its sum of squares, the update
reading the fp32 gradient) against deferred (engine.optim._deferred: the sum and the
update read the bf16 download itself). Both paths per round, their order turned each
round; best and median seconds of each phase and of the two together.

    python bench/adam.py                  # 200 M params, as on the GPU host
    python bench/adam.py --params 50e6    # smaller machines
    python bench/adam.py --fold-params 311164928 --repeats 7   # ~6 GB of host memory
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import engine.optim as eo
from engine.optim import _deferred, _sumsq

BYTES_ADAM = 28
BYTES_ADAM_COPY = 30
LR, WEIGHT_DECAY = 1e-3, 0.01


def _best_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: state allocation, page faults, library load
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _emit(**fields: object) -> None:
    print(json.dumps({"bench": "adam", **fields}), flush=True)


def _measure_bandwidth(n: int, repeats: int) -> float:
    """Bytes/s of a torch copy of n floats (the figure to compare with); emits both lines."""
    src = torch.randn(n)
    dst = torch.zeros(n)
    copy_s = _best_s(lambda: dst.copy_(src), repeats)
    bandwidth = 8 * n / copy_s  # counted as 1 read + 1 write, like the 28 bytes of Adam
    _emit(what="memory_copy", bytes_per_s=bandwidth, seconds=copy_s)
    # An in-place add reads 2 arrays and writes back one it has just read, as Adam does, so
    # it pays no read-for-ownership for a copy's destination: a closer ceiling for Adam.
    add_s = _best_s(lambda: dst.add_(src), repeats)
    _emit(what="memory_inplace_add", bytes_per_s=12 * n / add_s, seconds=add_s)
    return bandwidth


def _split(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def _fold_and_update(n: int, repeats: int) -> None:
    """The `--fold-params` comparison (module doc): one JSON line per path and phase, then
    the deferred path's time as a fraction of the copied one's."""
    gen = torch.Generator().manual_seed(0)
    master = _deferred.DeferredGradParameter(torch.randn(n, generator=gen) * 0.02)
    download = (torch.randn(n, generator=gen) * 1e-3).bfloat16()
    buffer = torch.empty(n)  # the reused fp32 gradient of the copied path
    opt = eo.Adam([master], lr=1e-5, weight_decay=0.1, decoupled_weight_decay=True)

    def copied() -> tuple[float, float]:
        start = time.perf_counter()
        buffer.copy_(download)  # ParamAttribute.fold_ahead's copy
        _sumsq.keep([buffer])
        folded = time.perf_counter()
        master.grad = buffer
        opt.step()
        opt.zero_grad()
        return folded - start, time.perf_counter() - folded

    def deferred() -> tuple[float, float]:
        start = time.perf_counter()
        _sumsq.keep([download])
        folded = time.perf_counter()
        _deferred.defer(master, download, buffer=lambda: buffer, on_read=lambda: None)
        opt.step()
        opt.zero_grad()
        return folded - start, time.perf_counter() - folded

    paths = {"copied": copied, "deferred": deferred}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    names = list(paths)
    for round_ in range(repeats + 1):  # round 0 warms up (state, page faults)
        for name in names[round_ % 2 :] + names[: round_ % 2]:
            fold_s, update_s = paths[name]()
            if round_ > 0:
                times[name].append((fold_s, update_s))
    best_total = {}
    for name, runs in times.items():
        phases = {
            "fold": [f for f, _ in runs],
            "update": [u for _, u in runs],
            "total": [f + u for f, u in runs],
        }
        best_total[name] = min(phases["total"])
        for phase, seconds in phases.items():
            _emit(
                what="fold_and_update",
                path=name,
                phase=phase,
                params=n,
                seconds=round(min(seconds), 4),
                median_s=round(statistics.median(seconds), 4),
                threads=eo.get_num_threads(),
                isa=eo.get_isa(),
            )
    _emit(
        what="fold_and_update",
        path="deferred/copied",
        phase="total",
        params=n,
        ratio=round(best_total["deferred"] / best_total["copied"], 3),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=200e6, help="fp32 parameters in all")
    parser.add_argument("--tensors", type=int, default=8, help="split into this many tensors")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps (best is kept)")
    parser.add_argument("--copy-dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--skip-foreach", action="store_true", help="skip torch foreach (slow)")
    parser.add_argument(
        "--fold-params",
        type=float,
        default=None,
        help="time the end-of-call fold and the update of one bf16 gradient this large, "
        "copied against deferred (module doc), instead of the optimizers",
    )
    args = parser.parse_args()
    n = int(args.fold_params or args.params)
    copy_dtype = getattr(torch, args.copy_dtype)

    info = eo.native_info()
    _emit(
        what="setup",
        params=n,
        tensors=1 if args.fold_params else args.tensors,
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        machine=platform.node(),
        cpus=os.cpu_count(),
        native=info,
    )
    if args.fold_params:
        _fold_and_update(n, args.repeats)
        return

    bandwidth = _measure_bandwidth(n, args.repeats)

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(k, generator=gen)) for k in _split(n, args.tensors)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    copies = [torch.empty(p.numel(), dtype=copy_dtype) for p in params]

    def report(impl: str, seconds: float, per_param: int, copy: str | None) -> None:
        _emit(
            what="step",
            impl=impl,
            copy=copy,
            params=n,
            seconds=seconds,
            params_per_s=n / seconds,
            bytes_per_s=per_param * n / seconds,
            of_copy_bandwidth=per_param * n / seconds / bandwidth,
        )

    ours = eo.Adam(params, lr=LR, weight_decay=WEIGHT_DECAY, decoupled_weight_decay=True)
    fused = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def with_copies(on: bool) -> None:
        for p, c in zip(params, copies, strict=True):
            eo.set_model_copy(p, c if on else None)

    def fused_then_cast() -> None:
        fused.step()
        with torch.no_grad():
            for p, c in zip(params, copies, strict=True):
                c.copy_(p.view(-1))

    # (impl, copy dtype or None, bytes per param, set-up outside the timing, the step)
    cases = [
        ("engine.optim.Adam", None, BYTES_ADAM, lambda: with_copies(False), ours.step),
        (
            "engine.optim.Adam",
            args.copy_dtype,
            BYTES_ADAM_COPY,
            lambda: with_copies(True),
            ours.step,
        ),
        ("torch.AdamW(fused=True)", None, BYTES_ADAM, lambda: with_copies(False), fused.step),
        (
            "torch.AdamW(fused=True)+cast",
            args.copy_dtype,
            BYTES_ADAM_COPY,
            lambda: None,
            fused_then_cast,
        ),
    ]
    # Interleave the cases, best of `repeats` each, so drift on a shared machine hits all.
    best = [float("inf")] * len(cases)
    for round_ in range(args.repeats + 1):  # round 0 warms up (state, page faults)
        for k, (_, _, _, setup, step) in enumerate(cases):
            setup()
            start = time.perf_counter()
            step()
            if round_ > 0:
                best[k] = min(best[k], time.perf_counter() - start)
    with_copies(False)
    for (impl, copy, per_param, _, _), seconds in zip(cases, best, strict=True):
        report(impl, seconds, per_param, copy)

    if not args.skip_foreach:
        foreach = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
        report("torch.AdamW(foreach=True)", _best_s(foreach.step, args.repeats), BYTES_ADAM, None)


if __name__ == "__main__":
    main()
