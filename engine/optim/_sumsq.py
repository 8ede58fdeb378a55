"""Gradient sums of squares for `Adam.grad_norm`: the C library's, and those kept ahead.

`rp_grad_sumsq` sums each gradient in double over fixed chunks added in order, so a
tensor's sum is the same whether it is summed alone or with others, on any thread count;
the norm adds the per-tensor sums with `math.fsum`, which rounds their exact total, so
their order does not matter either. A sum taken as soon as a gradient is final (RoundPipe
folds each layer's gradient while the backward runs: engine.fold_ahead) and kept with the
tensor therefore gives the norm the step would have computed, to the last bit.

A kept sum holds while the tensor's version counter is unchanged: an in-place torch op on
the gradient (a clip, an unscale, a division) drops it. A write through `.data` or a raw
pointer does not move the counter: change gradients with torch ops before the norm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import ConfigError
from . import _native

__all__ = ["GRAD_DTYPES", "can_keep", "keep", "kept", "per_tensor", "total"]

GRAD_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # RP_DTYPE_*
_KEPT_ATTR = "_rp_sumsq"  # (version counter when summed, sum of squares)


def per_tensor(grads: Sequence[Tensor]) -> list[float]:
    """The sum of the squares of each of `grads` (CPU tensors), in double."""
    native = _native.load()
    ffi, lib = native.ffi, native.lib
    dense = [g.contiguous() for g in grads]
    tensors = ffi.new("rp_adam_tensor[]", len(dense))
    for k, g in enumerate(dense):
        if g.dtype not in GRAD_DTYPES or g.device.type != "cpu":
            raise ConfigError(f"a gradient must be an fp32, fp16 or bf16 CPU tensor, got {g.dtype}")
        tensors[k].grad = g.data_ptr()
        tensors[k].grad_dtype = GRAD_DTYPES[g.dtype]
        tensors[k].numel = g.numel()
    out = ffi.new("double[]", len(dense))
    isa = _native.get_isa()
    isa_id = _native.ISAS.get(isa, _native.ISAS["scalar"])  # every path: the same sums
    # cffi releases the GIL for the call; `dense` keeps every tensor alive until it returns.
    rc = lib.rp_grad_sumsq(tensors, len(dense), out, _native.get_num_threads(), isa_id)
    if rc == -1:
        raise ConfigError(f"the C library refused isa {isa!r} for the sums of squares")
    if rc != 0:
        raise MemoryError("the C library could not allocate its per-chunk sums")
    return [out[k] for k in range(len(dense))]


def can_keep() -> bool:
    """Whether `keep` may run now: the C library is loaded already (no build on the caller's
    thread) and Adam uses it (torch's fallback sums the norm its own way)."""
    return _native.loaded() and _native.get_isa() != _native.TORCH_FALLBACK


def keep(grads: Sequence[Tensor]) -> None:
    """Sum each of `grads` now and keep the sum with it, for `total` to use while the
    tensor is unchanged."""
    grads = [g for g in grads if not g.is_inference()]  # no version counter to check
    for g, s in zip(grads, per_tensor(grads), strict=True):
        setattr(g, _KEPT_ATTR, (g._version, s))


def kept(grad: Tensor) -> float | None:
    """The sum kept with `grad`, if it still holds."""
    entry = getattr(grad, _KEPT_ATTR, None)
    if entry is None or entry[0] != grad._version:
        return None
    return float(entry[1])


def total(grads: Sequence[Tensor]) -> float:
    """The sum of the squares of every element of `grads`, in double: the kept sums that
    hold, the others summed now."""
    sums: list[float] = []
    missing: list[Tensor] = []
    for g in grads:
        s = kept(g)
        if s is None:
            missing.append(g)
        else:
            sums.append(s)
    if missing:
        sums.extend(per_tensor(missing))
    return math.fsum(sums)
