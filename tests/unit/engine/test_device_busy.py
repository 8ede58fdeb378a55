"""Each device's busy time and finished jobs (engine.device.device_busy, BusyReader), on
cpu:3: what the worker's metrics report as each GPU's share of a job."""

from __future__ import annotations

import time

import torch
from torch import nn

from engine import RoundPipe, RoundPipeRunConfig
from engine.device import BusyReader, DeviceManager, device_busy, get_devices
from engine.timer import IterTimer, ModelTimer

SLEEP_S = 0.02


def _timed_sleep(dev: DeviceManager, timer: IterTimer) -> None:
    with dev.compute(), timer.time([0]):
        time.sleep(SLEEP_S)


def test_busy_time_goes_to_the_device_that_ran_the_block(cpu3: int) -> None:
    devices = get_devices()
    reader = BusyReader()
    counts = [1, 3, 2]  # jobs per device
    timers = []
    jobs = []
    for dev, n in zip(devices, counts, strict=True):
        for _ in range(n):
            timer = IterTimer(ModelTimer([1.0]), "fwd", is_cuda=False)
            timers.append(timer)
            jobs.append(dev.submit(_timed_sleep, timer))
    for job in jobs:
        job.done.wait(10)
    for timer in timers:
        timer.flush()
    window = reader.read()
    assert [b.device for b in window] == [d.name for d in devices]
    assert [b.jobs for b in window] == counts
    for b, n in zip(window, counts, strict=True):
        assert n * SLEEP_S <= b.busy_s < n * SLEEP_S + 0.2, b
    # The next window starts where this one ended; the totals keep counting.
    assert all(b.busy_s == 0 and b.jobs == 0 for b in reader.read())
    assert [b.jobs for b in device_busy()] == counts


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def test_a_runs_shares_are_positive_and_add_up_to_its_compute(cpu3: int) -> None:
    """A RoundPipe run on three virtual devices: every device computed, the jobs are the
    plan's, and the busy seconds add up to the wall time of the calls less what is not
    layer compute (virtual CPU devices compute one at a time, under one lock)."""
    torch.manual_seed(0)
    width, rows = 384, 768
    model = nn.Sequential(*(_Block(width) for _ in range(6)))
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    x, y = torch.randn(rows, width), torch.randn(rows, width)

    def loss_fn(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return ((out - label) ** 2).mean()

    rp.forward_backward((x,), label=y, loss_fn=loss_fn)  # warm-up
    reader = BusyReader()
    started = time.perf_counter()
    for _ in range(2):
        rp.forward_backward((x,), label=y, loss_fn=loss_fn)
    wall_s = time.perf_counter() - started
    window = reader.read()
    assert len(window) == 3 and all(b.busy_s > 0 and b.jobs > 0 for b in window), window
    busy_s = sum(b.busy_s for b in window)
    # 0.83-0.88 of the wall time on a 2-core VM: the rest is transfers and Python.
    assert 0.6 * wall_s < busy_s <= wall_s, (busy_s, wall_s)
