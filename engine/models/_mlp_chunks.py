"""The dense decoder layer's MLP half over token chunks, for long micro-batches.

A decoder layer whose micro-batch has more tokens than `DecoderLayer.mlp_chunk_tokens`
runs as two halves: the attention half (norm, attention, residual) on the whole
micro-batch, then the MLP half (norm, MLP, residual), which treats every token alike, on
chunks of tokens, each recomputed in its backward (`run_chunked`). Only HF's pre-norm
layer with a dense gated MLP splits so (`has_split_halves`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..context import recompute_data_or_none, save_for_recompute
from ._attention import SLOT_KWARG, saving_attention
from ._compile import compile_for_devices

__all__ = [
    "DEFAULT_MLP_CHUNK_SIZE",
    "DEFAULT_MLP_CHUNK_TOKENS",
    "has_split_halves",
    "run_chunked",
]

# A decoder layer whose micro-batch has more tokens than this runs its MLP half chunk by
# chunk (see DecoderLayer.mlp_chunk_tokens). The MLP's three (tokens, intermediate) tensors
# (gate and up projections, act * up) are what autograd keeps most of (measured share:
# bench/RESULTS.md, "Figures moved out of engine docstrings").
# Above 128k tokens a micro-batch they decide whether a layer group fits; at or below it
# the unchunked (one compiled graph) path runs as before, so throughput at the usual
# 2048..131072 tokens is untouched.
DEFAULT_MLP_CHUNK_TOKENS = 131072
# Tokens per MLP chunk: 32768 x 6144 (Qwen3-1.7B's intermediate size) x 2 bytes is 384 MiB
# per (chunk, intermediate) tensor, a tenth of the 327,680-token micro-batch's, while each
# chunk's GEMMs still have 32768 rows, as many as a micro-batch of one 32k sequence.
DEFAULT_MLP_CHUNK_SIZE = 32768


def run_chunked(args: tuple[Any, ...], mode: str | None, compiled: bool, chunk_size: int) -> Tensor:
    """The layer as HF runs it, with the MLP half over chunks of `chunk_size` tokens.

    `args` = (layer, hidden, mask, positions, cos, sin); `mode` as
    `_attention.attention_mode`; `compiled`: through torch.compile. Under grad each chunk
    runs under `torch.utils.checkpoint`: autograd keeps only the
    chunk's input (a view of the attention half's output, which the post-attention
    norm would keep anyway) and recomputes the chunk's MLP in the backward, so no
    (tokens, intermediate) tensor of the whole micro-batch is ever alive. Under no_grad
    the chunks just run one after the other. The attention half keeps the saved
    attention slot ("save"/"replay") exactly as the whole layer
    does. The checkpoint stays outside the compiled functions (dynamo would have to
    trace it); each compiled body is an ordinary autograd function to it.
    """
    if mode == "save":
        call = _compiled_attention_half_saving() if compiled else _attention_half_saving
        hidden, attn_out, attn_lse = call(*args)
        save_for_recompute(attn_out, attn_lse)
    else:
        call = _compiled_attention_half() if compiled else _attention_half
        hidden = call(*args, recompute_data_or_none() if mode == "replay" else None)
    body = _compiled_mlp_half() if compiled else _mlp_half
    layer = args[0]
    flat = hidden.reshape(-1, hidden.shape[-1])  # (tokens, hidden)
    grad = torch.is_grad_enabled()
    parts = []
    for start in range(0, flat.shape[0], chunk_size):
        # Every chunk but the last has chunk_size rows: under torch.compile
        # (dynamic=False, one graph per shape) that is at most two graphs per grad mode.
        piece = flat[start : start + chunk_size]
        if grad:
            parts.append(checkpoint(body, layer, piece, use_reentrant=False))
        else:
            parts.append(body(layer, piece))
    return torch.cat(parts).view(hidden.shape)


def has_split_halves(layer: nn.Module) -> bool:
    """Whether `layer` is HF's pre-norm decoder layer with a dense gated MLP.

    That is Llama's layer, which Qwen2, Qwen3 and Mistral repeat: exactly the children
    `input_layernorm`, `self_attn`, `post_attention_layernorm` and `mlp`, the MLP holding
    `gate_proj`, `up_proj` and `down_proj` (nn.Linear, or LoRA's wrappers of them) and its
    activation. Layers with other norms around the MLP (Gemma, OLMo-2) or a router differ
    in their children and are run whole.
    """
    children = {name for name, _ in layer.named_children()}
    if children != {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}:
        return False
    mlp_children = {name for name, _ in layer.mlp.named_children()}
    projections = {"gate_proj", "up_proj", "down_proj"}
    return projections <= mlp_children <= projections | {"act_fn"}


def _attention_half(
    layer: nn.Module,
    hidden: Tensor,
    mask: Tensor | None,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    attention: Any = None,
) -> Tensor:
    """The first half of the HF decoder layer: hidden + self_attn(input_layernorm(hidden)).

    The attention gets the arguments HF's decoder layer gives it (transformers 5.x
    Llama/Qwen2/Qwen3/Mistral: no cache, so `past_key_values=None`, `use_cache=False`),
    plus the attention slot (see `_layer_calls._decoder_call`).
    """
    kwargs = {} if attention is None else {SLOT_KWARG: attention}
    out = layer.self_attn(
        hidden_states=layer.input_layernorm(hidden),
        attention_mask=mask,
        position_ids=positions,
        past_key_values=None,
        use_cache=False,
        position_embeddings=(cos, sin),
        **kwargs,
    )
    return hidden + out[0]


# `_attention_half` that also returns the attention output and log-sum-exp.
_attention_half_saving = saving_attention(_attention_half)


def _mlp_half(layer: nn.Module, hidden: Tensor) -> Tensor:
    """The second half of the HF decoder layer on (tokens, hidden) states: it treats every
    token alike, so it runs on any chunk of them."""
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


@functools.cache
def _compiled_attention_half() -> Callable[..., Tensor]:
    """`_attention_half` under torch.compile (see `_layer_calls._compiled_decoder_call`)."""
    return compile_for_devices(_attention_half)


@functools.cache
def _compiled_attention_half_saving() -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """`_attention_half_saving` under torch.compile (see `_layer_calls._compiled_decoder_call`)."""
    return compile_for_devices(_attention_half_saving)


@functools.cache
def _compiled_mlp_half() -> Callable[..., Tensor]:
    """`_mlp_half` under torch.compile: one chunk's norm, SwiGLU and residual fused."""
    return compile_for_devices(_mlp_half)
