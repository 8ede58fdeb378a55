"""Training throughput of a Qwen3 shape with RoundPipe, and the GPU-resident baseline.

Over ~700 lines: one script's two runs and the result line they share; its options (each
checked before a model is built) are in bench/train_args.py, the shapes it builds in
bench/shapes.py.

Prints one JSON line per result (system = roundpipe | pytorch-baseline): tokens/s (median
of the measured steps after warm-up), model TFLOP/s (6N + causal attention, the ANCHORS.md
convention), peak GPU memory (torch.cuda.max_memory_allocated) and peak host memory
(ru_maxrss of the process so far).

    python bench/train.py                                  # Qwen3-1.7B shape, RoundPipe
    python bench/train.py --baseline                       # + plain PyTorch on the GPU
    python bench/train.py --model qwen3-30b-a3b-6l         # MoE (bf16), full fine-tune
    RP_DEVICES=cpu:1 python bench/train.py --model tiny    # CPU self-check (a few seconds)
    python bench/train.py --lora --model qwen3-8b --baseline  # LoRA, + peft LoRA on the GPU
    python bench/train.py --lora --model qwen3-32b --seqs-per-step 16 --pin-model register
    torchrun --nproc-per-node 2 bench/train.py             # data parallel: a process per GPU
    python bench/train.py --model qwen3-8b --seqs-per-step 32 --optim-state-dtype bfloat16 \
        --optim-grad-dtype model --pin-model arena --recompute-attention   # 12 bytes/param
    python bench/train.py --matmul-precision fp8 --fp8-recipe rowwise   # FP8 (bench/fp8.sh)

`--lora`: rank-16 adapters (alpha 32) on every attention and MLP projection
(engine.adapters.lora), the fp16 base frozen (no master, gradient or optimizer state), fp32
adapters stepped by engine.optim.Adam. Its baseline is peft's LoRA on the HF model
entirely on the GPU: bf16 base, bf16 autocast, per-layer activation checkpointing,
fused AdamW on the adapters. LoRA's model TFLOP/s count 4N + attention per token (no
weight gradients of the frozen base).

Under torchrun (WORLD_SIZE > 1) every rank builds the same model, takes its share of the
same global batch (engine.parallel.data_parallel) and only rank 0 prints, with every rank's peak host
memory; NCCL on GPUs, gloo on CPU ranks (`RP_DEVICES=cpu:1 torchrun ... --model tiny`).

Each result also carries `plan_host_gib`: engine.planning.memory_plan's prediction of the peak host
memory, made (and checked against the budget) before the model is built.

The model is randomly initialised on the host (no download, bench/shapes.py), so the 1.7B
shape is built in seconds. `--model tiny` also checks itself: the first step's loss against the HF
model's own loss on the same batch, finite losses, and trained weights in the HF model.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Run as a script from a checkout: make `engine` importable without installing.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import train_args
from bench.options import grouped_plan
from bench.shapes import (
    SHAPES,
    build_model,
    count_active_params,
    count_base_params,
    count_params,
    flops_per_token,
)

log = logging.getLogger("bench.train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return train_args.parse_args(argv, description=__doc__)


# fp16/bf16 model copy, fp32 master, Adam m and v, fp32 gradient: a full fine-tune's host
# bytes per parameter.
_FULL_FINETUNE_BYTES_PER_PARAM = 18


def check_host_memory(args: argparse.Namespace) -> None:
    """Refuse a full fine-tune that cannot fit in this host's memory, before building it."""
    if getattr(args, "lora", False):  # adapters only: the optimizer state is tiny
        return
    import transformers

    shape = dict(SHAPES[args.model])
    family = shape.pop("family", "qwen3")
    prefix = {"qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}[family]
    config = getattr(transformers, f"{prefix}Config")(**shape)
    with torch.device("meta"):
        params = count_params(getattr(transformers, f"{prefix}ForCausalLM")(config))
    need = params * _FULL_FINETUNE_BYTES_PER_PARAM
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > total:
        raise SystemExit(
            f"--model {args.model} has {params / 1e9:.1f} B parameters: a full fine-tune needs "
            f"~{need / 2**30:.0f} GiB of host memory, this host has {total / 2**30:.0f} GiB; "
            "train adapters (--lora) or pick a smaller shape (e.g. qwen3-30b-a3b-6l)"
        )


def _compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (engine.timer's counter)."""
    from engine.timer import _compiled_graphs as graphs

    return graphs()


def make_batches(args: argparse.Namespace, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    if getattr(args, "text", False):  # the demo's generated stories, one byte a token
        from rp_service.demo import synthetic_records

        count = args.seqs_per_step * args.seq_len * (args.warmup + args.steps) // 150 + 64
        data = " ".join(r["text"] for r in synthetic_records(count, seed=args.seed)).encode()
        ids = torch.tensor(list(data), dtype=torch.long) % vocab
        rows = ids[: len(ids) // args.seq_len * args.seq_len].view(-1, args.seq_len)
        picks = torch.randint(
            0, rows.shape[0], (args.warmup + args.steps, args.seqs_per_step), generator=gen
        )
        return [rows[p] for p in picks]
    return [
        torch.randint(0, vocab, (args.seqs_per_step, args.seq_len), generator=gen)
        for _ in range(args.warmup + args.steps)
    ]


def unigram_entropy(batches: list[torch.Tensor]) -> float:
    """Entropy (nats) of the tokens' frequencies over `batches`: the loss of a model that
    predicts every token from the frequencies alone, the plateau a text run crosses on its
    way to learning the stories' structure."""
    counts = torch.bincount(torch.cat([b.reshape(-1) for b in batches])).double()
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * probs.log()).sum())


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
    batches: list[torch.Tensor],
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
        "params": count_base_params(model),
        "active_params": count_active_params(model),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "lora_rank": args.lora_rank if args.lora else None,
        "seq_len": args.seq_len,
        "seqs_per_step": args.seqs_per_step,
        "tokens_per_step": tokens,
        "steps": args.steps,
        "warmup": args.warmup,
        "tokens_per_s": round(tokens_per_s, 1),
        "model_tflops": round(
            tokens_per_s * flops_per_token(model, args.seq_len, args.lora) / 1e12, 2
        ),
        "step_s_median": round(step_s, 4),
        "step_s": [round(t, 4) for t in times_s],
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "losses": [round(x, 4) for x in losses],
        "lr": args.lr,
        "grad_clip": args.grad_clip,
        "lr_warmup_steps": args.lr_warmup_steps,
        "lr_min_ratio": args.lr_min_ratio,
        "lr_decay_steps": args.lr_decay_steps,
        "seed": args.seed,
        "text_unigram_entropy": (
            round(unigram_entropy(batches), 4) if getattr(args, "text", False) else None
        ),
        "peak_gpu_mem_gib": None if (g := gpu_peak_gib()) is None else round(g, 2),
        "peak_gpu_mem_gib_per_gpu": gpu_peaks_gib(),
        "peak_host_mem_gib": round(host_peak_gib(), 2),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        **extra,
    }
    print(json.dumps(result), flush=True)
    return result


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


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


def _deferred_grads(args: argparse.Namespace) -> bool:
    """Whether engine.optim.Adam reads the gradient downloads in place (the plan then counts
    no fp32 gradient buffer): not with --copy-grads, nor under data parallel (a rank's shards
    are plain parameters, their gradients copied)."""
    return not args.copy_grads and int(os.environ.get("WORLD_SIZE", "1")) == 1


def host_plan(args: argparse.Namespace) -> Any:
    """engine.planning.memory_plan's prediction of this run's peak host memory (from shapes only);
    None for the MoE shapes, which the plan does not model (check_host_memory covers them)."""
    from engine.device import get_num_devices
    from engine.planning.memory_plan import ModelShape, RunShape, plan_host_memory

    if "family" in SHAPES[args.model]:
        return None
    layers = {} if args.layers is None else {"num_hidden_layers": args.layers}
    shape = ModelShape.from_config({**SHAPES[args.model], **layers, "model_type": "qwen3"})
    run = RunShape(
        tokens_per_step=args.seqs_per_step * args.seq_len,
        seq_len=args.seq_len,
        num_microbatch=args.num_microbatch,
        recompute_grain=args.recompute_grain,
        optim_grad_dtype="optim" if args.optim_grad_dtype == "float32" else "model",
        optim_state_dtype=args.optim_state_dtype,
        optim_memory=args.optim_memory,
        pin_model=args.pin_model,
        cuda=torch.cuda.is_available(),
        saved_attention=not args.recompute_attention,
        trainable_params=shape.lora_params(args.lora_rank) if args.lora else None,
        double_buffer_weights=_double_buffer(args),
        overlap_calls=bool(args.overlap_calls),
        layers_per_group=args.group_layers,
        num_devices=get_num_devices(),
        deferred_grads=_deferred_grads(args),
    )
    return plan_host_memory(shape, run)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors (the plan's optim_state parts count these)."""
    return sum(
        t.nbytes
        for state in optimizer.state.values()
        for key, t in state.items()
        if torch.is_tensor(t) and key != "step"
    )


def _double_buffer(args: argparse.Namespace) -> bool:
    """RoundPipe's double_buffer_weights for these arguments (its default: overlap_calls)."""
    if args.double_buffer_weights is None:
        return bool(args.overlap_calls)
    return bool(args.double_buffer_weights)


def run_roundpipe(args: argparse.Namespace) -> dict[str, Any]:
    import engine.accel.graphs
    import engine.models
    import engine.planning.one_device
    from engine.device import get_num_devices
    from engine.models import causal_lm_loss_fn
    from engine.run_config import RoundPipeRunConfig
    from engine.wrapper import wrap_model_to_roundpipe

    plan = host_plan(args)
    if plan is not None:
        plan.check()  # before building: refuse a run the OOM killer would end
    else:
        check_host_memory(args)
    t0 = time.perf_counter()
    model = build_model(
        args.model,
        getattr(torch, args.dtype),
        "sdpa",
        args.seed,
        layers=args.layers,
        seq_len=args.seq_len,
    )
    build_s = time.perf_counter() - t0
    batches = make_batches(args, model.config.vocab_size)
    expected_first = reference_loss(model, batches[0]) if args.check else None
    initial = {n: p.detach().clone() for n, p in model.named_parameters()} if args.check else {}

    if args.replay_max_tokens is not None:
        engine.accel.graphs.ENABLED = args.replay_max_tokens > 0
        engine.accel.graphs.REPLAY_MAX_TOKENS = args.replay_max_tokens or None
    if args.mlp_chunk_tokens is not None:
        engine.models.MLP_CHUNK_TOKENS = args.mlp_chunk_tokens or None
    engine.planning.one_device.WIDEN_TAIL = not args.no_widen_tail
    engine.planning.one_device.GROUP_BY_SIZE = not args.timed_groups
    compact = args.optim_memory == "compact"
    dtypes: dict[str, Any] = (
        {"optim_memory": "compact"}
        if compact
        else {
            "optim_dtype": torch.float32,
            "optim_grad_dtype": (
                getattr(torch, args.dtype) if args.optim_grad_dtype == "model" else None
            ),
        }
    )
    t0 = time.perf_counter()
    rp = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=True,
        model_run_config=RoundPipeRunConfig(
            num_microbatch=args.num_microbatch,
            recompute_grain=args.recompute_grain,
            execute_plan=grouped_plan(model.config.num_hidden_layers + 2, args.group_layers),
        ),
        **dtypes,
        name=f"bench-{args.model}",
        lora_config=lora_config(args) if args.lora else None,
        recompute_attention=args.recompute_attention,
        pin_model=args.pin_model if torch.cuda.is_available() else "alloc",
        shard_optimizer=args.shard_optimizer,
        overlap_calls=args.overlap_calls,
        double_buffer_weights=_double_buffer(args),
        matmul_precision=args.matmul_precision,
        fp8_recipe=args.fp8_recipe,
    )
    wrap_s = time.perf_counter() - t0
    if args.optim_memory != "compact":
        rp.step_staleness = args.step_staleness
    if args.no_layer_publish:
        object.__setattr__(rp, "_publish_as_updated", False)
    if args.no_fold_ahead:
        object.__setattr__(rp, "_fold_ahead", False)
    if args.copy_grads:
        for _, pa in rp._all_params():
            pa.defer_copy = False
    dp = getattr(rp, "_dp", None)
    state_dtype = torch.uint8 if compact else getattr(torch, args.optim_state_dtype)
    optimizer, optimizer_name = _make_optimizer(rp.optim_parameters(), args.lr, state_dtype)

    adam_s: list[float] = []
    clipped = [p for group in optimizer.param_groups for p in group["params"]]

    def step_fn() -> None:
        start = time.perf_counter()
        if args.grad_clip is not None:
            if hasattr(optimizer, "clip_grad_norm_"):  # engine.optim.Adam's, as the daemon
                optimizer.clip_grad_norm_(args.grad_clip)
            else:
                torch.nn.utils.clip_grad_norm_(clipped, args.grad_clip)
        _set_lr(optimizer, train_args.lr_at(args, len(adam_s) + 1))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        adam_s.append(time.perf_counter() - start)

    reset_gpu_peak()
    recorder = MemoryBreakdown() if args.memory_breakdown else None
    times, losses, compiled = [], [], []
    for k, ids in enumerate(batches):
        graphs = _compiled_graphs()
        if dp is not None and k == args.warmup:
            dp.stats.update(steps=0, publish_s=0.0, reduce_s=0.0)  # count measured steps only
        start = time.perf_counter()
        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "return_logits": False},
            label=ids,
            loss_fn=causal_lm_loss_fn(ids),
        )
        rp.step(step_fn, is_async=not args.sync)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if _compiled_graphs() != graphs:
            compiled.append(k)
    rp.synchronize()
    breakdown = recorder.finish() if recorder is not None else None
    # A re-plan can put layers together in a new way (e.g. LoRA's frozen embedding with
    # the first decoder layer: an input without grad) and torch.compile builds a variant
    # during a measured step; the median includes it, the steady figure does not.
    steady = [t for k, t in enumerate(times) if k >= args.warmup and k not in compiled]
    tokens = args.seqs_per_step * args.seq_len

    checks: dict[str, Any] = {}
    if args.check:
        checks = self_check(model, initial, losses, expected_first, lora=args.lora)
    if dp is not None:
        checks.update(_ranks_summary(dp, args))
        if dp.rank != 0:
            return checks
    result = report(
        "roundpipe",
        args,
        model,
        times,
        losses,
        batches,
        num_devices=get_num_devices(),
        num_microbatch=args.num_microbatch,
        recompute_grain=args.recompute_grain,
        async_step=not args.sync,
        step_staleness=0 if compact else args.step_staleness,
        recompute_attention=args.recompute_attention,
        optimizer=optimizer_name,
        optimizer_s_median=round(statistics.median(adam_s[args.warmup :] or adam_s), 4),
        model_dtype=args.dtype,
        matmul_precision=args.matmul_precision,
        fp8_recipe=args.fp8_recipe if args.matmul_precision == "fp8" else None,
        experts_implementation=getattr(model.config, "_experts_implementation", None),
        optim_dtype="bfloat16" if compact else "float32",
        optim_state_dtype="uint8" if compact else args.optim_state_dtype,
        optim_memory=args.optim_memory,
        layer_publish=compact and not args.no_layer_publish,
        optimizer_state_bytes=_state_bytes(optimizer),
        loss_tail_mean=round(statistics.fmean(losses[-20:]), 5),
        optim_grad_dtype=args.optim_grad_dtype,
        pin_model=args.pin_model,
        plan_host_gib=round(plan.total_bytes / 2**30, 2) if plan is not None else None,
        plan_host_parts_gib=plan.summary()["parts_gib"] if plan is not None else None,
        build_s=round(build_s, 2),
        wrap_s=round(wrap_s, 2),
        plan=_last_plan(rp),
        layer_times_ms=_layer_times(rp),
        overlap_calls=args.overlap_calls,
        double_buffer_weights=_double_buffer(args),
        second_copy_gib=round(getattr(rp, "second_copy_bytes", 0) / 2**30, 2),
        optimizer_thread_s=_phase_medians(getattr(rp, "step_phases", []), args.warmup),
        fold_ahead=not args.no_fold_ahead,
        deferred_grad_copies=not args.copy_grads,
        fold_ahead_s=_phase_medians(getattr(rp, "fold_phases", []), args.warmup),
        layer_gb=[round(g, 6) for g in rp.layer_size],
        one_device=_one_device(rp),
        replay={
            "enabled": engine.accel.graphs.ENABLED,
            "max_tokens": engine.accel.graphs.REPLAY_MAX_TOKENS,
            **engine.accel.graphs.stats(),
        },
        gpu_peak_breakdown=breakdown,
        steps_with_compile=compiled,
        tokens_per_s_steps_without_compile=(
            round(tokens / statistics.median(steady), 1) if steady else None
        ),
        **checks,
    )
    return result


def _one_device(rp: Any) -> dict[str, Any] | None:
    """The one-GPU plan rules that were on (engine.planning.one_device), and the activations measured
    for the tail (GiB of one micro-batch): the decoder layers' largest, the most a backward
    job held, the tail's by its first layer."""
    import engine.planning.one_device

    meter = getattr(rp, "activation_meter", None)
    if meter is None:
        return None
    layers = [a for a in meter.layer if a is not None]
    return {
        "group_by_size": engine.planning.one_device.GROUP_BY_SIZE,
        "widen_tail": engine.planning.one_device.WIDEN_TAIL,
        "layer_gib_max": round(max(layers) / 2**30, 3) if layers else None,
        "held_gib": round(meter.held / 2**30, 3),
        "tail_gib": {str(k): round(v / 2**30, 3) for k, v in sorted(meter.tail.items())},
    }


def _phase_medians(rows: Any, warmup: int) -> dict[str, float] | None:
    """Per key, the median over the measured rows (after `warmup`) of per-step timings:
    RoundPipe.step_phases (the optimizer thread's step by phase: publish, fold, waiting
    for an overlapped call, step_fn) or RoundPipe.fold_phases (the fold done while the
    backward ran, engine.fold_ahead: its seconds, the gradients it made ready, how long
    the call's end waited for the optimizer thread)."""
    measured = list(rows)[warmup:]
    if not measured:
        return None
    return {k: round(statistics.median(p[k] for p in measured), 4) for k in measured[0]}


def _layer_times(rp: Any) -> dict[str, Any] | None:
    """The engine's smoothed per-layer times (ms over a step's micro-batches) that its
    plan used: bench/simulate.py's input."""
    source, fwd, bwd = rp.model_timer.get_estimate("fused")
    if source != "time":
        return None
    return {"fwd": [round(x, 3) for x in fwd], "bwd": [round(x, 3) for x in bwd]}


class MemoryBreakdown:
    """The largest CUDA allocations alive at the peak of device 0, by the Python line that
    made them (torch.cuda.memory's allocation history, replayed)."""

    def __init__(self) -> None:
        self.enabled = torch.cuda.is_available()
        if self.enabled:
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")

    def finish(self, top: int = 12) -> list[dict[str, Any]] | None:
        if not self.enabled:
            return None
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        live: dict[int, tuple[int, str]] = {}
        total = peak = 0
        at_peak: dict[int, tuple[int, str]] = {}
        for ev in snap["device_traces"][0]:
            if ev["action"] == "alloc":
                live[ev["addr"]] = (ev["size"], _site(ev.get("frames", [])))
                total += ev["size"]
                if total > peak:
                    peak, at_peak = total, dict(live)
            elif ev["action"] in ("free_completed",) and ev["addr"] in live:
                total -= live.pop(ev["addr"])[0]
        sites: dict[str, int] = {}
        for size, site in at_peak.values():
            sites[site] = sites.get(site, 0) + size
        ranked = sorted(sites.items(), key=lambda kv: -kv[1])[:top]
        return [{"gib": round(b / 2**30, 3), "site": s} for s, b in ranked]


def _site(frames: list[dict[str, Any]]) -> str:
    """The innermost frames outside torch itself: where an allocation came from."""
    ours = [
        f"{Path(f['filename']).name}:{f['line']} {f['name']}"
        for f in frames
        if "/torch/" not in f["filename"] or "/transformers/" in f["filename"]
    ]
    return " < ".join(ours[:3]) or "(torch internals)"


def lora_config(args: argparse.Namespace) -> Any:
    from engine.adapters.lora import LoraConfig

    return LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank)


def _ranks_summary(dp: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Data-parallel fields of the result: world size, backend, every rank's host peak."""
    import torch.distributed as dist

    peaks: list[Any] = [None] * dp.world
    dist.all_gather_object(peaks, round(host_peak_gib(), 2), group=dp.control)
    steps = max(1, dp.stats["steps"])
    return {
        "dp_publish_s_per_step": round(dp.stats["publish_s"] / steps, 4),
        "dp_reduce_s_per_step": round(dp.stats["reduce_s"] / steps, 4),
        "world_size": dp.world,
        "backend": str(dist.get_backend(dp.bulk)),
        "shard_optimizer": dp.sharded,
        "peak_host_mem_gib_per_rank": peaks,
    }


def self_check(
    model: nn.Module,
    initial: dict[str, torch.Tensor],
    losses: list[float],
    expected_first: float | None,
    lora: bool = False,
) -> dict[str, Any]:
    """Fail loudly if the run did not train the HF model it was given (LoRA: if the
    adapters did not move or the frozen base did)."""
    problems = []
    if not all(math.isfinite(x) for x in losses):
        problems.append(f"non-finite loss: {losses}")
    # fp16 model vs the fp32 reference on the same weights: agree to fp16 accuracy.
    if expected_first is not None and abs(losses[0] - expected_first) > 1e-2 * abs(expected_first):
        problems.append(f"first loss {losses[0]} != HF loss {expected_first}")
    changed = 0
    for n, p in model.named_parameters():
        if "lora_" in n:
            changed += 1  # checked below: the last step's update is in the optimizer copy
            continue
        moved = not torch.equal(p.detach().cpu(), initial[n.replace(".base_layer", "")])
        if lora and moved:
            problems.append(f"frozen base weight {n} changed")
        changed += moved
    if lora:
        from engine.adapters.peft_format import adapter_state_dict

        if all(not v.any() for k, v in adapter_state_dict(model).items() if "lora_B" in k):
            problems.append("no LoRA adapter moved from its zero initialisation")
    if changed == 0:
        problems.append("no parameter of the HF model changed after training")
    if problems:
        raise SystemExit("self-check failed: " + "; ".join(problems))
    return {"check": "ok", "reference_loss_first": expected_first, "params_changed": changed}


def _enable_checkpointing(model: nn.Module) -> None:
    """Per-layer activation checkpointing, non-reentrant (with a frozen embedding, the
    reentrant form would give the LoRA weights inside no gradient)."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:  # the name of later transformers 5.x releases
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def run_baseline(args: argparse.Namespace) -> dict[str, Any]:
    """HF model on the GPU: fp32 master, bf16 autocast, per-layer checkpointing, fused AdamW.

    With --lora: peft's LoRA (same rank, alpha and targets; fp32 adapters, peft's default)
    on the bf16 HF model, bf16 autocast, per-layer checkpointing, fused AdamW on the
    adapters."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.lora else torch.float32
    model = build_model(
        args.model, dtype, "sdpa", args.seed, layers=args.layers, seq_len=args.seq_len
    ).to(device)
    if args.lora:
        import peft

        cfg = lora_config(args)
        model = peft.get_peft_model(
            model,
            peft.LoraConfig(
                r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(cfg.target_modules)
            ),
        )
    _enable_checkpointing(model)
    model.config.use_cache = False
    fused = device.type == "cuda"
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0, fused=fused)
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
        _set_lr(optimizer, train_args.lr_at(args, len(losses) + 1))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))  # syncs: the step is done when its time is taken
        times.append(time.perf_counter() - start)
    result = report(
        "peft-lora-baseline" if args.lora else "pytorch-baseline",
        args,
        model,
        times,
        losses,
        batches,
        micro_batch_seqs=args.baseline_microbatch,
        grad_accum=accum,
        optimizer=f"torch.optim.AdamW(fused={fused})",
        master_dtype="float32",
        base_dtype=str(dtype).removeprefix("torch."),
        lora="peft" if args.lora else None,
        autocast="bfloat16",
        activation_checkpointing="per-layer",
    )
    return result


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _init_distributed(args: argparse.Namespace) -> None:
    """Under torchrun: join the process group (NCCL with GPUs, else gloo) and split the
    box's cores between its ranks (the C Adam and torch's CPU ops)."""
    import os

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    if args.baseline or args.baseline_only:
        raise SystemExit("--baseline is a single-process run; drop it under torchrun")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and not os.environ.get("RP_DEVICES", "").startswith("cpu")
    if cuda:
        gpus_per_rank = max(1, torch.cuda.device_count() // local_world)
        device = torch.device("cuda", local_rank * gpus_per_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    from engine.optim import physical_cores, set_num_threads

    threads = max(1, physical_cores() // local_world)
    set_num_threads(threads)
    torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _init_distributed(args)
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
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
