"""Presets through RoundPipe on CUDA against the HF model on the same GPU.

fp32: losses and gradients equal to the HF model's at rtol 1e-5 / atol 1e-5 (cuBLAS may
pick other GEMM kernels for a micro-batch than for the whole batch: ~1e-6 apart), and the
weights after three AdamW steps equal to WEIGHT_ATOL (explained there).

bf16 (model) with fp32 optimizer weights: bf16 rounds every activation, so two bf16 runs
that group their sums differently (micro-batches, chunked loss) are not bit-equal. The
oracle is the fp32 HF model: RoundPipe's bf16 loss and gradients must be no further from
it than the HF model's own bf16 run is (x2, plus 1e-3 of the gradient's scale), and after
a step the bf16 weights must be the fp32 optimizer weights rounded to bf16.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from tests import tiny_models

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 256, 4, 67
# After 3 AdamW steps at lr 1e-3 (weights move ~3e-3): Adam divides by sqrt(v) ~ |g|,
# so for gradients near eps a GEMM-rounding difference of ~1e-6 (another cuBLAS kernel for
# a micro-batch than for the whole batch) moves an update by up to lr * 1e-2; measured
# 1.8e-5 on an H100. 5e-5 is under 2% of the distance the weights travel.
WEIGHT_ATOL = 5e-5


@pytest.fixture
def cuda_devices() -> Iterator[None]:
    from engine.device import reset_devices

    old = os.environ.get("RP_DEVICES")
    os.environ["RP_DEVICES"] = "cuda"
    reset_devices()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("RP_DEVICES", None)
        else:
            os.environ["RP_DEVICES"] = old
        reset_devices()


def tiny_model(kind: str, *, tie: bool, attn: str = "sdpa") -> nn.Module:
    return tiny_models.tiny_model(
        kind,
        attn=attn,
        vocab_size=VOCAB,
        num_hidden_layers=4,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        **tiny_models.WIDE,
    )


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[1, :9] = -100
    return ids, labels


def hf_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}


def hf_loss_and_grads(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor):
    model.zero_grad()
    loss = model(input_ids=ids.cuda(), labels=labels.cuda()).loss
    loss.backward()
    return loss.detach().float().cpu(), hf_grads(model)


@pytest.mark.parametrize("num_microbatch", [1, 4])
@pytest.mark.parametrize(
    ("kind", "tie", "attn"), [("qwen3", False, "sdpa"), ("llama", True, "eager")]
)
def test_fp32_roundpipe_trains_like_hf_on_cuda(
    cuda_devices: None,
    kind: str,
    tie: bool,
    attn: str,
    num_microbatch: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import engine.models
    from engine import RoundPipeRunConfig

    # The eager preset against HF at fp32 precision; the compiled path has its own test.
    monkeypatch.setattr(engine.models, "DISABLE_TORCH_COMPILE", True)
    from engine.models import causal_lm_loss_fn
    from engine.wrapper import wrap_model_to_roundpipe

    torch.backends.cuda.matmul.allow_tf32 = False
    ref = tiny_model(kind, tie=tie, attn=attn).cuda()
    mine = copy.deepcopy(ref).cpu()
    rp = wrap_model_to_roundpipe(
        mine, model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch)
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    rp_opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-3, weight_decay=0.1)

    def step_fn() -> None:
        rp_opt.step()
        rp_opt.zero_grad()

    for step in range(3):
        ids, labels = batch(step)
        expected, expected_grads = hf_loss_and_grads(ref, ids, labels)
        got = rp.forward_backward(
            input_kwargs={"input_ids": ids, "return_logits": False},
            label=labels,
            loss_fn=causal_lm_loss_fn(labels),
        )
        torch.testing.assert_close(got.float().cpu(), expected, rtol=1e-5, atol=1e-5)
        if step == 0:
            rp.synchronize()
            got_grads = hf_grads(mine)
            for name, g in expected_grads.items():
                torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-5, msg=name)
        ref_opt.step()
        rp.step(step_fn, is_async=False)
    rp.synchronize()
    trained = dict(mine.named_parameters())
    diffs = {
        name: (trained[name].detach().cpu() - p.detach().cpu()).abs().max().item()
        for name, p in ref.named_parameters()
    }
    worst = max(diffs, key=diffs.__getitem__)
    assert diffs[worst] <= WEIGHT_ATOL, f"{worst}: {diffs[worst]:.3g}"


def test_bf16_model_with_fp32_optimizer_on_cuda(cuda_devices: None) -> None:
    from engine import RoundPipeRunConfig
    from engine.models import causal_lm_loss_fn
    from engine.wrapper import wrap_model_to_roundpipe

    torch.backends.cuda.matmul.allow_tf32 = False
    exact = tiny_model("qwen3", tie=True).cuda()
    half = copy.deepcopy(exact).to(torch.bfloat16)
    mine = copy.deepcopy(half).cpu()
    ids, labels = batch(7)
    exact_loss, exact_grads = hf_loss_and_grads(exact, ids, labels)
    half_loss, half_grads = hf_loss_and_grads(half, ids, labels)

    rp = wrap_model_to_roundpipe(
        mine, model_run_config=RoundPipeRunConfig(num_microbatch=4), optim_dtype=torch.float32
    )
    got = rp.forward_backward(
        input_kwargs={"input_ids": ids, "return_logits": False},
        label=labels,
        loss_fn=causal_lm_loss_fn(labels),
    )
    assert got.dtype == torch.float32  # the loss is computed in fp32
    got = got.cpu()
    assert abs(got - exact_loss) <= 2 * abs(half_loss - exact_loss) + 1e-3 * exact_loss
    rp.synchronize()
    got_grads = hf_grads(mine)
    for name, e in exact_grads.items():
        my_err = (got_grads[name] - e).abs().max()
        hf_err = (half_grads[name] - e).abs().max()
        assert my_err <= 2 * hf_err + 1e-3 * e.abs().max(), name

    from engine.attribute import ParamAttribute

    masters = {n: ParamAttribute.get(p).optim for n, p in mine.named_parameters()}
    assert all(m is not None and m.dtype == torch.float32 for m in masters.values())
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-3)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    before = {n: p.detach().clone() for n, p in mine.named_parameters()}
    rp.step(step_fn, is_async=False)
    rp.synchronize()
    for name, p in mine.named_parameters():
        assert p.dtype == torch.bfloat16
        # The bf16 weights are the updated fp32 masters, rounded.
        assert torch.equal(p.detach().cpu(), masters[name].detach().to(torch.bfloat16).cpu()), name
    assert any(not torch.equal(before[n], p.detach()) for n, p in mine.named_parameters())


def test_chunked_loss_bf16_on_cuda() -> None:
    from engine.models import chunked_cross_entropy_sum

    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden_size, vocab = 1001, 128, 5003
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=gen)
    weight = torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.05
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    targets[::7] = -100

    def run(h: torch.Tensor, w: torch.Tensor, chunked: bool):
        h = h.detach().requires_grad_()
        w = w.detach().requires_grad_()
        if chunked:
            loss = chunked_cross_entropy_sum(h, w, targets, chunk_tokens=97)
        else:
            loss = torch.nn.functional.cross_entropy(
                (h @ w.t()).float(), targets, ignore_index=-100, reduction="sum"
            )
        loss.backward()
        return loss.detach(), h.grad.float(), w.grad.float()

    exact = run(hidden, weight, chunked=False)
    full_bf16 = run(hidden.bfloat16(), weight.bfloat16(), chunked=False)
    mine = run(hidden.bfloat16(), weight.bfloat16(), chunked=True)
    torch.testing.assert_close(mine[0], full_bf16[0], rtol=1e-5, atol=1e-3)
    for k in (1, 2):
        my_err = (mine[k] - exact[k]).abs().max()
        hf_err = (full_bf16[k] - exact[k]).abs().max()
        assert my_err <= 2 * hf_err + 1e-3 * exact[k].abs().max()
    exact32 = run(hidden, weight, chunked=True)
    for a, b in zip(exact32, exact, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_compiled_decoder_layers_on_cuda(cuda_devices: None) -> None:
    """fp16 decoder layers run torch.compile'd; fp32 ones stay eager and exact.

    The compiled fp16 loss and gradients are compared with the eager fp16 run within fp16
    resolution (the kernels are fused and round differently).
    """
    import engine.models
    from engine import RoundPipeRunConfig
    from engine.models import _layer_calls, causal_lm_loss_fn
    from engine.wrapper import wrap_model_to_roundpipe

    calls: list[str] = []
    compiled_fn = _layer_calls._compiled_decoder_call()

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append("compiled")
        return compiled_fn(*args, **kwargs)

    base = tiny_model("qwen3", tie=True, attn="sdpa")
    results = []
    for dtype, disable in ((torch.float32, False), (torch.float16, True), (torch.float16, False)):
        engine.models.DISABLE_TORCH_COMPILE = disable
        calls.clear()
        try:
            model = copy.deepcopy(base).to(dtype)
            rp = wrap_model_to_roundpipe(
                model,
                optim_dtype=torch.float32,
                model_run_config=RoundPipeRunConfig(num_microbatch=2),
            )
            ids, labels = batch(0)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(_layer_calls, "_compiled_decoder_call", lambda: spy)
                loss = rp.forward_backward(
                    input_kwargs={"input_ids": ids, "return_logits": False},
                    label=labels,
                    loss_fn=causal_lm_loss_fn(labels),
                )
            rp.synchronize()
            results.append((loss.float(), {k: g.float() for k, g in hf_grads(model).items()}))
        finally:
            engine.models.DISABLE_TORCH_COMPILE = False
        # fp32 and the disabled run stay eager; the fp16 default run is compiled
        assert bool(calls) == (dtype == torch.float16 and not disable)
    (_, _), (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=2e-3, atol=2e-3)
    for name, g in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], g, rtol=2e-2, atol=2e-3, msg=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_chunked_loss_on_cuda(dtype: torch.dtype) -> None:
    """Half-precision chunks run two compiled kernels; same loss and gradients as eager.

    Both paths take the same half logits from the same GEMM and do the softmax in fp32, so
    the loss agrees to fp32 rounding and the half gradients to a few half ulps of their
    largest entry (an fp32 exp that differs in its last bit can flip a rounding).
    """
    import engine.models
    from engine.models import chunked_cross_entropy_sum
    from engine.models import loss as loss_module

    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden_size, vocab = 1001, 128, 5003
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.05).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    targets[::7] = -100
    assert loss_module._fused_loss_kernels(hidden) is not None

    def run(disable: bool):
        engine.models.DISABLE_TORCH_COMPILE = disable
        try:
            h = hidden.detach().requires_grad_()
            w = weight.detach().requires_grad_()
            loss = chunked_cross_entropy_sum(h, w, targets, chunk_tokens=256)
            (loss / 1000).backward()
        finally:
            engine.models.DISABLE_TORCH_COMPILE = False
        return loss.detach(), h.grad.float(), w.grad.float()

    eager, compiled = run(True), run(False)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-4)
    eps = torch.finfo(dtype).eps
    for k in (1, 2):
        scale = eager[k].abs().max()
        assert (compiled[k] - eager[k]).abs().max() <= 4 * eps * scale


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_output_is_saved_not_recomputed_on_cuda(
    cuda_devices: None, dtype: torch.dtype
) -> None:
    """Half-precision decoder layers keep the attention output and log-sum-exp of their
    forward; the recompute runs no attention kernel, and the gradients are those of the
    run that recomputes attention (same cuDNN kernels: equal to half rounding).
    """
    import engine.models
    from engine import ModelExecutePlan, RoundPipeRunConfig
    from engine.models import _attention, causal_lm_loss_fn
    from engine.wrapper import wrap_model_to_roundpipe

    base = tiny_models.tiny_model(
        "qwen3",
        attn="sdpa",
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        head_dim=64,
        max_position_embeddings=512,
    )
    # The availability probe runs once per GPU, lazily, and calls the kernel itself: run it
    # on every GPU the engine uses now, so the count below sees the layers' calls only.
    for index in range(torch.cuda.device_count()):
        assert _attention.kernels_work(torch.device("cuda", index), dtype, 4, 2, 64)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 160), generator=gen)
    cudnn_calls: list[int] = []
    real_forward = _attention._cudnn_forward

    def counting_forward(*args: Any) -> Any:
        cudnn_calls.append(1)
        return real_forward(*args)

    # layers: embedding, 3 decoder layers, head (the fused tail): every decoder layer is
    # recomputed in its backward group
    plan = ModelExecutePlan.from_ranges(
        [range(0, 2), range(2, 4), range(4, 5)], [range(2, 4), range(0, 2)]
    )
    results = {}
    for recompute, compile_ in ((True, False), (False, False), (False, True)):
        engine.models.DISABLE_TORCH_COMPILE = not compile_
        cudnn_calls.clear()
        try:
            model = copy.deepcopy(base).to(dtype)
            rp = wrap_model_to_roundpipe(
                model,
                optim_dtype=torch.float32,
                model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan),
                recompute_attention=recompute,
            )
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(_attention, "_cudnn_forward", counting_forward)
                loss = rp.forward_backward(
                    input_kwargs={"input_ids": ids, "return_logits": False},
                    label=ids,
                    loss_fn=causal_lm_loss_fn(ids),
                )
            rp.synchronize()
        finally:
            engine.models.DISABLE_TORCH_COMPILE = False
        results[(recompute, compile_)] = (loss.float(), hf_grads(model))
        if not compile_:
            # eager: one saving kernel call per decoder layer and micro-batch, in the
            # forward only (the recompute replays them); none when attention is recomputed
            assert len(cudnn_calls) == (0 if recompute else 3 * 2)
    ref_loss, ref_grads = results[(True, False)]
    for key in ((False, False), (False, True)):
        loss, grads = results[key]
        torch.testing.assert_close(loss, ref_loss, rtol=2e-3, atol=2e-3)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=2e-2, atol=2e-3, msg=f"{key} {name}")
