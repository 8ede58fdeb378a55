"""FP8 matmuls: the decoder's linear layers computed in float8 with dynamic scales.

What runs in FP8: the three matmuls of every converted `nn.Linear` (y = x W^T forward, the
input gradient g W and the weight gradient g^T x backward), each operand cast to float8
with a scale from its own absolute maximum at that call (dynamic scaling, no history),
multiplied by `torch._scaled_mm` into bf16. Everything else stays as it was: embeddings,
norms, attention's softmax, the chunked loss, the output head (never converted: see
`convert_linears`), the LoRA adapters' small GEMMs.

The recipes are torchao's float8 training recipes of the same names (facts from its
documentation and config; no code of it is used):
- rowwise: one scale per row of each operand along the matmul's inner dimension, every
  operand e4m3, scales rounded down to a power of two (exact to apply);
- tensorwise: one scale per operand, the output gradient in e5m2 (wider range, fewer
  digits), the rest e4m3;
- rowwise_with_gw_hp: rowwise, but the weight gradient g^T x multiplied in bf16 ("high
  precision"). That matmul's operands are scaled along the tokens, so rowwise casts them
  column by column over transposed copies of the two largest tensors of the backward
  (session 22 on an H200: the backward's casts grew from 1.0 to 3.7 ms a 1.7B layer while
  its FP8 GEMMs saved 2.8); here they are not cast at all. Only the weight gradient
  differs from rowwise: a LoRA or NF4 base (no weight gradient) computes the same.
The forward GEMM accumulates with the fast (lower-precision) mode, the two backward GEMMs
without it, as torchao's defaults do.

Why not torchao's `Float8Linear` itself: the engine's LoRA merges the adapter into the
uploaded base weight and runs its own autograd Function on it (`engine.adapters.lora`),
which a swapped module cannot reach, and its NF4 base is recognised as plain `nn.Linear`.
One autograd Function here serves full fine-tunes, LoRA and NF4 bases (its pieces
`fp8_forward` and `fp8_grad_input` serve LoRA's merged linear), traces whole inside the
decoder layers' torch.compile graphs and captures into CUDA graphs (no host
synchronisation: scales stay on the device). It matched torchao 0.18's Float8Linear bit for
bit on the CPU (both recipes: output, input and weight gradients), checked once (since
then rowwise scales are rounded down to a power of two by clearing their mantissa bits:
the same values but where torchao's log2 rounds up; and since session 25 tensorwise scales
too, as torchao's `round_scales_to_power_of_2` does, see `fp8_matmul_nt`); torchao is not a
dependency. `torch._scaled_mm` runs on the CPU in torch 2.13 (fp32 accumulation),
so CI checks the arithmetic; only CUDA GPUs of compute capability >= 8.9 make it fast
(`engine.options.FP8_MIN_CAPABILITY`).

Memory: nothing persistent. The backward keeps the bf16 input and the (streamed) bf16
weight as a bf16 linear does; the float8 copies live only inside one matmul. Inside the
compiled decoder layers every amax, scale and cast is a plain op of inductor's forward and
backward graphs (no graph break), fused with its neighbours, and AOTAutograd's partitioner
may keep the float8 x^T of the weight gradient from the forward instead of x (docs/FP8.md).
"""

from __future__ import annotations

import logging
from collections.abc import Container
from typing import Any, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from ..options import Fp8Recipe, MatmulPrecision

__all__ = [
    "DEFAULT_SKIP_MODULES",
    "E4M3",
    "E5M2",
    "Fp8Linear",
    "Fp8Recipe",
    "cast_to_fp8",
    "convert_linears",
    "fp8_forward",
    "fp8_grad_input",
    "fp8_linear",
    "fp8_matmul_nt",
    "fp8_recipe",
    "fp8_shape_ok",
    "grad_dtype",
    "use_fp8_matmuls",
]

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# The smallest amax a scale is computed from: an all-zero row gets a finite scale (torchao's
# EPS), and casts to zero whatever the scale.
_AMAX_FLOOR = 1e-12
# The exponent field of a float32: clearing the rest rounds a positive normal value down to a
# power of two.
_EXPONENT_BITS = 0x7F800000
# torch._scaled_mm wants both dimensions of its second operand and the inner dimension
# divisible by 16 (cuBLASLt's FP8 alignment).
_ALIGN = 16
# Linears left in bf16 by default: the output head, mixture-of-experts routers (whose top-k
# choice small errors could flip) and LoRA's adapter factors (fp32, tiny GEMMs).
DEFAULT_SKIP_MODULES = ("lm_head", "gate", "router", "lora_A", "lora_B")


def cast_to_fp8(
    t: Tensor, dtype: torch.dtype, *, rowwise: bool, pow2: bool = False
) -> tuple[Tensor, Tensor]:
    """Return `t` in float8 and its dequantisation scale: t ~= q * scale.

    Args:
        t: A 2-D tensor, cast row by row along its last dimension when `rowwise`.
        rowwise: One scale per row, shaped (rows, 1); else one 0-d scale.
        pow2: Round each scale down to a power of two (then multiplying by it is exact).

    The scale maps the amax onto the float8 type's largest finite value; values are
    clamped there (saturated) before the cast, so rounding never produces inf or nan.
    """
    absolute = t.abs()
    amax = absolute.amax(dim=-1, keepdim=True) if rowwise else absolute.amax()
    top = torch.finfo(dtype).max
    # float64 for the division: eager and compiled code round it alike (as torchao notes).
    scale = (top / amax.double().clamp(min=_AMAX_FLOOR)).float()
    if pow2:
        scale = _round_down_to_pow2(scale)
    q = (t.float() * scale).clamp(-top, top).to(dtype)
    return q, scale.reciprocal()


def _round_down_to_pow2(scale: Tensor) -> Tensor:
    """Positive normal float32 `scale` rounded down to a power of two: its mantissa bits
    cleared. Exact on every backend, where `exp2(floor(log2(s)))` (torchao's form) depends
    on a log2 that may round up to the next integer for s just below a power of two (then
    the scale doubles and the amax saturates) and may differ between eager and compiled."""
    return (scale.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)


def fp8_shape_ok(in_features: int, out_features: int) -> bool:
    """Whether a linear of these sizes can run its matmuls in FP8 (alignment)."""
    return in_features % _ALIGN == 0 and out_features % _ALIGN == 0


def _scaled_mm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, *, fast: bool) -> Tensor:
    """a (m, k) row-major times b (k, n) column-major, scales (m, 1) / (1, n) or 0-d."""
    return torch._scaled_mm(
        a, b, scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16, use_fast_accum=fast
    )


def fp8_matmul_nt(
    a: Tensor,
    b: Tensor,
    *,
    recipe: Fp8Recipe,
    a_dtype: torch.dtype = E4M3,
    fast: bool,
) -> Tensor:
    """a @ b^T in FP8 for a (m, k) and b (n, k), both scaled along k: (m, n) bf16.

    Every FP8 matmul of the linear is this one shape: both operands laid out with the inner
    dimension last, which is what `_scaled_mm` wants (its second operand column-major).
    """
    rowwise = recipe != "tensorwise"
    # The casts keep their input's layout; _scaled_mm wants a row-major and b^T
    # column-major, i.e. both contiguous (a no-op for the usual contiguous activations).
    # Every recipe's scales are powers of two: a scale that follows the amax's last bits
    # re-rounds a whole tensor when any kernel upstream rounds its largest element one
    # bf16 step apart (session 25, on the CPU: one such step moved tensorwise's output by
    # 2.5% and its gradients by 3.4%, relative L2; power-of-two scales by nothing).
    qa, sa = cast_to_fp8(a.contiguous(), a_dtype, rowwise=rowwise, pow2=True)
    qb, sb = cast_to_fp8(b.contiguous(), E4M3, rowwise=rowwise, pow2=True)
    if rowwise:
        sb = sb.reshape(1, -1)  # (n, 1) -> (1, n): b's per-row scales are output columns
    return _scaled_mm(qa, sa, qb.t(), sb, fast=fast)


def grad_dtype(recipe: Fp8Recipe) -> torch.dtype:
    """The float8 type of the output gradient under `recipe`."""
    # tensorwise: one scale must cover the whole gradient's range, which e5m2 has room for.
    return E5M2 if recipe == "tensorwise" else E4M3


def _pad_rows(t: Tensor, multiple: int) -> Tensor:
    """`t` (rows, cols) with zero rows appended up to a multiple of `multiple` rows (zero
    rows change neither an amax nor a sum over rows)."""
    extra = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, extra)) if extra else t


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T (+ bias) with all three matmuls in FP8 (`recipe`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: Fp8Recipe
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.recipe = recipe
        ctx.has_bias = bias is not None
        return fp8_forward(x, weight, bias, recipe)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        recipe: Fp8Recipe = ctx.recipe
        g = grad.reshape(-1, grad.shape[-1])  # (tokens, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_grad_input(grad, weight, recipe).to(x.dtype)
        if ctx.needs_input_grad[1] and recipe == "rowwise_with_gw_hp":
            grad_w = g.t().mm(x.reshape(-1, x.shape[-1])).to(weight.dtype)  # bf16 GEMM
        elif ctx.needs_input_grad[1]:
            # g^T x: both operands scaled along tokens, the inner dimension here, which must
            # be a multiple of 16: pad with zero tokens when it is not.
            flat = x.reshape(-1, x.shape[-1])
            gt = _pad_rows(g, _ALIGN).t()  # (out, tokens)
            xt = _pad_rows(flat, _ALIGN).t()  # (in, tokens)
            grad_w = fp8_matmul_nt(gt, xt, recipe=recipe, a_dtype=grad_dtype(recipe), fast=False)
            grad_w = grad_w.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: Fp8Recipe) -> Tensor:
    """F.linear(x, weight, bias) with its forward and backward matmuls in FP8."""
    return _Fp8Linear.apply(x, weight, bias, recipe)


def fp8_forward(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: Fp8Recipe) -> Tensor:
    """F.linear(x, weight, bias) computed in FP8, outside autograd (for autograd Functions
    that give their own backward, as `fp8_linear` and LoRA's merged linear do)."""
    flat = x.reshape(-1, x.shape[-1])  # (tokens, in)
    out = fp8_matmul_nt(flat, weight, recipe=recipe, fast=True)  # (tokens, out)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


def fp8_grad_input(grad: Tensor, weight: Tensor, recipe: Fp8Recipe) -> Tensor:
    """grad @ weight (the input gradient of x W^T) in FP8: grad (..., out) -> (..., in)."""
    g = grad.reshape(-1, grad.shape[-1])  # (tokens, out)
    # Inner dimension `out`: the weight transposed, (in, out), scaled along it.
    wt = weight.t()
    out = fp8_matmul_nt(g, wt, recipe=recipe, a_dtype=grad_dtype(recipe), fast=False)
    return out.view(*grad.shape[:-1], weight.shape[1])


class Fp8Linear(nn.Linear):
    """An `nn.Linear` whose matmuls run in FP8 for bf16 inputs (others: as nn.Linear).

    Holds the same parameter objects as the linear it replaces (`from_linear`), so names,
    state dicts and the engine's uploads are unchanged.
    """

    recipe: Fp8Recipe

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Fp8Recipe) -> Fp8Linear:
        """An Fp8Linear sharing `linear`'s weight and bias."""
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        new.recipe = recipe
        new.train(linear.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        recipe = fp8_recipe(self, x)
        if recipe is None:
            return F.linear(x, self.weight, self.bias)
        return fp8_linear(x, self.weight, self.bias, recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def fp8_recipe(linear: nn.Module, x: Tensor) -> Fp8Recipe | None:
    """The FP8 recipe `linear` computes `x` with, or None for its ordinary matmul: FP8 takes
    bf16 inputs and weights only (an fp32 model keeps its exact numerics)."""
    if not isinstance(linear, Fp8Linear):
        return None
    if x.dtype != torch.bfloat16 or linear.weight.dtype != torch.bfloat16:
        return None
    return linear.recipe


def _convertible(
    model: nn.Module, skip_modules: Container[str]
) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) of each plain `nn.Linear` `convert_linears` replaces."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is not nn.Linear or name in skip_modules:
                continue
            if not fp8_shape_ok(child.in_features, child.out_features):
                log.info(
                    "FP8: %s (%d -> %d) stays as it is: sizes not multiples of %d",
                    name,
                    child.in_features,
                    child.out_features,
                    _ALIGN,
                )
                continue
            found.append((parent, name, child))
    return found


def convert_linears(
    model: nn.Module,
    recipe: Fp8Recipe,
    *,
    skip_modules: Container[str] = DEFAULT_SKIP_MODULES,
) -> int:
    """Replace every plain `nn.Linear` of `model` by an `Fp8Linear`; return how many.

    A LoRA layer's frozen base is converted with the rest (its adapters stay bf16 GEMMs);
    an NF4 base is converted too (its decoded weight is cast on the device).

    Args:
        skip_modules: Linears kept as they are when their attribute name is listed (the
            output head, MoE routers, LoRA's adapter factors). Linears whose sizes are not
            multiples of 16 are kept too (FP8 GEMM alignment).
    """
    found = _convertible(model, skip_modules)
    for parent, name, child in found:
        setattr(parent, name, Fp8Linear.from_linear(child, recipe))
    return len(found)


def use_fp8_matmuls(
    name: str, layers: list[nn.Module], matmul_precision: str, fp8_recipe: str
) -> int:
    """RoundPipe's `matmul_precision` / `fp8_recipe` applied to its layers (before their
    parameters are pinned or replicated): the linears converted, or none for 'bf16'.

    Raises:
        ConfigError: An unknown value, or 'fp8' with linear weights other than bf16.
    """
    for option, value, alias in (
        ("matmul_precision", matmul_precision, MatmulPrecision),
        ("fp8_recipe", fp8_recipe, Fp8Recipe),
    ):
        if value not in get_args(alias):
            choices = " or ".join(repr(c) for c in get_args(alias))
            raise ConfigError(f"{option} must be {choices}, got {value!r}", field=option)
    if matmul_precision == "bf16":
        return 0
    dtypes = {
        child.weight.dtype
        for layer in layers
        for _, _, child in _convertible(layer, DEFAULT_SKIP_MODULES)
    }
    if dtypes - {torch.bfloat16}:
        raise ConfigError(
            "matmul_precision='fp8' multiplies bfloat16 weights and activations in float8; "
            f"this model's linear weights are {sorted(str(d) for d in dtypes)}: convert it "
            "with model.to(torch.bfloat16), or use matmul_precision='bf16'",
            field="matmul_precision",
        )
    count = sum(convert_linears(layer, fp8_recipe) for layer in layers)  # type: ignore[arg-type]
    log.info("%s: %d linear layers multiply in FP8 (%s scales)", name, count, fp8_recipe)
    return count
