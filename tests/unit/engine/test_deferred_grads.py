"""Deferred gradient copies in RoundPipe's step (engine.optim._deferred, issue 44).

Where the optimizer-side fp32 gradient would be a plain copy of the downloaded half-precision
one, the step hands the download over as a deferred copy: engine.optim.Adam reads it in
place, its sum of squares was kept with it while the backward ran (engine.fold_ahead), and
no fp32 gradient buffer is written or even allocated. A step_fn that reads `.grad` another
way gets the copy, made on that read, and from the next step on the copy is made while the
backward runs, as before.

The oracle is the same training with every gradient copied (the path before): losses, norms,
master and model weights and the gradients synchronize() hands back, bit for bit. Cases:
bf16 and fp16 models with fp32 masters; with the engine's clip, its norm alone, or neither;
staleness zero, one and the synchronous step; gradient accumulation over two calls; a
step_fn that keeps the gradient (no zero_grad); torch's AdamW; the GradScaler (its unscale
reads `.grad`: the C Adam does not take the loss scale).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
from torch import nn

import engine.optim as eo
from engine import GradScaler, RoundPipe, RoundPipeRunConfig
from engine.optim import _native

from ._models import make_batch, make_model
from .test_fold_ahead import copy_every_gradient
from .test_step_staleness import PLAN, _bits, _loss

CLIP = 1e-3  # below every norm here: the clip changes every update
STEPS = 3


def _train(
    model: nn.Module,
    *,
    defer: bool,
    kind: str,
    staleness: int = 0,
    is_async: bool = True,
    calls_per_step: int = 1,
    slow_s: float = 0.0,
) -> dict[str, Any]:
    """STEPS steps of `calls_per_step` calls, then one more call whose gradients synchronize()
    hands back. `kind` is the step_fn: "clip" (Adam.clip_grad_norm_), "norm" (Adam.grad_norm),
    "plain", "keep" (no zero_grad), "torch" (torch.optim.AdamW), "scaler" (GradScaler.step);
    `slow_s`: it sleeps that long first."""
    dtype = next(model.parameters()).dtype
    rp = RoundPipe(
        model,
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=PLAN),
        pin_model="off",
        step_staleness=staleness,
    )
    if not defer:
        copy_every_gradient(rp)
    params = list(rp.optim_parameters())
    opt: torch.optim.Optimizer
    if kind == "torch":
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    else:
        opt = eo.Adam(params, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    scaler = GradScaler(init_scale=2.0**10, growth_interval=1) if kind == "scaler" else None
    norms: list[float] = []

    def step_fn() -> None:
        time.sleep(slow_s)
        if kind == "clip":
            norms.append(float(opt.clip_grad_norm_(CLIP)))  # type: ignore[attr-defined]
        elif kind == "norm":
            norms.append(float(opt.grad_norm()))  # type: ignore[attr-defined]
        if scaler is not None:
            scaler.step(opt)
        else:
            opt.step()
        if kind != "keep":
            opt.zero_grad()

    def loss_fn(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        loss = _loss(out, label)
        return loss if scaler is None else scaler.scale(loss)

    losses, scales = [], []
    for k in range(STEPS * calls_per_step + 1):
        x, y = make_batch(seed=400 + k)
        losses.append(float(rp.forward_backward((x.to(dtype),), label=y, loss_fn=loss_fn)))
        if (k + 1) % calls_per_step == 0 and k < STEPS * calls_per_step:
            rp.step(step_fn, is_async=is_async)
            if scaler is not None:
                scaler.update()
                scales.append(scaler.get_scale())
    # The steps are done (the last call waited for them); synchronize() copies what is pending.
    buffers = sum(pa.optim_grad_buffer is not None for _, pa in rp._all_params())
    rp.synchronize()
    out = {
        "losses": losses,
        "norms": norms,
        "scales": scales,
        "masters": [_bits(p) for p in params],
        "weights": [_bits(p) for p in rp.model.parameters()],
        "grads": [_bits(p.grad) for p in rp.model.parameters() if p.grad is not None],
        "deferred": [p["deferred"] for p in rp.step_phases],
        "folded_ahead": [p["folded_ahead"] for p in rp.step_phases],
        "buffers": buffers,
        "trainable": len(params),
    }
    rp.close()
    return out


def _both(dtype: torch.dtype, kind: str, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same model trained with deferred copies and with every gradient copied; asserts
    the same bits and returns both runs."""
    _native.load()  # the sums kept while the backward runs are the C library's
    base = make_model(p_drop=0.0).to(dtype)
    got, expected = (
        _train(copy.deepcopy(base), defer=d, kind=kind, **kwargs) for d in (True, False)
    )
    for key in ("losses", "norms", "scales"):
        assert got[key] == expected[key], key  # float equality: the same bits
    for key in ("masters", "weights", "grads"):
        assert len(got[key]) == len(expected[key]) > 0
        for i, (a, b) in enumerate(zip(got[key], expected[key], strict=True)):
            assert torch.equal(a, b), f"{key}[{i}]"
    n = expected["trainable"]
    assert expected["deferred"] == [0] * STEPS and expected["buffers"] == n
    return got, expected


@pytest.fixture(autouse=True)
def _c_library() -> None:
    assert eo.get_isa() != _native.TORCH_FALLBACK


@pytest.mark.parametrize("kind", ["clip", "norm", "plain"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_c_adam_reads_every_download_in_place(cpu3: int, dtype: torch.dtype, kind: str) -> None:
    got, _ = _both(dtype, kind)
    n = got["trainable"]
    assert got["deferred"] == [n] * STEPS and got["folded_ahead"] == [0] * STEPS
    assert got["buffers"] == 0  # no fp32 gradient buffer was ever allocated


@pytest.mark.parametrize(
    ("staleness", "is_async"), [(0, True), (1, True), (1, False)], ids=["s0", "s1", "sync"]
)
def test_every_step_mode(cpu3: int, staleness: int, is_async: bool) -> None:
    got, _ = _both(torch.bfloat16, "clip", staleness=staleness, is_async=is_async)
    assert got["deferred"] == [got["trainable"]] * STEPS and got["buffers"] == 0


def test_the_next_calls_downloads_wait_for_a_slow_step_fn(cpu3: int) -> None:
    """Staleness one: the next call runs while step_fn sleeps; its gradient downloads must
    not overwrite the buffers the optimizer has yet to read (grad_copied waits for step_fn)."""
    got, _ = _both(torch.bfloat16, "clip", staleness=1, slow_s=0.2)
    assert got["deferred"] == [got["trainable"]] * STEPS


def test_gradient_accumulation_over_two_calls(num_devices: int) -> None:
    """The second call's download adds to the first's: the step hands the sum over."""
    got, _ = _both(torch.bfloat16, "clip", calls_per_step=2)
    assert got["deferred"] == [got["trainable"]] * STEPS and got["buffers"] == 0


def test_a_step_fn_that_keeps_the_gradient(cpu3: int) -> None:
    """No zero_grad: once step_fn has returned, the step copies the gradient it kept (the
    next download overwrites the buffer); the next steps add to that copy, as before."""
    got, _ = _both(torch.bfloat16, "keep")
    n = got["trainable"]
    assert got["deferred"] == [n, 0, 0] and got["buffers"] == n


@pytest.mark.parametrize(
    ("dtype", "kind"),
    [(torch.bfloat16, "torch"), (torch.float16, "scaler")],
    ids=["torch-adamw", "fp16-grad-scaler"],
)
def test_a_step_fn_that_reads_grad_gets_the_copy(cpu3: int, dtype: torch.dtype, kind: str) -> None:
    """torch's AdamW, or the GradScaler's unscale, reads `.grad`: the first step makes each
    copy on that read; from the second on it is made while the backward runs."""
    got, _ = _both(dtype, kind)
    n = got["trainable"]
    assert got["deferred"] == [n, 0, 0] and got["folded_ahead"] == [0, n, n]
    if kind == "scaler":
        assert got["scales"] == [2.0**11, 2.0**12, 2.0**13]  # every step went through
