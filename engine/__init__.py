"""RoundPipe: train models far larger than GPU memory by streaming layers from host memory.

Public API (the seeds' contract): RoundPipe, AutoRoundPipe, RoundPipeRunConfig,
wrap_model_to_roundpipe, GradScaler; engine.optim.Adam; engine.context's
save_for_recompute / get_recompute_data / doing_recompute.
"""

from __future__ import annotations

from .context import doing_recompute, get_recompute_data, save_for_recompute
from .errors import ConfigError, DeviceError, RoundPipeError, StepError
from .grad_scaler import GradScaler
from .lora import LoraConfig, apply_lora
from .roundpipe import AutoRoundPipe, RoundPipe
from .run_config import RoundPipeRunConfig
from .scheduler import ModelExecutePlan
from .wrapper import wrap_model_to_roundpipe

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
