"""What this box has: versions, devices, memory, the C Adam build; probed lazily."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

from engine.options import fp8_capable
from rp_service import __version__
from rp_service.schemas import JobSpec

__all__ = ["DEMO_SPEC_PATH", "SystemProbe", "load_demo_spec"]

log = logging.getLogger(__name__)

DEMO_SPEC_PATH = Path(__file__).resolve().parent / "demo" / "demo_spec.json"

# Used only while rp_service/demo/demo_spec.json is missing: a tiny randomly initialised
# Qwen3 on synthetic data, a few seconds on a CPU.
_PLACEHOLDER_DEMO: dict[str, Any] = {
    "name": "demo",
    "model": {
        "preset": "qwen3",
        "config": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
        },
        "dtype": "float32",
    },
    "data": {"train": "synthetic", "seq_len": 64},
    "train": {
        "steps": 50,
        "batch_size": 4,
        "lr": 1e-3,
        "warmup_steps": 5,
        "eval_interval": 0,
        "checkpoint_interval": 25,
    },
    "engine": {"gpus": 1},
}


_PROBE_TIMEOUT_S = 120.0
_CUDA_PROBE = """
import json
try:
    import torch
except ImportError:
    print("[]")
    raise SystemExit(0)
out = []
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "total_memory_bytes": int(p.total_memory),
                    "capability": f"{p.major}.{p.minor}"})
print(json.dumps(out))
"""


def load_demo_spec() -> JobSpec:
    """The embedded demo JobSpec (what `rp demo` submits)."""
    if DEMO_SPEC_PATH.is_file():
        return JobSpec.model_validate(json.loads(DEMO_SPEC_PATH.read_text()))
    return JobSpec.model_validate(_PLACEHOLDER_DEMO)


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _optional_version(module: str, *, fallback: str | None = None) -> str | None:
    """The module's `__version__`, else its installed distribution's version, else
    `fallback`; None when the module cannot be imported here."""
    try:
        imported = importlib.import_module(module)
    except Exception:  # any import failure means "not available here"
        return None
    version = getattr(imported, "__version__", None)
    if version is not None:
        return str(version)
    for dist in importlib.metadata.packages_distributions().get(module, []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return fallback or "unknown"


class SystemProbe:
    """Caches the slow facts (torch import, CUDA devices); blocking, call it in a thread."""

    def __init__(self, *, probe_cuda: bool, host_budget: Callable[[], int] | None = None) -> None:
        self.probe_cuda = probe_cuda
        self.host_budget = host_budget  # the submission check's budget (SpecResolver)

    def cuda_device_count(self) -> int:
        return len(self.devices)

    @cached_property
    def devices(self) -> list[dict[str, Any]]:
        """CUDA devices, probed in a child process so the daemon never holds a CUDA context;
        each says whether it multiplies in float8 (`fp8`: engine.matmul_precision fp8)."""
        if not self.probe_cuda:
            return []
        try:
            done = subprocess.run(
                [sys.executable, "-c", _CUDA_PROBE],
                capture_output=True,
                text=True,
                timeout=_PROBE_TIMEOUT_S,
                check=True,
            )
            devices = json.loads(done.stdout.strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
            log.warning("probing CUDA devices failed (%s); running without GPUs", exc)
            return []
        if not isinstance(devices, list):
            return []
        for device in devices:
            if isinstance(device, dict) and "capability" in device:
                device["fp8"] = fp8_capable(str(device["capability"]))
        return devices

    @cached_property
    def versions(self) -> dict[str, str | None]:
        return {
            "rp_service": __version__,
            "python": platform.python_version(),
            "torch": _optional_version("torch"),
            # The engine has no __version__ of its own: it ships in this distribution.
            "engine": _optional_version("engine", fallback=__version__),
            "transformers": _optional_version("transformers"),
        }

    @cached_property
    def adam(self) -> dict[str, Any] | None:
        try:
            from engine.optim import native_info  # type: ignore[attr-defined]

            info = native_info()
            return dict(info) if info is not None else None
        except Exception:  # not built or not importable here: reported as null
            return None

    def snapshot(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "versions": self.versions,
            "devices": self.devices,
            "host_memory_bytes": _host_memory_bytes(),
            "pinned_budget_bytes": _pinned_budget_bytes(),
            "host_memory_budget_bytes": self.host_budget() if self.host_budget else None,
            "adam": self.adam,
        }


def _pinned_budget_bytes() -> int | None:
    """Memory the OS could still give to pinned buffers: MemAvailable from /proc/meminfo."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
