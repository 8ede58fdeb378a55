"""Fixtures of the service's integration tests: real daemons with the fake worker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.service_daemon import Daemon


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Any]:
    """Factory: `make_daemon(RP_TOKEN="x", FAKE_STEP_S="0.2")` starts one; all stop at the end."""
    started: list[Daemon] = []

    def make(**env: str) -> Daemon:
        daemon = Daemon(tmp_path / f"data{len(started)}", env)
        started.append(daemon)
        daemon.start()
        return daemon

    yield make
    for daemon in started:
        daemon.stop()


@pytest.fixture
def service_daemon(make_daemon: Any) -> Daemon:
    """A daemon with the fake worker and no token."""
    return make_daemon()


@pytest.fixture(scope="module")
def module_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon shared by a module's tests that leave no jobs running."""
    daemon = Daemon(tmp_path_factory.mktemp("module-daemon") / "data", {})
    daemon.start()
    yield daemon
    daemon.stop()
