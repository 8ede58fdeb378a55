"""The daemon's side of serving: one process per base model, started on the first request
for it, stopped after RP_SERVE_IDLE_S without one.

GPUs: a serving process takes one GPU out of the orchestrator's pool (`lend_gpu`), the
same set that jobs are scheduled from, and gives it back when it stops. While no GPU is
free, an idle serving process of another base is stopped to make room; failing that the
request gets `ServingBusy` (503, Retry-After) naming the jobs that hold the GPUs. A daemon
without GPUs serves on the CPU (at most `_CPU_PROCESSES` bases loaded at once; past it an
idle one is stopped, else 503: never a load beyond the cap).

Host memory: before a process starts, what it will hold (rp_service/serving/footprint.py)
plus what the running workers and the other serving processes hold must fit the budget
jobs are planned with (RP_HOST_MEMORY_BUDGET); idle served models are stopped to make
room, else 503 (422 when the model alone is over the budget). Its folder's weights are
checked as at submission (422 `invalid_model`).

Requests to one process are written to its stdin and answered by id on its stdout
(protocol in rp_service/serving/process.py); the process generates one at a time. At most
RP_SERVE_MAX_QUEUED wait behind the one it generates (503 past it), and each has
RP_SERVE_REQUEST_TIMEOUT_S from when it is written (504 past it, the generation cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from rp_service.child_env import child_env
from rp_service.errors import InvalidRequest, ServiceError
from rp_service.jobs.faults import tree_rss_bytes
from rp_service.jobs.hostmem import budget_bytes
from rp_service.jobs.store import JobRecord
from rp_service.serving.footprint import base_footprint
from rp_service.serving.models import BaseModel, ServedModel
from rp_service.settings import Settings

__all__ = ["GenerationError", "ServingBusy", "ServingManager"]

log = logging.getLogger(__name__)

_CPU_PROCESSES = 2
_LINE_LIMIT_BYTES = 1 << 20
_BUSY_RETRY_S = 5  # Retry-After while every process that could be stopped is generating
_GIB = 1 << 30


class ServingBusy(ServiceError):
    """No room now (GPUs, the CPU cap, host memory, a process's queue): 503, Retry-After."""

    status_code = 503
    error_type = "server_error"
    default_code = "gpus_busy"

    def __init__(self, message: str, *, retry_after_s: int, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class GenerationError(ServiceError):
    """The serving process refused or failed a request (status from the process)."""

    error_type = "invalid_request_error"

    def __init__(self, message: str, *, status: int, code: str) -> None:
        super().__init__(message, code=code, param="messages" if status == 400 else None)
        self.status_code = status
        if status >= 500:
            self.error_type = "server_error"


class GpuPool(Protocol):
    """What the manager needs of the orchestrator."""

    gpu_ids: list[int]
    gpus_wanted: Callable[[], None] | None

    def lend_gpu(self) -> int | None: ...

    def return_gpu(self, gpu: int) -> None: ...

    def gpu_jobs(self) -> dict[int, str]: ...

    job_deleted: Callable[[JobRecord], None] | None

    def worker_host_bytes(self) -> dict[str, int]: ...


@dataclass(eq=False)
class ServingProcess:
    """One running serving process and the requests waiting on its answers."""

    base: BaseModel
    gpu: int | None
    proc: asyncio.subprocess.Process | None = None
    log_path: Path | None = None
    ready: asyncio.Future[dict[str, Any]] | None = None
    replies: dict[str, asyncio.Queue[dict[str, Any]]] = field(default_factory=dict)
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)
    stopping: bool = False
    loaded: bool = False  # the model is in memory (a loading process is never evicted)
    reader: asyncio.Task[None] | None = None
    footprint_bytes: int = 0  # host bytes it will hold once loaded (serving/footprint.py)

    @property
    def counted(self) -> bool:
        """Holds (or is about to hold) a slot and memory: starting, loading or running."""
        running = self.proc is None or self.proc.returncode is None
        return running and not self.stopping

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def device(self) -> str:
        return "cpu" if self.gpu is None else f"cuda:{self.gpu}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and not self.stopping

    def idle_s(self) -> float:
        return 0.0 if self.in_flight else time.monotonic() - self.last_used

    async def write(self, message: dict[str, Any]) -> None:
        if self.proc is None or self.proc.stdin is None or self.proc.stdin.is_closing():
            return
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        with contextlib.suppress(ConnectionError):
            await self.proc.stdin.drain()

    async def read_loop(self) -> None:
        """stdout -> the waiting request's queue, or the ready future; at EOF fail them all."""
        assert self.proc is not None and self.proc.stdout is not None
        failure = "the serving process exited"
        while True:
            try:
                line = await self.proc.stdout.readline()
            except ValueError:
                continue
            if not line:
                break
            try:
                message = json.loads(line)
            except ValueError:
                continue
            kind = message.get("type")
            if kind in ("ready", "failed") and self.ready is not None and not self.ready.done():
                self.ready.set_result(message)
            elif (queue := self.replies.get(message.get("id", ""))) is not None:
                queue.put_nowait(message)
        code = await self.proc.wait()
        if code not in (0, None) and not self.stopping:
            failure += f" with status {code}; see {self.log_path}"
        if self.ready is not None and not self.ready.done():
            self.ready.set_result({"type": "failed", "message": failure})
        for queue in self.replies.values():
            queue.put_nowait(
                {"type": "error", "status": 500, "code": "serving_died", "message": failure}
            )

    def host_bytes(self) -> int:
        """What it holds now, or will once loaded (blocking: reads /proc)."""
        rss = tree_rss_bytes(self.proc.pid) if self.proc is not None else 0
        return max(rss, self.footprint_bytes)

    async def request(
        self, payload: dict[str, Any], *, timeout_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        """`queued` once the request is written, then the process's replies to it up to
        its `done` or `error`; an `error` 504 once `timeout_s` have passed (waiting behind
        others included)."""
        rid = "r-" + secrets.token_hex(8)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.replies[rid] = queue
        self.in_flight += 1
        finished = False
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            await self.write({"op": "generate", "id": rid, **payload})
            yield {"type": "queued"}  # written: from here a client that leaves cancels it
            while True:
                try:
                    # Not wait_for: on 3.11 it swallows a cancel that meets a reply arriving
                    # (the abandoned answer would then be read to its end).
                    async with asyncio.timeout_at(deadline):
                        message = await queue.get()
                except TimeoutError:
                    yield {
                        "type": "error",
                        "status": 504,
                        "code": "generation_timeout",
                        "message": f"the answer took longer than {timeout_s:g} s "
                        "(RP_SERVE_REQUEST_TIMEOUT_S, waiting behind other requests included); "
                        "ask for fewer tokens (max_completion_tokens) or try again",
                    }
                    return  # not finished: the process is told to cancel it
                finished = message.get("type") in ("done", "error")
                yield message
                if finished:
                    return
        finally:
            self.replies.pop(rid, None)
            self.in_flight -= 1
            self.last_used = time.monotonic()
            if not finished:  # the client went away: free the process for the next one
                await self.write({"op": "cancel", "id": rid})


class ServingManager:
    """Starts, finds and stops serving processes; the service behind the chat route."""

    def __init__(
        self, settings: Settings, pool: GpuPool, *, host_budget: Callable[[], int] | None = None
    ) -> None:
        """`host_budget`: the jobs' host-memory budget (the submission check's); default
        RP_HOST_MEMORY_BUDGET, else the available memory less the margin, at first use."""
        self.settings = settings
        self.pool = pool
        self.host_budget = host_budget or self._default_budget
        self.processes: dict[str, ServingProcess] = {}
        self._starting: dict[str, asyncio.Lock] = {}
        self._idle_task: asyncio.Task[None] | None = None
        self._yielding: set[asyncio.Task[None]] = set()
        # Held while a new process is given its device and memory and registered: two
        # requests for two bases never both take the last slot.
        self._capacity = asyncio.Lock()
        self._budget: int | None = None  # the default budget, once computed
        pool.gpus_wanted = self.yield_gpus
        pool.job_deleted = self.job_deleted

    def process_of(self, base: BaseModel) -> ServingProcess | None:
        """The live process serving `base`, if any."""
        process = self.processes.get(base.key)
        return process if process is not None and process.alive else None

    async def generate(
        self, served: ServedModel, payload: dict[str, Any]
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Replies of the process for `served.base` to one request (starting it if needed).

        Raises:
            ServingBusy: no GPU, CPU slot or host memory can be had now, or the process's
                queue is full.
            InvalidRequest: the model is over the host-memory budget alone, or its
                folder's weights do not cover it.
            GenerationError: the process could not start.
        """
        process = await self._process(served.base)
        if process.in_flight > self.settings.serve_max_queued:
            raise ServingBusy(
                f"the model's serving process has {process.in_flight - 1} requests waiting "
                f"behind the one it generates (RP_SERVE_MAX_QUEUED={self.settings.serve_max_queued})"
                "; try again shortly",
                retry_after_s=_BUSY_RETRY_S,
                code="serving_queue_full",
            )
        body = {**payload, "tokenizer": served.tokenizer, "adapter": served.adapter}
        timeout_s = self.settings.serve_request_timeout_s
        async for message in process.request(body, timeout_s=timeout_s):
            yield message

    async def _process(self, base: BaseModel) -> ServingProcess:
        lock = self._starting.setdefault(base.key, asyncio.Lock())
        async with lock:
            process = self.process_of(base)
            if process is None:
                dead = self.processes.get(base.key)
                if dead is not None and not dead.stopping:
                    await self._stop(dead)  # it died: its GPU goes back before a new start
                process = await self._start(base)
            process.last_used = time.monotonic()
            return process

    async def _device(self) -> int | None:
        """A GPU for a new process (None: the CPU), stopping an idle process if needed."""
        if not self.pool.gpu_ids:
            counted = [p for p in self.processes.values() if p.counted]
            if len(counted) >= _CPU_PROCESSES and not await self._evict(counted, "CPU"):
                busy = ", ".join(p.base.path or str(p.base.preset) for p in counted)
                raise ServingBusy(
                    f"at most {_CPU_PROCESSES} models are served on the CPU at once, and "
                    f"every one is generating or loading ({busy}); try again shortly",
                    retry_after_s=_BUSY_RETRY_S,
                    code="serving_busy",
                )
            return None
        gpu = self.pool.lend_gpu()
        if gpu is not None:
            return gpu
        mine = [p for p in self.processes.values() if p.alive and p.gpu is not None]
        if await self._evict(mine, "GPU"):
            gpu = self.pool.lend_gpu()
            if gpu is not None:
                return gpu
        jobs = self.pool.gpu_jobs()
        held = [f"GPU {g}: job {jobs[g]}" for g in sorted(jobs)]
        held += [f"GPU {p.gpu}: serving {p.base.path or p.base.preset}" for p in mine]
        raise ServingBusy(
            f"every GPU is in use ({'; '.join(held) or 'none free'}); try again when a job "
            "ends, or pause one",
            retry_after_s=max(1, min(60, int(self.settings.serve_idle_s))),
        )

    def yield_gpus(self) -> None:
        """A queued job waits for GPUs: stop every served model that is not generating
        (training comes first; the next chat request loads its model again)."""
        for process in list(self.processes.values()):
            if (
                process.gpu is not None
                and process.alive
                and process.loaded
                and not process.in_flight
            ):
                log.info("serving: stopping %s: a queued job wants its GPU", process.pid)
                task = asyncio.get_running_loop().create_task(self._stop(process))
                self._yielding.add(task)
                task.add_done_callback(self._yielding.discard)

    async def _evict(self, candidates: list[ServingProcess], what: str) -> bool:
        """Stop the longest-idle process among `candidates` that is not generating."""
        idle = [p for p in candidates if p.loaded and p.in_flight == 0]
        if not idle:
            return False
        victim = max(idle, key=lambda p: p.idle_s())
        log.info("serving: stopping %s to free its %s", victim.base.path or victim.base.key, what)
        await self._stop(victim)
        return True

    def _default_budget(self) -> int:
        if self._budget is None:
            self._budget = budget_bytes(self.settings.host_memory_budget)
        return self._budget

    async def _admit(self, process: ServingProcess) -> None:
        """Count what `process` will hold; stop idle served models until it fits the
        budget beside the running workers and the other processes.

        Raises:
            InvalidRequest: it alone is over the budget, or its weights are not whole.
            ServingBusy: it fits once something now running ends.
        """
        cuda = process.gpu is not None
        need = await asyncio.to_thread(base_footprint, process.base, cuda=cuda)
        process.footprint_bytes = need
        budget = self.host_budget()
        name = process.base.path or process.base.preset
        if need > budget:
            raise InvalidRequest(
                f"model: serving {name} needs about {need / _GIB:.1f} GiB of host memory, over "
                f"this daemon's budget of {budget / _GIB:.1f} GiB (RP_HOST_MEMORY_BUDGET)",
                code="host_memory_exceeded",
                param="model",
                details={"need_bytes": need, "budget_bytes": budget},
            )
        while True:
            held = await asyncio.to_thread(self._held_bytes, process)
            if need + sum(held.values()) <= budget:
                return
            others = [p for p in self.processes.values() if p is not process and p.counted]
            if not await self._evict(others, "host memory"):
                break
        holders = "; ".join(f"{k}: {v / _GIB:.1f} GiB" for k, v in held.items() if v)
        raise ServingBusy(
            f"serving {name} needs about {need / _GIB:.1f} GiB of host memory; with what runs "
            f"now ({holders}) that is over the budget of {budget / _GIB:.1f} GiB "
            "(RP_HOST_MEMORY_BUDGET); try again when a job or an answer ends",
            retry_after_s=max(1, min(60, int(self.settings.serve_idle_s))),
            code="host_memory_busy",
        )

    def _held_bytes(self, process: ServingProcess) -> dict[str, int]:
        """What else holds host memory now: each running worker, each serving process."""
        held = {f"job {j}": b for j, b in self.pool.worker_host_bytes().items()}
        for other in list(self.processes.values()):
            if other is not process and other.counted:
                held[f"serving {other.base.path or other.base.preset}"] = other.host_bytes()
        return held

    async def _start(self, base: BaseModel) -> ServingProcess:
        async with self._capacity:
            gpu = await self._device()
            process = ServingProcess(base=base, gpu=gpu)
            self.processes[base.key] = process  # counted from now on
            try:
                await self._admit(process)
            except BaseException:
                await self._stop(process)
                raise
        try:
            await self._spawn(process)
        except BaseException:
            await self._stop(process)
            raise
        self._ensure_idle_watch()
        return process

    async def _spawn(self, process: ServingProcess) -> None:
        env = child_env()  # no RP_TOKEN: a model folder's code runs in it, as in a worker
        env["CUDA_VISIBLE_DEVICES"] = "" if process.gpu is None else str(process.gpu)
        env["RP_LOG_LEVEL"] = self.settings.log_level
        directory = self.settings.data_dir / "serving"
        directory.mkdir(parents=True, exist_ok=True)
        process.log_path = directory / f"{process.base.key}.log"
        log_file: IO[bytes] = process.log_path.open("ab")
        try:
            process.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                self.settings.serving_module,
                process.base.to_json(),
                "--device",
                *(["cpu"] if process.gpu is None else ["cuda:0", "--fold-adapters"]),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file,
                env=env,
                start_new_session=True,  # its own process group: a stop reaches its children
                limit=_LINE_LIMIT_BYTES,
            )
        finally:
            log_file.close()
        loop = asyncio.get_running_loop()
        process.ready = loop.create_future()
        process.reader = asyncio.create_task(process.read_loop(), name="rp-serving-reader")
        log.info(
            "serving: process %d loading %s on %s",
            process.pid,
            process.base.path or process.base.preset,
            process.device,
        )
        try:
            ready = await asyncio.wait_for(process.ready, self.settings.serve_load_timeout_s)
        except TimeoutError:
            raise GenerationError(
                f"the model did not load in {self.settings.serve_load_timeout_s:.0f} s "
                f"(RP_SERVE_LOAD_TIMEOUT_S); see {process.log_path}",
                status=503,
                code="model_load_timeout",
            ) from None
        if ready.get("type") != "ready":
            raise GenerationError(
                f"{ready.get('message', 'the serving process failed')} (log: {process.log_path})",
                status=500,
                code="model_load_failed",
            )
        process.loaded = True
        log.info("serving: process %d ready in %.1f s", process.pid, ready.get("load_s", 0.0))

    async def _stop(self, process: ServingProcess, *, grace_s: float = 5.0) -> None:
        """End the process (stdin closed, then SIGTERM, then SIGKILL) and give its GPU back."""
        process.stopping = True  # no new request reaches it from now on
        proc = process.proc
        if proc is not None and proc.returncode is None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), grace_s)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()
        if process.reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(process.reader, grace_s)
        if process.gpu is not None:
            self.pool.return_gpu(process.gpu)
            process.gpu = None
        if self.processes.get(process.base.key) is process:  # not a newer one for the base
            del self.processes[process.base.key]
        log.info("serving: process %s stopped", process.pid)

    def _ensure_idle_watch(self) -> None:
        if self._idle_task is None or self._idle_task.done():
            self._idle_task = asyncio.create_task(self._idle_watch(), name="rp-serving-idle")

    async def _idle_watch(self) -> None:
        """Stop each process idle for RP_SERVE_IDLE_S, and forget processes that died."""
        idle_s = self.settings.serve_idle_s
        tick_s = min(max(idle_s / 4, 0.05), 5.0)
        while self.processes:
            await asyncio.sleep(tick_s)
            for process in list(self.processes.values()):
                if process.stopping:
                    continue
                dead = process.proc is not None and process.proc.returncode is not None
                if dead or process.idle_s() >= idle_s:
                    if not dead:
                        log.info("serving: %s idle for %.0f s", process.pid, process.idle_s())
                    await self._stop(process)

    def job_deleted(self, job: JobRecord) -> None:
        """A job was deleted: its model leaves memory now, not at the idle timeout (a
        full fine-tune's process stops; a LoRA adapter is unloaded from its base's)."""
        folder = job.output_model_path
        if not folder:
            return
        for process in list(self.processes.values()):
            if process.base.path == folder:
                task = asyncio.get_running_loop().create_task(self._stop(process))
            elif process.alive:
                task = asyncio.get_running_loop().create_task(
                    process.write({"op": "unload", "adapter": folder})
                )
            else:
                continue
            self._yielding.add(task)
            task.add_done_callback(self._yielding.discard)

    async def stop(self) -> None:
        """Stop every process (the daemon is stopping)."""
        if self._idle_task is not None:
            self._idle_task.cancel()
        await asyncio.gather(*(self._stop(p) for p in list(self.processes.values())))
