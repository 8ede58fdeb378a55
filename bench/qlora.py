"""QLoRA throughput: LoRA over an NF4 base streamed from host memory, beside its baselines.

Prints one JSON line per result (issue 30's Performance section):

    python bench/qlora.py --model qwen3-8b --seqs-per-step 32 --num-microbatch 8 \\
        --fp16-base --baseline                      # NF4 vs fp16 base vs peft + bitsandbytes
    python bench/qlora.py --model llama-70b --seqs-per-step 16 --num-microbatch 8 --baseline
    RP_DEVICES=cpu:1 python bench/qlora.py --tiny --fp16-base --baseline   # CPU self-check
    python bench/qlora.py --model llama-70b --max-gpu-memory 24   # a 24 GiB card on a bigger one

Weights are random (no download): every linear weight of the decoder is random NF4 codes
with a random absmax per block of 64, built straight in packed form (a 70B base never
exists in full precision on the host); embeddings, norms and the head are random bf16.
LoRA rank 16 (alpha 32) on every projection, fp32 masters, the engine's Adam, async step.

`--baseline`: peft + bitsandbytes QLoRA on the same model resident on the GPU (the same
packed weights as bitsandbytes Linear4bit layers), activation checkpointing, fused AdamW
over the adapters, the same tokens per step. `--fp16-base`: the engine again with the
base in bf16 (the issue's "within 10%" comparison). `--dequant torch` decodes with the
torch table lookup instead of bitsandbytes' kernel. `--max-gpu-memory GIB`: RoundPipe's
max_gpu_memory (the plan sizes for a card that large, CUDA allocations past it fail; the
cap stays for the runs after the engine's, the baseline's included); each JSON line
reports it (`max_gpu_memory_gib`) beside the peak the allocator reserved.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.options import add_lora_step_options, grouped_plan
from bench.shapes import config_fields

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {"model_type": "qwen3", **config_fields("qwen3-8b")},
    "llama-70b": {
        "model_type": "llama",
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 28672,
        "vocab_size": 128256,
    },
    "tiny": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 256,
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU, short")
    p.add_argument("--seqs-per-step", type=int, default=32)
    add_lora_step_options(p, steps=2)
    p.add_argument("--fp16-base", action="store_true", help="also the engine on a bf16 base")
    p.add_argument("--baseline", action="store_true", help="also peft + bitsandbytes")
    p.add_argument("--baseline-micro-batch", type=int, default=None)
    p.add_argument("--no-engine", action="store_true", help="skip the NF4 engine run")
    p.add_argument("--dequant", choices=["auto", "bnb", "torch"], default="auto")
    p.add_argument(
        "--recompute-attention",
        action="store_true",
        help="recompute attention in the backward instead of keeping its outputs on the host",
    )
    p.add_argument(
        "--group-layers",
        type=int,
        default=None,
        metavar="K",
        help="an explicit plan of K-layer groups: K times fewer recompute inputs in host memory "
        "than the automatic one-layer groups (a 70B base at 16 x 2048: 40 GiB of them)",
    )
    p.add_argument(
        "--max-gpu-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="cap the engine's GPU memory (RoundPipe max_gpu_memory), e.g. 24",
    )
    p.add_argument(
        "--matmul-precision",
        choices=["bf16", "fp8"],
        default="bf16",
        help="RoundPipe's matmul_precision: fp8 multiplies the decoded base in float8 "
        "(engine.accel.fp8; the adapters stay bf16)",
    )
    p.add_argument(
        "--fp8-recipe",
        choices=["rowwise", "tensorwise", "rowwise_with_gw_hp"],
        default="rowwise",
    )
    args = p.parse_args(argv)
    if args.tiny and args.matmul_precision == "fp8":
        p.error("--tiny runs an fp32 model; --matmul-precision fp8 needs the bf16 shapes")
    if args.max_gpu_memory is not None and not args.max_gpu_memory > 0:
        p.error("--max-gpu-memory must be > 0 GiB")
    if args.tiny:
        args.model, args.seq_len, args.seqs_per_step = "tiny", 32, 4
        args.num_microbatch, args.steps, args.warmup = 2, 2, 1
    if args.seqs_per_step % args.num_microbatch:
        p.error("--seqs-per-step must be a multiple of --num-microbatch")
    return args


def build_config(name: str, seq_len: int = 2048) -> Any:
    import transformers

    shape = dict(SHAPES[name])
    kind = shape.pop("model_type")
    cls = transformers.Qwen3Config if kind == "qwen3" else transformers.LlamaConfig
    config = cls(
        **shape,
        tie_word_embeddings=False,
        use_cache=False,
        max_position_embeddings=max(131072, seq_len),
    )
    config._attn_implementation = "sdpa"
    return config


class _Pool:
    """Random values drawn once into pools of prime length and copied into each tensor at a
    moving offset (as bench/shapes.py does): a 70B model's 35 GB of random packed codes
    build at memory speed instead of minutes of drawing them one by one."""

    _LEN = 16_777_259

    def __init__(self, gen: torch.Generator) -> None:
        self.offset = 0
        self.pools = {
            "codes": torch.randint(0, 256, (self._LEN,), dtype=torch.uint8, generator=gen),
            "absmax": torch.rand(self._LEN, generator=gen) * 0.02 + 0.01,
            "normal": torch.randn(self._LEN, generator=gen) * 0.02,
        }

    def take(self, numel: int, kind: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        pool = self.pools[kind] if dtype is None else self.pools[kind].to(dtype)
        out = torch.empty(numel, dtype=pool.dtype)
        pos = 0
        while pos < numel:
            start = self.offset % self._LEN
            n = min(numel - pos, self._LEN - start)
            out[pos : pos + n].copy_(pool[start : start + n])
            pos, self.offset = pos + n, self.offset + n
        return out


def random_nf4(shape: torch.Size, dtype: torch.dtype, pool: _Pool) -> Any:
    from engine.adapters.nf4 import NF4_BLOCK, NF4Weight

    n = math.prod(shape)
    packed = pool.take((n + 1) // 2, "codes").reshape(-1, 1)
    absmax = pool.take(-(-n // NF4_BLOCK), "absmax")
    return NF4Weight(packed, absmax, torch.Size(shape), dtype)


def build_model(args: argparse.Namespace, *, nf4: bool, seed: int = 0) -> nn.Module:
    """The HF model with random weights, its decoder linears NF4 (if `nf4`) built packed."""
    import transformers

    from engine.adapters.nf4 import packed_parameter
    from engine.adapters.quantized_load import _parameters_on_meta

    config = build_config(args.model, args.seq_len)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    with _parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    pool = _Pool(torch.Generator().manual_seed(seed))
    for name, module in model.named_modules():
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            if nf4 and type(module) is nn.Linear and pname == "weight" and name != "lm_head":
                module._parameters[pname] = packed_parameter(random_nf4(p.shape, dtype, pool))
                continue
            if pname == "weight" and p.dim() == 1:  # norms
                value = torch.ones(p.shape, dtype=dtype)
            else:
                value = pool.take(p.numel(), "normal", dtype).view(p.shape)
            module._parameters[pname] = nn.Parameter(value, requires_grad=True)
    return model.train()


def host_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _status_gib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


class HostPhases:
    """Peak and final RSS of each phase of a run (build, wrap, first step, the rest), the
    kernel's high-water mark reset between phases (/proc/self/clear_refs), so a figure over
    the plan says which phase holds the extra. Linux only; elsewhere empty."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}
        self._reset()

    @staticmethod
    def _reset() -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def mark(self, name: str) -> None:
        peak, now = _status_gib("VmHWM"), _status_gib("VmRSS")
        if peak is not None and now is not None:
            self.phases[name] = {"peak": round(peak, 2), "end": round(now, 2)}
        self._reset()

    def peak_gib(self) -> float:
        """The highest of the phases' peaks (the reset lowers ru_maxrss too)."""
        return max((p["peak"] for p in self.phases.values()), default=host_peak_gib())


def gpu_peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def gpu_reserved_peak_gib() -> float | None:
    """The caching allocator's peak reservation: what a GPU memory cap bounds."""
    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.max_memory_reserved() / 2**30, 2)


def host_plan_gib(args: argparse.Namespace, config: Any, *, nf4: bool) -> dict[str, Any]:
    """engine.memory_plan's prediction for this run (the automatic backward groups, or
    those of `--group-layers K`)."""
    from engine.planning.memory_plan import ModelShape, RunShape, plan_host_memory

    shape = ModelShape.from_config(config)
    run = RunShape(
        tokens_per_step=args.seqs_per_step * args.seq_len,
        seq_len=args.seq_len,
        num_microbatch=args.num_microbatch,
        pin_model="arena" if torch.cuda.is_available() else "off",
        cuda=torch.cuda.is_available(),
        saved_attention=not args.recompute_attention,
        trainable_params=shape.lora_params(args.lora_rank),
        quantization="nf4" if nf4 else "none",
        model_dtype_bytes=4 if args.tiny else 2,
        layers_per_group=args.group_layers,
    )
    return plan_host_memory(shape, run).summary()


def batches(args: argparse.Namespace, vocab: int, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, vocab, (args.seqs_per_step, args.seq_len), generator=gen) for _ in range(n)
    ]


def run_engine(args: argparse.Namespace, *, nf4: bool) -> dict[str, Any]:
    from engine import RoundPipeRunConfig, wrap_model_to_roundpipe
    from engine.adapters.lora import LoraConfig
    from engine.adapters.nf4 import host_base_bytes, set_dequantize_kernel
    from engine.models import causal_lm_loss_fn
    from engine.optim import Adam

    set_dequantize_kernel(args.dequant)
    phases = HostPhases()
    model = build_model(args, nf4=nf4)
    base_bytes = host_base_bytes(model)
    phases.mark("build")
    rp = wrap_model_to_roundpipe(
        model,
        lora_config=LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank),
        model_run_config=RoundPipeRunConfig(
            num_microbatch=args.num_microbatch,
            execute_plan=grouped_plan(model.config.num_hidden_layers + 2, args.group_layers),
        ),
        optim_dtype=torch.float32,
        pin_model="arena" if torch.cuda.is_available() else "off",
        recompute_attention=args.recompute_attention,
        max_gpu_memory=args.max_gpu_memory,
        matmul_precision=args.matmul_precision,
        fp8_recipe=args.fp8_recipe,
    )
    opt = Adam(rp.optim_parameters(), lr=1e-5)
    phases.mark("wrap")

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    data = batches(args, model.config.vocab_size, args.warmup + args.steps)
    losses = []
    for i, ids in enumerate(data):
        if i == 1:
            rp.synchronize()
            phases.mark("step0")
        if i == args.warmup:
            rp.synchronize()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "return_logits": False},
            label=ids,
            loss_fn=causal_lm_loss_fn(ids),
        )
        rp.step(step_fn, is_async=True)
        losses.append(float(loss))
    rp.synchronize()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    phases.mark("steps")
    tokens = args.steps * args.seqs_per_step * args.seq_len
    out = {
        "run": "engine-nf4" if nf4 else "engine-bf16-base",
        "matmul_precision": args.matmul_precision,
        "fp8_recipe": args.fp8_recipe if args.matmul_precision == "fp8" else None,
        "base_host_bytes": base_bytes,
        "tokens_per_s": round(tokens / elapsed, 1),
        "step_s": round(elapsed / args.steps, 3),
        "host_peak_gib": round(phases.peak_gib(), 2),
        "host_phases_gib": phases.phases,
        "host_plan_gib": host_plan_gib(args, model.config, nf4=nf4),
        "gpu_peak_gib": gpu_peak_gib(),
        "gpu_reserved_peak_gib": gpu_reserved_peak_gib(),
        "losses": [round(x, 4) for x in losses],
    }
    del rp, model
    gc.collect()
    return out


def run_baseline(args: argparse.Namespace) -> dict[str, Any]:
    """peft + bitsandbytes: the same packed weights as Linear4bit layers, on one device."""
    import bitsandbytes as bnb
    import peft
    from bitsandbytes.functional import QuantState, get_4bit_type

    from engine.memory import packed_form

    if args.baseline_warmup is not None:
        args = argparse.Namespace(**{**vars(args), "warmup": args.baseline_warmup})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args, nf4=True)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or packed_form(module.weight) is None:
            continue
        w = packed_form(module.weight)
        layer = bnb.nn.Linear4bit(
            module.in_features,
            module.out_features,
            bias=False,
            compute_dtype=dtype,
            quant_type="nf4",
            device="meta",
        )
        state = QuantState(
            absmax=w.absmax.to(device),
            shape=w.shape,
            code=get_4bit_type("nf4", device=device),
            blocksize=64,
            quant_type="nf4",
            dtype=dtype,
        )
        layer.weight = bnb.nn.Params4bit(
            w.packed.to(device),
            requires_grad=False,
            quant_state=state,
            blocksize=64,
            quant_type="nf4",
            bnb_quantized=True,
            module=layer,
        )
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, layer)
    model.to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=args.lora_rank,
            lora_alpha=2 * args.lora_rank,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
        ),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    micro = args.baseline_micro_batch or args.seqs_per_step // args.num_microbatch
    data = batches(args, model.config.vocab_size, args.warmup + args.steps)
    for i, ids in enumerate(data):
        if i == args.warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        for mb in ids.to(device).split(micro):
            loss = model(input_ids=mb, labels=mb).loss * (mb.shape[0] / ids.shape[0])
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = args.steps * args.seqs_per_step * args.seq_len
    return {
        "run": "peft-bnb",
        "micro_batch": micro,
        "warmup": args.warmup,
        "tokens_per_s": round(tokens / elapsed, 1),
        "step_s": round(elapsed / args.steps, 3),
        "gpu_peak_gib": gpu_peak_gib(),
        "host_peak_gib": round(host_peak_gib(), 2),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    common = {
        "bench": "qlora",
        "model": args.model,
        "seq_len": args.seq_len,
        "tokens_per_step": args.seqs_per_step * args.seq_len,
        "num_microbatch": args.num_microbatch,
        "lora_rank": args.lora_rank,
        "dequant": args.dequant,
        "max_gpu_memory_gib": args.max_gpu_memory,
        "group_layers": args.group_layers,
        "recompute_attention": args.recompute_attention,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    runs = []
    if not args.no_engine:
        runs.append(lambda: run_engine(args, nf4=True))
    if args.fp16_base:
        runs.append(lambda: run_engine(args, nf4=False))
    if args.baseline:
        runs.append(lambda: run_baseline(args))
    results = []
    for run in runs:
        try:
            result = {**common, **run()}
        except torch.OutOfMemoryError as exc:  # the baseline may not fit: say so
            result = {**common, "error": f"out of memory: {str(exc)[:200]}"}
        print(json.dumps(result), flush=True)
        results.append(result)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
