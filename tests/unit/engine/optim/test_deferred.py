"""engine.optim._deferred: an optimizer-side parameter whose gradient is a deferred copy of
another tensor (RoundPipe's half-precision download). engine.optim.Adam reads that tensor in
place; any other read of `.grad` makes the copy, once.

Oracle: the same parameters given the fp32 copies as their gradients, stepped by the same
Adam: every norm and weight bit for bit, on every ISA path, for fp32, fp16 and bf16
gradients, with and without the clip; and no copy made, no buffer asked for.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import engine.optim as eo
from engine.optim import _deferred
from engine.optim._deferred import DeferredGradParameter

ISAS = eo.available_isas()
SIZES = (1, 17, 1000003)  # odd: the SIMD tails run


class _Copies:
    """The `buffer` and `on_read` of one deferred gradient, counting their calls."""

    def __init__(self, like: torch.Tensor) -> None:
        self.like = like
        self.buffers: list[torch.Tensor] = []
        self.reads = 0

    def buffer(self) -> torch.Tensor:
        self.buffers.append(torch.empty(self.like.shape, dtype=self.like.dtype))
        return self.buffers[-1]

    def on_read(self) -> None:
        self.reads += 1


def _defer(p: DeferredGradParameter, source: torch.Tensor) -> _Copies:
    copies = _Copies(p)
    _deferred.defer(p, source, buffer=copies.buffer, on_read=copies.on_read)
    return copies


@pytest.fixture(autouse=True)
def _restore_isa() -> Any:
    isa = eo.get_isa()
    yield
    eo.set_isa(isa)


def test_a_read_of_grad_makes_the_copy_once() -> None:
    p = DeferredGradParameter(torch.zeros(5))
    source = torch.randn(5).bfloat16()
    copies = _defer(p, source)
    assert _deferred.deferred(p) is source and _deferred.stored(p) is source
    g = p.grad
    assert g is not None and g.dtype == torch.float32 and torch.equal(g, source.float())
    assert copies.reads == 1 and g is copies.buffers[0]
    assert p.grad is g and copies.reads == 1  # made once
    assert _deferred.deferred(p) is None and _deferred.stored(p) is g


def test_setting_or_deleting_grad_drops_the_deferred_one_uncopied() -> None:
    p = DeferredGradParameter(torch.zeros(3))
    copies = _defer(p, torch.ones(3).half())
    p.grad = None
    assert p.grad is None and _deferred.deferred(p) is None
    copies = _defer(p, torch.ones(3).half())
    del p.grad
    assert p.grad is None
    copies2 = _defer(p, torch.ones(3).half())
    _deferred.drop(p)
    assert p.grad is None
    assert (copies.buffers, copies2.buffers) == ([], [])


def test_settle_copies_without_a_read() -> None:
    p = DeferredGradParameter(torch.zeros(4))
    source = torch.randn(4).half()
    copies = _defer(p, source)
    _deferred.settle(p)
    assert copies.reads == 0 and len(copies.buffers) == 1
    assert torch.equal(p.grad, source.float()) and copies.reads == 0
    _deferred.settle(p)  # nothing deferred: nothing to do
    assert len(copies.buffers) == 1


def test_defer_over_a_gradient_refuses() -> None:
    p = DeferredGradParameter(torch.zeros(2))
    p.grad = torch.ones(2)
    with pytest.raises(RuntimeError):
        _defer(p, torch.ones(2).bfloat16())
    p.grad = None
    _defer(p, torch.ones(2).bfloat16())
    with pytest.raises(RuntimeError):
        _defer(p, torch.ones(2).bfloat16())


def _twins() -> tuple[list[DeferredGradParameter], list[torch.nn.Parameter]]:
    """The same values as DeferredGradParameters and as plain parameters."""
    torch.manual_seed(0)
    values = [torch.randn(n) for n in SIZES]
    ours = [DeferredGradParameter(v.clone()) for v in values]
    ref = [torch.nn.Parameter(v.clone()) for v in values]
    return ours, ref


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_adam_reads_a_deferred_gradient_in_place_bit_for_bit(
    isa: str, grad_dtype: torch.dtype, clip: bool
) -> None:
    """Three steps: the C Adam reads each deferred (half) gradient itself, norm and update
    bit for bit those of its fp32 copy; no copy is made, no buffer asked for."""
    eo.set_isa(isa)
    ours, ref = _twins()
    kw: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True}
    opt, ref_opt = eo.Adam(ours, **kw), eo.Adam(ref, **kw)
    copies = []
    for _ in range(3):
        for p, r in zip(ours, ref, strict=True):
            source = (torch.randn(p.shape) * 3).to(grad_dtype)
            copies.append(_defer(p, source))
            r.grad = source.float()
        if clip:
            norm, ref_norm = opt.clip_grad_norm_(1.0), ref_opt.clip_grad_norm_(1.0)
            assert torch.equal(norm, ref_norm) and float(norm) > 1.0
        else:
            assert torch.equal(opt.grad_norm(), ref_opt.grad_norm())
        opt.step()
        ref_opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
        opt.zero_grad()
        ref_opt.zero_grad()
        assert all(p.grad is None for p in ours)
    assert all(c.reads == 0 and not c.buffers for c in copies)


def test_torch_fallback_steps_with_the_copy() -> None:
    """Without the C library the update is torch's: it reads `.grad`, so the copy is made."""
    eo.set_isa("torch")
    ours, ref = _twins()
    opt, ref_opt = eo.Adam(ours, lr=1e-2), eo.Adam(ref, lr=1e-2)
    copies = []
    for p, r in zip(ours, ref, strict=True):
        source = torch.randn(p.shape).bfloat16()
        copies.append(_defer(p, source))
        r.grad = source.float()
    opt.step()
    ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    assert all(c.reads == 1 for c in copies)


def test_zero_grad_keeping_the_tensors_zeroes_the_copy() -> None:
    """zero_grad(set_to_none=False) leaves zeros in the parameter's dtype, as torch does."""
    p = DeferredGradParameter(torch.randn(17))
    copies = _defer(p, torch.ones(p.shape).bfloat16())
    opt = eo.Adam([p])
    opt.zero_grad(set_to_none=False)
    assert copies.reads == 0 and len(copies.buffers) == 1
    assert p.grad is copies.buffers[0] and p.grad.dtype == torch.float32
    assert not p.grad.any()
