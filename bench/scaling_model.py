"""The data-parallel step-time model of docs/SCALING.md, as numbers.

Prints one JSON line per (regime, link, ranks): the predicted step time, tokens/s and
efficiency against N times one rank, and which term bounds the step. Inputs are the
measurements of bench/RESULTS.md ("Data parallel over torch.distributed", nvidia-h200-x2);
change them with the flags to model another box or model.

    python bench/scaling_model.py                     # Qwen3-1.7B shape, one H200 per box
    python bench/scaling_model.py --markdown          # the tables of docs/SCALING.md
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

GBIT = 1e9 / 8  # bytes/s in one Gb/s


@dataclass(frozen=True)
class Box:
    """One rank (one box, one GPU) of the model; times in seconds."""

    params: float = 1_720_574_976  # Qwen3-1.7B shape (tied embeddings)
    wire_bytes: float = 2.0  # fp16 gradients and weights on the wire
    one_rank_s: float = 3.294  # one H200, 131,072 tokens (bench/train.py, same call)
    tokens_ref: int = 131_072
    exposed_s: float = 0.472  # measured: 2-rank step - one rank's half (2.119 - 1.647)
    first_group_share: float = 0.36  # embedding + 6 layers: waited for before any compute
    host_fixed_s: float = 0.42  # per step whatever N: full-model bounces through PCIe
    host_per_shard_s: float = 0.73  # conversions + downloads of the shard, times N
    adam_per_shard_s: float = 0.374  # C Adam over P at 4.6 G params/s (ANCHORS.md)
    collectives: int = 61  # per step: 30 reduce-scatters, 30 all-gathers, the flags
    hop_latency_s: float = 25e-6  # per ring step over TCP; ~5 us over InfiniBand/RoCE

    def grad_bytes(self) -> float:
        return self.params * self.wire_bytes


def ring_s(box: Box, ranks: int, link_gbit: float) -> float:
    """One reduce-scatter or all-gather of the whole model over a ring of `ranks` boxes."""
    if ranks < 2:
        return 0.0
    bandwidth = (ranks - 1) / ranks * box.grad_bytes() / (link_gbit * GBIT)
    latency = (box.collectives / 2) * (ranks - 1) * box.hop_latency_s
    return bandwidth + latency


def step(box: Box, ranks: int, link_gbit: float, tokens_per_rank: float) -> dict[str, float]:
    """Predicted step: max(compute + exposed start, the optimizer thread's work)."""
    compute = box.one_rank_s * tokens_per_rank / box.tokens_ref
    comm = ring_s(box, ranks, link_gbit)
    # The forward cannot start before the first group's weights are gathered; the rest of
    # the gather and the reduce-scatter run under the iteration (staleness-one step).
    start = box.exposed_s + box.first_group_share * comm
    optimizer = 2 * comm + box.host_fixed_s + (box.host_per_shard_s + box.adam_per_shard_s) / ranks
    step_s = max(compute + start, optimizer)
    return {
        "compute_s": compute,
        "comm_s": 2 * comm,
        "optimizer_thread_s": optimizer,
        "step_s": step_s,
        "bound": "compute" if compute + start >= optimizer else "optimizer thread",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--params", type=float, default=Box.params)
    p.add_argument("--one-rank-s", type=float, default=Box.one_rank_s)
    p.add_argument("--exposed-s", type=float, default=Box.exposed_s)
    args = p.parse_args()
    box = Box(params=args.params, one_rank_s=args.one_rank_s, exposed_s=args.exposed_s)
    rows = []
    for regime in ("weak", "strong"):
        for link in (25, 100, 400):
            for ranks in (1, 2, 4, 8, 16, 32, 64):
                tokens = box.tokens_ref if regime == "weak" else box.tokens_ref / ranks
                r = step(box, ranks, link, tokens)
                global_tokens = tokens * ranks
                tps = global_tokens / r["step_s"]
                single = box.tokens_ref / box.one_rank_s
                rows.append(
                    {
                        "regime": regime,
                        "link_gbit": link,
                        "ranks": ranks,
                        "global_tokens": int(global_tokens),
                        **{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()},
                        "tokens_per_s": round(tps),
                        "speedup": round(tps / single, 2),
                        "efficiency": round(tps / single / ranks, 2),
                    }
                )
    if not args.markdown:
        for row in rows:
            print(json.dumps(row))
        return
    for regime in ("weak", "strong"):
        print(f"\n{regime}: ranks -> speedup over one rank (step s, bound)\n")
        print("| link | " + " | ".join(str(n) for n in (2, 4, 8, 16, 32, 64)) + " |")
        print("| --- |" + " ---: |" * 6)
        for link in (25, 100, 400):
            cells = [
                f"{r['speedup']}x ({r['step_s']:.2f} s{', opt' if r['bound'] != 'compute' else ''})"
                for r in rows
                if r["regime"] == regime and r["link_gbit"] == link and r["ranks"] > 1
            ]
            print(f"| {link} Gb/s | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
