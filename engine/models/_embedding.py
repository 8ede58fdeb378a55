"""The first layer of a preset: HF's causal-LM arguments in, token ids to hidden states,
the carry (`_carry`) started."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..errors import ConfigError
from ._carry import Carry, HeadOptions, MoeInfo, zero_router_stats

__all__ = ["EmbeddingLayer"]

# Arguments of HF's causal-LM forward that only make sense with a KV cache or per-layer
# outputs: accepted when they ask for nothing, refused otherwise.
_INERT_ARGUMENTS = ("past_key_values", "use_cache", "output_attentions", "output_hidden_states")


class EmbeddingLayer(nn.Module):
    """Layer 0: token ids -> hidden states; takes the preset model's forward arguments."""

    def __init__(self, embed_tokens: nn.Embedding, moe: MoeInfo | None = None) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.moe = moe

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        *,
        labels: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        logits_to_keep: int | Tensor = 0,
        return_dict: bool | None = None,
        num_items_in_batch: int | float | Tensor | None = None,
        output_router_logits: bool | None = None,
        return_logits: bool | None = None,
        **unsupported: Any,
    ) -> Carry:
        """Embed `input_ids` (mb, seq) and start the carry.

        Args:
            input_ids: Token ids, (mb, seq); or `inputs_embeds` (mb, seq, hidden) instead.
            attention_mask: 1 for tokens to attend to, 0 for padding, (mb, seq).
            position_ids: Positions for packed sequences, (mb, seq) or (1, seq); None means
                0..seq-1 in every row.
            labels: Token ids (mb, seq) for HF's causal-LM loss (shifted inside; -100 is
                ignored): the output then has `.loss`.
            logits_to_keep: HF's argument: an int keeps the logits of the last that many
                positions (0: all), a 1D tensor those positions. The loss always covers
                every position.
            return_dict: False returns HF's tuple (`output.to_tuple()`) instead.
            num_items_in_batch: HF's argument: `.loss` is the summed token loss divided by
                it instead of the micro-batch mean (pass the whole batch's count, e.g.
                `count_loss_tokens(labels)`, and the micro-batch losses add up to the
                batch mean).
            output_router_logits: MoE models: compute HF's router load-balancing loss
                (`.aux_loss`, added to `.loss` with `router_aux_loss_coef`); None takes the
                config's `output_router_logits`.
            return_logits: Whether the output has logits. None: yes, except where a loss is
                taken under autograd (the fused last stage of `forward_backward`, plain
                training), so training never builds the (tokens, vocab) tensor; pass True
                to get them there too. Without `labels` an explicit value keeps the
                original bare outputs: True gives the logits tensor, False the
                `(normed_hidden_states, lm_head_weight)` pair for `causal_lm_loss`.
        """
        for name, value in unsupported.items():
            if name not in _INERT_ARGUMENTS:
                raise ConfigError(
                    f"unexpected argument {name!r} for a RoundPipe preset model; it takes "
                    "input_ids, attention_mask, position_ids, labels, inputs_embeds, "
                    "logits_to_keep, return_dict, num_items_in_batch, output_router_logits "
                    "and return_logits"
                )
            if value:
                raise ConfigError(
                    f"{name}={value!r} is not supported by RoundPipe presets (no KV cache, "
                    "no per-layer outputs); leave it unset"
                )
        if (input_ids is None) == (inputs_embeds is None):
            raise ConfigError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is not None:
            if inputs_embeds.dim() != 3:
                raise ConfigError(
                    "inputs_embeds must be (batch, seq, hidden), got shape "
                    f"{tuple(inputs_embeds.shape)}"
                )
            hidden = inputs_embeds
        else:
            assert input_ids is not None
            if input_ids.dim() != 2:
                raise ConfigError(
                    f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}"
                )
            hidden = self.embed_tokens(input_ids)
        if labels is not None and labels.shape != hidden.shape[:2]:
            raise ConfigError(
                f"labels must be (batch, seq) like the input, got shape {tuple(labels.shape)} "
                f"for an input of {tuple(hidden.shape[:2])}"
            )
        router_stats = None
        want_router = False
        # The original bare outputs (see return_logits) have no room for an aux loss: the
        # config's default does not apply to them.
        bare = labels is None and return_logits is not None and return_dict is None
        if self.moe is not None:
            want_router = (
                self.moe.output_router_logits and not bare
                if output_router_logits is None
                else bool(output_router_logits)
            )
            if want_router:
                router_stats = zero_router_stats(self.moe.num_experts, hidden.device)
        options = HeadOptions(
            return_logits=return_logits,
            logits_to_keep=logits_to_keep,
            return_dict=return_dict,
            num_items_in_batch=num_items_in_batch,
            output_router_logits=want_router,
        )
        return (hidden, attention_mask, position_ids, labels, router_stats, options)
