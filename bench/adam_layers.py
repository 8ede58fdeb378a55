"""Benchmark the compact mode's Adam step as one kernel call against one call per layer.

RoundPipe(optim_memory='compact') has engine.optim.Adam report each layer's weights as
soon as they are updated (engine.context.StepProgress), so the step runs one C call per
layer in the model's order instead of one call for every parameter. This measures what
the split costs: the same bf16 parameters, bf16 gradients and 8-bit moments of a dense
Qwen3 shape (bench/shapes.py), the cases interleaved round by round (their order turned
each round), best and median of `--repeats` steps after a warm-up, in wall seconds and in
the process's CPU seconds (what a shared machine's load disturbs least); one JSON line per
case. "per parameter" (one call per tensor) is the finer split a per-parameter report
would give without batching.

    python bench/adam_layers.py --model qwen3-14b --layers 2      # ~4 GB of host memory
    python bench/adam_layers.py --model qwen3-14b --layers 40 --embeddings   # the GPU host
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import engine.optim as eo
from bench.shapes import SHAPES
from engine.context import OptimizerCtx


def layer_shapes(fields: dict[str, Any], layers: int, embeddings: bool) -> list[list[tuple]]:
    """Per layer, the weight shapes of a dense Qwen3 (embedding, decoders, norm + head)."""
    hidden, inter, head_dim = (fields[k] for k in ("hidden_size", "intermediate_size", "head_dim"))
    q, kv = fields["num_attention_heads"] * head_dim, fields["num_key_value_heads"] * head_dim
    decoder = [
        (hidden,),  # input_layernorm
        (q, hidden),
        (kv, hidden),
        (kv, hidden),
        (head_dim,),  # q_norm
        (head_dim,),  # k_norm
        (hidden, q),
        (hidden,),  # post_attention_layernorm
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
    ]
    out = [list(decoder) for _ in range(layers)]
    if embeddings:
        out = [[(fields["vocab_size"], hidden)], *out, [(hidden,), (fields["vocab_size"], hidden)]]
    return out


class _ByLayer:
    """A StepProgress that ranks by `rank` (layer or tensor index) and ignores reports."""

    def __init__(self, rank: dict[int, int]) -> None:
        self.rank = rank

    def order(self, param: torch.Tensor) -> int:
        return self.rank[id(param)]

    def updated(self, param: torch.Tensor) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="qwen3-14b")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--embeddings", action="store_true", help="add embedding and head")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (best is kept)")
    args = parser.parse_args()

    shapes = layer_shapes(SHAPES[args.model], args.layers, args.embeddings)
    g = torch.Generator().manual_seed(0)
    params, by_layer, by_tensor = [], {}, {}
    for j, layer in enumerate(shapes):
        for shape in layer:
            p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).bfloat16())
            p.grad = (torch.randn(shape, generator=g) * 1e-3).bfloat16()
            by_layer[id(p)], by_tensor[id(p)] = j, len(params)
            params.append(p)
    n = sum(p.numel() for p in params)
    opt = eo.Adam(params, lr=1e-5, weight_decay=0.1, decoupled_weight_decay=True,
                  state_dtype=torch.uint8)  # fmt: skip
    cases = {
        "one call": None,
        "per layer": _ByLayer(by_layer),
        "per parameter": _ByLayer(by_tensor),
    }

    def run(progress: _ByLayer | None) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        with OptimizerCtx(progress):
            opt.step()
        return time.perf_counter() - wall, time.process_time() - cpu

    run(None)  # warm-up: the state's allocation and page faults
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(run(cases[name]))
    one_wall = min(w for w, _ in times["one call"])
    one_cpu = min(c for _, c in times["one call"])
    for name, runs in times.items():
        wall, cpu = min(w for w, _ in runs), min(c for _, c in runs)
        print(
            json.dumps(
                {
                    "bench": "adam_layers",
                    "case": name,
                    "model": args.model,
                    "layers": len(shapes),
                    "params": n,
                    "threads": eo.get_num_threads(),
                    "isa": eo.get_isa(),
                    "seconds": round(wall, 4),
                    "median_s": round(statistics.median(w for w, _ in runs), 4),
                    "cpu_s": round(cpu, 4),
                    "m_params_per_s": round(n / wall / 1e6, 1),
                    "vs_one_call": round(one_wall / wall, 3),
                    "cpu_vs_one_call": round(one_cpu / cpu, 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
