"""Chat serving on a GPU: the serving process's generate runs on CUDA (its stop criterion
once returned a CPU tensor that generate ORs into its CUDA flags) and gives what
transformers' greedy generate gives on the same weights, with and without a folded adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class _Out:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, **message: Any) -> None:
        self.sent.append(message)


def _folders(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny model with a word-level tokenizer (each id decodes to a whole word, so the
    streamed text is the ids' text; random bytes would not be valid UTF-8) with ChatML as
    its chat template, and a random adapter."""
    from peft import LoraConfig, get_peft_model

    from bench.chat_latency import word_tokenizer
    from tests.tiny_models import tiny_model

    def model() -> Any:
        return tiny_model("qwen3", seed=3, vocab_size=264, tie_word_embeddings=False)

    base = model()
    base.generation_config.eos_token_id = None  # decode exactly max_tokens
    base.save_pretrained(tmp_path / "base")
    word_tokenizer(264).save_pretrained(tmp_path / "base")
    torch.manual_seed(5)
    peft = get_peft_model(
        model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    peft.save_pretrained(tmp_path / "adapter")
    return tmp_path / "base", tmp_path / "adapter"


@pytest.mark.parametrize(("fold", "compiled"), [(False, False), (True, False), (True, True)])
def test_generate_on_cuda_matches_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fold: bool, compiled: bool
) -> None:
    """`compiled`: each state (the base, the adapter) is answered eagerly once, then its
    decoding step is compiled (the static KV cache) and the next answer uses it; compared
    with transformers' generate with the same options (compiled kernels round bf16
    differently from eager)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rp_service.serving.models import BaseModel
    from rp_service.serving.process import Server, static_cache_tokens

    monkeypatch.setenv("RP_SERVE_COMPILE", "1" if compiled else "0")

    base_dir, adapter = _folders(tmp_path)
    out = _Out()
    server = Server(BaseModel(path=str(base_dir)), device="cuda:0", out=out, fold_adapters=fold)
    messages = [{"role": "user", "content": "Say something."}]
    # (adapter, decoded with the compiled step)
    asked = [(None, False), (None, True), (str(adapter), False), (str(adapter), True)]
    if not compiled:
        asked = [(None, False), (str(adapter), False)]
    for k, (which, _) in enumerate(asked):
        server.answer(
            {"id": f"r{k}", "messages": messages, "tokenizer": str(base_dir), "adapter": which,
             "max_tokens": 12, "temperature": 0.0, "top_p": None, "seed": None, "stop": []}
        )  # fmt: skip
    done = [m for m in out.sent if m["type"] == "done"]
    assert [m["completion_tokens"] for m in done] == [12] * len(asked), out.sent
    texts = ["".join(m["text"] for m in out.sent if m["id"] == f"r{k}" and m["type"] == "delta")
             for k in range(len(asked))]  # fmt: skip
    assert server.compiled == ({None: True, str(adapter): True} if compiled else {})

    tok = AutoTokenizer.from_pretrained(base_dir)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]], device="cuda:0")
    reference = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16).cuda()
    static = {
        "cache_implementation": "static",
        "max_cache_len": static_cache_tokens(
            ids.shape[1] + 12, reference.config.max_position_embeddings
        ),
    }
    expected: dict[tuple[str | None, bool], str] = {}
    for which in (None, str(adapter)):  # the base first: peft injects the adapter in place
        model = reference if which is None else PeftModel.from_pretrained(reference, adapter)
        for use_static in (False, True):
            new = model.eval().generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                do_sample=False, eos_token_id=None, pad_token_id=0,
                **(static if use_static else {}),
            )[0, ids.shape[1]:]  # fmt: skip
            expected[which, use_static] = tok.decode(new, skip_special_tokens=True)
    for (which, use_static), got in zip(asked, texts, strict=True):
        if which is None or not fold:  # folded bf16 weights round unlike peft's unmerged LoRA
            assert got == expected[which, use_static], (which, use_static)
    assert texts[-1] != texts[0]  # the adapter changes the answer
