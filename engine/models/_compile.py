"""torch.compile for the engine's device threads, and which dtypes run compiled.

The presets' decoder layers (`_decoder`) and the chunked loss (`loss`) compile their fp16 /
bf16 work on CUDA through `compile_for_devices`; fp32 and CPU devices run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["HALF_DTYPES", "compile_for_devices"]

# The dtypes whose CUDA work goes through compiled functions (fp32 keeps eager numerics).
HALF_DTYPES = (torch.float16, torch.bfloat16)

# One compiled variant per (device, grad mode, input shapes): two per GPU for a decoder
# layer. dynamo's default of 8 would leave GPUs 5-8 of an 8-GPU box running eagerly.
_RECOMPILE_LIMIT = 64


def compile_for_devices(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compile(fn)` made safe to call from the engine's device threads at once.

    While one thread compiles, inductor may FX-trace (it sets a process-wide flag), and
    dynamo then refuses a compiled call from any other thread ("using FX to symbolically
    trace a dynamo-optimized function"): seen on two H200s, where both controller threads
    compile their first layer together. With `error_on_nested_fx_trace` off such a call
    runs the function eagerly instead (same math, fused differently); compilations
    themselves are serialised by dynamo's own lock.
    """
    import torch._dynamo.config as dynamo_config

    dynamo_config.error_on_nested_fx_trace = False
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=False)
