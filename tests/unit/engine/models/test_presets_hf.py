"""The presets' Hugging Face call convention, and the Qwen2 / Mistral / Qwen3-MoE / GPT-OSS
presets, against the HF models themselves.

Oracle: the HF model (fp32, CPU) on the same weights. Each test wraps a deep copy of it in
RoundPipe on three virtual CPU devices and calls it exactly as HF code calls a model:
`rp(input_ids=x).logits`, `rp(input_ids=x, labels=x).loss`, and
`forward_backward(input_kwargs={"input_ids": x, "labels": x}, loss_fn=lambda out, _:
out.loss / n)`; losses, logits, gradients and the weights after three AdamW steps must
agree element-wise (rtol 1e-5).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from engine import RoundPipeRunConfig
from engine.models import count_loss_tokens
from engine.wrapper import wrap_model_to_roundpipe
from tests import tiny_models

transformers = pytest.importorskip("transformers")

VOCAB = 128
BATCH, SEQ = 4, 9
RTOL, ATOL = 1e-5, 1e-6


def tiny_model(kind: str, **overrides: Any) -> nn.Module:
    """A random 2-layer `*ForCausalLM` of `kind`, fp32, with 4-token windows where the
    family has them, so the sliding-window masks matter at SEQ tokens."""
    return tiny_models.tiny_model(kind, vocab_size=VOCAB, window=4, **overrides)


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids, a padding mask (row 0 padded left, row 2 right) and labels (-100 on padding)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, 5:] = 0  # the two halves differ in tokens and in loss tokens
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def wrap(model: nn.Module, num_microbatch: int) -> Any:
    return wrap_model_to_roundpipe(
        model,
        use_sequential_preset=True,
        model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch),
    )


def assert_grads_equal(got: nn.Module, expected: nn.Module) -> None:
    mine = dict(got.named_parameters())
    for name, p in expected.named_parameters():
        if p.grad is None:
            assert mine[name].grad is None or not mine[name].grad.any(), name
            continue
        torch.testing.assert_close(mine[name].grad, p.grad, rtol=RTOL, atol=ATOL, msg=name)


# ---- the call convention (Qwen3) ------------------------------------------------------


def test_forward_returns_hf_logits_and_batch_loss(cpu3: int) -> None:
    hf = tiny_model("qwen3")
    rp = wrap(copy.deepcopy(hf), num_microbatch=2)
    ids, mask, labels = batch(1)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, labels=labels)
        plain = rp(input_ids=ids)
        got = rp(input_ids=ids, attention_mask=mask, labels=labels)
        last = rp(input_ids=ids, logits_to_keep=2)
        as_tuple = rp(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    assert isinstance(got, transformers.modeling_outputs.CausalLMOutputWithPast)
    torch.testing.assert_close(plain.logits, hf(input_ids=ids).logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got.logits, expected.logits, rtol=RTOL, atol=ATOL)
    # The micro-batches count different loss tokens: the merged loss is the batch mean.
    assert count_loss_tokens(labels[:2]) != count_loss_tokens(labels[2:])
    torch.testing.assert_close(got.loss, expected.loss, rtol=RTOL, atol=ATOL)
    assert got.loss.dim() == 0 and list(got.keys()) == ["loss", "logits"]
    torch.testing.assert_close(last.logits, plain.logits[:, -2:], rtol=RTOL, atol=ATOL)
    # return_dict=False: HF's tuple, merged like the output object.
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 2
    torch.testing.assert_close(as_tuple[0], expected.loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(as_tuple[1], expected.logits, rtol=RTOL, atol=ATOL)


def test_merged_loss_backward_gives_hf_gradients(cpu3: int) -> None:
    hf = tiny_model("qwen3", tie_word_embeddings=True)
    mine = copy.deepcopy(hf)
    rp = wrap(mine, num_microbatch=2)
    ids, mask, labels = batch(2)
    expected = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
    expected.backward()
    out = rp(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    rp.synchronize()
    torch.testing.assert_close(out.loss, expected, rtol=RTOL, atol=ATOL)
    assert_grads_equal(mine, hf)


def test_forward_backward_with_the_hf_loss_line(cpu3: int) -> None:
    """`loss_fn=lambda out, _: out.loss / n`: the micro-batch means averaged, which is the
    batch mean when the micro-batches count the same tokens (labels = ids)."""
    n = 2
    hf = tiny_model("qwen3")
    mine = copy.deepcopy(hf)
    rp = wrap(mine, num_microbatch=n)
    ids, _, _ = batch(3)
    expected = hf(input_ids=ids, labels=ids).loss
    expected.backward()
    got = rp.forward_backward(
        input_kwargs={"input_ids": ids, "labels": ids}, loss_fn=lambda out, _: out.loss / n
    )
    rp.synchronize()
    torch.testing.assert_close(got, expected.detach(), rtol=RTOL, atol=ATOL)
    assert_grads_equal(mine, hf)


def test_forward_backward_with_padding_and_num_items_in_batch(cpu3: int) -> None:
    """Unequal micro-batches: HF's `num_items_in_batch` makes each `.loss` its share of the
    batch mean, so `loss_fn=lambda out, _: out.loss` sums to HF's batch loss."""
    hf = tiny_model("qwen3")
    mine = copy.deepcopy(hf)
    rp = wrap(mine, num_microbatch=3)
    ids, mask, labels = batch(4)
    expected = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
    expected.backward()
    got, outputs = rp.forward_backward(
        input_kwargs={
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "num_items_in_batch": count_loss_tokens(labels),
        },
        loss_fn=lambda out, _: out.loss,
        return_outputs=True,
    )
    rp.synchronize()
    torch.testing.assert_close(got, expected.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(outputs.loss, expected.detach(), rtol=RTOL, atol=ATOL)
    assert outputs.logits is None  # not built where the loss is taken under autograd
    assert_grads_equal(mine, hf)


def test_unsupported_arguments_are_named() -> None:
    from engine.errors import ConfigError
    from engine.models import to_sequential

    seq = to_sequential(tiny_model("qwen3"))
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ConfigError, match="output_attentions=True is not supported"):
        seq[0](input_ids=ids, output_attentions=True)
    with pytest.raises(ConfigError, match="unexpected argument 'label'"):
        seq[0](input_ids=ids, label=ids)
    seq[0](input_ids=ids, use_cache=False)  # what HF training code passes: accepted


# ---- the new families -------------------------------------------------------------------

FAMILIES = ["qwen2", "mistral", "qwen3_moe", "gpt_oss"]


def _adamw(params: Any) -> torch.optim.Optimizer:
    # lr 1e-3: see test_models._adamw (Adam amplifies rounding noise of tiny gradients).
    # eps 1e-6: an expert weight of the GPT-OSS model gets a gradient of -7.4e-9 from a
    # near-total cancellation, whose last bits differ by 5% between HF's summation order
    # and the engine's; at Adam's default eps (1e-8) that became a 1.2e-5 weight
    # difference in three steps. Gradients of 1e-3 are unaffected by eps either way.
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_trains_like_hf(kind: str, cpu3: int) -> None:
    """Logits, then loss, gradients and three AdamW steps through forward_backward.

    MoE families run with `output_router_logits=True`, so `.loss` includes HF's router
    auxiliary loss; one micro-batch, since that loss is not a sum over micro-batches.
    """
    moe = kind in ("qwen3_moe", "gpt_oss")
    extra = {"output_router_logits": True} if moe else {}
    n = 1 if moe else 2
    ref = tiny_model(kind)
    mine = copy.deepcopy(ref)
    rp = wrap(mine, num_microbatch=n)
    ref_opt, rp_opt = _adamw(ref.parameters()), _adamw(rp.optim_parameters())

    def step_fn() -> None:
        rp_opt.step()
        rp_opt.zero_grad()

    ids, mask, _ = batch(20)
    with torch.no_grad():
        expected_logits = ref(input_ids=ids, attention_mask=mask).logits
        got_logits = rp(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got_logits, expected_logits, rtol=RTOL, atol=ATOL)

    for step in range(3):
        ids, mask, labels = batch(10 + step)
        kwargs = {"input_ids": ids, "attention_mask": mask, "labels": labels, **extra}
        expected = ref(**kwargs)
        expected.loss.backward()
        got = rp.forward_backward(
            input_kwargs={
                **kwargs,
                "num_items_in_batch": None if moe else count_loss_tokens(labels),
            },
            loss_fn=lambda out, _: out.loss,
        )
        torch.testing.assert_close(got, expected.loss.detach(), rtol=RTOL, atol=ATOL)
        if step == 0:
            rp.synchronize()
            assert_grads_equal(mine, ref)
            if moe:
                assert expected.aux_loss > 0
        ref_opt.step()
        ref_opt.zero_grad()
        rp.step(step_fn, is_async=False)
    rp.synchronize()
    trained = dict(mine.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trained[name].detach(), p.detach(), rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_moe_losses_over_microbatches(kind: str, cpu3: int) -> None:
    """forward() merges the router statistics: `.loss` and `.aux_loss` of the whole batch.
    forward_backward's `.loss` per micro-batch is HF's on that micro-batch (gradient
    accumulation), so `out.loss / n` gives HF's micro-batch losses averaged."""
    n = 2
    ref = tiny_model(kind, output_router_logits=True)  # the config asks for the aux loss
    mine = copy.deepcopy(ref)
    rp = wrap(mine, num_microbatch=n)
    ids, mask, labels = batch(5)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask, labels=labels)
        got = rp(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.aux_loss, expected.aux_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got.loss, expected.loss, rtol=RTOL, atol=ATOL)

    total = torch.zeros(())
    for part in range(n):
        rows = slice(part * BATCH // n, (part + 1) * BATCH // n)
        loss = ref(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows]).loss / n
        loss.backward()
        total += loss.detach()
    got_total = rp.forward_backward(
        input_kwargs={"input_ids": ids, "attention_mask": mask, "labels": labels},
        loss_fn=lambda out, _: out.loss / n,
    )
    rp.synchronize()
    torch.testing.assert_close(got_total, total, rtol=RTOL, atol=ATOL)
    assert_grads_equal(mine, ref)


def test_moe_experts_keep_hf_names() -> None:
    """Experts stay in their decoder layer under their HF names (LoRA and save_pretrained
    find them there); dense layers of Qwen3-MoE keep their nn.Linear MLP."""
    from engine.models import to_sequential

    hf = tiny_model("qwen3_moe", mlp_only_layers=[1])
    seq = to_sequential(hf)
    names = {n for n, _ in seq[1].named_parameters()}
    assert {"layer.mlp.experts.gate_up_proj", "layer.mlp.experts.down_proj"} <= names
    assert isinstance(seq[2].layer.mlp.gate_proj, nn.Linear)
    assert {id(p) for p in seq.parameters()} == {id(p) for p in hf.parameters()}


def test_moe_merged_loss_backward_gives_whole_batch_gradients(cpu3: int) -> None:
    """`rp(..., labels=...).loss.backward()` over two micro-batches: the router statistics
    of both are merged before the aux loss is taken, so loss and gradients are HF's on the
    whole batch."""
    ref = tiny_model("qwen3_moe")
    mine = copy.deepcopy(ref)
    rp = wrap(mine, num_microbatch=2)
    ids, mask, labels = batch(6)
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    expected = ref(**kwargs, output_router_logits=True)
    expected.loss.backward()
    got = rp(**kwargs, output_router_logits=True)
    got.loss.backward()
    rp.synchronize()
    torch.testing.assert_close(got.loss, expected.loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got.aux_loss, expected.aux_loss, rtol=RTOL, atol=ATOL)
    assert_grads_equal(mine, ref)


def test_inputs_embeds_instead_of_ids() -> None:
    from engine.models import to_sequential

    hf = tiny_model("qwen2")
    seq = to_sequential(copy.deepcopy(hf))
    ids, mask, labels = batch(7)
    embeds = hf.model.embed_tokens(ids).detach()
    with torch.no_grad():
        expected = hf(inputs_embeds=embeds, attention_mask=mask, labels=labels)
        out = seq[0](inputs_embeds=embeds, attention_mask=mask, labels=labels)
        for layer in list(seq)[1:]:
            out = layer(out)
    torch.testing.assert_close(out.loss, expected.loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out.logits, expected.logits, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("window", [SEQ - 1, SEQ, SEQ + 1])
def test_mistral_window_at_the_sequence_length_matches_hf(cpu3: int, window: int) -> None:
    """A window of exactly the sequence length takes the plain causal mask (every key is in
    it); one token shorter keeps the sliding mask. Both give HF's logits and gradients."""
    hf = tiny_model("mistral", sliding_window=window)
    rp = wrap(copy.deepcopy(hf), num_microbatch=2)
    ids, _, _ = batch(3)
    expected = hf(input_ids=ids, labels=ids)
    expected.loss.backward()
    got = rp(input_ids=ids, labels=ids)
    got.loss.backward()
    torch.testing.assert_close(got.logits, expected.logits, rtol=RTOL, atol=ATOL)
    rp.synchronize()
    assert_grads_equal(rp.original_model, hf)
