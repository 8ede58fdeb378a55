"""Token-chunked MLP half of the dense decoder layers (long micro-batches).

Oracles: the same `DecoderLayer` with chunking off (layer output, input gradient and every
parameter gradient equal in fp32 at rtol 1e-5 / atol 1e-6), and the HF model itself for
`forward_backward` through RoundPipe. The thresholds are lowered to a few tokens (chunks
of 5 tokens above 8), with 23-token sequences so the last chunk is short and chunks cross
the boundary between sequences of a micro-batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import engine.models
from engine import RoundPipeRunConfig
from engine.models import _decoder, _mlp_chunks, count_loss_tokens, to_sequential
from engine.models._carry import HeadOptions
from engine.models._decoder import DecoderLayer
from engine.wrapper import wrap_model_to_roundpipe
from tests import tiny_models

transformers = pytest.importorskip("transformers")

VOCAB = 96
BATCH, SEQ = 2, 23
CHUNK, THRESHOLD = 5, 8
RTOL, ATOL = 1e-5, 1e-6
DENSE = ["qwen3", "llama", "mistral", "qwen2"]


def tiny_model(kind: str, **overrides: Any) -> nn.Module:
    """A random 2-layer fp32 `*ForCausalLM` (intermediate 96 = 3 x hidden), with 6-token
    windows where the family has them, so sliding masks matter at SEQ tokens."""
    return tiny_models.tiny_model(
        kind, vocab_size=VOCAB, window=6, intermediate_size=96, **overrides
    )


def padding_mask() -> Tensor:
    """Row 0 padded on the left, row 1 on the right."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :4] = 0
    mask[1, 17:] = 0
    return mask


def packed_positions() -> Tensor:
    """Two packed sequences per row (positions restart at 11)."""
    pos = torch.cat([torch.arange(11), torch.arange(SEQ - 11)])
    return pos.unsqueeze(0).expand(BATCH, SEQ).contiguous()


def counting_mlp_half(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count calls of the MLP-half body (each chunk's forward, and its recompute)."""
    calls: list[int] = []
    real = _mlp_chunks._mlp_half

    def counted(layer: nn.Module, hidden: Tensor) -> Tensor:
        calls.append(hidden.shape[0])
        return real(layer, hidden)

    monkeypatch.setattr(_mlp_chunks, "_mlp_half", counted)
    return calls


def run_layer(
    layer: DecoderLayer,
    hidden: Tensor,
    grad_out: Tensor,
    mask: Tensor | None,
    positions: Tensor | None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Output, input gradient and parameter gradients of one decoder layer."""
    layer.zero_grad(set_to_none=True)
    x = hidden.clone().requires_grad_()
    carry = (x, mask, positions, None, None, HeadOptions())
    out = layer(carry)[0]
    out.backward(grad_out)
    assert x.grad is not None
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def chunked_and_whole(kind: str) -> tuple[DecoderLayer, DecoderLayer]:
    layer = to_sequential(tiny_model(kind))[1]
    assert isinstance(layer, DecoderLayer) and layer.mlp_chunkable
    chunked = copy.deepcopy(layer)
    chunked.mlp_chunk_tokens, chunked.mlp_chunk_size = THRESHOLD, CHUNK
    layer.mlp_chunk_tokens = None
    return chunked, layer


@pytest.mark.parametrize("kind", DENSE)
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padded-packed"])
def test_chunked_layer_equals_whole_layer(
    kind: str, masked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunked, whole = chunked_and_whole(kind)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(BATCH, SEQ, 32, generator=gen)
    grad_out = torch.randn(BATCH, SEQ, 32, generator=gen)
    mask = padding_mask() if masked else None
    positions = packed_positions() if masked else None
    expected = run_layer(whole, hidden, grad_out, mask, positions)
    calls = counting_mlp_half(monkeypatch)
    got = run_layer(chunked, hidden, grad_out, mask, positions)
    # 46 tokens: nine chunks of 5 and a last one of 1, each run again in the backward
    # (in autograd's order)
    chunks = [CHUNK] * 9 + [1]
    assert calls[:10] == chunks and sorted(calls[10:]) == sorted(chunks)
    torch.testing.assert_close(got[0], expected[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got[1], expected[1], rtol=RTOL, atol=ATOL)
    assert got[2].keys() == expected[2].keys() and len(expected[2]) == len(list(whole.parameters()))
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=RTOL, atol=ATOL, msg=name)


def test_chunked_layer_without_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    """No grad: the chunks run one after the other, nothing recomputed, same output."""
    chunked, whole = chunked_and_whole("qwen3")
    hidden = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(2))
    carry = (hidden, padding_mask(), None, None, None, HeadOptions())
    calls = counting_mlp_half(monkeypatch)
    with torch.no_grad():
        expected = whole(carry)[0]
        assert calls == []  # the whole layer does not take the split path
        got = chunked(carry)[0]
    assert calls == [CHUNK] * 9 + [1]
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def test_threshold_and_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """At or below the threshold, and with MLP_CHUNK_TOKENS=None, the layer runs whole;
    the package switch is read when the preset is built."""
    assert engine.models.MLP_CHUNK_TOKENS == _mlp_chunks.DEFAULT_MLP_CHUNK_TOKENS == 131072
    hidden = torch.randn(BATCH, SEQ, 32)
    carry = (hidden, None, None, None, None, HeadOptions())
    calls = counting_mlp_half(monkeypatch)
    layer = to_sequential(tiny_model("qwen3"))[1]
    assert layer.mlp_chunk_tokens == 131072
    assert layer.mlp_chunk_size == _mlp_chunks.DEFAULT_MLP_CHUNK_SIZE
    layer.mlp_chunk_tokens = BATCH * SEQ  # not more tokens than the threshold
    with torch.no_grad():
        layer(carry)
    assert calls == []
    monkeypatch.setattr(engine.models, "MLP_CHUNK_TOKENS", None)
    off = to_sequential(tiny_model("qwen3"))[1]
    assert off.mlp_chunk_tokens is None
    with torch.no_grad():
        off(carry)
    assert calls == []
    monkeypatch.setattr(engine.models, "MLP_CHUNK_TOKENS", THRESHOLD)
    on = to_sequential(tiny_model("qwen3"))[1]
    with torch.no_grad():
        on(carry)
    assert calls == [BATCH * SEQ]  # one chunk: the default chunk size is larger


def test_moe_and_other_layers_are_never_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.models, "MLP_CHUNK_TOKENS", THRESHOLD)
    calls = counting_mlp_half(monkeypatch)
    # layer 1 sparse, layer 0 a dense MLP inside an MoE preset: both run whole
    seq = to_sequential(tiny_model("qwen3_moe", mlp_only_layers=[0]))
    carry = (torch.randn(BATCH, SEQ, 32), None, None, None, None, HeadOptions())
    for layer in seq[1:3]:
        assert not layer.mlp_chunkable
        with torch.no_grad():
            layer(carry)
    assert calls == []
    # a layer with an extra norm around its MLP (Gemma-like) is not the split structure
    plain = to_sequential(tiny_model("qwen3"))[1].layer
    assert _mlp_chunks.has_split_halves(plain)
    plain.pre_feedforward_layernorm = nn.Identity()
    assert not _mlp_chunks.has_split_halves(plain)


def saved_bytes(fn: Callable[[], Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for the backward while `fn` runs."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_chunked_layer_saves_less_than_half_for_backward() -> None:
    """The MLP's (tokens, intermediate) tensors dominate what a layer keeps at this shape
    (intermediate = 3 x hidden); chunked, autograd keeps only each chunk's input."""
    chunked, whole = chunked_and_whole("qwen3")
    chunked.mlp_chunk_size = 64
    hidden = torch.randn(4, 256, 32, requires_grad=True)
    carry = (hidden, None, None, None, None, HeadOptions())
    whole_bytes = saved_bytes(lambda: whole(carry)[0])
    chunked_bytes = saved_bytes(lambda: chunked(carry)[0])
    # The checkpoints hold their inputs by reference rather than through the saved-tensor
    # hooks: views of the attention half's output, one (tokens, hidden) tensor, counted here.
    held_by_checkpoints = hidden.numel() * hidden.element_size()
    assert chunked_bytes + held_by_checkpoints < whole_bytes / 2


# ---- through RoundPipe, against the HF model ---------------------------------------------


def lm_batch(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Ids, a padding mask (row 0 left-padded, row 2 right-padded) and labels, 4 x SEQ."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, 15:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


@pytest.mark.parametrize("kind", ["qwen3", "mistral"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_roundpipe_with_chunked_mlp_trains_like_hf(
    kind: str, grain: str, cpu3: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine.models, "MLP_CHUNK_TOKENS", THRESHOLD)
    monkeypatch.setattr(_decoder, "DEFAULT_MLP_CHUNK_SIZE", CHUNK)
    calls = counting_mlp_half(monkeypatch)
    hf = tiny_model(kind)
    mine = copy.deepcopy(hf)
    rp = wrap_model_to_roundpipe(
        mine,
        use_sequential_preset=True,
        model_run_config=RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain),
    )
    ids, mask, labels = lm_batch(3)
    expected = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
    expected.backward()
    got = rp.forward_backward(
        input_kwargs={
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "num_items_in_batch": count_loss_tokens(labels),
        },
        loss_fn=lambda out, _: out.loss,
    )
    rp.synchronize()
    # 2 layers x 2 micro-batches of 46 tokens: 10 chunks each in the forward, the
    # recompute and the backward's chunk recompute
    assert len(calls) == 2 * 2 * 10 * 3
    torch.testing.assert_close(got, expected.detach(), rtol=RTOL, atol=ATOL)
    params = dict(mine.named_parameters())
    for name, p in hf.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(params[name].grad, p.grad, rtol=RTOL, atol=ATOL, msg=name)
    with torch.no_grad():
        logits = rp(input_ids=ids, attention_mask=mask).logits
        ref = hf(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, ref, rtol=RTOL, atol=ATOL)
