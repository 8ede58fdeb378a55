"""Per-sequence sums of target-token log-probabilities, chunked like the causal-LM loss.

Preference objectives (DPO and its kin) score a whole completion by the sum of its tokens'
log-probabilities, log p(y | x) = sum_t log softmax(h_t W^T)[y_t]. As for the chunked
cross-entropy, the (tokens, vocab) logits never exist in full: the forward computes them
one chunk of tokens at a time and keeps only each token's log-sum-exp; the backward
recomputes a chunk's logits to form its gradient. The per-token values are returned (one
fp32 number a token), and the per-sequence sums are ordinary tensor ops on them.

Two ways in, for the two kinds of pass over a preset model whose head returns the
`(normed_hidden, lm_head_weight)` pair (`return_logits=False`, no labels):

- under autograd, inside a `forward_backward` loss_fn: `sequence_logprobs(outputs, targets)`;
- forward only, reduced on the device before the download:
  `RoundPipeRunConfig(output_fn=sequence_logprobs_output_fn(targets_per_micro_batch))`,
  so a micro-batch comes back to the host as a few numbers, not its hidden states.

Targets are next-token targets: row r's position t holds the id that position t predicts
(the labels shifted left by one), `ignore_index` where no log-probability counts (prompt,
padding).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import ConfigError
from . import DEFAULT_LOSS_CHUNK_TOKENS, IGNORE_INDEX
from .loss import head_backward, logit_chunks

__all__ = [
    "chunked_token_logprobs",
    "sequence_logprobs",
    "sequence_logprobs_output_fn",
]


def _lse_and_picked(logits: Tensor, targets: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """Per-token log-sum-exp and target log-probability (0 where ignored), both fp32."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    valid = targets != ignore_index
    picked = x.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)
    return lse, torch.where(valid, picked - lse, 0.0)


class ChunkedTokenLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weight.T)[targets] per token, computed chunk by chunk.

    Forward keeps the per-token log-sum-exp; backward recomputes each chunk's logits, so
    peak memory is one (chunk, vocab) block. Logits are computed in the input dtype (as
    `lm_head` would) and upcast to fp32 for the softmax; the weight gradient is
    accumulated in fp32.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        chunk_tokens: int,
        ignore_index: int,
    ) -> Tensor:
        tokens = hidden.shape[0]
        lse = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        logps = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        for start, stop, logits in logit_chunks(hidden, weight, chunk_tokens):
            lse[start:stop], logps[start:stop] = _lse_and_picked(
                logits, targets[start:stop], ignore_index
            )
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_tokens = chunk_tokens
        ctx.ignore_index = ignore_index
        return logps

    @staticmethod
    def backward(ctx: Any, grad_logps: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors
        ignore = ctx.ignore_index

        def grad_of_chunk(logits: Tensor, start: int, stop: int) -> Tensor:
            tgt = targets[start:stop]
            valid = tgt != ignore
            # d logp_t / d logits_t = onehot(y_t) - softmax(logits_t); scaled by the
            # incoming per-token gradient, zero for ignored tokens. In place: one fp32 chunk.
            grad = logits.float().sub_(lse[start:stop].unsqueeze(1)).exp_().neg_()
            grad[torch.arange(stop - start, device=grad.device), torch.where(valid, tgt, 0)] += 1.0
            grad.mul_(torch.where(valid, grad_logps[start:stop].float(), 0.0).unsqueeze(1))
            return grad.to(hidden.dtype)

        grad_hidden, grad_weight = head_backward(
            hidden, weight, ctx.chunk_tokens, ctx.needs_input_grad[:2], grad_of_chunk
        )
        return grad_hidden, grad_weight, None, None, None


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Return the fp32 log-probability of each target under softmax(hidden @ weight.T).

    Args:
        hidden: (tokens, hidden) inputs of the output projection.
        weight: (vocab, hidden) output projection.
        targets: (tokens,) ids; `ignore_index` entries give 0 (and no gradient).
        chunk_tokens: Tokens per chunk of logits.

    Returns:
        (tokens,) fp32.
    """
    if chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return ChunkedTokenLogprobs.apply(hidden, weight, targets, chunk_tokens, ignore_index)


def _head_pair(outputs: Any) -> tuple[Tensor, Tensor]:
    if isinstance(outputs, (tuple, list)) and len(outputs) == 2:
        hidden, weight = outputs
        if isinstance(hidden, Tensor) and isinstance(weight, Tensor) and hidden.dim() == 3:
            return hidden, weight
    raise ConfigError(
        "sequence log-probabilities need the head's (hidden_states, lm_head_weight) pair: "
        "call the preset model with return_logits=False and no labels, got "
        f"{type(outputs).__name__}"
    )


def sequence_logprobs(
    outputs: Any,
    targets: Tensor,
    *,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Return each row's sum of target-token log-probabilities, (rows,) fp32.

    Args:
        outputs: A preset head's `(normed_hidden (rows, seq, hidden), lm_head_weight)`.
        targets: (rows, seq) next-token targets, `ignore_index` where nothing counts.
        chunk_tokens: Tokens per chunk of logits.
    """
    hidden, weight = _head_pair(outputs)
    if targets.shape != hidden.shape[:2]:
        raise ConfigError(
            f"targets must be (rows, seq) = {tuple(hidden.shape[:2])} like the hidden "
            f"states, got {tuple(targets.shape)}"
        )
    per_token = chunked_token_logprobs(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1).to(hidden.device),
        chunk_tokens=chunk_tokens,
        ignore_index=ignore_index,
    )
    return per_token.view(targets.shape).sum(dim=1)  # (rows,)


def sequence_logprobs_output_fn(
    targets: Sequence[Tensor],
    *,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
) -> Callable[[Any, int], Tensor]:
    """Return an `output_fn` (see `RoundPipeRunConfig`) that turns micro-batch i's head
    output into `sequence_logprobs(output, targets[i])` on the device.

    Args:
        targets: One (rows_i, seq) target tensor per micro-batch, in the order the call
            splits its inputs (pass the same split as `split_input`).
    """

    def output_fn(outputs: Any, micro_batch: int) -> Tensor:
        hidden, _ = _head_pair(outputs)
        mb_targets = targets[micro_batch].to(hidden.device, non_blocking=True)
        return sequence_logprobs(
            outputs, mb_targets, chunk_tokens=chunk_tokens, ignore_index=ignore_index
        )

    return output_fn
