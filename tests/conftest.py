"""Shared test setup: engine tests run on virtual CPU devices unless they choose CUDA."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RP_DEVICES", "cpu:3")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests when CUDA is absent (they run on the GPU machine with -m gpu)."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # the client-only environment has no torch
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
