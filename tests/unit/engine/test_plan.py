"""ModelExecutePlan.auto on given layer timings: stage sizes for one and several devices."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine import ModelExecutePlan

# A decoder-only shape: embedding, 12 decoder layers, the head with its chunked loss (its
# forward + backward is the slowest stage by far, as on the GPU: 70 vs 17 per layer).
FWD = [1.0] + [5.0] * 12 + [20.0]
BWD = [1.0] + [17.0] * 12 + [50.0]
TAIL = FWD[-1] + BWD[-1]


def _model(fwd: list[float], bwd: list[float]) -> SimpleNamespace:
    timer = SimpleNamespace(get_estimate=lambda run_type: ("time", list(fwd), list(bwd)))
    return SimpleNamespace(num_layers=len(fwd), layer_size=[0.01] * len(fwd), model_timer=timer)


def _plan(min_stages: int) -> ModelExecutePlan:
    return ModelExecutePlan.auto(
        "fused", _model(FWD, BWD), min_stages=min_stages, model_memory_limit=100.0
    )


def _cost(group: range) -> float:
    return sum(BWD[i] for i in group)


@pytest.mark.parametrize("devices", [2, 4])
def test_backward_groups_after_the_tail_are_as_long_as_the_tail(devices: int) -> None:
    plan = _plan(devices)
    assert plan.fwd_plan[-1] == range(13, 14)  # the head alone is the fused tail
    costs = [_cost(g) for g in plan.bwd_plan]
    assert len(plan.bwd_plan) >= devices - 1
    # every group but the last one (the remainder, at the embedding end) keeps pace
    # with the tail; none is more than 10% longer
    assert all(0.9 * TAIL <= c <= 1.1 * TAIL for c in costs[:-1]), costs
    assert costs[-1] <= 1.1 * TAIL
    assert plan.bwd_plan[0].stop == 13  # the first backward group ends below the tail


def test_one_device_keeps_groups_of_the_slowest_single_layer() -> None:
    plan = _plan(1)
    costs = [_cost(g) for g in plan.bwd_plan]
    assert max(costs) <= 1.1 * max(BWD)
    assert len(plan.bwd_plan) > len(_plan(2).bwd_plan)


def test_many_devices_still_get_a_group_each() -> None:
    plan = _plan(8)
    assert len(plan.bwd_plan) >= 7
    plan.check_valid(len(FWD), "fused")
