"""RoundPipe: train models far larger than GPU memory by streaming layers from host memory.

Public API (the seeds' contract): RoundPipe, AutoRoundPipe, RoundPipeRunConfig,
wrap_model_to_roundpipe, GradScaler; engine.optim.Adam; engine.context's
save_for_recompute / get_recompute_data / doing_recompute.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, DeviceError, RoundPipeError, StepError

if TYPE_CHECKING:
    from .adapters.lora import LoraConfig, apply_lora
    from .context import doing_recompute, get_recompute_data, save_for_recompute
    from .grad_scaler import GradScaler
    from .roundpipe import AutoRoundPipe, RoundPipe
    from .run_config import RoundPipeRunConfig
    from .scheduler import ModelExecutePlan
    from .wrapper import wrap_model_to_roundpipe

# Imported on first use (PEP 562), so torch-free modules such as engine.planning.memory_plan can be
# imported without torch: the daemon plans host memory at submission that way.
_LAZY = {
    "doing_recompute": ".context",
    "get_recompute_data": ".context",
    "save_for_recompute": ".context",
    "GradScaler": ".grad_scaler",
    "LoraConfig": ".adapters.lora",
    "apply_lora": ".adapters.lora",
    "AutoRoundPipe": ".roundpipe",
    "RoundPipe": ".roundpipe",
    "RoundPipeRunConfig": ".run_config",
    "ModelExecutePlan": ".scheduler",
    "wrap_model_to_roundpipe": ".wrapper",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AutoRoundPipe",
    "ConfigError",
    "DeviceError",
    "GradScaler",
    "LoraConfig",
    "ModelExecutePlan",
    "RoundPipe",
    "RoundPipeError",
    "RoundPipeRunConfig",
    "StepError",
    "apply_lora",
    "doing_recompute",
    "get_recompute_data",
    "save_for_recompute",
    "wrap_model_to_roundpipe",
]
