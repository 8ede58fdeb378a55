"""The model shapes the benchmarks build, randomly initialised on the host in seconds, and
their parameter and FLOP counts (bench/train.py and its neighbours use them).

Weights are allocated without HF's initialisers and filled with normal(0, 0.02) from one
pool in place (no download), so the 1.7B shape is built in seconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "SHAPES",
    "build_model",
    "config_fields",
    "count_active_params",
    "count_base_params",
    "count_params",
    "flops_per_token",
]

_QWEN3_30B_A3B: dict[str, Any] = {
    "family": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}

_TINY: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
    "tie_word_embeddings": True,
}

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": {
        "hidden_size": 2048,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 6144,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen3-4b": {
        "hidden_size": 2560,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 9728,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    # ~8.2 B parameters: ~165 GB of host memory with the fp32 optimizer (the 8-GPU machine)
    "qwen3-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    # ~14.8 B parameters: 178 GB at 12 bytes a parameter, ~98 GiB with --optim-memory
    # compact --recompute-attention (issue 35, bench/host_lean.py)
    "qwen3-14b": {
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 17408,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    # Mixture of experts (Qwen3MoeForCausalLM, "family" picks the class). Qwen3-30B-A3B:
    # 30.5 B parameters, 3.3 B active per token (8 of 128 experts per layer); a full
    # fine-tune needs ~512 GiB of host memory at 18 bytes per parameter (fp16/bf16 copy,
    # fp32 master, Adam m and v, fp32 gradient), so on the 125 GiB box it needs --lora.
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    # The same decoder layers (and routing), 6 of the 48: 4.36 B parameters, 0.96 B active
    # per token (embedding and head included); a full fine-tune at 18 bytes per parameter
    # is ~73 GiB of host memory.
    "qwen3-30b-a3b-6l": {**_QWEN3_30B_A3B, "num_hidden_layers": 6},
    "tiny-moe": {
        **_TINY,
        "family": "qwen3_moe",
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    # hidden 5120, 64 layers, 64 query / 8 kv heads of 128, intermediate 25600: ~33 B
    # parameters, 66 GB in fp16 (LoRA only: the fp32 optimizer would need ~530 GB)
    "qwen3-32b": {
        "hidden_size": 5120,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 25600,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    # Qwen3-1.7B's structure (28 decoder layers, the same kernels per layer and micro-batch)
    # with tiny matrices: its step time is the host's time to issue the work
    # (bench/simulate.py --dispatch).
    "tiny28": {**_TINY, "num_hidden_layers": 28, "intermediate_size": 192},
    "tiny": _TINY,
    # Qwen3-1.7B's vocabulary, head layout and tied head with 4 small decoder layers (~41 M
    # parameters, 39 M of them the embedding): issue 35's accuracy case at a size a CPU
    # trains for 200 steps in minutes (the CPU replay in bench/host_lean.py's FP32_MASTER note).
    "qwen3-small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 768,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
}


def config_fields(name: str) -> dict[str, Any]:
    """The HF config fields of shape `name` less `tie_word_embeddings`, for the benches
    that build their own config and set the tying themselves (qlora, chat_latency)."""
    return {k: v for k, v in SHAPES[name].items() if k != "tie_word_embeddings"}


@contextlib.contextmanager
def _no_hf_init() -> Iterator[None]:
    """Skip HF's and torch's weight initialisers (the weights are filled afterwards)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older 5.x releases keep it in modeling_utils
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        yield


def build_model(
    name: str,
    dtype: torch.dtype,
    attn: str,
    seed: int,
    *,
    layers: int | None = None,
    seq_len: int = 0,
) -> nn.Module:
    """A randomly initialised Qwen3ForCausalLM (Qwen3MoeForCausalLM for a MoE shape) of the
    named shape, on the host, in `dtype`; `layers` keeps the first N decoder layers, and
    the position limit covers `seq_len`."""
    import transformers

    shape = dict(SHAPES[name])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    family = shape.pop("family", "qwen3")
    prefix = {"qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}[family]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")
    positions = max(40960, seq_len)
    config = config_cls(**shape, max_position_embeddings=positions, rope_theta=1e6, use_cache=False)
    config._attn_implementation = attn
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate straight in the model dtype
    try:
        with _no_hf_init():
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    fill_random(model, seed)
    if config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        model.tie_weights()
    return model.train()


# Random values are drawn once into a pool of prime length and copied into the weights
# (a different offset for each): a copy runs at memory speed where drawing 1.7B normals
# took over a minute on the host; a prime period never aligns with a weight's rows.
_POOL_LEN = 16_777_259


def fill_random(model: nn.Module, seed: int) -> None:
    """Fill weights with normal(0, 0.02) values from a shared pool; norm weights with 1."""
    gen = torch.Generator().manual_seed(seed)
    pool: torch.Tensor | None = None
    offset = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if pool is None or pool.dtype != p.dtype:
                pool = (torch.randn(_POOL_LEN, generator=gen) * 0.02).to(p.dtype)
            flat, pos = p.view(-1), 0
            while pos < flat.numel():
                start = offset % _POOL_LEN
                take = min(flat.numel() - pos, _POOL_LEN - start)
                flat[pos : pos + take].copy_(pool[start : start + take])
                pos, offset = pos + take, offset + take


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once


def count_base_params(model: nn.Module) -> int:
    """Parameters without LoRA adapters (peft's and engine.adapters.lora's are named lora_*)."""
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)


def count_active_params(model: nn.Module) -> int:
    """Base parameters a token goes through: an MoE layer's experts count top_k / num_experts."""
    c = model.config
    experts = getattr(c, "num_experts", 0)
    if not experts:
        return count_base_params(model)
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    idle = expert_params * (experts - c.num_experts_per_tok) // experts
    return count_base_params(model) - idle


def flops_per_token(model: nn.Module, seq_len: int, lora: bool = False) -> float:
    """6N for the matmuls (forward + backward; N the active parameters of an MoE) + 6 L S h
    d for causal attention scores; LoRA: 4N (no weight gradients of the frozen base) + the
    same attention term."""
    c = model.config
    attention = 6 * c.num_hidden_layers * seq_len * c.num_attention_heads * c.head_dim
    return (4 if lora else 6) * count_active_params(model) + attention
