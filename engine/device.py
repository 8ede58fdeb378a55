"""Devices from RP_DEVICES, each with its own streams and controller thread.

`RP_DEVICES` is read once, when the first model is built:
- `cuda`: every visible GPU (the default when CUDA is present);
- `cuda:0,1`: those GPUs;
- `cpu:N`: N virtual CPU devices (the default `cpu:1` without CUDA). Each has its own
  controller thread and its own copies of uploaded tensors, so round-robin, transfers and
  schedule run as on GPUs, with plain copies for transfers and no streams.

On CUDA a device has four streams: `param_upstream` (layer uploads), `upstream`
(activation uploads), `compute_stream` and `downstream` (downloads), ordered by events so
copies overlap compute.

Each device counts its busy time (the layers' compute: the blocks engine.timer times, on
the compute stream of a GPU, under the shared compute lock of a virtual CPU device) and its
finished jobs; `device_busy` reads the totals, `BusyReader` the share since its last read.

A GPU memory cap (`RoundPipe(max_gpu_memory=...)`, default `RP_GPU_MEMORY_GIB`) makes each
device look as large as the cap: the planning reads `get_min_gpu_memory` and
`device_memory_bytes`, which count it, and on CUDA `set_gpu_memory_cap` limits torch's
caching allocator to it (`torch.cuda.set_per_process_memory_fraction`), so an allocation
over it raises torch.OutOfMemoryError as on a card of that size (docs/ENGINE.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from .errors import DeviceError
from .threads import AnnotatedSemaphore, RoundPipeThread, working

__all__ = [
    "BusyReader",
    "DeviceBusy",
    "DeviceManager",
    "Job",
    "current_device",
    "device_busy",
    "device_list",
    "device_memory_bytes",
    "gc_collect",
    "get_devices",
    "get_min_gpu_memory",
    "get_next_device",
    "get_num_devices",
    "gpu_memory_cap_bytes",
    "gpu_memory_gib_setting",
    "parse_rp_devices",
    "reset_devices",
    "set_gpu_memory_cap",
]

log = logging.getLogger(__name__)

device_list: list[DeviceManager] = []
cur_device = 0
_init_lock = threading.Lock()
# The GPU memory cap in bytes (set_gpu_memory_cap); None: each device's own memory.
_gpu_memory_cap_bytes: int | None = None

# Virtual CPU devices share one CPU RNG and one pool of cores: a stage's compute holds this
# lock so the RNG states saved for recompute are not consumed by another device in between.
cpu_compute_lock = threading.RLock()

# The device whose controller thread is running (`current_device`).
_controller = threading.local()

# How many jobs a device may have issued but not finished: the running one and one
# prefetched, so GPU memory is bounded by two layer groups whatever the model's size.
MAX_INFLIGHT_JOBS = 2


def parse_rp_devices(value: str | None) -> list[torch.device]:
    """Return the devices named by an RP_DEVICES value (see the module docstring)."""
    spec = (value or "").strip().lower()
    if not spec:
        spec = "cuda" if torch.cuda.is_available() else "cpu:1"
    if spec == "cpu":
        spec = "cpu:1"
    if spec.startswith("cpu:"):
        try:
            count = int(spec[4:])
        except ValueError:
            count = 0
        if count < 1:
            raise DeviceError(
                f"RP_DEVICES={value!r}: 'cpu:N' needs N >= 1 virtual devices, e.g. 'cpu:3'",
                device=spec,
            )
        return [torch.device("cpu")] * count
    if spec == "cuda" or spec.startswith("cuda:"):
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if available == 0:
            raise DeviceError(
                f"RP_DEVICES={value!r} asks for CUDA but no GPU is visible; "
                "use 'cpu:N' or make a GPU visible (CUDA_VISIBLE_DEVICES)",
                device=spec,
            )
        if spec == "cuda":
            return [torch.device("cuda", i) for i in range(available)]
        ids: list[int] = []
        for part in spec[5:].split(","):
            try:
                ids.append(int(part))
            except ValueError as exc:
                raise DeviceError(
                    f"RP_DEVICES={value!r}: expected GPU ids like 'cuda:0,1'", device=spec
                ) from exc
        for i in ids:
            if not 0 <= i < available:
                raise DeviceError(
                    f"RP_DEVICES={value!r} names cuda:{i}, but only {available} GPU(s) are "
                    f"visible (ids 0..{available - 1})",
                    device=f"cuda:{i}",
                )
        if len(set(ids)) != len(ids):
            raise DeviceError(f"RP_DEVICES={value!r} names a GPU twice", device=spec)
        return [torch.device("cuda", i) for i in ids]
    raise DeviceError(
        f"RP_DEVICES={value!r} is not understood; use 'cuda', 'cuda:0,1' or 'cpu:N'",
        device=spec,
    )


def _done_job(*_: Any) -> None:
    """Stands in for a job's function once it has run."""


class DeviceBusy(NamedTuple):
    """A device's busy time and finished jobs (totals, or over a `BusyReader` window)."""

    device: str  # DeviceManager.name: "cuda:0", "cpu-virtual:1"
    busy_s: float
    jobs: int


class Job:
    """One unit of work queued on a device; `done` is set when it returned or failed."""

    def __init__(self, fn: Callable[..., None], args: tuple[Any, ...], name: str) -> None:
        self.fn = fn
        self.args = args
        self.name = name
        self.done = threading.Event()
        self.error: BaseException | None = None


class DeviceManager:
    """Streams, a job queue and the controller thread of one (real or virtual) device."""

    def __init__(self, id: int, device: torch.device) -> None:
        self.id = id
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.name = f"cuda:{device.index}" if self.is_cuda else f"cpu-virtual:{id}"
        if self.is_cuda:
            self.param_upstream: torch.cuda.Stream | None = torch.cuda.Stream(device)
            self.upstream: torch.cuda.Stream | None = torch.cuda.Stream(device)
            self.compute_stream: torch.cuda.Stream | None = torch.cuda.Stream(device)
            self.downstream: torch.cuda.Stream | None = torch.cuda.Stream(device)
        else:
            self.param_upstream = self.upstream = self.compute_stream = self.downstream = None
        self.shutdown = False
        self.is_idle = AnnotatedSemaphore(f"{self.name}.is_idle", 1)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._inflight: deque[torch.cuda.Event] = deque()
        self._busy_lock = threading.Lock()
        self._busy_s = 0.0
        self._jobs_done = 0
        self.controller_thread = RoundPipeThread(self.controller, name=f"rp-device-{id}")
        self.controller_thread.start()

    # ---- jobs -------------------------------------------------------------------------
    def submit(self, fn: Callable[..., None], *args: Any, name: str = "job") -> Job:
        """Queue `fn(self, *args)` on this device's controller thread."""
        job = Job(fn, args, name)
        self._jobs.put(job)
        return job

    def controller(self) -> None:
        """Run queued jobs in order until shut down."""
        if self.is_cuda:
            torch.cuda.set_device(self.device)
        _controller.device = self
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                with working():
                    job.fn(self, *job.args)
            except BaseException as exc:  # handed to the main thread through the job
                job.error = exc
            finally:
                # The job's closure refers to its call's state, which lists the job: drop
                # it so the state (pinned activations) is freed when the call returns,
                # not whenever the cycle collector runs.
                job.fn, job.args = _done_job, ()
                with self._busy_lock:
                    self._jobs_done += 1
                job.done.set()

    # ---- busy time --------------------------------------------------------------------
    def add_busy(self, seconds: float) -> None:
        """Count `seconds` of layer compute on this device (engine.timer, when a call's
        timings are read: on a GPU once the call's work is done)."""
        with self._busy_lock:
            self._busy_s += seconds

    def busy(self) -> DeviceBusy:
        """This device's busy seconds and finished jobs since it was created."""
        with self._busy_lock:
            return DeviceBusy(self.name, self._busy_s, self._jobs_done)

    def shutdown_controller(self) -> None:
        """Stop the controller thread after its queued jobs (a second call does nothing)."""
        if self.shutdown:
            return
        self.shutdown = True
        self._jobs.put(None)
        self.controller_thread.join(timeout=10)
        if self.controller_thread.is_alive():
            log.warning("%s: controller thread still busy 10 s after shutdown", self.name)

    def throttle(self) -> None:
        """Block until fewer than MAX_INFLIGHT_JOBS earlier jobs are unfinished on the GPU."""
        while len(self._inflight) >= MAX_INFLIGHT_JOBS:
            self._inflight.popleft().synchronize()

    def job_issued(self) -> None:
        """Record the end of the current job's GPU work (for `throttle`)."""
        if self.is_cuda:
            ev = torch.cuda.Event()
            ev.record(self.compute_stream)
            self._inflight.append(ev)

    # ---- streams and events -----------------------------------------------------------
    def on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[Any]:
        """Context that makes `stream` current (a no-op on virtual CPU devices)."""
        if stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(stream)

    def record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """Record an event on `stream`; None (always complete) on CPU."""
        if stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    @staticmethod
    def wait_event(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
        """Make `stream` wait for `event` on the GPU, without blocking the host."""
        if stream is not None and event is not None:
            stream.wait_event(event)

    @staticmethod
    def wait_stream(waiter: torch.cuda.Stream | None, wait_for: torch.cuda.Stream | None) -> None:
        """Make `waiter` wait for everything queued so far on `wait_for`."""
        if waiter is not None and wait_for is not None:
            waiter.wait_stream(wait_for)

    def mark_used(self, t: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        """Tell the caching allocator that `t` is used on `stream` too."""
        if stream is not None and t.is_cuda:
            t.record_stream(stream)

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Context for running layer code on this device."""
        if self.is_cuda:
            with torch.cuda.stream(self.compute_stream):
                yield
        else:
            with cpu_compute_lock:
                yield

    # ---- RNG --------------------------------------------------------------------------
    def get_rng_state(self) -> torch.Tensor:
        """The RNG state layer code on this device draws from."""
        if self.is_cuda:
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    @contextlib.contextmanager
    def rng_restored(self, state: torch.Tensor | None) -> Iterator[None]:
        """Run with the RNG set to `state`, then put the previous state back."""
        if state is None:
            yield
            return
        before = self.get_rng_state()
        self._set_rng_state(state)
        try:
            yield
        finally:
            self._set_rng_state(before)

    def _set_rng_state(self, state: torch.Tensor) -> None:
        if self.is_cuda:
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)


def current_device() -> DeviceManager | None:
    """The device whose controller thread runs the caller; None on any other thread."""
    return getattr(_controller, "device", None)


def device_busy() -> list[DeviceBusy]:
    """Each device's busy seconds and finished jobs since it was created, in device order;
    [] before the devices exist (this does not create them)."""
    return [dev.busy() for dev in list(device_list)]


class BusyReader:
    """Each device's busy seconds and finished jobs since the previous `read` (the first
    read: since the reader was made). A device created meanwhile counts from zero."""

    def __init__(self) -> None:
        self._last = {b.device: b for b in device_busy()}

    def read(self) -> list[DeviceBusy]:
        """The window's figures, in device order; the next window starts now."""
        now = device_busy()
        out = []
        for b in now:
            prev = self._last.get(b.device)
            if prev is None or b.jobs < prev.jobs or b.busy_s < prev.busy_s:
                prev = DeviceBusy(b.device, 0.0, 0)  # new, or the devices were reset
            out.append(DeviceBusy(b.device, b.busy_s - prev.busy_s, b.jobs - prev.jobs))
        self._last = {b.device: b for b in now}
        return out


def _local_rank_share(devices: list[torch.device]) -> list[torch.device]:
    """Under torchrun with several processes on a box (LOCAL_WORLD_SIZE > 1) and RP_DEVICES
    unset: this process's equal share of the GPUs, so `--nproc-per-node G` just works."""
    try:
        local_rank = int(os.environ["LOCAL_RANK"])
        local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return devices
    if local_world <= 1 or not devices or devices[0].type != "cuda":
        return devices
    if len(devices) < local_world:
        raise DeviceError(
            f"{local_world} processes on this box share {len(devices)} visible GPU(s); start "
            f"at most one process per GPU (torchrun --nproc-per-node {len(devices)}) or set "
            "RP_DEVICES for each process",
            device="cuda",
        )
    per = len(devices) // local_world
    return devices[local_rank * per : (local_rank + 1) * per]


def get_devices() -> list[DeviceManager]:
    """The device managers, created from RP_DEVICES on first use."""
    if not device_list:
        with _init_lock:
            if not device_list:
                devices = parse_rp_devices(os.environ.get("RP_DEVICES"))
                if not os.environ.get("RP_DEVICES"):
                    devices = _local_rank_share(devices)
                device_list.extend(DeviceManager(i, d) for i, d in enumerate(devices))
                log.info("RoundPipe devices: %s", ", ".join(d.name for d in device_list))
    return device_list


def reset_devices() -> None:
    """Stop the device threads and forget the devices (and the GPU memory cap); RP_DEVICES
    is read again on next use.

    For tests and notebooks that change RP_DEVICES; models built before keep working.
    """
    global cur_device, _gpu_memory_cap_bytes
    if _gpu_memory_cap_bytes is not None and device_list:
        set_gpu_memory_cap(None)
    _gpu_memory_cap_bytes = None
    with _init_lock:
        for dev in device_list:
            dev.shutdown_controller()
        device_list.clear()
        cur_device = 0


def get_next_device() -> DeviceManager:
    """Round-robin over the devices, process-wide (the seeds' function). A RoundPipe keeps
    its own round robin (`RoundPipe._next_device`), so its jobs' devices do not depend on
    the models that ran before it."""
    global cur_device
    devices = get_devices()
    dev = devices[cur_device % len(devices)]
    cur_device = (cur_device + 1) % len(devices)
    return dev


def get_num_devices() -> int:
    """Number of managed devices."""
    return len(get_devices())


def get_min_gpu_memory() -> float:
    """Smallest free memory over the devices in GB (host memory for virtual CPU devices).

    Under a GPU memory cap a device has the cap, or less where other processes leave less:
    this process's cached memory counts as free then, since the allocator frees its cache
    before it refuses an allocation under the cap (without a cap the figure stays the
    driver's free memory, the cache not counted, as the seed's).
    """
    cap = _gpu_memory_cap_bytes
    free: list[float] = []
    for dev in get_devices():
        if dev.is_cuda:
            free_bytes, _ = torch.cuda.mem_get_info(dev.device)
            if cap is not None:
                free_bytes = min(free_bytes + torch.cuda.memory_reserved(dev.device), cap)
        else:
            free_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            if cap is not None:
                free_bytes = min(free_bytes, cap)
        free.append(max(0, free_bytes) / 1e9)
    return min(free)


def gpu_memory_cap_bytes() -> int | None:
    """The GPU memory cap in force (bytes), or None."""
    return _gpu_memory_cap_bytes


def device_memory_bytes(device: torch.device) -> int:
    """A device's memory as the engine may use it: its total (a CUDA device's), or the
    GPU memory cap where that is smaller. Virtual CPU devices: the cap, or the host's RAM."""
    if device.type == "cuda":
        total = int(torch.cuda.get_device_properties(device).total_memory)
    else:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cap = _gpu_memory_cap_bytes
    return total if cap is None else min(total, cap)


def set_gpu_memory_cap(cap_bytes: int | None) -> None:
    """Cap every engine device at `cap_bytes` (None: lift the cap).

    Process-wide, like the allocator limit it sets: on each CUDA device torch's caching
    allocator may reserve at most `cap_bytes` (set_per_process_memory_fraction of the
    device's total; a cap over the total leaves the device as it is), so an allocation
    over it raises torch.OutOfMemoryError after the allocator has freed its cache. The
    CUDA context and libraries that allocate outside torch (NCCL) are not counted.
    """
    global _gpu_memory_cap_bytes
    if cap_bytes is not None and cap_bytes <= 0:
        raise ValueError(f"a GPU memory cap must be > 0 bytes, got {cap_bytes}")
    for dev in get_devices():
        if not dev.is_cuda:
            continue
        total = int(torch.cuda.get_device_properties(dev.device).total_memory)
        fraction = 1.0 if cap_bytes is None else min(1.0, cap_bytes / total)
        torch.cuda.set_per_process_memory_fraction(fraction, dev.device)
    if cap_bytes != _gpu_memory_cap_bytes:
        log.info(
            "GPU memory cap: %s",
            "none" if cap_bytes is None else f"{cap_bytes / (1 << 30):.2f} GiB per device",
        )
    _gpu_memory_cap_bytes = cap_bytes


def gc_collect() -> None:
    """Return cached GPU memory of all devices to the driver."""
    for dev in get_devices():
        if dev.is_cuda:
            with torch.cuda.device(dev.device):
                torch.cuda.empty_cache()


def host_memory_budget_setting() -> str | None:
    """RP_HOST_MEMORY_BUDGET as set (bytes, or with a unit: '96GiB', '100G'), or None.

    engine.planning.memory_plan parses it; read here because only this module reads the environment.
    """
    value = os.environ.get("RP_HOST_MEMORY_BUDGET", "").strip()
    return value or None


# The engine's other settings, read here for the same reason; each is read when asked
# for, so a change of the environment (a test's monkeypatch) takes effect.


def _setting(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def adam_threads_setting() -> str | None:
    """RP_ADAM_THREADS as set (threads of the C Adam), or None; engine.optim parses it."""
    return _setting("RP_ADAM_THREADS")


def adam_isa_setting() -> str | None:
    """RP_ADAM_ISA as set (the C Adam's instruction set path), or None."""
    return _setting("RP_ADAM_ISA")


def adam_cache_dir_setting() -> str | None:
    """RP_ADAM_CACHE_DIR, else $XDG_CACHE_HOME/roundpipe/adam; None: neither is set."""
    explicit = _setting("RP_ADAM_CACHE_DIR")
    if explicit is not None:
        return explicit
    base = _setting("XDG_CACHE_HOME")
    return None if base is None else os.path.join(base, "roundpipe", "adam")


def c_compiler_setting() -> str | None:
    """CC as set (the C compiler that builds the C Adam), or None."""
    return _setting("CC")


def gpu_memory_gib_setting() -> str | None:
    """RP_GPU_MEMORY_GIB as set (the default GPU memory cap, in GiB), or None;
    engine.planning.gpu_memory parses it."""
    return _setting("RP_GPU_MEMORY_GIB")


def profiler_setting() -> str | None:
    """RP_PROFILER as set ('nvtx' or 'torch'), or None."""
    return _setting("RP_PROFILER")
