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


@pytest.fixture
def cpu4() -> Iterator[int]:
    yield from use_devices("cpu:4", 4)


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


@pytest.fixture
def replay_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Replay (engine.accel.graphs) on the virtual CPU devices; off again (and no slots
    left) afterwards.

    The automatic plan stays the one searched before any timing: RoundPipe re-plans from
    measured times after the 1st and 3rd call, and the groups it then cuts are another
    plan than the one the test meant (the sums do not change: test_device_count_results).
    """
    from engine import roundpipe as roundpipe_module
    from engine.accel import graphs

    monkeypatch.setattr(roundpipe_module, "_REPLAN_AFTER_UPDATES", ())
    saved = graphs.REPLAY_ON_CPU, graphs.REPLAY_MAX_TOKENS, graphs.ENABLED
    graphs.REPLAY_ON_CPU, graphs.ENABLED = True, True
    try:
        yield
    finally:
        graphs.REPLAY_ON_CPU, graphs.REPLAY_MAX_TOKENS, graphs.ENABLED = saved
        graphs.drop_all_slots()
