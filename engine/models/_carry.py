"""The tuple that flows between a preset's layers (the "carry"), and its parts.

A preset turns a Hugging Face `*ForCausalLM` into an `nn.Sequential` of

    EmbeddingLayer  -> DecoderLayer x N -> LMHeadLayer

(`_sequential.build_causal_lm_sequential`). Between those layers flows one tuple:

    (hidden_states, attention_mask, position_ids, labels, router_stats, options)

`hidden_states` is (mb, seq, hidden); `attention_mask` is the caller's 2D padding mask
(mb, seq) or None; `position_ids` is the caller's (mb, seq) / (1, seq) tensor or None (then
0..seq-1 per sequence); `labels` the caller's (mb, seq) labels or None; `router_stats` the
running sums of HF's load-balancing loss over the MoE layers so far, or None (see `_moe`);
`options` the caller's output switches (`HeadOptions`). Only these small inputs travel:
every decoder layer builds its rotary cos/sin and its causal mask on its own device,
because a (mb, 1, seq, seq) mask or the (mb, seq, head_dim) cos/sin pair would cost
transfer bandwidth at every stage boundary (for the default positions the cos/sin are
computed once per device and length, see `_rotary`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Carry", "HeadOptions", "MoeInfo", "zero_router_stats"]


class HeadOptions(NamedTuple):
    """The caller's output switches, carried from the first layer to the head."""

    return_logits: bool | None = None
    logits_to_keep: int | Tensor = 0
    return_dict: bool | None = None
    num_items_in_batch: int | float | Tensor | None = None
    output_router_logits: bool = False


class MoeInfo(NamedTuple):
    """What HF's load-balancing loss needs to know about a mixture-of-experts model."""

    num_experts: int
    top_k: int
    aux_coef: float  # HF's router_aux_loss_coef
    output_router_logits: bool  # the config's default for the argument of that name


# (hidden, attention_mask, position_ids, labels, router_stats, options)
Carry = tuple[
    Tensor, Tensor | None, Tensor | None, Tensor | None, tuple[Tensor, ...] | None, HeadOptions
]


def zero_router_stats(num_experts: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Empty sums for HF's load-balancing loss: top-k counts and routing probabilities per
    expert, and the number of routed rows (int64 counts stay exact at any size)."""
    return (
        torch.zeros(num_experts, dtype=torch.int64, device=device),
        torch.zeros(num_experts, dtype=torch.float32, device=device),
        torch.zeros((), dtype=torch.int64, device=device),
    )
