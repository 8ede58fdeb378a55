"""The exported GGUF in llama.cpp answers as the model it came from. Needs
llama-cpp-python, which builds llama.cpp from source (about 12 minutes on 2 cores, over
CI's budget): marked `llama_cpp`, deselected by default (`pip install llama-cpp-python`, then
`python -m pytest -m llama_cpp tests/integration/test_gguf_llama_cpp.py`); it runs in 7 s.

A LoRA adapter (random, non-zero) on a tiny Qwen3 and a tiny Llama: peft's model (the
adapter on its base), the merged Hugging Face model, and the GGUF `export_job` writes from
the adapter folder, run in llama.cpp, give the same greedy tokens on a fixed prompt set.
f16 is compared with the Hugging Face model whose weights are rounded to f16 as the file's;
llama.cpp's KV cache is f32 (its default f16 cache rounds the logits at 1e-3).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rp_service.data.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer
from rp_service.export.job import export_job
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.llama_cpp


@pytest.fixture(scope="module")
def llama_cpp() -> Any:
    """The binding, imported when a selected test runs (the default run deselects this
    file, and collects it where llama-cpp-python is not installed)."""
    import llama_cpp as binding

    return binding


PROMPTS = [
    [{"role": "user", "content": "What is 3 plus 4?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Count: 1 2 3"}],
]
NEW_TOKENS = 24


def _adapter(tmp_path: Path, family: str) -> tuple[Path, Path, Any]:
    """A base folder, an adapter folder (random B, so it changes the answers) and peft's model."""
    from peft import LoraConfig, get_peft_model

    base = tmp_path / "base"
    model = tiny_model(
        family, seed=5, vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        head_dim=16, max_position_embeddings=256, tie_word_embeddings=family == "llama",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # wider than the init's 0.02, so greedy answers vary token to token
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    model.save_pretrained(base)
    tokenizer = build_byte_tokenizer()
    tokenizer.save_pretrained(base)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    gen = torch.Generator().manual_seed(0)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.2
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    return base, adapter, peft_model.eval()


def _hf_greedy(model: Any, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,  # no stop: compare every position
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def _llama_cpp_greedy(llm: Any, ids: list[int]) -> list[int]:
    got: list[int] = []
    for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        got.append(int(token))
        if len(got) == NEW_TOKENS:
            return got
    return got


@pytest.mark.parametrize("kind", ["f32", "f16"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_peft_merged_and_gguf_in_llama_cpp_answer_alike(
    tmp_path: Path, family: str, kind: str, llama_cpp: Any
) -> None:
    base, adapter, peft_model = _adapter(tmp_path, family)
    spec = {"model": {"path": str(base)}}
    result = export_job(adapter, spec, kind=kind, dest=tmp_path / "export", name="m")  # type: ignore[arg-type]
    assert (tmp_path / "export" / "Modelfile").read_text().startswith("FROM ./m-")
    with peft_model.disable_adapter():
        plain = _hf_greedy(peft_model, [1, 2, 3])
    assert _hf_greedy(peft_model, [1, 2, 3]) != plain  # the adapter changes the answer
    merged = peft_model.merge_and_unload()
    if kind == "f16":
        merged = merged.half().float()
    tokenizer = build_byte_tokenizer()
    # llama.cpp keeps its KV cache in f16 by default (1e-3 of the logits' scale); in f32 it
    # computes what transformers does to 1e-6, so near-ties break the same way
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(
        result["path"], n_ctx=256, n_threads=1, verbose=False, type_k=f32, type_v=f32
    )
    try:
        assert json.loads(json.dumps(llm.metadata.get("tokenizer.chat_template"))) == (
            tokenizer.chat_template
        )
        for messages in PROMPTS:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
            expected = _hf_greedy(merged, ids)
            assert len(set(expected)) > 3, expected  # answers varied enough to tell apart
            if kind == "f32":
                assert _hf_greedy(peft_model, ids) == expected  # the adapter on its base
            assert _llama_cpp_greedy(llm, ids) == expected, messages
    finally:
        llm.close()
