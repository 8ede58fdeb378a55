"""Hugging Face-style outputs of the presets, and how they merge over micro-batches.

The head layer returns a `CausalLMOutput` (a `transformers` `CausalLMOutputWithPast`) or,
for mixture-of-experts families, a `MoeCausalLMOutput` (`MoeCausalLMOutputWithPast`).
Within one micro-batch `.loss` is exactly what the HF model returns for that micro-batch:
the mean cross-entropy over its non-ignored tokens (or their sum divided by
`num_items_in_batch` when the caller passes it), plus `router_aux_loss_coef * aux_loss`
where the HF model adds it.

A loss is not additive over micro-batches (a mean of means is not the batch mean, and the
router auxiliary loss is a product of two batch averages), so these outputs keep the
additive pieces of their losses (`LossParts`) and are registered with `torch.utils._pytree`
to flatten into those pieces instead of `.loss` / `.aux_loss`. The engine moves, merges
(concatenates) and backpropagates flattened leaves; rebuilding an output recomputes
`.loss` and `.aux_loss` from its pieces. So the merged output of `RoundPipe.forward` over
several micro-batches carries the `.loss` (and `.aux_loss`) of the whole batch, as the HF
model would compute it on the whole batch, and `.loss.backward()` sends each micro-batch
the gradient of that batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

__all__ = [
    "CausalLMOutput",
    "LossSpec",
    "MoeCausalLMOutput",
    "OutputTuple",
    "build_output",
]

# The additive pieces, each with a leading micro-batch dimension of 1 (merged: one row
# per micro-batch):
#   ce_sum (fp32) and ce_count (int64): summed token cross-entropy and counted tokens;
#   ce_loss (fp32): the micro-batch loss already divided by the caller's num_items_in_batch;
#   router_counts (int64, E), router_probs (fp32, E), router_rows (int64): top-k
#     assignments per expert, summed routing probabilities per expert, and routed rows,
#     over the MoE layers (what HF's load_balancing_loss_func sums before dividing).
LossParts = dict[str, Tensor]


@dataclass(frozen=True)
class LossSpec:
    """How an output's `.loss` and `.aux_loss` follow from its `LossParts`."""

    ce: str | None  # "mean" (ce_sum / ce_count), "items" (ce_loss), or None: no labels
    num_experts: int = 0  # > 0: the parts hold router statistics, `.aux_loss` is set
    aux_coef: float = 0.0  # the weight of `.aux_loss` in `.loss` (HF's router_aux_loss_coef)


def finish_losses(spec: LossSpec, parts: LossParts) -> dict[str, Tensor | None]:
    """`loss` and `aux_loss` from the pieces, in HF's arithmetic (fp32)."""
    out: dict[str, Tensor | None] = {}
    loss: Tensor | None = None
    if spec.ce == "mean":
        loss = parts["ce_sum"].sum() / parts["ce_count"].sum()
    elif spec.ce == "items":
        loss = parts["ce_loss"].sum()
    if spec.num_experts:
        rows = parts["router_rows"].sum().to(torch.float32)
        tokens_per_expert = parts["router_counts"].sum(0).to(torch.float32) / rows
        router_prob_per_expert = parts["router_probs"].sum(0) / rows
        aux = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * spec.num_experts
        out["aux_loss"] = aux
        if loss is not None:
            loss = loss + spec.aux_coef * aux
    out["loss"] = loss
    return out


@dataclass
class CausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` of a preset: `.loss` (with labels) and `.logits`.

    See the module docstring for what `.loss` means per micro-batch and once merged.
    `past_key_values`, `hidden_states` and `attentions` stay None (no KV cache, no
    per-layer outputs).
    """


@dataclass
class MoeCausalLMOutput(MoeCausalLMOutputWithPast):
    """`MoeCausalLMOutputWithPast` of a mixture-of-experts preset.

    `.aux_loss` is HF's load-balancing loss when router outputs are asked for
    (`output_router_logits`, or the config's default); `.router_logits` stays None (the
    per-layer router logits are reduced on the fly instead of being kept).
    """


_DERIVED = ("loss", "aux_loss")


def build_output(
    cls: type[CausalLMOutputWithPast],
    fields: dict[str, Any],
    parts: LossParts | None,
    spec: LossSpec | None,
) -> CausalLMOutputWithPast:
    """An output of `cls` with `fields`, whose losses come from `parts` under `spec`."""
    values = dict(fields)
    if (
        parts is not None
        and spec is not None
        and all(isinstance(t, Tensor) for t in parts.values())
    ):
        for key, value in finish_losses(spec, parts).items():
            if value is not None:
                values[key] = value
    out = cls(**values)
    # Plain attributes, not dataclass fields: they stay out of the dict, to_tuple() and
    # `out["..."]`, so the object reads exactly like the HF output.
    object.__setattr__(out, "_rp_parts", parts)
    object.__setattr__(out, "_rp_spec", spec)
    return out


def _flatten(out: CausalLMOutputWithPast) -> tuple[list[Any], Any]:
    parts: LossParts | None = out.__dict__.get("_rp_parts")
    spec: LossSpec | None = out.__dict__.get("_rp_spec")
    derived = _DERIVED if parts is not None else ()
    keys = tuple(k for k in out if k not in derived)
    names = tuple(parts) if parts is not None else ()
    leaves = [parts[n] for n in names] if parts is not None else []
    leaves += [out[k] for k in keys]
    return leaves, (keys, names, spec)


def _unflatten(cls: type[CausalLMOutputWithPast], leaves: Any, context: Any) -> Any:
    keys, names, spec = context
    leaves = list(leaves)
    parts = dict(zip(names, leaves[: len(names)], strict=True)) if names else None
    fields = dict(zip(keys, leaves[len(names) :], strict=True))
    return build_output(cls, fields, parts, spec)


def _register(cls: type[CausalLMOutputWithPast]) -> None:
    # transformers registers every ModelOutput subclass with its own flatten (all dict
    # values) when the class is created; this one flattens into the loss pieces instead.
    if cls in pytree.SUPPORTED_NODES:
        pytree._deregister_pytree_node(cls)
    pytree.register_pytree_node(
        cls,
        _flatten,
        lambda leaves, context: _unflatten(cls, leaves, context),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
    )


for _cls in (CausalLMOutput, MoeCausalLMOutput):
    _register(_cls)


class OutputTuple(tuple):  # type: ignore[type-arg]
    """HF's `return_dict=False` form of an output (`output.to_tuple()`), which flattens and
    merges like the output it came from (so a merged `[0]` is the batch loss too)."""

    output: CausalLMOutputWithPast

    @classmethod
    def of(cls, output: CausalLMOutputWithPast) -> OutputTuple:
        result = cls(output.to_tuple())
        result.output = output
        return result


def _flatten_tuple(value: OutputTuple) -> tuple[list[Any], Any]:
    leaves, context = _flatten(value.output)
    return leaves, (type(value.output), context)


def _unflatten_tuple(leaves: Any, context: Any) -> OutputTuple:
    cls, inner = context
    return OutputTuple.of(_unflatten(cls, leaves, inner))


pytree.register_pytree_node(
    OutputTuple,
    _flatten_tuple,
    _unflatten_tuple,
    serialized_type_name=f"{__name__}.OutputTuple",
)
