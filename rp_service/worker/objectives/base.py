"""The one interface the training loop sees of an objective (`train.objective`).

`training._Run` owns everything objectives share (the model, the optimizer and its
schedule, the batch order, checkpoints, pause and resume, the output); an objective owns
what differs: its data, how a step's loss and gradients are made, its validation number,
its extra metrics, and whatever state a resumed attempt needs besides the weights.

The loop calls, in this order:

    objective = make(...)                  # data read and tokenised
    objective.prepare(rp, hf_model, lora=..., resuming=...)   # before any step moves the weights
    objective.load_state_dict(state)       # a resumed attempt only
    loss, tokens = objective.forward_backward(rp, step, indices)   # every step
    objective.metrics()                    # after the step's loss is read
    objective.evaluate(rp)                 # at evaluation steps, weights synchronized
    objective.state_dict()                 # into every checkpoint
    objective.close()                      # when the attempt ends, however it ends
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any, Protocol

from torch import Tensor

__all__ = ["Objective"]


class Objective(Protocol):
    """A training objective: SFT, DPO, GRPO (rp_service.worker.objectives)."""

    train: Sized
    """What `BatchOrder` indexes: one item per batch row (a sequence, a pair, a prompt)."""
    valid: Sized | None
    data_format: str
    """How sample prompts are rendered: ``chat``/``preference``/``prompt`` in the chat
    template, ``text``/``prompt_completion`` as plain text."""
    steps_per_batch: int
    """Optimizer steps each batch serves (GRPO's `num_iterations`; 1 for the others)."""
    needs_sync_before_step: bool
    """True when `forward_backward` reads the model copy outside the engine's own
    ordering (GRPO's rollouts): the loop synchronizes the previous update first."""

    def prepare(self, rp: Any, hf_model: Any, *, lora: bool, resuming: bool) -> None:
        """Before the first step of this attempt, with the weights as the spec built them
        (a resumed attempt: as its checkpoint's model copy); `hf_model` is the model `rp`
        wraps (its config and generation config)."""

    def forward_backward(self, rp: Any, step: int, indices: Tensor) -> tuple[Tensor, int]:
        """Forward and backward of 1-based step `step` on the items at `indices`;
        return the loss (a tensor: reading it is the step's host sync) and the tokens
        it trained on."""
        ...

    def metrics(self) -> dict[str, Any] | None:
        """The objective's own metrics of the last step (None: none), merged into its
        `metrics` event."""
        ...

    def evaluate(self, rp: Any) -> dict[str, float]:
        """Validation metrics of the current (synchronized) weights, merged into the
        step's event: ``valid_loss`` for SFT and DPO, rewards for GRPO."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state a resumed attempt needs besides weights and step."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (called before the first resumed step)."""

    def close(self) -> None:
        """Free what the objective holds (GRPO's grader sandbox)."""
