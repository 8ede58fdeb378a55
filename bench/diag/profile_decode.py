"""Rollout decode, second look (issue 48): a bare decode forward of the 8B resident copy at
256 rows with its LoRA adapters and with them off (the adapter's share), a profile of
decode-only forwards, and the sampler's per-token time with the allocator's device
allocations counted (cudaMalloc churn). One-off diagnosis; prints plain text.
  source bench/device_env.sh && python3 bench/diag/profile_decode.py
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import grpo
from bench.dpo import _wrap
from engine.adapters.lora import adapters_disabled
from rp_service.worker.generation import make_sampler
from rp_service.worker.sampling import top_p_draw


def main() -> None:
    cuda = torch.cuda.is_available()
    args = grpo.parse_args(
        ["--prompts", "32", "--completion-len", "64"] + ([] if cuda else ["--tiny"])
    )
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dev = "cuda" if cuda else "cpu"
    rp, _ = _wrap(args, nf4=False)
    model = rp.rp_unwrap()[1]
    sampler = make_sampler(
        model, rows=256, tokens=args.prompt_len + 64, prompt_width=args.prompt_len
    )
    sampler.refresh()
    m = sampler.model
    vocab = model.config.vocab_size
    ids = torch.randint(5, vocab - 5, (256, args.prompt_len), device=dev)

    def decode(n: int, cache) -> float:
        tok = ids[:, -1:]
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            m(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
        sync()
        return (time.perf_counter() - t0) / n * 1e3

    with torch.no_grad():
        for label, off in (("lora", False), ("adapters off", True), ("lora", False)):
            cache = m(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
            if off:
                with adapters_disabled():
                    decode(3, cache)
                    ms = decode(10, cache)
            else:
                decode(3, cache)
                ms = decode(10, cache)
            print(f"bare decode forward, 256 rows, {label}: {ms:.1f} ms")
        from torch.profiler import ProfilerActivity, profile

        cache = m(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
        decode(3, cache)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            decode(5, cache)
        ka = prof.key_averages()
        print(ka.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))

    def run(rows: int, tokens: int) -> float:
        draw = top_p_draw(temperature=1.0, top_p=1.0, generator=torch.Generator().manual_seed(1))
        sync()
        t0 = time.perf_counter()
        sampler.complete(
            [ids[r].tolist() for r in range(rows)],
            draw=draw,
            max_new_tokens=tokens,
            stop=set(),
            max_positions=1 << 30,
            pad_id=0,
        )
        sync()
        return time.perf_counter() - t0

    run(256, 4)
    for _ in range(2):
        before = torch.cuda.memory_stats().get("num_device_alloc", 0) if cuda else 0
        a = run(256, 8)
        b = run(256, 40)
        after = torch.cuda.memory_stats().get("num_device_alloc", 0) if cuda else 0
        print(
            f"sampler 256 rows: {(b - a) / 32 * 1e3:.1f} ms a token; device allocs {after - before}"
        )


if __name__ == "__main__":
    main()
