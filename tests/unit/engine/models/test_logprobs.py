"""Chunked target log-probabilities against log_softmax over the full logits."""

from __future__ import annotations

import pytest
import torch

from engine import ConfigError
from engine.models.logprobs import chunked_token_logprobs, sequence_logprobs


@pytest.mark.parametrize("chunk_tokens", [1, 5, 17, 1000])
def test_token_logprobs_and_grads_match_log_softmax(chunk_tokens: int) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, vocab = 17, 9, 31
    h = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[[0, 4, 16]] = -100
    upstream = torch.randn(tokens, generator=gen)

    full = (h @ w.t()).log_softmax(-1).gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    want = torch.where(targets != -100, full, 0.0)
    (want * upstream).sum().backward()
    want_h, want_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None

    got = chunked_token_logprobs(h, w, targets, chunk_tokens=chunk_tokens)
    (got * upstream).sum().backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, want_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, want_w, rtol=1e-5, atol=1e-6)


def test_sequence_sums_and_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(3, 5, 4, generator=gen)
    w = torch.randn(11, 4, generator=gen)
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    targets[1, :2] = -100
    per_token = chunked_token_logprobs(h.reshape(-1, 4), w, targets.reshape(-1)).view(3, 5)
    torch.testing.assert_close(sequence_logprobs((h, w), targets, chunk_tokens=4), per_token.sum(1))
    with pytest.raises(ConfigError, match="return_logits=False"):
        sequence_logprobs(h, targets)
    with pytest.raises(ConfigError, match="targets must be"):
        sequence_logprobs((h, w), targets[:, :4])
    with pytest.raises(ConfigError, match="chunk_tokens"):
        chunked_token_logprobs(h.reshape(-1, 4), w, targets.reshape(-1), chunk_tokens=0)
