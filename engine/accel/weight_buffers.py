"""Double-buffered model weights: publishing a step's weights by swapping two host copies.

Without it the optimizer thread publishes a layer by converting its fp32 masters into the
half-precision model weights the devices upload (`p.data.copy_(master)`): a pass over the
whole model every step, at memory bandwidth (its time: bench/RESULTS.md), and with
overlapped calls it can only start once the running call's uploads of
the layer are done.

With it every trainable half-precision parameter has a second host copy of the same shape.
`engine.optim.Adam` writes the updated weights into it in its own pass (`set_model_copy`),
and the next step publishes the layer by swapping the two: the parameter's `.data` becomes
the copy just written, and the buffer it held becomes the one the next update writes.
The swap still waits for the running call's uploads (a later upload must not see the new
weights), but it costs nothing. Uploads already queued read the storage they were given,
and the next update writes the old buffer only after this step's publish, so no upload
reads a buffer being written.

A copy is swapped in only while it holds the master's present value
(`engine.optim.current_model_copy`); otherwise (another optimizer, a master changed after
the update, the first step) the publish converts the master as before.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attribute import ParamAttribute
from ..memory import arena_slot_bytes, host_block
from ..optim import current_model_copy, set_model_copy

__all__ = ["attach_second_copies", "publish_param", "second_copy_params", "takes_second_copy"]


def takes_second_copy(dtype: torch.dtype, optim_dtype: torch.dtype) -> bool:
    """Whether a trainable parameter of `dtype` with masters of `optim_dtype` gets a second
    copy: the C Adam writes half-precision copies of fp32 masters."""
    return dtype in (torch.float16, torch.bfloat16) and optim_dtype == torch.float32


def second_copy_params(
    params: list[tuple[nn.Parameter, ParamAttribute]],
) -> list[tuple[nn.Parameter, ParamAttribute]]:
    """The parameters that get a second copy: trainable, half precision, fp32 master."""
    return [
        (p, pa)
        for p, pa in params
        if pa.optim is not None and takes_second_copy(p.dtype, pa.optim.dtype) and p.is_contiguous()
    ]


def attach_second_copies(params: list[tuple[nn.Parameter, ParamAttribute]], *, pinned: bool) -> int:
    """Give each parameter of `second_copy_params(params)` a second host copy, as the model
    copy its master's update writes; returns the bytes allocated.

    The copies share one block (no per-tensor rounding), pinned when `pinned` and CUDA is
    there (`engine.memory.host_block`), so uploads from either copy run at pinned speed.
    """
    chosen = second_copy_params(params)
    sizes = [arena_slot_bytes(p.numel() * p.element_size()) for p, _ in chosen]
    block = host_block(sum(sizes), pinned=pinned)
    offset = 0
    for (p, pa), size in zip(chosen, sizes, strict=True):
        nbytes = p.numel() * p.element_size()
        copy = block[offset : offset + nbytes].view(p.dtype).view(p.shape)
        offset += size
        assert pa.optim is not None  # second_copy_params keeps trainable ones only
        set_model_copy(pa.optim, copy)
    return int(block.numel())


def publish_param(p: nn.Parameter, pa: ParamAttribute) -> bool:
    """Make `p`'s host weights the optimizer's: swap in the copy the optimizer wrote if it
    is current (True), else convert the master into `p` (False)."""
    master = pa.optim
    if master is None or pa.master_shared:  # compact: the optimizer wrote p itself
        return False
    fresh = current_model_copy(master)
    if fresh is None:
        p.data.copy_(master.data)
        return False
    old = p.data
    p.data = fresh
    set_model_copy(master, old)  # the next update writes the buffer uploads no longer read
    return True
