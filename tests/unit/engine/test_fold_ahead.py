"""The fold during the backward (engine.fold_ahead, issue 44): each call's gradients have
their sums of squares kept as they land, so the clip's norm finds them done; where the
optimizer-side gradient would be a plain copy of the download, the step hands the download
over as a deferred copy (engine.optim._deferred) and engine.optim.Adam reads it in place,
else (the copy was read by a step_fn before, or deferring is off) the copy is made then too.

The oracle is the same training with the model's `_fold_ahead` switch off and nothing
deferred (the fold's copy and the norm in the step, as before): every loss, clip norm,
weight and gradient bit for bit, in every host memory mode, with LoRA, several virtual
devices, a tied weight, gradient accumulation and a step_fn that changes the gradients
before the norm. The counts say the fast path was taken: each trainable gradient summed
once per call and handed over deferred (or copied ahead) by the step, every sum kept; a
spy says no gradient was summed or copied before its download had landed.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import engine.optim as eo
from engine import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from engine.attribute import ParamAttribute
from engine.fold_ahead import fold_ahead_of_step
from engine.optim import _deferred, _native, _sumsq

from ._models import make_batch, make_model, tied_qwen3_roundpipe
from .test_step_staleness import MODES, PLAN, _bits, _loss, _model

CLIP = 1e-3  # below every norm here: the clip coefficient (from the norm) changes each update
COPIED = ("fp32", "fp32-masters")  # modes with an optimizer-side gradient; the others read in place


def _trainable(rp: RoundPipe) -> int:
    return sum(1 for _ in rp.optim_parameters())


def copy_every_gradient(rp: Any) -> None:
    """Defer no copy (the path before engine.optim._deferred): what a step_fn that reads
    `.grad` leaves behind after its first step."""
    for _, pa in rp._all_params():
        pa.defer_copy = False


def _train(
    model: nn.Module,
    *,
    fold_ahead: bool | str,
    defer: bool = True,
    calls_per_step: int = 1,
    steps: int = 3,
    scale_grads: bool = False,
    **rp_kwargs: Any,
) -> dict[str, Any]:
    """`steps` steps of `calls_per_step` calls each, then one more call whose gradients
    synchronize() hands back: losses, clip norms, weights, gradients and the counters.
    `fold_ahead="first"`: the kernel only in each step's first call; `defer=False`: every
    gradient copied (`copy_every_gradient`)."""
    adam_kwargs = rp_kwargs.pop("adam_kwargs", {})
    rp = RoundPipe(
        model,
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=PLAN),
        pin_model="off",
        **rp_kwargs,
    )
    if not defer:
        copy_every_gradient(rp)
    params = list(rp.optim_parameters())
    opt = eo.Adam(params, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, **adam_kwargs)
    norms: list[float] = []
    kept: list[int] = []

    def step_fn() -> None:
        # as held: reading p.grad would make a deferred gradient's copy
        assert all(_deferred.stored(p) is not None for p in params)
        if scale_grads:  # a step_fn that changes the gradients: the kept sums no longer hold
            torch._foreach_mul_([p.grad for p in params], 0.5)
        kept.append(sum(_sumsq.kept(_deferred.stored(p)) is not None for p in params))
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)

    dtype = next(model.parameters()).dtype
    losses = []
    for k in range(steps * calls_per_step + 1):
        on = fold_ahead is True or (fold_ahead == "first" and k % calls_per_step == 0)
        object.__setattr__(rp, "_fold_ahead", on)
        x, y = make_batch(seed=300 + k)
        losses.append(float(rp.forward_backward((x.to(dtype),), label=y, loss_fn=_loss)))
        if (k + 1) % calls_per_step == 0 and k < steps * calls_per_step:
            rp.step(step_fn)
    # The steps are done (the last call waited for them); synchronize() copies what is pending.
    buffers = sum(pa.optim_grad_buffer is not None for _, pa in rp._all_params())
    rp.synchronize()
    out = {
        "losses": losses,
        "norms": norms,
        "weights": [_bits(p) for p in rp.model.parameters()],
        "grads": [_bits(p.grad) for p in rp.model.parameters() if p.grad is not None],
        "kept": kept,
        "folded_ahead": [p["folded_ahead"] for p in rp.step_phases],
        "deferred": [p["deferred"] for p in rp.step_phases],
        "buffers": buffers,
        "fold_calls": [p["params"] for p in rp.__dict__.get("fold_phases", ())],
        "trainable": _trainable(rp),
    }
    rp.close()
    return out


def _assert_same(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got["losses"] == expected["losses"]
    assert got["norms"] == expected["norms"]  # float equality: the same bits
    for key in ("weights", "grads"):
        assert len(got[key]) == len(expected[key]) > 0
        for i, (a, b) in enumerate(zip(got[key], expected[key], strict=True)):
            assert torch.equal(a, b), f"{key}[{i}]"


def _assert_fast_path(
    got: dict[str, Any], expected: dict[str, Any], mode: str, *, defer: bool = True
) -> None:
    n, steps = got["trainable"], len(got["norms"])
    assert got["kept"] == [n] * steps  # every norm from the kept sums
    assert expected["kept"] == [0] * steps and expected["fold_calls"] == []  # the old path
    assert expected["deferred"] == [0] * steps
    separate = n if mode in COPIED else 0
    # each gradient handed over deferred, or its copy taken by the step
    assert got["deferred"] == [separate if defer else 0] * steps
    assert got["folded_ahead"] == [0 if defer else separate] * steps
    assert got["fold_calls"] == [n] * len(got["losses"])  # once per call, none missed
    # deferred: no optimizer-side gradient buffer is ever allocated
    assert (got["buffers"], expected["buffers"]) == (0 if defer else separate, separate)


@pytest.fixture(autouse=True)
def _c_library() -> None:
    """The kept sums are the C library's: load it before the first step."""
    _native.load()
    assert eo.get_isa() != _native.TORCH_FALLBACK


def _with_and_without(
    mode: str, on: bool | str = True, *, defer: bool = True, **train_kwargs: Any
) -> list[Any]:
    """`_train` of the same `MODES[mode]` model with the kernel (`on`) and deferred copies
    (`defer`), and with neither."""
    dtype, rp_kwargs, adam_kwargs = MODES[mode]
    base = _model(dtype)
    return [
        _train(
            copy.deepcopy(base),
            fold_ahead=f,
            defer=d,
            adam_kwargs=adam_kwargs,
            **rp_kwargs,
            **train_kwargs,
        )
        for f, d in ((on, defer), (False, False))
    ]


def check_equal_to_the_fold_in_the_step(
    mode: str, *, defer: bool = True, **train_kwargs: Any
) -> None:
    """Train `MODES[mode]` with the kernel and without; the same bits, the fast path taken
    (also run by tests/gpu/test_fold_ahead_gpu.py)."""
    _native.load()
    runs = _with_and_without(mode, defer=defer, **train_kwargs)
    _assert_same(*runs)
    _assert_fast_path(*runs, mode, defer=defer)


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "copied"])
@pytest.mark.parametrize("mode", ["fp32", "fp32-masters", "12-byte", "compact"])
def test_staleness_zero_with_clip_equals_the_fold_in_the_step(
    cpu3: int, mode: str, defer: bool
) -> None:
    check_equal_to_the_fold_in_the_step(mode, defer=defer, step_staleness=0)


@pytest.mark.parametrize("staleness", [0, 1])
def test_gradient_accumulation_takes_the_last_calls_copy(num_devices: int, staleness: int) -> None:
    """Three calls per step on a bf16 model: each call's download adds to the bf16 buffer,
    so the copies of the first two calls are stale by the step; the third call's is taken."""
    check_equal_to_the_fold_in_the_step("fp32-masters", calls_per_step=3, step_staleness=staleness)


def test_a_later_call_without_the_kernel_makes_the_copy_stale(cpu3: int) -> None:
    """The kernel in each step's first call only (a later call overlapped, say): the later
    calls' downloads add to the buffer it copied, so the step folds again."""
    got, expected = _with_and_without("fp32-masters", "first", calls_per_step=2)
    _assert_same(got, expected)
    assert got["folded_ahead"] == [0] * 3 and got["kept"] == [0] * 3
    assert got["deferred"] == [got["trainable"]] * 3  # the download is the gradient still
    assert got["fold_calls"] == [got["trainable"]] * 4  # steps' first calls and the last


def test_lora_and_a_step_fn_that_scales_the_gradients(cpu3: int) -> None:
    """LoRA (only the adapters trainable); the step_fn halves every gradient before the
    norm: no kept sum holds then, and the norm is summed again in the step. Reading `.grad`
    makes the deferred copies in the first step; from the second on every copy is made while
    the backward runs again (ParamAttribute.defer_copy), as without deferring."""
    base = _model(torch.float32, lora=True)
    for scale in (False, True):
        got, expected = (
            _train(
                copy.deepcopy(base), fold_ahead=on, defer=on, scale_grads=scale, step_staleness=0
            )
            for on in (True, False)
        )
        _assert_same(got, expected)
        n = got["trainable"]
        assert 0 < n < sum(1 for _ in base.parameters())
        assert got["kept"] == [0 if scale else n] * 3
        if scale:
            assert (got["deferred"], got["folded_ahead"]) == ([n, 0, 0], [0, n, n])
        else:
            assert (got["deferred"], got["folded_ahead"]) == ([n] * 3, [0] * 3)


def test_tied_weight_on_three_devices(cpu3: int) -> None:
    """A tiny Qwen3 whose embedding is also its head (two downloads a call, the head's
    first): the copy waits for the second one."""
    check_tied_weight()


def check_tied_weight() -> None:
    """The tied tiny Qwen3 with the kernel and deferred copies, and with neither: the same
    losses, clip norms and weights; every gradient handed over deferred (also run by
    tests/gpu/test_fold_ahead_gpu.py)."""
    _native.load()
    results = []
    for on in (True, False):
        model, rp = tied_qwen3_roundpipe(torch.bfloat16, step_staleness=0)
        object.__setattr__(rp, "_fold_ahead", on)
        if not on:
            copy_every_gradient(rp)
        params = list(rp.optim_parameters())
        opt = eo.Adam(params, lr=1e-2)
        norms: list[float] = []

        def step_fn(opt: eo.Adam = opt, norms: list[float] = norms) -> None:
            norms.append(float(opt.clip_grad_norm_(CLIP)))
            opt.step()
            opt.zero_grad()

        g = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(3):
            ids = torch.randint(0, 64, (8, 16), generator=g)
            losses.append(float(_lm_call(rp, ids)))
            rp.step(step_fn)
        rp.synchronize()
        phases = [(p["deferred"], p["folded_ahead"]) for p in rp.step_phases]
        weights = [_bits(p) for p in model.parameters()]
        results.append((losses, norms, weights, phases, len(params)))
        rp.close()
    (losses, norms, weights, phases, n), (losses0, norms0, weights0, _, _) = results
    assert losses == losses0 and norms == norms0
    assert all(torch.equal(a, b) for a, b in zip(weights, weights0, strict=True))
    assert phases == [(n, 0)] * 3


def _lm_call(rp: Any, ids: torch.Tensor) -> torch.Tensor:
    from engine.models import causal_lm_loss_fn

    return rp.forward_backward(
        input_kwargs={"input_ids": ids, "return_logits": False},
        label=ids,
        loss_fn=causal_lm_loss_fn(ids),
    )


# layers 0-2 in the call's last backward job
GATED_PLAN = ModelExecutePlan.from_ranges(
    [range(0, 3), range(3, 5), range(5, 7)], [range(3, 5), range(0, 3)]
)


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "copied"])
def test_no_gradient_is_copied_before_its_download_lands(
    cpu3: int, monkeypatch: pytest.MonkeyPatch, defer: bool
) -> None:
    """The second call of a step (accumulating) holds its last backward job (layers 0-2)
    until the fold kernel has summed (and, not deferring, copied) every later layer's
    gradient and stopped: each it took must have seen its buffer's final version (the
    download had landed), and each trainable gradient is taken once a call."""
    import engine.roundpipe

    gate = threading.Event()
    seen: list[tuple[ParamAttribute, int]] = []
    real_fold_ahead = ParamAttribute.fold_ahead

    def spying(self: ParamAttribute) -> torch.Tensor | None:
        host = self.grad_host
        seen.append((self, -1 if host is None else host._version))
        return real_fold_ahead(self)

    real_backward_job = engine.roundpipe.backward_job
    later = [0]  # trainable parameters of layers 3-6
    reached = []  # the kernel had copied them all while layers 0-2 were held

    def gated_backward_job(dev: Any, run: Any, bwd_id: int) -> None:
        if bwd_id == len(run.plan.bwd_plan) - 1 and not gate.is_set():
            deadline = time.monotonic() + 10.0
            while len(seen) < later[0] and time.monotonic() < deadline:
                time.sleep(0.01)
            reached.append(len(seen) == later[0])
            time.sleep(0.05)  # a kernel that would not wait copies layers 0-2 now
            gate.set()
        real_backward_job(dev, run, bwd_id)

    monkeypatch.setattr(ParamAttribute, "fold_ahead", spying)
    monkeypatch.setattr(engine.roundpipe, "backward_job", gated_backward_job)
    rp = RoundPipe(
        make_model(p_drop=0.0),
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=GATED_PLAN),
        pin_model="off",
        step_staleness=0,
    )
    if not defer:
        copy_every_gradient(rp)
    owned = rp._params_by_owner()
    later[0] = sum(pa.optim is not None for params in owned[3:] for _, pa in params)
    n = _trainable(rp)
    x, y = make_batch(seed=1)
    gate.set()
    rp.forward_backward((x,), label=y, loss_fn=_loss)  # the step's first call
    seen.clear()
    gate.clear()
    rp.forward_backward((x,), label=y, loss_fn=_loss)  # held up; adds to the first
    assert reached == [True]
    assert len(seen) == n and len({id(pa) for pa, _ in seen}) == n
    for pa, version in seen:
        assert pa.grad_host is not None and version == pa.grad_host._version
        # deferring, the sum is kept with the download (the copy's, else)
        summed = pa.grad_host if defer else pa.optim_grad_buffer
        assert summed is not None and _sumsq.kept(summed) is not None
    opt = eo.Adam(list(rp.optim_parameters()), lr=1e-2)
    rp.step(lambda: (opt.step(), opt.zero_grad()))
    rp.synchronize()
    assert rp.step_phases[-1]["deferred" if defer else "folded_ahead"] == n
    rp.close()


def test_no_kernel_with_the_switch_off(cpu3: int) -> None:
    """`_fold_ahead` off is the old path: no kernel queued, no stats kept (data parallel's
    kernel, the reduction during the backward, is tested with its ranks:
    tests/integration/test_distributed.py)."""
    rp = RoundPipe(make_model(p_drop=0.0), pin_model="off")
    try:
        object.__setattr__(rp, "_fold_ahead", False)
        assert fold_ahead_of_step(rp, None) is None  # type: ignore[arg-type]
        assert "fold_phases" not in rp.__dict__
    finally:
        rp.close()
