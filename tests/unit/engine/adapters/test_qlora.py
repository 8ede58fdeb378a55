"""QLoRA through RoundPipe against peft LoRA in plain PyTorch on the same decoded base.

The engine keeps every linear weight of the tiny HF model in NF4 (engine.adapters.nf4);
the oracle is peft on a copy of the model whose linear weights are bitsandbytes' own
decoding of the same packed bytes (fp32 compute on both sides): losses, adapter gradients
and three Adam steps equal, the packed base bit-identical after training, and the host
holding only the packed base (measured from the tensors the model references).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from engine import RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe
from engine.adapters.lora import DEFAULT_TARGET_MODULES, LoraConfig
from engine.adapters.nf4 import NF4Weight, host_base_bytes, quantize_base_nf4
from engine.adapters.peft_format import adapter_state_dict, load_adapter_state_dict
from engine.attribute import ParamAttribute
from engine.memory import packed_form
from engine.models import causal_lm_loss_fn
from engine.optim import Adam
from tests.unit.engine.adapters.test_lora import (
    ALPHA,
    ATOL,
    LR,
    RANK,
    RTOL,
    STEPS,
    WEIGHT_ATOL,
    _nothing,
    _Stale,
    assert_adapters_equal,
    peft_twin,
)
from tests.unit.engine.models.test_models import batch, tiny_model

peft = pytest.importorskip("peft")
bnb_functional = pytest.importorskip("bitsandbytes.functional")


def bnb_decoded(w: NF4Weight) -> torch.Tensor:
    """bitsandbytes' own decoding of a packed weight (the oracle's base weight)."""
    state = bnb_functional.QuantState(
        absmax=w.absmax,
        shape=w.shape,
        code=bnb_functional.get_4bit_type("nf4", device="cpu"),
        blocksize=64,
        quant_type="nf4",
        dtype=w.dtype,
    )
    return bnb_functional.dequantize_4bit(w.packed, state)


def decoded_twin(quantized: nn.Module, original: nn.Module) -> nn.Module:
    """A plain copy of `original` whose weights are those of `quantized`, packed ones
    decoded by bitsandbytes."""
    twin = copy.deepcopy(original)
    with torch.no_grad():
        for name, p in quantized.named_parameters():
            packed = packed_form(p)
            if packed is not None:
                twin.get_parameter(name).copy_(bnb_decoded(packed))
    return twin


def packed_weights(model: nn.Module) -> dict[str, NF4Weight]:
    return {n: packed_form(p) for n, p in model.named_parameters() if packed_form(p) is not None}


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("kind", "tie"), [("qwen3", False), ("llama", True)])
def test_qlora_trains_like_peft_on_the_decoded_base(
    kind: str, tie: bool, is_async: bool, cpu3: int
) -> None:
    original = tiny_model(kind, tie=tie, layers=3)
    hf = copy.deepcopy(original)
    full_bytes = host_base_bytes(hf)
    packed_bytes = quantize_base_nf4(hf)
    packed = packed_weights(hf)
    assert len(packed) == 7 * 3  # every projection; the head and the embedding stay
    ref = peft_twin(decoded_twin(hf, original), DEFAULT_TARGET_MODULES)
    before = {n: (w.packed.clone(), w.absmax.clone()) for n, w in packed.items()}

    rp = wrap_model_to_roundpipe(
        hf,
        lora_config=LoraConfig(rank=RANK, alpha=ALPHA),
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        optim_dtype=torch.float32,
    )
    assert isinstance(rp, RoundPipe)
    load_adapter_state_dict(rp, peft.get_peft_model_state_dict(ref))
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.Adam(ref_params, lr=LR)
    opt = Adam(rp.optim_parameters(), lr=LR)
    assert len(opt.param_groups[0]["params"]) == len(ref_params) == 2 * 7 * 3

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    stale = _Stale(ref_params)
    for step in range(STEPS):
        ids, labels = batch(20 + step)
        with stale if is_async else _nothing():
            expected = ref(input_ids=ids, labels=labels).loss
            expected.backward()
        got = rp.forward_backward(
            input_kwargs={"input_ids": ids}, label=labels, loss_fn=causal_lm_loss_fn(labels)
        )
        torch.testing.assert_close(got, expected.detach(), rtol=RTOL, atol=ATOL)
        if step == 0:
            rp.synchronize()
            assert_adapters_equal(rp, ref, grads=True, atol=ATOL)
        ref_opt.step()
        ref_opt.zero_grad()
        rp.step(step_fn, is_async=is_async)
    rp.synchronize()
    assert_adapters_equal(rp, ref, grads=False, atol=WEIGHT_ATOL)

    # The packed base: the same objects, bit for bit, frozen, with no optimizer state
    # (apply_lora renamed them: q_proj.weight is now q_proj.base_layer.weight).
    after = packed_weights(hf)
    assert {id(w) for w in after.values()} == {id(w) for w in packed.values()}
    for name, (codes, absmax) in before.items():
        assert torch.equal(packed[name].packed, codes), name
        assert torch.equal(packed[name].absmax, absmax), name
    for name in after:
        p = hf.get_parameter(name)
        assert not p.requires_grad
        assert ParamAttribute.get(p).optim is None and p not in opt.state
    assert len(opt.state) == len(ref_params)

    # Measured: the tensors the model references hold the packed base, no decoded copy.
    adapters = sum(t.numel() * t.element_size() for t in adapter_state_dict(rp).values())
    decoded_projections = sum(w.shape.numel() * 4 for w in after.values())
    held = host_base_bytes(hf)
    assert held - adapters == full_bytes - decoded_projections + packed_bytes + 4 * len(after)
    for module in hf.modules():
        for p in module._parameters.values():
            if p is not None and packed_form(p) is not None:
                assert p.untyped_storage().nbytes() == p.element_size()  # the NaN stand-in


def test_qlora_host_bytes_shrink_to_the_packed_size(cpu3: int) -> None:
    hf = tiny_model("qwen3", layers=2)
    linear = [m.weight for m in hf.modules() if type(m) is nn.Linear and m is not hf.lm_head]
    full = host_base_bytes(hf)
    packed = quantize_base_nf4(hf)
    numel = sum(w.numel() for w in linear)
    assert packed == numel // 2 + 4 * (numel // 64)
    assert host_base_bytes(hf) == full - 4 * numel + packed + 4 * len(linear)


def test_quantize_refuses_a_wrapped_model(cpu3: int) -> None:
    from engine import ConfigError

    rp = wrap_model_to_roundpipe(tiny_model("qwen3"), lora_config=LoraConfig(rank=RANK))
    with pytest.raises(ConfigError, match="before wrap_model_to_roundpipe"):
        quantize_base_nf4(rp)


def test_the_bench_runs_tiny_on_the_cpu(cpu3: int) -> None:
    from bench import qlora

    nf4, bf16, baseline = qlora.main(["--tiny", "--fp16-base", "--baseline"])
    assert (nf4["run"], bf16["run"], baseline["run"]) == (
        "engine-nf4",
        "engine-bf16-base",
        "peft-bnb",
    )
    assert all(r["tokens_per_s"] > 0 for r in (nf4, bf16, baseline))
    assert all(math.isfinite(x) for x in nf4["losses"] + bf16["losses"])
    assert nf4["base_host_bytes"] < bf16["base_host_bytes"] / 2


def test_the_bench_passes_and_reports_its_gpu_memory_cap(cpu3: int) -> None:
    from bench import qlora
    from engine.device import gpu_memory_cap_bytes

    (nf4,) = qlora.main(["--tiny", "--max-gpu-memory", "0.75"])
    assert nf4["max_gpu_memory_gib"] == 0.75
    assert gpu_memory_cap_bytes() == int(0.75 * (1 << 30))  # RoundPipe was given it
    with pytest.raises(SystemExit):
        qlora.parse_args(["--tiny", "--max-gpu-memory", "0"])


def test_merged_weight_decodes_a_packed_base(cpu3: int) -> None:
    """The merged export (W + s B A) reads the decoded base, not the parameter's stand-in."""
    from engine.adapters.lora import LoraLinear

    hf = tiny_model("qwen3", layers=2)
    quantize_base_nf4(hf)
    rp = wrap_model_to_roundpipe(hf, lora_config=LoraConfig(rank=RANK, alpha=ALPHA))
    lora_layers = [m for m in hf.modules() if isinstance(m, LoraLinear)]
    assert len(lora_layers) == 7 * 2
    torch.manual_seed(3)
    for layer in lora_layers:
        with torch.no_grad():
            layer.lora_B.weight.normal_()  # peft's init leaves B zero: make the delta count
        packed = packed_form(layer.base_layer.weight)
        expected = bnb_decoded(packed).float() + layer.scaling * (
            layer.lora_B.weight.float() @ layer.lora_A.weight.float()
        )
        merged = layer.merged_weight()
        assert torch.isfinite(merged).all()
        torch.testing.assert_close(merged.float(), expected.to(merged.dtype).float())
    rp.synchronize()


_PIN_RSS_SCRIPT = """
import gc, json, sys
import torch
from torch import nn
from engine.adapters.nf4 import host_base_bytes, quantize_base_nf4
from engine.memory import pin_module_arena

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

torch.manual_seed(0)
# Eight 1024 x 4096 projections: 16 MiB of packed codes, each weight in its own mapping.
model = nn.Sequential(*[nn.Linear(1024, 4096, bias=False) for _ in range(8)])
packed = quantize_base_nf4(model, skip_modules=())
gc.collect()
before = rss()
pin_module_arena(model)
gc.collect()
print(json.dumps({"packed": packed, "grown": rss() - before, "held": host_base_bytes(model)}))
"""


def test_pinning_a_packed_base_frees_the_unpinned_copy(tmp_path: object) -> None:
    """Measured, not counted: after the arena takes the packed weights (the move every
    QLoRA run makes), the process holds them once. quantize_nf4 hands out reshaped views,
    whose bases kept the old storage alive: the 70B base held 103 GiB of RSS for 40 GiB
    of packed bytes until NF4Weight took tensors of their own."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[4]
    out = subprocess.run(
        [sys.executable, "-c", _PIN_RSS_SCRIPT],
        cwd=root,
        # A fixed mmap threshold: glibc's moving one would serve these few-MiB tensors from
        # its heap, which keeps freed memory, and the RSS would not show what was freed.
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "MALLOC_MMAP_THRESHOLD_": "65536"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["held"] == figures["packed"] + 8 * 4  # + the eight fp32 NaN stand-ins
    # The arena is new memory as large as the packed weights; the old copies must go back.
    assert figures["grown"] < figures["packed"] / 4, figures
