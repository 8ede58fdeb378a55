"""Per-step training metrics: each step's event once its optimizer update has run.

A step's event carries `gpu_share`: each engine device's busy time over the step's wall
time (engine.device.BusyReader; docs/PERFORMANCE.md says how to read it)."""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.device import BusyReader, DeviceBusy

from ..data.datasets import BatchOrder

__all__ = ["Emit", "Meter", "gpu_share"]

Emit = Callable[..., None]
"""`emit(type, message, data, level="info")`: write one event."""
_SPEED_WINDOW = 20  # steps over which tokens/s is averaged


@dataclass(slots=True)
class Meter:
    """Per-step metrics: waits for each step's update (its grad norm and the learning rate
    the scheduler gave it, sent by the optimizer thread), then emits its event."""

    emit: Emit
    total_steps: int
    order: BatchOrder
    start_time: float = field(default_factory=time.perf_counter)
    start_step: int = 0
    trained_tokens: int = 0
    pending: deque[dict[str, Any]] = field(default_factory=deque)
    # (step, grad norm, learning rate, the optimizer thread's seconds) of each update, in
    # step order
    updates: queue.SimpleQueue[tuple[int, float, float, dict[str, float]]] = field(
        default_factory=queue.SimpleQueue
    )
    speed: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=_SPEED_WINDOW))
    last: dict[str, Any] = field(default_factory=dict)
    busy: BusyReader = field(default_factory=BusyReader)

    def record(
        self, step: int, loss: float, tokens: int, extra: dict[str, Any] | None = None
    ) -> None:
        """Note step `step` (1-based) as done on the main thread; `extra`: the objective's
        own metrics (DPO's rewards and log-probabilities)."""
        now = time.perf_counter()
        # this step's wall time: since the previous step, or since this attempt started
        step_seconds = now - (self.speed[-1][0] if self.speed else self.start_time)
        self.trained_tokens += tokens
        self.speed.append((now, tokens))
        if len(self.speed) > 1:
            span = now - self.speed[0][0]
            tokens_per_s = sum(t for _, t in list(self.speed)[1:]) / span if span > 0 else 0.0
        else:
            tokens_per_s = tokens / max(now - self.start_time, 1e-9)
        done = step - self.start_step
        eta = (now - self.start_time) / done * (self.total_steps - step) if done else None
        self.pending.append(
            {
                "step": step,
                "total_steps": self.total_steps,
                "epoch": round(self.order.epoch(step), 6),
                "train_loss": loss,
                "valid_loss": None,
                "learning_rate": None,
                "grad_norm": None,
                "tokens_per_second": round(tokens_per_s, 3),
                "step_seconds": round(step_seconds, 4),
                "trained_tokens": self.trained_tokens,
                "gpu_mem_bytes": _gpu_mem_bytes(),
                "gpu_share": gpu_share(self.busy.read(), step_seconds),
                "eta_seconds": None if eta is None else round(eta, 3),
                **(extra or {}),
            }
        )

    def flush(
        self, *, valid_loss: float | None = None, valid: dict[str, float] | None = None
    ) -> None:
        """Emit every pending step whose update has run (all of them after a sync);
        `valid`: the objective's validation metrics (``valid_loss`` or others), set on the
        last pending step, as `valid_loss` alone is."""
        if valid_loss is not None:
            valid = {**(valid or {}), "valid_loss": valid_loss}
        while True:
            try:
                step, norm, lr, timing = self.updates.get_nowait()
            except queue.Empty:
                return
            data = self.pending.popleft()
            if data["step"] != step:  # the optimizer thread runs steps in order
                raise RuntimeError(f"grad norm of step {step} arrived for step {data['step']}")
            data["grad_norm"] = norm
            data["learning_rate"] = lr
            data["optimizer"] = timing
            if not self.pending and valid:
                data.update(valid)
            self.last = data
            message = f"step {step}/{self.total_steps} loss {data['train_loss']:.4f}"
            if data["valid_loss"] is not None:
                message += f" valid {data['valid_loss']:.4f}"
            self.emit("metrics", message, data)


def gpu_share(window: list[DeviceBusy], wall_s: float) -> list[dict[str, Any]]:
    """The `gpu_share` of a metrics event: per device, its busy seconds over `wall_s`
    (at most 1; a call's busy time is counted when the call ends, so a window can catch a
    little of the one before) and the jobs it finished."""
    return [
        {
            "device": b.device,
            "busy_fraction": round(min(b.busy_s / wall_s, 1.0), 4) if wall_s > 0 else 0.0,
            "busy_s": round(b.busy_s, 4),
            "jobs": b.jobs,
        }
        for b in window
    ]


def _gpu_mem_bytes() -> int:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return sum(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))
