"""Causal attention that the backward recompute does not run again.

With stage recompute every decoder layer runs its forward twice: once without grad (the
forward pass) and once with grad (the recompute before its backward). The attention
kernel's output and log-sum-exp are all its backward needs besides q, k and v, so the
first forward keeps them (`save_for_recompute`: to host memory with the stage's other
saved data) and the recompute hands them back instead of running the kernel again; at
long sequences the attention is a large part of a layer's forward (bench/RESULTS.md).

The kernels are cuDNN's fused attention (`aten._scaled_dot_product_cudnn_attention` and its
backward), the same ones SDPA picks for these shapes on the H100, so the saved output and
log-sum-exp are what the recompute would have produced and the gradients are unchanged.

HF attention modules find their kernel by `config._attn_implementation`; a preset points
its decoder layers' attention at `ATTENTION_NAME` (a private config copy, see
`route_attention`), which behaves exactly like "sdpa" unless the decoder layer passes
a slot (`SLOT_KWARG`): a list to fill (the forward), or the saved pair (the recompute).
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..context import doing_recompute, recompute_data_or_none, saving_for_recompute
from ._compile import HALF_DTYPES

if TYPE_CHECKING:
    from ._decoder import DecoderLayer

__all__ = [
    "ATTENTION_NAME",
    "SLOT_KWARG",
    "attention_mode",
    "kernels_work",
    "route_attention",
    "saving_attention",
]

log = logging.getLogger(__name__)

ATTENTION_NAME = "roundpipe_sdpa"
SLOT_KWARG = "roundpipe_attention"


def _cudnn_forward(
    query: Tensor, key: Tensor, value: Tensor, scale: float | None
) -> tuple[Tensor, Tensor]:
    """Causal attention output (b, h, s, d) and log-sum-exp (b, h, s, 1), fp32."""
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, 0.0, True, False, scale=scale
    )
    return out, lse


def _cudnn_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    # No dropout: the philox seed and offset are not read, and the cumulative sequence
    # lengths are those of a padded (not nested) batch, i.e. none.
    unused = torch.zeros((), dtype=torch.long, device=query.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out,
        query,
        key,
        value,
        out,
        lse,
        unused,
        unused,
        None,
        None,
        None,
        query.shape[2],
        key.shape[2],
        0.0,
        True,
        scale=scale,
    )
    return dq, dk, dv


class _ReplayedAttention(torch.autograd.Function):
    """Forward: the saved output; backward: the attention kernel's own backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        out_bshd: Tensor,
        lse: Tensor,
        scale: float | None,
    ) -> Tensor:
        ctx.save_for_backward(query, key, value, out_bshd, lse)
        ctx.scale = scale
        return out_bshd.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        query, key, value, out_bshd, lse = ctx.saved_tensors
        dq, dk, dv = _cudnn_backward(
            grad.contiguous().transpose(1, 2),
            query,
            key,
            value,
            out_bshd.transpose(1, 2),
            lse,
            ctx.scale,
        )
        return dq, dk, dv, None, None, None


def saved_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """HF attention-interface function: "sdpa", or the saving / replaying causal kernel.

    q is (b, heads, s, d), k and v (b, kv_heads, s, d); returns (b, s, heads, d) as the
    HF functions do. The slot is only passed where the decoder layer checked that the
    attention is plain causal (no mask, no dropout, no sliding window).
    """
    slot = kwargs.pop(SLOT_KWARG, None)
    if slot is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if isinstance(slot, list):
        out, lse = _cudnn_forward(query, key, value, scaling)
        out_bshd = out.transpose(1, 2).contiguous()
        slot.extend((out_bshd, lse))
        return out_bshd, None
    out_bshd, lse = slot
    return _ReplayedAttention.apply(query, key, value, out_bshd, lse, scaling), None


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, saved_attention_forward)


def route_attention(attention: nn.Module) -> bool:
    """Point an HF attention module that uses "sdpa" at `saved_attention_forward`.

    The module gets its own shallow copy of the config (the model's config, its
    `save_pretrained` output and its other modules stay as they were). Returns whether
    it was routed; other implementations (eager, flash, flex) are left alone.
    """
    config = getattr(attention, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    _register()
    private = copy.copy(config)
    # the internal field, not the property: its setter also rewrites shared sub-configs
    private._attn_implementation_internal = ATTENTION_NAME
    attention.config = private
    return True


@functools.cache
def kernels_work(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> bool:
    """Whether the cuDNN kernels run here and match plain attention (checked once on tiny
    inputs, since cuDNN support depends on the GPU, the library and the head shape)."""
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (1, heads, 64, head_dim)
    kv_shape = (1, kv_heads, 64, head_dim)
    q = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    k = torch.randn(kv_shape, device=device, dtype=dtype, generator=gen)
    v = torch.randn(kv_shape, device=device, dtype=dtype, generator=gen)
    g = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    try:
        with torch.no_grad():
            out, lse = _cudnn_forward(q, k, v, None)
            dq, dk, dv = _cudnn_backward(g, q, k, v, out, lse, None)
        with torch.enable_grad():
            ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
            rq, rk, rv = ref_in
            rk = rk.repeat_interleave(heads // kv_heads, 1)
            rv = rv.repeat_interleave(heads // kv_heads, 1)
            scores = (rq @ rk.transpose(-1, -2)) * head_dim**-0.5
            causal = torch.ones(64, 64, dtype=torch.bool, device=device).tril()
            ref = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ rv
            ref.backward(g.float())
        pairs = [(out, ref), *zip((dq, dk, dv), (t.grad for t in ref_in), strict=True)]
        ok = all(
            torch.allclose(a.float(), b, atol=2e-2, rtol=2e-2)
            for a, b in pairs  # type: ignore[arg-type]
        )
    except (RuntimeError, NotImplementedError) as exc:
        log.info("cuDNN attention unavailable (%s); attention is recomputed", exc)
        return False
    if not ok:
        log.warning("cuDNN attention disagrees with plain attention here; attention is recomputed")
    return ok


def attention_mode(decoder: DecoderLayer, hidden: Tensor, mask: Any) -> str | None:
    """'save' (a forward that will be recomputed), 'replay' (that recompute) or None, for
    a call of `decoder` on `hidden` with the causal `mask` it built.

    Only plain causal attention (no mask, dropout or sliding window) in half precision
    on CUDA, where the cuDNN kernels run.
    """
    if (
        decoder.recompute_attention
        or not decoder.attention_routed
        or mask is not None
        or not hidden.is_cuda
        or hidden.dtype not in HALF_DTYPES
    ):
        return None
    attention = decoder.layer.self_attn
    # A sliding window at least as long as the sequence is plain causal attention.
    window = getattr(decoder.config, "sliding_window", None)
    windowed = decoder.sliding or getattr(attention, "sliding_window", None) is not None
    if (windowed and (window is None or hidden.shape[1] > window)) or (
        attention.training and getattr(attention, "attention_dropout", 0.0) > 0
    ):
        return None
    if doing_recompute():
        saved = recompute_data_or_none()
        return "replay" if saved is not None and len(saved) == 2 else None
    if torch.is_grad_enabled() or not saving_for_recompute():
        return None
    if not kernels_work(hidden.device, hidden.dtype, *decoder.attention_shape):
        return None
    return "save"


def saving_attention(call: Callable[..., Tensor]) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """`call(layer, hidden, mask, positions, cos, sin, slot)` as a function that fills a
    fresh slot and also returns the attention output and log-sum-exp it kept ("save")."""

    def saving(*args: Any) -> tuple[Tensor, Tensor, Tensor]:
        slot: list[Tensor] = []
        out = call(*args, slot)
        return out, slot[0], slot[1]

    saving.__qualname__ = f"{call.__qualname__}_saving"
    return saving
