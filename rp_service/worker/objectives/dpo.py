"""DPO: the sigmoid preference loss over pairs, their micro-batches, the reference pass.

Direct Preference Optimization (Rafailov et al., 2023) trains the policy pi on pairs
(x, y_w, y_l) of a prompt with a chosen and a rejected completion against a frozen
reference pi_ref:

    z = beta * ((log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x)))
    loss = -(1 - eps) * log sigmoid(z) - eps * log sigmoid(-z)

with eps the label smoothing of conservative DPO (0: the paper's loss), averaged over the
pairs of a batch. Each log pi(y|x) is the sum of the completion's token log-probabilities,
taken chunked from the head's hidden states (`engine.models.logprobs`), so no (tokens,
vocab) logits exist. At the start the policy is the reference, z = 0 and the loss is ln 2
whatever beta.

Batches: pair i is rows 2i (chosen) and 2i + 1 (rejected) of the batch, and the batch is
cut into micro-batches on pair boundaries (`pair_counts`, `split_rows`), so both rows of a
pair meet in one micro-batch's loss. A micro-batch's loss is its pairs' sum over the
batch's pair count, and the micro-batch losses add up to the batch mean, as for SFT.

The reference: the same base with the LoRA adapters off (`engine.adapters.lora.
adapters_disabled`, a forward without gradients in the same step), or, for full
fine-tuning, log-probabilities taken once before training by a forward-only pass and
stored with the job (`reference`). Both forwards reduce each micro-batch to its rows'
sums on the device (`sequence_logps`).

Metrics carry TRL's names: rewards are beta * (log pi - log pi_ref), averaged over pairs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.batch import even_counts, row_bounds
from engine.batch import split_rows as engine_split_rows

from ...data.preference import PREFERENCE_METRICS

__all__ = [
    "METRIC_NAMES",
    "dpo_loss_fn",
    "dpo_losses",
    "mean_loss",
    "metrics_of",
    "pair_counts",
    "sequence_logps",
    "split_label",
    "split_rows",
]

log = logging.getLogger(__name__)

# The per-micro-batch values a DPO loss_fn returns after the loss, each summed over the
# micro-batch's pairs and divided by the batch's pair count (so they add up to means).
_SUMS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
METRIC_NAMES = PREFERENCE_METRICS
"""The metrics of a DPO step, TRL's names."""


def dpo_losses(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair sigmoid DPO losses and the chosen and rejected rewards (detached).

    All inputs are (pairs,) sums of completion-token log-probabilities.
    """
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    z = beta * (chosen_ratio - rejected_ratio)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(z)
    if label_smoothing:
        losses = losses - label_smoothing * F.logsigmoid(-z)
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def pair_counts(num_pairs: int, num_microbatch: int) -> list[int]:
    """Pairs per micro-batch: `num_pairs` over at most `num_microbatch` micro-batches,
    as even as can be (the first ones one larger)."""
    if num_pairs < 1:
        raise ValueError(f"a DPO batch needs at least one pair, got {num_pairs}")
    return even_counts(num_pairs, num_microbatch)


def split_rows(counts: list[int]) -> Callable[..., list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    """A `split_input` callable: every tensor argument whose first dimension is the batch's
    rows (2 per pair) is cut on pair boundaries; other arguments go to every micro-batch."""
    return engine_split_rows(row_bounds(counts, rows_per_item=2))


def split_label(counts: list[int]) -> Callable[[Any, int], list[Any]]:
    """A `split_label` callable for a `(targets, ref_logps)` label, cut like `split_rows`."""
    bounds = row_bounds(counts, rows_per_item=2)

    def split(label: Any, num_microbatch: int) -> list[Any]:
        targets, ref = label
        return [(targets[a:b], ref[a:b]) for a, b in bounds]

    return split


def dpo_loss_fn(
    *,
    beta: float,
    label_smoothing: float,
    num_pairs: int,
    chunk_tokens: int | None = None,
) -> Callable[[Any, Any], list[Tensor]]:
    """Return a `forward_backward` loss_fn for a preset model called with
    `return_logits=False` and the label `(targets (rows, seq), ref_logps (rows,))`.

    It returns `[loss, *sums]`: the micro-batch's share of the batch mean loss, then the
    shares of the batch means named by `_SUMS` (detached), so the sums over micro-batches
    are the batch's loss and means (see `metrics_of`).
    """
    from engine.models.logprobs import sequence_logprobs

    extra = {} if chunk_tokens is None else {"chunk_tokens": chunk_tokens}
    scale = 1.0 / num_pairs

    def loss_fn(outputs: Any, label: Any) -> list[Tensor]:
        targets, ref = label
        logps = sequence_logprobs(outputs, targets, **extra).view(-1, 2)  # (pairs, 2)
        ref = ref.to(logps.device, torch.float32).view(-1, 2)
        losses, chosen, rejected = dpo_losses(
            logps[:, 0],
            logps[:, 1],
            ref[:, 0],
            ref[:, 1],
            beta=beta,
            label_smoothing=label_smoothing,
        )
        held = logps.detach()
        sums = [
            chosen.sum(),
            rejected.sum(),
            (chosen > rejected).float().sum(),
            held[:, 0].sum(),
            held[:, 1].sum(),
        ]
        return [losses.sum() * scale, *(s * scale for s in sums)]

    return loss_fn


def metrics_of(values: list[Tensor]) -> tuple[float, dict[str, float]]:
    """The batch loss and TRL-named metrics from the per-position sums `forward_backward`
    returned for `dpo_loss_fn`."""
    loss, *sums = (float(v) for v in values)
    named = dict(zip(_SUMS, sums, strict=True))
    named["rewards/margins"] = named["rewards/chosen"] - named["rewards/rejected"]
    return loss, {k: named[k] for k in METRIC_NAMES}


def sequence_logps(
    rp: Any,
    input_ids: Tensor,
    targets: Tensor,
    *,
    num_microbatch: int,
    chunk_tokens: int | None = None,
) -> Tensor:
    """Each row's completion log-probability under the model as it stands, (rows,) fp32:
    a forward without gradients whose micro-batches are reduced on the device.

    Rows go in pairs (chosen, rejected) and micro-batches are cut on pair boundaries, as
    in training. Call inside `adapters_disabled` for a LoRA model's reference.
    """
    from engine import RoundPipeRunConfig
    from engine.models.logprobs import sequence_logprobs_output_fn

    counts = pair_counts(input_ids.shape[0] // 2, num_microbatch)
    bounds = row_bounds(counts, rows_per_item=2)
    extra = {} if chunk_tokens is None else {"chunk_tokens": chunk_tokens}
    config = RoundPipeRunConfig(
        num_microbatch=len(counts),
        split_input=split_rows(counts),
        merge_output=lambda parts: torch.cat([p.float() for p in parts]),
        output_fn=sequence_logprobs_output_fn([targets[a:b] for a, b in bounds], **extra),
    )
    with torch.no_grad():
        out = rp.forward(input_ids=input_ids, return_logits=False, roundpipe_run_config=config)
    return out.cpu()


def mean_loss(
    policy: Tensor, ref: Tensor, *, beta: float, label_smoothing: float
) -> tuple[float, dict[str, float]]:
    """The mean DPO loss and metrics of (rows,) policy and reference log-probabilities
    (evaluation: no gradients)."""
    pol, rf = policy.view(-1, 2).double(), ref.view(-1, 2).double()
    losses, chosen, rejected = dpo_losses(
        pol[:, 0], pol[:, 1], rf[:, 0], rf[:, 1], beta=beta, label_smoothing=label_smoothing
    )
    n = pol.shape[0]
    sums = [
        chosen.sum(),
        rejected.sum(),
        (chosen > rejected).double().sum(),
        pol[:, 0].sum(),
        pol[:, 1].sum(),
    ]
    return metrics_of([losses.sum() / n, *(s / n for s in sums)])
