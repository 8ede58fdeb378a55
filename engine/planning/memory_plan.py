"""Host-memory plan: what a model and run config will need, checked against a budget.

Over ~600 lines: every part of the footprint (weights, packed bases, gradients, masters,
moments, activations, saved attention) and the options that would fit are one account;
the plan and the check read the same table. The engine's own check of a live model's
tensors before it pins them is `allocation_check`.

Computed from shapes alone, before anything is allocated: the daemon runs it at job
submission without importing torch (this module imports nothing heavy), the engine before
it pins a model, bench/train.py prints it beside the measured peak.

What a full fine-tune holds on the host, per trainable parameter (fp16/bf16 model):

    model copy (pinned)           2   uploaded to the devices each iteration
    host gradient (pinned)        2   where the devices download the gradient
    optimizer-side master         4   fp32 (optim_dtype)
    optimizer gradient            4   fp32 buffer the host gradient is folded into;
                                      0 with optim_grad_dtype = the model's dtype
    Adam exp_avg + exp_avg_sq     8   fp32; 4 with optim_state_dtype = bfloat16
                                 --
                                 20   (12 in the low-precision modes)
    second model copy             2   only with double_buffer_weights (engine.accel.weight_buffers)

and with optim_memory = compact (issue 35; bf16 model, engine.optim.Adam state_dtype=uint8):

    model copy = the master (bf16)  2   updated in place with stochastic rounding
    host gradient (bf16)            2   read in place by the optimizer
    optimizer-side master           0
    optimizer gradient              0
    Adam exp_avg + exp_avg_sq       2   8-bit codes
    their block scales              0.03 one fp32 absmax per 256 elements, per moment
                                   ----
                                    6.03

plus torch's power-of-two rounding of every pinned tensor (pin_model='alloc'; 'arena'
avoids it), the activations kept for the backward (each backward group's input, per
micro-batch; from 64 MiB up pinned in power-of-two pieces, so not rounded), the saved
attention outputs (on CUDA unless attention is recomputed; pieces as well) and
the runtime itself (CUDA context, libraries). Frozen parameters (LoRA bases) have only
the model copy; with quantization='nf4' the projections' copy is packed (half a byte
a parameter plus a 4-byte absmax per 64: engine.adapters.nf4).

matmul_precision = fp8 (engine.accel.fp8) adds nothing here: the float8 copies of a
linear's operands and their scales exist on the device only, inside one matmul (at most
the input, output gradient and weight of one linear, a byte an element), and the host
keeps the bf16 weights it uploads. An FP8 copy of the weights on the host (half the
upload bytes, issue 49) is not built.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from ..catalog import LORA_TARGET_MODULES, projection_shapes_of
from ..errors import ConfigError, HostMemoryError
from ..options import (
    EngineOptions,
    OptimMemory,
    OptimStateDtype,
    PinModel,
    Quantization,
    RecomputeGrain,
    default_num_microbatch,
)

__all__ = [
    "MAX_DIM",
    "HostMemoryPlan",
    "ModelShape",
    "RunShape",
    "available_host_bytes",
    "compact_state_bytes",
    "default_budget_bytes",
    "default_num_microbatch",
    "format_gib",
    "nf4_tensor_bytes",
    "parse_bytes",
    "plan_host_memory",
    "process_rss_bytes",
    "run_shape",
]

GIB = 1 << 30
# RSS of the process beside the model and the optimizer: Python, torch and its libraries,
# and on CUDA the context, cuDNN/cuBLAS handles and compiled kernels: the CUDA figure is
# the runtime a 70B NF4 run measured beside its model and optimizer (bench/RESULTS.md,
# "Figures moved out of engine docstrings").
RUNTIME_BYTES = {"cuda": 4 * GIB, "cpu": GIB // 2}
# The default budget leaves this share of the available memory (at least MIN) to the OS,
# the page cache the data loader uses, and anything the plan does not see.
BUDGET_MARGIN = 0.05
BUDGET_MARGIN_MIN_BYTES = GIB
# scheduler.ModelExecutePlan.auto groups layers up to 1.1x the slowest one (the head).
_GROUP_THRESHOLD = 1.1
# Explicit group sizes a refusal may offer: two groups are in flight on a GPU, so larger
# ones take GPU memory (a 70B NF4 layer packs to ~0.5 GB; an 8B bf16 layer is ~0.4 GB).
_GROUP_SIZES_TO_OFFER = (2, 4)
_ALIGN = 64  # memory.ARENA_ALIGN_BYTES
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_QBLOCK = 256  # engine.optim._q8.QBLOCK (that module imports torch)
_PIECES_MIN_BYTES = 64 << 20  # transfer.PIECES_MIN_BYTES
_PIECE_GRANULE_BYTES = 2 << 20  # transfer.PIECE_GRANULE_BYTES
# No real model dimension is larger; bigger values are typos (the daemon checks a preset's
# model.config against it at submission).
MAX_DIM = 1 << 31

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_bytes(value: str | int, *, name: str = "RP_HOST_MEMORY_BUDGET") -> int:
    """Bytes from an int or a string such as '96GiB', '100G', '123456789'."""
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{name} must be > 0 bytes, got {value}")
        return value
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number) :]
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in _UNITS or not amount > 0 or not math.isfinite(amount):
        raise ConfigError(
            f"{name} must be a positive size in bytes, optionally with a unit "
            f"(e.g. 96GiB, 100G, 64000000000), got {value!r}"
        )
    return int(amount * _UNITS[unit])


def format_gib(nbytes: int | float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (free + reclaimable), or free pages elsewhere; lowered
    to what the process's cgroup limit leaves (a container's memory limit, which
    /proc/meminfo does not show)."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    left = _cgroup_bytes_left()
    return available if left is None else min(available, left)


def _cgroup_bytes_left(root: str = "/sys/fs/cgroup") -> int | None:
    """Limit less usage of this process's memory cgroup (v2, then v1); None: no limit."""
    for limit_file, usage_file in (
        (f"{root}/memory.max", f"{root}/memory.current"),
        (f"{root}/memory/memory.limit_in_bytes", f"{root}/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_file, encoding="ascii") as f:
                limit_text = f.read().strip()
            with open(usage_file, encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max":
            return None
        limit = int(limit_text)
        if limit >= 1 << 60:  # cgroup v1 writes a huge number for "no limit"
            return None
        return max(0, limit - usage)
    return None


def default_budget_bytes(setting: str | int | None = None, *, in_use_bytes: int = 0) -> int:
    """The host bytes a run may use: `setting` (RP_HOST_MEMORY_BUDGET) if given, else the
    available memory (plus `in_use_bytes` the asking process already holds) less a margin
    of BUDGET_MARGIN (at least BUDGET_MARGIN_MIN_BYTES)."""
    if setting is not None:
        return parse_bytes(setting)
    usable = available_host_bytes() + in_use_bytes
    return max(0, usable - max(int(usable * BUDGET_MARGIN), BUDGET_MARGIN_MIN_BYTES))


def process_rss_bytes() -> int:
    """Resident memory of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _pinned_bytes(nbytes: int, pin_model: str, cuda: bool) -> int:
    """What a pinned host tensor of `nbytes` costs: torch's pinned allocator rounds each
    allocation up to a power of two; the arena aligns to 64 bytes; pageable costs nbytes."""
    if nbytes <= 0:
        return 0
    if pin_model == "arena":
        return -(-nbytes // _ALIGN) * _ALIGN
    if pin_model == "alloc" and cuda:
        return 1 << (nbytes - 1).bit_length()
    return nbytes


def _cuda_pinned(nbytes: int, cuda: bool) -> int:
    """An activation or gradient buffer from torch's pinned allocator (rounded on CUDA)."""
    return _pinned_bytes(nbytes, "alloc", cuda)


def _activation_pinned(nbytes: int, cuda: bool) -> int:
    """An activation the engine keeps on the host (transfer.async_d2h with pieces=True):
    from _PIECES_MIN_BYTES up, pinned in power-of-two pieces that waste under a granule;
    below, one tensor rounded up to a power of two."""
    if cuda and nbytes >= _PIECES_MIN_BYTES:
        return -(-nbytes // _PIECE_GRANULE_BYTES) * _PIECE_GRANULE_BYTES
    return _cuda_pinned(nbytes, cuda)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """A decoder-only transformer (the Qwen3 / Llama presets), from its HF config."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qk_norm: bool = True  # Qwen3 normalises q and k per head; Llama does not

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> ModelShape:
        """From an HF config object or its dict (config.json); missing head_dim and
        num_key_value_heads default as HF does."""
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        try:
            hidden = int(get("hidden_size"))
            heads = int(get("num_attention_heads"))
            shape = cls(
                hidden_size=hidden,
                num_hidden_layers=int(get("num_hidden_layers")),
                num_attention_heads=heads,
                num_key_value_heads=int(get("num_key_value_heads") or heads),
                head_dim=int(get("head_dim") or hidden // heads),
                intermediate_size=int(get("intermediate_size")),
                vocab_size=int(get("vocab_size")),
                tie_word_embeddings=bool(get("tie_word_embeddings", False)),
                qk_norm=str(get("model_type", "qwen3")).startswith("qwen3"),
            )
        except (TypeError, ValueError, ArithmeticError) as exc:
            raise ConfigError(
                f"the model config lacks a transformer shape field the memory plan needs: {exc}"
            ) from exc
        sizes = [f for f in fields(shape) if f.type == "int"]
        bad = [f.name for f in sizes if not 0 < getattr(shape, f.name) <= MAX_DIM]
        if bad:
            raise ConfigError(f"the model config's {', '.join(bad)} must be in 1..{MAX_DIM}")
        return shape

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """`{name: (in_features, out_features)}` of a decoder layer's projections."""
        return projection_shapes_of(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
        )

    def layer_tensors(self) -> list[int]:
        """Element counts of one decoder layer's parameters."""
        h, d = self.hidden_size, self.head_dim
        # q, k, v, o, gate, up, down projections
        out = [fan_in * fan_out for fan_in, fan_out in self.projection_shapes().values()]
        out += [h, h]  # input and post-attention norms
        if self.qk_norm:
            out += [d, d]
        return out

    def param_tensors(self) -> list[int]:
        """Element counts of every parameter tensor (a tied embedding once)."""
        embed = self.vocab_size * self.hidden_size
        head = [] if self.tie_word_embeddings else [embed]
        return [embed, *self.layer_tensors() * self.num_hidden_layers, self.hidden_size, *head]

    @property
    def num_params(self) -> int:
        return sum(self.param_tensors())

    def lora_params(self, rank: int, target_modules: Iterable[str] = LORA_TARGET_MODULES) -> int:
        """Trainable parameters of rank-`rank` adapters (A: in x r, B: r x out) on the
        `target_modules` projections of every layer (default: all seven)."""
        shapes = self.projection_shapes()
        per_layer = sum(sum(shapes[m]) for m in target_modules if m in shapes)
        return rank * per_layer * self.num_hidden_layers

    def backward_groups(
        self, grain: str, layers_per_group: int | None = None, num_devices: int = 1
    ) -> int:
        """How many backward groups keep a hidden state as their input: the automatic
        plan's, or with `layers_per_group` those of `ModelExecutePlan.grouped` over the
        preset's layers (the embedding, the decoder layers, the head), less the first
        group, whose input is the token ids.

        On 3 or more devices the automatic plan searches groups down to one layer each
        (engine.planning.search: many short jobs fill the round-robin), and measured on 4
        GPUs it took them: the plan counts that finest grouping there (4 x H200, Qwen3-1.7B,
        128 x 2048: one-layer backward groups held 25 GiB more than the 5 groups counted
        before)."""
        if grain == "layer":
            return self.num_hidden_layers
        if layers_per_group is not None:
            groups = math.ceil((self.num_hidden_layers + 2) / layers_per_group)
            return max(0, groups - 2)  # the fused tail keeps none; the first, token ids
        if num_devices >= 3:
            return self.num_hidden_layers
        layer = sum(self.layer_tensors())
        head = self.vocab_size * self.hidden_size
        per_group = max(1, int(_GROUP_THRESHOLD * head / layer))
        return math.ceil(self.num_hidden_layers / per_group)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunShape:
    """The run config the plan needs (JobSpec engine/train sections, RoundPipe options)."""

    tokens_per_step: int
    seq_len: int
    num_microbatch: int = 4
    recompute_grain: RecomputeGrain = "stage"
    model_dtype_bytes: int = 2
    optim_dtype_bytes: int = 4
    optim_grad_dtype: Literal["optim", "model"] = "optim"
    optim_state_dtype: OptimStateDtype = "float32"
    pin_model: PinModel = "alloc"
    cuda: bool = True
    saved_attention: bool = True  # CUDA, half precision, attention not recomputed
    trainable_params: int | None = None  # None: all (full fine-tune); else e.g. LoRA's
    optimizer_state: bool = True  # count Adam's moments
    double_buffer_weights: bool = False  # a second model copy per trainable parameter
    # RoundPipe's overlap_calls: a call's backward still holds its activations and saved
    # attention while the next call's forward saves its own, so both parts count twice
    # (session 28, Qwen3-1.7B on 1 and 2 H200s: 100.8-104.1 GiB peak against 68.4 planned
    # without it, the difference their sum, 33.4 GiB).
    overlap_calls: bool = False
    optim_memory: OptimMemory = "default"  # compact: see the module doc
    # "nf4": the frozen projections are held packed (engine.adapters.nf4); EngineOptions
    # allows it with adapters only (trainable_params set).
    quantization: Quantization = "none"
    # Layers per group of an explicit ModelExecutePlan.grouped; None: the automatic plan.
    layers_per_group: int | None = None
    # The devices of one process: from 3 on, the automatic plan may keep an input per layer.
    num_devices: int = 1
    # Whole frozen copies of the model wrapped beside it for forwards only (the service's
    # GRPO full fine-tune keeps its starting weights as the KL reference): pinned as it is.
    frozen_copies: int = 0
    # The optimizer reads each gradient download in place (engine.optim.Adam, a step_fn
    # that zeroes the gradients and reads no `.grad`, one process: the service's jobs), so
    # no optimizer-dtype gradient buffer is made (engine/optim/_deferred.py). Session 26,
    # Qwen3-1.7B on an H200: 47.8 GiB peak with the deferral, 54.2 GiB copied, the
    # difference this buffer (6.4 GiB).
    deferred_grads: bool = False


def run_shape(
    options: EngineOptions,
    shape: ModelShape,
    *,
    tokens_per_step: int,
    seq_len: int,
    num_devices: int,
    cuda: bool,
    deferred_grads: bool = False,
) -> RunShape:
    """The RunShape of a run of `shape` with `options` on `num_devices` devices
    (`deferred_grads`: see RunShape)."""
    model_bytes = _DTYPE_BYTES[options.model_dtype]
    lora = options.lora
    return RunShape(
        tokens_per_step=tokens_per_step,
        seq_len=seq_len,
        num_microbatch=options.num_microbatch_on(num_devices),
        recompute_grain=options.recompute_grain,
        model_dtype_bytes=model_bytes,
        optim_dtype_bytes=_DTYPE_BYTES[options.optim_dtype],
        optim_grad_dtype="optim" if options.optim_grad_dtype is None else "model",
        optim_state_dtype=options.optim_state_dtype,
        optim_memory=options.optim_memory,
        pin_model=options.pin_model,
        cuda=cuda,
        # attention outputs are kept (on the host) for half-precision CUDA runs only
        saved_attention=cuda and model_bytes == 2 and not options.recompute_attention,
        trainable_params=None
        if lora is None
        else shape.lora_params(lora.rank, lora.target_modules),
        quantization=options.quantization,
        layers_per_group=options.layers_per_group,
        num_devices=num_devices,
        deferred_grads=deferred_grads,
        double_buffer_weights=options.overlap_calls,  # RoundPipe's default with overlap
        overlap_calls=options.overlap_calls,
    )


@dataclass(frozen=True, slots=True)
class HostMemoryPlan:
    """Predicted peak host bytes, by part."""

    parts: dict[str, int]
    run: RunShape
    shape: ModelShape | None = None

    @property
    def total_bytes(self) -> int:
        return sum(self.parts.values())

    def summary(self) -> dict[str, Any]:
        """JSON-ready: total and parts in bytes and GiB."""
        return {
            "total_bytes": self.total_bytes,
            "total_gib": round(self.total_bytes / GIB, 2),
            "parts_gib": {k: round(v / GIB, 2) for k, v in self.parts.items()},
        }

    def check(self, budget_bytes: int | None = None) -> None:
        """Raise HostMemoryError when the plan needs more than the budget (default:
        default_budget_bytes()), naming the options that would fit."""
        budget = default_budget_bytes() if budget_bytes is None else budget_bytes
        need = self.total_bytes
        if need <= budget:
            return
        fitting = self.fitting_options(budget)
        parts = ", ".join(f"{k} {format_gib(v)}" for k, v in self.parts.items() if v)
        hint = (
            "; options that would fit: " + "; ".join(text for _, text in fitting)
            if fitting
            else "; no option of this engine fits: raise RP_HOST_MEMORY_BUDGET if the machine "
            "has the memory, or use a machine with more"
        )
        raise HostMemoryError(
            f"this run needs about {format_gib(need)} of host memory ({parts}), over the "
            f"budget of {format_gib(budget)} (RP_HOST_MEMORY_BUDGET){hint}",
            need_bytes=need,
            budget_bytes=budget,
            options=[text for _, text in fitting],
            option_fields=[name for name, _ in fitting],
            parts=dict(self.parts),
        )

    def fitting_options(self, budget: int) -> list[tuple[str, str]]:
        """(config field, change with what it would need) for each change that fits."""
        if self.shape is None:
            return []
        run, shape = self.run, self.shape
        out: list[tuple[str, str]] = []
        low = replace(
            run, optim_grad_dtype="model", optim_state_dtype="bfloat16", pin_model="arena"
        )
        if low != run and run.optim_memory == "default":
            need = plan_host_memory(shape, low).total_bytes
            if need <= budget:
                out.append(
                    (
                        "optim_state_dtype",
                        "lower-precision optimizer memory: optim_state_dtype=bfloat16, "
                        f"optim_grad_dtype=model, pin_model=arena ({format_gib(need)})",
                    )
                )
        compact = replace(run, optim_memory="compact", pin_model="arena")
        if compact != run and run.model_dtype_bytes == 2 and run.trainable_params is None:
            need = plan_host_memory(shape, compact).total_bytes
            if need <= budget:
                text = (
                    "compact optimizer memory: optim_memory=compact (bfloat16 model, 8-bit "
                    f"Adam moments), pin_model=arena ({format_gib(need)})"
                )
                out.append(("optim_memory", text))
        if run.cuda and run.saved_attention:
            bases = [(run, ""), (low, " with the lower-precision options")]
            if compact != run and run.model_dtype_bytes == 2 and run.trainable_params is None:
                bases.append((compact, " with optim_memory=compact, pin_model=arena"))
            for base, label in bases:
                need = plan_host_memory(shape, replace(base, saved_attention=False)).total_bytes
                if need <= budget:
                    text = f"recompute_attention=true{label} ({format_gib(need)})"
                    out.append(("recompute_attention", text))
                    break
        if run.recompute_grain == "stage" and run.layers_per_group is None:
            for size in _GROUP_SIZES_TO_OFFER:
                need = plan_host_memory(shape, replace(run, layers_per_group=size)).total_bytes
                if need <= budget:
                    text = (
                        f"layers_per_group={size} (fewer backward groups keep fewer recompute "
                        f"inputs: {format_gib(need)})"
                    )
                    out.append(("layers_per_group", text))
                    break
        if run.trainable_params is None:
            need = plan_host_memory(shape, replace(run, trainable_params=shape.lora_params(16)))
            if need.total_bytes <= budget:
                text = f"LoRA (rank 16 on all projections: {format_gib(need.total_bytes)})"
                out.append(("lora", text))
        for base, label in ((run, ""), (low, " with the lower-precision options")):
            tokens = _max_tokens(shape, base, budget)
            if tokens is not None and tokens < run.tokens_per_step:
                out.append(("tokens_per_step", f"at most {tokens} tokens per step{label}"))
                break
        return out


def _max_tokens(shape: ModelShape, run: RunShape, budget: int) -> int | None:
    """The most tokens per step (whole micro-batches of seq_len sequences) that fit."""
    step = run.seq_len * run.num_microbatch
    lo, hi = 0, run.tokens_per_step // step
    while lo < hi:  # the need grows with the tokens: bisect on sequences per micro-batch
        mid = (lo + hi + 1) // 2
        trial = replace(run, tokens_per_step=mid * step)
        if plan_host_memory(shape, trial).total_bytes <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * step if lo else None


def plan_host_memory(shape: ModelShape, run: RunShape) -> HostMemoryPlan:
    """The predicted peak host memory of training `shape` with `run`."""
    if run.tokens_per_step <= 0 or run.seq_len <= 0 or run.num_microbatch <= 0:
        raise ConfigError("the memory plan needs tokens_per_step, seq_len, num_microbatch > 0")
    tensors = shape.param_tensors()
    total = sum(tensors)
    trainable = total if run.trainable_params is None else run.trainable_params
    mbytes = run.model_dtype_bytes
    pin, cuda = run.pin_model, run.cuda
    parts: dict[str, int] = {}
    packed: list[int] = []
    if run.quantization == "nf4":
        projections = shape.layer_tensors()[:7] * shape.num_hidden_layers
        packed = [b for n in projections for b in nf4_tensor_bytes(n)]
        tensors = _without(tensors, projections)
    model = sum(_pinned_bytes(n * mbytes, pin, cuda) for n in tensors)
    model += sum(_pinned_bytes(b, pin, cuda) for b in packed)
    frozen = run.frozen_copies * model
    if run.trainable_params is None:
        grads = sum(
            _pinned_bytes(n * mbytes, pin, cuda)
            if pin == "arena"
            else _cuda_pinned(n * mbytes, cuda)
            for n in tensors
        )
    else:  # adapters: small tensors, pinned one by one (the base is frozen: no gradient)
        model += trainable * mbytes
        grads = trainable * mbytes
    parts["model"] = model
    if frozen:
        parts["frozen_copies"] = frozen
    parts["host_gradients"] = grads
    if run.optim_memory == "compact":  # the weights are the masters, the gradient in place
        parts["optim_master"] = parts["optim_gradients"] = parts["model_second_copy"] = 0
        compact = compact_state_bytes(tensors if run.trainable_params is None else [trainable])
        parts["optim_state"] = compact[0] if run.optimizer_state else 0
        parts["optim_state_scales"] = compact[1] if run.optimizer_state else 0
    else:
        parts["optim_master"] = trainable * run.optim_dtype_bytes
        copied = run.optim_grad_dtype == "optim" and not run.deferred_grads
        parts["optim_gradients"] = trainable * run.optim_dtype_bytes if copied else 0
        second = run.double_buffer_weights and mbytes < run.optim_dtype_bytes
        parts["model_second_copy"] = trainable * mbytes if second else 0
        state_bytes = 4 if run.optim_state_dtype == "float32" else 2
        parts["optim_state"] = 2 * trainable * state_bytes if run.optimizer_state else 0
    mb_tokens = run.tokens_per_step // run.num_microbatch
    boundary = _activation_pinned(mb_tokens * shape.hidden_size * mbytes, cuda)
    parts["activations"] = (
        shape.backward_groups(run.recompute_grain, run.layers_per_group, run.num_devices)
        * run.num_microbatch
        * boundary
    )
    if cuda and run.saved_attention:
        q_width = shape.num_attention_heads * shape.head_dim
        per_mb = _activation_pinned(mb_tokens * q_width * mbytes, cuda)
        per_mb += _activation_pinned(mb_tokens * shape.num_attention_heads * 4, cuda)  # fp32 LSE
        parts["saved_attention"] = shape.num_hidden_layers * run.num_microbatch * per_mb
    else:
        parts["saved_attention"] = 0
    if run.overlap_calls:  # two calls' worth (RunShape.overlap_calls)
        parts["activations"] *= 2
        parts["saved_attention"] *= 2
    parts["runtime"] = RUNTIME_BYTES["cuda" if cuda else "cpu"]
    return HostMemoryPlan(parts, run, shape)


def compact_state_bytes(numels: Iterable[int]) -> tuple[int, int]:
    """(codes, scales) bytes of engine.optim.Adam's 8-bit moments for tensors of `numels`
    elements: one byte per element and moment, one fp32 absmax per 256 elements and moment
    (engine.optim._q8.QBLOCK)."""
    codes = scales = 0
    for n in numels:
        codes += 2 * n
        scales += 2 * 4 * ((n + _QBLOCK - 1) // _QBLOCK)
    return codes, scales


def nf4_tensor_bytes(numel: int, block: int = 64) -> tuple[int, int]:
    """Bytes of an NF4 weight of `numel` values: its packed codes (half a byte a value)
    and its fp32 absmax (one per block); engine.adapters.nf4 holds them as two tensors."""
    return (numel + 1) // 2, 4 * -(-numel // block)


def _without(tensors: list[int], removed: list[int]) -> list[int]:
    """`tensors` less one occurrence of each element of `removed` (a multiset difference)."""
    left = list(tensors)
    for n in removed:
        left.remove(n)
    return left
