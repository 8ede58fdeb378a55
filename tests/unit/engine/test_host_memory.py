"""Host memory per parameter (issue 15): the in-place half gradient, the pinned arena, the
host-memory plan against the bytes the engine really allocates, and its refusals."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import engine.optim as eo
from engine import ModelExecutePlan, RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe
from engine.attribute import ParamAttribute
from engine.errors import ConfigError, HostMemoryError
from engine.planning.memory_plan import (
    GIB,
    ModelShape,
    RunShape,
    parse_bytes,
    plan_host_memory,
)
from tests.tiny_models import tiny_model
from tests.unit.engine._models import make_batch, make_model

STEPS = 3


def _mse(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((out.float() - label.float()) ** 2).mean()


def _train(rp: Any, *, zero: bool = True, calls: int = 2, record: list | None = None) -> None:
    """STEPS async steps of the C Adam, each after `calls` forward_backward (accumulated)."""
    opt = eo.Adam(list(rp.optim_parameters()), lr=1e-2, weight_decay=0.01)
    x, y = make_batch(batch=12)

    def step_fn() -> None:
        if record is not None:
            record.append([p.grad.float().clone() for p in rp.optim_parameters()])
        opt.step()
        if zero:
            opt.zero_grad(set_to_none=True)

    for _ in range(STEPS):
        for c in range(calls):
            rp.forward_backward((x[c::calls].half(),), label=y[c::calls], loss_fn=_mse)
        rp.step(step_fn)
    rp.synchronize()


FIXED_PLAN = ModelExecutePlan.from_ranges(
    [range(0, 3), range(3, 5), range(5, 7)], [range(3, 5), range(0, 3)]
)


def _half_model() -> nn.Sequential:
    return make_model(p_drop=0.0).half()


@pytest.mark.parametrize("pin_model", ["off", "arena"])
def test_in_place_half_grads_train_like_the_fp32_buffer(num_devices: int, pin_model: str) -> None:
    """The fp32 buffer holds the fp16 gradient widened exactly; reading the fp16 gradient
    in place must give bit-identical training (accumulation over calls included)."""
    base = _half_model()
    # One plan for both: an automatic plan follows measured times, and on 3+ devices it may
    # split the fused tail, which sums its fp16 gradients in another order (last bits).
    cfg = RoundPipeRunConfig(execute_plan=FIXED_PLAN)
    ref = RoundPipe(
        copy.deepcopy(base), optim_dtype=torch.float32, pin_model="off", model_run_config=cfg
    )
    got = RoundPipe(
        copy.deepcopy(base),
        optim_dtype=torch.float32,
        optim_grad_dtype=torch.float16,
        pin_model=pin_model,
        model_run_config=cfg,
    )
    _train(ref)
    _train(got)
    for (_, a), (_, b) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ref.optim_parameters(), got.optim_parameters(), strict=True):
        assert torch.equal(a, b)
    for _, pa in got._all_params():
        assert pa.grad_in_place and pa.optim_grad_buffer is None  # no fp32 gradient buffer


def test_in_place_grads_accumulate_until_the_optimizer_drops_them(cpu3: int) -> None:
    """Without zero_grad the optimizer's gradient keeps growing, as with the fp32 buffer."""
    base = _half_model()
    seen_ref: list = []
    seen_got: list = []
    ref = RoundPipe(copy.deepcopy(base), optim_dtype=torch.float32)
    got = RoundPipe(copy.deepcopy(base), optim_dtype=torch.float32, optim_grad_dtype=torch.float16)
    _train(ref, zero=False, calls=1, record=seen_ref)
    _train(got, zero=False, calls=1, record=seen_got)
    for step_ref, step_got in zip(seen_ref, seen_got, strict=True):
        for a, b in zip(step_ref, step_got, strict=True):
            # the sum is taken in fp16 on the device here, in fp32 on the host there
            torch.testing.assert_close(b, a, rtol=2e-3, atol=1e-4)
    assert any(not torch.equal(s0, s2) for s0, s2 in zip(seen_got[0], seen_got[2], strict=True))


def test_arena_holds_parameters_and_gradient_buffers_in_one_block() -> None:
    rp = RoundPipe(_half_model(), optim_dtype=torch.float32, pin_model="arena")
    params = list(rp.model.parameters())
    base = params[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in params)
    for p in params:
        pa = ParamAttribute.get(p)
        assert pa.grad_host is not None and pa.grad_host.untyped_storage().data_ptr() == base
        assert pa.grad_host.data_ptr() % 64 == 0 and p.data_ptr() % 64 == 0
    ends = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for p in params
        for t in (p, ParamAttribute.get(p).grad_host)
    )
    assert all(e0 <= s1 for (_, e0), (s1, _) in itertools.pairwise(ends))  # no overlap


def test_unsupported_grad_dtype_is_refused() -> None:
    with pytest.raises(ConfigError, match="optim_grad_dtype must be"):
        RoundPipe(_half_model(), optim_dtype=torch.float32, optim_grad_dtype=torch.bfloat16)


# ---------------------------------------------------------------- the plan


def _qwen3(tie: bool) -> nn.Module:
    return tiny_model(
        "qwen3",
        seed=None,
        dtype=torch.float16,
        vocab_size=264,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        head_dim=16,
        max_position_embeddings=None,
        tie_word_embeddings=tie,
    )


def _llama() -> nn.Module:
    # head_dim=None: hidden / heads = 12
    return tiny_model(
        "llama",
        seed=None,
        vocab_size=300,
        hidden_size=48,
        intermediate_size=80,
        head_dim=None,
        max_position_embeddings=None,
    )


@pytest.mark.parametrize("model_fn", [lambda: _qwen3(True), lambda: _qwen3(False), _llama])
def test_shape_counts_the_hf_parameters(model_fn: Any) -> None:
    model = model_fn()
    shape = ModelShape.from_config(model.config)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert sorted(shape.param_tensors()) == sorted(p.numel() for p in model.parameters())


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize(
    "grad_mode,state_dtype,pin_model,zeroes",
    [
        ("optim", "float32", "off", False),
        ("model", "bfloat16", "arena", False),
        ("optim", "bfloat16", "alloc", False),
        # the service's step_fn: it zeroes the gradients, so engine.optim.Adam reads each
        # download in place and no fp32 gradient buffer is made (the plan's deferred_grads)
        ("optim", "float32", "alloc", True),
    ],
)
def test_plan_matches_the_bytes_allocated(
    cpu3: int, tie: bool, grad_mode: str, state_dtype: str, pin_model: str, zeroes: bool
) -> None:
    hf = _qwen3(tie)
    shape = ModelShape.from_config(hf.config)
    seq, batch = 16, 4
    run = RunShape(
        tokens_per_step=seq * batch,
        seq_len=seq,
        optim_grad_dtype=grad_mode,  # type: ignore[arg-type]
        optim_state_dtype=state_dtype,  # type: ignore[arg-type]
        pin_model=pin_model,  # type: ignore[arg-type]
        cuda=False,
        deferred_grads=zeroes,
    )
    plan = plan_host_memory(shape, run)
    rp = wrap_model_to_roundpipe(
        hf,
        optim_dtype=torch.float32,
        optim_grad_dtype=torch.float16 if grad_mode == "model" else None,
        pin_model=pin_model,
    )
    opt = eo.Adam(list(rp.optim_parameters()), lr=1e-3, state_dtype=getattr(torch, state_dtype))
    ids = torch.randint(0, 264, (batch, seq), generator=torch.Generator().manual_seed(0))
    from engine.models import causal_lm_loss_fn

    rp.forward_backward(
        input_kwargs={"input_ids": ids, "return_logits": False},
        label=ids,
        loss_fn=causal_lm_loss_fn(ids),
    )

    def step_fn() -> None:
        opt.step()
        if zeroes:
            opt.zero_grad()

    rp.step(step_fn, is_async=False)
    attrs = [pa for _, pa in rp._all_params()]
    params = [p for p, _ in rp._all_params()]
    got = {
        "model": sum(_nbytes(p) for p in params),
        "host_gradients": sum(_nbytes(pa.grad_host) for pa in attrs),
        "optim_master": sum(_nbytes(pa.optim) for pa in attrs),
        "optim_gradients": sum(_nbytes(pa.optim_grad_buffer) for pa in attrs),
        "optim_state": sum(
            _nbytes(s["exp_avg"]) + _nbytes(s["exp_avg_sq"]) for s in opt.state.values()
        ),
    }
    if pin_model == "arena":  # the plan counts each tensor at its 64-byte-aligned slot
        got["model"] = sum(-(-_nbytes(p) // 64) * 64 for p in params)
        got["host_gradients"] = sum(-(-_nbytes(pa.grad_host) // 64) * 64 for pa in attrs)
        arena = params[0].untyped_storage().nbytes()
        buffers = sum(-(-_nbytes(b) // 64) * 64 for b in rp.model.buffers())
        assert arena == got["model"] + got["host_gradients"] + buffers
    assert {k: plan.parts[k] for k in got} == got
    assert (got["optim_gradients"] == 0) == (zeroes or grad_mode == "model")


def test_plan_of_8b_on_the_h100_box() -> None:
    """The issue's target: Qwen3-8B, 32 x 2048 tokens, in 115 GiB (bench/RESULTS.md)."""
    shape = ModelShape(
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
    )
    full = RunShape(tokens_per_step=32 * 2048, seq_len=2048)
    with pytest.raises(HostMemoryError) as info:
        plan_host_memory(shape, full).check(115 * GIB)
    err = info.value
    assert err.budget_bytes == 115 * GIB and err.need_bytes > 180 * GIB
    assert "over the budget of 115.0 GiB" in str(err)
    # optim_memory=compact (issue 35) fits on its own since it exists
    assert err.option_fields == ["optim_memory", "recompute_attention", "lora", "tokens_per_step"]
    assert "optim_memory=compact" in err.options[0]
    assert "recompute_attention=true with the lower-precision options" in err.options[1]
    low = RunShape(
        tokens_per_step=32 * 2048,
        seq_len=2048,
        optim_grad_dtype="model",
        optim_state_dtype="bfloat16",
        pin_model="arena",
        saved_attention=False,
    )
    plan = plan_host_memory(shape, low)
    plan.check(115 * GIB)
    weights = sum(plan.parts[k] for k in ("model", "host_gradients", "optim_master", "optim_state"))
    assert weights == 12 * shape.num_params  # 2 + 2 + 4 + 4 bytes a parameter


def test_overlapped_calls_plan_two_calls_activations_and_the_second_copy() -> None:
    """Session 28 (bench/RESULTS.md): Qwen3-1.7B, 128 x 2048 tokens, 8 micro-batches,
    overlapped calls peaked at 100.8-104.1 GiB where 68.4 were planned, the difference the
    activations and saved attention (33.4 GiB): a call's backward still holds its own while
    the next call's forward saves new ones."""
    from bench.shapes import SHAPES  # the shape bench/train.py measured

    shape = ModelShape.from_config({**SHAPES["qwen3-1.7b"], "model_type": "qwen3"})
    run = RunShape(
        tokens_per_step=128 * 2048,
        seq_len=2048,
        num_microbatch=8,
        num_devices=2,
        deferred_grads=True,  # bench/train.py's step, as measured
    )
    plain = plan_host_memory(shape, replace(run, double_buffer_weights=True))
    both = plan_host_memory(shape, replace(run, double_buffer_weights=True, overlap_calls=True))
    calls = plain.parts["activations"] + plain.parts["saved_attention"]
    assert both.total_bytes - plain.total_bytes == calls
    assert 100.8 * 0.97 * GIB <= both.total_bytes <= 104.1 * 1.03 * GIB  # within 3% of both peaks


def test_engine_refuses_over_budget_before_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _half_model()
    with pytest.raises(HostMemoryError, match=r"needs about .* over the budget of 0\.0 GiB"):
        RoundPipe(model, optim_dtype=torch.float32, host_memory_budget=1000)
    assert not any(ParamAttribute.has(p) for p in model.parameters())  # nothing allocated
    monkeypatch.setenv("RP_HOST_MEMORY_BUDGET", "2KiB")
    with pytest.raises(HostMemoryError, match="budget of 0.0 GiB"):
        RoundPipe(model, optim_dtype=torch.float32)
    monkeypatch.setenv("RP_HOST_MEMORY_BUDGET", "lots")
    with pytest.raises(ConfigError, match="RP_HOST_MEMORY_BUDGET must be a positive size"):
        RoundPipe(model, optim_dtype=torch.float32)
    monkeypatch.setenv("RP_HOST_MEMORY_BUDGET", "1GiB")
    RoundPipe(model, optim_dtype=torch.float32)  # fits


@pytest.mark.parametrize(
    "text,expected",
    [("123", 123), ("96GiB", 96 << 30), ("100G", 100 * 10**9), ("1.5 MiB", 3 << 19), (7, 7)],
)
def test_parse_bytes(text: Any, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "-1G", "12XB", "nan", 0])
def test_parse_bytes_rejects(text: Any) -> None:
    with pytest.raises(ConfigError, match="RP_HOST_MEMORY_BUDGET"):
        parse_bytes(text)


def test_a_container_limit_lowers_the_available_memory(tmp_path: Any) -> None:
    from engine.planning.memory_plan import _cgroup_bytes_left

    assert _cgroup_bytes_left(str(tmp_path)) is None  # no cgroup files: no limit
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("123\n")
    assert _cgroup_bytes_left(str(tmp_path)) is None
    (tmp_path / "memory.max").write_text(f"{8 << 30}\n")
    assert _cgroup_bytes_left(str(tmp_path)) == (8 << 30) - 123
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))
    (v1 / "memory" / "memory.usage_in_bytes").write_text("5")
    assert _cgroup_bytes_left(str(v1)) is None
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(1 << 30))
    assert _cgroup_bytes_left(str(v1)) == (1 << 30) - 5
