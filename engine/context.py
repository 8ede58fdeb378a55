"""Thread-local flags that tell layer code whether it runs a forward, a recompute or a step.

`save_for_recompute(*data)` inside a layer's forward keeps data (tensors that do not require
grad, or any Python objects) for the backward recompute of that layer, where
`get_recompute_data()` returns it as a tuple and `doing_recompute()` is True.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .errors import RoundPipeError

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "ForwardCtx",
    "OptimizerCtx",
    "RecomputeCtx",
    "StepProgress",
    "doing_optimizer",
    "doing_recompute",
    "flags",
    "get_recompute_data",
    "recompute_data_or_none",
    "save_for_recompute",
    "saving_for_recompute",
    "step_progress",
]

flags = threading.local()


def _get(name: str, default: Any = None) -> Any:
    return getattr(flags, name, default)


class ForwardCtx:
    """Marks a layer's forward; `save_fn` receives what the layer saves for recompute."""

    def __init__(self, save_fn: Callable[..., None] | None) -> None:
        self.save_for_recompute = save_fn
        self._prev: Any = None

    def __enter__(self) -> ForwardCtx:
        self._prev = _get("forward")
        flags.forward = self
        return self

    def __exit__(self, *exc: object) -> None:
        flags.forward = self._prev


class RecomputeCtx:
    """Marks the recompute of a layer; `recompute_data` is what its forward saved."""

    def __init__(self, recompute_data: tuple[Any, ...] | None) -> None:
        self.recompute_data = recompute_data
        self._prev: Any = None

    def __enter__(self) -> RecomputeCtx:
        self._prev = _get("recompute")
        flags.recompute = self
        return self

    def __exit__(self, *exc: object) -> None:
        flags.recompute = self._prev


class StepProgress(Protocol):
    """What an optimizer may tell the engine while a step_fn runs (`step_progress()`).

    RoundPipe installs one for a step whose optimizer writes the weights the next call
    uploads (optim_memory='compact'): a layer's uploads start once every weight it owns is
    reported updated, instead of when step_fn returns. An optimizer that reports nothing
    (torch's) leaves every layer waiting for step_fn, as without it.
    """

    def order(self, param: Tensor) -> int:
        """The rank of `param` in the order the engine wants the updates, lowest first (its
        layer: the next forward needs layer 0 first); parameters of one rank may be updated
        together."""
        ...

    def updated(self, param: Tensor) -> None:
        """`param` holds its new value: this step_fn will not write it again (the engine
        may upload it from now on). Its gradient stays the optimizer's until step_fn returns."""
        ...


class OptimizerCtx:
    """Marks optimizer work: RoundPipe's parameters() yields the optimizer-side tensors;
    `progress`: what `step_progress()` returns inside (an enclosing one's without)."""

    def __init__(self, progress: StepProgress | None = None) -> None:
        self.progress = progress
        self._prev: StepProgress | None = None

    def __enter__(self) -> OptimizerCtx:
        flags.optimizer_depth = _get("optimizer_depth", 0) + 1
        self._prev = _get("step_progress")
        if self.progress is not None:
            flags.step_progress = self.progress
        return self

    def __exit__(self, *exc: object) -> None:
        flags.optimizer_depth = _get("optimizer_depth", 1) - 1
        flags.step_progress = self._prev


def step_progress() -> StepProgress | None:
    """The StepProgress of the step_fn running on this thread, or None: an optimizer that
    updates parameter by parameter reports to it (engine.optim.Adam does)."""
    return _get("step_progress")  # type: ignore[no-any-return]


def doing_optimizer() -> bool:
    """True inside an OptimizerCtx on this thread (e.g. in a step_fn)."""
    return _get("optimizer_depth", 0) > 0


def doing_recompute() -> bool:
    """True while a layer's forward is being re-run for the backward pass."""
    return _get("recompute") is not None


def get_recompute_data() -> tuple[Any, ...]:
    """Return what this layer saved with save_for_recompute, always as a tuple."""
    ctx = _get("recompute")
    if ctx is None:
        raise RoundPipeError(
            "get_recompute_data() is only valid during a recompute; check doing_recompute() first"
        )
    if ctx.recompute_data is None:
        raise RoundPipeError("this layer saved nothing with save_for_recompute() in its forward")
    return ctx.recompute_data


def save_for_recompute(*data: Any) -> None:
    """Keep `data` for this layer's recompute; a no-op when no backward will follow.

    Tensors must not require grad. At most one call per layer and forward.
    """
    ctx = _get("forward")
    if ctx is None or ctx.save_for_recompute is None:
        return
    ctx.save_for_recompute(*data)


def saving_for_recompute() -> bool:
    """True where `save_for_recompute` keeps data: a forward whose layer will be recomputed."""
    ctx = _get("forward")
    return ctx is not None and ctx.save_for_recompute is not None


def recompute_data_or_none() -> tuple[Any, ...] | None:
    """What this layer saved for its recompute, or None (no recompute, or nothing saved)."""
    ctx = _get("recompute")
    return None if ctx is None else ctx.recompute_data
