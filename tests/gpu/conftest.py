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


@pytest.fixture
def replay_settings() -> Iterator[None]:
    """engine.accel.graphs' switches restored (and no slots left) after the test."""
    from engine.accel import graphs

    saved = graphs.ENABLED, graphs.REPLAY_MAX_TOKENS
    try:
        yield
    finally:
        graphs.ENABLED, graphs.REPLAY_MAX_TOKENS = saved
        graphs.drop_all_slots()


@pytest.fixture
def math_attention() -> Iterator[None]:
    """Deterministic attention: SDPA's math kernels (not cuDNN's); the tests using it
    also recompute attention (`recompute_attention=True`)."""
    backends = torch.backends.cuda
    saved = (
        backends.flash_sdp_enabled(),
        backends.mem_efficient_sdp_enabled(),
        backends.cudnn_sdp_enabled(),
    )
    backends.enable_flash_sdp(False)
    backends.enable_mem_efficient_sdp(False)
    backends.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        backends.enable_flash_sdp(saved[0])
        backends.enable_mem_efficient_sdp(saved[1])
        backends.enable_cudnn_sdp(saved[2])


@pytest.fixture
def deterministic_inductor() -> Iterator[None]:
    """Inductor picks its Triton configs without timing them (`deterministic`): two compiles
    of the same graph in one test (a reference and the engine's) then choose the same
    kernels. Without it each compile benchmarks its candidates and may keep another one,
    whose reductions round differently in the last bf16 bit (bench/RESULTS.md, session
    20)."""
    import torch._inductor.config as inductor_config

    saved = inductor_config.deterministic
    inductor_config.deterministic = True
    torch._dynamo.reset()  # nothing compiled before may be reused
    try:
        yield
    finally:
        inductor_config.deterministic = saved
        torch._dynamo.reset()
