"""The worker's Meter: a step's event waits for its update and carries the learning rate
the optimizer thread read from the scheduler (not one recomputed beside it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine.device import get_devices
from engine.timer import IterTimer, ModelTimer
from rp_service.data.datasets import BatchOrder
from rp_service.worker.meter import Meter
from rp_service.worker.training import lr_factor
from tests.unit.engine.conftest import use_devices


def test_the_event_carries_the_schedulers_rate_once_the_update_ran() -> None:
    events: list[tuple[Any, ...]] = []
    meter = Meter(emit=lambda *a: events.append(a), total_steps=3, order=BatchOrder(8, 2, seed=0))
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=2e-3)

    def factor(step: int) -> float:
        return lr_factor(step, total_steps=3, warmup_steps=2, schedule="linear")

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    for step in (1, 2, 3):
        meter.record(step, loss=1.0, tokens=10)
        meter.flush()
        assert len(events) == step - 1  # not before its update
        rate = scheduler.get_last_lr()[0]  # what step_fn reads before optimizer.step()
        optimizer.step()
        scheduler.step()
        meter.updates.put((step, 0.5, rate, {"step_s": 0.25}))
        meter.flush()
    rates = [data["learning_rate"] for _, _, data in events]
    assert rates == [2e-3 * factor(k) for k in range(3)] == [1e-3, 2e-3, 2e-3]


@pytest.fixture
def cpu3() -> Iterator[int]:
    yield from use_devices("cpu:3", 3)


def test_the_event_carries_each_devices_share_of_the_step(cpu3: int) -> None:
    """`gpu_share`: every engine device, its busy seconds over the step's wall time and
    its finished jobs (here: one job of 30 ms on the second of three virtual devices)."""
    devices = get_devices()
    events: list[tuple[Any, ...]] = []
    meter = Meter(emit=lambda *a: events.append(a), total_steps=1, order=BatchOrder(8, 2, seed=0))
    timer = IterTimer(ModelTimer([1.0]), "fwd", is_cuda=False)

    def job(dev: Any) -> None:
        with dev.compute(), timer.time([0]):
            time.sleep(0.03)

    devices[1].submit(job).done.wait(10)
    timer.flush()
    meter.record(1, loss=1.0, tokens=10)
    meter.updates.put((1, 0.5, 1e-3, {"step_s": 0.25}))
    meter.flush()
    (share,) = [data["gpu_share"] for _, _, data in events]
    assert [s["device"] for s in share] == [d.name for d in devices]
    assert [s["jobs"] for s in share] == [0, 1, 0]
    assert share[0]["busy_fraction"] == share[2]["busy_fraction"] == 0.0
    assert share[1]["busy_s"] >= 0.03 and 0 < share[1]["busy_fraction"] <= 1.0
