"""A Hugging Face causal LM and its tokenizer, written as one GGUF file llama.cpp loads.

Written with `gguf`, the Python library llama.cpp publishes: its tensor-name map
(`TensorNameMap` of the architecture) names the tensors, its `SpecialVocab` reads the
merges and special-token ids from the tokenizer folder, its `quants` packs Q8_0. What this
module adds is the choice of llama.cpp architecture per family and the facts llama.cpp
needs that the name map does not carry:

- llama.cpp's ``llama`` architecture (Llama and Mistral) rotates interleaved pairs of a
  head's dimensions while transformers rotates its two halves, so the rows of q_proj and
  k_proj are permuted per head (pair ``i`` of a head takes rows ``i`` and ``i + d/2``);
  ``qwen2`` and ``qwen3`` rotate halves there too and are written as they are.
- Norms and biases stay float32 (llama.cpp adds them in f32); a Q8_0 export keeps a matrix
  whose rows are not whole 32-value blocks in f16.
- The vocabulary is the tokenizer's, padded with unused tokens to the embedding's rows,
  with its chat template (the one the model was trained in, docs/CHAT.md).

No llama.cpp here: tests/unit/rp_service/test_gguf_export.py reads a file back with
`gguf.GGUFReader` and runs the model from its tensors; the slow test compares greedy tokens
in llama.cpp itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

__all__ = ["FAMILIES", "GGUF_TYPES", "ExportError", "GgufType", "write_gguf"]

log = logging.getLogger(__name__)

GgufType = Literal["f32", "f16", "q8_0"]
GGUF_TYPES: tuple[GgufType, ...] = ("f32", "f16", "q8_0")

# HF model_type -> (llama.cpp architecture, whether q/k rows are permuted for its rope)
FAMILIES: dict[str, tuple[str, bool]] = {
    "llama": ("LLAMA", True),
    "mistral": ("LLAMA", True),
    "qwen2": ("QWEN2", False),
    "qwen3": ("QWEN3", False),
}

# The pre-tokenizer llama.cpp runs, told by the regex of the tokenizer's Split step: the
# GPT-4-style patterns of Qwen2/Qwen3 (digits one at a time) and Llama 3 (up to three).
_LETTERS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_PRE_TOKENIZERS = {
    _LETTERS + r"\p{N}" + _REST: "qwen2",
    _LETTERS + r"\p{N}{1,3}" + _REST: "llama-bpe",
}


class ExportError(ValueError):
    """The model or its tokenizer is something llama.cpp cannot load; says what and why."""


def _config_value(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, None)
    return default if value is None else value


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    scaling = params.get("rope_type") or (getattr(config, "rope_scaling", None) or {}).get(
        "rope_type"
    )
    if scaling not in (None, "default"):
        raise ExportError(
            f"the model's rope scaling {scaling!r} is not exported to GGUF here; export the "
            "Hugging Face folder and convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    return float(params.get("rope_theta") or _config_value(config, "rope_theta", 10000.0))


def _check_window(config: Any) -> None:
    """Refuse a sliding window shorter than the context: llama.cpp's llama and qwen2
    architectures attend to every position, so such a model would answer differently."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "model_type", None) == "qwen2" and not getattr(
        config, "use_sliding_window", False
    ):
        window = None
    positions = int(config.max_position_embeddings)
    if isinstance(window, int) and window < positions:
        raise ExportError(
            f"the model attends within a sliding window of {window} positions (of "
            f"{positions}); llama.cpp runs this architecture with full attention, so the GGUF "
            "would answer differently past the window: not exported"
        )


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows from transformers' half-split rope order to llama.cpp's pairwise one."""
    rows = weight.shape[0]
    # (heads, 2 halves, d/2, in) -> (heads, d/2, 2, in): row i of the first half and row i
    # of the second become neighbours
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def _tensors(
    model: Any, config: Any, arch: Any, permute: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    names = gguf.TensorNameMap(arch, config.num_hidden_layers)
    tied = bool(_config_value(config, "tie_word_embeddings", False))
    heads, kv_heads = (
        config.num_attention_heads,
        _config_value(config, "num_key_value_heads", config.num_attention_heads),
    )
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and tied:
            continue  # llama.cpp reads the output projection from token_embd
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ExportError(
                f"llama.cpp's {arch.name.lower()} architecture has no tensor for {key!r}; "
                "this model cannot be exported to GGUF"
            )
        tensor = value.detach().to(torch.float32)
        if permute and key.endswith("self_attn.q_proj.weight"):
            tensor = _permute(tensor, heads)
        elif permute and key.endswith("self_attn.k_proj.weight"):
            tensor = _permute(tensor, kv_heads)
        yield name, tensor


def _encode(tensor: torch.Tensor, kind: GgufType) -> tuple[np.ndarray, Any]:
    """The array to write and its GGML type (None: the array's own, f32 or f16)."""
    import gguf

    data = tensor.numpy()
    if tensor.dim() < 2 or kind == "f32":
        return data.astype(np.float32), None
    if kind == "q8_0" and data.shape[-1] % 32 == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.quantize(data, qtype), qtype
    return data.astype(np.float16), None


def _pre_tokenizer(tokenizer_json: dict[str, Any]) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer, or ExportError."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    patterns = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if not patterns and byte_level and not byte_level[0].get("use_regex", True):
        if tokenizer_json.get("model", {}).get("merges"):
            raise ExportError("a byte-level tokenizer with merges but no split is not supported")
        return "default"  # no merges: every byte is a token, whatever the split
    for pattern in patterns:
        if pattern in _PRE_TOKENIZERS:
            return _PRE_TOKENIZERS[pattern]
    raise ExportError(
        "the tokenizer's pre-tokenizer is none llama.cpp is known here to reproduce (Qwen2/3, "
        "Llama 3, the built-in byte tokenizer); export the Hugging Face folder and convert it "
        "with llama.cpp's convert_hf_to_gguf.py"
    )


def _vocab(writer: Any, tokenizer: Any, folder: Path, rows: int) -> None:
    """The token list, types, merges, special ids and chat template of `tokenizer`."""
    import gguf

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"{folder} has no tokenizer.json: GGUF needs the fast tokenizer's files")
    tokenizer_json = json.loads(path.read_text())
    model = tokenizer_json.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ExportError(
            "only byte-level BPE tokenizers (GPT-2 style: Qwen, Llama 3, the built-in one) are "
            f"exported to GGUF here; this one is {model.get('type')!r}"
            + (" with byte fallback (SentencePiece-like)" if model.get("byte_fallback") else "")
        )
    vocab = tokenizer.get_vocab()
    if len(vocab) > rows:
        raise ExportError(f"the tokenizer has {len(vocab)} tokens, the embedding {rows} rows")
    by_id = {i: t for t, i in vocab.items()}
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    added = {t.content for t in tokenizer.added_tokens_decoder.values()}
    tokens, types = [], []
    for i in range(rows):
        text = by_id.get(i)
        if text is None:  # the embedding's rows past the tokenizer (preset rounding)
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(text)
        if text in special:
            types.append(gguf.TokenType.CONTROL)
        elif text in added:
            types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(tokenizer_json))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special_vocab = gguf.SpecialVocab(folder, load_merges=True, n_vocab=rows)
    if not special_vocab.merges:
        # llama.cpp requires the key; a merge of two ids whose join is no token never fires
        special_vocab.merges = ["Ġ Ġ"] if "ĠĠ" not in vocab else []
    special_vocab.chat_template = tokenizer.chat_template or None
    special_vocab.add_to_gguf(writer, quiet=True)


def write_gguf(model: Any, tokenizer: Any, tokenizer_dir: str | Path, out: str | Path, *,
               kind: GgufType = "f16", name: str = "model") -> Path:  # fmt: skip
    """Write `model` (a transformers causal LM, weights on the CPU) and `tokenizer` (loaded
    from `tokenizer_dir`) to the GGUF file `out`; return `out`.

    Raises:
        ExportError: a family, rope scaling or tokenizer llama.cpp cannot load, or no
            `gguf` library installed.
    """
    try:
        import gguf
    except ImportError:
        raise ExportError(
            "the gguf library is not installed on the daemon's host: pip install "
            "'rp-service[export]'"
        ) from None

    config = model.config
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise ExportError(
            f"model type {family!r} is not exported to GGUF; these are: {', '.join(FAMILIES)}"
        )
    if kind not in GGUF_TYPES:
        raise ExportError(f"GGUF type {kind!r}: use one of {', '.join(GGUF_TYPES)}")
    _check_window(config)
    arch_name, permute = FAMILIES[family]
    arch = getattr(gguf.MODEL_ARCH, arch_name)
    heads = config.num_attention_heads
    head_dim = _config_value(config, "head_dim", config.hidden_size // heads)
    out = Path(out)
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(name)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(heads))
    writer.add_head_count_kv(int(_config_value(config, "num_key_value_heads", heads)))
    writer.add_key_length(int(head_dim))
    writer.add_value_length(int(head_dim))
    writer.add_rope_dimension_count(int(head_dim))
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[kind]
    writer.add_file_type(int(file_type))
    _vocab(writer, tokenizer, Path(tokenizer_dir), int(config.vocab_size))
    with torch.no_grad():
        for tensor_name, tensor in _tensors(model, config, arch, permute):
            data, qtype = _encode(tensor, kind)
            writer.add_tensor(tensor_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    log.info("wrote %s (%s, %s)", out, arch_name.lower(), kind)
    return out
