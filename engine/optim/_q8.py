"""8-bit Adam moments with block-wise scales, and the torch reference of the C arithmetic.

The format follows the 8-bit optimizers paper (Dettmers et al. 2021: block-wise
quantization with dynamic tree quantization). Each tensor's moments are cut into blocks of
`QBLOCK` elements (csrc/adam.h RP_QBLOCK); a block keeps one fp32 absmax and one byte per
element, the index of the nearest value of a fixed 256-entry map after dividing by the
absmax. The maps are dynamic trees: after the sign bit (signed map, exp_avg) the number of
leading zero bits E gives the decade 10**-E, the first one bit is the indicator and the
bits after it split (0.1, 1] linearly. So the map is dense near 1 and reaches down to
1e-6 (signed) / 1e-7 (unsigned, exp_avg_sq) of the absmax, where a moment's small values
live. A code is the value's index in the sorted map; encoding counts the midpoints between
neighbours that lie below x (in C: a guess from x's decade and its linear position in it,
then one compare with the threshold above the guess; `_decades`). A positive exp_avg_sq is never stored as 0: an underflow there would turn
m / (sqrt(v) + eps) into m / eps.

`exact_update` is the reference the kernel tests compare against bit for bit: every fp32
operation of csrc/adam.c done in float64 and rounded once (exact for +, -, *, /, sqrt), and
fma through round-to-odd (a float64 sum with its TwoSum error, nudged to odd when inexact),
which rounds to fp32 as the hardware fma does. It is also the `set_isa("torch")` path of
these modes (bf16 parameters, 8-bit moments).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "QBLOCK",
    "QMAP",
    "dequantize",
    "exact_update",
    "num_blocks",
    "quantize",
    "zero_state",
]

QBLOCK = 256


def _dynamic_map(signed: bool) -> list[float]:
    """The 256 sorted values of the signed (7 magnitude bits) or unsigned (8) tree map."""
    bits = 7 if signed else 8
    values = [0.0]
    for zeros in range(bits):  # leading zeros: the decade
        fraction_bits = bits - 1 - zeros
        for f in range(2**fraction_bits):
            magnitude = 10.0**-zeros * (0.1 + 0.9 * (f + 1) / 2**fraction_bits)
            values.append(magnitude)
            if signed:
                values.append(-magnitude)
    if signed:  # 255 distinct values: repeat the top one, which no x ever selects twice
        values.append(1.0)
    return sorted(values)


def _decades(signed: bool) -> list[float]:
    """The encoder's first guess per decade z (0..7): lo[8], inv_step[8], base[8].

    A magnitude a in decade z, (10**-(z+1), 10**-z], lies between map magnitudes number
    base + floor((a - lo) * inv_step) and the next: the decade's values are lo plus whole
    steps. The last decade runs down to 0 (lo = 0, one step up to its single value); the
    signed map's has 6 decades, so its entry 7 repeats entry 6. The guess is off by at most
    one magnitude next to a map value (rounding), never next to a threshold, so one compare
    with the threshold above it gives the exact code (csrc/adam.c q8_encode).
    """
    bits = 7 if signed else 8
    lo, inv_step, base = [], [], []
    for z in range(8):
        z = min(z, bits - 1)
        if z < bits - 1:
            lo.append(10.0 ** -(z + 1))
            inv_step.append(2 ** (bits - 1 - z) / (0.9 * 10.0**-z))
            base.append(float(2 ** (bits - 1 - z) - 1))
        else:
            lo.append(0.0)
            inv_step.append(10.0 ** (bits - 1))
            base.append(0.0)
    return lo + inv_step + base


def _tables() -> Tensor:
    """csrc/adam.h's qmap: signed values, thresholds, unsigned values, thresholds, then the
    decade bounds 10**-1 .. 10**-7 (and a 0) and each map's `_decades`."""
    parts = []
    for signed in (True, False):
        values = torch.tensor(_dynamic_map(signed), dtype=torch.float64).float()
        wide = values.double()
        thresholds = ((wide[:-1] + wide[1:]) / 2).float()
        parts += [values, torch.cat([thresholds, torch.tensor([math.inf])])]
    parts.append(torch.tensor([10.0**-d for d in range(1, 8)] + [0.0]))
    parts += [torch.tensor(_decades(signed)) for signed in (True, False)]
    return torch.cat([t.float() for t in parts]).contiguous()


QMAP = _tables()
"""float32[RP_QMAP_SIZE], the table the C kernel reads (RP_QMAP_* offsets); kept alive here."""
_SIGNED, _SIGNED_T = QMAP[0:256], QMAP[256:511]
_UNSIGNED, _UNSIGNED_T = QMAP[512:768], QMAP[768:1023]
SIGNED_ZERO_CODE = int(torch.searchsorted(_SIGNED_T, torch.tensor([0.0])).item())


def num_blocks(numel: int) -> int:
    """Absmax entries of a tensor of `numel` elements."""
    return (numel + QBLOCK - 1) // QBLOCK


def zero_state(p: Tensor) -> dict[str, Tensor]:
    """Fresh 8-bit moments of `p` (all zero): codes shaped like `p`, one absmax per block."""
    blocks = num_blocks(p.numel())
    return {
        "exp_avg": torch.full(p.shape, SIGNED_ZERO_CODE, dtype=torch.uint8),
        "exp_avg_sq": torch.zeros(p.shape, dtype=torch.uint8),
        "exp_avg_absmax": torch.zeros(blocks, dtype=torch.float32),
        "exp_avg_sq_absmax": torch.zeros(blocks, dtype=torch.float32),
    }


def _per_element(absmax: Tensor, numel: int) -> Tensor:
    return absmax.repeat_interleave(QBLOCK)[:numel]


def dequantize(codes: Tensor, absmax: Tensor, *, signed: bool) -> Tensor:
    """fp32 moments (flat) from codes and block absmax: map value * absmax, one rounding."""
    values = (_SIGNED if signed else _UNSIGNED)[codes.reshape(-1).long()]
    return (values.double() * _per_element(absmax, codes.numel()).double()).float()


def quantize(x: Tensor, *, signed: bool) -> tuple[Tensor, Tensor]:
    """(codes shaped like x, block absmax) of fp32 `x`, as the C kernel stores them.

    NaN differs from the kernel (which leaves it out of the absmax): the reference is for
    finite moments.
    """
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    padded = torch.zeros(num_blocks(n) * QBLOCK, dtype=torch.float32)
    padded[:n] = flat.abs()
    absmax = padded.view(-1, QBLOCK).amax(dim=1)
    scale = _per_element(absmax, n)
    norm = torch.where(scale > 0, (flat.double() / scale.double()).float(), torch.zeros_like(flat))
    codes = torch.searchsorted(_SIGNED_T if signed else _UNSIGNED_T, norm)  # thresholds < x
    if not signed:
        codes = torch.where((codes == 0) & (norm > 0), torch.ones_like(codes), codes)
    return codes.to(torch.uint8).reshape(x.shape), absmax


# ---- the exact reference --------------------------------------------------------------
def _f32(x: Tensor) -> Tensor:
    return x.to(torch.float32)


def _mul(a: Tensor, b: Tensor) -> Tensor:
    return _f32(a.double() * b.double())


def _add(a: Tensor, b: Tensor) -> Tensor:
    return _f32(a.double() + b.double())


def _div(a: Tensor, b: Tensor) -> Tensor:
    return _f32(a.double() / b.double())


def _fma(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """fmaf(a, b, c) of fp32 tensors, correctly rounded (see the module docstring)."""
    prod = a.double() * b.double()  # exact: 24 + 24 bits
    addend = c.double().expand_as(prod)
    total = prod + addend
    virtual = total - prod  # TwoSum: total + err == prod + addend exactly
    err = (prod - (total - virtual)) + (addend - virtual)
    even = (total.view(torch.int64) & 1) == 0
    nudge = (err != 0) & even & torch.isfinite(total)
    toward = torch.where(err > 0, math.inf, -math.inf).to(torch.float64)
    return _f32(torch.where(nudge, torch.nextafter(total, toward), total))


def _sqrt(a: Tensor) -> Tensor:
    return _f32(a.double().sqrt())


def exact_update(
    p: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    h: dict[str, Any],
    round_bf16: Any,
) -> None:
    """One step of csrc/adam.c on `p` (fp32 or bf16) in torch, bit for bit.

    Args:
        h: The kernel's scalars (engine.optim._hyper_values of the group and step).
        round_bf16: engine.optim.stochastic_round_bf16.
    """

    def const(name: str) -> Tensor:
        return torch.tensor(float(h[name]), dtype=torch.float32)

    shape = p.shape
    x = p.detach().reshape(-1).float()
    g = grad.reshape(-1).float()
    q8 = state["exp_avg"].dtype == torch.uint8
    if q8:
        m = dequantize(state["exp_avg"], state["exp_avg_absmax"], signed=True)
        v = dequantize(state["exp_avg_sq"], state["exp_avg_sq_absmax"], signed=False)
    else:
        m = state["exp_avg"].reshape(-1).float()
        v = state["exp_avg_sq"].reshape(-1).float()
    if h["maximize"]:
        g = -g
    if h["use_l2"]:
        g = _fma(x, const("l2_weight_decay"), g)
    if h["use_decoupled"]:
        x = _mul(x, const("decoupled_decay"))
    w = const("beta1_weight")
    diff = _add(g, -m)
    if abs(float(w)) < 0.5:
        m = _fma(w, diff, m)
    else:
        m = _fma(_add(w, torch.tensor(-1.0)), diff, g)
    v = _mul(v, const("beta2"))
    v = _fma(_mul(const("one_minus_beta2"), g), g, v)
    second = v
    if h["amsgrad"]:
        second = torch.maximum(state["max_exp_avg_sq"].reshape(-1), v)
        state["max_exp_avg_sq"].copy_(second.reshape(shape))
    denom = _add(_mul(_sqrt(second), const("inv_bias_correction2_sqrt")), const("eps"))
    x = _add(x, _div(_mul(const("neg_step_size"), m), denom))
    with torch.no_grad():
        if p.dtype == torch.bfloat16:
            p.copy_(round_bf16(x, which=0, seed=h["param_sr_seed"]).reshape(shape))
        else:
            p.copy_(x.reshape(shape))
    if q8:
        state["exp_avg"], state["exp_avg_absmax"] = quantize(m.reshape(shape), signed=True)
        state["exp_avg_sq"], state["exp_avg_sq_absmax"] = quantize(v.reshape(shape), signed=False)
    elif state["exp_avg"].dtype == torch.bfloat16:
        state["exp_avg"].copy_(round_bf16(m, which=0, seed=h["sr_seed"]).reshape(shape))
        state["exp_avg_sq"].copy_(round_bf16(v, which=1, seed=h["sr_seed"]).reshape(shape))
    else:
        state["exp_avg"].copy_(m.reshape(shape))
        state["exp_avg_sq"].copy_(v.reshape(shape))
