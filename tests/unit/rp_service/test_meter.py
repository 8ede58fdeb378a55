"""The worker's Meter: a step's event waits for its update and carries the learning rate
the optimizer thread read from the scheduler (not one recomputed beside it)."""

from __future__ import annotations

from typing import Any

import torch

from rp_service.data.datasets import BatchOrder
from rp_service.worker.meter import Meter
from rp_service.worker.training import lr_factor


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
        meter.updates.put((step, 0.5, rate))
        meter.flush()
    rates = [data["learning_rate"] for _, _, data in events]
    assert rates == [2e-3 * factor(k) for k in range(3)] == [1e-3, 2e-3, 2e-3]
