"""What a serving process will hold in host memory, and whether its folder's weights are
whole, found before the process starts (blocking: reads config.json and the safetensors
headers, never a tensor; torch-free).

The figure is the one jobs are planned with (rp_service/jobs/hostmem.py): the runtime of
`engine.planning.memory_plan` (`RUNTIME_BYTES`, the process's libraries and, on a GPU, its
CUDA context) plus the weights in the dtype the process loads them in: float32 on the CPU;
on a GPU they go straight to the device (rp_service/serving/process.py), so none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.catalog import FAMILIES
from engine.errors import ConfigError
from engine.planning.memory_plan import RUNTIME_BYTES, ModelShape
from rp_service.jobs.weights import check_weights_cover, safetensors_numel
from rp_service.serving.models import BaseModel

__all__ = ["CPU_BYTES_PER_PARAM", "base_footprint"]

CPU_BYTES_PER_PARAM = 4  # float32, as process.Server loads a base on the CPU


def _read_config(folder: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None  # the process reports an unreadable folder when it loads it
    return config if isinstance(config, dict) else None


def _config_params(config: dict[str, Any] | None) -> int:
    if config is None:
        return 0
    try:
        return ModelShape.from_config(config).num_params
    except ConfigError:
        return 0  # a family the plan has no shape for: the runtime alone is counted


def _num_params(base: BaseModel) -> int:
    """Parameters of the base; raises InvalidRequest (`invalid_model`) for a folder whose
    weights do not cover its model (jobs/weights.py, as at submission)."""
    if base.path is not None:
        folder = Path(base.path)
        config = _read_config(folder)
        if config is not None:
            check_weights_cover(folder, config, param="model")
        counted = safetensors_numel(folder)
        return counted if counted is not None else _config_params(config)
    family = FAMILIES.get(base.preset or "")
    defaults = family.config_defaults if family is not None else None
    return _config_params({**defaults, **base.config} if defaults is not None else None)


def base_footprint(base: BaseModel, *, cuda: bool) -> int:
    """Host bytes a serving process of `base` holds once loaded.

    Raises:
        InvalidRequest: the folder's weights do not cover the model (`invalid_model`).
    """
    params = _num_params(base)
    runtime = RUNTIME_BYTES["cuda" if cuda else "cpu"]
    return runtime if cuda else runtime + params * CPU_BYTES_PER_PARAM
