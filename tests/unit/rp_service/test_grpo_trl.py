"""The GRPO objective's loss, gradients and metrics against trl's GRPOTrainer.

trl (1.16) computes the loss inline in `GRPOTrainer._compute_loss(model, inputs)`; it is
called here on a minimal stand-in for the trainer (the attributes that method reads, an
accelerator whose gathers and reductions are the identity) whose
`_get_per_token_logps_and_entropies` returns the per-token log-probabilities of the same
head (hidden states over the temperature, head weight) our loss reads with full logits.
The advantages are checked against the formula of trl's `_generate_and_score_completions`
(which cannot be called without a model and a generation backend) using trl's `nanstd`.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

from rp_service.worker.objectives import grpo

trl_grpo = pytest.importorskip(
    "trl.trainer.grpo_trainer", reason="trl is a dev extra (pip install -e '.[dev]')"
)
trl_utils = pytest.importorskip("trl.trainer.utils")

ROWS, SEQ, HIDDEN, VOCAB, GROUP, MAX_COMPLETION = 6, 9, 16, 40, 3, 12


def _batch(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Hidden states, head weight, targets (-100 outside each completion) and rewards."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, SEQ, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5
    targets = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    for row in range(ROWS):
        prompt, length = 1 + row % 3, SEQ - row % 4
        targets[row, :prompt] = -100
        targets[row, length:] = -100
    rewards = torch.randint(0, 3, (ROWS,), generator=gen).float() / 2
    return hidden, weight, targets, rewards


def _token_logps(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float) -> Tensor:
    logp = ((hidden / temperature) @ weight.T).log_softmax(-1)
    return logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def _trainer(loss_type: str, beta: float, eps_low: float, eps_high: float, logps: Any) -> Any:
    def identity(t: Tensor, **_: Any) -> Tensor:
        return t

    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=MAX_COMPLETION,
        accelerator=SimpleNamespace(
            num_processes=1, gather=identity, gather_for_metrics=identity, reduce=identity
        ),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
    )


def _trl_loss(
    logps: Tensor,
    targets: Tensor,
    advantages: Tensor,
    *,
    loss_type: str,
    beta: float,
    ref: Tensor | None = None,
    old: Tensor | None = None,
    eps: tuple[float, float] = (0.2, 0.2),
) -> tuple[Tensor, dict[str, float]]:
    trainer = _trainer(loss_type, beta, *eps, logps)
    mask = (targets != -100).long()
    inputs: dict[str, Any] = {
        "prompt_ids": torch.zeros(ROWS, 1, dtype=torch.long),
        "prompt_mask": torch.ones(ROWS, 1, dtype=torch.long),
        "completion_ids": torch.zeros(ROWS, SEQ, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": mask.sum().float(),
    }
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    if old is not None:
        inputs["old_per_token_logps"] = old
    loss = trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss, logged


def _ours(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    advantages: Tensor,
    *,
    loss_type: str,
    beta: float,
    temperature: float,
    ref: Tensor | None,
    old: Tensor | None,
    rows: list[int],
    chunk_tokens: int,
) -> tuple[Tensor, list[list[Tensor]]]:
    """Our loss of the batch, in micro-batches of `rows` whose shares add up to the batch's,
    backward done; the loss and each micro-batch's values (loss, KL, clip shares)."""
    mask = targets != -100
    denominator, row_tokens = grpo.normalizer(
        loss_type,  # type: ignore[arg-type]
        mask,
        max_completion_tokens=MAX_COMPLETION,
    )
    loss_fn = grpo.grpo_loss_fn(
        temperature=temperature,
        epsilon_low=0.2,
        epsilon_high=0.2,
        beta=beta,
        loss_type=loss_type,  # type: ignore[arg-type]
        denominator=denominator,
        batch_tokens=int(mask.sum()),
        chunk_tokens=chunk_tokens,
    )
    parts = grpo.split_label(rows)((targets, advantages, ref, row_tokens, old), len(rows))
    starts = [sum(rows[:k]) for k in range(len(rows))]
    values = [
        loss_fn((hidden[a : a + n], weight), part)
        for a, n, part in zip(starts, rows, parts, strict=True)
    ]
    loss = sum(v[0] for v in values)
    loss.backward()  # type: ignore[union-attr]
    return loss, values  # type: ignore[return-value]


@pytest.mark.parametrize("scale", grpo.SCALE_REWARDS)
def test_advantages_equal_trls(scale: str) -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 1.0, 0.2, 0.9, 0.0])
    grouped = rewards.view(-1, GROUP)
    mean = grouped.mean(dim=1).repeat_interleave(GROUP)
    if scale == "batch":
        std = trl_utils.nanstd(rewards).expand_as(rewards)
    else:
        std = trl_utils.nanstd(grouped, dim=1).repeat_interleave(GROUP)
    theirs = rewards - mean
    if scale != "none":
        theirs = theirs / (std + 1e-4)
    ours = grpo.group_advantages(rewards, GROUP, scale=scale)  # type: ignore[arg-type]
    torch.testing.assert_close(ours.float(), theirs)
    assert ours[3:6].abs().max() == 0  # a group of equal rewards teaches nothing


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_loss_and_gradients_equal_trls(loss_type: str, beta: float, temperature: float) -> None:
    hidden, weight, targets, rewards = _batch(seed=len(loss_type) + int(beta * 100))
    advantages = grpo.group_advantages(rewards, GROUP).float()
    gen = torch.Generator().manual_seed(3)
    ref = _token_logps(hidden, weight, targets, temperature) + 0.3 * torch.randn(
        ROWS, SEQ, generator=gen
    )

    theirs_h = hidden.clone().requires_grad_(True)
    theirs_w = weight.clone().requires_grad_(True)
    theirs, logged = _trl_loss(
        _token_logps(theirs_h, theirs_w, targets, temperature),
        targets,
        advantages,
        loss_type=loss_type,
        beta=beta,
        ref=ref if beta else None,
    )
    theirs.backward()

    # ours: the batch in two micro-batches whose shares add up to the batch's loss
    ours_h = hidden.clone().requires_grad_(True)
    ours_w = weight.clone().requires_grad_(True)
    ours, values = _ours(
        ours_h,
        ours_w,
        targets,
        advantages,
        loss_type=loss_type,
        beta=beta,
        temperature=temperature,
        ref=ref if beta else None,
        old=None,
        rows=[4, 2],
        chunk_tokens=7,
    )

    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_h.grad, theirs_h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ours_w.grad, theirs_w.grad, rtol=1e-4, atol=1e-6)
    assert ours_h.grad.abs().sum() > 0
    clip = float(sum(v[2] for v in values))
    assert clip == logged["clip_ratio/region_mean"] == 0.0  # on-policy: the clip never binds
    if beta:
        assert float(sum(v[1] for v in values)) == pytest.approx(logged["kl"], rel=1e-5)


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_an_off_policy_ratio_clips_as_trl_does(loss_type: str) -> None:
    hidden, weight, targets, rewards = _batch(seed=7)
    advantages = grpo.group_advantages(rewards, GROUP).float()
    logps = _token_logps(hidden, weight, targets, 1.0).requires_grad_(True)
    old = (
        logps + 0.4 * torch.randn(ROWS, SEQ, generator=torch.Generator().manual_seed(9))
    ).detach()
    theirs, logged = _trl_loss(logps, targets, advantages, loss_type=loss_type, beta=0.0, old=old)
    (their_grad,) = torch.autograd.grad(theirs, logps)

    mask = targets != -100
    per_token, _, bound = grpo.per_token_loss(
        logps, old, advantages, None, epsilon_low=0.2, epsilon_high=0.2, beta=0.0
    )
    denominator, row_tokens = grpo.normalizer(
        loss_type,  # type: ignore[arg-type]
        mask,
        max_completion_tokens=MAX_COMPLETION,
    )
    masked = per_token * mask
    ours = (
        (masked.sum(1) / row_tokens).sum() / denominator
        if row_tokens is not None
        else masked.sum() / denominator
    )
    (our_grad,) = torch.autograd.grad(ours, logps)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(our_grad, their_grad)
    fraction = float((bound & mask).sum() / mask.sum())
    assert 0 < fraction == pytest.approx(logged["clip_ratio/region_mean"])


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_several_iterations_score_against_the_rollout_policy_as_trl_does(loss_type: str) -> None:
    """num_iterations > 1: the label's old log-probabilities are the ratio's denominator
    (TRL's `old_per_token_logps`); loss, gradients, KL and clip fraction equal TRL's."""
    hidden, weight, targets, rewards = _batch(seed=11)
    advantages = grpo.group_advantages(rewards, GROUP).float()
    temperature, beta = 0.7, 0.04
    gen = torch.Generator().manual_seed(5)
    base = _token_logps(hidden, weight, targets, temperature)
    old = (base + 0.3 * torch.randn(ROWS, SEQ, generator=gen)).detach()
    ref = (base + 0.2 * torch.randn(ROWS, SEQ, generator=gen)).detach()

    theirs_h = hidden.clone().requires_grad_(True)
    theirs, logged = _trl_loss(
        _token_logps(theirs_h, weight, targets, temperature),
        targets,
        advantages,
        loss_type=loss_type,
        beta=beta,
        ref=ref,
        old=old,
    )
    theirs.backward()

    ours_h = hidden.clone().requires_grad_(True)
    ours, values = _ours(
        ours_h,
        weight,
        targets,
        advantages,
        loss_type=loss_type,
        beta=beta,
        temperature=temperature,
        ref=ref,
        old=old,
        rows=[2, 4],
        chunk_tokens=5,
    )

    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_h.grad, theirs_h.grad, rtol=1e-4, atol=1e-6)
    clip = float(sum(v[2] for v in values))
    assert 0 < clip == pytest.approx(logged["clip_ratio/region_mean"], rel=1e-5)
    assert float(sum(v[1] for v in values)) == pytest.approx(logged["kl"], rel=1e-5)
