"""Schemathesis over the live daemon's OpenAPI schema: no input makes it answer 5xx."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.integration.service_daemon import Daemon


@pytest.fixture(scope="module")
def fuzzed_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    # Slow steps: the jobs fuzzing submits sit in the queue instead of keeping a CPU busy.
    # No token (RP_AUTH=none, loopback only), so every input reaches the routes.
    env = {"FAKE_STEP_S": "5", "RP_AUTH": "none"}
    daemon = Daemon(tmp_path_factory.mktemp("fuzz") / "data", env)
    daemon.start()
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed_daemon: Daemon):
    return schemathesis.openapi.from_url(f"{fuzzed_daemon.base_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_input_makes_a_server_error(case, fuzzed_daemon: Daemon) -> None:
    response = case.call(base_url=fuzzed_daemon.base_url, timeout=30)
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}"
    )
    if response.status_code >= 400:
        assert set(response.json()) == {"error"}, response.text[:500]
