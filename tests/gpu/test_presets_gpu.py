"""Qwen2, Mistral, Qwen3-MoE and GPT-OSS presets on CUDA against the HF model on the GPU,
called the Hugging Face way (`labels` -> `out.loss`, `.logits`).

fp32 (eager, TF32 off): logits, loss and gradients equal to the HF model's at rtol 1e-5 /
atol 1e-5 (cuBLAS may pick other GEMM kernels for a micro-batch than for the whole batch,
~1e-6 apart; see test_models_gpu).

Half precision with fp32 optimizer weights: fp16 for the dense families (through the
compiled decoder path), bf16 for the MoE families (transformers' default experts kernel on
CUDA is torch's grouped_mm, which takes bf16 operands; the MoE layers run eagerly). Two
half-precision runs that group their sums differently are not bit-equal, so the oracle is
the fp32 HF model: RoundPipe's loss and gradients must be no further from it than the HF
model's own half-precision run is (x2, plus 1e-3 of the gradient's scale), as in
test_models_gpu's bf16 test.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests import tiny_models

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 256, 4, 67
FAMILIES = ["qwen2", "mistral", "qwen3_moe", "gpt_oss"]
MOE = ("qwen3_moe", "gpt_oss")


def tiny_model(kind: str, **overrides: Any) -> nn.Module:
    """A random 3-layer model of `kind` (hidden 64), windows of 16 tokens, fp32."""
    moe: dict[str, Any] = {}
    if kind == "qwen3_moe":
        moe = {"num_experts": 8, "moe_intermediate_size": 32, "output_router_logits": True}
    elif kind == "gpt_oss":
        moe = {"num_local_experts": 8, "output_router_logits": True}
    return tiny_models.tiny_model(
        kind,
        window=16,
        vocab_size=VOCAB,
        num_hidden_layers=3,
        max_position_embeddings=256,
        **{**tiny_models.WIDE, **moe, **overrides},
    )


def batch(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    mask[3, 50:] = 0  # right padding
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None
    }


def hf_run(model: nn.Module, kwargs: dict[str, torch.Tensor]) -> tuple[Any, dict]:
    model.zero_grad()
    out = model(**{k: v.cuda() for k, v in kwargs.items()})
    out.loss.backward()
    return out, grads(model)


def wrap(model: nn.Module, num_microbatch: int, execute_plan: Any = None, **kwargs: Any) -> Any:
    from engine import RoundPipeRunConfig
    from engine.wrapper import wrap_model_to_roundpipe

    run_config = RoundPipeRunConfig(num_microbatch=num_microbatch, execute_plan=execute_plan)
    return wrap_model_to_roundpipe(model, model_run_config=run_config, **kwargs)


@pytest.mark.parametrize("kind", FAMILIES)
def test_fp32_family_matches_hf_on_cuda(
    kind: str, cuda_devices: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.models
    from engine.models import count_loss_tokens

    monkeypatch.setattr(engine.models, "DISABLE_TORCH_COMPILE", True)
    ref = tiny_model(kind)
    if kind in MOE:
        # The experts' plain loop: torch's grouped_mm (HF's default on CUDA) is a bf16
        # kernel; this test is about the preset, not about that kernel's fp32 support.
        ref.set_experts_implementation("eager")
    ref = ref.cuda()
    mine = copy.deepcopy(ref).cpu()
    rp = wrap(mine, num_microbatch=1 if kind in MOE else 2)
    kwargs = batch(0)
    with torch.no_grad():
        expected_logits = ref(input_ids=kwargs["input_ids"].cuda()).logits.float().cpu()
        got_logits = rp(input_ids=kwargs["input_ids"]).logits.float().cpu()
    torch.testing.assert_close(got_logits, expected_logits, rtol=1e-5, atol=1e-5)

    expected, expected_grads = hf_run(ref, kwargs)
    extra = {} if kind in MOE else {"num_items_in_batch": count_loss_tokens(kwargs["labels"])}
    got = rp.forward_backward(input_kwargs={**kwargs, **extra}, loss_fn=lambda out, _: out.loss)
    rp.synchronize()
    torch.testing.assert_close(got.float().cpu(), expected.loss.float().cpu(), rtol=1e-5, atol=1e-5)
    got_grads = grads(mine)
    assert got_grads.keys() == expected_grads.keys()
    for name, g in expected_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", FAMILIES)
def test_half_family_on_cuda(kind: str, cuda_devices: int) -> None:
    from engine.models import _layer_calls

    dtype = torch.bfloat16 if kind in MOE else torch.float16
    base = tiny_model(kind)
    exact = copy.deepcopy(base)
    if kind in MOE:
        exact.set_experts_implementation("eager")  # the fp32 oracle: see the fp32 test
    exact = exact.cuda()
    half = copy.deepcopy(base).to(dtype).cuda()  # HF's default experts kernel
    mine = copy.deepcopy(base).to(dtype)
    kwargs = batch(1)
    exact_out, exact_grads = hf_run(exact, kwargs)
    half_out, half_grads = hf_run(half, kwargs)
    exact_loss = exact_out.loss.float().cpu()
    half_loss = half_out.loss.float().cpu()

    calls: list[int] = []
    compiled_fn = _layer_calls._compiled_decoder_call()

    def spy(*args: object, **kw: object) -> torch.Tensor:
        calls.append(1)
        return compiled_fn(*args, **kw)

    rp = wrap(mine, num_microbatch=1, optim_dtype=torch.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_layer_calls, "_compiled_decoder_call", lambda: spy)
        got = rp.forward_backward(input_kwargs=kwargs, loss_fn=lambda out, _: out.loss)
    rp.synchronize()
    # Dense families take the compiled decoder path; MoE layers fall back to eager.
    assert bool(calls) == (kind not in MOE)
    got = got.float().cpu()
    assert abs(got - exact_loss) <= 2 * abs(half_loss - exact_loss) + 1e-3 * exact_loss
    got_grads = grads(mine)
    for name, e in exact_grads.items():
        my_err = (got_grads[name] - e).abs().max()
        hf_err = (half_grads[name] - e).abs().max()
        assert my_err <= 2 * hf_err + 1e-3 * e.abs().max(), name


@pytest.mark.parametrize("window", [SEQ, 16])
def test_mistral_saves_attention_when_the_window_covers_the_sequence(
    window: int, cuda_devices: int
) -> None:
    """A window at least as long as the sequence is plain causal attention: the cuDNN
    output is kept for the recompute; a shorter one takes HF's masked attention."""
    from engine import ModelExecutePlan
    from engine.models import _attention

    ref = tiny_model("mistral", sliding_window=window).to(torch.float16)
    ids = batch(2)["input_ids"]
    # The availability probe calls the kernel itself, once per GPU: run it before counting.
    for index in range(torch.cuda.device_count()):
        assert _attention.kernels_work(torch.device("cuda", index), torch.float16, 4, 2, 16)
    # embedding, 3 decoder layers, head: every decoder layer is recomputed in its backward
    plan = ModelExecutePlan.from_ranges(
        [range(0, 2), range(2, 4), range(4, 5)], [range(2, 4), range(0, 2)]
    )
    cudnn_calls: list[int] = []
    real_forward = _attention._cudnn_forward

    def counting_forward(*args: Any) -> Any:
        cudnn_calls.append(1)
        return real_forward(*args)

    results = []
    for recompute in (True, False):
        model = copy.deepcopy(ref)
        rp = wrap(
            model,
            num_microbatch=2,
            optim_dtype=torch.float32,
            execute_plan=plan,
            recompute_attention=recompute,
        )
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_attention, "_cudnn_forward", counting_forward)
            loss = rp.forward_backward(
                input_kwargs={"input_ids": ids, "labels": ids},
                loss_fn=lambda out, _: out.loss / 2,
            )
        rp.synchronize()
        results.append((loss.float().cpu(), grads(model)))
    covers = window >= SEQ
    # With saving on: one kernel call per decoder layer and micro-batch, or none.
    assert len(cudnn_calls) == (3 * 2 if covers else 0)
    (ref_loss, ref_grads), (loss, got_grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=2e-3, atol=2e-3)
    for name, g in ref_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=2e-2, atol=2e-3, msg=name)
