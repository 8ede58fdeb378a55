"""Per-layer timings that feed the automatic plan, and profiler annotations."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Literal

import torch

from .accel import graphs
from .device import DeviceManager, current_device, profiler_setting

__all__ = ["PROFILER_TYPE", "IterTimer", "ModelTimer", "annotate"]

PROFILER_TYPE: str | None = profiler_setting()
"""'nvtx' to emit NVTX ranges (nsys), 'torch' for torch.profiler record_function ranges."""


def annotate(name: str, color: str | None = None) -> contextlib.AbstractContextManager[object]:
    """A named range in the profiler's timeline, or a null context when not profiling."""
    if PROFILER_TYPE == "nvtx" and torch.cuda.is_available():
        return torch.cuda.nvtx.range(name)
    if PROFILER_TYPE == "torch":
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


log = logging.getLogger(__name__)

Action = Literal["fwd", "re", "bwd"]


class ModelTimer:
    """Smoothed per-layer forward and backward times of one model.

    Before any measurement the estimates are the layer sizes (bytes; backward
    BACKWARD_MULTIPLIER x forward). Each finished job reports its per-layer times; the
    first report of each kind is dropped (warm-up), later ones enter an exponential
    moving average started from 0 and de-biased by `scale`. Iterations during which
    torch.compile built a graph are dropped as well, and once a layer is measured a
    sample enters at most OUTLIER_FACTOR x its estimate. VERBOSE logs every iteration's
    times at INFO (at DEBUG otherwise).
    """

    SMOOTH_RATE = 0.3
    BACKWARD_MULTIPLIER = 2.0
    # Once a layer has an estimate, one iteration's time enters at most this many times it.
    # A stall inside a timed block that no compile counter saw (on 4 H200s, a 22.5 s step
    # whose forward layers measured 2.6-3.1 s against ~55 ms) would otherwise drag the
    # estimates up for many iterations and cut the plan into groups of two layers; clipped,
    # a real slow-down still moves an estimate up (1.6x an iteration once the average has
    # several samples).
    OUTLIER_FACTOR = 3.0
    VERBOSE = False

    def __init__(self, layer_sizes: list[float]) -> None:
        self.n_layers = len(layer_sizes)
        self._sizes = [max(s, 1.0) for s in layer_sizes]
        self.stage: dict[str, int] = {"fwd": 0, "bwd": 0}
        self.scale: dict[str, float] = {"fwd": 0.0, "bwd": 0.0}
        self.estimate: dict[str, list[float]] = {
            "fwd": [0.0] * self.n_layers,
            "bwd": [0.0] * self.n_layers,
        }
        self._pending: dict[str, list[float | None]] = {
            "fwd": [None] * self.n_layers,
            "bwd": [None] * self.n_layers,
        }
        self._lock = threading.Lock()
        self.updates = 0
        self._compiles_seen = _compiled_graphs()

    def report(self, action: Literal["fwd", "bwd"], layer_times_ms: dict[int, float]) -> None:
        """Record measured times (ms summed over micro-batches) for some layers."""
        with self._lock:
            for i, t in layer_times_ms.items():
                prev = self._pending[action][i]
                self._pending[action][i] = t if prev is None else prev + t

    def update_times(self) -> bool:
        """Fold reported times into the estimates; True when the estimates changed."""
        changed = False
        compiles = _compiled_graphs()
        with self._lock:
            # An iteration during which torch.compile built a graph (the first one on each
            # device, a new shape) timed the compiler too: seen on 2 GPUs, where the head
            # first ran on the second GPU in iteration 2 and measured 3x its time. Such an
            # iteration is not a measurement; it would skew the plan for many iterations.
            compiled_meanwhile = compiles != self._compiles_seen
            self._compiles_seen = compiles
            for action in ("fwd", "bwd"):
                pending = self._pending[action]
                if any(p is None for p in pending):
                    continue  # only complete iterations count
                self._pending[action] = [None] * self.n_layers
                log.log(
                    logging.INFO if self.VERBOSE else logging.DEBUG,
                    "%s ms per layer%s: %s",
                    action,
                    " (dropped: torch.compile ran)" if compiled_meanwhile else "",
                    [round(float(p), 1) for p in pending],  # type: ignore[arg-type]
                )
                if compiled_meanwhile:
                    continue
                if self.stage[action] == 0:
                    self.stage[action] = 1  # drop the first (warm-up) measurement
                    continue
                r = self.SMOOTH_RATE
                samples = [float(p) for p in pending]  # type: ignore[arg-type]
                if self.stage[action] == 2:
                    ceiling = self.OUTLIER_FACTOR / self.scale[action]
                    samples = [
                        min(p, e * ceiling)
                        for e, p in zip(self.estimate[action], samples, strict=True)
                    ]
                self.scale[action] = self.scale[action] * (1 - r) + r
                self.estimate[action] = [
                    e * (1 - r) + r * p for e, p in zip(self.estimate[action], samples, strict=True)
                ]
                self.stage[action] = 2
                changed = True
        if changed:
            self.updates += 1
        return changed

    def get_estimate(
        self, run_type: str
    ) -> tuple[Literal["time", "memory"], list[float], list[float]]:
        """`(source, forward per layer, backward per layer)`: ms when measured, else bytes."""
        with self._lock:
            if self.stage["fwd"] == 2 and (run_type == "infer" or self.stage["bwd"] == 2):
                fwd = [e / self.scale["fwd"] for e in self.estimate["fwd"]]
                if self.stage["bwd"] == 2:
                    bwd = [e / self.scale["bwd"] for e in self.estimate["bwd"]]
                else:
                    bwd = [f * self.BACKWARD_MULTIPLIER for f in fwd]
                return "time", fwd, bwd
        return self.size_estimate()

    def size_estimate(self) -> tuple[Literal["memory"], list[float], list[float]]:
        """`get_estimate` before any measurement: the layer sizes (bytes), backward
        BACKWARD_MULTIPLIER x forward."""
        return "memory", list(self._sizes), [s * self.BACKWARD_MULTIPLIER for s in self._sizes]

    def shares(self, action: Literal["fwd", "bwd"], layer_ids: range) -> list[float] | None:
        """The layers' present estimates (ms), to split a block that runs several of them
        (the fused tail) in proportion; None before they were measured (an even split).

        A tail that takes decoder layers on (engine.planning.one_device) keeps the head's share
        it was measured with alone, where an even split would move most of the head's time
        onto the decoder layers and the planner would see a cheap head.
        """
        with self._lock:
            if self.stage[action] != 2:
                return None
            return [self.estimate[action][i] for i in layer_ids]


def _compiled_graphs() -> int:
    """How many graphs torch.compile has built and engine.accel.graphs has captured in this
    process so far (either makes an iteration's timings a measure of the building)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing compiled
    compiled = 0 if dynamo_utils is None else int(dynamo_utils.counters["stats"]["unique_graphs"])
    return compiled + graphs.stats()["captures"]


class IterTimer:
    """Collects one job's per-layer times and reports them to the ModelTimer when done.

    On CUDA, times come from events on the compute stream (read once they completed, at
    `flush`); on CPU from the wall clock. Each block's time also counts as its device's busy
    time (`DeviceManager.add_busy`: the device whose controller thread ran it).
    """

    def __init__(self, parent: ModelTimer, action: Literal["fwd", "bwd"], is_cuda: bool) -> None:
        self.parent = parent
        self.action = action
        self.is_cuda = is_cuda
        self._events: list[
            tuple[dict[int, float], torch.cuda.Event, torch.cuda.Event, DeviceManager | None]
        ] = []
        self._wall: dict[int, float] = {}

    @contextlib.contextmanager
    def time(
        self,
        layer_ids: range | list[int],
        stream: torch.cuda.Stream | None = None,
        *,
        shares: list[float] | None = None,
    ) -> Iterator[None]:
        """Time a block that runs `layer_ids`: its time is split among them in proportion
        to `shares` (evenly without)."""
        ids = list(layer_ids)
        weights = shares if shares is not None and sum(shares) > 0 else [1.0] * len(ids)
        total = sum(weights) or 1.0
        fractions = {i: w / total for i, w in zip(ids, weights, strict=True)}
        owner = current_device()
        if self.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            self._events.append((fractions, start, end, owner))
        else:
            t0 = time.perf_counter()
            yield
            dt = (time.perf_counter() - t0) * 1000
            if owner is not None:
                owner.add_busy(dt / 1000)
            for i, f in fractions.items():
                self._wall[i] = self._wall.get(i, 0.0) + dt * f

    def flush(self) -> None:
        """Report the measured times (waits for the CUDA events)."""
        times = dict(self._wall)
        for fractions, start, end, owner in self._events:
            end.synchronize()
            dt = start.elapsed_time(end)
            if owner is not None:
                owner.add_busy(dt / 1000)
            for i, f in fractions.items():
                times[i] = times.get(i, 0.0) + dt * f
        if times:
            self.parent.report(self.action, times)
