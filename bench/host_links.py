"""Host <-> GPU copy bandwidth, one GPU at a time and all at once (issue 43: where a
several-GPU step's time goes).

Every activation handed from one device to the next, every saved attention output and every
layer upload crosses a GPU's host link; if GPUs share a PCIe switch or sit on another NUMA
node than the pinned buffers, 4 GPUs get less than 4 times one GPU's bandwidth and the
round-robin pipeline cannot scale past that. Prints one JSON line per measurement:
`{"bench": "host_links", "gpus": [...], "direction": "h2d"|"d2h", "gb_s_each": [...],
"gb_s_total": ...}`, and one line per ordered GPU pair for device-to-device copies.

    python bench/host_links.py --gib 1 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch


def _copy_rate(pairs: list[tuple[torch.Tensor, torch.Tensor]], repeat: int) -> list[float]:
    """GB/s of each (dst, src) copy, all issued at once from one thread per pair."""
    rates = [0.0] * len(pairs)
    barrier = threading.Barrier(len(pairs))

    def work(k: int) -> None:
        dst, src = pairs[k]
        dev = dst.device if dst.is_cuda else src.device
        with torch.cuda.device(dev):
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)  # warm-up
                stream.synchronize()
                barrier.wait()
                t0 = time.perf_counter()
                for _ in range(repeat):
                    dst.copy_(src, non_blocking=True)
                stream.synchronize()
                rates[k] = (
                    repeat * src.numel() * src.element_size() / (time.perf_counter() - t0) / 1e9
                )

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(pairs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rates


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    n = torch.cuda.device_count()
    numel = int(args.gib * 2**30) // 2
    hosts = [torch.empty(numel, dtype=torch.float16, pin_memory=True) for _ in range(n)]
    gpus = [torch.empty(numel, dtype=torch.float16, device=f"cuda:{i}") for i in range(n)]
    sets = [[i] for i in range(n)] + [list(range(k)) for k in (2, 4, 8) if k <= n]
    if n >= 4:
        sets.append([0, 2])
        sets.append([1, 3])
    for ids in sets:
        for direction in ("h2d", "d2h"):
            pairs = [
                (gpus[i], hosts[i]) if direction == "h2d" else (hosts[i], gpus[i]) for i in ids
            ]
            rates = _copy_rate(pairs, args.repeat)
            row = {
                "bench": "host_links",
                "gpus": ids,
                "direction": direction,
                "gib": args.gib,
                "gb_s_each": [round(r, 1) for r in rates],
                "gb_s_total": round(sum(rates), 1),
            }
            print(json.dumps(row), flush=True)
    for a in range(n):
        for b in range(n):
            if a != b:
                rate = _copy_rate([(gpus[b], gpus[a])], args.repeat)[0]
                row = {"bench": "host_links.p2p", "src": a, "dst": b, "gb_s": round(rate, 1)}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
