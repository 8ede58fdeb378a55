"""GRPO: group-normalised advantages and the clipped policy-gradient loss on completions.

Group Relative Policy Optimization (Shao et al., 2024, DeepSeekMath) samples G
completions o_1..o_G of each prompt q with the current policy, scores each with the
grader (reward r_i), and turns the rewards into advantages relative to the group:

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + 1e-4)      scale_rewards "group"
    A_i =  r_i - mean(r_1..r_G)                                 scale_rewards "none"
    A_i = (r_i - mean(group)) / (std(all rewards of the batch) + 1e-4)   "batch"

with std the unbiased (Bessel) standard deviation, as TRL's `GRPOTrainer` computes it
(its default: "group"). Each completion token t gets the PPO-clipped objective with the
ratio rho_t = pi(o_t | q, o_<t) / pi_old(o_t | ...) and, with `kl_coef` beta > 0, the
k3 estimate of the KL divergence to the reference:

    l_t = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i)
          + beta (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)

With one optimizer step per batch of rollouts (`num_iterations` 1, TRL's default) pi_old
is the policy itself (its detached log-probabilities): rho_t is 1 in value, the clip never
binds (clip_fraction 0) and the gradient is A_i grad log pi(o_t). With `num_iterations`
mu > 1 the same rollouts serve mu optimizer steps and pi_old is the rollout policy: its
log-probabilities, taken once when the rollouts are made, come in the label (TRL's
`old_per_token_logps`), and the clip binds as the policy moves away.

Normalisation (`loss_type`, TRL's names; "dapo" is TRL's default):

    dapo     sum of l_t over every completion token of the batch / those tokens
    grpo     mean over completions of (sum of the completion's l_t / its length)
    dr_grpo  sum of l_t / (completions x max_completion_tokens)

Log-probabilities are those of the sampling distribution, the logits divided by the
temperature (as TRL scores them), taken chunked from the head's hidden states
(`engine.models.logprobs`): no (tokens, vocab) logits exist. Each micro-batch's loss is
its share of the batch's, so the shares add up to the loss of the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from engine.batch import even_counts, row_bounds
from engine.batch import split_rows as engine_split_rows

__all__ = [
    "LOSS_TYPES",
    "SCALE_REWARDS",
    "LossType",
    "ScaleRewards",
    "group_advantages",
    "grpo_loss_fn",
    "normalizer",
    "per_token_loss",
    "split_label",
    "token_logps",
]

LossType = Literal["dapo", "grpo", "dr_grpo"]
LOSS_TYPES: tuple[LossType, ...] = ("dapo", "grpo", "dr_grpo")
ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[ScaleRewards, ...] = ("group", "batch", "none")
_STD_EPS = 1e-4  # TRL's


def _std(x: Tensor, dim: int | None = None) -> Tensor:
    """Unbiased standard deviation; 0 where a single value (a group of one)."""
    if (x.numel() if dim is None else x.shape[dim]) < 2:
        return torch.zeros(()) if dim is None else torch.zeros(x.shape[0], dtype=x.dtype)
    return x.std() if dim is None else x.std(dim=dim)


def group_advantages(rewards: Tensor, group_size: int, *, scale: ScaleRewards = "group") -> Tensor:
    """Advantages (rows,) of rewards (rows,) laid out group by group (rows = prompts x G)."""
    grouped = rewards.double().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred.reshape(-1)
    if scale == "group":
        std = _std(grouped, dim=1).unsqueeze(1)
    else:
        std = _std(grouped.reshape(-1))
    return (centred / (std + _STD_EPS)).reshape(-1)


def per_token_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    ref_logps: Tensor | None,
    *,
    epsilon_low: float,
    epsilon_high: float,
    beta: float,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """l_t of every position (rows, seq), the k3 KL per position (None without beta)
    and which positions the clip bound (bool)."""
    adv = advantages.to(logps.dtype).unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * adv, clipped * adv)
    bound = ((ratio < 1 - epsilon_low) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
    kl = None
    if beta != 0.0:
        assert ref_logps is not None
        diff = ref_logps - logps
        kl = torch.exp(diff) - diff - 1
        loss = loss + beta * kl
    return loss, kl, bound


def normalizer(
    loss_type: LossType, mask: Tensor, *, max_completion_tokens: int
) -> tuple[float, Tensor | None]:
    """What a batch's masked loss sum is divided by: a count for ``dapo`` and
    ``dr_grpo``; for ``grpo`` (None, each row's token count)."""
    rows = mask.shape[0]
    if loss_type == "grpo":
        return float(rows), mask.sum(dim=1).clamp(min=1).float()
    if loss_type == "dr_grpo":
        return float(rows * max_completion_tokens), None
    return float(max(int(mask.sum()), 1)), None


def split_rows(
    counts: Sequence[int],
) -> Callable[..., list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    """A `split_input` callable cutting the batch's rows into micro-batches of `counts`."""
    return engine_split_rows(row_bounds(counts))


def split_label(counts: Sequence[int]) -> Callable[[Any, int], list[Any]]:
    """A `split_label` callable for the label of `grpo_loss_fn`, cut like `split_rows`."""
    bounds = row_bounds(counts)

    def split(label: Any, num_microbatch: int) -> list[Any]:
        return [tuple(None if t is None else t[a:b] for t in label) for a, b in bounds]

    return split


def _completion_logps(
    outputs: Any, targets: Tensor, temperature: float, chunk_tokens: int | None
) -> Tensor:
    """(rows, seq) fp32 log-probability of each target at `temperature`, 0 where ignored."""
    from engine.models.logprobs import chunked_token_logprobs

    hidden, weight = outputs
    extra = {} if chunk_tokens is None else {"chunk_tokens": chunk_tokens}
    # (h / T) W^T = logits / T: the sampling distribution's log-probabilities
    scaled = hidden if temperature == 1.0 else hidden / temperature
    flat = chunked_token_logprobs(
        scaled.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1).to(hidden.device),
        **extra,
    )
    return flat.view(targets.shape)


def grpo_loss_fn(
    *,
    temperature: float,
    epsilon_low: float,
    epsilon_high: float,
    beta: float,
    loss_type: LossType,
    denominator: float,
    batch_tokens: int,
    chunk_tokens: int | None = None,
) -> Callable[[Any, Any], list[Tensor]]:
    """A `forward_backward` loss_fn for a preset model called with `return_logits=False`
    and the label `(targets (rows, seq), advantages (rows,), ref (rows, seq) | None,
    row_tokens (rows,) | None, old (rows, seq) | None)`, `old` the rollout policy's
    log-probabilities (None: the policy's own, detached); `denominator` from `normalizer`
    over the whole batch, `batch_tokens` its completion tokens.

    Returns `[loss, kl, clipped]`: the micro-batch's shares of the batch loss, of the
    batch's mean KL per completion token and of its clipped fraction (detached).
    """

    def loss_fn(outputs: Any, label: Any) -> list[Tensor]:
        targets, advantages, ref, row_tokens, old = label
        logps = _completion_logps(outputs, targets, temperature, chunk_tokens)
        device = logps.device
        mask = (targets != -100).to(device)
        ref_d = None if ref is None else ref.to(device, torch.float32)
        old_d = logps.detach() if old is None else old.to(device, torch.float32)
        loss, kl, bound = per_token_loss(
            logps,
            old_d,
            advantages.to(device),
            ref_d,
            epsilon_low=epsilon_low,
            epsilon_high=epsilon_high,
            beta=beta,
        )
        fmask = mask.float()
        if loss_type == "grpo":
            per_row = (loss * fmask).sum(dim=1) / row_tokens.to(device)
            total = per_row.sum() / denominator
        else:
            total = (loss * fmask).sum() / denominator
        # metrics: shares of means over the batch's completion tokens (TRL's masked means)
        scale = 1.0 / max(batch_tokens, 1)
        kl_share = (kl.detach() * fmask).sum() * scale if kl is not None else total.new_zeros(())
        clip_share = (bound.float() * fmask).sum() * scale
        return [total, kl_share, clip_share]

    return loss_fn


def token_logps(
    rp: Any,
    input_ids: Tensor,
    targets: Tensor,
    *,
    temperature: float,
    num_microbatch: int,
    chunk_tokens: int | None = None,
) -> Tensor:
    """(rows, seq) per-token log-probabilities under the model as it stands, without
    gradients, each micro-batch reduced on the device (a LoRA model's reference: call
    inside `adapters_disabled`)."""
    from engine import RoundPipeRunConfig

    counts = even_counts(input_ids.shape[0], num_microbatch)
    bounds = row_bounds(counts)

    def output_fn(outputs: Any, micro_batch: int) -> Tensor:
        a, b = bounds[micro_batch]
        return _completion_logps(outputs, targets[a:b], temperature, chunk_tokens)

    config = RoundPipeRunConfig(
        num_microbatch=len(counts),
        split_input=split_rows(counts),
        merge_output=lambda parts: torch.cat([p.float().cpu() for p in parts]),
        output_fn=output_fn,
    )
    with torch.no_grad():
        return rp.forward(input_ids=input_ids, return_logits=False, roundpipe_run_config=config)
