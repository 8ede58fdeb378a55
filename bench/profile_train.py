"""Where a RoundPipe training step's time goes: GPU streams, engine threads, idle gaps.

Builds the bench/train.py model, times steps (default: engine.optim.Adam, asynchronous;
`--variants noop,adam` adds a no-op optimizer, the engine alone), then profiles two
back-to-back iterations with torch.profiler and analyses the second, which overlaps the
first one's optimizer step. Prints one JSON line each for:
- `profile_train`: tokens/s, the summed kernel/copy time per CUDA stream, the plans;
- `profile_train.host`: milliseconds per engine thread and activity (job bodies, waits,
  throttling, uploads, downloads, the optimizer's publish/fold and Adam), recorded by
  bench/host_timeline.py since torch.profiler sees CPU ops of this thread only;
- `profile_train.gaps`: the busiest compute stream's idle time, attributed to what each
  controller thread was doing in the middle of each gap, and the largest gaps.
The Chrome trace and the host spans (gzipped) go to --trace-dir (default: $OUT).

    python bench/profile_train.py --model qwen3-1.7b --steps 3 --warmup 2 --trace-dir /tmp/p
    RP_DEVICES=cuda:0,1 python bench/profile_train.py --num-microbatch 8
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import host_timeline
from bench.shapes import SHAPES, build_model
from bench.train import make_batches


def stream_busy(prof: torch.profiler.profile) -> dict[str, float]:
    """Summed device time (ms) per stream, kernels and copies."""
    busy: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        key = f"stream{getattr(ev, 'device_resource_id', '?')}"
        dur = ev.time_range.elapsed_us() / 1000 if hasattr(ev, "time_range") else 0.0
        busy[key] = busy.get(key, 0.0) + dur
    return busy


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen3-1.7b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--seqs-per-step", type=int, default=64)
    p.add_argument("--num-microbatch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--variants", default="adam")
    p.add_argument("--trace-dir", default=os.environ.get("OUT"))
    p.add_argument("--profile", action="store_true", help="print the kernel table")
    p.add_argument("--lora", action="store_true", help="LoRA rank 16 on every projection")
    p.add_argument("--pin-model", choices=["alloc", "register", "arena"], default="alloc")
    p.add_argument(
        "--base",
        choices=["fp16", "bf16", "nf4"],
        default="fp16",
        help="bf16/nf4: bench/qlora.py's model (random bf16 weights, or its decoder linears "
        "NF4-packed), to see where an NF4 base's time goes against the bf16 one",
    )
    p.add_argument("--recompute-attention", action="store_true")
    args = p.parse_args()

    from engine import RoundPipeRunConfig, wrap_model_to_roundpipe
    from engine.adapters.lora import LoraConfig
    from engine.models import causal_lm_loss_fn
    from engine.optim import Adam

    dtype = torch.float16
    if args.base == "fp16":
        model = build_model(args.model, dtype, "sdpa", 0)
    else:
        from bench import qlora

        ns = argparse.Namespace(model=args.model, tiny=False)
        model = qlora.build_model(ns, nf4=args.base == "nf4")
    rp = wrap_model_to_roundpipe(
        model,
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=args.num_microbatch),
        lora_config=LoraConfig(rank=16, alpha=32.0) if args.lora else None,
        recompute_attention=args.recompute_attention,
        pin_model=args.pin_model,
    )
    tokens = args.seq_len * args.seqs_per_step
    ns = argparse.Namespace(
        seed=0,
        warmup=args.warmup,
        steps=args.steps,
        seqs_per_step=args.seqs_per_step,
        seq_len=args.seq_len,
    )
    batches = make_batches(ns, model.config.vocab_size)
    opt = Adam(rp.optim_parameters(), lr=1e-5)

    def adam_step() -> None:
        opt.step()
        opt.zero_grad()

    def noop_step() -> None:
        pass

    for variant in args.variants.split(","):
        step_fn = {"noop": noop_step, "adam": adam_step}[variant]
        times: list[float] = []
        for k, ids in enumerate(batches):
            t0 = time.perf_counter()
            rp.forward_backward(
                input_kwargs={"input_ids": ids}, label=ids, loss_fn=causal_lm_loss_fn(ids)
            )
            t_fb = time.perf_counter() - t0
            rp.step(step_fn)
            times.append(time.perf_counter() - t0)
            print(
                json.dumps(
                    {
                        "variant": variant,
                        "step": k,
                        "fb_s": round(t_fb, 3),
                        "step_s": round(times[-1], 3),
                    }
                ),
                flush=True,
            )
        rp.synchronize()
        measured = times[args.warmup :]
        med = statistics.median(measured)
        # Profile two iterations back to back, as in training: the second one overlaps the
        # first one's optimizer step, which is the steady state. The analysis looks at it.
        host_timeline.install()
        host_timeline.start()
        marks: dict[str, float] = {}
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            t0 = time.perf_counter()
            for k in range(2):
                ids = batches[k % len(batches)]
                marks[f"fb{k}_start"] = time.time_ns() / 1000
                with torch.profiler.record_function(f"iteration{k}"):
                    rp.forward_backward(
                        input_kwargs={"input_ids": ids}, label=ids, loss_fn=causal_lm_loss_fn(ids)
                    )
                marks[f"fb{k}_end"] = time.time_ns() / 1000
                rp.step(step_fn)
            rp.synchronize()
            wall_ms = (time.perf_counter() - t0) * 1000
        spans = host_timeline.stop()
        busy = {k: round(v, 1) for k, v in stream_busy(prof).items()}
        result: dict[str, Any] = {
            "bench": "profile_train",
            "variant": variant,
            "model": args.model,
            "lora": args.lora,
            "base": args.base,
            "tokens_per_s": round(tokens / med, 1),
            "step_s_median": round(med, 3),
            "profiled_wall_ms_2_iterations": round(wall_ms, 1),
            "stream_busy_ms": busy,
            "plans": {str(k): repr(v) for k, v in rp._plans.items()},
        }
        print(json.dumps(result), flush=True)
        window = (marks["fb1_start"], marks["fb1_end"])
        print(
            json.dumps(
                {
                    "bench": "profile_train.host",
                    "variant": variant,
                    "iteration1_ms": round((window[1] - window[0]) / 1000, 1),
                    "ms_by_thread_and_label": host_timeline.summarize(spans, *window),
                }
            ),
            flush=True,
        )
        trace_path = Path(args.trace_dir or "/tmp") / f"trace_{args.base}_{variant}.json"
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
        trace = json.loads(trace_path.read_text())
        # Kineto's clock against ours: the 'iteration1' range was recorded at fb1_start.
        it1 = [
            e for e in trace["traceEvents"] if e.get("name") == "iteration1" and e.get("ph") == "X"
        ]
        offset = marks["fb1_start"] - float(it1[0]["ts"]) if it1 else 0.0
        gaps = host_timeline.gpu_gaps(trace, spans, window, offset)
        print(json.dumps({"bench": "profile_train.gaps", "variant": variant, **gaps}), flush=True)
        if args.trace_dir:
            # gzip: a step's trace is tens of MB of JSON and compresses about tenfold
            with trace_path.open("rb") as src, gzip.open(f"{trace_path}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            with gzip.open(Path(args.trace_dir) / f"host_{args.base}_{variant}.json.gz", "wt") as f:
                json.dump({"offset_us": offset, "marks": marks, "spans": spans}, f)
        trace_path.unlink()
        if args.profile:
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)


if __name__ == "__main__":
    main()
