"""engine.optim.Adam's low-precision modes (issue 15): fp16/bf16 gradients read in place and
bf16 moments, on every ISA path, against torch references."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import engine.optim as eo
from engine.errors import ConfigError

# Odd sizes: every SIMD tail length of both vector widths, and one multi-chunk tensor.
SIZES = (*range(1, 18), 33, 4097)
STEPS = 4
KWARGS = [
    {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.1, "decoupled_weight_decay": True},
    {"lr": 3e-3, "betas": (0.2, 0.95), "weight_decay": 0.05, "maximize": True},
]


@pytest.fixture(autouse=True)
def _default_settings() -> Iterator[None]:
    yield
    eo.set_isa(None)
    eo.set_num_threads(None)


def _train(
    isa: str,
    *,
    state_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    kwargs: dict[str, Any],
    sizes: tuple[int, ...] = SIZES,
    threads: int = 1,
) -> tuple[list[torch.nn.Parameter], list[dict[str, Any]]]:
    eo.set_isa(isa)
    eo.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    for p in params:
        p.grad_dtype = grad_dtype
    opt = eo.Adam(params, state_dtype=state_dtype, **kwargs)
    for _ in range(STEPS):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(grad_dtype)
        opt.step()
    return params, [opt.state[p] for p in params]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@pytest.mark.parametrize("kwargs", KWARGS)
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_isa_paths_agree_bitwise(kwargs, grad_dtype, state_dtype) -> None:
    expected = _train("scalar", state_dtype=state_dtype, grad_dtype=grad_dtype, kwargs=kwargs)
    for isa in eo.available_isas():
        got = _train(isa, state_dtype=state_dtype, grad_dtype=grad_dtype, kwargs=kwargs)
        for p_exp, p_got in zip(expected[0], got[0], strict=True):
            assert torch.equal(p_exp, p_got), isa
        for s_exp, s_got in zip(expected[1], got[1], strict=True):
            assert s_got["exp_avg"].dtype == state_dtype
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(_bits(s_exp[key]), _bits(s_got[key])), (isa, key)


def test_threads_do_not_change_bf16_results() -> None:
    best = eo.available_isas()[-1]
    common = {"state_dtype": torch.bfloat16, "grad_dtype": torch.float16, "kwargs": KWARGS[0]}
    one = _train(best, sizes=(1_000_003,), threads=1, **common)
    many = _train(best, sizes=(1_000_003,), threads=3, **common)
    assert torch.equal(one[0][0], many[0][0])
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(_bits(one[1][0][key]), _bits(many[1][0][key]))


@pytest.mark.parametrize("kwargs", KWARGS)
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_half_grad_matches_torch_adamw_on_widened_grads(kwargs, grad_dtype) -> None:
    """fp32 state: a half gradient is the same as its exact fp32 widening (torch oracle)."""
    got = _train(
        eo.available_isas()[-1], state_dtype=torch.float32, grad_dtype=grad_dtype, kwargs=kwargs
    )
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES]
    oracle_kwargs = {k: v for k, v in kwargs.items() if k != "decoupled_weight_decay"}
    oracle_cls = torch.optim.AdamW if kwargs.get("decoupled_weight_decay") else torch.optim.Adam
    ref = oracle_cls(params, **oracle_kwargs)
    for _ in range(STEPS):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(grad_dtype).float()
        ref.step()
    for p_got, p_ref in zip(got[0], params, strict=True):
        torch.testing.assert_close(p_got.detach(), p_ref.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kwargs", KWARGS)
def test_bf16_state_matches_the_torch_reference(kwargs) -> None:
    """The C kernel against the torch fallback (torch ops + stochastic_round_bf16)."""
    native = _train(
        eo.available_isas()[-1], state_dtype=torch.bfloat16, grad_dtype=torch.float16, kwargs=kwargs
    )
    ref = _train("torch", state_dtype=torch.bfloat16, grad_dtype=torch.float16, kwargs=kwargs)
    for p_n, p_r in zip(native[0], ref[0], strict=True):
        torch.testing.assert_close(p_n.detach(), p_r.detach(), rtol=0, atol=1e-6)
    for s_n, s_r in zip(native[1], ref[1], strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            # The fp32 values may differ by an ulp (division vs reciprocal, adam.c), which
            # can move a stochastic rounding across one bf16 step: at most one bf16 ulp.
            torch.testing.assert_close(s_n[key].float(), s_r[key].float(), rtol=2**-7, atol=1e-30)


def test_stochastic_rounding_is_unbiased_and_brackets_the_value() -> None:
    x = torch.tensor([1.0 + 2**-9, -3.0 - 2**-10, 0.1, 1e-30, 2.0**-140], dtype=torch.float32)
    down = x.to(torch.bfloat16)  # nearest; the two neighbours bracket x
    draws = torch.stack([eo.stochastic_round_bf16(x, which=0, seed=s).float() for s in range(4000)])
    lo = torch.minimum(draws.min(0).values, down.float())
    hi = torch.maximum(draws.max(0).values, down.float())
    assert torch.all(lo <= x) and torch.all(x <= hi)
    assert draws.unique(dim=0).shape[0] > 1  # it does round both ways
    # unbiased: the mean of the draws is x (to within sampling error of 4000 draws)
    spread = (hi - lo).clamp_min(1e-45)
    assert torch.all((draws.mean(0) - x).abs() <= 0.05 * spread)


def test_stochastic_rounding_keeps_exact_and_special_values() -> None:
    x = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), float("nan")])
    out = eo.stochastic_round_bf16(x, which=1, seed=12345)
    assert torch.equal(out[:6].float(), x[:6])
    assert out[:2].float().signbit().tolist() == [False, True]
    assert out[6].view(torch.int16).item() == 0x7FC0


def test_bf16_second_moment_keeps_decaying() -> None:
    """With beta2 = 0.999 round-to-nearest would freeze v (v * 0.999 == v in bf16)."""
    p = torch.nn.Parameter(torch.zeros(4096))
    p.grad_dtype = torch.float16
    opt = eo.Adam([p], lr=1e-3, betas=(0.9, 0.999), state_dtype=torch.bfloat16)
    p.grad = torch.ones(4096, dtype=torch.float16)
    opt.step()
    v0 = opt.state[p]["exp_avg_sq"].float().mean().item()
    for _ in range(200):
        p.grad = torch.zeros(4096, dtype=torch.float16)
        opt.step()
    v = opt.state[p]["exp_avg_sq"].float().mean().item()
    assert v == pytest.approx(v0 * 0.999**200, rel=0.02)


def test_state_dict_round_trip_and_dtype_conversion() -> None:
    params = [torch.nn.Parameter(torch.randn(37)) for _ in range(2)]
    opt = eo.Adam(params, lr=1e-2, state_dtype=torch.bfloat16)
    for p in params:
        p.grad = torch.randn(37)
    opt.step()
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    back = eo.Adam(clone, lr=1e-2, state_dtype=torch.bfloat16)
    # deep copies: torch's load_state_dict keeps the step tensors of the dict it is given
    back.load_state_dict(copy.deepcopy(opt.state_dict()))
    fp32 = eo.Adam([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    fp32.load_state_dict(copy.deepcopy(opt.state_dict()))  # bf16 moments widened
    for o in (opt, back, fp32):
        for p in o.param_groups[0]["params"]:
            p.grad = torch.ones(37)
        o.step()
    for a, b in zip(params, clone, strict=True):
        assert torch.equal(a, b)
    assert fp32.state[fp32.param_groups[0]["params"][0]]["exp_avg"].dtype == torch.float32


def test_bad_state_options_are_rejected() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match="state_dtype must be"):
        eo.Adam([p], state_dtype=torch.float16)
    with pytest.raises(ConfigError, match="amsgrad=True needs state_dtype=torch.float32"):
        eo.Adam([p], amsgrad=True, state_dtype=torch.bfloat16)
