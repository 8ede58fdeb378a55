"""The fine-tuning service behind OpenAI's routes: finds the model and files a request
names, submits the translated JobSpec to the one orchestrator, and reads jobs, events and
checkpoints back in OpenAI's shapes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from pathlib import Path

from engine.catalog import FAMILIES
from rp_service.errors import BadRequest, Conflict, InvalidRequest, JobFailure
from rp_service.jobs.files import RETRY_WINDOW_S
from rp_service.jobs.idempotency import body_sha256
from rp_service.jobs.openai_store import OpenAIJobRecord, OpenAIStore
from rp_service.jobs.orchestrator import Orchestrator
from rp_service.jobs.outputs import JobOutputs
from rp_service.jobs.resolve import config_max_positions, under_roots
from rp_service.jobs.store import FileRecord, JobRecord, Store
from rp_service.openai.mapping import (
    openai_checkpoint,
    openai_event,
    openai_job,
    parse_cursor,
    plan_job,
)
from rp_service.openai.schemas import (
    FineTuningJob,
    FineTuningJobCheckpoint,
    FineTuningJobCreate,
    FineTuningJobEvent,
)
from rp_service.schemas import ModelSection
from rp_service.settings import Settings

__all__ = ["FineTuning"]

log = logging.getLogger(__name__)

# Native spec fields named in a resolver error -> the create request's field behind them.
_PARAMS = {
    "data.train": "training_file",
    "data.valid": "validation_file",
    "data.seq_len": "model",
    "model.path": "model",
    "model.preset": "model",
    "tokenizer.path": "model",
    "engine.gpus": "model",
    "engine.matmul_precision": "matmul_precision",
}
_MODELS_NAMED = 20  # model folders listed in an unknown-model error


class FineTuning:
    """OpenAI's fine_tuning.jobs over the native store and orchestrator."""

    def __init__(
        self, settings: Settings, store: Store, orchestrator: Orchestrator, outputs: JobOutputs
    ) -> None:
        self.settings = settings
        self.store = store
        self.orchestrator = orchestrator
        self.outputs = outputs
        self.openai = OpenAIStore(store)

    # ------------------------------------------------------------ create

    async def create(
        self, body: FineTuningJobCreate, *, idempotency_key: str | None, retried: bool
    ) -> tuple[FineTuningJob, bool]:
        """Submit a job; returns it and whether this call created it.

        The OpenAI SDK retries a POST after a lost response or a 5xx without any key, so a
        request marked as a retry (`retried`) with the body of a job created in the last
        RETRY_WINDOW_S returns that job. An `Idempotency-Key` makes it exact (native rules).
        """
        body_sha = body_sha256(body)
        if idempotency_key is None and retried:
            since = int(time.time()) - RETRY_WINDOW_S
            earlier = await asyncio.to_thread(self.openai.find_retried_job, body_sha, since=since)
            if earlier is not None:
                job = await self.orchestrator.get(earlier.job_id)
                log.info("openai: retried create answered with job %s", job.id)
                return openai_job(job, earlier), False
        model, max_positions = await asyncio.to_thread(self._model, body.model)
        train = await asyncio.to_thread(self._file, body.training_file, "training_file")
        if body.validation_file is not None:
            await asyncio.to_thread(self._file, body.validation_file, "validation_file")
        if body.seed is not None:
            seed = body.seed
        elif idempotency_key is not None:  # a retry must submit the same spec as the first try
            seed = int(hashlib.sha256(f"{idempotency_key}:{body_sha}".encode()).hexdigest(), 16)
            seed %= 2**31
        else:
            seed = secrets.randbelow(2**31)
        plan = plan_job(
            body,
            model=model,
            max_positions=max_positions,
            train_examples=train.line_count,
            gpu_count=len(self.orchestrator.gpu_ids),
            seed=seed,
        )
        key = f"openai:{idempotency_key}" if idempotency_key is not None else None
        try:
            job, created = await self.orchestrator.submit(plan.spec, idempotency_key=key)
        except BadRequest:
            raise
        except (InvalidRequest, JobFailure) as exc:  # the resolver's 422, in OpenAI's terms: a 400
            param = _PARAMS.get(exc.param or "", exc.param)
            if param is not None and param.split(".")[0] in ("grader", "grpo"):
                param = f"method.reinforcement.{param}"
            raise BadRequest(exc.message, code=exc.code, param=param) from None
        if created:
            record = OpenAIJobRecord(
                job_id=job.id, body_sha256=body_sha, created_at=job.created_at, fields=plan.fields
            )
            await asyncio.to_thread(self.openai.add_job, record)
        elif idempotency_key is not None:
            # The native check compares the specs, which leave out what only the OpenAI
            # object keeps (metadata, suffix): the key's first body is compared here.
            first = (await asyncio.to_thread(self.openai.get_jobs, [job.id])).get(job.id)
            if first is not None and first.body_sha256 != body_sha:
                raise Conflict(
                    "this Idempotency-Key was already used with a different request body; "
                    "use a new key for a new job",
                    code="idempotency_key_reused",
                    param="Idempotency-Key",
                )
        return await self._public(job), created

    def _model(self, name: str) -> tuple[ModelSection, int | None]:
        """A preset, or a model folder under RP_MODEL_ROOTS; blocking."""
        if name in FAMILIES:
            return ModelSection(preset=name), FAMILIES[name].max_positions  # type: ignore[arg-type]
        relative = Path(name)
        roots = self.settings.model_roots
        # The roots first: nothing outside them is read or even looked at (config.json).
        if relative.is_absolute():
            candidates = [relative]
        elif ".." not in relative.parts:
            candidates = [root.absolute() / relative for root in roots]
        else:
            candidates = []
        for folder in candidates:
            resolved = under_roots(str(folder), roots)
            if resolved is not None and (resolved / "config.json").is_file():
                return ModelSection(path=str(folder)), _max_positions(resolved)
        found = self._model_names()
        listed = ", ".join(found[:_MODELS_NAMED]) or "none"
        raise BadRequest(
            f"model {name!r} does not exist or is not available for fine-tuning here: give a "
            f"preset ({', '.join(FAMILIES)}: random initialisation) or the name of a Hugging "
            f"Face model folder under RP_MODEL_ROOTS (found: {listed})",
            code="model_not_found",
            param="model",
        )

    def _model_names(self) -> list[str]:
        names: list[str] = []
        for root in self.settings.model_roots:
            for config in sorted([*root.glob("*/config.json"), *root.glob("*/*/config.json")]):
                names.append(config.parent.relative_to(root).as_posix())
        return names

    def _file(self, file_id: str, param: str) -> FileRecord:
        record = self.store.get_file(file_id)
        if record is None:
            raise BadRequest(
                f"{param}: no uploaded file with id {file_id!r}; upload it with "
                "files.create(file=..., purpose='fine-tune') and pass the id it returns",
                code="file_not_found",
                param=param,
            )
        return record

    # ------------------------------------------------------------ reads

    async def _public(self, job: JobRecord) -> FineTuningJob:
        extras = await asyncio.to_thread(self.openai.get_jobs, [job.id])
        return openai_job(job, extras.get(job.id))

    async def get(self, job_id: str) -> FineTuningJob:
        return await self._public(await self.orchestrator.get(job_id))

    async def list(
        self, *, after: str | None, limit: int, metadata: dict[str, str] | bool | None = False
    ) -> tuple[list[FineTuningJob], bool]:
        """Jobs of both APIs, newest first; `after` is the last id of the previous page.

        `metadata`: False, no filter; a dict, jobs whose metadata has those pairs; None,
        jobs without metadata.
        """
        if metadata is False:
            jobs, has_more = await self.orchestrator.list(status=None, after=after, limit=limit)
        else:
            jobs, has_more = await asyncio.to_thread(
                self.openai.list_jobs_by_metadata,
                metadata if isinstance(metadata, dict) else None,
                after=after,
                limit=limit,
            )
        extras = await asyncio.to_thread(self.openai.get_jobs, [j.id for j in jobs])
        return [openai_job(j, extras.get(j.id)) for j in jobs], has_more

    async def events(
        self, job_id: str, *, after: str | None, limit: int
    ) -> tuple[list[FineTuningJobEvent], bool]:
        """Newest first, as OpenAI lists them: `after` pages on to older events."""
        await self.orchestrator.get(job_id)
        before = parse_cursor(after, prefix="ftevent", job_id=job_id) if after else None
        events = await asyncio.to_thread(
            self.openai.list_events_desc, job_id, before=before, limit=limit + 1
        )
        return [openai_event(e) for e in events[:limit]], len(events) > limit

    async def checkpoints(
        self, job_id: str, *, after: str | None, limit: int
    ) -> tuple[list[FineTuningJobCheckpoint], bool]:
        """Checkpoints still on disk, newest first; `after` pages on to older ones."""
        records = sorted(await self.outputs.checkpoints(job_id), key=lambda r: -r.step)
        if after:
            step = parse_cursor(after, prefix="ftckpt", job_id=job_id)
            records = [r for r in records if r.step < step]
        return [openai_checkpoint(r) for r in records[:limit]], len(records) > limit

    # ------------------------------------------------------------ lifecycle

    async def cancel(self, job_id: str, *, retried: bool = False) -> FineTuningJob:
        try:
            return await self._public(await self.orchestrator.cancel(job_id))
        except Conflict as exc:
            return await self._after_retry(job_id, exc, retried=retried, done={"cancelled"})

    async def pause(self, job_id: str) -> FineTuningJob:
        return await self._public(await self.orchestrator.pause(job_id))

    async def resume(self, job_id: str, *, retried: bool = False) -> FineTuningJob:
        try:
            return await self._public(await self.orchestrator.resume(job_id))
        except Conflict as exc:
            return await self._after_retry(job_id, exc, retried=retried, done={"queued", "running"})

    async def _after_retry(
        self, job_id: str, conflict: Conflict, *, retried: bool, done: set[str]
    ) -> FineTuningJob:
        """A retry whose first attempt did the work (its response was lost) gets the job,
        not the 409 that the same request would deserve the first time."""
        job = await self.orchestrator.get(job_id)
        if retried and job.status in done:
            return await self._public(job)
        raise conflict


def _max_positions(folder: Path) -> int | None:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the resolver names the unreadable config at submission
    return config_max_positions(config if isinstance(config, dict) else None)
