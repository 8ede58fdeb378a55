"""GradScaler driving a half-precision RoundPipe model: overflow skips the step and backs off."""

from __future__ import annotations

import torch
from torch import nn

from engine import GradScaler, RoundPipe, RoundPipeRunConfig


def _fp16_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).half()


def test_overflowing_scale_skips_the_step_then_training_resumes(cpu3: int) -> None:
    rp = RoundPipe(
        _fp16_model(),
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    # 2**24 times the fp16 loss overflows fp16 gradients (max 65504): the first steps must skip.
    scaler = GradScaler(init_scale=2.0**24, growth_interval=1000)
    x = torch.randn(8, 8).half()
    y = torch.randn(8, 4).half()

    def loss_fn(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return scaler.scale(((out.float() - label.float()) ** 2).mean()) / 2

    def step_fn() -> None:
        scaler.step(opt)
        opt.zero_grad()

    before = [p.detach().clone() for p in rp.optim_parameters()]
    scales = []
    for _ in range(12):
        rp.forward_backward((x,), label=y, loss_fn=loss_fn)
        rp.step(step_fn)
        scaler.update()
        scales.append(scaler.get_scale())
    rp.synchronize()
    after = list(rp.optim_parameters())
    # Backed off by 0.5 per overflowing step until the gradients were finite, then held
    # (growth_interval 1000) while the steps went through.
    skipped = sum(1 for a, b in zip([2.0**24, *scales], scales, strict=False) if b == a / 2)
    assert 1 <= skipped < len(scales)
    assert scales[:skipped] == [2.0 ** (24 - k) for k in range(1, skipped + 1)]
    assert all(s == scales[skipped - 1] for s in scales[skipped:])
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert all(torch.isfinite(p).all() for p in after)
