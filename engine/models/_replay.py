"""When a decoder layer's call may be replayed as a CUDA graph, and under which key.

`engine.accel.graphs` asks a layer `rp_replay_key(carry)`: what the call depends on besides
its tensors' values, or None where it must run as it is. Two layers with equal keys share
one graph, so the key starts with what makes two decoder layers compute the same function
(`replay_identity`).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._attention import attention_mode
from ._carry import Carry
from ._compile import HALF_DTYPES

if TYPE_CHECKING:
    from ._decoder import DecoderLayer

__all__ = ["replay_identity", "replay_key"]


def _config_digest(config: Any) -> str:
    """A digest of a HF config's values (equal configs, equal digests)."""
    values = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    return hashlib.sha1(repr(sorted(values.items(), key=str)).encode()).hexdigest()


def replay_identity(decoder: nn.Module, layer: nn.Module, config: Any) -> tuple[str, str, str]:
    """What makes two decoder layers compute the same function: the classes and the
    model's config."""
    return (type(decoder).__qualname__, type(layer).__qualname__, _config_digest(config))


def replay_key(decoder: DecoderLayer, carry: Carry) -> tuple[Any, ...] | None:
    """`decoder`'s replay key for this call (see `DecoderLayer.rp_replay_key`).

    Replayed: the compiled half-precision CUDA path on plain causal attention (no
    padding mask, no positions, no sliding window shorter than the sequence), without
    dropout, MLP chunking or router statistics; the attention saved or replayed as in
    any call.
    """
    hidden, attention_mask, position_ids, _, router_stats, _ = carry
    if attention_mask is not None or position_ids is not None or router_stats is not None:
        return None
    compiled = decoder.use_compile and decoder.compilable
    if not (compiled and hidden.is_cuda and hidden.dtype in HALF_DTYPES):
        return None
    if decoder.chunks_mlp(hidden) or decoder.draws_random():
        return None
    if decoder.causal_mask(hidden, None, None) is not None:
        return None
    return (
        decoder.replay_identity,
        decoder.sliding,
        attention_mode(decoder, hidden, None),
        tuple(hidden.shape),
        hidden.dtype,
        hidden.device,
        torch.is_grad_enabled(),
    )
