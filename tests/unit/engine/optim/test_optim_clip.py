"""engine.optim.Adam's gradient norm and clip: the norm summed in double by the C library,
the clip's multiply done inside the next step (no pass over the gradients of its own).

The update after `Adam.clip_grad_norm_` must be bit for bit the one after torch's clip with
the same norm (`clip_grads_with_norm_`), on every ISA path and for every gradient and
moment dtype; the norm must not depend on the thread count."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import engine.optim as eo
from engine.optim import _sumsq

ISAS = eo.available_isas()


def _params(grad_dtype: torch.dtype, sizes: tuple[int, ...] = (1000, 3001, 7)):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in params:
        p.grad_dtype = None  # the C Adam takes half gradients of fp32 parameters
        p.grad = (torch.randn_like(p) * 3).to(grad_dtype)
    return params


def _twins(params):
    """fp32 copies of `params` with fp32 copies of their gradients (torch's clip's input)."""
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for a, b in zip(params, twins, strict=True):
        b.grad = a.grad.float().clone()
    return twins


@pytest.fixture(autouse=True)
def _restore_isa():
    isa = eo.get_isa()
    yield
    eo.set_isa(isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_clip_inside_the_step_equals_torch_clip_with_the_same_norm(isa, grad_dtype, state_dtype):
    eo.set_isa(isa)
    ours = _params(grad_dtype)
    ref = _twins(ours)
    kw = {"lr": 1e-2, "weight_decay": 0.1, "state_dtype": state_dtype}
    opt, ref_opt = eo.Adam(ours, **kw), eo.Adam(ref, **kw)
    scaled = 0
    for _ in range(3):
        norm = opt.clip_grad_norm_(1.0)
        torch.nn.utils.clip_grads_with_norm_(ref, 1.0, norm)
        scaled += float(norm) > 1.0
        opt.step()
        ref_opt.step()
        for a, b in zip(ours, ref, strict=True):
            assert torch.equal(a, b)
            b.grad = a.grad.float().clone()  # the same gradients again next step
    assert scaled == 3  # the clip did change every update


def test_gradients_keep_their_values_until_the_step_and_zero_grad_drops_the_clip():
    ours = _params(torch.float32)
    before = [p.grad.clone() for p in ours]
    opt = eo.Adam(ours, lr=1e-2)
    opt.clip_grad_norm_(0.5)
    assert all(torch.equal(p.grad, g) for p, g in zip(ours, before, strict=True))
    opt.zero_grad(set_to_none=False)  # a clip that no step applied is forgotten
    unclipped = _params(torch.float32)
    ref = _twins(unclipped)
    opt2, ref_opt = eo.Adam(unclipped, lr=1e-2), eo.Adam(ref, lr=1e-2)
    opt2.clip_grad_norm_(0.5)
    opt2.zero_grad(set_to_none=False)
    for a, b in zip(unclipped, ref, strict=True):
        a.grad = b.grad.clone()
    opt2.step()
    ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(unclipped, ref, strict=True))


def test_norm_is_the_double_sum_and_does_not_depend_on_threads():
    # Over 2**18 elements a tensor spans several of the library's chunks.
    params = _params(torch.float32, sizes=(3 * (1 << 18) + 5, 11))
    exact = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    threads = eo.get_num_threads()
    try:
        norms = []
        for n in (1, 2, 3):
            eo.set_num_threads(n)
            norms.append(eo.Adam(params).grad_norm())
    finally:
        eo.set_num_threads(threads)
    assert norms[0].dtype == torch.float32
    assert all(torch.equal(norms[0], n) for n in norms[1:])
    assert float(norms[0]) == pytest.approx(exact, rel=1e-7)
    # torch's fp32 sum is within its own rounding of the same value
    torch_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    assert float(torch_norm) == pytest.approx(exact, rel=1e-5)


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_norm_of_half_gradients_equals_the_norm_of_their_fp32_values(grad_dtype):
    params = _params(grad_dtype)
    widened = _twins(params)
    assert torch.equal(eo.Adam(params).grad_norm(), eo.Adam(widened).grad_norm())


def _chained_sumsq(g: torch.Tensor) -> float:
    """The documented sum (csrc/adam.h, rp_grad_sumsq) in numpy: per chunk of 2**18
    elements, element i's square in double added in order to running sum i % 4, the four
    added as (s0 + s1) + (s2 + s3); the chunks' sums added in order."""
    x = g.detach().float().reshape(-1).double().numpy()
    total = 0.0
    for lo in range(0, x.size, 1 << 18):
        chunk = x[lo : lo + (1 << 18)]
        s = [float(np.add.accumulate(chunk[k::4] ** 2)[-1]) if chunk[k::4].size else 0.0
             for k in range(4)]  # fmt: skip
        total += (s[0] + s[1]) + (s[2] + s[3])
    return total


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sums_of_squares_are_the_documented_chains_on_every_isa(grad_dtype):
    """Each ISA path's per-tensor sums (the vector ones widen a half gradient in registers)
    equal the documented order's to the bit, and a half gradient's sum is its fp32 copy's."""
    torch.manual_seed(1)
    grads = [(torch.randn(n) * 3).to(grad_dtype) for n in (1, 3, 17, 1000003, 3 * (1 << 18) + 5)]
    grads.append(torch.tensor([0.0, -0.0, 65504.0, 1e-7], dtype=grad_dtype))  # fp16 edges
    expected = [_chained_sumsq(g) for g in grads]
    for isa in ISAS:
        eo.set_isa(isa)
        assert _sumsq.per_tensor(grads) == expected, isa
        assert _sumsq.per_tensor([g.float() for g in grads]) == expected, isa


def test_without_gradients_the_norm_is_zero_and_the_step_does_nothing():
    p = torch.nn.Parameter(torch.ones(4))
    opt = eo.Adam([p])
    assert float(opt.clip_grad_norm_(1.0)) == 0.0
    opt.step()
    assert torch.equal(p, torch.ones(4))


def test_torch_fallback_multiplies_the_gradients_at_once():
    eo.set_isa("torch")
    params = _params(torch.float32)
    ref = _twins(params)
    norm = eo.Adam(params).clip_grad_norm_(1.0)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert torch.equal(norm, ref_norm)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(params, ref, strict=True))


def test_a_given_total_norm_is_the_one_clipped_by():
    # Data parallel: each rank clips its shard by the norm over every rank's gradients.
    params = _params(torch.float32)
    ref = _twins(params)
    opt, ref_opt = eo.Adam(params, lr=1e-2), eo.Adam(ref, lr=1e-2)
    norm = opt.clip_grad_norm_(1.0, total_norm=123.0)
    assert float(norm) == 123.0
    torch.nn.utils.clip_grads_with_norm_(ref, 1.0, torch.tensor(123.0))
    opt.step()
    ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, ref, strict=True))
