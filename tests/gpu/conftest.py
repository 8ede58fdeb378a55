"""GPU tests: run the engine on CUDA devices (skipped without CUDA)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def cuda_devices() -> Iterator[int]:
    """All visible GPUs as RoundPipe devices, TF32 off so fp32 compares tightly."""
    from engine.device import reset_devices

    old = os.environ.get("RP_DEVICES")
    os.environ["RP_DEVICES"] = "cuda"
    reset_devices()
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield torch.cuda.device_count()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev_tf32
        if old is None:
            os.environ.pop("RP_DEVICES", None)
        else:
            os.environ["RP_DEVICES"] = old
        reset_devices()
