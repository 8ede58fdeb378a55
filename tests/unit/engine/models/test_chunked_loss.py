"""The chunked cross-entropy against the full one: values, gradients, memory bound."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from engine.errors import ConfigError
from engine.models import causal_lm_loss, causal_lm_loss_fn, chunked_cross_entropy_sum

TOKENS, HIDDEN, VOCAB = 37, 24, 53  # odd: no chunk size below divides the token count


def make_inputs(dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.3).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    targets[[0, 5, 6, 36]] = -100
    return hidden, weight, targets


def full_loss_and_grads(hidden, weight, targets):
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = F.cross_entropy((h @ w.t()).float(), targets, ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_tokens", [1, 5, 16, 37, 1000])
def test_chunked_sum_equals_full_cross_entropy(chunk_tokens: int) -> None:
    hidden, weight, targets = make_inputs()
    expected, grad_h, grad_w = full_loss_and_grads(hidden, weight, targets)

    got = chunked_cross_entropy_sum(hidden, weight, targets, chunk_tokens=chunk_tokens)
    got.backward()

    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, grad_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, grad_w, rtol=1e-5, atol=1e-6)


def test_upstream_gradient_scales_the_gradients() -> None:
    hidden, weight, targets = make_inputs(seed=1)
    _, grad_h, grad_w = full_loss_and_grads(hidden, weight, targets)
    (chunked_cross_entropy_sum(hidden, weight, targets, chunk_tokens=4) * 0.25).backward()
    torch.testing.assert_close(hidden.grad, grad_h * 0.25, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, grad_w * 0.25, rtol=1e-5, atol=1e-6)


def test_bf16_is_as_close_to_fp32_as_the_full_bf16_loss() -> None:
    # Both round logits and gradients to bf16, at different points (per chunk here, once
    # per GEMM there), so neither equals the other bit for bit. The oracle is fp32: the
    # chunked bf16 result must be no further from it than the full bf16 one (x2 slack).
    hidden, weight, targets = make_inputs(torch.bfloat16, seed=2)
    full, full_gh, full_gw = full_loss_and_grads(hidden, weight, targets)
    _, exact_gh, exact_gw = full_loss_and_grads(hidden.float(), weight.float(), targets)
    got = chunked_cross_entropy_sum(hidden, weight, targets, chunk_tokens=6)
    got.backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)  # same bf16 logits, fp32 CE
    for mine, theirs, exact_grad in (
        (hidden.grad, full_gh, exact_gh),
        (weight.grad, full_gw, exact_gw),
    ):
        assert mine.dtype == torch.bfloat16
        my_err = (mine.float() - exact_grad).abs().max()
        their_err = (theirs.float() - exact_grad).abs().max()
        assert my_err <= 2 * their_err + 1e-3 * exact_grad.abs().max()


def test_causal_lm_loss_shifts_labels_like_transformers() -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    gen = torch.Generator().manual_seed(3)
    batch, seq = 3, 13
    hidden = torch.randn(batch, seq, HIDDEN, generator=gen, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen, requires_grad=True)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    labels[1, :4] = -100

    expected = ForCausalLMLoss(hidden @ weight.t(), labels, VOCAB)
    grads = torch.autograd.grad(expected, (hidden, weight))
    got = causal_lm_loss((hidden, weight), labels, chunk_tokens=10)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(got_grads, grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)

    # Logits in, the same loss out (the inference-shaped path).
    from_logits = causal_lm_loss(hidden @ weight.t(), labels)
    torch.testing.assert_close(from_logits, expected, rtol=1e-5, atol=1e-6)

    # Pre-shifted labels and an explicit divisor.
    shifted = torch.cat([labels[:, 1:], torch.full((batch, 1), -100)], dim=1)
    n = int((shifted != -100).sum())
    summed = causal_lm_loss((hidden, weight), shifted, shifted=True, num_items_in_batch=n * 2)
    torch.testing.assert_close(summed, expected / 2, rtol=1e-5, atol=1e-6)


def test_loss_fn_over_microbatches_sums_to_batch_mean() -> None:
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, 9, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    labels = torch.randint(0, VOCAB, (5, 9), generator=gen)
    labels[0] = -100  # a micro-batch with no counted token contributes zero
    labels[3, 2:] = -100
    expected = causal_lm_loss((hidden, weight), labels)
    loss_fn = causal_lm_loss_fn(labels, chunk_tokens=8)
    total = sum(
        loss_fn((h, weight), lab)
        for h, lab in zip(hidden.split([1, 2, 2]), labels.split([1, 2, 2]), strict=True)
    )
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)


class _LargestTensor(TorchDispatchMode):
    """Records the largest element count of any tensor an op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_never_materialises_more_than_one_chunk_of_logits() -> None:
    hidden, weight, targets = make_inputs(seed=5)
    chunk = 4
    with _LargestTensor() as mode:
        chunked_cross_entropy_sum(hidden, weight, targets, chunk_tokens=chunk).backward()
    # The weight gradient (vocab x hidden) is the largest thing; logits stay at one chunk.
    assert mode.max_numel <= max(chunk * VOCAB, VOCAB * HIDDEN, TOKENS * HIDDEN)
    assert mode.max_numel < TOKENS * VOCAB


def test_bad_chunk_size_is_a_config_error() -> None:
    hidden, weight, targets = make_inputs()
    with pytest.raises(ConfigError, match="chunk_tokens"):
        chunked_cross_entropy_sum(hidden, weight, targets, chunk_tokens=0)


def test_chunk_functions_match_cross_entropy() -> None:
    """The two functions that the CUDA half-precision path compiles, run eagerly here."""
    from engine.models.loss import grad_logits_of_chunk, lse_and_loss_of_chunk

    hidden, weight, targets = make_inputs(seed=3)
    logits = (hidden @ weight.t()).detach().requires_grad_()
    expected = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    (expected * 0.5).backward()

    lse, total = lse_and_loss_of_chunk(logits.detach(), targets, -100)
    grad = grad_logits_of_chunk(logits.detach(), lse, targets, torch.tensor(0.5), -100)

    torch.testing.assert_close(lse, torch.logsumexp(logits.detach(), dim=-1))
    torch.testing.assert_close(total, expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, logits.grad, rtol=1e-5, atol=1e-6)
    assert grad[[0, 5, 6, 36]].abs().sum() == 0  # ignored tokens


def test_fused_chunk_path_equals_full_cross_entropy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk loop through the fused functions (compiled on CUDA, eager here)."""
    from engine.models import loss

    monkeypatch.setattr(
        loss,
        "_fused_loss_kernels",
        lambda _: (loss.lse_and_loss_of_chunk, loss.grad_logits_of_chunk),
    )
    hidden, weight, targets = make_inputs(seed=4)
    expected, grad_h, grad_w = full_loss_and_grads(hidden, weight, targets)
    got = chunked_cross_entropy_sum(hidden, weight, targets, chunk_tokens=5)
    (got * 1.0).backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, grad_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, grad_w, rtol=1e-5, atol=1e-6)


def test_fused_path_only_for_half_precision_on_cuda() -> None:
    from engine.models.loss import _fused_loss_kernels

    assert _fused_loss_kernels(torch.zeros(2, 2)) is None
    assert _fused_loss_kernels(torch.zeros(2, 2, dtype=torch.float16)) is None  # CPU
