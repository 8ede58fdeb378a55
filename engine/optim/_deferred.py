"""Optimizer-side parameters whose gradient may be a deferred copy of another tensor.

RoundPipe downloads each gradient into a host buffer of the model's dtype and used to copy it
into the optimizer-side gradient (fp32 with fp32 masters) at every step: a write of 4 bytes a
parameter and, in the update, a read of 4 more. `engine.optim.Adam` reads a half gradient
itself, widening it exactly in registers, so where the optimizer-side gradient would be a
plain copy of the download, the step hands it over as a deferred copy instead (`defer`):
`Adam` reads the download in place (`deferred`), and the copy is made only if something
else reads `p.grad` (a torch optimizer, torch's clip, a GradScaler's unscale, a log line):
the property below makes it on that first read, so every reader sees the gradient it
always saw. Neither way changes a bit of the update or of the norm (the widening is exact,
and the C library's sums of squares are the same for a half gradient and its fp32 copy).

A deferred copy lives within one step: the step hands it out after the fold and, once
step_fn has returned, copies what the step_fn kept (`settle`); `p.grad = None` (zero_grad)
drops it. Autograd's own accumulation into `.grad` (a backward through the optimizer-side
parameters) bypasses the property: the engine never runs one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["DeferredGradParameter", "defer", "deferred", "drop", "settle", "stored"]

_RAW_GRAD = torch._C.TensorBase.grad  # the `.grad` slot itself, under the property below
_ENTRY_ATTR = "_rp_deferred_grad"


@dataclass(frozen=True, slots=True)
class _Deferred:
    source: Tensor  # the gradient's values, in its own dtype (the download buffer)
    buffer: Callable[[], Tensor]  # the parameter-dtype tensor the copy goes into
    on_read: Callable[[], None]  # told when a read other than the C Adam's made the copy


class DeferredGradParameter(nn.Parameter):
    """An nn.Parameter whose `.grad` may be held as another tensor until first read."""

    @property  # type: ignore[override]
    def grad(self) -> Tensor | None:
        """The gradient; a deferred one is copied into the parameter's dtype first."""
        entry = self.__dict__.get(_ENTRY_ATTR)
        if entry is not None:
            _copy(self, entry)
            entry.on_read()
        return _RAW_GRAD.__get__(self)  # type: ignore[no-any-return]

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        self.__dict__.pop(_ENTRY_ATTR, None)
        _RAW_GRAD.__set__(self, value)

    @grad.deleter
    def grad(self) -> None:
        self.__dict__.pop(_ENTRY_ATTR, None)
        _RAW_GRAD.__delete__(self)


def defer(
    p: DeferredGradParameter,
    source: Tensor,
    *,
    buffer: Callable[[], Tensor],
    on_read: Callable[[], None],
) -> None:
    """Make `source` (p's shape, any dtype the C Adam reads) p's gradient, copied into
    `buffer()` on the first read of `p.grad`, after which `on_read()` is called. p must hold
    no gradient."""
    if _RAW_GRAD.__get__(p) is not None or _ENTRY_ATTR in p.__dict__:
        raise RuntimeError("defer() over a gradient: add to it instead")
    p.__dict__[_ENTRY_ATTR] = _Deferred(source, buffer, on_read)


def deferred(p: Tensor) -> Tensor | None:
    """The tensor p's gradient is a deferred copy of, or None."""
    entry = p.__dict__.get(_ENTRY_ATTR)
    return None if entry is None else entry.source


def stored(p: Tensor) -> Tensor | None:
    """p's gradient as held, copying nothing: the deferred source, else `.grad`."""
    source = deferred(p)
    return source if source is not None else _RAW_GRAD.__get__(p)


def settle(p: Tensor) -> None:
    """Make p's deferred copy now (the gradient outlives the tensor it is a copy of); not a
    read in `on_read`'s sense. Nothing when p's gradient is not deferred."""
    entry = p.__dict__.get(_ENTRY_ATTR)
    if entry is not None:
        _copy(p, entry)


def drop(p: Tensor) -> None:
    """Forget p's deferred gradient (p then has none)."""
    p.__dict__.pop(_ENTRY_ATTR, None)


def _copy(p: Tensor, entry: _Deferred) -> None:
    buf = entry.buffer()
    buf.copy_(entry.source)
    del p.__dict__[_ENTRY_ATTR]
    _RAW_GRAD.__set__(p, buf)
