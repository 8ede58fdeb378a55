"""Double-buffered weights (RoundPipe double_buffer_weights, engine.accel.weight_buffers): the C
Adam writes the half-precision weights into a second host copy and the next step publishes
by swapping the two.

The oracle is the same training without the second copy (the step converting the fp32
masters into the model): every loss, gradient and weight bit for bit, with calls one after
the other and overlapped. A copy that does not hold the master's present value (another
optimizer, a master changed after the update) must not be swapped in.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import engine.optim as eo
from engine import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from engine.attribute import ParamAttribute
from engine.planning.allocation_check import check_engine_allocation
from engine.planning.memory_plan import (
    ModelShape,
    RunShape,
    plan_host_memory,
)
from tests.unit.engine._models import make_batch, make_model
from tests.unit.engine.accel.test_replay import assert_same

DTYPE = torch.bfloat16
GROUPED = ModelExecutePlan.from_ranges(
    [range(0, 3), range(3, 5), range(5, 7)], [range(3, 5), range(1, 3), range(0, 1)]
)


def mse(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((out.float() - label.float()) ** 2).mean()


def half_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(t.to(DTYPE) for t in make_batch(seed=k)) for k in range(steps)]  # type: ignore[misc]


def bf16_roundpipe(
    plan: ModelExecutePlan, num_microbatch: int, *, overlap: bool, double: bool
) -> tuple[nn.Module, RoundPipe]:
    """A bf16 model with fp32 masters, and its RoundPipe."""
    model = make_model(p_drop=0.0).to(DTYPE)
    rp = RoundPipe(
        model,
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch, execute_plan=plan),
        overlap_calls=overlap,
        double_buffer_weights=double,
    )
    return model, rp


def train(
    *,
    double: bool,
    overlap: bool,
    steps: int = 4,
    step_fn_extra: Any = None,
    optimizer: str = "engine",
    plan: ModelExecutePlan = GROUPED,
) -> tuple[RoundPipe, list[torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A bf16 model, fp32 masters, Adam; returns the RoundPipe, the losses, the gradients at
    `synchronize()` and the trained weights."""
    model, rp = bf16_roundpipe(plan, 3, overlap=overlap, double=double)
    params = list(rp.optim_parameters())
    opt: torch.optim.Optimizer = (
        eo.Adam(params, lr=1e-2) if optimizer == "engine" else torch.optim.AdamW(params, lr=1e-2)
    )

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()
        if step_fn_extra is not None:
            step_fn_extra(params)

    losses = []
    data = half_batches(steps)
    for k, (x, y) in enumerate(data):
        losses.append(rp.forward_backward((x,), label=y, loss_fn=mse))
        if k + 1 < len(data):
            rp.step(step_fn)
    rp.synchronize()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    rp.step(step_fn)
    rp.synchronize()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return rp, losses, grads, weights


def assert_runs_equal(got: tuple[Any, ...], expected: tuple[Any, ...]) -> None:
    for a, b in zip(got[1], expected[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_same(got[2], expected[2])
    assert_same(got[3], expected[3])


@pytest.mark.parametrize("overlap", [False, True])
def test_swapped_weights_train_bit_for_bit_as_converted_ones(
    num_devices: int, overlap: bool
) -> None:
    got = train(double=True, overlap=overlap)
    expected = train(double=False, overlap=overlap)
    assert_runs_equal(got, expected)
    rp = got[0]
    params = sum(1 for _ in rp.optim_parameters())
    # Steps 2 and 3 publish on the optimizer thread (the first has nothing new, the last
    # follows a synchronize(), which published), swapping every parameter, none converted.
    published = [p for p in rp.step_phases if p["swapped"]]
    assert len(published) == 2
    assert all(p["swapped"] == params for p in published)
    assert not any(p["swapped"] for p in expected[0].step_phases)


def test_the_two_copies_alternate() -> None:
    """Each publish makes the parameter's storage the other buffer; the one it left is
    what the next update writes."""
    model = make_model(p_drop=0.0).to(DTYPE)
    rp = RoundPipe(model, optim_dtype=torch.float32, double_buffer_weights=True)
    opt = eo.Adam(rp.optim_parameters(), lr=1e-2)
    weight = model[0].weight
    x, y = half_batches(1)[0]
    ptrs = []
    for _ in range(4):
        rp.forward_backward((x,), label=y, loss_fn=mse)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        ptrs.append(weight.data_ptr())
    assert ptrs[0] != ptrs[1] and ptrs[0] == ptrs[2] and ptrs[1] == ptrs[3]
    master_param = ParamAttribute.get(weight).optim
    assert master_param is not None
    assert eo.get_model_copy(master_param).data_ptr() == ptrs[2]  # type: ignore[union-attr]
    assert torch.equal(weight.detach(), master_param.detach().to(DTYPE))


def test_a_master_changed_after_the_update_is_converted(num_devices: int) -> None:
    """step_fn changes one master after Adam wrote its copy: that copy is stale (the
    master's version moved) and the step converts the master instead."""

    def halve_first(params: list[nn.Parameter]) -> None:
        with torch.no_grad():
            params[0].mul_(0.5)

    got = train(double=True, overlap=True, step_fn_extra=halve_first)
    expected = train(double=False, overlap=True, step_fn_extra=halve_first)
    assert_runs_equal(got, expected)
    params = sum(1 for _ in got[0].optim_parameters())
    assert [p["swapped"] for p in got[0].step_phases if p["swapped"]] == [params - 1] * 2


def test_another_optimizer_trains_the_same_and_warns_once() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train(double=True, overlap=True, optimizer="torch")
    expected = train(double=False, overlap=True, optimizer="torch")
    assert_runs_equal(got, expected)
    texts = [str(w.message) for w in caught if "double_buffer_weights" in str(w.message)]
    assert len(texts) == 1 and "engine.optim.Adam" in texts[0]


# the first layers in a backward group of their own, the last job of a call
GATED_PLAN = ModelExecutePlan.from_ranges(
    [range(0, 3), range(3, 5), range(5, 7)], [range(3, 5), range(0, 3)]
)


def test_the_swap_waits_for_the_running_calls_uploads(
    cpu3: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call's last backward job (the first layers, which re-uploads them) is held up;
    the step must not swap those layers' new weights in before that upload, or the
    recompute would run with other weights than the forward did."""
    import engine.roundpipe

    gate = threading.Event()
    real_backward_job = engine.roundpipe.backward_job
    last_jobs = [0]

    def gated_backward_job(dev: Any, run: Any, bwd_id: int) -> None:
        if bwd_id == len(run.plan.bwd_plan) - 1:
            last_jobs[0] += 1
            if last_jobs[0] == 3:
                run.wait(gate)
        real_backward_job(dev, run, bwd_id)

    monkeypatch.setattr(engine.roundpipe, "backward_job", gated_backward_job)
    data = half_batches(3)
    results = []
    for double in (True, False):
        last_jobs[0] = 0
        gate.clear() if double else gate.set()
        model, rp = bf16_roundpipe(GATED_PLAN, 2, overlap=double, double=double)
        opt = eo.Adam(rp.optim_parameters(), lr=1e-2)

        def step_fn(opt: torch.optim.Optimizer = opt) -> None:
            opt.step()
            opt.zero_grad()

        losses = []
        for k, (x, y) in enumerate(data):
            losses.append(rp.forward_backward((x,), label=y, loss_fn=mse))
            rp.step(step_fn)  # the third call's step swaps w[2] in while its backward waits
            if double and k == 2:
                timer = threading.Timer(0.3, gate.set)
                timer.start()
        rp.synchronize()
        results.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    for a, b in zip(results[0][0], results[1][0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_same(results[0][1], results[1][1])


def test_tied_weights_on_eight_virtual_devices_swap_once() -> None:
    """A preset model with a tied embedding (the embedding's and the head's layer use one
    parameter): one swap, after both layers' uploads."""
    from tests.unit.engine._models import train_tied_qwen3
    from tests.unit.engine.conftest import use_devices

    for _ in use_devices("cpu:8", 8):
        rp, got_losses, got = train_tied_qwen3(
            eo.Adam, DTYPE, overlap_calls=True, double_buffer_weights=True
        )
        _, expected_losses, expected = train_tied_qwen3(
            eo.Adam, DTYPE, overlap_calls=True, double_buffer_weights=False
        )
    params = sum(1 for _ in rp.optim_parameters())
    assert max(p["swapped"] for p in rp.step_phases) == params
    assert got_losses == expected_losses
    assert_same(got, expected)


def test_only_trainable_half_parameters_get_a_second_copy() -> None:
    model = make_model(p_drop=0.0).to(DTYPE)
    model[1].requires_grad_(False)  # a frozen LayerNorm: no master, no second copy
    rp = RoundPipe(model, optim_dtype=torch.float32, double_buffer_weights=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    expected = sum(-(-p.numel() * 2 // 64) * 64 for p in trainable)
    assert rp.second_copy_bytes == expected
    fp32 = RoundPipe(make_model(p_drop=0.0), double_buffer_weights=True)
    assert fp32.second_copy_bytes == 0  # fp32 weights: the master is the model
    off = RoundPipe(make_model(p_drop=0.0).to(DTYPE), optim_dtype=torch.float32)
    assert off.second_copy_bytes == 0  # default: follows overlap_calls


def test_the_host_memory_checks_count_the_second_copy() -> None:
    model = make_model(p_drop=0.0).to(DTYPE)
    kwargs = dict(optim_dtype=torch.float32, optim_grad_dtype=None, pin_model="off")
    plain = check_engine_allocation(model, budget_bytes=1 << 40, **kwargs)  # type: ignore[arg-type]
    double = check_engine_allocation(
        model,
        budget_bytes=1 << 40,
        double_buffer_weights=True,
        **kwargs,  # type: ignore[arg-type]
    )
    half_bytes = sum(p.numel() * 2 for p in model.parameters())
    assert plain.parts["model_second_copy"] == 0
    assert double.parts["model_second_copy"] >= half_bytes
    assert double.total_bytes - plain.total_bytes == double.parts["model_second_copy"]
    from tests.tiny_models import tiny_config

    shape = ModelShape.from_config(tiny_config("qwen3", vocab_size=64))
    run = RunShape(tokens_per_step=64, seq_len=16)
    base = plan_host_memory(shape, run)
    more = plan_host_memory(shape, replace(run, double_buffer_weights=True))
    added = more.parts["model_second_copy"]
    assert more.total_bytes - base.total_bytes == added == shape.num_params * 2


def test_current_model_copy_follows_the_master() -> None:
    p = nn.Parameter(torch.randn(10))
    copy = torch.empty(10, dtype=DTYPE)
    eo.set_model_copy(p, copy)
    assert eo.current_model_copy(p) is None  # nothing written yet
    opt = eo.Adam([p], lr=1e-2)
    p.grad = torch.randn(10)
    opt.step()
    assert eo.current_model_copy(p) is copy
    assert torch.equal(copy, p.detach().to(DTYPE))
    with torch.no_grad():
        p.add_(1.0)  # changed after the update: the copy is stale
    assert eo.current_model_copy(p) is None
    opt.step()
    assert eo.current_model_copy(p) is copy
    eo.set_model_copy(p, torch.empty(10, dtype=DTYPE))  # a new buffer holds nothing yet
    assert eo.current_model_copy(p) is None
