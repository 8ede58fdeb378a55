"""Benchmark the C Adam's compact mode (issue 35): bf16 parameters that are their own
masters, bf16 gradients, 8-bit moments; params/s per ISA path, best of `--repeats` steps
after a warm-up.

    python bench/adam_compact.py --params 16e6 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import engine.optim as eo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=16e6)
    parser.add_argument("--threads", type=int, default=None, help="default: physical cores")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--isas", default=",".join(eo.available_isas()))
    args = parser.parse_args()
    n = int(args.params)
    eo.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((torch.randn(n, generator=gen) * 0.02).bfloat16())
    p.grad = (torch.randn(n, generator=gen) * 1e-3).bfloat16()
    opt = eo.Adam(
        [p], lr=1e-3, weight_decay=0.01, decoupled_weight_decay=True, state_dtype=torch.uint8
    )
    for isa in args.isas.split(","):
        if isa == "torch":
            continue
        eo.set_isa(isa)
        opt.step()  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            opt.step()
            best = min(best, time.perf_counter() - start)
        fields = {"bench": "adam_compact", "isa": isa, "threads": eo.get_num_threads()}
        if isa == "avx512":  # timed on this CPU by the first step (engine.optim._native)
            from engine.optim import _native

            fields["q8_lookup"] = _native.q8_lookup(_native.load().lib)
        print(json.dumps({**fields, "params": n, "params_per_s": n / best}), flush=True)
    eo.set_isa(None)


if __name__ == "__main__":
    main()
