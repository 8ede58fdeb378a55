"""QLoRA exports against peft and transformers on bitsandbytes' own 4-bit base.

The engine loads a bf16 folder with its projections in NF4 (`load_nf4_model`, what the
worker does for `model.quantization: nf4` with a `model.path`), trains LoRA (rank 4, all
seven projections) for a few Adam steps, then writes the adapter and the merged model
(`save_adapter(..., merged_path=...)`, what a LoRA job's output does). The oracles:

- transformers loads the same folder with `BitsAndBytesConfig(load_in_4bit=True,
  bnb_4bit_quant_type="nf4")` (bitsandbytes quantizes it itself) and peft loads the
  adapter onto it: the base codes are the engine's, the adapter weights the engine's bit
  for bit, and its logits the engine's;
- transformers loads the merged folder as a plain model: it is in the model's dtype, its
  projections are bitsandbytes' decoding of the same codes plus s B A, and its logits are
  those of peft on the 4-bit base.

The model dtype (what NF4 decodes into, what both sides compute in) runs as bf16 (a job's
usual `model.dtype`) and fp32 (where the two implementations differ only by the order of
their sums, so the comparison is tight). tests/gpu/test_qlora_export_gpu.py runs the same
scenario on CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from engine import RoundPipeRunConfig, wrap_model_to_roundpipe
from engine.adapters.lora import DEFAULT_TARGET_MODULES, LoraConfig, lora_modules
from engine.adapters.peft_format import ADAPTER_WEIGHTS_NAME
from engine.adapters.quantized_load import load_nf4_model
from engine.memory import packed_form
from engine.models import causal_lm_loss_fn
from engine.optim import Adam
from tests.unit.engine.models.test_models import batch, tiny_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

LAYERS = 2
RANK, ALPHA = 4, 8.0  # scaling 2
# Large enough that three steps move every lora_B well away from its zero init (the
# adapter's effect on the logits is about half their scale), small enough to stay finite.
LR, STEPS = 1e-2, 3
# fp32 on both sides, the same decoded base bits: the engine computes x (W + s B A)^T with
# the adapter merged into the weight, peft x W^T + s (x A^T) B^T. Only the order of the
# sums differs, a few fp32 ulps of the logits (measured 2.7e-7 at logits of ~0.65).
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
# In a half dtype the two round at different places (the engine the merged weight, peft
# the base output before adding its fp32 adapter output), so neither is the exact value.
# The bar of tests/gpu/test_lora_gpu.py: against the fp32 computation of the same model,
# the engine's error is at most twice peft's own plus 1e-3 of the logits' scale.
HALF_ERR_FACTOR, HALF_ERR_SCALE = 2.0, 1e-3


def save_bf16_folder(tmp_path: Path, kind: str, tie: bool) -> tuple[Path, nn.Module]:
    """A tiny bf16 model saved as transformers saves it; returns (folder, the model)."""
    source = tiny_model(kind, tie=tie, layers=LAYERS).to(torch.bfloat16)
    folder = tmp_path / f"{kind}-bf16"
    source.save_pretrained(folder)
    return folder, source


def train_on_nf4(folder: Path, dtype: torch.dtype) -> nn.Module:
    """The engine's QLoRA run: NF4 base read from `folder`, LoRA on every projection,
    `STEPS` Adam steps; returns the RoundPipe, synchronized."""
    model = load_nf4_model(folder, dtype=dtype)  # rp_service.worker.modeling's nf4 path
    rp = wrap_model_to_roundpipe(
        model,
        lora_config=LoraConfig(rank=RANK, alpha=ALPHA),
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        optim_dtype=torch.float32,
    )
    opt = Adam(rp.optim_parameters(), lr=LR)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    for step in range(STEPS):
        ids, labels = batch(40 + step)
        rp.forward_backward(
            input_kwargs={"input_ids": ids}, label=labels, loss_fn=causal_lm_loss_fn(labels)
        )
        rp.step(step_fn)
    rp.synchronize()
    return rp


def bnb_4bit_model(folder: Path, dtype: torch.dtype, device: str) -> nn.Module:
    """transformers' own 4-bit load of `folder` (bitsandbytes quantizes it), computing in
    `dtype`, in eval mode."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=dtype,
        quantization_config=transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
        ),
        device_map=device,
    )
    linear4 = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert (
        len(linear4) == len(DEFAULT_TARGET_MODULES) * LAYERS
    )  # every projection; the head stays in `dtype`
    for m in linear4:
        # On a CPU with AVX512-BF16, bitsandbytes' no-grad eval forward repacks the weight
        # with its absmax rounded to bf16 and computes in bf16: another base than the codes
        # decode to. Off, the CPU runs its reference path (decode to `dtype`, then a GEMM),
        # the base the engine decodes and the one a CUDA GPU computes with.
        m.support_avx512bf16_for_cpu = False
    return model.eval()


def base_codes(model: nn.Module) -> dict[str, tuple[torch.Tensor, Any]]:
    """Module name -> (packed codes, quant state) of a bitsandbytes 4-bit model, on the CPU."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            state = m.weight.quant_state
            cpu_state = bnb.functional.QuantState(
                absmax=state.absmax.cpu(),
                shape=state.shape,
                code=state.code.cpu(),
                blocksize=state.blocksize,
                quant_type=state.quant_type,
                dtype=state.dtype,
            )
            out[name] = (m.weight.data.cpu().clone(), cpu_state)
    return out


def logits(model: nn.Module, ids: torch.Tensor, device: str) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids.to(device)).logits.float().cpu()


def assert_logits_match(
    got: torch.Tensor,
    ref: torch.Tensor,
    *,
    dtype: torch.dtype,
    exact: torch.Tensor | None,
    fp32_atol: float,
) -> None:
    """`got` equals `ref` within the dtype's tolerance (see FP32_* and HALF_* above);
    `exact` is the fp32 computation both approximate in a half dtype."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=FP32_RTOL, atol=fp32_atol)
        return
    assert exact is not None
    my_err = (got - exact).abs().max()
    their_err = (ref - exact).abs().max()
    bar = HALF_ERR_FACTOR * their_err + HALF_ERR_SCALE * exact.abs().max()
    assert my_err <= bar, (my_err, their_err)


def run_export_scenario(
    tmp_path: Path, kind: str, tie: bool, dtype: torch.dtype, device: str, *, fp32_atol: float
) -> None:
    """Train on the NF4 base, export, and check both exports (see the module docstring)."""
    from safetensors.torch import load_file

    folder, source = save_bf16_folder(tmp_path, kind, tie)
    rp = train_on_nf4(folder, dtype)
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    rp.save_adapter(adapter_dir, merged_path=merged_dir)
    ids, _ = batch(99)
    with torch.no_grad():
        engine_logits = rp(input_ids=ids).logits.float().cpu()
    engine_lora = dict(lora_modules(rp))
    assert len(engine_lora) == len(DEFAULT_TARGET_MODULES) * LAYERS
    for name, mod in engine_lora.items():
        assert mod.lora_B.weight.ne(0).any(), f"{name}: lora_B still at its zero init"

    # ---- the adapter, by peft onto bitsandbytes' 4-bit base -----------------------------
    base4 = bnb_4bit_model(folder, dtype, device)
    codes = base_codes(base4)  # before any forward: the codes as bitsandbytes made them
    for name, (packed, state) in codes.items():
        mine = packed_form(engine_lora[name].base_layer.weight)
        assert torch.equal(mine.packed, packed.reshape(-1, 1)), f"{name}: other NF4 codes"
        assert torch.equal(mine.absmax, state.absmax), name
        assert state.dtype == dtype == mine.dtype
    plain_logits = logits(base4, ids, device)  # the 4-bit base alone
    tuned = peft.PeftModel.from_pretrained(base4, adapter_dir)
    loaded = {
        n: m
        for n, m in tuned.base_model.model.named_modules()
        if isinstance(m, peft.tuners.lora.LoraLayer)
    }
    assert loaded.keys() == engine_lora.keys()
    for name, layer in loaded.items():
        assert isinstance(layer.base_layer, bnb.nn.Linear4bit), name
        assert layer.scaling["default"] == ALPHA / RANK
        for part in ("lora_A", "lora_B"):
            theirs = getattr(layer, part)["default"].weight.detach().cpu()
            mine = getattr(engine_lora[name], part).weight.detach()
            assert theirs.dtype == mine.dtype == torch.float32, (name, part)
            assert torch.equal(theirs, mine), (name, part)  # bit for bit
    peft_logits = logits(tuned, ids, device)
    exact = None
    if dtype != torch.float32:
        # The fp32 computation of the same model: the same codes (checked), decoded to fp32.
        exact_base = bnb_4bit_model(folder, torch.float32, device)
        for name, (packed, _) in base_codes(exact_base).items():
            assert torch.equal(packed, codes[name][0]), name
        exact = logits(peft.PeftModel.from_pretrained(exact_base, adapter_dir), ids, device)
    assert_logits_match(engine_logits, peft_logits, dtype=dtype, exact=exact, fp32_atol=fp32_atol)
    # The adapter is live: it moves the logits far more than any tolerance above.
    effect = (peft_logits - plain_logits).abs().max()
    assert effect > 0.1 * peft_logits.abs().max(), effect

    # ---- the merged model, as a plain transformers model --------------------------------
    written = load_file(str(merged_dir / "model.safetensors"))
    assert {t.dtype for t in written.values()} == {dtype}  # bf16 for a bf16 model
    assert all(torch.isfinite(t).all() for t in written.values())  # no NaN stand-in
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, device_map=device)
    assert merged.dtype == dtype
    assert getattr(merged.config, "quantization_config", None) is None
    adapter = load_file(str(adapter_dir / ADAPTER_WEIGHTS_NAME))
    scaling = ALPHA / RANK
    merged_params = {n: p.detach().cpu() for n, p in merged.named_parameters()}
    projections = set()
    for name, (packed, state) in codes.items():
        # bitsandbytes' decoding of its own codes, in the model dtype (what the 4-bit base
        # computes with), plus s B A from the saved adapter, summed in fp32, rounded once.
        w = bnb.functional.dequantize_4bit(packed, state)
        b = adapter[f"base_model.model.{name}.lora_B.weight"]
        a = adapter[f"base_model.model.{name}.lora_A.weight"]
        expected = (w.float() + scaling * (b @ a)).to(dtype)
        assert torch.equal(merged_params[f"{name}.weight"], expected), name
        projections.add(f"{name}.weight")
    for name, p in source.named_parameters():  # embedding, norms, head: the source's
        if name not in projections:
            assert torch.equal(merged_params[name], p.detach().to(dtype)), name
    if tie:
        assert merged.lm_head.weight is merged.model.embed_tokens.weight
    merged_logits = logits(merged, ids, device)
    assert_logits_match(merged_logits, peft_logits, dtype=dtype, exact=exact, fp32_atol=fp32_atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("kind", "tie"), [("qwen3", False), ("llama", True)])
def test_qlora_exports_load_in_peft_and_transformers(
    tmp_path: Path, kind: str, tie: bool, dtype: torch.dtype, cpu3: int
) -> None:
    run_export_scenario(tmp_path, kind, tie, dtype, "cpu", fp32_atol=FP32_ATOL)
