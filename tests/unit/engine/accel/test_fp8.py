"""FP8 matmuls (engine.accel.fp8) on the CPU: the scaling arithmetic against a float64
reference, the three matmuls against matmuls of the dequantised operands, and RoundPipe with
matmul_precision='fp8' against the same model converted and run in plain PyTorch.

`torch._scaled_mm` runs on the CPU in torch 2.13 (fp32 accumulation), so everything but
the speed is checked here. The engine's results equal the plain FP8 model's bit for bit:
same kernels on the same operands, and rowwise input scales do not depend on how a batch is
cut into micro-batches (the weight gradient's scales along tokens do: the oracle runs the
same micro-batches).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from engine import RoundPipeRunConfig, wrap_model_to_roundpipe
from engine.accel.fp8 import (
    E4M3,
    E5M2,
    Fp8Linear,
    cast_to_fp8,
    convert_linears,
    fp8_forward,
    fp8_grad_input,
    fp8_linear,
)
from engine.adapters.lora import LoraConfig, LoraLinear, _MergedLoraLinear, apply_lora
from engine.errors import ConfigError
from engine.models import causal_lm_loss_fn
from tests.unit.engine.models.test_models import BATCH, batch, tiny_model

DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def reference_cast(t: torch.Tensor, dtype: torch.dtype, axis: int | None, pow2: bool) -> Any:
    """(float8 values, dequantisation scale) computed in float64, amax along `axis`."""
    x = t.double()
    amax = x.abs().amax() if axis is None else x.abs().amax(dim=axis, keepdim=True)
    top = torch.finfo(dtype).max
    scale = top / amax.clamp(min=1e-12)
    if pow2:
        scale = 2.0 ** torch.floor(torch.log2(scale))
    scale = scale.float()  # the scale the float32 multiply uses
    return (x.float() * scale).clamp(-top, top).to(dtype), 1.0 / scale


def dequantised(t: torch.Tensor, dtype: torch.dtype, axis: int | None, pow2: bool) -> torch.Tensor:
    q, inv = reference_cast(t, dtype, axis, pow2)
    return q.float() * inv


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(("rowwise", "pow2"), [(True, True), (True, False), (False, False)])
def test_cast_matches_the_float64_reference(dtype: torch.dtype, rowwise: bool, pow2: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    # Rows of very different magnitudes, an all-zero row, odd sizes.
    t = torch.randn(17, 49, generator=gen) * torch.logspace(-6, 4, 17).unsqueeze(1)
    t[5] = 0
    t = t.to(torch.bfloat16)
    q, inv = cast_to_fp8(t, dtype, rowwise=rowwise, pow2=pow2)
    q_ref, inv_ref = reference_cast(t, dtype, -1 if rowwise else None, pow2)
    assert q.dtype == dtype and q.shape == t.shape
    assert inv.shape == ((17, 1) if rowwise else ())
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    torch.testing.assert_close(inv, inv_ref, rtol=0, atol=0)
    assert torch.isfinite(q.float()).all()
    assert (q[5].float() == 0).all()


def test_scales_map_each_rows_amax_onto_the_largest_float8() -> None:
    t = torch.tensor([[3.0, -500.0, 1.0, 0.0], [1e-3, 2e-3, -4e-3, 0.0]], dtype=torch.bfloat16)
    q, inv = cast_to_fp8(t, E4M3, rowwise=True)
    # No rounding of the scales: the amax lands on 448, e4m3's largest finite value.
    assert q.float().abs().amax(dim=1).tolist() == [448.0, 448.0]
    back = q.float() * inv
    torch.testing.assert_close(back, t.float(), rtol=2**-4, atol=0)  # 3 mantissa bits
    # Power-of-two scales: amax * scale lands in (224, 448].
    q2, inv2 = cast_to_fp8(t, E4M3, rowwise=True, pow2=True)
    assert torch.equal(torch.log2(inv2), torch.round(torch.log2(inv2)))
    peaks = q2.float().abs().amax(dim=1)
    assert ((peaks > 224) & (peaks <= 448)).all()


def test_power_of_two_scales_never_round_up() -> None:
    # amax 56 + one float32 step: 448 / amax is one float32 step below 8, whose float32 log2
    # rounds to 3.0 exactly (exp2(floor(log2)) would give 8 and saturate the amax).
    amax = torch.tensor(56.0).nextafter(torch.tensor(100.0))
    t = torch.stack([amax, torch.tensor(1.0)]).unsqueeze(0)
    assert torch.log2(torch.tensor(448.0) / amax).item() == 3.0
    q, inv = cast_to_fp8(t, E4M3, rowwise=True, pow2=True)
    assert inv.item() == 0.25
    assert q.float()[0, 0].item() == 224.0  # 56.0000038 * 4 in e4m3, not clamped at 448


def test_rowwise_keeps_small_rows_that_tensorwise_flushes() -> None:
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(8, 64, generator=gen)
    t[0] *= 1e6  # one outlier row sets the tensor's scale
    errors = {}
    for rowwise in (True, False):
        q, inv = cast_to_fp8(t, E4M3, rowwise=rowwise)
        err = (q.float() * inv - t).norm(dim=1) / t.norm(dim=1)
        errors[rowwise] = err[1:].max().item()
    assert errors[True] < 0.05
    assert errors[False] > 0.2  # the small rows fall below e4m3's smallest subnormals


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("tokens", [(3, 7), (2, 16)], ids=["21-padded", "32"])
def test_the_three_matmuls_equal_matmuls_of_the_dequantised_operands(
    recipe: str, tokens: tuple[int, int]
) -> None:
    gen = torch.Generator().manual_seed(2)
    rowwise, pow2 = recipe != "tensorwise", True  # every recipe's scales: powers of two
    axis = -1 if rowwise else None
    grad_dtype = E4M3 if rowwise else E5M2
    x = torch.randn(*tokens, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(48, 64, generator=gen) * 0.1).to(torch.bfloat16).requires_grad_()
    b = torch.randn(48, generator=gen).to(torch.bfloat16).requires_grad_()
    g = torch.randn(*tokens, 48, generator=gen).to(torch.bfloat16)
    fp8_linear(x, w, b, recipe).backward(g)  # type: ignore[arg-type]
    out = fp8_forward(x.detach(), w.detach(), b.detach(), recipe)  # type: ignore[arg-type]

    x2, g2 = x.detach().reshape(-1, 64), g.reshape(-1, 48)
    wd = w.detach()
    # forward: x and W scaled along `in`
    expected = dequantised(x2, E4M3, axis, pow2) @ dequantised(wd, E4M3, axis, pow2).t()
    expected = (expected.to(torch.bfloat16) + b.detach()).view(*tokens, 48)
    # input gradient: g and W^T scaled along `out`
    grad_x = dequantised(g2, grad_dtype, axis, pow2) @ dequantised(wd.t(), E4M3, axis, pow2).t()
    # weight gradient: g^T and x^T scaled along tokens, or (gw_hp) the bf16 product itself
    grad_w = dequantised(g2.t(), grad_dtype, axis, pow2) @ dequantised(x2.t(), E4M3, axis, pow2).t()
    tol = {"rtol": 8e-3, "atol": 1e-5}  # one bf16 rounding of the fp32 sums
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    torch.testing.assert_close(x.grad.float(), grad_x.view(*tokens, 64), **tol)
    if recipe == "rowwise_with_gw_hp":
        assert torch.equal(w.grad, g2.t().mm(x2))
        assert (w.grad.float() - grad_w).abs().max() > 3 * 8e-3 * grad_w.abs().max()
    else:
        torch.testing.assert_close(w.grad.float(), grad_w, **tol)
    torch.testing.assert_close(b.grad, g2.sum(0))
    # and FP8 is not bf16: the plain product differs by far more than the tolerance
    plain = torch.nn.functional.linear(x.detach(), wd, b.detach())
    assert (plain.float() - out.float()).abs().max() > 3 * 8e-3 * out.float().abs().max()


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("bumped", ["x", "g"])
def test_one_bf16_step_on_the_largest_element_changes_nothing(recipe: str, bumped: str) -> None:
    """Another kernel upstream may round the largest element one bf16 step apart: with
    scales that followed the amax's last bits tensorwise re-rounded the whole tensor (2.5-3.4%
    relative L2 on the CPU, session 25); power-of-two scales keep every result."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(96, 64, generator=gen).clamp(-2.5, 2.5).to(torch.bfloat16)
    w = (torch.randn(48, 64, generator=gen) * 0.1).to(torch.bfloat16)
    g = torch.randn(96, 48, generator=gen).clamp(-2.5, 2.5).to(torch.bfloat16)
    x[7, 3] = g[11, 5] = 3.0  # the amax, one bf16 step below 3.015625, far from 2 and 4

    def results(x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fp8_linear(xr, wr, None, recipe)  # type: ignore[arg-type]
        out.backward(g)
        return [out.detach(), xr.grad, wr.grad]

    want = results(x, g)
    if bumped == "x":
        x[7, 3] = 3.015625
    else:
        g[11, 5] = 3.015625
    got = results(x, g)
    # What the bumped element reaches: x[7, 3] the output's row 7 and the weight gradient's
    # column 3 (not the input gradient, g W); g[11, 5] the input gradient's row 11 and the
    # weight gradient's row 5 (not the output). Everything else stays bit for bit.
    reach = {"x": [(0, 7), None, (1, 3)], "g": [None, (0, 11), (0, 5)]}[bumped]
    for name, a, b, where in zip(("out", "grad_x", "grad_w"), got, want, reach, strict=True):
        changed = (a != b).nonzero()
        if where is None:
            assert changed.numel() == 0, name
        else:
            dim, index = where
            assert set(changed[:, dim].tolist()) <= {index}, name


def test_merged_lora_linear_runs_its_base_matmuls_in_fp8() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(32, 64, generator=gen) * 0.1).to(torch.bfloat16)
    a = (torch.randn(4, 64, generator=gen) * 0.1).requires_grad_()
    b = (torch.randn(32, 4, generator=gen) * 0.1).requires_grad_()
    g = torch.randn(2, 16, 32, generator=gen).to(torch.bfloat16)
    grads = {}
    for recipe in ("rowwise", None):
        xr, ar, br = (t.detach().clone().requires_grad_() for t in (x, a, b))
        out = _MergedLoraLinear.apply(xr, w, None, ar, br, 2.0, recipe)
        out.backward(g)
        grads[recipe] = (out, xr.grad, ar.grad, br.grad)
    out, gx, ga, gb = grads["rowwise"]
    assert torch.equal(out, fp8_forward(x.detach(), w, None, "rowwise"))
    assert torch.equal(gx, fp8_grad_input(g, w, "rowwise"))
    # the adapter gradients do not go through FP8
    assert torch.equal(ga, grads[None][2]) and torch.equal(gb, grads[None][3])


def test_conversion_keeps_parameters_names_and_the_head() -> None:
    hf = tiny_model("qwen3", layers=2).to(torch.bfloat16)
    params = {name: id(p) for name, p in hf.named_parameters()}
    assert convert_linears(hf, "rowwise") == 2 * len(DECODER_LINEARS)
    assert {name: id(p) for name, p in hf.named_parameters()} == params
    converted = {n.rsplit(".", 1)[-1] for n, m in hf.named_modules() if isinstance(m, Fp8Linear)}
    assert converted == set(DECODER_LINEARS)
    assert type(hf.lm_head) is nn.Linear
    # a linear whose sizes FP8 GEMMs cannot take stays as it is
    odd = nn.Sequential(nn.Linear(20, 16), nn.Linear(16, 32))
    assert convert_linears(odd, "tensorwise") == 1
    assert type(odd[0]) is nn.Linear and isinstance(odd[1], Fp8Linear)


def _plain_fp8(base: nn.Module, recipe: str | None, num_microbatch: int) -> tuple[Any, dict]:
    """Loss and gradients of `base` (converted to FP8 when `recipe`), micro-batch by
    micro-batch as the engine cuts the batch (each micro-batch's loss over the batch's
    token count)."""
    model = copy.deepcopy(base)
    if recipe is not None:
        convert_linears(model, recipe)  # type: ignore[arg-type]
    ids, labels = batch(3)
    count = int((labels[:, 1:] != -100).sum())
    total = torch.zeros(())
    rows = BATCH // num_microbatch
    for i in range(num_microbatch):
        part = slice(i * rows, (i + 1) * rows)
        loss = model(input_ids=ids[part], labels=labels[part], num_items_in_batch=count).loss
        loss.backward()
        total = total + loss.detach().float()
    return total, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _engine(model: nn.Module, num_microbatch: int, **kwargs: Any) -> tuple[Any, dict, nn.Module]:
    """Loss and gradients of one forward_backward of `model` through RoundPipe."""
    rp = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=True,
        model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch),
        **kwargs,
    )
    ids, labels = batch(3)
    loss = rp.forward_backward(
        input_kwargs={"input_ids": ids}, label=labels, loss_fn=causal_lm_loss_fn(labels)
    )
    rp.synchronize()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss, grads, model


# Tensorwise on one layer only: the CPU's _scaled_mm takes ~50 ms a call with 0-d scales
# (~3 ms with rowwise ones) at these sizes.
@pytest.mark.parametrize(
    ("recipe", "num_microbatch", "layers"),
    [("rowwise", 1, 3), ("rowwise", 2, 3), ("tensorwise", 2, 1), ("rowwise_with_gw_hp", 2, 2)],
)
def test_roundpipe_in_fp8_equals_the_plain_fp8_model(
    recipe: str, num_microbatch: int, layers: int, num_devices: int
) -> None:
    torch.manual_seed(0)
    base = tiny_model("qwen3", layers=layers).to(torch.bfloat16)
    loss, grads, model = _engine(
        copy.deepcopy(base), num_microbatch, matmul_precision="fp8", fp8_recipe=recipe
    )
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == layers * len(DECODER_LINEARS)
    expected_loss, expected = _plain_fp8(base, recipe, num_microbatch)
    torch.testing.assert_close(loss.float(), expected_loss, rtol=0, atol=0)
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
    # the bf16 model's gradients are another function: FP8 really ran
    _, bf16 = _plain_fp8(base, None, num_microbatch)
    worst = max(((grads[n] - g).float().norm() / g.float().norm()).item() for n, g in bf16.items())
    assert worst > 0.05


def test_lora_and_nf4_bases_train_in_fp8(cpu3: int) -> None:
    from engine.adapters.nf4 import quantize_base_nf4

    torch.manual_seed(0)
    losses = {}
    for precision in ("bf16", "fp8"):
        hf = tiny_model("qwen3", layers=1).to(torch.bfloat16)
        # (a deep copy would lose the packed form: built each time)
        quantize_base_nf4(hf)
        apply_lora(hf, LoraConfig(rank=4, alpha=8))
        loss, grads, model = _engine(hf, 2, matmul_precision=precision)
        bases = [m.base_layer for m in model.modules() if isinstance(m, LoraLinear)]
        assert len(bases) == len(DECODER_LINEARS)
        assert all(isinstance(b, Fp8Linear) == (precision == "fp8") for b in bases)
        adapters = [g for n, g in grads.items() if "lora_" in n]
        assert len(grads) == len(adapters) == 2 * len(DECODER_LINEARS)
        assert all(torch.isfinite(g).all() for g in adapters)
        losses[precision] = loss.item()
    assert losses["fp8"] != losses["bf16"]
    assert losses["fp8"] == pytest.approx(losses["bf16"], rel=0.02)


def test_fp8_is_refused_for_other_dtypes_and_unknown_values(cpu3: int) -> None:
    hf = tiny_model("qwen3", layers=1)  # fp32
    with pytest.raises(ConfigError, match="bfloat16") as refused:
        wrap_model_to_roundpipe(hf, matmul_precision="fp8")
    assert refused.value.field == "matmul_precision"
    assert not any(isinstance(m, Fp8Linear) for m in hf.modules())
    hf = hf.to(torch.bfloat16)
    with pytest.raises(ConfigError, match="'bf16' or 'fp8'") as refused:
        wrap_model_to_roundpipe(hf, matmul_precision="fp4")
    assert refused.value.field == "matmul_precision"
    with pytest.raises(ConfigError, match="'rowwise' or 'tensorwise'") as refused:
        wrap_model_to_roundpipe(hf, matmul_precision="fp8", fp8_recipe="blockwise")
    assert refused.value.field == "fp8_recipe"


def test_the_fp8_linear_traces_whole_under_torch_compile() -> None:
    """The engine compiles its decoder layers: the FP8 linear must trace without a graph
    break (fullgraph) and compute what it computes eagerly, forward and backward."""
    torch._dynamo.reset()
    lin = Fp8Linear.from_linear(nn.Linear(64, 48).to(torch.bfloat16), "rowwise")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 16, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    g = torch.randn(3, 16, 48, generator=gen).to(torch.bfloat16)
    results = []
    for call in (lin, torch.compile(lin, backend="aot_eager", fullgraph=True, dynamic=False)):
        out = call(x)
        out.backward(g)
        results.append((out.detach(), x.grad, lin.weight.grad, lin.bias.grad))
        x.grad = lin.weight.grad = lin.bias.grad = None
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)
