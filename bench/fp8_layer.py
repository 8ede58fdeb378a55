"""One decoder layer of a model shape, bf16 against FP8, compiled as the engine compiles it,
with a per-kernel profile of its backward (issue 49: where FP8's backward time goes).

The layer runs as the engine runs it: through `_layer_calls._compiled_decoder_call`, the
forward without grad, then the backward as the recompute (the forward again, under grad)
and autograd's backward of it. For each precision (bf16, FP8 rowwise, tensorwise and
rowwise_with_gw_hp) one JSON line:

    fp8_layer           forward_ms, backward_ms (recompute + gradients): CUDA-event
                        medians over --iters calls
    fp8_layer.kernels   one backward under torch.profiler: device milliseconds per
                        category (gemm, attention, fused = inductor's Triton kernels, where
                        the casts, amaxes and transposes live, other = eager aten kernels
                        and copies) and the --top kernels by device time, each with its
                        calls and milliseconds

Inductor names its kernels after the aten ops fused into them (`triton_red_fused_abs_amax_...`
is an amax, `..._clamp_mul_..._to_copy` a cast): the table shows which casts fused with
what, and what they cost next to the GEMMs.

    python bench/fp8_layer.py --model qwen3-1.7b --tokens 16384
    python bench/fp8_layer.py --tiny --device cpu --eager --iters 1 --warmup 0  # CI
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fp8_matmul import time_ms
from bench.shapes import SHAPES, build_model
from engine.accel.fp8 import convert_linears
from engine.models._layer_calls import _compiled_decoder_call, _decoder_call

PRECISIONS = ("bf16", "rowwise", "tensorwise", "rowwise_with_gw_hp")
# Kernel-name fragments, tried in this order: the first that matches names the category.
CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa", "mha")),
    ("fused", ("triton",)),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "f8f8", "scaled_mm", "cublas", "sm90")),
)
# The tiny shape of --tiny: every size a multiple of 16 (FP8's alignment).
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
}


def build_layer(model: str, tiny: bool) -> tuple[nn.Module, nn.Module]:
    """The first decoder layer of `model` (bf16, random) and its rotary embedding."""
    if tiny:
        from tests.tiny_models import tiny_model

        hf = tiny_model("qwen3", num_hidden_layers=1, dtype=torch.bfloat16, **TINY)
    else:
        hf = build_model(model, torch.bfloat16, "sdpa", 0, layers=1)
    return hf.model.layers[0], hf.model.rotary_emb


def category(name: str) -> str:
    """The kernel's category (see CATEGORIES); 'other' where none matches."""
    low = name.lower()
    for label, fragments in CATEGORIES:
        if any(f in low for f in fragments):
            return label
    return "other"


class LayerStep:
    """The engine's forward (no grad) and backward (recompute + gradients) of one layer."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, tokens: int, seq: int, device: str):
        self.layer = layer
        rows = max(1, tokens // seq)
        gen = torch.Generator().manual_seed(0)
        hidden_size = layer.self_attn.o_proj.out_features
        self.hidden = torch.randn(rows, seq, hidden_size, generator=gen).to(device, torch.bfloat16)
        self.grad = (torch.randn(rows, seq, hidden_size, generator=gen) * 1e-3).to(
            device, torch.bfloat16
        )
        self.positions = torch.arange(seq, device=device).unsqueeze(0)
        self.cos, self.sin = rotary.to(device)(self.hidden, self.positions)

    def call(self, fn: Callable[..., torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        return fn(self.layer, hidden, None, self.positions, self.cos, self.sin, None)

    def forward(self, fn: Callable[..., torch.Tensor]) -> None:
        with torch.no_grad():
            self.call(fn, self.hidden)

    def backward(self, fn: Callable[..., torch.Tensor]) -> None:
        hidden = self.hidden.detach().requires_grad_()
        self.call(fn, hidden).backward(self.grad)
        for p in self.layer.parameters():
            p.grad = None


def kernel_table(fn: Callable[[], None], cuda: bool, top: int) -> dict[str, Any]:
    """Device milliseconds of one call of `fn` per category and its `top` kernels (on the
    CPU: CPU operators, for the plumbing only)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        on_device = ev.device_type == torch.autograd.DeviceType.CUDA
        if on_device != cuda or (not cuda and ev.cpu_parent is not None):
            continue  # device kernels on a GPU; top-level operators on the CPU
        entry = kernels.setdefault(ev.name, [0, 0.0])
        entry[0] += 1
        entry[1] += ev.time_range.elapsed_us() / 1000
    totals: dict[str, float] = {}
    for name, (_, ms) in kernels.items():
        totals[category(name)] = totals.get(category(name), 0.0) + ms
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "category_ms": {k: round(v, 3) for k, v in sorted(totals.items())},
        "total_ms": round(sum(totals.values()), 3),
        "top": [
            {"kernel": name[:160], "calls": calls, "ms": round(ms, 3), "category": category(name)}
            for name, (calls, ms) in ranked
        ],
    }


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    cuda = args.device.startswith("cuda")
    base, rotary = build_layer(args.model, args.tiny)
    fn = _decoder_call if args.eager else _compiled_decoder_call()
    rows = []
    for precision in args.precisions:
        layer = copy.deepcopy(base)
        if precision != "bf16":
            convert_linears(layer, precision)
        step = LayerStep(layer.to(args.device), rotary, args.tokens, args.seq_len, args.device)
        common = {"model": "tiny" if args.tiny else args.model, "precision": precision}
        common |= {"tokens": step.hidden.shape[0] * args.seq_len, "compiled": not args.eager}
        row = {"bench": "fp8_layer", **common}
        timing = {"warmup": args.warmup, "cuda": cuda}
        row["forward_ms"] = round(time_ms(lambda s=step: s.forward(fn), args.iters, **timing), 3)
        row["backward_ms"] = round(time_ms(lambda s=step: s.backward(fn), args.iters, **timing), 3)
        print(json.dumps(row), flush=True)
        table = {"bench": "fp8_layer.kernels", **common, "phase": "backward"}
        table |= kernel_table(lambda s=step: s.backward(fn), cuda, args.top)
        print(json.dumps(table), flush=True)
        rows += [row, table]
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--tiny", action="store_true", help="a hidden-64 layer (with --device cpu)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens a micro-batch")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--device", default="cuda")
    p.add_argument("--eager", action="store_true", help="the layer uncompiled")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (compiles)")
    p.add_argument("--top", type=int, default=25, help="kernels listed per profile")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("FP8 matmuls need a CUDA GPU of compute capability >= 8.9")
    torch.manual_seed(0)
    return measure(args)


if __name__ == "__main__":
    main()
