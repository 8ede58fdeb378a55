"""The last layer of a preset: final norm, then HF's causal-LM output from the carry.

The loss is taken from the final hidden states chunk by chunk, so the (tokens, vocab)
logits never exist in full for it (`loss.ChunkedCrossEntropy`); the logits themselves are
only computed where they are returned.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..context import doing_recompute
from ._carry import Carry, MoeInfo
from .loss import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    IGNORE_INDEX,
    chunked_cross_entropy_sum,
    shift_labels,
)

__all__ = ["LMHeadLayer"]


class LMHeadLayer(nn.Module):
    """Last layer: final norm, then HF's causal-LM output (`.loss`, `.logits`, `.aux_loss`).

    With `labels`, `.loss` is taken by the chunked cross-entropy straight from the normed
    hidden states (no (tokens, vocab) logits for it) and is HF's loss of this micro-batch;
    `.logits` are computed only where they are returned (see `EmbeddingLayer`'s
    `return_logits`).
    """

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, moe: MoeInfo | None = None) -> None:
        super().__init__()
        if lm_head.bias is not None:
            raise NotImplementedError(
                "the causal-LM head preset supports lm_head without bias only"
            )
        self.norm = norm
        self.lm_head = lm_head
        self.moe = moe
        self.loss_chunk_tokens = DEFAULT_LOSS_CHUNK_TOKENS

    def forward(self, carry: Carry) -> Any:
        """Return the HF output object (a tuple with return_dict=False), or, for an
        explicit `return_logits` without labels, the logits or the training pair."""
        from ._outputs import (
            CausalLMOutput,
            LossSpec,
            MoeCausalLMOutput,
            OutputTuple,
            build_output,
        )

        hidden, _, _, labels, router_stats, options = carry
        hidden = self.norm(hidden)
        if (
            labels is None
            and router_stats is None
            and options.return_logits is not None
            and options.return_dict is None
        ):
            if options.return_logits:
                return self.lm_head(_keep_positions(hidden, options.logits_to_keep))
            return (hidden, self.lm_head.weight)
        want_logits = options.return_logits
        if want_logits is None:
            # Left out only where a loss is taken right here under autograd (the fused last
            # stage of forward_backward, plain use); a no-grad forward and its recompute
            # must agree on the output's structure, so both keep them.
            want_logits = labels is None or not torch.is_grad_enabled() or doing_recompute()
        parts: dict[str, Tensor] = {}
        ce_mode = None
        if labels is not None:
            targets = shift_labels(labels, IGNORE_INDEX).reshape(-1)
            total = chunked_cross_entropy_sum(
                hidden.reshape(-1, hidden.shape[-1]),
                self.lm_head.weight,
                targets,
                chunk_tokens=self.loss_chunk_tokens,
            )
            items = options.num_items_in_batch
            if items is None:
                ce_mode = "mean"
                parts["ce_sum"] = total.reshape(1)
                parts["ce_count"] = (targets != IGNORE_INDEX).sum().reshape(1)
            else:
                ce_mode = "items"
                if isinstance(items, Tensor):
                    items = items.to(total.device)
                parts["ce_loss"] = (total / items).reshape(1)
        spec = LossSpec(ce_mode)
        if router_stats is not None:
            assert self.moe is not None
            counts, probs, rows = router_stats
            parts["router_counts"] = counts.unsqueeze(0)
            parts["router_probs"] = probs.unsqueeze(0)
            parts["router_rows"] = rows.reshape(1)
            spec = LossSpec(ce_mode, self.moe.num_experts, self.moe.aux_coef)
        fields: dict[str, Any] = {}
        if want_logits:
            fields["logits"] = self.lm_head(_keep_positions(hidden, options.logits_to_keep))
        cls = CausalLMOutput if self.moe is None else MoeCausalLMOutput
        out = build_output(cls, fields, parts or None, spec if parts else None)
        return OutputTuple.of(out) if options.return_dict is False else out


def _keep_positions(hidden: Tensor, logits_to_keep: int | Tensor) -> Tensor:
    """HF's `logits_to_keep`: the last N positions (0: all), or the given positions."""
    if isinstance(logits_to_keep, int):
        return hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:, :]
    return hidden[:, logits_to_keep.to(hidden.device), :]
