"""engine.GradScaler against torch.amp.GradScaler on a scripted run of good and bad grads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch

import engine.optim as eo
from engine.errors import ConfigError, StepError
from engine.grad_scaler import GradScaler
from engine.optim_stream import launch_optim_kernel, on_optim_stream, synchronize_optim

INF, NAN = float("inf"), float("nan")
# Per step: None = finite grads, else a value planted in one gradient.
SCRIPT = [None, None, None, INF, None, NAN, None, None, None, None, -INF, None, None, None]
OPTIONS = {"init_scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.25, "growth_interval": 3}
SIZES = (5, 17)


@pytest.fixture(autouse=True)
def _drain_optimizer_thread() -> Iterator[None]:
    yield
    try:
        synchronize_optim()
    except StepError:
        pass


def _grads(step: int, bad: float | None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    grads = [torch.randn(n, generator=gen) for n in SIZES]
    if bad is not None:
        grads[step % 2][3] = bad
    return grads


def _torch_run() -> tuple[list[float], list[bool], list[torch.Tensor], dict]:
    params = [torch.nn.Parameter(torch.ones(n)) for n in SIZES]
    opt = torch.optim.Adam(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **OPTIONS)
    scales, stepped = [], []
    for i, bad in enumerate(SCRIPT):
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, _grads(i, bad), strict=True):
            p.grad = scaler.scale(g)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        stepped.append(not torch.equal(before[0], params[0].detach()))
    return scales, stepped, [p.detach() for p in params], scaler.state_dict()


def _ours_run(
    launch_step: Callable[[GradScaler, torch.optim.Optimizer], None],
) -> tuple[list[float], list[bool], list[torch.Tensor], GradScaler]:
    params = [torch.nn.Parameter(torch.ones(n)) for n in SIZES]
    opt = eo.Adam(params, lr=0.1)
    scaler = GradScaler(**OPTIONS)
    scales, stepped = [], []
    for i, bad in enumerate(SCRIPT):
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, _grads(i, bad), strict=True):
            p.grad = scaler.scale(g)  # waits for the previous update
        launch_step(scaler, opt)
        scaler.update()
        scales.append(scaler.get_scale())
        synchronize_optim()
        stepped.append(not torch.equal(before[0], params[0].detach()))
    return scales, stepped, [p.detach() for p in params], scaler


def _step_from_main(scaler: GradScaler, opt: torch.optim.Optimizer) -> None:
    assert scaler.step(opt) is None


def _step_on_optimizer_thread(scaler: GradScaler, opt: torch.optim.Optimizer) -> None:
    def step_fn() -> None:
        assert on_optim_stream()
        scaler.step(opt)
        opt.zero_grad()

    launch_optim_kernel(step_fn)  # async, as RoundPipe.step(step_fn) does


def _unscale_clip_step(scaler: GradScaler, opt: torch.optim.Optimizer) -> None:
    def step_fn() -> None:
        scaler.unscale_(opt)
        scaler.step(opt)

    launch_optim_kernel(step_fn)


@pytest.mark.parametrize(
    "launch_step", [_step_from_main, _step_on_optimizer_thread, _unscale_clip_step]
)
def test_same_decisions_as_torch(launch_step) -> None:
    exp_scales, exp_stepped, exp_params, exp_state = _torch_run()
    scales, stepped, params, scaler = _ours_run(launch_step)
    assert stepped == exp_stepped
    assert scales == exp_scales
    assert exp_stepped.count(False) == 3 and len(set(exp_scales)) > 2  # the script bites
    for got, exp in zip(params, exp_params, strict=True):
        torch.testing.assert_close(got, exp, rtol=0, atol=1e-6)
    assert scaler.state_dict() == exp_state


def test_get_scale_adapts_to_thread() -> None:
    scaler = GradScaler(init_scale=4.0, growth_interval=1)
    p = torch.nn.Parameter(torch.ones(3))
    opt = eo.Adam([p])
    seen: list[float] = []

    def step_fn() -> None:
        scaler.step(opt)
        scaler.update()  # on the optimizer thread: runs inline
        seen.append(scaler.get_scale())

    p.grad = scaler.scale(torch.ones(3))
    launch_optim_kernel(step_fn)
    synchronize_optim()
    assert seen == [8.0]
    assert scaler.get_scale() == 8.0
    assert float(scaler.scale(torch.ones(()))) == 8.0


def test_scale_waits_for_the_pending_update() -> None:
    scaler = GradScaler(init_scale=2.0, growth_interval=1)
    p = torch.nn.Parameter(torch.ones(3))
    opt = eo.Adam([p])
    gate = threading.Event()
    p.grad = scaler.scale(torch.ones(3))
    launch_optim_kernel(gate.wait)  # hold the optimizer thread
    launch_optim_kernel(scaler.step, opt)
    scaler.update()
    assert not scaler.scaler_updated.is_set()
    result: list[float] = []
    reader = threading.Thread(target=lambda: result.append(float(scaler.scale(torch.ones(())))))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()  # blocked until the update has run
    gate.set()
    reader.join(5)
    assert result == [4.0]


def test_new_scale_and_state_dict_round_trip() -> None:
    scaler = GradScaler(**OPTIONS)
    src = torch.tensor(32.0)
    scaler.update(src)
    src.fill_(1.0)  # copied at the call: later changes do not leak in
    assert scaler.get_scale() == 32.0
    scaler.update(16)
    assert scaler.get_scale() == 16.0
    state = scaler.state_dict()
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(state)
    assert theirs.get_scale() == 16.0 and theirs.get_growth_interval() == 3
    other = GradScaler()
    other.load_state_dict(state)
    assert other.get_scale() == 16.0
    assert other.get_growth_interval(up_to_date=True) == 3
    assert other.get_backoff_factor() == 0.25


def test_setters_apply_in_order() -> None:
    scaler = GradScaler()
    scaler.set_growth_factor(3.0)
    scaler.set_backoff_factor(0.1)
    scaler.set_growth_interval(7)
    assert scaler.get_growth_factor(up_to_date=True) == 3.0
    assert scaler.get_backoff_factor(up_to_date=True) == 0.1
    assert scaler.get_growth_interval(up_to_date=True) == 7


def test_disabled_is_a_pass_through() -> None:
    scaler = GradScaler(enabled=False)
    p = torch.nn.Parameter(torch.ones(3))
    opt = eo.Adam([p], lr=0.1)
    out = torch.ones(2)
    assert scaler.scale(out) is out
    assert scaler.get_scale() == 1.0
    p.grad = torch.full((3,), INF)
    scaler.unscale_(opt)
    scaler.step(opt)  # no inf check when disabled: the step runs
    scaler.update()
    assert not torch.isfinite(p).all()
    assert scaler.state_dict() == {}
    assert not scaler.is_enabled()


def test_update_without_step_reports_and_does_not_hang() -> None:
    scaler = GradScaler()
    scaler.update()  # torch raises: no inf checks recorded; here on the optimizer thread
    with pytest.raises(StepError, match="No inf checks"):
        synchronize_optim()
    assert scaler.scaler_updated.wait(1.0)
    assert scaler.get_scale() == 2.0**16


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"init_scale": 0.0}, "init_scale"),
    ],
)
def test_bad_factors_raise(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        GradScaler(**kwargs)
