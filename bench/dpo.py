"""DPO throughput: LoRA DPO through the engine beside SFT LoRA and a GPU-resident peft DPO.

Prints one JSON line per result (issue 32's Performance section):

    python bench/dpo.py --model qwen3-8b --pairs-per-step 32 --seq-len 2048 \\
        --num-microbatch 8 --baseline           # engine DPO vs engine SFT vs peft DPO
    RP_DEVICES=cpu:1 python bench/dpo.py --tiny --baseline      # CPU self-check

Weights are random bf16 (no download), LoRA rank 16 (alpha 32) on every projection, fp32
masters, the engine's Adam, async step. A step is `pairs-per-step` pairs of two rows of
`seq-len` tokens (a shared prompt of a quarter of the row, then a chosen or a rejected
completion). Tokens per second count the policy's tokens once: 2 x pairs x seq-len a step,
whatever the reference costs. The runs:

- `engine-dpo`: per step a forward without gradients with the adapters off (the
  reference), then `forward_backward` with the DPO loss (chunked log-probabilities);
- `engine-sft`: the same rows as plain causal-LM SFT, the same call's yardstick;
- `peft-dpo` (`--baseline`): the model resident on the GPU with peft's LoRA, activation
  checkpointing, per micro-batch a no-grad reference forward under `disable_adapter()`
  and the policy forward and backward through full logits (as TRL's DPOTrainer with
  `precompute_ref_log_probs=False`), fused AdamW over the adapters.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.options import add_lora_step_options
from bench.qlora import SHAPES, build_model, gpu_peak_gib, host_peak_gib

_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BETA = 0.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU, short")
    p.add_argument("--pairs-per-step", type=int, default=32)
    add_lora_step_options(p, steps=3)
    p.add_argument("--baseline", action="store_true", help="also peft DPO on the GPU")
    p.add_argument("--baseline-micro-pairs", type=int, default=1, help="pairs per peft pass")
    p.add_argument("--no-sft", action="store_true", help="skip the SFT yardstick")
    args = p.parse_args(argv)
    if args.tiny:
        args.model = "tiny"
        args.seq_len, args.pairs_per_step, args.num_microbatch = 33, 6, 3
        args.steps, args.warmup = 2, 1
    return args


def pair_batches(args: argparse.Namespace, vocab: int, n: int) -> list[tuple[Any, Any]]:
    """`n` steps of `(input_ids, targets)`: rows chosen, rejected, ... of (2P, seq_len)."""
    gen = torch.Generator().manual_seed(1)
    prompt = args.seq_len // 4
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2 * args.pairs_per_step, args.seq_len), generator=gen)
        ids[1::2, :prompt] = ids[0::2, :prompt]  # a pair shares its prompt
        targets = torch.full_like(ids, -100)
        targets[:, prompt - 1 : -1] = ids[:, prompt:]
        out.append((ids, targets))
    return out


def _wrap(args: argparse.Namespace, *, nf4: bool = False) -> tuple[Any, Any]:
    """The random model (its decoder linears NF4 if `nf4`) with LoRA, wrapped; its Adam."""
    from engine import RoundPipeRunConfig, wrap_model_to_roundpipe
    from engine.adapters.lora import LoraConfig
    from engine.optim import Adam

    model = build_model(args, nf4=nf4)
    rp = wrap_model_to_roundpipe(
        model,
        lora_config=LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank),
        model_run_config=RoundPipeRunConfig(num_microbatch=args.num_microbatch),
        optim_dtype=torch.float32,
        pin_model="arena" if torch.cuda.is_available() else "off",
    )
    return rp, Adam(rp.optim_parameters(), lr=1e-6)


def _timed(args: argparse.Namespace, step: Any) -> tuple[float, list[float]]:
    """Run `step(i)` for the warm-up and measured steps; the measured seconds, the losses."""
    losses = []
    start = time.perf_counter()
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        losses.append(step(i))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, losses


def _result(args: argparse.Namespace, run: str, elapsed: float, losses: list[float]) -> dict:
    tokens = args.steps * 2 * args.pairs_per_step * args.seq_len
    return {
        "run": run,
        "tokens_per_s": round(tokens / elapsed, 1),
        "step_s": round(elapsed / args.steps, 3),
        "host_peak_gib": round(host_peak_gib(), 2),
        "gpu_peak_gib": gpu_peak_gib(),
        "losses": [round(x, 4) for x in losses],
    }


def run_engine_dpo(args: argparse.Namespace) -> dict[str, Any]:
    from engine import RoundPipeRunConfig
    from engine.adapters.lora import adapters_disabled
    from rp_service.worker.objectives import dpo

    rp, opt = _wrap(args)
    data = pair_batches(args, rp.config.vocab_size, args.warmup + args.steps)
    counts = dpo.pair_counts(args.pairs_per_step, args.num_microbatch)
    run_config = RoundPipeRunConfig(
        num_microbatch=len(counts),
        split_input=dpo.split_rows(counts),
        split_label=dpo.split_label(counts),
    )
    loss_fn = dpo.dpo_loss_fn(beta=BETA, label_smoothing=0.0, num_pairs=args.pairs_per_step)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    phases: list[tuple[float, float]] = []  # per step: the reference's and the policy's s

    def step(i: int) -> float:
        ids, targets = data[i]
        t0 = time.perf_counter()
        with adapters_disabled(rp):
            ref = dpo.sequence_logps(rp, ids, targets, num_microbatch=args.num_microbatch)
        t1 = time.perf_counter()  # sequence_logps returns on the host: the pass is done
        values = rp.forward_backward(
            input_kwargs={"input_ids": ids, "return_logits": False},
            label=(targets, ref),
            loss_fn=loss_fn,
            run_config=run_config,
        )
        rp.step(step_fn, is_async=True)
        loss = float(values[0])
        phases.append((t1 - t0, time.perf_counter() - t1))
        return loss

    elapsed, losses = _timed(args, step)
    rp.synchronize()
    out = _result(args, "engine-dpo", elapsed, losses)
    measured = phases[args.warmup :]
    out["reference_s"] = [round(a, 3) for a, _ in measured]
    out["policy_s"] = [round(b, 3) for _, b in measured]
    return out


def run_engine_sft(args: argparse.Namespace) -> dict[str, Any]:
    from engine.models import causal_lm_loss_fn

    rp, opt = _wrap(args)
    data = pair_batches(args, rp.config.vocab_size, args.warmup + args.steps)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    def step(i: int) -> float:
        ids, targets = data[i]
        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "return_logits": False},
            label=targets,
            loss_fn=causal_lm_loss_fn(targets, shifted=True),
        )
        rp.step(step_fn, is_async=True)
        return float(loss)

    elapsed, losses = _timed(args, step)
    rp.synchronize()
    out = _result(args, "engine-sft", elapsed, losses)
    return out


def _row_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row sums of target log-probabilities from full logits, row by row (TRL's
    selective log-softmax: one row's fp32 log-sum-exp at a time)."""
    sums = []
    for row_logits, row_targets in zip(logits, targets, strict=True):
        valid = row_targets != -100
        picked = row_logits.gather(-1, row_targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        lse = torch.logsumexp(row_logits.float(), dim=-1)
        sums.append(((picked.float() - lse) * valid).sum())
    return torch.stack(sums)


def run_baseline(args: argparse.Namespace) -> dict[str, Any]:
    """peft DPO with the model resident on one device, activation checkpointing."""
    import peft

    if args.baseline_warmup is not None:
        args = argparse.Namespace(**{**vars(args), "warmup": args.baseline_warmup})

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args, nf4=False).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = peft.get_peft_model(
        model,
        peft.LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=_TARGETS),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, fused=device.type == "cuda")
    data = pair_batches(args, model.config.vocab_size, args.warmup + args.steps)
    rows = 2 * args.baseline_micro_pairs

    def step(i: int) -> float:
        ids, targets = data[i]
        total = 0.0
        for mb_ids, mb_targets in zip(ids.split(rows), targets.split(rows), strict=True):
            mb_ids, mb_targets = mb_ids.to(device), mb_targets.to(device)
            with torch.no_grad(), model.disable_adapter():
                ref = _row_logps(model(input_ids=mb_ids).logits, mb_targets)
            policy = _row_logps(model(input_ids=mb_ids).logits, mb_targets)
            z = BETA * ((policy[0::2] - ref[0::2]) - (policy[1::2] - ref[1::2]))
            loss = -F.logsigmoid(z).sum() / args.pairs_per_step
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    elapsed, losses = _timed(args, step)
    out = _result(args, "peft-dpo", elapsed, losses)
    out["micro_pairs"] = args.baseline_micro_pairs
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    common = {
        "bench": "dpo",
        "model": args.model,
        "seq_len": args.seq_len,
        "pairs_per_step": args.pairs_per_step,
        "policy_tokens_per_step": 2 * args.pairs_per_step * args.seq_len,
        "num_microbatch": args.num_microbatch,
        "lora_rank": args.lora_rank,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    runs = [run_engine_dpo]
    if not args.no_sft:
        runs.append(run_engine_sft)
    if args.baseline:
        runs.append(run_baseline)
    results = []
    for run in runs:
        try:
            result = {**common, **run(args)}
        except torch.OutOfMemoryError as exc:  # the baseline may not fit: say so
            result = {**common, "run": run.__name__, "error": f"out of memory: {str(exc)[:200]}"}
        print(json.dumps(result), flush=True)
        results.append(result)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    by_run = {r["run"]: r for r in results if "tokens_per_s" in r}
    if "engine-dpo" in by_run:
        dpo_tps = by_run["engine-dpo"]["tokens_per_s"]
        ratios = {
            f"vs_{name.replace('-', '_')}": round(dpo_tps / r["tokens_per_s"], 3)
            for name, r in by_run.items()
            if name != "engine-dpo"
        }
        if ratios:
            summary = {**common, "run": "summary", "engine_dpo_tokens_per_s": dpo_tps, **ratios}
            print(json.dumps(summary), flush=True)
            results.append(summary)
    return results


if __name__ == "__main__":
    main()
