"""The daemon's side of serving: one process per base model, started on the first request
for it, stopped after RP_SERVE_IDLE_S without one.

GPUs: a serving process takes one GPU out of the orchestrator's pool (`lend_gpu`), the
same set that jobs are scheduled from, and gives it back when it stops. While no GPU is
free, an idle serving process of another base is stopped to make room; failing that the
request gets `ServingBusy` (503, Retry-After) naming the jobs that hold the GPUs. A daemon
without GPUs serves on the CPU (at most `_CPU_PROCESSES` bases loaded at once).

Requests to one process are written to its stdin and answered by id on its stdout
(protocol in rp_service/serving/process.py); the process generates one at a time.
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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from rp_service.errors import ServiceError
from rp_service.serving.models import BaseModel, ServedModel
from rp_service.settings import Settings

__all__ = ["GenerationError", "ServingBusy", "ServingManager"]

log = logging.getLogger(__name__)

_CPU_PROCESSES = 2
_LINE_LIMIT_BYTES = 1 << 20
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent.parent)


class ServingBusy(ServiceError):
    """Every GPU is held (by jobs or other models in use): 503 with Retry-After."""

    status_code = 503
    error_type = "server_error"
    default_code = "gpus_busy"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
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

    async def request(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The process's replies to one request, up to its `done` or `error`."""
        rid = "r-" + secrets.token_hex(8)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.replies[rid] = queue
        self.in_flight += 1
        finished = False
        try:
            await self.write({"op": "generate", "id": rid, **payload})
            while True:
                message = await queue.get()
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

    def __init__(self, settings: Settings, pool: GpuPool) -> None:
        self.settings = settings
        self.pool = pool
        self.processes: dict[str, ServingProcess] = {}
        self._starting: dict[str, asyncio.Lock] = {}
        self._idle_task: asyncio.Task[None] | None = None
        self._yielding: set[asyncio.Task[None]] = set()
        pool.gpus_wanted = self.yield_gpus

    def process_of(self, base: BaseModel) -> ServingProcess | None:
        """The live process serving `base`, if any."""
        process = self.processes.get(base.key)
        return process if process is not None and process.alive else None

    async def generate(
        self, served: ServedModel, payload: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        """Replies of the process for `served.base` to one request (starting it if needed).

        Raises:
            ServingBusy: no GPU can be had now.
            GenerationError: the process could not start.
        """
        process = await self._process(served.base)
        body = {**payload, "tokenizer": served.tokenizer, "adapter": served.adapter}
        async for message in process.request(body):
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
            loaded = [p for p in self.processes.values() if p.alive]
            if len(loaded) >= _CPU_PROCESSES:
                await self._evict(loaded, "CPU")
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

    async def _start(self, base: BaseModel) -> ServingProcess:
        gpu = await self._device()
        process = ServingProcess(base=base, gpu=gpu)
        self.processes[base.key] = process
        try:
            await self._spawn(process)
        except BaseException:
            await self._stop(process)
            raise
        self._ensure_idle_watch()
        return process

    async def _spawn(self, process: ServingProcess) -> None:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p
        )
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

    async def stop(self) -> None:
        """Stop every process (the daemon is stopping)."""
        if self._idle_task is not None:
            self._idle_task.cancel()
        await asyncio.gather(*(self._stop(p) for p in list(self.processes.values())))
