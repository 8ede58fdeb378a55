"""Plans for one GPU: groups by parameter size, and a fused tail that takes the top backward
group's layers where their activations fit.

With one GPU every job runs in turn on it, so no pipeline needs balancing and the timings
cannot change how long the work takes; the grouping only changes the overheads. Each group
boundary moves the activation between jobs through host memory (down, then up again), keeps
a recompute input, and makes the GPU wait for the next job's input (at 131,072 tokens
0.5 GB each way). The timed plan groups layers up to 1.1 x the slowest layer, which at long
sequences is a decoder layer, so one-layer groups: at 131,072 tokens on one GPU they ran
slower than the size-grouped plan of the first calls (bench/RESULTS.md, 2026-11-24). `GROUP_BY_SIZE` keeps the grouping by parameter size, as before any timing
(ModelExecutePlan.auto(..., by_size=True)).

A decoder layer outside the fused tail runs a no-grad forward and, in its backward job, a
recompute before its backward; a layer inside the tail runs its forward once, with grad, and
its backward right after. With one GPU nothing runs beside the tail, so each layer moved
into it saves its recompute: the default step of Qwen3-1.7B ran faster with the top
backward group's six layers in the tail (`WIDEN_TAIL`; bench/RESULTS.md). The price is GPU
memory: the tail holds those layers' activations of a micro-batch at once, with the head's.

The memory is measured, not modelled: `ActivationMeter` reads the CUDA allocator around each
layer's recompute in the first calls (what autograd keeps for the layer's backward, its
saved-attention upload included) and around the tail's forward. `widen_tail` moves layers
of the top backward group into the tail, from the top down, while the tail's activations
stay under what the largest job already held plus the room the device has left (under a
GPU memory cap, the room of a device as large as the cap: engine.planning.gpu_memory). With
`recompute_grain='layer'` (asked for to hold one layer's activations at a time, for the
longest sequences) the tail stays as planned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..device import device_memory_bytes
from ..scheduler import ModelExecutePlan

__all__ = [
    "GROUP_BY_SIZE",
    "MEMORY_FRACTION",
    "WIDEN_TAIL",
    "ActivationMeter",
    "DeviceRoom",
    "widen_tail",
    "with_tail_start",
]

GROUP_BY_SIZE = True
"""One GPU: group layers by parameter size, not by measured time (False: by time)."""

WIDEN_TAIL = True
"""One GPU: the fused tail takes the top backward group's layers (False: the automatic
plan's tail, usually the head alone)."""

MEMORY_FRACTION = 0.9
"""The share of the device's memory that the widened tail may plan up to: the caching
allocator's reserve over what is allocated, and other processes, need the rest."""

# Calls measured at the start: the plan is re-made after the 1st, 3rd and 10th timed call
# (roundpipe._REPLAN_AFTER_UPDATES); reading the allocator costs little a layer, but not nothing.
_MEASURED_CALLS = 12


@dataclass(frozen=True)
class DeviceRoom:
    """The device's memory as the widening sees it (bytes): its total (or the GPU memory
    cap where smaller), and the most this process's caching allocator reserved on it."""

    total: int
    peak_reserved: int

    @classmethod
    def of(cls, device: torch.device) -> DeviceRoom:
        return cls(
            total=device_memory_bytes(device),
            peak_reserved=torch.cuda.max_memory_reserved(device),
        )

    def free(self) -> int:
        return int(MEMORY_FRACTION * self.total) - self.peak_reserved


class ActivationMeter:
    """GPU bytes of one micro-batch's activations: per layer (its recompute), the most a
    backward job held at once, and the fused tail's forward (the first micro-batch of
    each of the first calls, on CUDA)."""

    def __init__(self, num_layers: int) -> None:
        self.layer: list[int | None] = [None] * num_layers
        self.held = 0
        # By the tail's first layer: a widened tail measures more than the tail it grew
        # from, which the plan of a later re-planning starts from again.
        self.tail: dict[int, int] = {}
        self.calls = 0

    def wanted(self, device: torch.device, num_devices: int) -> bool:
        """Whether this call's jobs should measure (one CUDA device, the first calls)."""
        return (
            WIDEN_TAIL
            and num_devices == 1
            and device.type == "cuda"
            and self.calls < _MEASURED_CALLS
        )

    @staticmethod
    def allocated(device: torch.device) -> int:
        return torch.cuda.memory_allocated(device)

    def record_layer(self, layer_id: int, nbytes: int) -> None:
        prev = self.layer[layer_id]
        self.layer[layer_id] = nbytes if prev is None else max(prev, nbytes)

    def record_held(self, nbytes: int) -> None:
        self.held = max(self.held, nbytes)

    def record_tail(self, start: int, nbytes: int) -> None:
        self.tail[start] = max(self.tail.get(start, nbytes), nbytes)


def widen_tail(
    plan: ModelExecutePlan,
    meter: ActivationMeter,
    layer_gb: Sequence[float],
    room: DeviceRoom,
    param_cap_gb: float,
) -> ModelExecutePlan:
    """`plan` (fused, one device) with the top backward group's layers moved into the fused
    tail, from the top down, while (a) each was measured, (b) the tail's activations exceed
    the most any job held so far by no more than the device's free room, and (c) the tail's
    parameters stay within `param_cap_gb`. The plan itself when none moves."""
    tail = plan.fwd_plan[-1]
    tail_act = meter.tail.get(tail.start)
    if not plan.bwd_plan or tail_act is None or plan.tail_split != 1:
        return plan
    top = plan.bwd_plan[0]
    if top.stop != tail.start:
        return plan
    held = max(meter.held, *meter.tail.values())
    free = room.free()
    act, gb, start = tail_act, sum(layer_gb[j] for j in tail), tail.start
    for j in reversed(top):
        a = meter.layer[j]
        if a is None or act + a - held > free or gb + layer_gb[j] > param_cap_gb:
            break
        act, gb, start = act + a, gb + layer_gb[j], j
    if start == tail.start:
        return plan
    return with_tail_start(plan, start)


def with_tail_start(plan: ModelExecutePlan, start: int) -> ModelExecutePlan:
    """A fused plan whose tail starts at layer `start` (at or before its present start): the
    groups before are cut there, and those left empty dropped."""
    n = plan.fwd_plan[-1].stop

    def cut(groups: Sequence[range]) -> list[range]:
        return [range(r.start, min(r.stop, start)) for r in groups if r.start < start]

    fwd = [*cut(plan.fwd_plan[:-1]), range(start, n)]
    bwd = [r for r in cut(plan.bwd_plan) if len(r)]
    return ModelExecutePlan.from_ranges(fwd, bwd, plan.tail_split)
