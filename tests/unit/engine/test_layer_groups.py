"""ModelExecutePlan.grouped (equal layer groups, the head's group the fused tail): its
ranges, the host memory plan's count of the recompute inputs it keeps, and a preset that
trains like Hugging Face under it."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from engine import ModelExecutePlan, RoundPipeRunConfig
from engine.errors import ConfigError
from engine.models import causal_lm_loss_fn
from engine.planning.memory_plan import ModelShape, RunShape, plan_host_memory
from engine.scheduler import ModelTracker
from engine.wrapper import wrap_model_to_roundpipe
from tests.unit.engine.adapters.test_nf4 import LLAMA_70B  # the Llama-3.3-70B shape
from tests.unit.engine.models.test_models import ATOL, RTOL, _adamw, batch, tiny_model


def test_groups_cover_the_layers_with_the_head_in_the_tail() -> None:
    plan = ModelExecutePlan.grouped(7, 2)
    assert plan.fwd_plan == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    assert plan.bwd_plan == [range(4, 6), range(2, 4), range(0, 2)]
    for run_type in ("fused", "infer"):
        plan.check_valid(7, run_type)  # type: ignore[arg-type]
    whole = ModelExecutePlan.grouped(7, 10)  # one group: the whole model is the tail
    assert whole.fwd_plan == [range(0, 7)] and whole.bwd_plan == []
    whole.check_valid(7, "fused")


@pytest.mark.parametrize("size", [0, -1, True, 1.5, "2"])
def test_a_bad_group_size_is_refused(size: object) -> None:
    with pytest.raises(ConfigError, match="layers_per_group"):
        ModelExecutePlan.grouped(7, size)  # type: ignore[arg-type]


@pytest.mark.parametrize("hidden_layers", [1, 5, 28, 80])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 100])
def test_the_plan_counts_the_hidden_states_the_engine_keeps(hidden_layers: int, size: int) -> None:
    """The memory plan's backward groups are the layers whose input the engine keeps for the
    recompute, less layer 0 (whose input is the token ids)."""
    plan = ModelExecutePlan.grouped(hidden_layers + 2, size)
    kept = {i for i in range(hidden_layers + 2) if ModelTracker(plan).backward_need_input(i)}
    shape = ModelShape.from_config({**LLAMA_70B, "num_hidden_layers": hidden_layers})
    assert shape.backward_groups("stage", size) == len(kept - {0})
    # the layer grain keeps every decoder layer's input whatever the groups
    assert shape.backward_groups("layer", size) == hidden_layers


def _qlora_70b(layers_per_group: int | None) -> RunShape:
    shape = ModelShape.from_config(LLAMA_70B)
    return RunShape(
        tokens_per_step=16 * 2048,
        seq_len=2048,
        num_microbatch=2,
        pin_model="arena",
        saved_attention=False,
        trainable_params=shape.lora_params(16),
        quantization="nf4",
        layers_per_group=layers_per_group,
    )


def test_two_layer_groups_halve_a_70b_runs_recompute_inputs() -> None:
    shape = ModelShape.from_config(LLAMA_70B)
    auto = plan_host_memory(shape, _qlora_70b(None))
    two = plan_host_memory(shape, _qlora_70b(2))
    boundary = 16 * 2048 * 8192 * 2  # the step's tokens x hidden x bf16, over the micro-batches
    assert auto.parts["activations"] == 80 * boundary  # one-layer groups at this shape
    assert two.parts["activations"] == (math.ceil(82 / 2) - 2) * boundary
    assert {k: v for k, v in two.parts.items() if k != "activations"} == {
        k: v for k, v in auto.parts.items() if k != "activations"
    }


def test_a_refusal_offers_larger_groups_when_they_fit() -> None:
    shape = ModelShape.from_config(LLAMA_70B)
    auto = plan_host_memory(shape, _qlora_70b(None))
    two = plan_host_memory(shape, _qlora_70b(2)).total_bytes
    four = plan_host_memory(shape, _qlora_70b(4)).total_bytes
    offered = dict(auto.fitting_options(two))
    assert "layers_per_group=2" in offered["layers_per_group"]
    # only four-layer groups fit: those are offered
    assert "layers_per_group=4" in dict(auto.fitting_options(four))["layers_per_group"]
    # explicit groups already chosen, or the layer grain: none to offer
    chosen = plan_host_memory(shape, _qlora_70b(2))
    assert "layers_per_group" not in dict(chosen.fitting_options(four))
    layer = plan_host_memory(shape, replace(_qlora_70b(None), recompute_grain="layer"))
    assert "layers_per_group" not in dict(layer.fitting_options(four))


@pytest.mark.parametrize("size", [2, 3])
def test_a_preset_trains_like_hf_in_groups(size: int, cpu3: int) -> None:
    ref = tiny_model("qwen3", layers=5)
    mine = copy.deepcopy(ref)
    plan = ModelExecutePlan.grouped(5 + 2, size)
    rp = wrap_model_to_roundpipe(
        mine, model_run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=plan)
    )
    assert rp.num_layers == 7
    ref_opt, rp_opt = _adamw(ref.parameters()), _adamw(rp.optim_parameters())
    for step in range(2):
        ids, labels = batch(20 + step)
        expected = ref(input_ids=ids, labels=labels).loss
        expected.backward()
        got = rp.forward_backward(
            input_kwargs={"input_ids": ids}, label=labels, loss_fn=causal_lm_loss_fn(labels)
        )
        torch.testing.assert_close(got, expected.detach(), rtol=RTOL, atol=ATOL)
        ref_opt.step()
        ref_opt.zero_grad()
        rp.step(lambda: (rp_opt.step(), rp_opt.zero_grad()), is_async=False)
    rp.synchronize()
    trained = dict(mine.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trained[name].detach(), p.detach(), rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 8])
def test_the_plan_counts_the_inputs_the_automatic_plan_keeps_on_many_devices(
    devices: int,
) -> None:
    """From 3 devices the automatic plan may cut every decoder layer into a backward group
    of its own (engine.planning.search's uniform candidates): the plan counts each one's
    input then. The 4-GPU bound is what the plan held against a measured 4-GPU run."""
    from bench.shapes import SHAPES
    from engine.planning.search import plan_groups

    shape = ModelShape.from_config({**SHAPES["qwen3-1.7b"], "model_type": "qwen3"})
    counted = shape.backward_groups("stage", None, devices)
    if devices >= 3:
        assert counted == 28
    else:
        assert counted < 28
    # The finest grouping the search can take: one layer a backward group, each keeping
    # its input (the first group's is the token ids).
    n = 30
    fwd = [1.0] + [50.0] * 28 + [280.0]
    groups = plan_groups(
        "fused",
        fwd,
        [3 * f for f in fwd],
        [0.1] * n,
        num_devices=max(devices, 3),
        num_microbatch=8,
    )
    plan = ModelExecutePlan.from_ranges(groups.fwd_plan, groups.bwd_plan, groups.tail_split)
    kept = {i for i in range(n) if ModelTracker(plan).backward_need_input(i)} - {0}
    assert len(kept) <= shape.backward_groups("stage", None, max(devices, 3))
