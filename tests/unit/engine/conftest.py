"""Fixtures that pick the virtual device count for an engine test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from engine.device import reset_devices


@pytest.fixture(params=[1, 3], ids=["cpu1", "cpu3"])
def num_devices(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run the test on cpu:1 and on cpu:3."""
    yield from use_devices(f"cpu:{request.param}", request.param)


@pytest.fixture
def cpu3() -> Iterator[int]:
    yield from use_devices("cpu:3", 3)


def use_devices(spec: str, n: int) -> Iterator[int]:
    old = os.environ.get("RP_DEVICES")
    os.environ["RP_DEVICES"] = spec
    reset_devices()
    try:
        yield n
    finally:
        if old is None:
            os.environ.pop("RP_DEVICES", None)
        else:
            os.environ["RP_DEVICES"] = old
        reset_devices()
