"""Overlapped calls (RoundPipe overlap_calls): each forward_backward returns with its losses
while its backward jobs run on, and the next call's forward jobs start behind them.

The oracle is the same training without overlap (async steps, same plan): every loss,
gradient and weight bit for bit. The step must not publish new weights over a layer's host
copy before the call's backward has uploaded it (the recompute would see other weights
than the forward did), nor fold a gradient before it is down: a layer whose backward is
held up makes both waits happen.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from engine import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from engine.accel import graphs
from engine.errors import RoundPipeError
from tests.unit.engine._models import make_batch, make_model
from tests.unit.engine.accel import test_replay as replay_models
from tests.unit.engine.accel.test_replay import assert_same


def mse(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((out - label) ** 2).mean()


def run_steps(
    model: nn.Module,
    *,
    overlap: bool,
    steps: int = 4,
    num_microbatch: int = 3,
    grain: str = "stage",
    plan: ModelExecutePlan | None = None,
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    step_every: int = 1,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Losses, the gradients at `synchronize()` and the trained weights."""
    cfg = RoundPipeRunConfig(
        num_microbatch=num_microbatch, recompute_grain=grain, execute_plan=plan
    )
    rp = RoundPipe(model, optim_dtype=torch.float32, model_run_config=cfg, overlap_calls=overlap)
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    data = batches or [make_batch(seed=k) for k in range(steps)]
    losses = []
    torch.manual_seed(123)  # dropout draws, the same in both runs
    for k, (x, y) in enumerate(data):
        losses.append(rp.forward_backward((x,), label=y, loss_fn=mse))
        if (k + 1) % step_every == 0 and k + 1 < len(data):
            rp.step(step_fn)
    rp.synchronize()
    grads = {n: p.grad.clone() for n, p in rp.model.named_parameters() if p.grad is not None}
    rp.step(step_fn)
    rp.synchronize()
    weights = {n: p.detach().clone() for n, p in rp.model.named_parameters()}
    return losses, grads, weights


def assert_runs_equal(got: Any, expected: Any) -> None:
    for a, b in zip(got[0], expected[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_same(got[1], expected[1])
    assert_same(got[2], expected[2])


# Plans are pinned: automatic plans follow measured times, which overlapped calls report
# one call later, so the two runs would re-plan at different calls (and a layer moved to
# another group sums its gradient in another order).
GROUPED = ModelExecutePlan.from_ranges(
    [range(0, 3), range(3, 5), range(5, 7)], [range(3, 5), range(1, 3), range(0, 1)]
)
SPLIT_TAIL = ModelExecutePlan.from_ranges(
    [range(0, 2), range(2, 4), range(4, 7)], [range(2, 4), range(0, 2)], tail_split=2
)


@pytest.fixture
def cpu8() -> Iterator[int]:
    from tests.unit.engine.conftest import use_devices

    yield from use_devices("cpu:8", 8)


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("plan", ["grouped", "split_tail"])
def test_overlapped_training_is_bit_for_bit_the_same(
    num_devices: int, grain: str, plan: str
) -> None:
    execute_plan = SPLIT_TAIL if plan == "split_tail" else GROUPED
    got = run_steps(make_model(p_drop=0.0), overlap=True, grain=grain, plan=execute_plan)
    expected = run_steps(make_model(p_drop=0.0), overlap=False, grain=grain, plan=execute_plan)
    assert_runs_equal(got, expected)


def test_overlap_on_eight_virtual_devices_with_tied_weights(cpu8: int) -> None:
    """A preset model with a tied embedding (used by the first and the last layer) on 8
    devices, one-layer groups: the step publishes the tied weight only once the head's and
    the embedding's uploads are done."""
    from tests.unit.engine._models import train_tied_qwen3

    _, got_losses, got = train_tied_qwen3(torch.optim.AdamW, overlap_calls=True)
    _, expected_losses, expected = train_tied_qwen3(torch.optim.AdamW, overlap_calls=False)
    assert got_losses == expected_losses
    assert_same(got, expected)


def test_gradients_accumulate_over_overlapped_calls(num_devices: int) -> None:
    """Two calls per step (gradient accumulation): the second call's downloads add to the
    first call's gradients once those are down."""
    batches = [make_batch(seed=k) for k in range(6)]
    got = run_steps(
        make_model(p_drop=0.0), overlap=True, batches=batches, step_every=2, plan=GROUPED
    )
    expected = run_steps(
        make_model(p_drop=0.0), overlap=False, batches=batches, step_every=2, plan=GROUPED
    )
    assert_runs_equal(got, expected)


# the first layers in a backward group of their own, the last job of a call
GATED_PLAN = ModelExecutePlan.from_ranges(
    [range(0, 3), range(3, 5), range(5, 7)], [range(3, 5), range(0, 3)]
)


def test_a_call_returns_before_its_backward_and_the_step_waits_for_it(
    cpu3: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the call's last backward job (the first layers) held up before it starts,
    forward_backward still returns and the step is launched; that step's publish must wait
    for the held-up job's upload of the first layers (else their recompute would see the
    new weights) and its fold for their gradients; the result equals the same steps
    without overlap."""
    import engine.roundpipe

    gate = threading.Event()
    real_backward_job = engine.roundpipe.backward_job
    last_jobs = [0]  # last backward jobs started: the second call's is held up

    def gated_backward_job(dev: Any, run: Any, bwd_id: int) -> None:
        if bwd_id == len(run.plan.bwd_plan) - 1:
            last_jobs[0] += 1
            if last_jobs[0] == 2:
                run.wait(gate)  # outside the device's compute: other devices go on
        real_backward_job(dev, run, bwd_id)

    monkeypatch.setattr(engine.roundpipe, "backward_job", gated_backward_job)
    x, y = make_batch(seed=5)
    results = []
    for overlap in (True, False):
        last_jobs[0] = 0
        model = make_model(p_drop=0.0)
        rp = RoundPipe(
            model,
            optim_dtype=torch.float32,
            model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=GATED_PLAN),
            overlap_calls=overlap,
        )
        opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)

        def step_fn(opt: torch.optim.Optimizer = opt) -> None:
            opt.step()
            opt.zero_grad()

        gate.clear() if overlap else gate.set()
        rp.forward_backward((x,), label=y, loss_fn=mse)  # runs through; its step makes w[1]
        rp.step(step_fn)
        loss = rp.forward_backward((x,), label=y, loss_fn=mse)
        # With overlap this returned while the last backward job waits at the gate.
        rp.step(step_fn)
        if overlap:
            timer = threading.Timer(0.3, gate.set)
            timer.start()
        rp.synchronize()
        results.append((loss, {n: p.detach().clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    assert_same(results[0][1], results[1][1])


class Failing(nn.Module):
    """Fails in its backward (recompute) on the second call."""

    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from engine.context import doing_recompute

        if doing_recompute():
            Failing.calls += 1
            if Failing.calls > 2:
                raise ValueError("broken backward")
        return self.lin(x)


def test_an_overlapped_calls_backward_error_surfaces_later(cpu3: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Failing(), nn.Linear(16, 16), nn.Linear(16, 4))
    plan = ModelExecutePlan.from_ranges([range(0, 2), range(2, 4)], [range(0, 2)])
    Failing.calls = 0
    rp = RoundPipe(
        model,
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan),
        overlap_calls=True,
    )
    x, y = make_batch()
    rp.forward_backward((x,), label=y, loss_fn=mse)  # recomputes twice: fine
    rp.forward_backward((x,), label=y, loss_fn=mse)  # returns; its backward fails
    with pytest.raises((ValueError, RoundPipeError), match="broken backward"):
        rp.synchronize()


def test_overlap_and_replay_together(cpu3: int) -> None:
    saved = graphs.REPLAY_ON_CPU, graphs.ENABLED
    graphs.REPLAY_ON_CPU = graphs.ENABLED = True
    try:
        plan = replay_models.GROUPED
        got = run_steps(
            replay_models.make_model(), overlap=True, batches=_replay_batches(), plan=plan
        )
        graphs.ENABLED = False
        expected = run_steps(
            replay_models.make_model(), overlap=False, batches=_replay_batches(), plan=plan
        )
    finally:
        graphs.REPLAY_ON_CPU, graphs.ENABLED = saved
        graphs.drop_all_slots()
    assert_runs_equal(got, expected)


def _replay_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = replay_models.batch()
    return [(x + k, y) for k in range(4)]
