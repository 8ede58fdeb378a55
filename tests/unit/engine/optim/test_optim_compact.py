"""engine.optim.Adam's compact mode (issue 35): bf16 parameters as their own masters and
8-bit block-wise moments, every ISA path against the torch reference of the same
arithmetic (engine.optim._q8.exact_update), bit for bit."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import engine.optim as eo
from engine.errors import ConfigError
from engine.optim import _q8

# Odd sizes: SIMD tails of both widths, partial 8-bit blocks, and a multi-chunk tensor.
SIZES = (1, 17, 255, 257, 1000, 4097)
BIG = 1_000_003
KWARGS = [
    {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.1, "decoupled_weight_decay": True},
    {"lr": 3e-3, "betas": (0.6, 0.95), "weight_decay": 0.05, "maximize": True},  # L2
]


@pytest.fixture(autouse=True)
def _default_settings() -> Iterator[None]:
    yield
    eo.set_isa(None)
    eo.set_num_threads(None)


def _train(
    isa: str,
    *,
    param_dtype: torch.dtype = torch.bfloat16,
    grad_dtype: torch.dtype = torch.bfloat16,
    kwargs: dict[str, Any] = KWARGS[0],
    sizes: tuple[int, ...] = SIZES,
    threads: int = 1,
    steps: int = 3,
) -> tuple[list[torch.nn.Parameter], list[dict[str, Any]]]:
    eo.set_isa(isa)
    eo.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(param_dtype)) for n in sizes]
    for p in params:
        p.grad_dtype = None  # any gradient dtype
    opt = eo.Adam(params, state_dtype=torch.uint8, **kwargs)
    for _ in range(steps):
        for p in params:
            scale = torch.logspace(-6, 0, p.numel()) * 1e-2  # moments over many decades
            p.grad = (torch.randn(p.shape, generator=gen) * scale).to(grad_dtype)
        opt.step()
    return params, [opt.state[p] for p in params]


def _assert_same(a: tuple[Any, Any], b: tuple[Any, Any], what: str) -> None:
    for p, q in zip(a[0], b[0], strict=True):
        assert p.dtype == q.dtype
        assert torch.equal(p.detach().view(torch.uint8), q.detach().view(torch.uint8)), what
    for s, t in zip(a[1], b[1], strict=True):
        assert s["exp_avg"].dtype == torch.uint8
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
            assert torch.equal(s[key], t[key]), (what, key)


def test_maps_are_the_dynamic_trees() -> None:
    signed, unsigned = _q8.QMAP[0:256], _q8.QMAP[512:768]
    for values in (signed, unsigned):
        assert torch.all(values[1:] >= values[:-1])
        assert values[-1] == 1.0
    assert signed[0] == -1.0 and unsigned[0] == 0.0
    assert signed[_q8.SIGNED_ZERO_CODE] == 0.0
    assert signed[signed > 0].min() == pytest.approx(1e-6) and len(signed.unique()) == 255
    assert unsigned[unsigned > 0].min() == pytest.approx(1e-7) and len(unsigned.unique()) == 256


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_picks_the_nearest_value(signed: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5000, generator=gen) * torch.logspace(-8, 0, 5000)
    x = x if signed else x.abs()
    codes, absmax = _q8.quantize(x, signed=signed)
    got = _q8.dequantize(codes, absmax, signed=signed)
    table = _q8.QMAP[0:256] if signed else _q8.QMAP[512:768]
    scale = absmax.repeat_interleave(_q8.QBLOCK)[: x.numel()]
    best = (table[None, :] * scale[:, None] - x[:, None]).abs().min(dim=1).values
    err = (got - x).abs()
    tiny = (~signed) & (x > 0) & (codes == 1)  # raised from 0 on purpose
    assert torch.all((err <= best * (1 + 1e-6) + 1e-30) | tiny)
    assert not signed or torch.all(got[x == 0] == 0)
    if not signed:
        assert torch.all(got[x > 0] > 0)  # no positive second moment becomes zero


@pytest.mark.parametrize("kwargs", KWARGS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_isa_paths_match_exact_reference(kwargs: dict[str, Any], grad_dtype) -> None:
    expected = _train("torch", kwargs=kwargs, grad_dtype=grad_dtype)
    for isa in eo.available_isas():
        _assert_same(expected, _train(isa, kwargs=kwargs, grad_dtype=grad_dtype), isa)


def _on_thresholds(thresholds: torch.Tensor) -> torch.Tensor:
    """Every finite threshold, its float neighbours, and 1.0 (the block absmax) per block."""
    t = thresholds[torch.isfinite(thresholds)]
    values = torch.cat(
        [t, torch.nextafter(t, torch.tensor(-2.0)), torch.nextafter(t, torch.tensor(2.0))]
    )
    values = values[values.abs() <= 1.0]
    blocks = values.split(_q8.QBLOCK - 1)
    return torch.cat([torch.cat([b, torch.ones(1)]) for b in blocks])


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_codes_on_and_next_to_every_threshold_match_reference(isa: str) -> None:
    """The C encoder guesses a code and corrects it with one threshold (csrc/adam.c
    q8_encode): moments on each threshold and one ulp either side get the reference's code.
    beta1 = beta2 = 0 makes exp_avg = grad and exp_avg_sq = grad**2 exactly enough."""
    if isa not in eo.available_isas():
        pytest.skip(f"{isa} not available here")
    m_target = _on_thresholds(_q8.QMAP[256:512])
    v_target = _on_thresholds(_q8.QMAP[768:1024])
    grads = [m_target, -m_target, v_target.sqrt()]
    results = []
    for path in ("torch", isa):
        eo.set_isa(path)
        params = [torch.nn.Parameter(torch.zeros(g.numel())) for g in grads]
        opt = eo.Adam(params, lr=1e-3, betas=(0.0, 0.0), state_dtype=torch.uint8)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        results.append((params, [opt.state[p] for p in params]))
    _assert_same(results[0], results[1], isa)
    codes = torch.cat([s["exp_avg"] for s in results[1][1][:2]]).unique()
    assert codes.numel() == 255  # every signed code (255 and 254 are both 1.0) was hit


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_big_tensor_matches_exact_reference(isa: str) -> None:
    if isa not in eo.available_isas():
        pytest.skip(f"CPU has no {isa}")
    expected = _big_reference()
    _assert_same(expected, _train(isa, sizes=(BIG,), steps=2, threads=2), isa)


_BIG_REFERENCE: list[Any] = []


def _big_reference() -> Any:
    if not _BIG_REFERENCE:
        _BIG_REFERENCE.append(_train("torch", sizes=(BIG,), steps=2))
    return _BIG_REFERENCE[0]


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_fp32_params_with_8bit_moments_match_reference(isa: str) -> None:
    if isa not in eo.available_isas():
        pytest.skip(f"CPU has no {isa}")
    common = {"param_dtype": torch.float32, "grad_dtype": torch.float32, "sizes": SIZES[:5]}
    _assert_same(_train("torch", **common), _train(isa, **common), isa)


def test_threads_do_not_change_results() -> None:
    best = eo.available_isas()[-1]
    one = _train(best, sizes=(BIG, 300_001), threads=1)
    many = _train(best, sizes=(BIG, 300_001), threads=3)
    _assert_same(one, many, "threads")


def test_state_bytes_per_parameter() -> None:
    params, states = _train(eo.available_isas()[-1], sizes=(BIG,), steps=1)
    nbytes = sum(t.nbytes for k, t in states[0].items() if k != "step")
    assert nbytes == 2 * BIG + 2 * 4 * _q8.num_blocks(BIG)
    assert params[0].dtype == torch.bfloat16  # the master: no other copy


def test_resume_from_state_dict_is_bit_identical() -> None:
    eo.set_isa(eo.available_isas()[-1])
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(1000, generator=gen).to(torch.bfloat16) for _ in range(6)]

    def run(p: torch.nn.Parameter, opt: eo.Adam, steps: list[torch.Tensor]) -> None:
        for g in steps:
            p.grad = g
            opt.step()

    p = torch.nn.Parameter(torch.randn(1000, generator=gen).to(torch.bfloat16))
    opt = eo.Adam([p], lr=1e-2, state_dtype=torch.uint8)
    run(p, opt, grads[:3])
    saved_p, saved_opt = p.detach().clone(), copy.deepcopy(opt.state_dict())
    run(p, opt, grads[3:])
    q = torch.nn.Parameter(saved_p.clone())
    opt2 = eo.Adam([q], lr=1e-2, state_dtype=torch.uint8)
    opt2.load_state_dict(saved_opt)
    run(q, opt2, grads[3:])
    assert torch.equal(p.view(torch.int16), q.view(torch.int16))
    for key in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
        assert torch.equal(opt.state[p][key], opt2.state[q][key]), key


def test_fp32_state_dict_loads_into_8bit_and_back() -> None:
    """A state dict of the fp32 mode is quantized on the next 8-bit step and back."""
    p = torch.nn.Parameter(torch.randn(600))
    ref = torch.nn.Parameter(p.detach().clone())
    grad = torch.randn(600)
    p.grad, ref.grad = grad, grad.clone()
    exact = eo.Adam([ref], lr=1e-3)
    full = eo.Adam([p], lr=1e-3)
    for opt in (exact, full):
        opt.step()
    compact = eo.Adam([p], lr=1e-3, state_dtype=torch.uint8)
    compact.load_state_dict(full.state_dict())
    compact.step()
    assert compact.state[p]["exp_avg"].dtype == torch.uint8
    back = eo.Adam([p], lr=1e-3)
    back.load_state_dict(compact.state_dict())
    back.step()
    exact.step()
    exact.step()
    assert back.state[p]["exp_avg"].dtype == torch.float32
    assert "exp_avg_absmax" not in back.state[p]
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(back.state[p][key], exact.state[ref][key], rtol=0.05, atol=1e-3)


def test_stochastic_rounding_keeps_small_updates_of_bf16_params() -> None:
    """An update far below half a bf16 ulp: round-to-nearest would freeze the weight; the
    stochastic rounding moves it by the right amount on average."""
    eo.set_isa(eo.available_isas()[-1])
    p = torch.nn.Parameter(torch.ones(20000, dtype=torch.bfloat16))
    opt = eo.Adam([p], lr=1e-4, state_dtype=torch.uint8)  # |update| ~ lr; ulp(1) = 2**-7
    for _ in range(50):
        p.grad = torch.ones(20000, dtype=torch.bfloat16)
        opt.step()
    assert p.float().mean().item() == pytest.approx(1 - 50 * 1e-4, abs=2e-4)


def test_bf16_param_takes_no_model_copy() -> None:
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    eo.set_model_copy(p, torch.zeros(4, dtype=torch.bfloat16))
    p.grad = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="own master"):
        eo.Adam([p], state_dtype=torch.uint8).step()


@pytest.mark.parametrize("permute", [0, 1], ids=["gather", "permute"])
def test_both_avx512_table_lookups_match_the_reference(permute: int) -> None:
    """The AVX-512 path looks its 8-bit tables up by gathers or by permutes, whichever the
    first Q8 step timed faster on this CPU (_native.q8_lookup); both must give the
    reference's bits, so both are forced here after that timing has run."""
    from engine.optim import _native

    if "avx512" not in eo.available_isas():
        pytest.skip("CPU has no avx512")
    lib = _native.load().lib
    assert _native.q8_lookup(lib) in ("permute", "gather")  # timed once, flag set
    chosen = lib.rp_adam_get_q8_permute()
    assert chosen == (_native.q8_lookup(lib) == "permute")
    try:
        lib.rp_adam_set_q8_permute(permute)
        expected = _train("torch")
        _assert_same(expected, _train("avx512"), f"permute={permute}")
        _assert_same(_big_reference(), _train("avx512", sizes=(BIG,), steps=2, threads=2), "big")
        assert lib.rp_adam_get_q8_permute() == permute  # no step re-timed it
    finally:
        lib.rp_adam_set_q8_permute(chosen)
