"""RoundPipe(optim_memory='compact') (issue 35): the bf16 weights are the optimizer's masters,
the step is exact against a plain loop of the same optimizer, a resume from a checkpoint is
bit-identical, and the plan predicts the bytes the optimizer allocates."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import engine.optim as eo
from engine import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from engine.errors import ConfigError
from engine.planning.memory_plan import GIB, ModelShape, RunShape, plan_host_memory
from tests.tiny_models import tiny_model
from tests.unit.engine._models import make_batch, make_model

STEPS = 4


def _mse(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((out.float() - label.float()) ** 2).mean()


# A fixed plan: an automatic one follows measured times, and another split would sum the
# micro-batches' bf16 gradients in another order (last bits) between the runs compared.
FIXED_PLAN = ModelExecutePlan.from_ranges(
    [range(0, 3), range(3, 5), range(5, 7)], [range(3, 5), range(0, 3)]
)


def _compact(model: nn.Module) -> RoundPipe:
    cfg = RoundPipeRunConfig(execute_plan=FIXED_PLAN)
    return RoundPipe(model, pin_model="off", optim_memory="compact", model_run_config=cfg)


def _steps(rp: RoundPipe, opt: eo.Adam, steps: int, *, is_async: bool = True) -> None:
    x, y = make_batch(batch=12)
    for _ in range(steps):
        rp.forward_backward((x.bfloat16(),), label=y, loss_fn=_mse)

        def step_fn() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        rp.step(step_fn, is_async=is_async)
    rp.synchronize()


def _bits(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().view(torch.int16).clone() for p in model.parameters()]


def test_masters_are_the_model_weights(cpu3) -> None:
    rp = _compact(make_model(p_drop=0.0).bfloat16())
    assert all(p.dtype == torch.bfloat16 for p in rp.optim_parameters())
    model_ptrs = {p.data_ptr() for p in rp.model.parameters()}
    assert {p.data_ptr() for p in rp.optim_parameters()} == model_ptrs


def test_async_steps_equal_the_plain_loop(cpu3) -> None:
    """The compact step writes the weights the next call uploads, so that call waits for it:
    async and sync steps give the same weights, bit for bit, and so does a plain loop."""
    base = make_model(p_drop=0.0).bfloat16()
    results = []
    for is_async in (True, False):
        rp = _compact(copy.deepcopy(base))
        opt = eo.Adam(list(rp.optim_parameters()), lr=1e-2, state_dtype=torch.uint8)
        _steps(rp, opt, STEPS, is_async=is_async)
        results.append(_bits(rp.model))
    plain = copy.deepcopy(base)
    opt = eo.Adam(list(plain.parameters()), lr=1e-2, state_dtype=torch.uint8)
    x, y = make_batch(batch=12)
    for _ in range(STEPS):
        loss = _mse(plain(x.bfloat16()), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for a, b in zip(results[0], results[1], strict=True):
        assert torch.equal(a, b)
    changed = [not torch.equal(a, b) for a, b in zip(results[0], _bits(base), strict=True)]
    assert any(changed)
    # RoundPipe splits the batch into micro-batches: the gradient sums differ in the last
    # bits from the plain loop's, so the plain loop is a close, not exact, reference.
    for p, q in zip(results[0], _bits(plain), strict=True):
        torch.testing.assert_close(
            p.view(torch.bfloat16), q.view(torch.bfloat16), atol=0.05, rtol=0.05
        )


def test_resume_is_bit_identical(cpu3) -> None:
    base = make_model(p_drop=0.0).bfloat16()
    rp = _compact(copy.deepcopy(base))
    opt = eo.Adam(list(rp.optim_parameters()), lr=1e-2, state_dtype=torch.uint8)
    _steps(rp, opt, 2)
    weights = copy.deepcopy(rp.model.state_dict())
    state = copy.deepcopy(opt.state_dict())
    _steps(rp, opt, 2)
    straight = _bits(rp.model)

    resumed_model = copy.deepcopy(base)
    resumed_model.load_state_dict(weights)
    rp2 = _compact(resumed_model)
    opt2 = eo.Adam(list(rp2.optim_parameters()), lr=1e-2, state_dtype=torch.uint8)
    opt2.load_state_dict(state)
    _steps(rp2, opt2, 2)
    for a, b in zip(straight, _bits(rp2.model), strict=True):
        assert torch.equal(a, b)


def test_plan_predicts_the_optimizer_bytes() -> None:
    model = tiny_model("qwen3", vocab_size=1000, dtype=torch.bfloat16)
    config = model.config
    params = list(model.parameters())
    opt = eo.Adam(params, lr=1e-3, state_dtype=torch.uint8)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    allocated = sum(t.nbytes for s in opt.state.values() for k, t in s.items() if k != "step")
    shape = ModelShape.from_config(config.to_dict())
    plan = plan_host_memory(
        shape, RunShape(tokens_per_step=64, seq_len=32, optim_memory="compact", cuda=False)
    )
    predicted = plan.parts["optim_state"] + plan.parts["optim_state_scales"]
    assert plan.parts["optim_master"] == plan.parts["optim_gradients"] == 0
    assert abs(predicted - allocated) / allocated < 0.02, (predicted, allocated)
    n = sum(p.numel() for p in params)
    assert n == sum(shape.param_tensors())
    assert 6.0 < (plan.parts["optim_state"] + plan.parts["optim_state_scales"]) / n + 4 < 6.1


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"optim_dtype": torch.float32}, "leave optim_dtype unset"),
        ({"double_buffer_weights": True}, "double_buffer_weights"),
        ({"optim_memory": "tiny"}, "optim_memory must be"),
    ],
)
def test_bad_combinations_are_refused(cpu3, kwargs: dict[str, Any], needle: str) -> None:
    options = {"optim_memory": "compact", **kwargs}
    with pytest.raises(ConfigError, match=needle):
        RoundPipe(make_model(p_drop=0.0).bfloat16(), pin_model="off", **options)


def test_fp16_model_is_refused(cpu3) -> None:
    with pytest.raises(ConfigError, match="bfloat16"):
        _compact(make_model(p_drop=0.0).half())


def test_plan_of_14b_on_the_h100_box() -> None:
    """The issue's target: Qwen3-14B, 32 x 2048 tokens a step, <= 112 GiB of host memory."""
    shape = ModelShape(
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=17408,
        vocab_size=151936,
    )
    run = RunShape(tokens_per_step=32 * 2048, seq_len=2048, pin_model="arena")
    with pytest.raises(Exception, match="optim_memory=compact") as info:
        plan_host_memory(
            shape, replace(run, optim_grad_dtype="model", optim_state_dtype="bfloat16")
        ).check(112 * GIB)
    assert "recompute_attention" in info.value.option_fields
    compact = replace(run, optim_memory="compact", saved_attention=False)
    plan = plan_host_memory(shape, compact)
    plan.check(112 * GIB)
    per_param = (
        sum(
            plan.parts[k]
            for k in (
                "model",
                "host_gradients",
                "optim_master",
                "optim_gradients",
                "optim_state",
                "optim_state_scales",
            )
        )
        / shape.num_params
    )
    assert 6.0 < per_param < 6.05
