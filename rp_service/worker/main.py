"""`python -m rp_service.worker JOB_DIR`: run one attempt of a job and report it as events.

Protocol (the orchestrator's side is in orchestrator.py):

- input: ``JOB_DIR/spec.json`` = ``{"job_id", "attempt", "spec", "options", "resolved"}``,
  where ``options`` is the job's `EngineOptions.to_json()`, mapped once by the daemon at
  submission (the worker does not map the spec again);
- stdout: the event pipe, one JSON object a line
  ``{"type", "level", "message", "data"}``; nothing else is written there (file
  descriptor 1 is pointed at stderr, so stray prints and native code land in the log);
- stderr: the log;
- SIGTERM: cancel, exit at once (code 143) without a checkpoint;
- SIGUSR1: pause: finish the step, checkpoint, emit ``paused``, exit 75;
- exit 0 after ``succeeded``, 1 after an error event.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["EXIT_CANCELLED", "EXIT_FAILED", "EXIT_PAUSED", "EventWriter", "main"]

log = logging.getLogger("rp_service.worker")

EXIT_FAILED = 1
EXIT_PAUSED = 75
EXIT_CANCELLED = 128 + signal.SIGTERM

_OOM_ADVICE = (
    "out of memory: raise engine.num_microbatch (smaller micro-batches), set "
    "engine.recompute_grain to 'layer', lower data.seq_len or train.batch_size (fewer tokens "
    "per step), train a LoRA adapter (train.method: lora), or use model.dtype bfloat16"
)
# Messages of CUDA/driver faults: the machine failed, not the job; the daemon retries them.
_DEVICE_FAULTS = (
    "cuda error",
    "cudaerror",
    "cublas_status",
    "cudnn_status",
    "nccl error",
    "ecc error",
    "illegal memory access",
    "unspecified launch failure",
    "uncorrectable",
)


class EventWriter:
    """Writes events as JSON lines to the event pipe, one flushed line each, thread-safe."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._journal: IO[str] | None = None

    def open_journal(self, path: str | None) -> None:
        """Also append every event to `path`, before the pipe: the daemon recovers from it
        what a SIGKILL of the daemon lost in the pipe (rp_service.jobs.journal)."""
        if path:
            try:
                self._journal = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
            except OSError as exc:
                log.warning("no event journal at %s: %s", path, exc)

    def raw(self, line: str) -> None:
        """Pass on a line another worker wrote (a rank's, through rp_service.cluster)."""
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()

    def __call__(
        self, type: str, message: str, data: dict[str, Any] | None = None, level: str = "info"
    ) -> None:
        line = json.dumps(
            {"type": type, "level": level, "message": message, "data": data or {}},
            allow_nan=False,
            default=_json_default,
        )
        with self._lock:
            if self._journal is not None:
                try:
                    self._journal.write(line + "\n")
                except OSError:  # a full disk must not stop the events on the pipe
                    self._journal = None
            self._stream.write(line + "\n")
            self._stream.flush()


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _take_stdout() -> IO[str]:
    """Return a private stream on the real stdout, and point fd 1 and sys.stdout at stderr."""
    sys.stdout.flush()
    events_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(events_fd, "w", encoding="utf-8", buffering=1)


def _install_signals(pause: threading.Event) -> None:
    """Handle SIGTERM and SIGUSR1 on a dedicated thread, whatever the main thread does.

    Both signals are blocked before any other thread exists, so every thread the engine
    and torch start inherits the block and only `sigwait` here receives them: a cancel
    works even while the main thread waits inside native code.
    """
    wanted = {signal.SIGTERM, signal.SIGUSR1}
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)

    def wait_for_signals() -> None:
        while True:
            signum = signal.sigwait(wanted)
            if signum == signal.SIGTERM:
                os.write(2, b"rp_service.worker: SIGTERM, cancelled: exiting now\n")
                os._exit(EXIT_CANCELLED)
            log.info("SIGUSR1: pausing after the current step")
            pause.set()

    threading.Thread(target=wait_for_signals, name="rp-signals", daemon=True).start()


def _fail(emit: EventWriter, code: str, message: str, param: str | None, **details: Any) -> int:
    data = {"code": code, "message": message, "param": param, **details}
    emit("message", message, data, level="error")
    return EXIT_FAILED


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or while handling."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not s for s in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _is_oom(exc: BaseException) -> bool:
    return any(isinstance(e, MemoryError) or "out of memory" in str(e).lower() for e in _chain(exc))


def _is_host_oom(exc: BaseException) -> bool:
    return any(isinstance(e, MemoryError) for e in _chain(exc))


def _no_space(exc: BaseException) -> OSError | None:
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return e
    return None


def _is_device_fault(exc: BaseException) -> bool:
    text = " ".join(str(e).lower() for e in _chain(exc))
    return "out of memory" not in text and any(mark in text for mark in _DEVICE_FAULTS)


def _gpu_figures() -> dict[str, Any]:
    """Per-GPU memory at the failure: what the job held, its peak, and the device's size."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    from engine.device import gpu_memory_cap_bytes

    cap = gpu_memory_cap_bytes()
    gpus = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        gpus.append(
            {
                "device": i,
                "allocated_bytes": torch.cuda.memory_allocated(i),
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(i),
                "reserved_bytes": torch.cuda.memory_reserved(i),
                "free_bytes": free,
                "total_bytes": total,
                "cap_bytes": cap,  # the engine's GPU memory cap (RP_GPU_MEMORY_GIB), or None
            }
        )
    return {"gpus": gpus}


def _host_figures() -> dict[str, Any]:
    from ..jobs.faults import host_memory_limit, tree_rss_bytes

    limit, source = host_memory_limit()
    return {"rss_bytes": tree_rss_bytes(os.getpid()), "limit_bytes": limit, "limit_source": source}


def _fail_for(emit: EventWriter, exc: BaseException, paths: Any) -> int:
    """The error event of an exception in training: named cause, figures, what helps."""
    full = _no_space(exc)
    if full is not None:
        import shutil

        where = Path(full.filename) if full.filename else Path(paths.checkpoint_dir)
        while not where.exists() and where != where.parent:
            where = where.parent
        usage = shutil.disk_usage(where)
        details = {"path": str(where), "free_bytes": usage.free, "total_bytes": usage.total}
        message = (
            f"disk full while writing {full.filename or 'the job directory'} "
            f"({usage.free} bytes free of {usage.total}): free space under RP_DATA_DIR or "
            "lower train.keep_checkpoints; earlier checkpoints are intact"
        )
        return _fail(emit, "disk_full", message, None, details=details)
    if _is_host_oom(exc):
        from ..jobs.faults import HOST_OOM_ADVICE

        message = f"out of host memory ({type(exc).__name__}: {exc}); {HOST_OOM_ADVICE}"
        return _fail(emit, "out_of_host_memory", message, None, details=_host_figures())
    if _is_oom(exc):
        details = _gpu_figures()
        return _fail(
            emit,
            "out_of_memory",
            f"{_OOM_ADVICE} ({exc})",
            "engine.num_microbatch",
            details=details,
        )
    if _is_device_fault(exc):
        message = f"device fault: {type(exc).__name__}: {exc}"
        return _fail(emit, "device_fault", message, None)
    return _fail(emit, "internal_error", f"training failed: {type(exc).__name__}: {exc}", None)


def run(
    job_dir: Path,
    emit: EventWriter,
    pause: threading.Event,
    *,
    join: Callable[[], int] | None = None,
) -> int:
    """Run the job in `job_dir`; return the process exit code.

    `join` (a rank of a multi-node job, rp_service.cluster.rank) joins the job's process
    group and returns this rank; only rank 0 keeps the event journal.
    """
    from pydantic import ValidationError

    from engine.options import EngineOptions, OptionError

    from ..errors import JobFailure
    from ..schemas import JobSpec
    from .training import JobPaths, run_job

    try:
        payload = json.loads((job_dir / "spec.json").read_text())
        spec = JobSpec.model_validate(payload["spec"])
        options = EngineOptions.from_json(payload["options"])
        paths = JobPaths.from_json(payload["resolved"])
    except (OSError, KeyError, TypeError, json.JSONDecodeError, OptionError) as exc:
        return _fail(emit, "invalid_job_dir", f"cannot read {job_dir / 'spec.json'}: {exc}", None)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        return _fail(emit, "invalid_spec", f"{param}: {first['msg']}", param)
    rank = 0
    if join is not None:
        try:
            rank = join()
        except Exception as exc:  # the rendezvous timed out or a peer's address is wrong
            traceback.print_exc()
            return _fail(emit, "node_lost", f"joining the job's ranks failed: {exc}", None)
    if rank == 0:
        emit.open_journal(payload.get("event_journal"))
    log.info("job %s attempt %s in %s", payload.get("job_id"), payload.get("attempt"), job_dir)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the log is a file: no progress bars in it
    try:
        outcome = run_job(spec, options, paths, emit, pause)
    except JobFailure as exc:
        return _fail(emit, exc.code, exc.message, exc.param, **exc.details)
    except Exception as exc:
        from engine.errors import HostMemoryError

        if isinstance(exc, HostMemoryError):  # the engine's own check, before allocating
            return _fail(emit, "host_memory_exceeded", str(exc), "engine")
        traceback.print_exc()
        return _fail_for(emit, exc, paths)
    if outcome.status == "paused":
        emit("status", f"paused at step {outcome.step}", {"status": "paused", "step": outcome.step})
        return EXIT_PAUSED
    done = {
        "status": "succeeded",
        "step": outcome.step,
        "output_model_path": outcome.output_model_path,
    }
    if outcome.merged_model_path is not None:
        done["merged_model_path"] = outcome.merged_model_path
    emit("status", "succeeded", done)
    return 0


def _die_with_daemon() -> None:
    """On Linux, have the kernel SIGKILL this worker when the daemon that started it dies.

    A restarted daemon kills the workers it finds recorded in the store; this covers the
    moment between starting a worker and recording its pid.
    """
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def main(argv: list[str] | None = None, *, join: Callable[[], int] | None = None) -> int:
    """Entry point: `python -m rp_service.worker JOB_DIR` (`join`: see `run`)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m rp_service.worker JOB_DIR", file=sys.stderr)
        return 2
    _die_with_daemon()
    pause = threading.Event()
    _install_signals(pause)
    emit = EventWriter(_take_stdout())
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    code = run(Path(args[0]), emit, pause, join=join)
    # Engine threads may still be parked on queues; the events are flushed, so leave now.
    sys.stderr.flush()
    os._exit(code)
