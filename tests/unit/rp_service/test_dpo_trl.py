"""The DPO objective's loss, metrics and gradients against trl's DPOTrainer on one batch.

trl (1.16) has no free loss function: `DPOTrainer._compute_loss(model, inputs, ...)`
runs the model and computes the loss and TRL's metrics inline. It is called here on a
minimal stand-in for the trainer (the attributes that method reads, with an accelerator
whose gathers are the identity) and a stand-in model that returns the per-token
log-probabilities of the same head (hidden states and head weight) our `dpo_loss_fn`
reads, so both sides score the same per-sequence log-probabilities.

Label smoothing: trl 1.16's `sigmoid` loss no longer takes label smoothing (cDPO's
`-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)` was dropped from it); its `robust` loss
is `(-(1 - eps) log sigmoid(z) + eps log sigmoid(-z)) / (1 - 2 eps)`. trl sums several
loss types with weights, and `2 (1 - eps) sigmoid - (1 - 2 eps) robust` is exactly cDPO,
so for eps > 0 trl computes our loss as that weighted sum in the same call.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

from rp_service.worker.objectives import dpo

trl_dpo = pytest.importorskip(
    "trl.trainer.dpo_trainer", reason="trl is a dev extra (pip install -e '.[dev]')"
)

PAIRS, SEQ, HIDDEN, VOCAB = 5, 9, 16, 40


def _batch(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Hidden states, head weight, targets (rows 2i chosen, 2i + 1 rejected; -100 where
    not scored: the prompt, the padding, the last position) and reference log-probs."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2 * PAIRS, SEQ, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5
    targets = torch.randint(0, VOCAB, (2 * PAIRS, SEQ), generator=gen)
    for row in range(2 * PAIRS):
        prompt, length = 1 + row % 3, SEQ - row % 4
        targets[row, :prompt] = -100
        targets[row, length - 1 :] = -100
    ref = -torch.rand(2 * PAIRS, generator=gen) * 20 - 40
    return hidden, weight, targets, ref


def _token_logps(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    """(rows, seq) log-probability of each target, 0 where not scored: full logits."""
    logp = (hidden @ weight.T).log_softmax(-1)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked * (targets != -100)


def _halves(x: Tensor) -> Tensor:
    """Our interleaved rows (chosen, rejected, chosen, ...) in trl's order: all chosen
    rows, then all rejected rows."""
    return torch.cat([x[0::2], x[1::2]])


def _trainer(beta: float, eps: float) -> Any:
    """The attributes `DPOTrainer._compute_loss` reads, for reference log-probabilities
    given in the inputs and the plain (reverse-KL) sigmoid loss."""
    if eps:
        loss_types, loss_weights = ["sigmoid", "robust"], [2 * (1 - eps), -(1 - 2 * eps)]
    else:
        loss_types, loss_weights = ["sigmoid"], [1.0]

    def identity(t: Tensor) -> Tensor:  # one process: gathering is the identity
        return t

    return SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(
            device=torch.device("cpu"), gather=identity, gather_for_metrics=identity
        ),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        loss_types=loss_types,
        loss_weights=loss_weights,
        beta=beta,
        label_smoothing=eps,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )


def _trl_loss(
    hidden: Tensor, weight: Tensor, targets: Tensor, ref: Tensor, *, beta: float, eps: float
) -> tuple[Tensor, dict[str, float]]:
    trainer = _trainer(beta, eps)
    token_logps = _halves(_token_logps(hidden, weight, targets))  # (rows, seq)
    scored = _halves(targets != -100)
    # trl's position t - 1 predicts token t, whose completion_mask[t] is 1
    completion_mask = torch.zeros_like(scored, dtype=torch.long)
    completion_mask[:, 1:] = scored[:, :-1].long()

    def model(**kwargs: Any) -> SimpleNamespace:
        # the fused head's outputs: (rows, seq - 1) log-probabilities of the shifted labels
        zeros = torch.zeros(token_logps.shape[0], SEQ - 1)
        return SimpleNamespace(
            log_probs=token_logps[:, :-1],
            entropy=zeros,
            mean_logits=zeros,
            is_top1=zeros.bool(),
        )

    ordered_ref = _halves(ref)
    inputs = {
        "input_ids": torch.zeros(2 * PAIRS, SEQ, dtype=torch.long),
        "attention_mask": torch.ones(2 * PAIRS, SEQ, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ordered_ref[:PAIRS],
        "ref_rejected_logps": ordered_ref[PAIRS:],
    }
    loss = trl_dpo.DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss, {k: logged[k] for k in dpo.METRIC_NAMES}


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_loss_metrics_and_gradients_equal_trls(beta: float, eps: float) -> None:
    hidden, weight, targets, ref = _batch(seed=int(beta * 10 + eps * 100))
    # a policy away from the reference, so the rewards and accuracies are not all zero
    ref = ref + torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)) * 4

    theirs_h = hidden.clone().requires_grad_(True)
    theirs, their_metrics = _trl_loss(theirs_h, weight, targets, ref, beta=beta, eps=eps)
    theirs.backward()

    ours_h = hidden.clone().requires_grad_(True)
    loss_fn = dpo.dpo_loss_fn(beta=beta, label_smoothing=eps, num_pairs=PAIRS, chunk_tokens=7)
    values = loss_fn((ours_h, weight), (targets, ref))
    values[0].backward()
    ours, our_metrics = dpo.metrics_of([v.detach() for v in values])

    torch.testing.assert_close(torch.tensor(ours), theirs.detach(), rtol=1e-6, atol=0)
    assert 0.0 < our_metrics["rewards/accuracies"] < 1.0
    for name in dpo.METRIC_NAMES:
        assert our_metrics[name] == pytest.approx(their_metrics[name], rel=1e-6, abs=1e-6), name
    torch.testing.assert_close(ours_h.grad, theirs_h.grad, rtol=1e-5, atol=1e-7)
