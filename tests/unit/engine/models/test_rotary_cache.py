"""The default positions' rotary tables: computed once per device, dtype and length, and
bit for bit what the layer's rotary module computes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from engine import RoundPipeRunConfig
from engine.models import _rotary
from engine.models._rotary import DefaultRotaryCache, default_rotary, rotary_fingerprint
from engine.wrapper import wrap_model_to_roundpipe
from tests.tiny_models import tiny_config, tiny_model


def _rotary_module(**overrides: Any) -> nn.Module:
    return Qwen3RotaryEmbedding(tiny_config("qwen3", **overrides))


def _count_calls(module: nn.Module) -> list[int]:
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1

    module.register_forward_hook(hook)
    return calls


@pytest.fixture(autouse=True)
def _empty_cache() -> Any:
    _rotary._CACHE.clear()
    yield
    _rotary._CACHE.clear()


def test_tables_are_computed_once_and_equal_the_module_output() -> None:
    rotary = _rotary_module()
    calls = _count_calls(rotary)
    key = rotary_fingerprint(rotary)
    assert key is not None
    hidden = torch.randn(3, 10, 32, dtype=torch.float16)
    positions, (cos, sin) = default_rotary(key, rotary, hidden)
    again_positions, (again_cos, again_sin) = default_rotary(key, rotary, hidden)
    assert calls[0] == 1
    assert again_cos is cos and again_sin is sin and again_positions is positions
    expected_positions = torch.arange(10).unsqueeze(0)
    expected_cos, expected_sin = rotary(hidden, expected_positions)
    assert torch.equal(positions, expected_positions)
    assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
    assert cos.dtype == torch.float16


def test_length_and_dtype_and_frequencies_are_part_of_the_key() -> None:
    rotary = _rotary_module()
    calls = _count_calls(rotary)
    key = rotary_fingerprint(rotary)
    assert key is not None
    _, (short, _) = default_rotary(key, rotary, torch.zeros(1, 6, 32))
    _, (long, _) = default_rotary(key, rotary, torch.zeros(1, 12, 32))
    _, (half, _) = default_rotary(key, rotary, torch.zeros(1, 12, 32, dtype=torch.bfloat16))
    assert calls[0] == 3
    assert short.shape[1] == 6 and long.shape[1] == 12 and half.dtype == torch.bfloat16
    other = _rotary_module(rope_theta=500.0)
    other_key = rotary_fingerprint(other)
    assert other_key != key
    _, (other_cos, _) = default_rotary(other_key, other, torch.zeros(1, 12, 32))
    assert not torch.equal(other_cos, long)


def test_least_recently_used_entries_are_dropped() -> None:
    rotary = _rotary_module()
    calls = _count_calls(rotary)
    key = rotary_fingerprint(rotary)
    assert key is not None
    cache = DefaultRotaryCache(entries=2)
    for length in (4, 5, 4, 6):  # 4 is used again before 6 arrives: 5 goes
        cache.get(key, rotary, torch.zeros(1, length, 32))
    assert len(cache) == 2 and calls[0] == 3
    cache.get(key, rotary, torch.zeros(1, 4, 32))
    assert calls[0] == 3
    cache.get(key, rotary, torch.zeros(1, 5, 32))
    assert calls[0] == 4


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", {"full_attention": "default"}])
def test_frequencies_that_follow_the_sequence_have_no_key(rope_type: Any) -> None:
    rotary = _rotary_module()
    rotary.rope_type = rope_type
    assert rotary_fingerprint(rotary) is None


def test_without_a_key_the_tables_are_recomputed() -> None:
    rotary = _rotary_module()
    rotary.rope_type = "dynamic"
    calls = _count_calls(rotary)
    hidden = torch.zeros(1, 8, 32)
    for _ in range(3):
        default_rotary(None, rotary, hidden)
    assert calls[0] == 3 and len(_rotary._CACHE) == 0


def test_inference_mode_neither_reads_nor_fills_the_cache() -> None:
    rotary = _rotary_module()
    key = rotary_fingerprint(rotary)
    assert key is not None
    hidden = torch.zeros(1, 8, 32)
    with torch.inference_mode():
        _, (cos, _) = default_rotary(key, rotary, hidden)
    assert cos.is_inference() and len(_rotary._CACHE) == 0
    _, (cos, _) = default_rotary(key, rotary, hidden)
    assert not cos.is_inference()
    with torch.inference_mode():
        _, (inside, _) = default_rotary(key, rotary, hidden)
    assert inside is not cos


def test_a_wrapped_model_builds_each_length_once_and_matches_hf(cpu3: int) -> None:
    """Every decoder layer of every micro-batch reads the same tables, and the outputs are
    HF's; caller-given positions still go through the rotary module each call."""
    model = tiny_model("qwen3", vocab_size=64)
    reference = tiny_model("qwen3", vocab_size=64)
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1

    rp = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=True,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    for layer in rp.model[1:-1]:
        layer.rotary_emb.register_forward_hook(hook)
    ids = torch.randint(0, 64, (4, 16))
    got = rp(input_ids=ids).logits
    expected = reference(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    default_calls = calls[0]
    # one table per device that ran a decoder layer, not one per layer and micro-batch
    assert 1 <= default_calls <= cpu3 < 2 * 2
    calls[0] = 0
    positions = torch.arange(16).unsqueeze(0).expand(4, -1)
    got_positions = rp(input_ids=ids, position_ids=positions).logits
    assert calls[0] == 2 * 2  # 2 layers x 2 micro-batches
    assert torch.equal(got_positions, got)
