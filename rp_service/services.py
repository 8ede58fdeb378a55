"""The daemon's long-lived services: built once by `create_app`, started and closed by its
lifespan, reached by the routes only through `rp_service.api.deps`.

One store, one orchestrator, one serving manager: two of either would each think they
own the database or the GPUs. Closing runs in the reverse order of the dependencies:
served models first (their GPUs go back to the orchestrator's pool), then the jobs (a
checkpoint each), then the store's threads and the store.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rp_service.jobs.events import EventHub
from rp_service.jobs.files import FileService
from rp_service.jobs.orchestrator import Orchestrator
from rp_service.jobs.outputs import JobOutputs
from rp_service.jobs.store import Store
from rp_service.jobs.store_io import StoreIO
from rp_service.openai import Chat, FineTuning, Graders
from rp_service.serving.manager import ServingManager
from rp_service.settings import Settings
from rp_service.system import SystemProbe

__all__ = ["Services"]


@dataclass(frozen=True, slots=True)
class Services:
    """Everything the routes call; `build` makes each one once."""

    settings: Settings
    store: Store
    io: StoreIO
    orchestrator: Orchestrator
    outputs: JobOutputs
    files: FileService
    system: SystemProbe
    serving: ServingManager
    chat: Chat
    fine_tuning: FineTuning
    graders: Graders

    @classmethod
    def build(cls, settings: Settings) -> Services:
        """The services of one daemon; nothing is opened or started until `start`."""
        store = Store(settings.db_path)
        io = StoreIO(store)  # the store's own threads: event writes never queue behind uploads
        hub = EventHub()
        orchestrator = Orchestrator(settings, store, hub, io=io)
        outputs = JobOutputs(settings, store, hub, io=io)
        # Served models count against the budget jobs are planned with (issue 46).
        serving = ServingManager(
            settings, orchestrator, host_budget=lambda: orchestrator.resolver.host_budget_bytes
        )
        return cls(
            settings=settings,
            store=store,
            io=io,
            orchestrator=orchestrator,
            outputs=outputs,
            files=FileService(
                store,
                settings.files_dir,
                max_upload_bytes=settings.max_upload_bytes,
                max_line_bytes=settings.max_line_bytes,
            ),
            system=SystemProbe(
                probe_cuda=settings.gpus != "none",
                host_budget=lambda: orchestrator.resolver.host_budget_bytes,
            ),
            serving=serving,
            chat=Chat(settings, store, serving),
            fine_tuning=FineTuning(settings, store, orchestrator, outputs),
            graders=Graders(settings),
        )

    async def start(self) -> None:
        """Open the store, count the GPUs, start taking jobs off the queue."""
        await asyncio.to_thread(self.store.open)
        devices = await asyncio.to_thread(lambda: self.system.devices)
        capabilities = {d["index"]: d["capability"] for d in devices if "capability" in d}
        await self.orchestrator.start(gpu_count=len(devices), capabilities=capabilities)

    async def close(self) -> None:
        """Stop the served models, then the jobs, then the store (each even if one before
        it failed)."""
        try:
            await self.serving.stop()
        finally:
            try:
                await self.orchestrator.stop()
            finally:
                self.io.close()
                self.store.close()
