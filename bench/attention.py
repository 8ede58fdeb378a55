"""Causal attention forward + backward per SDPA backend, at the Qwen3-1.7B head shape.

Prints one JSON line per (sequence length, backend): milliseconds for forward and for
forward + backward of one micro-batch, and the attention TFLOP/s (causal: half of the
4 * seq^2 * heads * head_dim multiply-adds of the forward, backward 2.5x the forward).
Backends that refuse the shape print their error instead. The tokens per call are equal
at every length (the bench's 4 micro-batches of 32,768 tokens), so the rows compare the
attention cost per token across lengths.

Run on a GPU: `python bench/attention.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

BACKENDS: dict[str, SDPBackend | None] = {
    "default": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def _time(fn: object, iters: int) -> float:
    fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def _measure(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gqa: bool,
    backend: SDPBackend | None,
    iters: int,
) -> tuple[float, float]:
    """Seconds of one causal forward, and of one forward + backward."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fwd() -> torch.Tensor:
        return scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=gqa)

    def fwd_bwd() -> None:
        fwd().sum().backward()

    with sdpa_kernel(backend) if backend else contextlib.nullcontext():
        with torch.no_grad():
            t_f = _time(fwd, iters)
        return t_f, _time(fwd_bwd, iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=32768, help="tokens per micro-batch")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seq-lens", default="2048,8192")
    args = p.parse_args()
    dev = torch.device("cuda")
    for seq in (int(s) for s in args.seq_lens.split(",")):
        batch = args.tokens // seq
        q = torch.randn(batch, args.heads, seq, args.head_dim, device=dev, dtype=torch.float16)
        k = torch.randn(batch, args.kv_heads, seq, args.head_dim, device=dev, dtype=q.dtype)
        v = torch.randn_like(k)
        fwd_flops = 2 * 2 * batch * args.heads * seq * seq * args.head_dim / 2
        for gqa in (True, False):
            kk, vv = (
                (k, v)
                if gqa
                else (
                    k.repeat_interleave(args.heads // args.kv_heads, 1),
                    v.repeat_interleave(args.heads // args.kv_heads, 1),
                )
            )
            for name, backend in BACKENDS.items():
                row: dict[str, object] = {"seq": seq, "batch": batch, "backend": name, "gqa": gqa}
                try:
                    t_f, t_fb = _measure(q, kk, vv, gqa, backend, args.iters)
                    row |= {
                        "fwd_ms": round(t_f * 1e3, 3),
                        "fwd_bwd_ms": round(t_fb * 1e3, 3),
                        "fwd_tflops": round(fwd_flops / t_f / 1e12, 1),
                        "fwd_bwd_tflops": round(3.5 * fwd_flops / t_fb / 1e12, 1),
                    }
                except RuntimeError as exc:
                    row["error"] = str(exc).splitlines()[0][:200]
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
