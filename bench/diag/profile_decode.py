"""Where a rollout decode step's time goes (issue 48): the 8B resident sampler, eager, at
64 and 256 rows, timed per token, then one profiled stretch (torch profiler tables by GPU
self time and by CPU time). One-off diagnosis; prints plain text.
  source bench/device_env.sh && python3 bench/diag/profile_decode.py
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import grpo
from bench.dpo import _wrap
from rp_service.worker.generation import make_sampler
from rp_service.worker.sampling import top_p_draw


def main() -> None:
    cuda = torch.cuda.is_available()
    argv = ["--prompts", "32", "--completion-len", "64"] + ([] if cuda else ["--tiny"])
    args = grpo.parse_args(argv)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dev = "cuda" if cuda else "cpu"
    rp, _ = _wrap(args, nf4=False)
    model = rp.rp_unwrap()[1]
    print("attn:", getattr(model.config, "_attn_implementation", None), "dtype:", model.dtype)
    sampler = make_sampler(
        model, rows=256, tokens=args.prompt_len + 64, prompt_width=args.prompt_len
    )
    sampler.refresh()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    base = [
        torch.randint(5, vocab - 5, (args.prompt_len,), generator=gen).tolist() for _ in range(256)
    ]

    def run(rows: int, tokens: int) -> float:
        draw = top_p_draw(temperature=1.0, top_p=1.0, generator=torch.Generator().manual_seed(1))
        sync()
        t0 = time.perf_counter()
        sampler.complete(
            base[:rows],
            draw=draw,
            max_new_tokens=tokens,
            stop=set(),
            max_positions=1 << 30,
            pad_id=0,
        )
        sync()
        return time.perf_counter() - t0

    run(64, 4)
    for rows in (64, 256):
        a, b = run(rows, 8), run(rows, 40)
        print(f"rows {rows}: {(b - a) / 32 * 1e3:.1f} ms a token (prefill+8: {a:.2f} s)")
    # the bare model: one decode forward with HF's own cache, no sampler code around it
    m = sampler.model if hasattr(sampler, "model") else None
    if m is not None:
        ids = torch.randint(5, vocab - 5, (256, args.prompt_len), device=dev)
        with torch.no_grad():
            out = m(input_ids=ids, use_cache=True)
            cache = out.past_key_values
            tok = ids[:, -1:]
            for _ in range(3):
                m(input_ids=tok, past_key_values=cache, use_cache=True)
            sync()
            t0 = time.perf_counter()
            for _ in range(20):
                m(input_ids=tok, past_key_values=cache, use_cache=True)
            sync()
            print(
                f"bare HF decode forward, 256 rows, no mask: {(time.perf_counter() - t0) / 20 * 1e3:.1f} ms"
            )
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(256, 12)
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
    print(ka.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
