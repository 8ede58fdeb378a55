"""NF4 storage (engine.adapters.nf4) and loading (engine.adapters.quantized_load).

The oracle is bitsandbytes itself: the packed codes and absmax equal its quantize_4bit,
the decoded weights its dequantize_4bit, bit for bit (odd sizes, every float dtype, both
decoders); a folder saved 4-bit by transformers loads to the same bytes without being
re-quantized; the memory plan counts the packed base.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from engine import ConfigError
from engine.adapters import nf4, quantized_load
from engine.adapters.nf4 import (
    NF4Weight,
    dequantize_nf4,
    quantize_base_nf4,
    quantize_nf4,
    set_dequantize_kernel,
)
from engine.adapters.quantized_load import load_nf4_model
from engine.memory import packed_form
from engine.options import AdamOptions, EngineOptions
from engine.planning.allocation_check import check_engine_allocation
from engine.planning.memory_plan import (
    ModelShape,
    RunShape,
    nf4_tensor_bytes,
    plan_host_memory,
)
from tests.unit.engine.models.test_models import tiny_model

bnb = pytest.importorskip("bitsandbytes.functional")
transformers = pytest.importorskip("transformers")

SHAPES = [(1,), (17,), (3, 5), (64,), (65,), (37, 50), (1, 1000003 // 1000), (129, 64)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (so -0.0 != 0.0 and NaNs compare)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.fixture(params=["bnb", "torch"])
def kernel(request: pytest.FixtureRequest) -> Any:
    set_dequantize_kernel(request.param)
    yield request.param
    set_dequantize_kernel("auto")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_equals_bitsandbytes(
    shape: tuple[int, ...], dtype: torch.dtype, kernel: str
) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    w.view(-1)[0] = 0.0  # an exact code
    got = quantize_nf4(w)
    packed, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert torch.equal(got.packed, packed)
    assert got.absmax.dtype == torch.float32 and torch.equal(got.absmax, state.absmax)
    assert got.packed.shape == ((w.numel() + 1) // 2, 1)
    decoded = got.dequantize()
    assert decoded.shape == w.shape and decoded.dtype == dtype
    # bitsandbytes gives a 1-D weight back as (1, n): compare the values
    assert torch.equal(bits(decoded), bits(bnb.dequantize_4bit(packed, state).view(shape)))
    out = torch.empty(shape, dtype=dtype)
    assert dequantize_nf4(got.packed, got.absmax, shape, dtype, out=out) is out
    assert torch.equal(bits(out), bits(decoded))


def test_chunked_quantization_equals_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(45, 77, dtype=torch.bfloat16)
    monkeypatch.setattr(nf4, "_QUANT_CHUNK_VALUES", 640)  # 6 chunks, the last one short
    got = quantize_nf4(w)
    packed, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert torch.equal(got.packed, packed) and torch.equal(got.absmax, state.absmax)


def test_the_nibble_order_is_high_first() -> None:
    # Codes 15 (1.0) then 0 (-1.0): byte 0xF0, absmax 2.
    w = NF4Weight(
        torch.tensor([[0xF0]], dtype=torch.uint8),
        torch.tensor([2.0]),
        torch.Size([2]),
        torch.float32,
    )
    assert w.dequantize().tolist() == [2.0, -2.0]


def test_bad_packed_forms_are_refused() -> None:
    with pytest.raises(ConfigError, match="uint8 values"):
        NF4Weight(
            torch.zeros(3, 1, dtype=torch.uint8), torch.ones(1), torch.Size([8]), torch.bfloat16
        )
    with pytest.raises(ConfigError, match="float32 values"):
        NF4Weight(
            torch.zeros(4, 1, dtype=torch.uint8), torch.ones(2), torch.Size([8]), torch.bfloat16
        )
    with pytest.raises(ConfigError, match="kernel"):
        set_dequantize_kernel("cuda")  # type: ignore[arg-type]


def test_quantize_base_keeps_the_head_and_tied_weights() -> None:
    model = tiny_model("llama", tie=True, layers=1)
    quantize_base_nf4(model)
    assert packed_form(model.lm_head.weight) is None
    assert packed_form(model.model.embed_tokens.weight) is None
    q = model.model.layers[0].self_attn.q_proj.weight
    assert packed_form(q) is not None and not q.requires_grad
    assert q.shape == (64, 64) and q.dtype == torch.float32
    assert torch.isnan(q).all()  # the stand-in: a host-side use shows


# ---- loading ---------------------------------------------------------------------------


def _save_bf16(tmp_path: Path, kind: str = "qwen3", tie: bool = False) -> tuple[Path, nn.Module]:
    model = tiny_model(kind, tie=tie, layers=2).to(torch.bfloat16)
    folder = tmp_path / "bf16"
    model.save_pretrained(folder)
    return folder, model


def _linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"]


@pytest.mark.parametrize(("kind", "tie"), [("qwen3", False), ("llama", True)])
def test_a_bf16_folder_is_quantized_tensor_by_tensor(
    tmp_path: Path, kind: str, tie: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, source = _save_bf16(tmp_path, kind, tie)
    holding: list[int] = []
    quantize = quantized_load.quantize_nf4

    def watched(weight: torch.Tensor, **kw: Any) -> NF4Weight:
        # At each quantization: what full-precision linear weights does the host hold?
        model = watched.model  # type: ignore[attr-defined]
        if model is not None:
            holding.append(
                sum(
                    m.weight.untyped_storage().nbytes()
                    for n, m in model.named_modules()
                    if type(m) is nn.Linear
                    and n != "lm_head"
                    and m.weight.device.type != "meta"
                    and packed_form(m.weight) is None
                )
            )
        return quantize(weight, **kw)

    watched.model = None  # type: ignore[attr-defined]
    from_config = transformers.AutoModelForCausalLM.from_config

    def capture(*a: Any, **kw: Any) -> nn.Module:
        watched.model = from_config(*a, **kw)  # type: ignore[attr-defined]
        return watched.model  # type: ignore[attr-defined]

    monkeypatch.setattr(quantized_load, "quantize_nf4", watched)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", capture)
    model = load_nf4_model(folder)
    assert holding and max(holding) == 0  # one weight in full precision at a time
    names = _linear_names(source)
    assert len(names) == 7 * 2
    for name in names:
        w = packed_form(model.get_submodule(name).weight)
        expected = quantize(source.get_submodule(name).weight)
        assert torch.equal(w.packed, expected.packed) and torch.equal(w.absmax, expected.absmax)
        assert w.dtype == torch.bfloat16
    for name, p in source.named_parameters():
        if name.rsplit(".", 1)[0] not in names:
            assert torch.equal(model.get_parameter(name), p.detach()), name
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    # Buffers as transformers' own loader computes them (fp32 rotary tables).
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    for buf_name, buf in hf.named_buffers():
        assert torch.equal(model.get_buffer(buf_name), buf), buf_name


@pytest.mark.parametrize("double_quant", [False, True], ids=["absmax", "double-quant"])
def test_a_transformers_4bit_folder_loads_without_requantizing(
    tmp_path: Path, double_quant: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, source = _save_bf16(tmp_path)
    q = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        quantization_config=transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=torch.bfloat16,
        ),
        device_map="cpu",
    )
    saved = tmp_path / "q4"
    q.save_pretrained(saved)
    assert json.loads((saved / "config.json").read_text())["quantization_config"]["load_in_4bit"]

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("a 4-bit folder was re-quantized")

    monkeypatch.setattr(quantized_load, "quantize_nf4", refuse)
    model = load_nf4_model(saved)
    for name in _linear_names(source):
        w = packed_form(model.get_submodule(name).weight)
        ref = q.get_submodule(name).weight  # bitsandbytes' Params4bit
        assert torch.equal(w.packed, ref.data.reshape(-1, 1))
        expected = bnb.dequantize_4bit(ref.data, ref.quant_state)
        assert torch.equal(bits(w.dequantize()), bits(expected)), name
        if not double_quant:
            assert torch.equal(w.absmax, ref.quant_state.absmax)
    assert torch.equal(model.model.embed_tokens.weight, source.model.embed_tokens.weight)


def test_other_quantizations_are_refused(tmp_path: Path) -> None:
    folder, _ = _save_bf16(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="gptq"):
        load_nf4_model(folder)


# ---- memory plan -------------------------------------------------------------------------


LLAMA_70B = {
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "model_type": "llama",
}


def test_the_plan_counts_the_packed_base() -> None:
    shape = ModelShape.from_config(LLAMA_70B)
    lora = shape.lora_params(16)
    run = {
        "tokens_per_step": 16 * 2048,
        "seq_len": 2048,
        "trainable_params": lora,
        "pin_model": "arena",
    }
    fp16 = plan_host_memory(shape, RunShape(**run))
    packed = plan_host_memory(shape, RunShape(**run, quantization="nf4"))
    projections = shape.layer_tensors()[:7] * shape.num_hidden_layers
    nf4_bytes = sum(-(-b // 64) * 64 for n in projections for b in nf4_tensor_bytes(n))
    full_bytes = sum(-(-(2 * n) // 64) * 64 for n in projections)
    assert fp16.parts["model"] - packed.parts["model"] == full_bytes - nf4_bytes
    assert packed.parts["model"] < 45 * 2**30 < 125 * 2**30 < fp16.parts["model"]
    # nf4 without adapters is refused once, by the options the plan is built from
    with pytest.raises(ConfigError, match="only adapters can train") as refused:
        EngineOptions(adam=AdamOptions(lr=1e-4), quantization="nf4")
    assert refused.value.field == "quantization"


def test_nf4_tensor_bytes() -> None:
    assert nf4_tensor_bytes(1) == (1, 4)
    assert nf4_tensor_bytes(64) == (32, 4)
    assert nf4_tensor_bytes(65) == (33, 8)


def test_the_allocation_check_counts_packed_bytes() -> None:
    model = tiny_model("qwen3", layers=2)
    full = check_engine_allocation(
        model, optim_dtype=None, optim_grad_dtype=None, pin_model="off", budget_bytes=1 << 40
    )
    for p in model.parameters():
        p.requires_grad_(False)
    numel = sum(
        m.weight.numel()
        for n, m in model.named_modules()
        if type(m) is nn.Linear and n != "lm_head"
    )
    packed_bytes = quantize_base_nf4(model)
    plan = check_engine_allocation(
        model, optim_dtype=None, optim_grad_dtype=None, pin_model="off", budget_bytes=1 << 40
    )
    assert plan.parts["model"] == full.parts["model"] - 4 * numel + packed_bytes
    from engine.errors import HostMemoryError

    with pytest.raises(HostMemoryError):
        check_engine_allocation(
            model,
            optim_dtype=None,
            optim_grad_dtype=None,
            pin_model="off",
            budget_bytes=plan.parts["model"] - 1,
        )
