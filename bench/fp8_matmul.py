"""Per-matmul-shape FP8 profile: the decoder's linear layers in bf16 against FP8 (rowwise and
tensorwise scales), with and without the casts (issue 49's table).

For each projection of a model shape (q, k/v, o, gate/up, down), each of its three matmuls
(forward x W^T, input gradient g W, weight gradient g^T x) at `--tokens` tokens a
micro-batch:

    bf16_ms         torch's bf16 matmul
    <recipe>_gemm_ms  torch._scaled_mm alone, on operands cast beforehand
    <recipe>_ms     the matmul as engine.accel.fp8 runs it, casts included (eager here:
                    each cast its own kernels; inside the engine's compiled decoder layers
                    inductor fuses them, so the truth lies between the two columns)

One JSON line per (model, projection, matmul), CUDA-event medians over `--iters` calls, and
the speedups over bf16. Needs a GPU of compute capability >= 8.9.

    python bench/fp8_matmul.py                                   # qwen3-1.7b and qwen3-8b
    python bench/fp8_matmul.py --models qwen3-8b --tokens 8192 16384
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.shapes import SHAPES
from engine.accel.fp8 import E4M3, cast_to_fp8, fp8_matmul_nt, grad_dtype
from engine.options import Fp8Recipe

RECIPES: tuple[Fp8Recipe, ...] = ("rowwise", "tensorwise")


def projections(model: str) -> dict[str, tuple[int, int]]:
    """(in, out) of each distinct linear of a decoder layer of `model`."""
    s = SHAPES[model]
    hidden, heads, kv, head_dim = (
        s["hidden_size"],
        s["num_attention_heads"],
        s["num_key_value_heads"],
        s["head_dim"],
    )
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj/v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj/up_proj": (hidden, s["intermediate_size"]),
        "down_proj": (s["intermediate_size"], hidden),
    }


def time_ms(fn: Callable[[], object], iters: int, *, warmup: int = 3, cuda: bool = True) -> float:
    """Median milliseconds of `fn` over `iters` calls, after `warmup` untimed calls: CUDA
    events, or the host's clock where not `cuda` (bench/fp8_layer.py's CPU plumbing)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def operands(tokens: int, d_in: int, d_out: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(a, b) of each matmul as a @ b^T, inner dimension last (engine.accel.fp8's layout)."""
    x = torch.randn(tokens, d_in, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16) * 0.02
    g = torch.randn(tokens, d_out, device="cuda", dtype=torch.bfloat16) * 1e-3
    return {
        "forward": (x, w),  # (tokens, in) x (out, in)^T
        "grad_input": (g, w.t().contiguous()),  # (tokens, out) x (in, out)^T
        "grad_weight": (g.t().contiguous(), x.t().contiguous()),  # (out, tokens) x (in, tokens)^T
    }


def measure(model: str, tokens: int, iters: int) -> list[dict[str, object]]:
    rows = []
    for proj, (d_in, d_out) in projections(model).items():
        for name, (a, b) in operands(tokens, d_in, d_out).items():
            flops = 2 * a.shape[0] * a.shape[1] * b.shape[0]
            row: dict[str, object] = {
                "bench": "fp8_matmul",
                "model": model,
                "proj": proj,
                "matmul": name,
                "m": a.shape[0],
                "k": a.shape[1],
                "n": b.shape[0],
                "tokens": tokens,
            }
            bf16 = time_ms(lambda a=a, b=b: a @ b.t(), iters)
            row["bf16_ms"] = round(bf16, 4)
            row["bf16_tflops"] = round(flops / bf16 / 1e9, 1)
            for recipe in RECIPES:
                rowwise = recipe == "rowwise"
                a_dtype = E4M3 if name == "forward" else grad_dtype(recipe)
                fast = name == "forward"
                qa, sa = cast_to_fp8(a, a_dtype, rowwise=rowwise, pow2=True)
                qb, sb = cast_to_fp8(b, E4M3, rowwise=rowwise, pow2=True)
                sb = sb.reshape(1, -1) if rowwise else sb
                gemm = time_ms(
                    lambda qa=qa, sa=sa, qb=qb, sb=sb, fast=fast: torch._scaled_mm(
                        qa,
                        qb.t(),
                        scale_a=sa,
                        scale_b=sb,
                        out_dtype=torch.bfloat16,
                        use_fast_accum=fast,
                    ),
                    iters,
                )
                full = time_ms(
                    lambda a=a, b=b, r=recipe, d=a_dtype, fast=fast: fp8_matmul_nt(
                        a, b, recipe=r, a_dtype=d, fast=fast
                    ),
                    iters,
                )
                row[f"{recipe}_gemm_ms"] = round(gemm, 4)
                row[f"{recipe}_ms"] = round(full, 4)
                row[f"{recipe}_gemm_speedup"] = round(bf16 / gemm, 3)
                row[f"{recipe}_speedup"] = round(bf16 / full, 3)
                row[f"{recipe}_gemm_tflops"] = round(flops / gemm / 1e9, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--models", nargs="+", default=["qwen3-1.7b", "qwen3-8b"], choices=sorted(SHAPES)
    )
    p.add_argument(
        "--tokens",
        nargs="+",
        type=int,
        default=[32768],
        help="tokens a micro-batch (64 x 2048-token sequences in 4 micro-batches: 32768)",
    )
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("bench/fp8_matmul.py needs a CUDA GPU of compute capability >= 8.9")
    torch.manual_seed(0)
    for model in args.models:
        for tokens in args.tokens:
            measure(model, tokens, args.iters)


if __name__ == "__main__":
    main()
