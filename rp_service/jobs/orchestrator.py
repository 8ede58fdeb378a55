"""The job lifecycle: queue -> GPUs -> one worker process per job -> events -> final state.

Over ~600 lines: the lifecycle's transitions, GPU accounting (lent to serving too) and
worker supervision share one queue and one lock-free asyncio state; the pieces that stand
apart (the pipe, the journal, faults, retention, resolve) live beside it.

Runs on the daemon's event loop. The store is the queue: queued jobs are started in order
of priority, then FIFO, while their GPUs (or a CPU slot) are free. Each worker's stdout is
its event pipe: every line is stored (on the store's writer thread), then handed to the
job's followers from memory. Cancel is SIGTERM to the
worker's process group (SIGKILL after a grace period), pause is SIGUSR1 (the worker
checkpoints and exits 75). At start-up `reconcile` puts the store back in a state that no
worker of a previous daemon can contradict.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import signal
import sqlite3
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import IO, Any

from engine.options import EngineOptions
from rp_service.cluster.nodes import ClusterView
from rp_service.errors import Conflict, DiskFull, InvalidRequest, NotFound, TooManyRequests
from rp_service.jobs.events import EventHub
from rp_service.jobs.faults import MemoryWatch, classify_death, tree_rss_bytes
from rp_service.jobs.gpu_mode import GpuMode
from rp_service.jobs.idempotency import body_sha256
from rp_service.jobs.journal import recover
from rp_service.jobs.pipe import WorkerHandle, prepare_job_dir, proc_start_time
from rp_service.jobs.resolve import SpecResolver
from rp_service.jobs.retention import (
    check_free_space,
    delete_job,
    prune_checkpoints,
    sweep_trash,
)
from rp_service.jobs.store import EventRecord, JobRecord, Store
from rp_service.jobs.store_io import StoreIO
from rp_service.schemas import TERMINAL_STATUSES, JobSpec
from rp_service.settings import Settings

__all__ = ["Orchestrator"]

log = logging.getLogger(__name__)

_LINE_LIMIT_BYTES = 1 << 20  # longest event line read from a worker
# A worker that cannot start for one of these reasons (out of file descriptors, processes
# or memory for a moment) goes back to the queue and is tried again after a pause.
_TRANSIENT_START_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM})
_START_RETRY_S = 2.0
# A job that met a full disk is paused with this error code, and re-queued once the disk
# has RP_MIN_FREE_BYTES free again (looked at every _DISK_POLL_S).
WAITING_FOR_DISK = "waiting_for_disk"
_DISK_POLL_S = 5.0
# What runs a job with engine.nodes > 1: the Ray driver, read exactly as a worker is.
_DRIVER_MODULE = "rp_service.cluster.driver"
# What runs a job whose gpu_mode is ranks: one data-parallel rank per GPU of this box.
_LOCAL_RANKS_MODULE = "rp_service.cluster.local"


class Orchestrator:
    """Submits, schedules, runs and controls jobs; the service behind the jobs routes."""

    def __init__(
        self, settings: Settings, store: Store, hub: EventHub, *, io: StoreIO | None = None
    ) -> None:
        self.settings = settings
        self.store = store
        self.hub = hub
        self.io = io if io is not None else StoreIO(store)
        self.resolver = SpecResolver(settings, store)
        # RP_RAY_ADDRESS: jobs with engine.nodes > 1 run on that cluster (rp_service.cluster)
        self.cluster: ClusterView | None = None
        if settings.ray_address is not None:
            self.cluster = self.resolver.cluster = ClusterView(settings)
        self.gpu_ids: list[int] = []
        self.gpu_capabilities: list[str | None] = []  # of gpu_ids, in order
        self.ready = False
        self.events_appended = 0
        self._workers: dict[str, WorkerHandle] = {}
        self._busy_gpus: set[int] = set()
        self._cpu_jobs = 0
        self._wake = asyncio.Event()
        self._stopping = False
        self._loop_task: asyncio.Task[None] | None = None
        self._disk_task: asyncio.Task[None] | None = None
        self.disk_poll_s = _DISK_POLL_S
        self._watchers: set[asyncio.Task[None]] = set()
        # Set by chat serving (rp_service/serving/manager.py): called when a queued job
        # waits for GPUs, so that idle served models return the ones they were lent.
        self.gpus_wanted: Callable[[], None] | None = None
        # Told of a deleted job (its served model unloads: rp_service/serving/manager.py).
        self.job_deleted: Callable[[JobRecord], None] | None = None

    # ------------------------------------------------------------ start and stop

    async def start(self, *, gpu_count: int, capabilities: Mapping[int, str] | None = None) -> None:
        """Reconcile the store with reality, then start taking jobs off the queue.

        Args:
            capabilities: CUDA compute capability by device index ('9.0'), where probed.
        """
        self.gpu_ids = self.settings.gpu_ids(gpu_count)
        known = capabilities or {}
        self.gpu_capabilities = [known.get(g) for g in self.gpu_ids]
        await asyncio.to_thread(self.reconcile)
        self._loop_task = asyncio.create_task(self._schedule_loop(), name="rp-scheduler")
        self._disk_task = asyncio.create_task(self._disk_watch_loop(), name="rp-disk-watch")
        self.ready = True
        self._wake.set()

    async def stop(self) -> None:
        """Checkpoint and stop every worker (SIGUSR1, as a pause); their jobs go back to
        the queue and resume from that checkpoint at the next start. A worker that has not
        exited after RP_SHUTDOWN_GRACE_S is killed."""
        self.ready = False
        self._stopping = True
        if self._disk_task is not None:
            self._disk_task.cancel()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        grace_s = self.settings.shutdown_grace_s
        for worker in list(self._workers.values()):
            worker.send(signal.SIGUSR1)
            worker.escalation = asyncio.create_task(self._escalate(worker, grace_s=grace_s))
        if self._watchers:
            await asyncio.wait(self._watchers, timeout=grace_s + 15.0)
        self.hub.close()

    def reconcile(self) -> None:
        """Blocking: kill workers of a previous daemon, settle in-between states and
        remove what interrupted deletes left."""
        sweep_trash(self.settings, self.store)
        for job in self.store.jobs_with_worker():
            pid, started = job.worker_pid, job.worker_started
            if pid is not None and started is not None and proc_start_time(pid) == started:
                log.warning("reconcile: killing stale worker %d of job %s", pid, job.id)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                deadline = time.monotonic() + 5.0
                while proc_start_time(pid) == started and time.monotonic() < deadline:
                    time.sleep(0.05)
            self.store.update_job(job.id, worker_pid=None, worker_started=None)
        for job in self.store.jobs_with_status(["running", "pausing"]):
            recover(self.store, job, self.settings.jobs_dir / job.id)
        for job in self.store.jobs_with_status(["running"]):
            if job.restarts + 1 > self.settings.max_attempts:
                self.store.transition(
                    job.id,
                    ["running"],
                    "failed",
                    level="error",
                    message=f"job failed: interrupted by {job.restarts + 1} daemon restarts",
                    gpus=[],
                    error={
                        "code": "too_many_restarts",
                        "message": f"the daemon restarted during this job {job.restarts + 1} "
                        f"times (RP_MAX_ATTEMPTS={self.settings.max_attempts})",
                        "param": None,
                    },
                )
            else:
                self.store.transition(
                    job.id,
                    ["running"],
                    "queued",
                    level="warning",
                    message="daemon restarted: job re-queued to resume from its last checkpoint",
                    gpus=[],
                    restarts=job.restarts + 1,
                )
        for job in self.store.jobs_with_status(["pausing"]):
            self.store.transition(job.id, ["pausing"], "paused", gpus=[])
        for job in self.store.jobs_with_status(["cancelling"]):
            self.store.transition(job.id, ["cancelling"], "cancelled", gpus=[])
        for job in self.store.jobs_with_status(["validating"]):
            self.store.transition(job.id, ["validating"], "queued")

    # ------------------------------------------------------------ service: reads

    async def get(self, job_id: str) -> JobRecord:
        job = await asyncio.to_thread(self.store.get_job, job_id)
        if job is None:
            raise NotFound(f"no job with id {job_id!r}", code="job_not_found", param="job_id")
        return job

    async def list(
        self, *, status: str | None, after: str | None, limit: int
    ) -> tuple[list[JobRecord], bool]:
        return await asyncio.to_thread(
            self.store.list_jobs, status=status, after=after, limit=limit
        )

    def queue_length(self) -> int:
        return self.store.count_by_status().get("queued", 0)

    # ------------------------------------------------------------ service: writes

    async def submit(
        self, spec: JobSpec, *, idempotency_key: str | None = None
    ) -> tuple[JobRecord, bool]:
        """Check and queue a job; returns it and whether it was created by this call."""
        await asyncio.to_thread(check_free_space, self.settings)
        if await asyncio.to_thread(self.queue_length) >= self.settings.max_queued:
            raise TooManyRequests(
                f"the queue holds RP_MAX_QUEUED={self.settings.max_queued} jobs; submit again "
                "when some have started",
                code="queue_full",
            )
        options, gpu_mode = await asyncio.to_thread(self._check, spec)
        record = JobRecord(
            id="job-" + secrets.token_hex(12),
            status="queued",
            created_at=int(time.time()),
            spec=spec.model_dump(mode="json"),
            name=spec.name,
            priority=spec.priority,
            # known before the worker starts when given in steps (epochs need the data)
            progress={"total_steps": spec.train.steps} if spec.train.steps else {},
            options=options.to_json(),  # the one mapping of the spec, for every launch
            gpu_mode=gpu_mode.to_json(),  # and the one choice of mode: a resume keeps it
        )
        job, created, event = await self.io.write(
            self.store.create_job,
            record,
            idempotency_key=idempotency_key,
            body_sha256=body_sha256(spec),
            max_queued=self.settings.max_queued,  # the check above is only a cheap early one
        )
        if created:
            log.info("job %s queued (priority %d)", job.id, job.priority)
            self._published(job.id, event, status=job.status)
            self._wake.set()
        return job, created

    def _check(self, spec: JobSpec) -> tuple[EngineOptions, GpuMode]:
        """Blocking: the resolver's checks, the options and the GPU mode of `spec`."""
        gpu_count = len(self.gpu_ids)
        options = self.resolver.check(
            spec, gpu_count=gpu_count, gpu_capabilities=self.gpu_capabilities
        )
        mode = self.resolver.gpu_mode(spec, options, gpu_count=gpu_count)
        return self.resolver.overlap_calls(spec, options, mode, gpu_count=gpu_count)

    async def cancel(self, job_id: str) -> JobRecord:
        for _ in range(10):
            job = await self.get(job_id)
            if job.status in TERMINAL_STATUSES:
                raise Conflict(
                    f"job {job_id} is already {job.status}; only a job that has not finished "
                    "can be cancelled",
                    code="job_not_cancellable",
                    param="job_id",
                )
            if job.status == "cancelling":
                return job
            worker = self._workers.get(job_id)
            if job.status in ("running", "pausing") and worker is not None:
                done = await self._transition(job_id, [job.status], "cancelling")
                if done is None:
                    continue
                worker.cancel_requested = True
                worker.send(signal.SIGTERM)
                if worker.escalation is None:
                    worker.escalation = asyncio.create_task(
                        self._escalate(worker, grace_s=self.settings.cancel_grace_s)
                    )
                return done
            done = await self._transition(job_id, [job.status], "cancelled", gpus=[])
            if done is not None:
                return done
        raise Conflict(f"job {job_id} keeps changing state; try again", code="job_busy")

    async def pause(self, job_id: str) -> JobRecord:
        for _ in range(10):
            job = await self.get(job_id)
            if job.status in ("pausing", "paused"):
                return job
            if job.status not in ("queued", "running"):
                raise Conflict(
                    f"job {job_id} is {job.status}; only a queued or running job can be paused",
                    code="job_not_pausable",
                    param="job_id",
                )
            worker = self._workers.get(job_id)
            if job.status == "running" and worker is not None:
                done = await self._transition(job_id, ["running"], "pausing")
                if done is None:
                    continue
                worker.pause_requested = True
                worker.send(signal.SIGUSR1)
                return done
            done = await self._transition(job_id, [job.status], "paused", gpus=[])
            if done is not None:
                return done
        raise Conflict(f"job {job_id} keeps changing state; try again", code="job_busy")

    async def resume(self, job_id: str) -> JobRecord:
        job = await self.get(job_id)
        if job.status != "paused":
            raise Conflict(
                f"job {job_id} is {job.status}; only a paused job can be resumed",
                code="job_not_resumable",
                param="job_id",
            )
        waiting = (job.error or {}).get("code") == WAITING_FOR_DISK
        if waiting:  # it would meet the full disk again at once
            await asyncio.to_thread(check_free_space, self.settings, what="the resume")
        done = await self._transition(
            job_id,
            ["paused"],
            "queued",
            message="job resumed: queued to continue from its last checkpoint",
            max_queued=self.settings.max_queued,
            **({"error": None} if waiting else {}),
        )
        if done is None:
            return await self.resume(job_id)
        self._wake.set()
        return done

    async def delete(self, job_id: str) -> JobRecord:
        """Delete a finished job: its row marked deleted, its directory removed."""
        job = await asyncio.to_thread(delete_job, self.settings, self.store, job_id)
        if job is None:
            raise NotFound(f"no job with id {job_id!r}", code="job_not_found", param="job_id")
        self.hub.notify(job_id)  # its followers re-read the store and end
        if self.job_deleted is not None:
            self.job_deleted(job)
        return job

    async def _retain(self, job_id: str) -> None:
        """RP_KEEP_FINISHED_CHECKPOINTS, applied once a job has ended."""
        try:
            await asyncio.to_thread(prune_checkpoints, self.settings, self.store, job_id)
        except (OSError, sqlite3.Error) as exc:
            log.warning("job %s: pruning its checkpoints failed: %s", job_id, exc)

    # ------------------------------------------------------------ store + fan-out

    # Every event write goes through the store's writer thread, so a job's events are
    # committed, and then published, in id order.

    def _published(
        self, job_id: str, event: EventRecord | None, *, status: str | None = None
    ) -> None:
        if event is not None:
            self.events_appended += 1
            self.hub.publish(job_id, event, status=status)

    async def _transition(
        self, job_id: str, from_statuses: list[str], to: str, **kwargs: Any
    ) -> JobRecord | None:
        result = await self.io.write(self.store.transition, job_id, from_statuses, to, **kwargs)
        if result is None:
            return None
        job, event = result
        log.info("job %s: %s", job_id, to)
        self._published(job_id, event, status=job.status)
        if to in TERMINAL_STATUSES:
            await self._retain(job_id)
        return job

    async def _event(self, job_id: str, **kwargs: Any) -> None:
        event = await self.io.write(self.store.append_event, job_id, **kwargs)
        self._published(job_id, event)

    # ------------------------------------------------------------ scheduling

    async def _schedule_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._start_queued()
            except Exception:
                log.exception("scheduler: starting queued jobs failed")
                await asyncio.sleep(1.0)
                self._wake.set()

    async def _start_queued(self) -> None:
        queued = await asyncio.to_thread(self.store.jobs_with_status, ["queued"])
        for job in queued:
            if job.id in self._workers:
                continue
            wanted = int(job.spec.get("engine", {}).get("gpus", 0))
            if int(job.spec.get("engine", {}).get("nodes", 1)) > 1:
                gpus = []  # the cluster's, reserved by the job's driver (placement group)
            elif self.gpu_ids and wanted > 0:
                free = [g for g in self.gpu_ids if g not in self._busy_gpus]
                if len(free) < wanted:
                    if self.gpus_wanted is not None:
                        self.gpus_wanted()  # idle served models give their GPUs back
                    return  # strict FIFO within a priority: nobody overtakes the head
                gpus = free[:wanted]
            else:
                if self._cpu_jobs >= self.settings.max_cpu_jobs:
                    return
                gpus = []
            await self._launch(job, gpus)

    def _claim(self, worker: WorkerHandle) -> None:
        self._workers[worker.job_id] = worker
        if worker.on_cluster:
            pass  # holds nothing of this box: Ray accounts for its nodes
        elif worker.gpus:
            self._busy_gpus.update(worker.gpus)
        else:
            self._cpu_jobs += 1

    def _release(self, worker: WorkerHandle) -> None:
        self._workers.pop(worker.job_id, None)
        if worker.on_cluster:
            pass
        elif worker.gpus:
            self._busy_gpus.difference_update(worker.gpus)
        else:
            self._cpu_jobs -= 1
        self._wake.set()

    # GPUs lent to chat serving (rp_service/serving/manager.py): out of the jobs' pool
    # until returned, so a job waits for a served model to go idle as for another job.

    def lend_gpu(self) -> int | None:
        """A GPU no job holds, taken out of the pool; None while every GPU is held."""
        free = [g for g in self.gpu_ids if g not in self._busy_gpus]
        if not free:
            return None
        self._busy_gpus.add(free[0])
        return free[0]

    def return_gpu(self, gpu: int) -> None:
        self._busy_gpus.discard(gpu)
        self._wake.set()

    def gpu_jobs(self) -> dict[int, str]:
        """GPU id -> the job whose worker holds it."""
        return {g: w.job_id for w in self._workers.values() for g in w.gpus}

    def worker_host_bytes(self) -> dict[str, int]:
        """Job id -> resident bytes of its worker's process tree now (blocking: /proc)."""
        workers = list(self._workers.values())
        return {w.job_id: tree_rss_bytes(w.proc.pid) for w in workers if w.proc is not None}

    def cluster_info(self) -> dict[str, Any] | None:
        """Blocking: the Ray cluster's nodes and the jobs holding them; None on one box."""
        if self.cluster is None:
            return None
        try:
            return {"address": self.cluster.address, "nodes": self.cluster.nodes()}
        except Exception as exc:  # an unreachable cluster must not fail GET /v1/system
            log.warning("reading the Ray cluster failed: %s", exc)
            return {"address": self.cluster.address, "nodes": [], "error": str(exc)}

    def gpu_share(self) -> list[dict[str, Any]]:
        """Each GPU of the daemon: the job whose worker holds it and the busy fraction that
        job reported for it in its latest metrics event (None before its first, or for a GPU
        lent to chat serving); then the virtual devices of jobs running on the CPU."""
        holders = {g: w for w in self._workers.values() for g in w.gpus}
        rows = []
        for gpu in self.gpu_ids:
            worker = holders.get(gpu)
            row: dict[str, Any] = {"gpu": gpu, "device": f"cuda:{gpu}", "job_id": None}
            reported: dict[str, Any] = {}
            if worker is not None:
                row["job_id"] = worker.job_id
                # The worker sees its GPUs as cuda:0.. in the order it was given them.
                name = f"cuda:{worker.gpus.index(gpu)}"
                reported = next((d for d in worker.gpu_share if d["device"] == name), {})
            rows.append(_share_row(row, reported, worker))
        for worker in self._workers.values():
            if not worker.gpus:
                for reported in worker.gpu_share:
                    row = {"gpu": None, "device": reported["device"], "job_id": worker.job_id}
                    rows.append(_share_row(row, reported, worker))
        return rows

    async def _launch(self, job: JobRecord, gpus: list[int]) -> None:
        nodes = int(job.spec.get("engine", {}).get("nodes", 1))
        worker = WorkerHandle(job_id=job.id, gpus=gpus, on_cluster=nodes > 1)
        self._claim(worker)
        job_dir = self.settings.jobs_dir / job.id
        try:
            spec = JobSpec.model_validate(job.spec)
            resolved = await asyncio.to_thread(self.resolver.resolve, spec, job_dir)
            options = job.options or self.resolver.legacy_options(spec)
        except InvalidRequest as exc:
            self._release(worker)
            await self._transition(
                job.id,
                ["queued"],
                "failed",
                level="error",
                message=f"job failed: {exc.message}",
                error={"code": exc.code, "message": exc.message, "param": exc.param},
            )
            return
        attempt = job.attempt + 1
        started = await self._transition(
            job.id,
            ["queued"],
            "running",
            message=f"job running (attempt {attempt})",
            event_data={"attempt": attempt, "gpus": gpus},
            attempt=attempt,
            gpus=gpus,
            started_at=job.started_at or int(time.time()),
        )
        if started is None:  # cancelled or paused while we looked
            self._release(worker)
            return
        as_ranks = (job.gpu_mode or {}).get("mode") == "ranks"
        if spec.engine.gpus > 0 and not gpus and not worker.on_cluster:
            devices = "cpu:1 a rank" if as_ranks else f"cpu:{self.settings.cpu_devices}"
            await self._event(
                job.id,
                type_="message",
                level="warning",
                message=f"this daemon has no GPUs: running on CPU devices ({devices}) instead",
                data={"devices": devices},
            )
        worker.attempt = attempt
        worker.replay_until = int((job.progress or {}).get("step") or 0)
        worker.memory = await asyncio.to_thread(MemoryWatch.begin)
        log_file: IO[bytes] | None = None
        try:
            env, log_file = await asyncio.to_thread(
                partial(
                    prepare_job_dir,
                    self.settings,
                    job_id=job.id,
                    job_dir=job_dir,
                    attempt=attempt,
                    spec=spec,
                    options=options,
                    resolved=resolved,
                    gpus=gpus,
                )
            )
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                _DRIVER_MODULE
                if worker.on_cluster
                else _LOCAL_RANKS_MODULE
                if as_ranks
                else self.settings.worker_module,
                str(job_dir),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file,
                env=env,
                start_new_session=True,  # its own process group: signals reach its children
                limit=_LINE_LIMIT_BYTES,
            )
        except OSError as exc:
            if log_file is not None:
                log_file.close()
            self._release(worker)
            if exc.errno in _TRANSIENT_START_ERRNOS:
                await self._requeue_unstarted(job, exc)
                return
            code = "disk_full" if exc.errno == errno.ENOSPC else "worker_failed"
            await self._finish_failed(
                job.id, f"could not start the worker: {exc}", code=code, gpus=[]
            )
            return
        worker.proc = proc
        pid_started = await asyncio.to_thread(proc_start_time, proc.pid)
        await asyncio.to_thread(
            self.store.update_job, job.id, worker_pid=proc.pid, worker_started=pid_started
        )
        log.info("job %s: worker %d started on %s", job.id, proc.pid, gpus or "cpu")
        if worker.cancel_requested:
            worker.send(signal.SIGTERM)
        elif worker.pause_requested:
            worker.send(signal.SIGUSR1)
        task = asyncio.create_task(self._watch(worker, log_file), name=f"rp-watch-{job.id}")
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _requeue_unstarted(self, job: JobRecord, exc: OSError) -> None:
        """Back to the queue, attempt unchanged, and a wake-up after a pause: the resource
        that was short (files, processes, memory) is often free again a moment later."""
        await self._transition(
            job.id,
            ["running"],
            "queued",
            level="warning",
            message=f"could not start the worker ({exc.strerror or exc}): job re-queued, "
            f"tried again in {_START_RETRY_S:g} s",
            event_data={"reason": errno.errorcode.get(exc.errno or 0, "unknown")},
            attempt=job.attempt,
            gpus=[],
        )
        asyncio.get_running_loop().call_later(_START_RETRY_S, self._wake.set)

    # ------------------------------------------------------------ control

    async def _escalate(self, worker: WorkerHandle, *, grace_s: float) -> None:
        await asyncio.sleep(grace_s)
        if worker.proc is not None and worker.proc.returncode is None:
            log.warning(
                "job %s: worker still running %.0f s after the signal; SIGKILL",
                worker.job_id,
                grace_s,
            )
            worker.send(signal.SIGKILL)

    # ------------------------------------------------------------ the event pipe

    async def _watch(self, worker: WorkerHandle, log_file: IO[bytes]) -> None:
        proc = worker.proc
        if proc is None or proc.stdout is None:
            return
        sampler = asyncio.create_task(self._sample_memory(worker))
        try:
            while True:
                try:
                    line = await proc.stdout.readline()
                except ValueError:  # a line over the limit: skipped, the rest still counts
                    continue
                if not line:
                    break
                await self._on_line(worker, line)
            returncode = await proc.wait()
        except Exception:
            log.exception("job %s: reading the worker failed", worker.job_id)
            worker.send(signal.SIGKILL)
            returncode = await proc.wait()
        finally:
            log_file.close()
            sampler.cancel()
        if worker.escalation is not None:
            worker.escalation.cancel()
        try:
            await self._settle_durably(worker, returncode)
        finally:
            self._release(worker)

    async def _settle_durably(
        self, worker: WorkerHandle, returncode: int, *, delays_s: tuple[float, ...] = (1, 5, 30)
    ) -> None:
        """`_settle`, tried again while the store cannot be written (a full disk): the job
        keeps its worker's resources until its state is recorded. Gives up after the last
        delay; the next start reconciles the job then."""
        for delay in (*delays_s, None):
            try:
                await self._settle(worker, returncode)
                return
            except sqlite3.Error as exc:
                if delay is None:
                    log.error("job %s: cannot record the worker's exit: %s", worker.job_id, exc)
                    return
                log.warning(
                    "job %s: cannot record the worker's exit (%s); again in %.0f s",
                    worker.job_id,
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)

    async def _sample_memory(self, worker: WorkerHandle) -> None:
        """Note the worker's resident memory now and then, to name an OOM kill later."""
        proc = worker.proc
        while proc is not None and proc.returncode is None:
            await asyncio.to_thread(worker.memory.sample, proc.pid)
            await asyncio.sleep(self.settings.memory_sample_s)

    async def _on_line(self, worker: WorkerHandle, line: bytes) -> None:
        event = worker.read_line(line)
        if event is None:
            return
        if event["type_"] == "metrics" and not worker.replay_noted:
            worker.replay_noted = True
            step = event["data"].get("step")
            if isinstance(step, int) and step <= worker.replay_until:
                last = worker.replay_until
                steps = f"step {step}" if step == last else f"steps {step}-{last}"
                await self._event(
                    worker.job_id,
                    type_="message",
                    level="info",
                    message=f"{steps} replayed after resume from step {step - 1}: "
                    f"the metrics of attempt {worker.attempt} replace the earlier ones",
                    data={
                        "replayed_steps": [step, last],
                        "resumed_from": step - 1,
                        "attempt": worker.attempt,
                    },
                )
        await self._event(worker.job_id, **event)

    async def _settle(self, worker: WorkerHandle, returncode: int) -> None:
        """Move the job to the state the worker's exit means."""
        job_id = worker.job_id
        log.info("job %s: worker exited with %d", job_id, returncode)
        clear: dict[str, Any] = {"worker_pid": None, "worker_started": None, "gpus": []}
        if self._stopping and not worker.cancel_requested:
            # A graceful stop is not the job's fault: back in the queue, restarts unchanged.
            await self._transition(
                job_id,
                ["running"],
                "queued",
                level="warning",
                message="daemon stopping: job re-queued to resume from its last checkpoint",
                **clear,
            )
            await self._transition(job_id, ["pausing"], "paused", **clear)
            return
        outcome, _ = worker.outcome(returncode)
        if outcome == "cancelled":
            await self._transition(
                job_id, ["cancelling", "running", "pausing"], "cancelled", **clear
            )
        elif outcome == "succeeded":
            await self._transition(
                job_id,
                ["running", "pausing"],
                "succeeded",
                output_model_path=worker.output_model_path,
                **clear,
            )
        elif outcome == "paused":
            await self._transition(job_id, ["pausing", "running"], "paused", **clear)
        else:
            await self._worker_died(worker, returncode, clear)
        # A cancel or pause that came while this exit was being settled: no worker is left
        # to act on it, so it takes effect now (else the job would wait in that state).
        await self._transition(job_id, ["cancelling"], "cancelled", **clear)
        await self._transition(job_id, ["pausing"], "paused", **clear)

    async def _worker_died(
        self, worker: WorkerHandle, returncode: int, clear: dict[str, Any]
    ) -> None:
        """Retry a death that is not the job's own fault from the last checkpoint (up to
        RP_MAX_ATTEMPTS), fail the job with the named cause otherwise."""
        job_id = worker.job_id
        if worker.last_error and worker.last_error.get("code") == "disk_full":
            await self._wait_for_disk(job_id, worker.last_error, clear)
            return
        memory = await asyncio.to_thread(worker.memory.figures)
        death = classify_death(returncode, worker.last_error, memory)
        job = await self.get(job_id)
        limit = self.settings.max_attempts
        if death.retry and job.restarts + 1 <= limit:
            # A pause asked for before the death: the job is paused at its last checkpoint.
            await self._transition(job_id, ["pausing"], "paused", **clear)
            done = await self._transition(
                job_id,
                ["running"],
                "queued",
                level="warning",
                message=f"{death.reason}: job re-queued to resume from its last checkpoint "
                f"(retry {job.restarts + 1} of {limit}, RP_MAX_ATTEMPTS)",
                event_data={"retry": job.restarts + 1, "reason": death.reason, **memory},
                restarts=job.restarts + 1,
                **clear,
            )
            if done is not None:
                log.warning("job %s: %s; retrying", job_id, death.reason)
            return
        error = dict(death.error)
        message = death.reason
        if death.retry:
            message += f" (after {job.restarts} retries, RP_MAX_ATTEMPTS={limit})"
            error["message"] = message
        await self._transition(
            job_id,
            ["running", "pausing"],
            "failed",
            level="error",
            message=f"job failed: {message}",
            error=error,
            event_data={"details": error["details"]} if error.get("details") else None,
            **clear,
        )

    async def _wait_for_disk(
        self, job_id: str, reported: dict[str, Any], clear: dict[str, Any]
    ) -> None:
        """A worker that met a full disk: the job is paused at its last checkpoint (kept:
        a paused job's checkpoints are never pruned) until space returns."""
        message = (
            "disk full: job paused at its last checkpoint until RP_DATA_DIR has "
            f"RP_MIN_FREE_BYTES={self.settings.min_free_bytes} free again; it resumes by "
            "itself then (or with resume)"
        )
        error = {
            "code": WAITING_FOR_DISK,
            "message": f"{message}. The worker said: {reported.get('message')}",
            "param": None,
            "details": reported.get("details"),
        }
        await self._transition(
            job_id,
            ["running", "pausing"],
            "paused",
            level="warning",
            message=message,
            event_data={"reason": WAITING_FOR_DISK},
            error=error,
            **clear,
        )

    async def _disk_watch_loop(self) -> None:
        """Re-queue the jobs paused for the disk once it has the floor free again."""
        while True:
            await asyncio.sleep(self.disk_poll_s)
            try:
                await self._resume_waiting_for_disk()
            except Exception:
                log.exception("disk watch: re-queueing jobs waiting for disk failed")

    async def _resume_waiting_for_disk(self) -> int:
        paused = await asyncio.to_thread(self.store.jobs_with_status, ["paused"])
        waiting = [j for j in paused if (j.error or {}).get("code") == WAITING_FOR_DISK]
        resumed = 0
        for job in waiting:
            # Room for one more checkpoint as big as its last above the floor: a disk that
            # filled below it (ENOSPC) would otherwise run the job into it again and again.
            checkpoints = await asyncio.to_thread(self.store.list_checkpoints, job.id)
            need = checkpoints[-1].size_bytes if checkpoints else 0
            try:
                await asyncio.to_thread(check_free_space, self.settings, what="a resume", need=need)
            except DiskFull:
                continue
            try:
                done = await self._transition(
                    job.id,
                    ["paused"],
                    "queued",
                    message="disk space is back: job queued to continue from its last checkpoint",
                    max_queued=self.settings.max_queued,
                    error=None,
                )
            except TooManyRequests:
                break  # the queue is full: tried again at the next look
            resumed += done is not None
        if resumed:
            self._wake.set()
        return resumed

    async def _finish_failed(
        self, job_id: str, message: str, *, code: str | None = None, **fields: Any
    ) -> None:
        worker = self._workers.get(job_id)
        reported = worker.last_error if worker and worker.last_error else {}
        # The worker's own code (invalid_data, out_of_memory, ...) says more than ours.
        code = code or reported.get("code") or "worker_failed"
        await self._transition(
            job_id,
            ["running", "pausing", "queued"],
            "failed",
            level="error",
            message=f"job failed: {message}",
            error={"code": code, "message": message, "param": reported.get("param")},
            **fields,
        )


def _share_row(
    row: dict[str, Any], reported: dict[str, Any], worker: WorkerHandle | None
) -> dict[str, Any]:
    """A `gpu_share` row of GET /v1/system: `row` with what the worker reported for it."""
    return {
        **row,
        "busy_fraction": reported.get("busy_fraction"),
        "jobs": reported.get("jobs"),
        "step": worker.gpu_share_step if reported and worker is not None else None,
    }
