"""GGUF export (rp_service/export/gguf_file.py) without llama.cpp: the file is read back with
`gguf.GGUFReader` and a pure-torch forward written the way llama.cpp computes (its tensor
names, its rope per architecture: pairs for ``llama``, halves for ``qwen2``/``qwen3``) must
give the Hugging Face model's logits. That proves the names, shapes, the q/k permutation
and the metadata; tests/integration/test_gguf_llama_cpp.py (slow) runs llama.cpp itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf  # the export extra, in the dev extra too (.ci/run installs it)
import numpy as np
import pytest
import torch

from rp_service.data.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer
from rp_service.export.gguf_file import ExportError, write_gguf
from rp_service.export.job import modelfile_text
from tests.tiny_models import tiny_model

IDS = [60, 124, 7, 200, 33, 255, 1, 90, 17, 3, 141]  # 11 positions: odd, past one rope period


def _model(family: str, **fields: Any) -> Any:
    sizes = {"hidden_size": 64, "intermediate_size": 96, "head_dim": 16}
    window = {"qwen2": {"use_sliding_window": False}, "mistral": {"sliding_window": None}}
    return tiny_model(
        family,
        seed=11,
        vocab_size=BYTE_VOCAB_SIZE + 7,  # rows past the tokenizer, as presets round them
        **{**sizes, **window.get(family, {}), **fields},
    ).eval()


def _export(tmp_path: Path, model: Any, kind: str = "f32") -> Any:
    tokenizer = build_byte_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    out = write_gguf(model, tokenizer, tmp_path, tmp_path / "m.gguf", kind=kind)  # type: ignore[arg-type]
    return gguf.GGUFReader(out)


def _field(reader: Any, key: str) -> Any:
    return reader.fields[key].contents()


def _weights(reader: Any) -> dict[str, torch.Tensor]:
    out = {}
    for t in reader.tensors:
        data = np.array(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            data = gguf.quants.dequantize(data, t.tensor_type)
        out[t.name] = torch.from_numpy(data.astype(np.float32).copy())
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float, pairs: bool) -> torch.Tensor:
    """(seq, heads, d) rotated as llama.cpp does: neighbours (``llama``) or halves (NeoX)."""
    seq, _, d = x.shape
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * freqs  # (seq, d/2)
    cos, sin = angle.cos().float()[:, None], angle.sin().float()[:, None]
    a, b = (x[..., 0::2], x[..., 1::2]) if pairs else (x[..., : d // 2], x[..., d // 2 :])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    if pairs:
        return torch.stack((ra, rb), dim=-1).flatten(-2)
    return torch.cat((ra, rb), dim=-1)


def _gguf_logits(reader: Any, ids: list[int]) -> torch.Tensor:
    """The logits of `ids` computed from the GGUF's tensors and metadata alone."""
    arch = _field(reader, "general.architecture")
    w = _weights(reader)
    key = lambda name: _field(reader, f"{arch}.{name}")  # noqa: E731
    heads, kv, d = (
        key("attention.head_count"),
        key("attention.head_count_kv"),
        key("attention.key_length"),
    )
    eps, theta = key("attention.layer_norm_rms_epsilon"), key("rope.freq_base")
    x = w["token_embd.weight"][ids]
    seq = len(ids)
    mask = torch.full((seq, seq), float("-inf")).triu(1)
    for i in range(key("block_count")):
        p = lambda n, i=i: w[f"blk.{i}.{n}"]  # noqa: E731
        h = _rms(x, p("attn_norm.weight"), eps)
        q, k, v = (h @ p(f"attn_{n}.weight").T for n in "qkv")
        if f"blk.{i}.attn_q.bias" in w:
            q, k, v = q + p("attn_q.bias"), k + p("attn_k.bias"), v + p("attn_v.bias")
        q, k, v = q.view(seq, heads, d), k.view(seq, kv, d), v.view(seq, kv, d)
        if f"blk.{i}.attn_q_norm.weight" in w:
            q, k = _rms(q, p("attn_q_norm.weight"), eps), _rms(k, p("attn_k_norm.weight"), eps)
        q, k = _rope(q, theta, arch == "llama"), _rope(k, theta, arch == "llama")
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5 + mask
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(seq, heads * d)
        x = x + attn @ p("attn_output.weight").T
        h = _rms(x, p("ffn_norm.weight"), eps)
        gate, up = h @ p("ffn_gate.weight").T, h @ p("ffn_up.weight").T
        x = x + (torch.nn.functional.silu(gate) * up) @ p("ffn_down.weight").T
    head = w.get("output.weight", w["token_embd.weight"])
    return _rms(x, w["output_norm.weight"], eps) @ head.T


@pytest.mark.parametrize(
    ("family", "fields"),
    [
        ("qwen3", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"num_key_value_heads": 4}),
        ("qwen2", {}),
        ("mistral", {}),
    ],
)
def test_the_gguf_computes_the_hf_models_logits(tmp_path: Path, family: str, fields: dict) -> None:
    model = _model(family, **fields)
    reader = _export(tmp_path, model)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(_gguf_logits(reader, IDS), expected, rtol=1e-4, atol=1e-4)
    names = {t.name for t in reader.tensors}
    assert ("output.weight" in names) != bool(fields.get("tie_word_embeddings"))


def test_the_tokenizer_and_template_travel_in_the_file(tmp_path: Path) -> None:
    reader = _export(tmp_path, _model("qwen3"), kind="f16")
    tokenizer = build_byte_tokenizer()
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert (
        len(tokens) == BYTE_VOCAB_SIZE + 7 and tokens[BYTE_VOCAB_SIZE] == f"[PAD{BYTE_VOCAB_SIZE}]"
    )
    assert [tokens[i] for i in range(BYTE_VOCAB_SIZE)] == tokenizer.convert_ids_to_tokens(
        list(range(BYTE_VOCAB_SIZE))
    )
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert _field(reader, "tokenizer.chat_template") == tokenizer.chat_template
    types = _field(reader, "tokenizer.ggml.token_type")
    assert types[tokenizer.convert_tokens_to_ids("<|im_end|>")] == gguf.TokenType.CONTROL
    by_name = {t.name: t for t in reader.tensors}
    assert by_name["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert by_name["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_q8_0_stays_close(tmp_path: Path) -> None:
    model = _model("qwen3")
    reader = _export(tmp_path, model, kind="q8_0")
    by_name = {t.name: t for t in reader.tensors}
    assert by_name["blk.0.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([IDS])).logits[0]
    got = _gguf_logits(reader, IDS)
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize(
    ("family", "fields", "needle"),
    [
        ("gpt_oss", {}, "not exported to GGUF"),
        ("mistral", {"sliding_window": 16}, "sliding window of 16"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
         "sliding window of 8"),
    ],
)  # fmt: skip
def test_what_llama_cpp_cannot_run_is_refused(
    tmp_path: Path, family: str, fields: dict, needle: str
) -> None:
    model = tiny_model(family, seed=1, vocab_size=BYTE_VOCAB_SIZE, **fields)
    with pytest.raises(ExportError, match=needle):
        _export(tmp_path, model)
    assert not (tmp_path / "m.gguf").exists() or family == "gpt_oss"


def test_the_modelfile_spells_chatml_for_ollama() -> None:
    text = modelfile_text("job-1-f16.gguf", build_byte_tokenizer())
    assert text.startswith("FROM ./job-1-f16.gguf\n")
    assert "{{ .Role }}" in text and 'PARAMETER stop "<|im_end|>"' in text
    assert 'PARAMETER stop "<|endoftext|>"' in text


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_a_lora_job_is_merged_onto_its_base_first(tmp_path: Path, quantization: str) -> None:
    """`export_job` on an adapter folder: the GGUF computes peft's model, whose base is,
    for a QLoRA job, the base rounded through NF4 as the engine held it."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from engine.adapters.nf4 import quantize_nf4
    from rp_service.export.job import export_job

    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    model = _model("qwen3")
    model.save_pretrained(base_dir)
    build_byte_tokenizer().save_pretrained(base_dir)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1, generator=torch.Generator().manual_seed(2))
    peft_model.save_pretrained(adapter_dir)
    build_byte_tokenizer().save_pretrained(adapter_dir)
    spec = {"model": {"path": str(base_dir), "quantization": quantization}}
    result = export_job(adapter_dir, spec, kind="f32", dest=tmp_path / "out", name="j")

    oracle = type(model).from_pretrained(base_dir).eval()
    if quantization == "nf4":
        with torch.no_grad():
            for name, module in oracle.named_modules():
                if isinstance(module, torch.nn.Linear) and name != "lm_head":
                    module.weight.copy_(quantize_nf4(module.weight).dequantize())
    oracle = PeftModel.from_pretrained(oracle, adapter_dir).eval()
    with torch.no_grad():
        expected = oracle(input_ids=torch.tensor([IDS])).logits[0]
    got = _gguf_logits(gguf.GGUFReader(result["path"]), IDS)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
