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


def compile_for_devices(fn: Callable[..., Any], *, backend: str = "inductor") -> Callable[..., Any]:
    """`torch.compile(fn)` made safe to call from the engine's device threads at once.

    While one thread compiles, inductor may FX-trace, and that sets a process-wide flag
    (`torch.fx._symbolic_trace._is_fx_tracing_flag`). dynamo reads it in every thread: by
    default a compiled call from another thread then fails ("using FX to symbolically
    trace a dynamo-optimized function", seen on two H200s), and with
    `error_on_nested_fx_trace` off it runs the function eagerly: the same math fused
    differently, so a layer's result depended on whether another GPU was compiling at
    that moment. `force_compile_during_fx_trace` makes
    dynamo ignore the flag: the other thread runs its compiled graph (or waits on dynamo's
    compile lock to build one). torch releases without that switch keep the eager
    fallback, which is still better than an exception.

    Not solved here: each GPU's compile picks its Triton configs by timing, so the same
    layer can give other last bits on cuda:0 than on cuda:1 (measured on H200s; inductor's
    `deterministic` mode narrows it, does not remove it: bench/RESULTS.md, sessions 20-21).
    Runs stay reproducible because each RoundPipe keeps its own round robin (the same
    layer on the same GPU in two identical runs); across device counts the results agree
    within the bar docs/ENGINE.md states.
    """
    import torch._dynamo.config as dynamo_config

    if hasattr(dynamo_config, "force_compile_during_fx_trace"):
        dynamo_config.force_compile_during_fx_trace = True
    dynamo_config.error_on_nested_fx_trace = False
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=False, backend=backend)
