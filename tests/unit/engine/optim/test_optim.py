"""engine.optim.Adam against torch.optim.Adam / AdamW, across ISA paths and thread counts."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import engine.optim as eo
from engine.errors import ConfigError
from engine.optim import _native

STEPS = 10
SMALL_SIZES = (1, 7, 4097)
BIG = 1_000_003


@pytest.fixture(autouse=True)
def _default_settings() -> Iterator[None]:
    yield
    eo.set_isa(None)
    eo.set_num_threads(None)


def _params(sizes: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in sizes]


def _groups(params: list[torch.nn.Parameter], split: int, lr: float) -> list[dict[str, Any]]:
    """Two param groups, the second with its own lr and weight decay."""
    return [
        {"params": params[:split]},
        {"params": params[split:], "lr": lr * 0.5, "weight_decay": 0.05},
    ]


def _run_pair(
    sizes: tuple[int, ...], kwargs: dict[str, Any], *, steps: int = STEPS, scheduler: bool = False
) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer, list, list]:
    """Train the same params with engine.optim.Adam and the torch oracle on equal grads."""
    init = _params(sizes, seed=0)
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    split = max(1, len(sizes) - 1)
    opt = eo.Adam(_groups(ours, split, kwargs["lr"]), **kwargs)
    if kwargs.get("decoupled_weight_decay"):
        oracle_kwargs = {k: v for k, v in kwargs.items() if k != "decoupled_weight_decay"}
        ref = torch.optim.AdamW(_groups(theirs, split, kwargs["lr"]), **oracle_kwargs)
    else:
        ref = torch.optim.Adam(_groups(theirs, split, kwargs["lr"]), **kwargs)
    scheds = []
    if scheduler:
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.3) for o in (opt, ref)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for a, b in zip(ours, theirs, strict=True):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for s in scheds:
            s.step()
    return opt, ref, ours, theirs


def _assert_same_state(opt: torch.optim.Optimizer, ref: torch.optim.Optimizer, ours, theirs):
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
        sa, sb = opt.state[a], ref.state[b]
        assert float(sa["step"]) == float(sb["step"])
        assert sa["step"].dtype == sb["step"].dtype
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert (key in sa) == (key in sb), key
            if key in sa:
                torch.testing.assert_close(sa[key], sb[key], rtol=1e-6, atol=1e-6)


HYPER_GRID = [
    {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8},
    {"lr": 0.1, "betas": (0.5, 0.9), "eps": 1e-3},
    {"lr": 3e-2, "betas": (0.0, 0.0), "eps": 1e-6},  # lerp's large-weight branch
    {"lr": 1e-2, "betas": (0.7, 0.99), "eps": 1e-8},  # lerp weight 0.3 rounds near 0.3f
]
FLAG_GRID = [
    {"weight_decay": wd, "amsgrad": ams, "maximize": mx, "decoupled_weight_decay": dec}
    for wd, ams, mx, dec in itertools.product(
        (0.0, 0.1), (False, True), (False, True), (False, True)
    )
]


@pytest.mark.parametrize(
    "flags", FLAG_GRID, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items())
)
@pytest.mark.parametrize("hyper", HYPER_GRID, ids=lambda h: f"lr{h['lr']}-b{h['betas']}")
def test_matches_torch_adam_grid(hyper: dict[str, Any], flags: dict[str, Any]) -> None:
    opt, ref, ours, theirs = _run_pair(SMALL_SIZES, {**hyper, **flags})
    _assert_same_state(opt, ref, ours, theirs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 1e-3},
        {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True, "maximize": True},
        {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True},
    ],
)
def test_matches_torch_adam_big(kwargs: dict[str, Any]) -> None:
    opt, ref, ours, theirs = _run_pair((7, BIG), kwargs, steps=3)
    _assert_same_state(opt, ref, ours, theirs)


def test_lr_scheduler_changes_lr_between_steps() -> None:
    opt, ref, ours, theirs = _run_pair(SMALL_SIZES, {"lr": 0.05}, scheduler=True)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.3**3)
    _assert_same_state(opt, ref, ours, theirs)


def test_tensor_lr_and_betas() -> None:
    kwargs = {"lr": torch.tensor(0.01), "betas": (torch.tensor(0.8), torch.tensor(0.95))}
    init = _params((33,), seed=3)
    a, b = torch.nn.Parameter(init[0].clone()), torch.nn.Parameter(init[0].clone())
    opt, ref = eo.Adam([a], **kwargs), torch.optim.Adam([b], **kwargs)
    for i in range(4):
        g = torch.full((33,), 0.1 * (i + 1)) * init[0]
        a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)


def _train_native(isa: str, threads: int, sizes: tuple[int, ...], copy_dtype, kwargs):
    eo.set_isa(isa)
    eo.set_num_threads(threads)
    params = [torch.nn.Parameter(t) for t in _params(sizes, seed=5)]
    copies = []
    for p in params:
        copy = torch.empty(p.numel(), dtype=copy_dtype) if copy_dtype is not None else None
        eo.set_model_copy(p, copy)
        copies.append(copy)
    opt = eo.Adam(params, **kwargs)
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    states = [opt.state[p] for p in params]
    return params, copies, states


ISA_KWARGS = [
    {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True, "maximize": True},
    {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True, "betas": (0.2, 0.5)},
]
TAIL_SIZES = (*range(1, 34), 4097)


@pytest.mark.parametrize("kwargs", ISA_KWARGS)
@pytest.mark.parametrize("copy_dtype", [None, torch.float16, torch.bfloat16])
def test_isa_paths_agree_bitwise(kwargs: dict[str, Any], copy_dtype) -> None:
    isas = eo.available_isas()
    assert "scalar" in isas
    expected = _train_native("scalar", 1, TAIL_SIZES, copy_dtype, kwargs)
    for isa in isas:
        got = _train_native(isa, 1, TAIL_SIZES, copy_dtype, kwargs)
        for p_exp, p_got in zip(expected[0], got[0], strict=True):
            assert torch.equal(p_exp, p_got), isa
        for s_exp, s_got in zip(expected[2], got[2], strict=True):
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in s_exp:
                    assert torch.equal(s_exp[key], s_got[key]), (isa, key)
        if copy_dtype is not None:
            for p, c in zip(got[0], got[1], strict=True):
                # the half copy is the fp32 master cast down, bit for bit
                assert torch.equal(c.view(torch.int16), p.detach().to(copy_dtype).view(torch.int16))


def test_big_tensor_copy_and_threads_bitwise() -> None:
    best = eo.available_isas()[-1]
    kwargs = ISA_KWARGS[0]
    one = _train_native(best, 1, (BIG,), torch.bfloat16, kwargs)
    many = _train_native(best, 3, (BIG,), torch.bfloat16, kwargs)
    assert torch.equal(one[0][0], many[0][0])
    assert torch.equal(one[1][0].view(torch.int16), many[1][0].view(torch.int16))
    assert torch.equal(many[1][0], many[0][0].detach().to(torch.bfloat16))
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert torch.equal(one[2][0][key], many[2][0][key])


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("copy_dtype", [torch.float16, torch.bfloat16])
def test_copy_cast_edge_values(isa: str, copy_dtype: torch.dtype) -> None:
    if isa not in eo.available_isas():
        pytest.skip(f"CPU has no {isa}")
    eo.set_isa(isa)
    special = [
        1e-40,
        -1e-40,
        1e-45,
        5.96e-8,
        2.98023223876953125e-08,
        2.99e-08,
        6.1e-5,
        65504.0,
        65519.0,
        65520.0,
        -70000.0,
        1.0000001,
        3.3895314e38,
        float("inf"),
    ]
    gen = torch.Generator().manual_seed(7)
    x = torch.cat(
        [
            torch.tensor(special),
            torch.randn(301, generator=gen) * 1e-6,
            torch.randn(301, generator=gen) * 1e4,
        ]
    )
    p = torch.nn.Parameter(x.clone())
    copy = torch.empty(p.numel(), dtype=copy_dtype)
    eo.set_model_copy(p, copy)
    opt = eo.Adam([p], lr=0.0)  # lr 0 keeps the master exact: only the cast is tested
    p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    assert torch.equal(p.detach(), x)
    assert torch.equal(copy.view(torch.int16), x.to(copy_dtype).view(torch.int16))


def test_torch_fallback_is_exact_torch() -> None:
    eo.set_isa("torch")
    _, _, ours, theirs = _run_pair(SMALL_SIZES, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True})
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_params_without_grad_are_skipped_and_closure_runs() -> None:
    a, b = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(5))
    opt = eo.Adam([a, b], lr=0.1)
    a.grad = torch.ones(5)
    calls = []
    assert opt.step(lambda: calls.append(1) or 3.0) == 3.0
    assert calls == [1]
    assert torch.all(a < 1) and torch.equal(b.detach(), torch.ones(5))
    assert b not in opt.state or len(opt.state[b]) == 0


def test_state_dict_round_trips_with_torch() -> None:
    kwargs = {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}
    opt, ref, ours, theirs = _run_pair(SMALL_SIZES, kwargs, steps=4)
    # ours -> torch and torch -> ours, then both continue: still the same trajectory
    ours_in_torch = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    theirs_in_ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    torch_opt = torch.optim.Adam(_groups(ours_in_torch, 2, 0.01), **kwargs)
    torch_opt.load_state_dict(opt.state_dict())
    our_opt = eo.Adam(_groups(theirs_in_ours, 2, 0.01), **kwargs)
    our_opt.load_state_dict(ref.state_dict())
    assert our_opt.state_dict()["param_groups"] == ref.state_dict()["param_groups"]
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        for a, b in zip(ours_in_torch, theirs_in_ours, strict=True):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        torch_opt.step()
        our_opt.step()
    _assert_same_state(our_opt, torch_opt, theirs_in_ours, ours_in_torch)


def test_state_dict_round_trip_is_exact() -> None:
    opt, _, ours, _ = _run_pair(SMALL_SIZES, {"lr": 0.01}, steps=2)
    clone = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt2 = eo.Adam(_groups(clone, 2, 0.01), lr=0.01)
    opt2.load_state_dict(opt.state_dict())
    for a, b in zip(ours, clone, strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[a][key], opt2.state[b][key])


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"lr": -1.0}, "lr must be >= 0"),
        ({"eps": -1e-8}, "eps must be >= 0"),
        ({"betas": (1.0, 0.9)}, "betas[0] must be in [0, 1)"),
        ({"betas": (0.9, -0.1)}, "betas[1] must be in [0, 1)"),
        ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
        ({"differentiable": True}, "differentiable"),
        ({"capturable": True}, "capturable"),
    ],
)
def test_bad_hyperparameters_raise(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace(")", r"\)")):
        eo.Adam([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_bad_group_hyperparameter_names_the_group() -> None:
    with pytest.raises(ConfigError, match=r"param_groups\[1\]\.lr"):
        eo.Adam(
            [
                {"params": [torch.nn.Parameter(torch.zeros(2))]},
                {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": -0.5},
            ]
        )


# bf16 parameters are their own masters since issue 35 (test_optim_compact.py).
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_non_fp32_param_is_rejected(dtype: torch.dtype) -> None:
    with pytest.raises(ConfigError, match="fp32"):
        eo.Adam([torch.nn.Parameter(torch.zeros(3, dtype=dtype))])


def test_bad_grad_and_copy_are_rejected() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    opt = eo.Adam([p])
    if hasattr(p, "grad_dtype"):  # torch >= 2.10 lets a grad differ in dtype only if asked
        p.grad_dtype = None
        p.grad = torch.zeros(4, dtype=torch.float64)  # fp16 and bf16 grads are accepted
        with pytest.raises(ConfigError, match="fp32, fp16 or bf16"):
            opt.step()
    p.grad = None
    with pytest.raises(ConfigError, match="float16 or torch.bfloat16"):
        eo.set_model_copy(p, torch.zeros(4))
    with pytest.raises(ConfigError, match="elements"):
        eo.set_model_copy(p, torch.zeros(5, dtype=torch.float16))
    with pytest.raises(ConfigError, match="contiguous"):
        eo.set_model_copy(p, torch.zeros(4, 2, dtype=torch.float16)[:, 0])
    eo.set_model_copy(p, torch.zeros(4, dtype=torch.float16))
    eo.set_model_copy(p, None)
    assert eo.get_model_copy(p) is None


def test_settings_validate() -> None:
    with pytest.raises(ConfigError, match="isa must be one of"):
        eo.set_isa("sse9")
    with pytest.raises(ConfigError, match="positive integer"):
        eo.set_num_threads(0)
    eo.set_num_threads(3)
    assert eo.get_num_threads() == 3


def test_env_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RP_ADAM_THREADS", "5")
    monkeypatch.setenv("RP_ADAM_ISA", "scalar")
    assert eo.get_num_threads() == 5
    assert eo.get_isa() == "scalar"
    monkeypatch.setenv("RP_ADAM_ISA", "nope")
    with pytest.raises(ConfigError, match="RP_ADAM_ISA"):
        eo.get_isa()


def test_native_info() -> None:
    info = eo.native_info()
    assert info["isa"] in eo.available_isas()
    assert info["threads"] == eo.get_num_threads() >= 1
    assert info["origin"] in ("install", "cache")
    assert info["library"]
    assert 1 <= eo.physical_cores() <= (os.cpu_count() or 1)


def test_cache_build_once(tmp_path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setenv("RP_ADAM_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="engine.optim._native"):
        first = _native._build_into_cache()
    assert first.origin == "cache" and first.built_now
    assert first.path.startswith(str(tmp_path))
    assert any("compiled into" in r.getMessage() for r in caplog.records)
    second = _native._build_into_cache()
    assert not second.built_now and second.path == first.path
    key_dir = tmp_path / f"{_native.cpu_flags_hash()}-{_native.source_hash()}"
    assert key_dir.is_dir()


def test_missing_compiler_names_what_to_install(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RP_ADAM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(eo.NativeBuildError, match="apt-get install build-essential") as info:
        _native._build_into_cache()
    assert "no-such-cc" in str(info.value)
    assert "set_isa('torch')" in str(info.value)  # the opt-in fallback is named, not taken
