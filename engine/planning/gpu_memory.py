"""The GPU memory cap: `RoundPipe(max_gpu_memory=...)` parsed, and the floor it must clear.

A cap makes every engine device look as large as the cap (engine.device.set_gpu_memory_cap
applies it): the automatic plan's groups hold at most 30% of the cap in parameters each
(ModelExecutePlan.auto's default `model_memory_limit`: 60%, half of it per group since the
next is prefetched), one GPU's fused tail widens only within 90% of the cap
(engine.planning.one_device), and on CUDA the caching allocator cannot reserve past it.

The floor: whatever the plan, a device holds the largest layer with its gradients while
the next job's layer is uploaded beside it (engine.device.MAX_INFLIGHT_JOBS), and a
micro-batch's activations on top. A cap below the parameters' part can never run: RoundPipe
refuses it at construction (`check_gpu_memory_cap`), naming the smallest cap that clears
it. The activations depend on the batch, so over the cap at run time torch raises
torch.OutOfMemoryError instead (more micro-batches or recompute_grain='layer' hold fewer).

Torch-free: the daemon validates a job's value with `parse_max_gpu_memory` too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..errors import ConfigError
from .memory_plan import GIB, parse_bytes

__all__ = [
    "check_gpu_memory_cap",
    "min_gpu_memory_bytes",
    "parse_max_gpu_memory",
    "resolve_max_gpu_memory",
]

# Bytes the floor adds for what every job allocates besides layers and activations (cuBLAS
# workspaces, the caching allocator's rounding): a cap this close to the floor would run
# out of memory at the first job anyway.
WORKSPACE_BYTES = 256 << 20

# A plain number from here up is bytes, below it GiB: `max_gpu_memory=24` and
# `max_gpu_memory=24 * 2**30` both mean 24 GiB (no GPU holds 2**20 GiB, no cap is 1 MiB).
BYTES_FROM = 1 << 20


def parse_max_gpu_memory(
    value: float | int | str | None, *, name: str = "max_gpu_memory"
) -> int | None:
    """Bytes of a GPU memory cap: a number is GiB (24 or 23.5), or bytes from BYTES_FROM up
    (24 * 2**30); a string is read the same or carries a unit ('24GiB', '24G',
    '25769803776B'); None stays None (no cap).

    Raises:
        ConfigError: not a positive, finite size; the message names `name`.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a size in GiB (e.g. 24) or with a unit, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text)
        except ValueError:
            return parse_bytes(text, name=name)
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"{name} must be a positive size in GiB (e.g. 24, or '24GiB'), got {value!r}"
        )
    return int(value) if value >= BYTES_FROM else int(value * GIB)


def resolve_max_gpu_memory(value: float | int | str | None) -> int | None:
    """The cap a RoundPipe gets: `value` (its max_gpu_memory) parsed, else RP_GPU_MEMORY_GIB,
    else None (no cap)."""
    cap = parse_max_gpu_memory(value)
    if cap is not None:
        return cap
    from ..device import gpu_memory_gib_setting  # imports torch: only on this path

    return parse_max_gpu_memory(gpu_memory_gib_setting(), name="RP_GPU_MEMORY_GIB")


def min_gpu_memory_bytes(
    layer_bytes: Sequence[int], trainable_bytes: Sequence[int], activation_bytes: int = 0
) -> int:
    """The least memory a device can run these layers in: the largest layer with its
    gradients, the largest other layer prefetched beside it, `activation_bytes` of a
    micro-batch and WORKSPACE_BYTES."""
    if not layer_bytes:
        return WORKSPACE_BYTES + activation_bytes
    running = max(b + g for b, g in zip(layer_bytes, trainable_bytes, strict=True))
    return running + max(layer_bytes) + activation_bytes + WORKSPACE_BYTES


def check_gpu_memory_cap(
    cap_bytes: int,
    layer_bytes: Sequence[int],
    trainable_bytes: Sequence[int],
    activation_bytes: int = 0,
) -> None:
    """Raise ConfigError when `cap_bytes` is below `min_gpu_memory_bytes` of the layers,
    naming max_gpu_memory and the smallest value (GiB, rounded up to 0.1) that clears it."""
    need = min_gpu_memory_bytes(layer_bytes, trainable_bytes, activation_bytes)
    if cap_bytes >= need:
        return
    largest = max(range(len(layer_bytes)), key=lambda i: layer_bytes[i], default=None)
    what = (
        f"the largest layer (layer {largest}: {_gib(layer_bytes[largest])}) with its "
        "gradients while the next job's layer is uploaded beside it"
        if largest is not None
        else "the runtime's workspace"
    )
    smallest = math.ceil(need / GIB * 10) / 10
    raise ConfigError(
        f"max_gpu_memory={_gib(cap_bytes)} cannot hold {what}: that needs "
        f"{_gib(need)} before any activations; use max_gpu_memory={smallest:.1f} or "
        "more (RP_GPU_MEMORY_GIB for the default)",
        field="max_gpu_memory",
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.3g} GiB"
