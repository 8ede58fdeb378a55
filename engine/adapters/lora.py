"""LoRA: low-rank adapters on a model's linear layers over a frozen base.

`apply_lora(model, config)` replaces each targeted `nn.Linear` (matched by name, like
peft's `target_modules`) with a `LoraLinear` that holds the original layer as
`base_layer` and two small fp32 matrices `lora_A` (rank x in) and `lora_B` (out x rank),
and freezes every other parameter. RoundPipe then gives optimizer-side copies, gradient
buffers and optimizer state to the adapters only: a frozen base parameter costs the bytes
of its own (half-precision) copy in pinned host memory and nothing else.

Why a layer of our own rather than peft's modules: the engine deep-copies every layer into
per-device replicas (`transfer.make_replica`) and runs fp16/bf16 decoder layers through
one torch.compile'd function; peft's `lora.Linear` carries per-adapter dictionaries,
mixed-batch and merge state and dtype bookkeeping that each replica would copy and that
dynamo would trace and guard on. `LoraLinear` is the same math (y = W x + s B A x,
s = alpha / rank; A Kaiming-uniform, B zero, like peft's default) in a dozen lines with the
same parameter names, so peft's file format maps one to one (engine.adapters.peft_format
reads and writes it). peft itself is not needed at run time (the tests use it as the
oracle); a `peft.LoraConfig` is accepted wherever a `LoraConfig` is, by its attributes.

Adapters compute in the activations' dtype (fp16/bf16 on the GPU: their weights are cast
per call, gradients come back in fp32 through the cast) while peft computes them in fp32;
in fp32 the two are the same function.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..accel.fp8 import Fp8Recipe, fp8_forward, fp8_grad_input, fp8_recipe
from ..catalog import LORA_TARGET_MODULES, max_lora_rank
from ..errors import ConfigError
from ..memory import packed_form

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "LoraConfig",
    "LoraLinear",
    "adapters_disabled",
    "apply_lora",
    "count_parameters",
    "lora_config_of",
    "lora_modules",
    "unwrap",
    "user_model",
]

log = logging.getLogger(__name__)

DEFAULT_TARGET_MODULES: tuple[str, ...] = LORA_TARGET_MODULES  # the catalog's: all seven
# Inside `adapters_disabled`: every LoraLinear computes its base layer alone. Process-wide,
# not per module: the engine's device replicas are deep copies made once, which a flag on
# the host module would not reach.
_disabled_depth = 0


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """What adapters to add: rank, scale (alpha / rank), dropout, and where.

    Attributes:
        rank: Rank r of each adapter (peft's `r`); 1 <= r <= min(in, out) of every target.
        alpha: Scale numerator (peft's `lora_alpha`): the update is (alpha / rank) B A x.
        dropout: Dropout on the adapter's input (peft's `lora_dropout`), in [0, 1).
        target_modules: Names of the `nn.Linear` modules to adapt; a module matches when
            its full name equals a target or ends with '.' + target (peft's rule). Every
            target must match at least one linear layer.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = field(default=DEFAULT_TARGET_MODULES)

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", (self.target_modules,))
        elif not isinstance(self.target_modules, tuple):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(
                f"lora.rank must be an integer >= 1, got {self.rank!r}", field="lora.rank"
            )
        if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise ConfigError(
                f"lora.alpha must be a finite number, got {self.alpha!r}", field="lora.alpha"
            )
        if self.alpha <= 0:
            raise ConfigError(f"lora.alpha must be > 0, got {self.alpha}", field="lora.alpha")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(
                f"lora.dropout must be in [0, 1), got {self.dropout!r}", field="lora.dropout"
            )
        if not self.target_modules:
            raise ConfigError(
                "lora.target_modules is empty; name the linear layers to adapt, e.g. "
                f"{list(DEFAULT_TARGET_MODULES)}",
                field="lora.target_modules",
            )
        for name in self.target_modules:
            if not isinstance(name, str) or not name:
                raise ConfigError(
                    f"lora.target_modules must be non-empty module names, got {name!r}",
                    field="lora.target_modules",
                )

    @property
    def scaling(self) -> float:
        """The factor on B A x: alpha / rank."""
        return self.alpha / self.rank

    @classmethod
    def from_any(cls, config: Any) -> LoraConfig:
        """A `LoraConfig` from ours, a `peft.LoraConfig`, or a mapping of our field names.

        A peft config is read by its attributes (`r`, `lora_alpha`, `lora_dropout`,
        `target_modules`); options this engine does not implement raise ConfigError.
        """
        if isinstance(config, LoraConfig):
            return config
        if isinstance(config, Mapping):
            unknown = set(config) - {"rank", "alpha", "dropout", "target_modules"}
            if unknown:
                raise ConfigError(
                    f"unknown LoRA config keys {sorted(unknown)}; "
                    "use rank, alpha, dropout, target_modules"
                )
            return cls(**config)
        if hasattr(config, "r") and hasattr(config, "lora_alpha"):
            return _from_peft(config)
        raise ConfigError(
            "lora_config must be an engine.adapters.lora.LoraConfig, a peft.LoraConfig or a mapping, "
            f"got {type(config).__name__}"
        )

    def to_peft_json(self, base_model_name_or_path: str | None, task_type: str | None) -> dict:
        """The `adapter_config.json` content peft reads back as an equal LoraConfig."""
        return {
            "peft_type": "LORA",
            "task_type": task_type,
            "base_model_name_or_path": base_model_name_or_path,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": sorted(self.target_modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "init_lora_weights": True,
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
            "layers_to_transform": None,
            "layers_pattern": None,
            "rank_pattern": {},
            "alpha_pattern": {},
        }


# peft options with a value other than these change the math or the parameter set.
_PEFT_UNSUPPORTED: dict[str, Any] = {
    "use_dora": False,
    "use_rslora": False,
    "bias": "none",
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "exclude_modules": None,
    "target_parameters": None,
}


def _from_peft(config: Any) -> LoraConfig:
    for name, neutral in _PEFT_UNSUPPORTED.items():
        value = getattr(config, name, neutral)
        if value not in (neutral, None) and not (isinstance(value, (dict, list)) and not value):
            raise ConfigError(
                f"peft LoraConfig.{name}={value!r} is not supported by the engine's LoRA; "
                f"leave it at {neutral!r}"
            )
    targets = config.target_modules
    if targets is None:
        raise ConfigError(
            "peft LoraConfig.target_modules is None (peft's per-architecture default); "
            f"name the modules, e.g. {list(DEFAULT_TARGET_MODULES)}"
        )
    if isinstance(targets, str):
        raise ConfigError(
            f"peft LoraConfig.target_modules={targets!r} is a regular expression; the engine "
            "takes a list of module names"
        )
    return LoraConfig(
        rank=config.r,
        alpha=float(config.lora_alpha),
        dropout=float(config.lora_dropout),
        target_modules=tuple(sorted(targets)),
    )


class _MergedLoraLinear(torch.autograd.Function):
    """y = x W'^T (+ bias) with W' = W + s B A already in `weight`; backward gives the
    input gradient through W' and the adapter gradients from the factors:
    dA = s (g B)^T x, dB = s g^T (x A^T). The frozen W and bias get none. With an FP8
    `recipe` (the base is an `engine.accel.fp8.Fp8Linear`) the two matmuls through W' run in
    FP8; the adapter gradients stay in the activations' dtype."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        a: Tensor,
        b: Tensor,
        s: float,
        recipe: Fp8Recipe | None,
    ) -> Tensor:
        ctx.save_for_backward(x, weight, a, b)
        ctx.scaling = s
        ctx.recipe = recipe
        if recipe is not None:
            return fp8_forward(x, weight, bias, recipe)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, a, b = ctx.saved_tensors
        s = ctx.scaling
        g = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:
            if ctx.recipe is not None:
                grad_x = fp8_grad_input(grad, weight, ctx.recipe).to(grad.dtype)
            else:
                grad_x = grad @ weight
        grad_a = grad_b = None
        if ctx.needs_input_grad[3]:
            gb = g @ b.to(g.dtype)  # (tokens, rank)
            grad_a = ((gb.t() @ x2) * s).to(a.dtype)
        if ctx.needs_input_grad[4]:
            low = x2 @ a.to(x2.dtype).t()  # (tokens, rank)
            grad_b = ((g.t() @ low) * s).to(b.dtype)
        return grad_x, None, None, grad_a, grad_b, None, None


class LoraLinear(nn.Module):
    """`base_layer(x) + (alpha / rank) * lora_B(lora_A(dropout(x)))`, base frozen.

    The adapter weights are fp32 parameters (what the optimizer updates); they are cast to
    the input's dtype for the two small GEMMs. In a RoundPipe device replica (no dropout)
    the adapter is merged into the uploaded copy of the frozen weight once per upload
    (`rp_after_upload`: W' = W + s B A, one small GEMM), so the forward is the base GEMM
    alone and the backward the base input-gradient GEMM plus the adapter gradients; the
    host weights stay untouched. The merged weight is rounded to the base dtype, as in a
    merged export: in fp16 a change of the adapter below half an ulp of a weight does not
    reach the forward, an error of the size of rounding the layer's output to fp16.
    """

    def __init__(self, base_layer: nn.Linear, *, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base_layer = base_layer
        device = base_layer.weight.device
        self.lora_A = nn.Linear(
            base_layer.in_features, rank, bias=False, device=device, dtype=torch.float32
        )
        self.lora_B = nn.Linear(
            rank, base_layer.out_features, bias=False, device=device, dtype=torch.float32
        )
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank
        self.rank = rank
        # True in a RoundPipe device replica while the uploaded base weight holds W + s B A.
        self.merged = False
        # peft's default initialisation: the adapted model starts as the base model.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @property
    def weight(self) -> Tensor:
        """The base weight (code that reads `proj.weight`, e.g. for its dtype, still works)."""
        return self.base_layer.weight

    def rp_after_upload(self) -> None:
        """Called by the engine (transfer.upload_layers) on a device replica after each
        upload, under no_grad on the compute stream: merge the adapter into the weight."""
        w = self.base_layer.weight
        bias = self.base_layer.bias
        if (
            _disabled_depth
            or (self.training and isinstance(self.lora_dropout, nn.Dropout))
            or w.requires_grad
            or (bias is not None and bias.requires_grad)
        ):
            # Dropout: the adapter sees dropout(x), the base x. A base unfrozen by the
            # user needs its own gradient, which the merged backward does not give.
            self.merged = False
            return
        self.merge_adapter()

    def merge_adapter(self) -> None:
        """W += s B A in the weight's dtype (one addmm; the weight is a copy: a device
        replica, or the rollout sampler's), and the forward the base GEMM alone from then on."""
        w = self.base_layer.weight
        w.addmm_(self.lora_B.weight.to(w.dtype), self.lora_A.weight.to(w.dtype), alpha=self.scaling)
        self.merged = True

    def forward(self, x: Tensor) -> Tensor:
        if _disabled_depth and not self.merged:
            return self.base_layer(x)
        if self.merged:
            return _MergedLoraLinear.apply(
                x,
                self.base_layer.weight,
                self.base_layer.bias,
                self.lora_A.weight,
                self.lora_B.weight,
                self.scaling,
                fp8_recipe(self.base_layer, x),
            )
        out = self.base_layer(x)
        a = self.lora_A.weight
        b = self.lora_B.weight
        if a.dtype != x.dtype:
            a, b = a.to(x.dtype), b.to(x.dtype)
        low = F.linear(self.lora_dropout(x), a)  # (..., rank)
        flat = torch.addmm(
            out.reshape(-1, out.shape[-1]),
            low.reshape(-1, low.shape[-1]),
            b.t(),
            alpha=self.scaling,
        )
        return flat.view(out.shape)

    def merged_weight(self, a: Tensor | None = None, b: Tensor | None = None) -> Tensor:
        """W + s B A in the base weight's dtype (computed in fp32), from `a`/`b` if given."""
        a = self.lora_A.weight if a is None else a
        b = self.lora_B.weight if b is None else b
        w = self.base_layer.weight
        packed = packed_form(w)  # a 4-bit base: the parameter's own storage is a stand-in
        if packed is not None:
            w = packed.dequantize()
        delta = (b.detach().float() @ a.detach().float()) * self.scaling
        return (w.detach().float() + delta.to(w.device)).to(w.dtype)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scaling={self.scaling:g}"


@contextmanager
def adapters_disabled(model_or_rp: nn.Module | None = None) -> Iterator[None]:
    """Run the base model alone inside: every `LoraLinear` skips its adapter.

    For a reference forward (preference tuning: the base is the reference model), with no
    second copy of the weights. Device replicas uploaded inside skip the adapter merge, so
    the whole forward call must run inside; `model_or_rp`'s pending calls (an overlapped
    backward that would upload layers in here) are finished first. Process-wide: every
    model's adapters are off inside.
    """
    global _disabled_depth
    finish = getattr(model_or_rp, "finish_pending", None)
    if callable(finish):
        finish()
    _disabled_depth += 1
    try:
        yield
    finally:
        _disabled_depth -= 1


# ---- finding the model's modules ---------------------------------------------------------


def unwrap(module: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """For a RoundPipe wrapper, (the module it runs, the user's model behind it); None for
    any other module.

    Found by the wrapper's `rp_unwrap` hook rather than by its class: the wrappers import
    the adapters (`save_adapter`), so the adapters do not import them. The hook is looked
    up on the class, past the wrapper's fall-through to the user's model's attributes.
    """
    hook = getattr(type(module), "rp_unwrap", None)
    return None if hook is None else hook(module)


def user_model(model_or_rp: nn.Module) -> nn.Module:
    """The user's model behind a RoundPipe (the HF model of a preset), else the model."""
    inner = unwrap(model_or_rp)
    return model_or_rp if inner is None else inner[1]


def _named_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """`named_modules()` that looks through RoundPipe wrappers (an auto-split inserts them
    as `child -> RoundPipe(model=child)`), so names stay those of the user's model."""
    inner = unwrap(module)
    if inner is not None:
        yield from _named_modules(inner[0], prefix)
        return
    yield prefix, module
    for name, child in module.named_children():
        yield from _named_modules(child, f"{prefix}.{name}" if prefix else name)


def lora_modules(model_or_rp: nn.Module) -> list[tuple[str, LoraLinear]]:
    """The model's LoRA layers with their module paths in the user's model."""
    return [(n, m) for n, m in _named_modules(user_model(model_or_rp)) if isinstance(m, LoraLinear)]


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _linear_names(model: nn.Module) -> list[str]:
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m) is nn.Linear})


def _set_child(root: nn.Module, name: str, child: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, child)


# ---- applying ----------------------------------------------------------------------------


def apply_lora(model: nn.Module, config: Any) -> nn.Module:
    """Add LoRA adapters to `model` in place and freeze everything else; return `model`.

    Args:
        model: A Hugging Face model (before `wrap_model_to_roundpipe`) or any module whose
            submodules include the targeted `nn.Linear` layers (e.g. an `nn.Sequential`).
        config: An `engine.adapters.lora.LoraConfig`, a `peft.LoraConfig`, or a mapping of
            LoraConfig fields.

    Raises:
        ConfigError: A target name matches no linear layer (the message lists the linear
            layers there are), matches a module that is not an `nn.Linear`, the rank is
            out of range for a layer, or the model already has adapters.
    """
    cfg = LoraConfig.from_any(config)
    if unwrap(model) is not None:
        raise ConfigError(
            "apply_lora takes the model before wrapping; pass lora_config= to "
            "wrap_model_to_roundpipe, or call apply_lora first and wrap the result"
        )
    if any(isinstance(m, LoraLinear) for m in model.modules()):
        raise ConfigError("the model already has LoRA adapters; apply_lora once per model")
    chosen: list[tuple[str, nn.Linear]] = []
    for target in cfg.target_modules:
        found = [(n, m) for n, m in model.named_modules() if n and _matches(n, target)]
        if not found:
            raise ConfigError(
                f"lora.target_modules: no module named {target!r} in {type(model).__name__}; "
                f"its linear layers are named {_linear_names(model)}",
                field="lora.target_modules",
            )
        for name, module in found:
            if type(module) is not nn.Linear:
                raise ConfigError(
                    f"lora.target_modules: {name!r} is a {type(module).__name__}, not an "
                    f"nn.Linear; LoRA adapts linear layers ({_linear_names(model)})",
                    field="lora.target_modules",
                )
            limit = max_lora_rank(module.in_features, module.out_features)
            if cfg.rank > limit:
                raise ConfigError(
                    f"lora.rank={cfg.rank} exceeds min(in, out)={limit} of {name!r} "
                    f"({module.in_features} -> {module.out_features}); use rank <= {limit}",
                    field="lora.rank",
                )
            chosen.append((name, module))
    for p in model.parameters():
        p.requires_grad_(False)
    seen: set[str] = set()
    for name, linear in chosen:
        if name in seen:  # two targets naming the same module
            continue
        seen.add(name)
        lora = LoraLinear(linear, rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout)
        _set_child(model, name, lora.train(linear.training))  # an eval model stays in eval
    object.__setattr__(model, "_rp_lora_config", cfg)
    log.info("LoRA: %d adapters (rank %d) on %s", len(seen), cfg.rank, type(model).__name__)
    return model


def lora_config_of(model_or_rp: nn.Module) -> LoraConfig:
    """The LoraConfig `apply_lora` used on this model."""
    cfg = getattr(user_model(model_or_rp), "_rp_lora_config", None)
    if cfg is None:
        raise ConfigError("the model has no LoRA adapters; apply_lora (or lora_config=) first")
    return cfg


def count_parameters(model_or_rp: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts of the model (a tied weight counts once)."""
    params = list(nn.Module.parameters(user_model(model_or_rp)))
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return trainable, sum(p.numel() for p in params)
