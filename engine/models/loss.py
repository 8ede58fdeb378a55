"""The chunked causal-LM loss: cross-entropy taken from the final hidden states chunk by
chunk, so the (tokens, vocab) logits never exist in full for it.

`ChunkedCrossEntropy` keeps only the per-token log-sum-exp in the forward and recomputes
each chunk's logits in the backward; `causal_lm_loss` / `causal_lm_loss_fn` give
transformers' `ForCausalLMLoss` from a preset head's output (the head layer,
`_head.LMHeadLayer`, takes HF's `.loss` with it too).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import ConfigError
from ._compile import HALF_DTYPES, compile_for_devices

__all__ = [
    "DEFAULT_LOSS_CHUNK_TOKENS",
    "IGNORE_INDEX",
    "ChunkedCrossEntropy",
    "causal_lm_loss",
    "causal_lm_loss_fn",
    "chunked_cross_entropy_sum",
    "count_loss_tokens",
    "grad_logits_of_chunk",
    "head_backward",
    "logit_chunks",
    "lse_and_loss_of_chunk",
    "shift_labels",
]

IGNORE_INDEX = -100
# 2048 tokens x 151936 vocab x 4 bytes (fp32 logits) is 1.2 GiB per chunk: large enough
# for efficient GEMMs, small next to the (16 x 2048) x 151936 logits of a full micro-batch.
DEFAULT_LOSS_CHUNK_TOKENS = 2048


class ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of token cross-entropies of `hidden @ weight.T`, computed chunk by chunk.

    Forward keeps only the per-token log-sum-exp; backward recomputes each chunk's logits,
    so peak memory is one chunk of (chunk, vocab) logits instead of (tokens, vocab).
    Logits are computed in the input dtype (as `lm_head` would) and upcast to fp32 for the
    softmax, like transformers' loss; the weight gradient is accumulated in fp32.
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
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        fused = _fused_loss_kernels(hidden)
        lse_and_loss = fused[0] if fused is not None else lse_and_loss_of_chunk
        for start, stop, logits in logit_chunks(hidden, weight, chunk_tokens):
            lse[start:stop], part = lse_and_loss(logits, targets[start:stop], ignore_index)
            total += part
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_tokens = chunk_tokens
        ctx.ignore_index = ignore_index
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors
        scale = grad_total.float()
        fused = _fused_loss_kernels(hidden)
        ignore = ctx.ignore_index

        def grad_of_chunk(logits: Tensor, start: int, stop: int) -> Tensor:
            tgt = targets[start:stop]
            if fused is not None:
                return fused[1](logits, lse[start:stop], tgt, scale, ignore)
            # grad_logits_of_chunk's math, in place: one fp32 chunk instead of three
            valid = tgt != ignore
            # d(lse - logit[t]) / d logits = softmax - onehot(t); ignored tokens get 0.
            grad = logits.float().sub_(lse[start:stop].unsqueeze(1)).exp_()  # (chunk, vocab)
            grad[torch.arange(stop - start, device=grad.device), torch.where(valid, tgt, 0)] -= 1.0
            grad.mul_((valid.float() * scale).unsqueeze(1))
            return grad.to(hidden.dtype)

        grad_hidden, grad_weight = head_backward(
            hidden, weight, ctx.chunk_tokens, ctx.needs_input_grad[:2], grad_of_chunk
        )
        return grad_hidden, grad_weight, None, None, None


def logit_chunks(
    hidden: Tensor, weight: Tensor, chunk_tokens: int
) -> Iterator[tuple[int, int, Tensor]]:
    """(start, stop, hidden[start:stop] @ weight.T) for each chunk of `chunk_tokens`
    tokens: the (tokens, vocab) logits one block at a time, in the hidden dtype."""
    tokens = hidden.shape[0]
    for start in range(0, tokens, chunk_tokens):
        stop = min(start + chunk_tokens, tokens)
        yield start, stop, hidden[start:stop] @ weight.t()


def head_backward(
    hidden: Tensor,
    weight: Tensor,
    chunk_tokens: int,
    needs: Sequence[bool],
    grad_of_chunk: Callable[[Tensor, int, int], Tensor],
) -> tuple[Tensor | None, Tensor | None]:
    """The gradients of `hidden` and `weight` (those `needs` asks for) of a function of
    the logits `hidden @ weight.T`, from `grad_of_chunk(logits, start, stop)`: its
    gradient with respect to one recomputed chunk of logits, in the hidden dtype. The
    weight gradient is summed over chunks in fp32 (ChunkedCrossEntropy and the DPO
    log-probabilities, engine.models.logprobs, share this)."""
    grad_hidden = torch.empty_like(hidden) if needs[0] else None
    grad_weight = (
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
    )
    for start, stop, logits in logit_chunks(hidden, weight, chunk_tokens):
        grad_logits = grad_of_chunk(logits, start, stop)
        del logits  # the chunk's logits may go before the two GEMMs
        if grad_hidden is not None:
            grad_hidden[start:stop] = grad_logits @ weight
        if grad_weight is not None:
            grad_weight += _matmul_fp32_out(grad_logits.t(), hidden[start:stop])
    return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype)


def lse_and_loss_of_chunk(
    logits: Tensor, targets: Tensor, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """Per-token log-sum-exp (fp32) and summed cross-entropy of one chunk of logits."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    valid = targets != ignore_index
    picked = x.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)
    return lse, torch.where(valid, lse - picked, 0.0).sum()


def grad_logits_of_chunk(
    logits: Tensor, lse: Tensor, targets: Tensor, scale: Tensor, ignore_index: int
) -> Tensor:
    """d loss / d logits of one chunk, in the logits' dtype: (softmax - onehot) * scale,
    zero for ignored tokens."""
    valid = targets != ignore_index
    probs = torch.exp(logits.float() - lse.unsqueeze(1))
    cols = torch.arange(logits.shape[1], device=logits.device)
    onehot = cols.unsqueeze(0) == torch.where(valid, targets, 0).unsqueeze(1)
    grad = (probs - onehot.to(probs.dtype)) * (valid.to(probs.dtype) * scale).unsqueeze(1)
    return grad.to(logits.dtype)


@functools.cache
def _compiled_loss_kernels() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The two chunk functions under torch.compile (one fused kernel each).

    Eager, a chunk's fp32 upcast, log-sum-exp, softmax and one-hot subtraction are a
    dozen passes over (chunk x vocab) floats (what they cost a step: bench/RESULTS.md,
    "Figures moved out of engine docstrings").
    """
    return (
        compile_for_devices(lse_and_loss_of_chunk),
        compile_for_devices(grad_logits_of_chunk),
    )


def _fused_loss_kernels(
    hidden: Tensor,
) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The compiled chunk functions for fp16/bf16 on CUDA, as for the decoder layers
    (fp32 keeps eager numerics); None where the eager in-place path runs."""
    from . import DISABLE_TORCH_COMPILE  # the package imports this module first

    if DISABLE_TORCH_COMPILE or not hidden.is_cuda or hidden.dtype not in HALF_DTYPES:
        return None
    return _compiled_loss_kernels()


@functools.cache
def _fp32_out_matmul_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch.mm(..., out_dtype=float32)` runs for half inputs on this backend."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _matmul_fp32_out(a: Tensor, b: Tensor) -> Tensor:
    """Return a @ b in fp32; half inputs keep the half GEMM but skip rounding its output.

    Each chunk's weight-gradient partial would otherwise be rounded to fp16/bf16 before
    the fp32 sum over chunks (cuBLAS can write fp32 directly; the CPU cannot).
    """
    if a.dtype == torch.float32:
        return a @ b
    if _fp32_out_matmul_works(a.device.type, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def chunked_cross_entropy_sum(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Return the fp32 sum over tokens of cross_entropy(hidden @ weight.T, targets).

    Args:
        hidden: (tokens, hidden) inputs of the output projection.
        weight: (vocab, hidden) output projection.
        targets: (tokens,) class ids; `ignore_index` entries add nothing.
        chunk_tokens: Tokens per chunk of logits.
    """
    if chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return ChunkedCrossEntropy.apply(hidden, weight, targets, chunk_tokens, ignore_index)


def shift_labels(labels: Tensor, ignore_index: int) -> Tensor:
    """Targets for causal LM: position t predicts labels[t + 1]; the last one predicts nothing."""
    pad = torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def count_loss_tokens(
    labels: Tensor, *, ignore_index: int = IGNORE_INDEX, shifted: bool = False
) -> int:
    """Return how many tokens of `labels` (batch, seq) contribute to the causal-LM loss."""
    targets = labels if shifted else labels[..., 1:]
    return int((targets != ignore_index).sum().item())


def causal_lm_loss(
    outputs: Any,
    labels: Tensor,
    *,
    num_items_in_batch: int | Tensor | None = None,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
    shifted: bool = False,
) -> Tensor:
    """Return the causal-LM cross-entropy (fp32) of a preset model's outputs.

    Matches transformers' `ForCausalLMLoss`: labels are shifted by one (unless `shifted`),
    `ignore_index` tokens are skipped, and the result is the mean over counted tokens, or
    their sum divided by `num_items_in_batch` when given.

    Args:
        outputs: The head layer's output: the `(normed_hidden, lm_head_weight)` pair (the
            chunked path), logits (mb, seq, vocab), or the HF-style output object (its
            `.logits`).
        labels: (mb, seq) token ids, `ignore_index` where no loss is wanted.
        num_items_in_batch: Divisor for the summed loss; pass the count over the whole
            batch (`count_loss_tokens`) so per-micro-batch losses add up to the batch mean.
        chunk_tokens: Tokens per chunk of logits.
        shifted: `labels` are already the next-token targets (e.g. packed data).
    """
    targets = labels if shifted else shift_labels(labels, ignore_index)
    if not isinstance(outputs, (Tensor, tuple, list)) and hasattr(outputs, "logits"):
        if outputs.logits is None:
            raise ConfigError(
                "the model output has no logits (they are left out where a loss is taken "
                "under autograd); pass labels and use output.loss, or pass "
                "return_logits=False for the chunked pair, or return_logits=True"
            )
        outputs = outputs.logits
    if isinstance(outputs, Tensor):
        logits = outputs
        flat_targets = targets.reshape(-1).to(logits.device)
        total = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            flat_targets,
            ignore_index=ignore_index,
            reduction="sum",
        )
    elif isinstance(outputs, (tuple, list)) and len(outputs) == 2:
        hidden, weight = outputs
        flat_targets = targets.reshape(-1).to(hidden.device)
        total = chunked_cross_entropy_sum(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            flat_targets,
            chunk_tokens=chunk_tokens,
            ignore_index=ignore_index,
        )
    else:
        raise ConfigError(
            "causal_lm_loss expects logits or the (hidden_states, lm_head_weight) pair of a "
            f"preset model's head, got {type(outputs).__name__}"
        )
    if num_items_in_batch is None:
        num_items_in_batch = (flat_targets != ignore_index).sum()
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def causal_lm_loss_fn(
    labels: Tensor | None = None,
    *,
    num_items_in_batch: int | None = None,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
    shifted: bool = False,
) -> Callable[[Any, Tensor], Tensor]:
    """Return a `loss_fn(outputs, labels)` for `forward_backward` over a preset model.

    With the whole batch's `labels` (or `num_items_in_batch`), each micro-batch's loss is
    its summed token loss over the batch's token count, so the sum that `forward_backward`
    returns, and its gradients, equal the full-batch mean loss of the HF model.
    """
    if num_items_in_batch is None and labels is not None:
        num_items_in_batch = count_loss_tokens(labels, ignore_index=ignore_index, shifted=shifted)
    if num_items_in_batch is not None and num_items_in_batch < 1:
        # No counted token: a zero loss (and zero gradients) rather than 0/0.
        num_items_in_batch = 1

    def loss_fn(outputs: Any, mb_labels: Tensor) -> Tensor:
        return causal_lm_loss(
            outputs,
            mb_labels,
            num_items_in_batch=num_items_in_batch,
            chunk_tokens=chunk_tokens,
            ignore_index=ignore_index,
            shifted=shifted,
        )

    return loss_fn
