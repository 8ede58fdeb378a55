"""The daemon's services: built once per app, reached through the dependencies, closed by
the lifespan in the reverse order of what they depend on."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rp_service.app import create_app
from rp_service.jobs.orchestrator import Orchestrator
from rp_service.jobs.store import Store
from rp_service.services import Services
from rp_service.serving.manager import ServingManager
from rp_service.settings import Settings

LOOPBACK = "http://127.0.0.1:8321"


def test_each_service_is_built_once_and_shared(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path, gpus="none", auth="none"))
    services: Services = app.state.services
    assert services.chat.manager is services.serving
    assert services.chat.store is services.store
    assert services.fine_tuning.orchestrator is services.orchestrator
    assert services.fine_tuning.outputs is services.outputs
    assert services.serving.pool is services.orchestrator
    # The orchestrator asks the one serving manager for GPUs back when a job waits.
    assert services.orchestrator.gpus_wanted == services.serving.yield_gpus


def test_the_lifespan_stops_serving_then_jobs_then_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    serving_stop, orchestrator_stop, store_close = (
        ServingManager.stop,
        Orchestrator.stop,
        Store.close,
    )

    async def stop_serving(self: ServingManager) -> None:
        calls.append("serving")
        await serving_stop(self)

    async def stop_orchestrator(self: Orchestrator) -> None:
        calls.append("orchestrator")
        await orchestrator_stop(self)

    def close_store(self: Store) -> None:
        calls.append("store")
        store_close(self)

    monkeypatch.setattr(ServingManager, "stop", stop_serving)
    monkeypatch.setattr(Orchestrator, "stop", stop_orchestrator)
    monkeypatch.setattr(Store, "close", close_store)
    app = create_app(Settings(data_dir=tmp_path, gpus="none", auth="none"))
    with TestClient(app, base_url=LOOPBACK) as client:
        assert client.get("/v1/models").status_code == 200  # the chat service answers
        assert calls == []
    assert calls == ["serving", "orchestrator", "store"]


def test_a_failing_serving_stop_still_stops_the_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    orchestrator_stop = Orchestrator.stop

    async def broken(self: ServingManager) -> None:
        raise RuntimeError("a serving process would not die")

    async def stop_orchestrator(self: Orchestrator) -> None:
        calls.append("orchestrator")
        await orchestrator_stop(self)

    monkeypatch.setattr(ServingManager, "stop", broken)
    monkeypatch.setattr(Orchestrator, "stop", stop_orchestrator)
    app = create_app(Settings(data_dir=tmp_path, gpus="none", auth="none"))
    with pytest.raises(RuntimeError, match="would not die"), TestClient(app, base_url=LOOPBACK):
        pass
    assert calls == ["orchestrator"]
