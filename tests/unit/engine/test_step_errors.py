"""An exception inside step_fn reaches the caller as a RuntimeError, and training goes on.

The oracle is the same model trained with plain PyTorch and torch.optim.SGD on the same
batches: after a failed step (synchronous or asynchronous), the RoundPipe model's weights
follow it exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from engine import RoundPipe, RoundPipeRunConfig, StepError

from ._models import make_batch, make_model

LR = 0.05
MICROBATCHES = 2


def _loss(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((out - label) ** 2).mean()


class Boom(ValueError):
    pass


def _broken() -> None:
    raise Boom("optimizer exploded")


def _mb_loss(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    # forward_backward sums the micro-batch losses: equal halves of the batch mean
    return _loss(out, label) / MICROBATCHES


def _reference_step(ref: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x, y = make_batch(batch=8, seed=seed)
    _loss(ref(x), y).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("is_async", [False, True])
def test_step_fn_error_is_a_runtime_error_and_training_continues(is_async: bool, cpu3: int) -> None:
    ref = make_model(p_drop=0.0)
    rp = RoundPipe(
        copy.deepcopy(ref), model_run_config=RoundPipeRunConfig(num_microbatch=MICROBATCHES)
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    rp_opt = torch.optim.SGD(rp.optim_parameters(), lr=LR)

    def good() -> None:
        rp_opt.step()
        rp_opt.zero_grad()

    def train(seed: int, step_fn: Callable[[], None]) -> None:
        x, y = make_batch(batch=8, seed=seed)
        rp.forward_backward((x,), label=y, loss_fn=_mb_loss)
        rp.step(step_fn, is_async=False)  # the reference has no stale weights

    train(1, good)
    _reference_step(ref, ref_opt, 1)

    # The failed step's gradients stay in the optimizer-side .grad, as a failed
    # torch optimizer.step() leaves them in .grad: drop them on both sides.
    x, y = make_batch(batch=8, seed=2)
    rp.forward_backward((x,), label=y, loss_fn=_mb_loss)
    caught: RuntimeError | None = None
    try:
        rp.step(_broken, is_async=is_async)
        if is_async:  # surfaces at the next call that waits for the optimizer
            rp.synchronize()
    except RuntimeError as exc:  # the plain handler a training loop has
        caught = exc
    assert isinstance(caught, StepError)
    assert isinstance(caught.__cause__, Boom)
    assert "optimizer exploded" in str(caught)
    rp.zero_grad()

    for seed in (3, 4):
        train(seed, good)
        _reference_step(ref, ref_opt, seed)
    rp.synchronize()
    got = dict(rp.model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name].detach(), p.detach(), rtol=1e-5, atol=1e-6)
