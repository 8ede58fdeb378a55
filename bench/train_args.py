"""bench/train.py's command line: its options, the rules between them (each checked before
a model is built) and the learning-rate schedule they describe."""

from __future__ import annotations

import argparse
import math

import torch

from bench.shapes import SHAPES

# `--model tiny` runs on a CPU in seconds: shorter sequences, fewer of them.
TINY_DEFAULTS = {"seq_len": 32, "seqs_per_step": 8, "steps": 3, "warmup": 1}


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """bench/train.py's options, checked (the help shows `description`)."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen3-1.7b")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="keep only the first N decoder layers of the shape (memory probes of long sequences)",
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (2048)")
    p.add_argument(
        "--seqs-per-step", type=int, default=None, help="sequences per optimizer step (64)"
    )
    p.add_argument("--steps", type=int, default=None, help="measured steps (5)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured first steps (2)")
    p.add_argument("--num-microbatch", type=int, default=4)
    p.add_argument("--recompute-grain", choices=["stage", "layer"], default="stage")
    p.add_argument(
        "--group-layers",
        type=int,
        default=None,
        help="an explicit plan of K-layer groups (long sequences: fewer recompute inputs in "
        "host memory than the automatic one-layer groups)",
    )
    p.add_argument(
        "--mlp-chunk-tokens",
        type=int,
        default=None,
        help="engine.models.MLP_CHUNK_TOKENS: chunk the MLP over tokens above this many "
        "tokens a micro-batch (0: never)",
    )
    p.add_argument("--sync", action="store_true", help="synchronous optimizer step")
    p.add_argument(
        "--step-staleness",
        type=int,
        choices=[0, 1],
        default=1,
        help="the asynchronous step's staleness (RoundPipe step_staleness): 1, the seeds' "
        "step; 0, each layer published as the optimizer finishes it (the service default)",
    )
    p.add_argument(
        "--recompute-attention",
        action="store_true",
        help="recompute attention in the backward (wrap_model_to_roundpipe's recompute_attention)",
    )
    p.add_argument(
        "--optim-state-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="Adam's exp_avg / exp_avg_sq dtype (engine.optim.Adam state_dtype)",
    )
    p.add_argument(
        "--optim-memory",
        choices=["default", "compact"],
        default="default",
        help="compact: bf16 weights as the masters, 8-bit Adam moments, the bf16 gradient in "
        "place (~6 bytes a parameter; needs --dtype bfloat16; RoundPipe optim_memory)",
    )
    p.add_argument(
        "--no-layer-publish",
        action="store_true",
        help="compact: publish the weights when the whole step_fn returns, not layer by "
        "layer as the optimizer reports them (RoundPipe's private _publish_as_updated; A/B)",
    )
    p.add_argument(
        "--no-fold-ahead",
        action="store_true",
        help="fold the gradients into the optimizer's and sum their squares in the step, not "
        "while the backward runs (RoundPipe's private _fold_ahead, engine.fold_ahead; A/B)",
    )
    p.add_argument(
        "--copy-grads",
        action="store_true",
        help="copy every downloaded gradient into the optimizer's fp32 gradient, as before "
        "deferred copies (engine.optim._deferred: Adam reads the download in place; A/B)",
    )
    p.add_argument(
        "--text",
        action="store_true",
        help="train on generated text (the demo's stories as bytes) instead of random ids",
    )
    p.add_argument(
        "--optim-grad-dtype",
        choices=["float32", "model"],
        default="float32",
        help="the optimizer's gradient: an fp32 buffer, or the downloaded half gradient in place",
    )
    p.add_argument(
        "--pin-model",
        choices=["alloc", "register", "arena", "off"],
        default="alloc",
        help="pinning of the host model: torch's allocator (rounds each tensor up to a power "
        "of two), cudaHostRegister in place, or one registered arena (engine.memory.pin_module)",
    )
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
    p.add_argument(
        "--dtype",
        choices=["float16", "bfloat16"],
        default=None,
        help="model dtype (float16; bfloat16 for MoE shapes: torch's grouped_mm, which "
        "transformers' experts use on CUDA, takes bf16 only)",
    )
    p.add_argument(
        "--matmul-precision",
        choices=["bf16", "fp8"],
        default="bf16",
        help="RoundPipe's matmul_precision: fp8 multiplies the decoder's linear layers in "
        "float8 (engine.accel.fp8; needs --dtype bfloat16, the default with fp8)",
    )
    p.add_argument(
        "--fp8-recipe",
        choices=["rowwise", "tensorwise", "rowwise_with_gw_hp"],
        default="rowwise",
        help="RoundPipe's fp8_recipe (with --matmul-precision fp8)",
    )
    p.add_argument("--lora", action="store_true", help="LoRA fine-tuning (see above)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument(
        "--shard-optimizer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="under torchrun: fp32 masters and Adam state sharded across ranks (ZeRO-1)",
    )
    p.add_argument(
        "--memory-breakdown",
        action="store_true",
        help="record CUDA allocations and report the largest ones alive at the peak",
    )
    p.add_argument(
        "--replay-max-tokens",
        type=int,
        default=None,
        help="CUDA graph replay of decoder layers for micro-batches of up to this many "
        "tokens (engine.accel.graphs.REPLAY_MAX_TOKENS; default the engine's; 0: off)",
    )
    p.add_argument(
        "--no-widen-tail",
        action="store_true",
        help="on one GPU, keep the automatic plan's fused tail to the head "
        "(engine.planning.one_device.WIDEN_TAIL = False)",
    )
    p.add_argument(
        "--timed-groups",
        action="store_true",
        help="on one GPU, group layers by their measured times as on several, not by size "
        "(engine.planning.one_device.GROUP_BY_SIZE = False)",
    )
    p.add_argument(
        "--overlap-calls",
        action="store_true",
        help="overlap each call's backward with the next call's forward (RoundPipe overlap_calls)",
    )
    p.add_argument(
        "--double-buffer-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a second host copy of the weights that the C Adam writes and the step swaps "
        "in (RoundPipe double_buffer_weights; default: with --overlap-calls)",
    )
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument(
        "--grad-clip",
        type=float,
        default=None,
        help="clip the gradient norm to this in the step function, as the daemon does with "
        "train.grad_clip (torch.nn.utils.clip_grad_norm_ over the optimizer's parameters)",
    )
    p.add_argument(
        "--lr-warmup-steps",
        type=int,
        default=0,
        help="linear learning-rate warm-up: step k (from 1) takes lr * min(1, k / N), "
        "counting the unmeasured --warmup steps (0: the full lr from the first step)",
    )
    p.add_argument(
        "--lr-min-ratio",
        type=float,
        default=1.0,
        help="after the warm-up, a cosine decay to lr * this at the last step (1: constant lr)",
    )
    p.add_argument(
        "--lr-decay-steps",
        type=int,
        default=0,
        help="with --lr-min-ratio: decay over the last N steps only, the lr constant before "
        "them (0: over every step after the warm-up)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="self-checks (default: on for --model tiny)",
    )
    args = p.parse_args(argv)
    tiny = args.model in ("tiny", "tiny-moe")
    for key, full in (("seq_len", 2048), ("seqs_per_step", 64), ("steps", 5), ("warmup", 2)):
        if getattr(args, key) is None:
            setattr(args, key, TINY_DEFAULTS[key] if tiny else full)
    if args.check is None:
        args.check = tiny
    if args.dtype is None:
        fp8 = args.matmul_precision == "fp8"
        args.dtype = "bfloat16" if fp8 or "family" in SHAPES[args.model] else "float16"
    if args.matmul_precision == "fp8" and args.dtype != "bfloat16":
        p.error("--matmul-precision fp8 multiplies bfloat16 models: pass --dtype bfloat16")
    if args.seqs_per_step % args.num_microbatch:
        p.error("--seqs-per-step must be a multiple of --num-microbatch")
    if (args.baseline or args.baseline_only) and args.seqs_per_step % args.baseline_microbatch:
        p.error("--seqs-per-step must be a multiple of --baseline-microbatch")
    if args.memory_breakdown and _history_breaks_chunked_mlp(args):
        p.error(
            "--memory-breakdown records CUDA memory history, and with torch >= 2.11 that "
            "breaks torch.utils.checkpoint around compiled functions (SystemError: ... "
            "returned NULL without setting an exception; pytorch/pytorch#179536). This run "
            "chunks the MLP under checkpoint: pass --mlp-chunk-tokens 0 with "
            "--memory-breakdown, or drop --memory-breakdown"
        )
    return args


def _history_breaks_chunked_mlp(args: argparse.Namespace) -> bool:
    """Whether this run would chunk a dense MLP (under torch.utils.checkpoint, around the
    compiled chunk) on a torch whose CUDA memory history breaks that: 2.11 raised a
    SystemError in the backward of such chunks on the H100 only while history was on."""
    from torch.torch_version import TorchVersion

    from engine.models._mlp_chunks import DEFAULT_MLP_CHUNK_TOKENS

    if not torch.cuda.is_available() or TorchVersion(torch.__version__) < (2, 11):
        return False
    if "family" in SHAPES[args.model]:  # mixture-of-experts shapes never chunk their MLP
        return False
    limit = DEFAULT_MLP_CHUNK_TOKENS if args.mlp_chunk_tokens is None else args.mlp_chunk_tokens
    micro_batch_tokens = args.seqs_per_step // args.num_microbatch * args.seq_len
    return bool(limit) and micro_batch_tokens > limit


def scheduled_lr(
    lr: float,
    step: int,
    warmup_steps: int,
    total_steps: int = 0,
    min_ratio: float = 1.0,
    decay_steps: int = 0,
) -> float:
    """The learning rate of optimizer step `step` (1 for the first) under a linear warm-up
    over `warmup_steps` steps (0: none), then, when `min_ratio` < 1, a cosine decay that
    reaches lr * min_ratio at step `total_steps`: over the last `decay_steps` steps (the lr
    constant before them), or over every step after the warm-up when `decay_steps` is 0."""
    if step <= warmup_steps:
        return lr * step / warmup_steps
    start = total_steps - decay_steps if decay_steps > 0 else warmup_steps
    start = max(start, warmup_steps)
    if min_ratio >= 1.0 or total_steps <= start or step <= start:
        return lr
    done = min(1.0, (step - start) / (total_steps - start))
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * done)))


def lr_at(args: argparse.Namespace, step: int) -> float:
    """The learning rate of optimizer step `step` (1 for the first) under args' schedule."""
    total = args.warmup + args.steps
    return scheduled_lr(
        args.lr, step, args.lr_warmup_steps, total, args.lr_min_ratio, args.lr_decay_steps
    )
