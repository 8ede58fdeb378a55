"""Every ISA path of the C Adam (the vector kernel written once over a SIMD layer per ISA,
csrc/adam_vector.h, and the scalar path of csrc/adam.c) against the torch oracle of the
same arithmetic (engine.optim._q8.exact_update), bit for bit, in every mode: fp32/bf16
parameters, fp32/fp16/bf16 gradients, fp32/bf16/8-bit moments, fp16/bf16 model copies,
amsgrad, maximize, L2 and decoupled weight decay, at sizes that leave SIMD tails of
both widths and partial 8-bit blocks."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import engine.optim as eo
from engine.optim import _q8

SIZES = (1, 7, 15, 16, 17, 31, 33, 255, 257, 1000)
STEPS = 3
FLAGS = {
    "l2-maximize": {"lr": 3e-3, "betas": (0.6, 0.95), "weight_decay": 0.05, "maximize": True},
    # beta1 0.2: lerp's large-weight branch
    "decoupled": {
        "lr": 1e-2,
        "betas": (0.2, 0.5),
        "weight_decay": 0.1,
        "decoupled_weight_decay": True,
    },
    "amsgrad": {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True, "maximize": True},
}
F32, F16, BF16, U8 = torch.float32, torch.float16, torch.bfloat16, torch.uint8


def _modes() -> Iterator[Any]:
    """(param, grad, state, copy dtype, flags): every valid combination."""
    for param, grad, state, copy, flags in itertools.product(
        (F32, BF16), (F32, F16, BF16), (F32, BF16, U8), (None, F16, BF16), FLAGS
    ):
        if copy is not None and (param == BF16 or state == U8):
            continue  # a bf16 parameter is its own master; compact mode writes no copy
        if flags == "amsgrad" and state != F32:
            continue  # amsgrad needs fp32 moments
        name = "-".join(str(d).removeprefix("torch.") for d in (param, grad, state, copy))
        yield pytest.param(param, grad, state, copy, flags, id=f"{name}-{flags}")


@pytest.fixture(autouse=True)
def _default_settings() -> Iterator[None]:
    yield
    eo.set_isa(None)
    eo.set_num_threads(None)


def _problem(param_dtype: torch.dtype, grad_dtype: torch.dtype, sizes: tuple[int, ...]):
    """Initial parameters and the gradients of every step (moments over many decades)."""
    gen = torch.Generator().manual_seed(0)
    init = [(torch.randn(n, generator=gen) * 0.5).to(param_dtype) for n in sizes]
    grads = [
        [(torch.randn(n, generator=gen) * torch.logspace(-6, -1, n)).to(grad_dtype) for n in sizes]
        for _ in range(STEPS)
    ]
    return init, grads


def _native(isa: str, init, grads, state_dtype, copy_dtype, kwargs, threads: int = 1):
    eo.set_isa(isa)
    eo.set_num_threads(threads)
    params = [torch.nn.Parameter(t.clone()) for t in init]
    copies = []
    for p in params:
        p.grad_dtype = None  # any gradient dtype
        copy = None if copy_dtype is None else torch.empty(p.numel(), dtype=copy_dtype)
        eo.set_model_copy(p, copy)
        copies.append(copy)
    opt = eo.Adam(params, state_dtype=state_dtype, **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], copies, [opt.state[p] for p in params]


def _oracle(init, grads, state_dtype, copy_dtype, kwargs):
    """The same steps through exact_update, one tensor at a time."""
    params = [t.clone() for t in init]
    group = eo.Adam([torch.nn.Parameter(params[0])], **kwargs).param_groups[0]
    states = []
    for p in params:
        state = (
            _q8.zero_state(p)
            if state_dtype == U8
            else {
                "exp_avg": torch.zeros(p.shape, dtype=state_dtype),
                "exp_avg_sq": torch.zeros(p.shape, dtype=state_dtype),
            }
        )
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros(p.shape)
        states.append(state)
    for step, step_grads in enumerate(grads, start=1):
        h = eo._hyper_values(group, float(step))
        for p, g, state in zip(params, step_grads, states, strict=True):
            _q8.exact_update(p, g, state, h, eo.stochastic_round_bf16)
    copies = [None if copy_dtype is None else p.to(copy_dtype) for p in params]
    return params, copies, states


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_same(expected, got, what: str) -> None:
    for k, (p, q) in enumerate(zip(expected[0], got[0], strict=True)):
        assert p.dtype == q.dtype
        assert torch.equal(_bits(p), _bits(q)), (what, "param", SIZES[k] if k < len(SIZES) else k)
    for c, d in zip(expected[1], got[1], strict=True):
        assert (c is None) == (d is None)
        if c is not None:
            assert torch.equal(_bits(c), _bits(d)), (what, "model copy")
    for s, t in zip(expected[2], got[2], strict=True):
        for key, value in s.items():
            assert t[key].dtype == value.dtype, (what, key)
            assert torch.equal(_bits(value), _bits(t[key])), (what, key)


@pytest.mark.parametrize(("param", "grad", "state", "copy", "flags"), list(_modes()))
def test_every_isa_matches_the_oracle_bit_for_bit(param, grad, state, copy, flags) -> None:
    init, grads = _problem(param, grad, SIZES)
    kwargs = FLAGS[flags]
    expected = _oracle(init, grads, state, copy, kwargs)
    isas = eo.available_isas()
    assert "scalar" in isas
    for isa in isas:
        _assert_same(expected, _native(isa, init, grads, state, copy, kwargs), isa)


def test_big_odd_tensor_on_threads_matches_the_oracle() -> None:
    """1,000,003 elements: several of the kernel's chunks (threads claim them) and a tail."""
    init, grads = _problem(F32, F16, (1_000_003,))
    grads = grads[:2]
    kwargs = FLAGS["decoupled"]
    expected = _oracle(init, grads, BF16, BF16, kwargs)
    for isa in eo.available_isas():
        _assert_same(expected, _native(isa, init, grads, BF16, BF16, kwargs, threads=2), isa)


def test_vector_paths_are_built_where_the_cpu_has_them() -> None:
    """The vector kernel is compiled for each ISA the CPU has (a stub elsewhere): on x86 the
    dev and CI machines have AVX2 at least, so the shared kernel is exercised here."""
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    isas = eo.available_isas()
    assert ("avx2" in isas) == all(f in flags.split() for f in ("avx2", "fma", "f16c"))
    assert ("avx512" in isas) == ("avx512f" in flags.split())
