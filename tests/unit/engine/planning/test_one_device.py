"""One device: the fused tail takes the top backward group's layers (engine.planning.one_device).

Oracles: the plans written out by hand; the memory rule's arithmetic on given measurements;
and for training, RoundPipe with the head alone in the tail, whose losses and weights the
widened plan must repeat bit for bit (a layer's forward with grad is the same computation
as its no-grad forward and recompute).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from engine import ModelExecutePlan, RoundPipeRunConfig
from engine.models import count_loss_tokens
from engine.planning.one_device import ActivationMeter, DeviceRoom, widen_tail, with_tail_start
from engine.timer import IterTimer, ModelTimer
from engine.wrapper import wrap_model_to_roundpipe
from tests.tiny_models import tiny_model

GIB = 1 << 30

# The automatic plan of Qwen3-1.7B's default step (bench/sim_inputs): 0 the embedding,
# 1-28 the decoder layers, 29 the head.
DEFAULT_PLAN = ModelExecutePlan.from_ranges(
    [range(0, 7), range(7, 13), range(13, 19), range(19, 25), range(25, 29), range(29, 30)],
    [range(23, 29), range(17, 23), range(11, 17), range(5, 11), range(0, 5)],
)
LAYER_GB = [0.3] + [0.1] * 28 + [0.3]


def measured(layer: int = GIB, tail: int = 2 * GIB) -> ActivationMeter:
    """Every decoder layer `layer` bytes, six held at once, the head's tail `tail`."""
    meter = ActivationMeter(30)
    for j in range(1, 29):
        meter.record_layer(j, layer)
    meter.record_held(6 * layer)
    meter.record_tail(29, tail)
    return meter


def room(free_gib: float) -> DeviceRoom:
    total = 80 * GIB
    return DeviceRoom(total=total, peak_reserved=int(0.9 * total - free_gib * GIB))


def test_by_size_plans_on_parameter_sizes_whatever_the_timings() -> None:
    # Long sequences: each decoder layer is slower than the head, so the timed plan has
    # one-layer groups; by size (the head is the largest layer) they hold several layers.
    timer = ModelTimer([g * 1e9 for g in LAYER_GB])
    timer.get_estimate = lambda run_type: (
        "time",
        [1.0] + [50.0] * 28 + [10.0],
        [1.0] + [150.0] * 28 + [30.0],
    )  # type: ignore[method-assign]
    model = SimpleNamespace(num_layers=30, layer_size=LAYER_GB, model_timer=timer)
    timed = ModelExecutePlan.auto("fused", model, min_stages=1, model_memory_limit=100.0)
    assert len(timed.bwd_plan) == 28  # one decoder layer each (the embedding joins one)
    sized = ModelExecutePlan.auto(
        "fused", model, min_stages=1, model_memory_limit=100.0, by_size=True
    )
    unmeasured = SimpleNamespace(
        num_layers=30, layer_size=LAYER_GB, model_timer=ModelTimer([g * 1e9 for g in LAYER_GB])
    )
    first = ModelExecutePlan.auto("fused", unmeasured, min_stages=1, model_memory_limit=100.0)
    assert (sized.fwd_plan, sized.bwd_plan) == (first.fwd_plan, first.bwd_plan)
    assert sized.fwd_plan[-1] == range(29, 30)
    # the head (0.3) over a decoder layer (0.1): groups of up to 3 decoder layers
    assert max(len(r) for r in sized.bwd_plan) == 3
    sized.check_valid(30, "fused")


def test_with_tail_start_cuts_the_groups_before_it() -> None:
    plan = with_tail_start(DEFAULT_PLAN, 23)
    assert plan.fwd_plan == [range(0, 7), range(7, 13), range(13, 19), range(19, 23), range(23, 30)]
    assert plan.bwd_plan == [range(17, 23), range(11, 17), range(5, 11), range(0, 5)]
    plan.check_valid(30, "fused")
    # inside a group: both sides are cut there
    plan = with_tail_start(DEFAULT_PLAN, 27)
    assert plan.fwd_plan[-3:] == [range(19, 25), range(25, 27), range(27, 30)]
    assert plan.bwd_plan[0] == range(23, 27)
    plan.check_valid(30, "fused")


def test_the_tail_takes_the_top_group_when_it_fits() -> None:
    plan = widen_tail(DEFAULT_PLAN, measured(), LAYER_GB, room(40), param_cap_gb=20)
    assert plan.fwd_plan[-1] == range(23, 30)
    assert plan.bwd_plan[0] == range(17, 23)
    plan.check_valid(30, "fused")


def test_the_tail_grows_only_as_far_as_the_room_allows() -> None:
    # Six layers (6 GiB) were held at once; the tail's 2 GiB plus k layers may exceed that
    # by the free room: 1 GiB of room -> 5 layers (2 + 5 = 7 <= 6 + 1).
    plan = widen_tail(DEFAULT_PLAN, measured(), LAYER_GB, room(1), param_cap_gb=20)
    assert plan.fwd_plan[-1] == range(24, 30)
    # No room and nothing held: the head stays alone.
    meter = measured()
    meter.held = 0
    meter.tail[29] = 2 * GIB
    tight = DeviceRoom(total=80 * GIB, peak_reserved=80 * GIB)
    assert widen_tail(DEFAULT_PLAN, meter, LAYER_GB, tight, param_cap_gb=20) is DEFAULT_PLAN


def test_the_tail_grows_only_within_the_parameter_cap() -> None:
    # The head's 0.3 GB and two 0.1 GB layers: 0.5 GB
    plan = widen_tail(DEFAULT_PLAN, measured(), LAYER_GB, room(40), param_cap_gb=0.55)
    assert plan.fwd_plan[-1] == range(27, 30)


def test_nothing_moves_without_measurements_or_with_a_split_or_other_shape() -> None:
    unmeasured = ActivationMeter(30)
    assert widen_tail(DEFAULT_PLAN, unmeasured, LAYER_GB, room(40), 20) is DEFAULT_PLAN
    # the top layer's recompute was never measured (replayed): it stops there
    meter = measured()
    meter.layer[28] = None
    assert widen_tail(DEFAULT_PLAN, meter, LAYER_GB, room(40), 20) is DEFAULT_PLAN
    split = ModelExecutePlan.from_ranges(DEFAULT_PLAN.fwd_plan, DEFAULT_PLAN.bwd_plan, 2)
    assert widen_tail(split, measured(), LAYER_GB, room(40), 20) is split
    gap = ModelExecutePlan.from_ranges([range(0, 20), range(20, 30)], [range(10, 20), range(0, 10)])
    assert widen_tail(gap, measured(), LAYER_GB, room(40), 20) is gap


def test_a_widened_tail_stays_widened_when_re_planned() -> None:
    # After widening, the tail measured more (its layers' activations with the head's) and
    # the allocator's peak grew by it; the next automatic plan starts from the head alone.
    meter = measured()
    first = widen_tail(DEFAULT_PLAN, meter, LAYER_GB, room(3), param_cap_gb=20)
    assert first.fwd_plan[-1] == range(23, 30)
    meter.record_tail(23, 2 * GIB + 6 * GIB)
    again = widen_tail(DEFAULT_PLAN, meter, LAYER_GB, room(1), param_cap_gb=20)
    assert again.fwd_plan == first.fwd_plan and again.bwd_plan == first.bwd_plan


def test_the_meter_keeps_the_largest_measurement() -> None:
    meter = ActivationMeter(3)
    meter.record_layer(1, 5)
    meter.record_layer(1, 3)
    meter.record_tail(2, 7)
    meter.record_tail(2, 4)
    meter.record_held(9)
    meter.record_held(2)
    assert (meter.layer, meter.tail, meter.held) == ([None, 5, None], {2: 7}, 9)
    # only CUDA and one device are measured
    assert not meter.wanted(torch.device("cpu"), 1)
    assert not meter.wanted(torch.device("cuda", 0), 2)


def test_a_block_of_layers_is_timed_in_proportion_to_its_shares() -> None:
    timer = ModelTimer([1.0, 1.0, 1.0])
    assert timer.shares("fwd", range(0, 3)) is None  # not measured yet: an even split
    it = IterTimer(timer, "fwd", is_cuda=False)
    with it.time(range(0, 3), shares=[1.0, 1.0, 2.0]):
        pass
    it.flush()
    pending = timer._pending["fwd"]
    assert pending[2] == pytest.approx(2 * pending[0]) and pending[0] == pending[1]
    even = IterTimer(timer, "bwd", is_cuda=False)
    with even.time(range(0, 3)):
        pass
    even.flush()
    assert len(set(timer._pending["bwd"])) == 1
    for _ in range(2):
        timer._pending["fwd"] = [1.0, 2.0, 3.0]
        timer._pending["bwd"] = [1.0, 1.0, 1.0]
        timer.update_times()
    assert timer.shares("fwd", range(1, 3)) == pytest.approx([0.6, 0.9])


VOCAB, ROWS, SEQ = 96, 4, 7


def train_lm(
    model: torch.nn.Module,
    plan: ModelExecutePlan | None = None,
    *,
    calls: int = 3,
    seq: int = SEQ,
) -> tuple[list[float], dict[str, torch.Tensor], torch.nn.Module]:
    """Losses, weights after `calls` AdamW steps on random tokens, and the RoundPipe (the
    automatic plan without `plan`); the GPU tests share it."""
    rp = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=True,
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan),
    )
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-3)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    losses = []
    for step in range(calls):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCAB, (ROWS, seq), generator=gen)
        kwargs = {"input_ids": ids, "labels": ids, "num_items_in_batch": count_loss_tokens(ids)}
        loss = rp.forward_backward(input_kwargs=kwargs, loss_fn=lambda out, _: out.loss)
        losses.append(float(loss))
        rp.step(step_fn)
    rp.synchronize()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, weights, rp


def test_a_widened_tail_trains_bit_for_bit_as_the_head_alone() -> None:
    model = tiny_model("qwen3", vocab_size=VOCAB, num_hidden_layers=4, tie_word_embeddings=False)
    # [embedding, decoder 1-4, head]
    narrow = ModelExecutePlan.from_ranges(
        [range(0, 3), range(3, 5), range(5, 6)], [range(3, 5), range(0, 3)]
    )
    wide = with_tail_start(narrow, 3)
    assert wide.fwd_plan == [range(0, 3), range(3, 6)] and wide.bwd_plan == [range(0, 3)]
    losses_a, weights_a, _ = train_lm(copy.deepcopy(model), narrow)
    losses_b, weights_b, _ = train_lm(copy.deepcopy(model), wide)
    assert losses_a == losses_b
    assert weights_a.keys() == weights_b.keys()
    for k in weights_a:
        assert torch.equal(weights_a[k], weights_b[k]), k
