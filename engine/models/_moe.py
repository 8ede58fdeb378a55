"""Mixture-of-experts decoder layers: HF's layer as it is, plus the router statistics.

An HF MoE decoder layer holds its router and all its experts (Qwen3-MoE and GPT-OSS keep
the experts as 3D parameters of one module), so the experts are uploaded and streamed with
their layer like any other weight; the HF layer computes the routing and the experts.

What the preset adds is HF's router load-balancing loss (`load_balancing_loss_func`, the
Switch Transformer loss), which HF computes at the end from the router logits of every
layer. Here each layer reduces its own router logits at once to three running sums that
travel in the carry: top-k assignments per expert, summed routing probabilities per
expert, and routed rows (padding excluded with the attention mask, as HF does). The head
divides them exactly as HF does, so no (tokens, experts) tensor per layer is kept.

The router's logits are taken with a forward hook on the router module, which HF itself
records them from (`OutputRecorder(..., index=0)`), installed only while the layer runs
and only when the loss is wanted. MoE layers run eagerly, never under torch.compile: the
routing is data-dependent and the hook would not survive tracing.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from ._carry import Carry, MoeInfo
from ._decoder import DecoderLayer

__all__ = ["MoeDecoderLayer", "add_router_stats", "moe_info"]

log = logging.getLogger(__name__)


class MoeDecoderLayer(DecoderLayer):
    """`DecoderLayer` that adds its routers' statistics to the carry's running sums.

    Args:
        router_class: Class name of the HF router module (its output 0 is the logits).
        top_k: Experts per token (HF's `num_experts_per_tok`).
    """

    compilable = False
    # The router's statistics and the experts' batches see the whole micro-batch.
    mlp_is_dense = False

    def __init__(
        self,
        layer: nn.Module,
        rotary_emb: nn.Module,
        config: Any,
        layer_idx: int,
        *,
        router_class: str,
        top_k: int,
    ) -> None:
        super().__init__(layer, rotary_emb, config, layer_idx)
        self.top_k = top_k
        # Paths, not modules: the engine runs device-side copies of this layer, and the
        # hook must go on the copy that runs.
        self.router_paths = [
            name for name, m in layer.named_modules() if type(m).__name__ == router_class
        ]

    def forward(self, carry: Carry) -> Carry:
        hidden, attention_mask, position_ids, labels, router_stats, options = carry
        if router_stats is None or not self.router_paths:
            out = self.run_layer(hidden, attention_mask, position_ids)
            return (out, attention_mask, position_ids, labels, router_stats, options)
        captured: list[Tensor] = []

        def keep_logits(module: nn.Module, inputs: Any, output: Any) -> None:
            captured.append(output[0] if isinstance(output, tuple) else output)

        handles = [
            self.layer.get_submodule(path).register_forward_hook(keep_logits)
            for path in self.router_paths
        ]
        try:
            out = self.run_layer(hidden, attention_mask, position_ids)
        finally:
            for handle in handles:
                handle.remove()
        if len(captured) != len(self.router_paths):
            raise ConfigError(
                f"the router of this {type(self.layer).__name__} did not run (a replaced MoE "
                "forward, e.g. a hub kernel?); the router auxiliary loss needs it: pass "
                "output_router_logits=False or use transformers' own MoE forward"
            )
        for logits in captured:
            router_stats = add_router_stats(router_stats, logits, attention_mask, self.top_k)
        return (out, attention_mask, position_ids, labels, router_stats, options)


def add_router_stats(
    stats: tuple[Tensor, ...], router_logits: Tensor, attention_mask: Tensor | None, top_k: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Add one layer's router logits (tokens, experts) to the running sums, as HF's
    `load_balancing_loss_func` reduces each layer (softmax over all experts, top-k of it)."""
    counts, probs, rows = stats
    weights = torch.nn.functional.softmax(router_logits, dim=-1)
    _, selected = torch.topk(weights, top_k, dim=-1)
    flat_selected = selected.reshape(-1)
    if attention_mask is None:
        ones = torch.ones_like(flat_selected, dtype=torch.int64)
        counts = counts + torch.zeros_like(counts).scatter_add_(0, flat_selected, ones)
        probs = probs + weights.float().sum(dim=0)
        rows = rows + weights.shape[0]
    else:
        mask = attention_mask.reshape(-1).to(router_logits.device)
        per_choice = mask.to(torch.int64).repeat_interleave(top_k)
        counts = counts + torch.zeros_like(counts).scatter_add_(0, flat_selected, per_choice)
        probs = probs + (weights.float() * mask.to(torch.float32).unsqueeze(-1)).sum(dim=0)
        rows = rows + mask.to(torch.int64).sum()
    return counts, probs, rows


def moe_info(model: nn.Module, num_experts: int, top_k: int) -> MoeInfo:
    """`MoeInfo` from a HF MoE causal LM (its `router_aux_loss_coef` and config)."""
    config = model.config
    coef = getattr(model, "router_aux_loss_coef", None)
    if coef is None:
        coef = config.router_aux_loss_coef
    log.info(
        "%s: MoE decoder layers run eagerly (no torch.compile: data-dependent routing)",
        type(model).__name__,
    )
    return MoeInfo(
        num_experts=num_experts,
        top_k=top_k,
        aux_coef=float(coef),
        output_router_logits=bool(getattr(config, "output_router_logits", False)),
    )
