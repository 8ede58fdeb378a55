"""The engine's correctness tests on CUDA: streams, events and pinned transfers included."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from tests.unit.engine._models import make_batch, make_model
from tests.unit.engine.test_roundpipe import MIXED_PLAN, _accumulate, mse_over

pytestmark = pytest.mark.gpu

RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("num_microbatch", [1, 2, 4, 5])
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("plan", ["auto", "mixed"])
def test_forward_backward_matches_plain_pytorch_cuda(
    cuda_devices: int, num_microbatch: int, grain: str, plan: str
) -> None:
    model = make_model().eval()
    ref = copy.deepcopy(model).cuda()
    x, y = make_batch()
    ref_loss = ((ref(x.cuda()) - y.cuda()) ** 2).mean()
    ref_loss.backward()
    cfg = RoundPipeRunConfig(
        num_microbatch=num_microbatch,
        recompute_grain=grain,
        execute_plan=MIXED_PLAN if plan == "mixed" else None,
    )
    rp = RoundPipe(model, model_run_config=cfg)
    loss = rp.forward_backward((x,), label=y, loss_fn=mse_over(num_microbatch))
    rp.synchronize()
    torch.testing.assert_close(loss, ref_loss.detach().cpu(), rtol=RTOL, atol=ATOL)
    for (name, p), (_, q) in zip(rp.model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad.cpu(), rtol=RTOL, atol=ATOL, msg=name)


def test_forward_then_backward_cuda(cuda_devices: int) -> None:
    model = make_model().eval()
    ref = copy.deepcopy(model).cuda()
    x, y = make_batch()
    xr = x.cuda().requires_grad_(True)
    ((ref(xr) - y.cuda()) ** 2).mean().backward()
    xp = x.clone().requires_grad_(True)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=4))
    out = rp(xp)
    ((out - y) ** 2).mean().backward()
    rp.synchronize()
    torch.testing.assert_close(xp.grad, xr.grad.cpu(), rtol=RTOL, atol=ATOL)
    for (name, p), (_, q) in zip(rp.model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad.cpu(), rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("is_async", [False, True])
def test_steps_cuda(cuda_devices: int, is_async: bool) -> None:
    model = make_model().eval()
    ref = copy.deepcopy(model).cuda()
    scratch = copy.deepcopy(model).cuda()
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=4))
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    batches = [make_batch(seed=100 + k) for k in range(5)]
    for x, y in batches:
        rp.forward_backward((x,), label=y, loss_fn=mse_over(4))
        rp.step(step_fn, is_async=is_async)
    rp.synchronize()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    prev = [p.detach().clone() for p in ref.parameters()]
    for x, y in batches:
        src = prev if is_async else [p.detach() for p in ref.parameters()]
        with torch.no_grad():
            for s, w in zip(scratch.parameters(), src, strict=True):
                s.copy_(w)
        scratch.zero_grad()
        _accumulate(scratch, x.cuda(), y.cuda(), 4)
        prev = [p.detach().clone() for p in ref.parameters()]
        for p, s in zip(ref.parameters(), scratch.parameters(), strict=True):
            p.grad = s.grad.clone()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, p), (_, q) in zip(rp.model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p, q.cpu(), rtol=1e-4, atol=1e-5, msg=name)


def test_no_grad_forward_cuda(cuda_devices: int) -> None:
    model = make_model().eval()
    ref = copy.deepcopy(model).cuda()
    x, _ = make_batch()
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=4))
    with torch.no_grad():
        out = rp(x, roundpipe_run_config=RoundPipeRunConfig(output_device="cuda:0"))
        assert out.device == torch.device("cuda", 0)
        torch.testing.assert_close(out, ref(x.cuda()), rtol=RTOL, atol=ATOL)


def test_half_model_fp32_master_cuda(cuda_devices: int) -> None:
    """fp16 model, fp32 optimizer weights: gradients within fp16 rounding of the fp32 oracle."""
    model = make_model().eval()
    ref = copy.deepcopy(model).cuda()
    x, y = make_batch()
    ((ref(x.cuda()) - y.cuda()) ** 2).mean().backward()
    rp = RoundPipe(
        model.half(),
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=4),
    )
    assert all(p.dtype == torch.float32 for p in rp.optim_parameters())
    rp.forward_backward(
        (x.half(),),
        label=y.half(),
        loss_fn=lambda o, lab: ((o.float() - lab.float()) ** 2).mean() / 4,
    )
    rp.synchronize()
    for (name, p), (_, q) in zip(rp.model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad.float(), q.grad.cpu(), rtol=2e-2, atol=2e-3, msg=name)


def test_gpu_memory_bounded_by_plan(cuda_devices: int) -> None:
    """48 layers of 16 MiB each: GPU memory in use stays at a few layer groups, not the model."""
    torch.manual_seed(0)
    layers = [nn.Linear(2048, 2048) for _ in range(48)]
    model = nn.Sequential(*layers)
    one_group = ModelExecutePlan.from_ranges(
        [range(i, i + 2) for i in range(0, 48, 2)], [range(i, i + 2) for i in range(44, -1, -2)]
    )
    rp = RoundPipe(
        model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=one_group)
    )
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(64, 2048)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    rp.forward_backward((x,), label=None, loss_fn=lambda o, _: o.float().pow(2).mean())
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < model_bytes / 4, (peak, model_bytes)
