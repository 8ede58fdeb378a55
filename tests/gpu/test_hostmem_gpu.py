"""Issue 15 on CUDA: the in-place half gradient and the cudaHostRegister'ed arena train
bit-identically to the fp32 gradient buffer and torch-pinned parameters."""

from __future__ import annotations

import copy

import pytest
import torch

import engine.optim as eo
from engine import RoundPipe
from engine.attribute import ParamAttribute
from tests.unit.engine._models import make_batch, make_model

pytestmark = pytest.mark.gpu


def _mse(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((out.float() - label.to(out.device).float()) ** 2).mean()


def _train(rp: RoundPipe) -> None:
    opt = eo.Adam(list(rp.optim_parameters()), lr=1e-2, weight_decay=0.01)
    x, y = make_batch(batch=12)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(4):
        for c in range(2):
            rp.forward_backward((x[c::2].half(),), label=y[c::2], loss_fn=_mse)
        rp.step(step_fn)  # asynchronous: the next downloads wait for the whole step
    rp.synchronize()


def test_in_place_grads_and_arena_match_the_default_cuda(cuda_devices: int) -> None:
    base = make_model(p_drop=0.0).half()
    ref = RoundPipe(copy.deepcopy(base), optim_dtype=torch.float32, pin_model="alloc")
    got = RoundPipe(
        copy.deepcopy(base),
        optim_dtype=torch.float32,
        optim_grad_dtype=torch.float16,
        pin_model="arena",
    )
    for p in got.model.parameters():
        assert p.is_pinned() and ParamAttribute.get(p).grad_host.is_pinned()
    _train(ref)
    _train(got)
    for a, b in zip(ref.optim_parameters(), got.optim_parameters(), strict=True):
        assert torch.equal(a, b)
    for (_, a), (_, b) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        assert torch.equal(a, b)
