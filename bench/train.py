"""Training throughput of a Qwen3 shape with RoundPipe, and the GPU-resident baseline.

Prints one JSON line per result (system = roundpipe | pytorch-baseline): tokens/s (median
of the measured steps after warm-up), model TFLOP/s (6N + causal attention, the ANCHORS.md
convention), peak GPU memory (torch.cuda.max_memory_allocated) and peak host memory
(ru_maxrss of the process so far).

    python bench/train.py                                  # Qwen3-1.7B shape, RoundPipe
    python bench/train.py --baseline                       # + plain PyTorch on the GPU
    RP_DEVICES=cpu:1 python bench/train.py --model tiny    # CPU self-check (a few seconds)
    python bench/train.py --model qwen3-8b --seqs-per-step 32 --optim-state-dtype bfloat16 \
        --optim-grad-dtype model --pin-model arena --recompute-attention   # 12 bytes/param

Each result also carries `plan_host_gib`: engine.memory_plan's prediction of the peak host
memory, made (and checked against the budget) before the model is built.

The model is randomly initialised on the host (no download): weights are allocated
without HF's initialisers and filled with normal(0, 0.02) in place, so the 1.7B shape is
built in seconds. `--model tiny` also checks itself: the first step's loss against the HF
model's own loss on the same batch, finite losses, and trained weights in the HF model.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Run as a script from a checkout: make `engine` importable without installing.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

log = logging.getLogger("bench.train")

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": {
        "hidden_size": 2048,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 6144,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen3-4b": {
        "hidden_size": 2560,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 9728,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    # ~8.2 B parameters: ~165 GB of host memory with the fp32 optimizer (the 8-GPU machine)
    "qwen3-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 256,
        "tie_word_embeddings": True,
    },
}
# `--model tiny` runs on a CPU in seconds: shorter sequences, fewer of them.
TINY_DEFAULTS = {"seq_len": 32, "seqs_per_step": 8, "steps": 3, "warmup": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen3-1.7b")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (2048)")
    p.add_argument(
        "--seqs-per-step", type=int, default=None, help="sequences per optimizer step (64)"
    )
    p.add_argument("--steps", type=int, default=None, help="measured steps (5)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured first steps (2)")
    p.add_argument("--num-microbatch", type=int, default=4)
    p.add_argument("--recompute-grain", choices=["stage", "layer"], default="stage")
    p.add_argument("--sync", action="store_true", help="synchronous optimizer step")
    p.add_argument(
        "--recompute-attention",
        action="store_true",
        help="recompute attention in the backward (engine.models.RECOMPUTE_ATTENTION)",
    )
    p.add_argument(
        "--optim-state-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="Adam's exp_avg / exp_avg_sq dtype (engine.optim.Adam state_dtype)",
    )
    p.add_argument(
        "--optim-grad-dtype",
        choices=["float32", "model"],
        default="float32",
        help="the optimizer's gradient: an fp32 buffer, or the downloaded half gradient in place",
    )
    p.add_argument("--pin-model", choices=["alloc", "register", "arena", "off"], default="alloc")
    p.add_argument("--baseline", action="store_true", help="also run the GPU-resident baseline")
    p.add_argument("--baseline-only", action="store_true", help="run only the baseline")
    p.add_argument(
        "--baseline-microbatch", type=int, default=4, help="sequences per baseline micro-batch"
    )
    p.add_argument(
        "--log-plans",
        action="store_true",
        help="log each iteration's per-layer times and each new execution plan (stderr)",
    )
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="self-checks (default: on for --model tiny)",
    )
    args = p.parse_args(argv)
    tiny = args.model == "tiny"
    for key, full in (("seq_len", 2048), ("seqs_per_step", 64), ("steps", 5), ("warmup", 2)):
        if getattr(args, key) is None:
            setattr(args, key, TINY_DEFAULTS[key] if tiny else full)
    if args.check is None:
        args.check = tiny
    if args.seqs_per_step % args.num_microbatch:
        p.error("--seqs-per-step must be a multiple of --num-microbatch")
    if args.seqs_per_step % args.baseline_microbatch:
        p.error("--seqs-per-step must be a multiple of --baseline-microbatch")
    return args


@contextlib.contextmanager
def _no_hf_init() -> Iterator[None]:
    """Skip HF's and torch's weight initialisers (the weights are filled afterwards)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older 5.x releases keep it in modeling_utils
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        yield


def build_model(name: str, dtype: torch.dtype, attn: str, seed: int) -> nn.Module:
    """A randomly initialised Qwen3ForCausalLM of the named shape, on the host, in `dtype`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **SHAPES[name], max_position_embeddings=40960, rope_theta=1e6, use_cache=False
    )
    config._attn_implementation = attn
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate straight in the model dtype
    try:
        with _no_hf_init():
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    _fill_random(model, seed)
    if config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        model.tie_weights()
    return model.train()


# Random values are drawn once into a pool of prime length and copied into the weights
# (a different offset for each): a copy runs at memory speed where drawing 1.7B normals
# took over a minute on the host; a prime period never aligns with a weight's rows.
_POOL_LEN = 16_777_259


def _fill_random(model: nn.Module, seed: int) -> None:
    """Fill weights with normal(0, 0.02) values from a shared pool; norm weights with 1."""
    gen = torch.Generator().manual_seed(seed)
    pool: torch.Tensor | None = None
    offset = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if pool is None or pool.dtype != p.dtype:
                pool = (torch.randn(_POOL_LEN, generator=gen) * 0.02).to(p.dtype)
            flat, pos = p.view(-1), 0
            while pos < flat.numel():
                start = offset % _POOL_LEN
                take = min(flat.numel() - pos, _POOL_LEN - start)
                flat[pos : pos + take].copy_(pool[start : start + take])
                pos, offset = pos + take, offset + take


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """6N for the matmuls (forward + backward) + 6 L S h d for causal attention scores."""
    c = model.config
    attention = 6 * c.num_hidden_layers * seq_len * c.num_attention_heads * c.head_dim
    return 6 * count_params(model) + attention


def make_batches(args: argparse.Namespace, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    return [
        torch.randint(0, vocab, (args.seqs_per_step, args.seq_len), generator=gen)
        for _ in range(args.warmup + args.steps)
    ]


def host_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # KiB on Linux


def gpu_peak_gib() -> float | None:
    if not torch.cuda.is_available():
        return None
    return max(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count())) / 2**30


def gpu_peaks_gib() -> list[float]:
    """Peak allocated memory of every visible GPU (the busiest one is `peak_gpu_mem_gib`)."""
    if not torch.cuda.is_available():
        return []
    return [
        round(torch.cuda.max_memory_allocated(d) / 2**30, 2)
        for d in range(torch.cuda.device_count())
    ]


def reset_gpu_peak() -> None:
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)


def report(
    system: str,
    args: argparse.Namespace,
    model: nn.Module,
    times_s: list[float],
    losses: list[float],
    **extra: Any,
) -> dict[str, Any]:
    tokens = args.seqs_per_step * args.seq_len
    measured = times_s[args.warmup :]
    step_s = statistics.median(measured)
    tokens_per_s = tokens / step_s
    result = {
        "bench": "train",
        "system": system,
        "model": args.model,
        "params": count_params(model),
        "seq_len": args.seq_len,
        "seqs_per_step": args.seqs_per_step,
        "tokens_per_step": tokens,
        "steps": args.steps,
        "warmup": args.warmup,
        "tokens_per_s": round(tokens_per_s, 1),
        "model_tflops": round(tokens_per_s * flops_per_token(model, args.seq_len) / 1e12, 2),
        "step_s_median": round(step_s, 4),
        "step_s": [round(t, 4) for t in times_s],
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "peak_gpu_mem_gib": None if (g := gpu_peak_gib()) is None else round(g, 2),
        "peak_gpu_mem_gib_per_gpu": gpu_peaks_gib(),
        "peak_host_mem_gib": round(host_peak_gib(), 2),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        **extra,
    }
    print(json.dumps(result), flush=True)
    return result


def _make_optimizer(
    params: Any, lr: float, state_dtype: torch.dtype = torch.float32
) -> tuple[torch.optim.Optimizer, str]:
    """engine.optim.Adam if it imports and steps (its C library may be missing), else AdamW."""
    params = list(params)
    try:
        from engine.optim import Adam

        probe = nn.Parameter(torch.zeros(3))
        probe.grad = torch.ones(3)
        Adam([probe], lr=lr).step()  # builds/loads the C library now, not on the step thread
    except Exception as exc:
        if state_dtype != torch.float32:
            raise
        print(f"# engine.optim.Adam unusable ({exc!r}); using torch.optim.AdamW", file=sys.stderr)
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0), "torch.optim.AdamW"
    return Adam(params, lr=lr, state_dtype=state_dtype), "engine.optim.Adam"


def reference_loss(model: nn.Module, ids: torch.Tensor) -> float:
    """The HF model's own loss on `ids`, in fp32 on the host (the tiny self-check's oracle)."""
    import copy

    ref = copy.deepcopy(model).float()
    with torch.no_grad():
        return float(ref(input_ids=ids, labels=ids).loss)


def _last_plan(rp: Any) -> str | None:
    """The layer groups of the measured steps: the automatic plan of the latest timings."""
    plans = getattr(rp, "_plans", {})  # (run type, devices, maturity) -> plan
    return repr(plans[max(plans, key=lambda k: k[2])]) if plans else None


def host_plan(args: argparse.Namespace) -> Any:
    """engine.memory_plan's prediction of this run's peak host memory (from shapes only)."""
    from engine.memory_plan import ModelShape, RunShape, plan_host_memory

    shape = ModelShape.from_config({**SHAPES[args.model], "model_type": "qwen3"})
    run = RunShape(
        tokens_per_step=args.seqs_per_step * args.seq_len,
        seq_len=args.seq_len,
        num_microbatch=args.num_microbatch,
        recompute_grain=args.recompute_grain,
        optim_grad_dtype="optim" if args.optim_grad_dtype == "float32" else "model",
        optim_state_dtype=args.optim_state_dtype,
        pin_model=args.pin_model,
        cuda=torch.cuda.is_available(),
        saved_attention=not args.recompute_attention,
    )
    return plan_host_memory(shape, run)


def run_roundpipe(args: argparse.Namespace) -> dict[str, Any]:
    import engine.models
    from engine.device import get_num_devices
    from engine.models import causal_lm_loss_fn
    from engine.run_config import RoundPipeRunConfig
    from engine.wrapper import wrap_model_to_roundpipe

    plan = host_plan(args)
    plan.check()  # before building: refuse a run the OOM killer would end
    t0 = time.perf_counter()
    model = build_model(args.model, torch.float16, "sdpa", args.seed)
    build_s = time.perf_counter() - t0
    batches = make_batches(args, model.config.vocab_size)
    expected_first = reference_loss(model, batches[0]) if args.check else None
    initial = {n: p.detach().clone() for n, p in model.named_parameters()} if args.check else {}

    engine.models.RECOMPUTE_ATTENTION = args.recompute_attention
    t0 = time.perf_counter()
    rp = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=True,
        model_run_config=RoundPipeRunConfig(
            num_microbatch=args.num_microbatch, recompute_grain=args.recompute_grain
        ),
        optim_dtype=torch.float32,
        optim_grad_dtype=torch.float16 if args.optim_grad_dtype == "model" else None,
        pin_model=args.pin_model,
        name=f"bench-{args.model}",
    )
    wrap_s = time.perf_counter() - t0
    optimizer, optimizer_name = _make_optimizer(
        rp.optim_parameters(), args.lr, getattr(torch, args.optim_state_dtype)
    )

    def step_fn() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    reset_gpu_peak()
    times, losses = [], []
    for ids in batches:
        start = time.perf_counter()
        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "return_logits": False},
            label=ids,
            loss_fn=causal_lm_loss_fn(ids),
        )
        rp.step(step_fn, is_async=not args.sync)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    rp.synchronize()

    checks: dict[str, Any] = {}
    if args.check:
        checks = self_check(model, initial, losses, expected_first)
    result = report(
        "roundpipe",
        args,
        model,
        times,
        losses,
        num_devices=get_num_devices(),
        num_microbatch=args.num_microbatch,
        recompute_grain=args.recompute_grain,
        async_step=not args.sync,
        recompute_attention=args.recompute_attention,
        optimizer=optimizer_name,
        model_dtype="float16",
        optim_dtype="float32",
        optim_state_dtype=args.optim_state_dtype,
        optim_grad_dtype=args.optim_grad_dtype,
        pin_model=args.pin_model,
        plan_host_gib=round(plan.total_bytes / 2**30, 2),
        plan_host_parts_gib=plan.summary()["parts_gib"],
        build_s=round(build_s, 2),
        wrap_s=round(wrap_s, 2),
        plan=_last_plan(rp),
        **checks,
    )
    return result


def self_check(
    model: nn.Module,
    initial: dict[str, torch.Tensor],
    losses: list[float],
    expected_first: float | None,
) -> dict[str, Any]:
    """Fail loudly if the run did not train the HF model it was given."""
    problems = []
    if not all(math.isfinite(x) for x in losses):
        problems.append(f"non-finite loss: {losses}")
    # fp16 model vs the fp32 reference on the same weights: agree to fp16 accuracy.
    if expected_first is not None and abs(losses[0] - expected_first) > 1e-2 * abs(expected_first):
        problems.append(f"first loss {losses[0]} != HF loss {expected_first}")
    changed = sum(
        not torch.equal(p.detach().cpu(), initial[n]) for n, p in model.named_parameters()
    )
    if changed == 0:
        problems.append("no parameter of the HF model changed after training")
    if problems:
        raise SystemExit("self-check failed: " + "; ".join(problems))
    return {"check": "ok", "reference_loss_first": expected_first, "params_changed": changed}


def run_baseline(args: argparse.Namespace) -> dict[str, Any]:
    """HF model on the GPU: fp32 master, bf16 autocast, per-layer checkpointing, fused AdamW."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.model, torch.float32, "sdpa", args.seed).to(device)
    # Per-layer activation checkpointing; renamed in later transformers 5.x releases.
    enable = (
        getattr(model, "activation_checkpointing_enable", None)
        or model.gradient_checkpointing_enable
    )
    enable()
    model.config.use_cache = False
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=fused)
    batches = make_batches(args, model.config.vocab_size)
    accum = args.seqs_per_step // args.baseline_microbatch

    reset_gpu_peak()
    times, losses = [], []
    for ids in batches:
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        for chunk in ids.split(args.baseline_microbatch):
            chunk = chunk.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=chunk, labels=chunk).loss / accum
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))  # syncs: the step is done when its time is taken
        times.append(time.perf_counter() - start)
    result = report(
        "pytorch-baseline",
        args,
        model,
        times,
        losses,
        micro_batch_seqs=args.baseline_microbatch,
        grad_accum=accum,
        optimizer=f"torch.optim.AdamW(fused={fused})",
        master_dtype="float32",
        autocast="bfloat16",
        activation_checkpointing="per-layer",
    )
    return result


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="# %(name)s: %(message)s")
    if args.log_plans:
        for name in ("engine.timer", "engine.roundpipe"):
            logging.getLogger(name).setLevel(logging.DEBUG)
    torch.manual_seed(args.seed)
    # The baseline first: the process's peak host memory is then RoundPipe's, not its.
    if args.baseline or args.baseline_only:
        run_baseline(args)
        _release_memory()  # the baseline's model and optimizer died with its frame
    if not args.baseline_only:
        run_roundpipe(args)


if __name__ == "__main__":
    main()
