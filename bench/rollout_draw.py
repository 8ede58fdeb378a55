"""One rollout token's draw at GRPO's batch: the top-p draw where the logits are against
the one it replaced (the logits brought to the host, `torch.multinomial` there).

    python bench/rollout_draw.py                      # 256 rows x 151,936 (Qwen3's vocabulary)
    python bench/rollout_draw.py --rows 64 --top-p 1.0

Prints one JSON line per (draw, top_p): milliseconds a token (median of --iters after one
warm-up), on CUDA when there is one (the host draw then includes the copy to the host).
The replaced draw is kept here as the baseline, written as it was in
`rp_service/worker/sampling.py` before session 24.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rp_service.worker.sampling import top_p_draw


def host_multinomial_draw(
    *, temperature: float, top_p: float, generator: torch.Generator
) -> object:
    """The draw before session 24: (rows, vocab) to the host, softmax and multinomial there."""

    def draw(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float().cpu()
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        if top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            before = sorted_p.cumsum(dim=-1) - sorted_p
            sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    return draw


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--top-p", type=float, nargs="+", default=[1.0, 0.9])
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0))
    logits = (logits * 3).to(device)
    for top_p in args.top_p:
        for name, make in (("device", top_p_draw), ("host_multinomial", host_multinomial_draw)):
            draw = make(temperature=1.0, top_p=top_p, generator=torch.Generator().manual_seed(1))
            times = []
            for _ in range(args.iters + 1):
                start = time.perf_counter()
                ids = draw(logits)  # type: ignore[operator]
                ids.tolist()  # the loop's sync: the ids reach the host
                times.append((time.perf_counter() - start) * 1e3)
            row = {
                "bench": "rollout_draw",
                "draw": name,
                "device": str(device),
                "rows": args.rows,
                "vocab": args.vocab,
                "top_p": top_p,
                "ms_per_token": round(statistics.median(times[1:]), 2),
                "threads": torch.get_num_threads(),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
