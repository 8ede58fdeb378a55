"""Token-chunked MLP half on CUDA in fp16: same gradients, lower peak memory.

A Qwen3 decoder layer (hidden 1024, intermediate 3072, as Qwen3-0.6B) on 8192 tokens
with the chunking threshold lowered to 4096 tokens (chunks of 2048), eager and under
torch.compile, against the same layer run whole. fp16 rounds every activation and the
chunked run sums each weight gradient over chunks in fp16, so the two agree to fp16
resolution (rtol 2e-2, atol 2e-2 of the gradient's largest entry), not bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tests.tiny_models import tiny_model

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")

TOKENS, THRESHOLD, CHUNK = 8192, 4096, 2048
HIDDEN = 1024


def qwen3(num_layers: int, vocab: int = 256) -> nn.Module:
    return tiny_model(
        "qwen3",
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=3072,
        num_hidden_layers=num_layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=TOKENS,
    )


def close(got: Tensor, expected: Tensor, name: str) -> None:
    got, expected = got.float(), expected.float()
    atol = 2e-2 * expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=atol, msg=name)


def layer_step(layer: nn.Module, hidden: Tensor, grad_out: Tensor) -> tuple[Tensor, int]:
    """Input and parameter gradients of one forward + backward, and its peak bytes above
    what was allocated before it."""
    from engine.models._carry import HeadOptions

    layer.zero_grad(set_to_none=True)
    x = hidden.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = layer((x, None, None, None, None, HeadOptions()))[0]
    out.backward(grad_out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    return torch.cat([g.float().flatten() for g in grads]), peak


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_chunked_fp16_layer_gradients_and_peak_memory(compiled: bool) -> None:
    from engine.models import to_sequential

    whole = to_sequential(qwen3(1).to("cuda", torch.float16))[1]
    whole.use_compile = compiled
    whole.mlp_chunk_tokens = None
    chunked = copy.deepcopy(whole)
    chunked.mlp_chunk_tokens, chunked.mlp_chunk_size = THRESHOLD, CHUNK
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(1, TOKENS, HIDDEN, device="cuda", dtype=torch.float16, generator=gen)
    grad_out = torch.randn(hidden.shape, device="cuda", dtype=torch.float16, generator=gen)
    layer_step(whole, hidden, grad_out)  # warm-up: compile, cuBLAS workspaces
    layer_step(chunked, hidden, grad_out)
    expected, whole_peak = layer_step(whole, hidden, grad_out)
    got, chunked_peak = layer_step(chunked, hidden, grad_out)
    close(got, expected, "gradients")
    # Whole: three (8192, 3072) fp16 tensors of 48 MiB each are kept for the backward.
    assert chunked_peak < whole_peak, (chunked_peak, whole_peak)


def test_roundpipe_fp16_with_chunked_mlp_matches_unchunked(
    cuda_devices: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through RoundPipe (compiled layers, saved attention replayed in the recompute): the
    loss and gradients with the MLP chunked match those without."""
    import engine.models
    from engine import ModelExecutePlan, RoundPipeRunConfig
    from engine.models import _decoder, _mlp_chunks
    from engine.wrapper import wrap_model_to_roundpipe

    base = qwen3(2).half()
    ids = torch.randint(0, 256, (1, TOKENS), generator=torch.Generator().manual_seed(2))
    results: dict[bool, tuple[Tensor, dict[str, Tensor]]] = {}
    calls: list[int] = []
    compiled_body: Callable[..., Any] = _mlp_chunks._compiled_mlp_half()

    def counted(layer: nn.Module, hidden: Tensor) -> Tensor:
        calls.append(hidden.shape[0])  # outside the compiled body: counts every call
        return compiled_body(layer, hidden)

    monkeypatch.setattr(_mlp_chunks, "_compiled_mlp_half", lambda: counted)
    monkeypatch.setattr(_decoder, "DEFAULT_MLP_CHUNK_SIZE", CHUNK)
    assert not engine.models.DISABLE_TORCH_COMPILE
    # layers: embedding, 2 decoder layers, head (the fused tail): both decoder layers run a
    # no-grad forward and a recompute (saving and replaying their attention where cuDNN's
    # kernels run)
    plan = ModelExecutePlan.from_ranges(
        [range(0, 2), range(2, 3), range(3, 4)], [range(2, 3), range(0, 2)]
    )
    for chunk in (False, True):
        monkeypatch.setattr(engine.models, "MLP_CHUNK_TOKENS", THRESHOLD if chunk else None)
        calls.clear()
        model = copy.deepcopy(base)
        rp = wrap_model_to_roundpipe(
            model,
            use_sequential_preset=True,
            optim_dtype=torch.float32,
            model_run_config=RoundPipeRunConfig(num_microbatch=1, execute_plan=plan),
        )
        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "labels": ids}, loss_fn=lambda out, _: out.loss
        )
        rp.synchronize()
        grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
        results[chunk] = (loss.detach().float().cpu(), grads)
        # 2 layers x 4 chunks, in the forward, the recompute and the chunks' backward
        assert calls == ([CHUNK] * 24 if chunk else [])
    # The oracle: the same (fp16-rounded) weights in fp32 through the HF model. fp16 runs
    # of the same math differ by rounding (compiled bodies fuse differently chunked and
    # whole; the embedding gradient sums ~32 tokens a row), so the chunked run must be as
    # close to fp32 as the unchunked one is, not equal to it element by element.
    ref = copy.deepcopy(base).float().cuda()
    ref_loss = ref(input_ids=ids.cuda(), labels=ids.cuda()).loss
    ref_loss.backward()
    expected = {n: p.grad.detach().float().cpu() for n, p in ref.named_parameters()}
    close(results[True][0], ref_loss.detach().float().cpu(), "loss")
    for name, grad in expected.items():
        scale = grad.abs().max().item() or 1.0
        err_chunked = (results[True][1][name] - grad).abs().max().item() / scale
        err_whole = (results[False][1][name] - grad).abs().max().item() / scale
        assert err_chunked <= 2 * err_whole + 1e-3, (name, err_chunked, err_whole)
