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


def test_timer_drops_iterations_during_which_torch_compile_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine import timer

    compiled = [0]
    monkeypatch.setattr(timer, "_compiled_graphs", lambda: compiled[0])
    t = timer.ModelTimer([1.0, 1.0])

    def iteration(fwd: list[float], bwd: list[float]) -> bool:
        t.report("fwd", dict(enumerate(fwd)))
        t.report("bwd", dict(enumerate(bwd)))
        return t.update_times()

    assert not iteration([9.0, 9.0], [9.0, 9.0])  # warm-up: dropped
    compiled[0] += 1  # e.g. the head compiled on a second GPU
    assert not iteration([30.0, 300.0], [60.0, 600.0])
    assert t.get_estimate("fused")[0] == "memory"
    assert iteration([3.0, 10.0], [6.0, 20.0])
    source, fwd, bwd = t.get_estimate("fused")
    assert source == "time"
    assert fwd == pytest.approx([3.0, 10.0]) and bwd == pytest.approx([6.0, 20.0])


def test_timer_clips_a_stall_that_no_compile_counter_saw(monkeypatch: pytest.MonkeyPatch) -> None:
    """One iteration 50x slower (a stall inside the timed blocks) enters as 3x: after two
    measured iterations, the de-biased average goes to 2.2x, not 30x; later iterations at
    the real times bring it back."""
    from engine import timer

    monkeypatch.setattr(timer, "_compiled_graphs", lambda: 0)
    t = timer.ModelTimer([1.0, 1.0])

    def iteration(fwd: list[float]) -> None:
        t.report("fwd", dict(enumerate(fwd)))
        t.report("bwd", dict(enumerate(2 * f for f in fwd)))
        t.update_times()

    iteration([9.0, 9.0])  # warm-up: dropped
    iteration([10.0, 2.0])
    assert t.get_estimate("fused")[1] == pytest.approx([10.0, 2.0])
    iteration([500.0, 2.0])  # the stall, on the first layer
    fwd = t.get_estimate("fused")[1]
    assert fwd[0] == pytest.approx((0.3 * 0.7 * 10.0 + 0.3 * 30.0) / (1 - 0.7**2))
    assert fwd[0] < 2.5 * 10.0 and fwd[1] == pytest.approx(2.0)
    for _ in range(8):
        iteration([10.0, 2.0])
    assert t.get_estimate("fused")[1][0] == pytest.approx(10.0, rel=0.05)


# Per-layer times (ms summed over 4 micro-batches) logged on two H200s for Qwen3-1.7B:
# embedding, 28 decoder layers, head with its loss.
H200_FWD = [1.0] + [24.5] * 28 + [145.0]
H200_BWD = [20.0] + [71.0] * 28 + [430.0]


def _makespan(plan: ModelExecutePlan, devices: int, nmb: int) -> float:
    from engine.planning.simulate import simulate_plan

    return simulate_plan(plan, H200_FWD, H200_BWD, devices, nmb, handoff=24.5 / nmb)


@pytest.mark.parametrize(("devices", "nmb"), [(2, 4), (2, 8), (4, 8)])
def test_pipeline_search_shortens_the_simulated_call(devices: int, nmb: int) -> None:
    model = _model(H200_FWD, H200_BWD)
    balanced = ModelExecutePlan.auto("fused", model, min_stages=devices, model_memory_limit=100.0)
    searched = ModelExecutePlan.auto(
        "fused", model, min_stages=devices, model_memory_limit=100.0, num_microbatch=nmb
    )
    searched.check_valid(len(H200_FWD), "fused")
    ideal = (sum(H200_FWD) + sum(H200_BWD)) / devices
    assert _makespan(searched, devices, nmb) < 0.95 * _makespan(balanced, devices, nmb)
    if devices == 2:  # both passes' first groups short: the pipeline fills fast
        assert ideal / _makespan(searched, devices, nmb) > 0.95
        assert len(searched.fwd_plan[0]) < len(searched.fwd_plan[-2])
        assert len(searched.bwd_plan[-1]) < len(searched.bwd_plan[0])


def test_one_device_is_not_searched() -> None:
    model = _model(H200_FWD, H200_BWD)
    plain = ModelExecutePlan.auto("fused", model, min_stages=1, model_memory_limit=100.0)
    given = ModelExecutePlan.auto(
        "fused", model, min_stages=1, model_memory_limit=100.0, num_microbatch=4
    )
    assert repr(plain) == repr(given)
