"""The HF decoder layer called whole, as a function of the layer (eager or compiled).

`run_whole` is how `DecoderLayer` runs a micro-batch that is not split into MLP chunks
(those: `_mlp_chunks`): one call of the HF layer, with the attention slot of
`_attention` ("save": keep the attention output for the recompute, "replay": hand it
back) where the layer chose one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from ..context import recompute_data_or_none, save_for_recompute
from ._attention import SLOT_KWARG, saving_attention
from ._compile import compile_for_devices

__all__ = ["run_whole"]


def run_whole(args: tuple[Any, ...], mode: str | None, compiled: bool) -> Tensor:
    """The HF decoder layer on `args` = (layer, hidden, mask, positions, cos, sin).

    `mode` as `_attention.attention_mode`; `compiled`: through torch.compile.
    """
    if mode == "save":
        call = _compiled_saving_call() if compiled else _decoder_call_saving_attention
        out, attn_out, attn_lse = call(*args)
        save_for_recompute(attn_out, attn_lse)
        return out
    call = _compiled_decoder_call() if compiled else _decoder_call
    return call(*args, recompute_data_or_none() if mode == "replay" else None)


def _decoder_call(
    layer: nn.Module,
    hidden: Tensor,
    mask: Tensor | None,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    attention: Any = None,
) -> Tensor:
    """One HF decoder layer on (mb, seq, hidden) states; `attention` is the slot for
    `_attention.saved_attention_forward` (None: plain attention)."""
    kwargs = {} if attention is None else {SLOT_KWARG: attention}
    out = layer(
        hidden,
        attention_mask=mask,
        position_ids=positions,
        position_embeddings=(cos, sin),
        **kwargs,
    )
    # Older transformers releases return a 1-tuple from decoder layers.
    return out[0] if isinstance(out, tuple) else out


# `_decoder_call` that also returns the attention output and log-sum-exp.
_decoder_call_saving_attention = saving_attention(_decoder_call)


@functools.cache
def _compiled_decoder_call() -> Callable[..., Tensor]:
    """`_decoder_call` under torch.compile, shared by every layer and device.

    The layer is an argument, not a compiled module: the engine runs device-side replicas
    of each layer, and torch.compile lifts their parameters as graph inputs, so all
    decoder layers of one shape share one compiled graph (one for grad, one for no-grad).
    It fuses HF's fp32 RMSNorm, rotary and SwiGLU elementwise work (the step's GPU time
    it saved: bench/RESULTS.md).
    """
    return compile_for_devices(_decoder_call)


@functools.cache
def _compiled_saving_call() -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """`_decoder_call_saving_attention` under torch.compile (see `_compiled_decoder_call`)."""
    return compile_for_devices(_decoder_call_saving_attention)
