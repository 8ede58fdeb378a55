"""Presets (Qwen3, Llama) against the HF models they convert: logits, loss, gradients.

The oracle is the HF model itself: a deep copy of it is converted to the preset
`nn.Sequential` (or wrapped in RoundPipe) and must give the same outputs and gradients,
parameter by parameter, in fp32.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from engine.models import (
    SUPPORTED_MODELS,
    causal_lm_loss,
    causal_lm_loss_fn,
    to_sequential,
)
from tests import tiny_models

transformers = pytest.importorskip("transformers")

VOCAB = 256
BATCH, SEQ = 4, 11  # odd sizes: a sequence length no chunk or SIMD width divides
RTOL, ATOL = 1e-5, 1e-6


def tiny_model(kind: str, *, tie: bool = False, layers: int = 2, attn: str = "sdpa") -> nn.Module:
    """A random tiny `*ForCausalLM` (hidden 64, 4 heads, 2 kv heads, vocab 256), fp32."""
    return tiny_models.tiny_model(
        kind,
        attn=attn,
        vocab_size=VOCAB,
        num_hidden_layers=layers,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        **tiny_models.WIDE,
    )


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels with some ignored (-100) positions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[2, 5] = -100
    return ids, labels


def run_sequential(seq: nn.Sequential, *args: Any, **kwargs: Any) -> Any:
    """Call an engine-style Sequential: layer 0 takes the arguments, the rest chain."""
    out = seq[0](*args, **kwargs)
    for layer in list(seq)[1:]:
        out = layer(out)
    return out


def grads_by_name(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_equal(got: nn.Module, expected: nn.Module) -> None:
    g, e = grads_by_name(got), grads_by_name(expected)
    assert g.keys() == e.keys()
    for name in e:
        torch.testing.assert_close(g[name], e[name], rtol=RTOL, atol=ATOL, msg=name)


MODELS = [
    pytest.param("qwen3", False, "sdpa", id="qwen3-sdpa"),
    pytest.param("qwen3", True, "eager", id="qwen3-tied-eager"),
    pytest.param("llama", False, "eager", id="llama-eager"),
    pytest.param("llama", True, "sdpa", id="llama-tied-sdpa"),
]


def test_registry_lists_the_presets() -> None:
    assert SUPPORTED_MODELS == {
        "qwen3": "engine.models.qwen3",
        "llama": "engine.models.llama",
        "qwen2": "engine.models.qwen2",
        "mistral": "engine.models.mistral",
        "qwen3_moe": "engine.models.qwen3_moe",
        "gpt_oss": "engine.models.gpt_oss",
    }


@pytest.mark.parametrize(("kind", "tie", "attn"), MODELS)
def test_preset_logits_match_hf(kind: str, tie: bool, attn: str) -> None:
    hf = tiny_model(kind, tie=tie, layers=3, attn=attn)
    seq = to_sequential(copy.deepcopy(hf))
    ids, _ = batch()
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = run_sequential(seq, ids).logits
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(("kind", "tie", "attn"), MODELS)
def test_preset_loss_and_grads_match_hf(kind: str, tie: bool, attn: str) -> None:
    hf = tiny_model(kind, tie=tie, attn=attn)
    mine = copy.deepcopy(hf)
    seq = to_sequential(mine)
    ids, labels = batch()

    expected = hf(input_ids=ids, labels=labels).loss
    expected.backward()
    head_out = run_sequential(seq, ids, return_logits=False)
    assert isinstance(head_out, tuple) and len(head_out) == 2
    got = causal_lm_loss(head_out, labels, chunk_tokens=7)
    got.backward()

    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert_grads_equal(mine, hf)
    if tie:
        assert mine.lm_head.weight is mine.model.embed_tokens.weight


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_mask_and_packed_positions_match_hf(attn: str) -> None:
    hf = tiny_model("qwen3", attn=attn)
    mine = copy.deepcopy(hf)
    seq = to_sequential(mine)
    ids, labels = batch(2)
    # Right padding in row 1, and row 3 packs two sequences (positions restart at 6).
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    labels[1, 8:] = -100
    positions = torch.arange(SEQ).repeat(BATCH, 1)
    positions[3, 6:] = torch.arange(SEQ - 6)

    for kwargs in ({"attention_mask": mask}, {"position_ids": positions}):
        hf.zero_grad()
        mine.zero_grad()
        expected = hf(input_ids=ids, labels=labels, **kwargs).loss
        expected.backward()
        got = causal_lm_loss(run_sequential(seq, ids, return_logits=False, **kwargs), labels)
        got.backward()
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
        assert_grads_equal(mine, hf)


def test_loss_fn_sums_to_batch_mean_over_microbatches() -> None:
    hf = tiny_model("llama", tie=True)
    mine = copy.deepcopy(hf)
    seq = to_sequential(mine)
    ids, labels = batch(3)
    expected = hf(input_ids=ids, labels=labels).loss
    expected.backward()

    loss_fn = causal_lm_loss_fn(labels, chunk_tokens=5)
    total = torch.zeros(())
    for mb_ids, mb_labels in zip(ids.split([1, 3]), labels.split([1, 3]), strict=True):
        loss = loss_fn(run_sequential(seq, mb_ids, return_logits=False), mb_labels)
        loss.backward()
        total += loss.detach()
    torch.testing.assert_close(total, expected.detach(), rtol=RTOL, atol=ATOL)
    assert_grads_equal(mine, hf)


def test_preset_keeps_hf_modules_and_parameter_names() -> None:
    hf = tiny_model("qwen3", tie=True)
    seq = to_sequential(hf)
    assert len(seq) == hf.config.num_hidden_layers + 2
    assert seq[0].embed_tokens is hf.model.embed_tokens
    assert seq[1].layer is hf.model.layers[0]
    assert seq[-1].lm_head is hf.lm_head
    hf_params = {id(p) for p in hf.parameters()}
    assert {id(p) for p in seq.parameters()} == hf_params


def test_unsupported_class_of_a_supported_type_is_refused() -> None:
    base = tiny_model("qwen3").model  # Qwen3Model: no LM head
    with pytest.raises(NotImplementedError, match="Qwen3ForCausalLM"):
        to_sequential(base)


def test_unsupported_model_type_lists_presets() -> None:
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(
        NotImplementedError, match=r"qwen3 \(Qwen3ForCausalLM\).*llama|llama.*qwen3"
    ):
        to_sequential(transformers.GPT2LMHeadModel(config))


# ---- through the engine: RoundPipe on virtual CPU devices ------------------------------

STEPS = 3


def _adamw(params: Any) -> torch.optim.Optimizer:
    # Adam's update is ~lr * g / (|g| + eps): for gradients near eps it amplifies rounding
    # differences (chunked vs full loss: ~1e-7) by up to lr / eps. lr 1e-3 keeps that under
    # 1e-5 while the weights still move by ~3e-3 in three steps.
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


@pytest.mark.parametrize("num_microbatch", [1, 4])
@pytest.mark.parametrize(("kind", "tie"), [("qwen3", False), ("llama", True)])
def test_roundpipe_trains_like_hf(
    kind: str, tie: bool, num_microbatch: int, num_devices: int
) -> None:
    from engine import RoundPipe, RoundPipeRunConfig
    from engine.wrapper import wrap_model_to_roundpipe

    ref = tiny_model(kind, tie=tie, layers=3)
    mine = copy.deepcopy(ref)
    rp = wrap_model_to_roundpipe(
        mine,
        use_sequential_preset=True,
        model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch),
    )
    assert isinstance(rp, RoundPipe)
    assert rp.config is mine.config  # attributes fall through to the HF model
    ref_opt = _adamw(ref.parameters())
    rp_opt = _adamw(rp.optim_parameters())

    def step_fn() -> None:
        rp_opt.step()
        rp_opt.zero_grad()

    for step in range(STEPS):
        ids, labels = batch(10 + step)
        expected = ref(input_ids=ids, labels=labels).loss
        expected.backward()
        # return_logits left to the head: the fused last stage runs with grad enabled.
        got = rp.forward_backward(
            input_kwargs={"input_ids": ids}, label=labels, loss_fn=causal_lm_loss_fn(labels)
        )
        torch.testing.assert_close(got, expected.detach(), rtol=RTOL, atol=ATOL)
        if step == 0:
            rp.synchronize()  # .grad of the HF parameters now holds the gradients
            assert_grads_equal(mine, ref)
        ref_opt.step()
        ref_opt.zero_grad()
        rp.step(step_fn, is_async=False)
    rp.synchronize()

    # atol 1e-5 for the weights: see _adamw.
    trained = dict(mine.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            trained[name].detach(), p.detach(), rtol=RTOL, atol=1e-5, msg=name
        )


def test_roundpipe_inference_returns_hf_logits(cpu3: int) -> None:
    from engine import RoundPipeRunConfig
    from engine.wrapper import wrap_model_to_roundpipe

    ref = tiny_model("qwen3", tie=True)
    rp = wrap_model_to_roundpipe(
        copy.deepcopy(ref), model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    ids, _ = batch(4)
    mask = torch.ones_like(ids)
    mask[2, 7:] = 0
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).logits
        got = rp(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def test_trained_roundpipe_model_saves_in_hf_format(tmp_path: Any, cpu3: int) -> None:
    from engine import RoundPipeRunConfig
    from engine.wrapper import wrap_model_to_roundpipe

    hf = tiny_model("llama", tie=True)
    before = {n: p.detach().clone() for n, p in hf.named_parameters()}
    rp = wrap_model_to_roundpipe(hf, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = _adamw(rp.optim_parameters())

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    ids, labels = batch(5)
    rp.forward_backward(
        input_kwargs={"input_ids": ids, "return_logits": False},
        label=labels,
        loss_fn=causal_lm_loss_fn(labels),
    )
    rp.step(step_fn)  # async
    rp.synchronize()
    hf.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    for name, p in loaded.named_parameters():
        trained = dict(hf.named_parameters())[name].detach()
        torch.testing.assert_close(p.detach(), trained, rtol=0, atol=0, msg=name)
        assert not torch.equal(trained, before[name]), f"{name} was not trained"


def test_roundpipe_forward_with_grad_backpropagates_logits(cpu3: int) -> None:
    from engine import RoundPipeRunConfig
    from engine.wrapper import wrap_model_to_roundpipe

    ref = tiny_model("qwen3", tie=True)
    mine = copy.deepcopy(ref)
    rp = wrap_model_to_roundpipe(mine, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    ids, labels = batch(6)
    expected = ref(input_ids=ids, labels=labels).loss
    expected.backward()
    # forward() runs the head without grad and recomputes it for backward: logits both times.
    logits = rp(ids)
    got = causal_lm_loss(logits, labels)
    got.backward()
    rp.synchronize()
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert_grads_equal(mine, ref)
