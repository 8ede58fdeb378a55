"""GradScaler: loss scaling shared by the threads that scale and the optimizer thread.

API-compatible with `torch.amp.GradScaler`, and it makes the same decisions (it delegates
them to two of them). The work is split by thread, because the step runs on the
optimizer thread while the next iteration's forward runs elsewhere:

- `scale()` runs where the loss is computed (the main or a device thread) with
  `scale_scaler`, whose scale is refreshed from `next_scale` once `scaler_updated` is set;
- `unscale_()` and `step()` run on the optimizer thread with `main_scaler` (called from
  another thread, they are launched there and waited for);
- `update()` is called from the main thread and launches `update_kernel()` on the
  optimizer thread, which updates `main_scaler`, publishes `next_scale` and sets
  `scaler_updated`.

Access rules: both sides touch `next_scale` and `scaler_updated`; only the optimizer
thread touches `main_scaler`; only the scaling threads touch `scale_scaler`.

The gradients are the fp32 master gradients on the CPU, so both inner scalers are
`torch.amp.GradScaler("cpu")`; `scale()` still moves the scale to the device of the
outputs it multiplies.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any, Final

import torch
from torch import Tensor

from .errors import ConfigError
from .optim_stream import launch_optim_kernel, on_optim_stream, synchronize_optim
from .threads import AnnotatedEvent

__all__ = ["GradScaler"]

log = logging.getLogger(__name__)


class GradScaler:
    """Loss scaling for mixed precision, shared by the scaling and optimizer threads.

    Attributes:
        enabled: Whether gradient scaling is enabled (read only).
        main_scaler: Tracks the scale used for unscaling and updating (optimizer thread).
        scale_scaler: Only applies the scale to outputs (scaling threads).
        next_scale: The scale the next `scale()` uses, published by `update_kernel()`.
        scaler_updated: Set when no update is pending, i.e. `next_scale` is current.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if enabled:
            _check_factors(init_scale, growth_factor, backoff_factor, growth_interval)
        self.enabled: Final[bool] = bool(enabled)
        options = {
            "init_scale": float(init_scale),
            "growth_factor": float(growth_factor),
            "backoff_factor": float(backoff_factor),
            "growth_interval": int(growth_interval),
            "enabled": self.enabled,
        }
        self.main_scaler = torch.amp.GradScaler("cpu", **options)
        self.scale_scaler = torch.amp.GradScaler("cpu", **options)
        if self.enabled:
            # Create both scale tensors now, on the CPU: main_scaler never scales anything,
            # and torch's unscale_ needs the tensors that the first scale() would create.
            self.main_scaler.scale(torch.ones(()))
            self.scale_scaler.scale(torch.ones(()))
        self.next_scale = torch.full((), float(init_scale), dtype=torch.float32)
        self.scaler_updated = AnnotatedEvent("scaler_updated", set_=True)
        self._scale_lock = threading.Lock()  # scale() may run on several device threads

    # --- scaling threads -------------------------------------------------------------

    def scale(self, outputs: Tensor | Iterable[Tensor]) -> Any:
        """Multiply a tensor (or an iterable of them) by the scale factor.

        Waits for a pending `update()` first, so every output of an iteration is scaled
        by the scale that iteration's step will unscale with. Returns the outputs
        unmodified when disabled.
        """
        if not self.enabled:
            return outputs
        if on_optim_stream():
            return self.main_scaler.scale(outputs)
        self.scaler_updated.wait()
        with self._scale_lock:
            # torch.amp.GradScaler.update(new_scale) just fills its scale tensor.
            self.scale_scaler.update(float(self.next_scale))
            return self.scale_scaler.scale(outputs)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled).

        On the optimizer thread: the scale `main_scaler` unscales with. Elsewhere: the
        scale the next `scale()` uses (waiting for a pending `update()`).
        """
        if not self.enabled:
            return 1.0
        if on_optim_stream():
            return self.main_scaler.get_scale()
        self.scaler_updated.wait()
        return float(self.next_scale)

    # --- optimizer thread ------------------------------------------------------------

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale and record whether any is inf/NaN.

        From another thread, it runs on the optimizer thread and is waited for.
        """
        if not self.enabled:
            return
        self._on_optim(self.main_scaler.unscale_, optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless `unscale_` ran this iteration) and step if all grads are finite.

        Returns the result of `optimizer.step()` when disabled or on the optimizer thread,
        None otherwise (the step ran on the optimizer thread and was waited for).
        """
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if on_optim_stream():
            return self.main_scaler.step(optimizer, *args, **kwargs)
        self._on_optim(self.main_scaler.step, optimizer, *args, **kwargs)
        return None

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Back off after a skipped step, grow after `growth_interval` good ones.

        Call it from the main thread after the iteration's `step()`: it launches
        `update_kernel()` on the optimizer thread and returns; the next `scale()` or
        `get_scale()` waits for it. `new_scale` sets the scale instead (a tensor is copied
        now, so later changes to it have no effect).
        """
        if not self.enabled:
            return
        new_scale = _copy_scale(new_scale)
        if on_optim_stream():
            self.update_kernel(new_scale)
            return
        self.scaler_updated.clear()
        try:
            launch_optim_kernel(self.update_kernel, new_scale)
        except BaseException:
            self.scaler_updated.set()  # nothing will run: do not leave scale() waiting
            raise

    def update_kernel(self, new_scale: float | Tensor | None) -> None:
        """Update `main_scaler` and publish its scale (runs on the optimizer thread)."""
        try:
            self.main_scaler.update(new_scale)
            self.next_scale.fill_(self.main_scaler.get_scale())
        finally:
            self.scaler_updated.set()

    # --- factors and state -----------------------------------------------------------

    def get_growth_factor(self, up_to_date: bool = False) -> float:
        """The growth factor; `up_to_date` waits for the optimizer thread first."""
        self._maybe_sync(up_to_date)
        return self.main_scaler.get_growth_factor()

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor, in order with the queued steps."""
        _check_factors(2.0**16, new_factor, 0.5, 1)
        launch_optim_kernel(self.main_scaler.set_growth_factor, float(new_factor))

    def get_backoff_factor(self, up_to_date: bool = False) -> float:
        """The backoff factor; `up_to_date` waits for the optimizer thread first."""
        self._maybe_sync(up_to_date)
        return self.main_scaler.get_backoff_factor()

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor, in order with the queued steps."""
        _check_factors(2.0**16, 2.0, new_factor, 1)
        launch_optim_kernel(self.main_scaler.set_backoff_factor, float(new_factor))

    def get_growth_interval(self, up_to_date: bool = False) -> int:
        """The growth interval; `up_to_date` waits for the optimizer thread first."""
        self._maybe_sync(up_to_date)
        return self.main_scaler.get_growth_interval()

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval, in order with the queued steps."""
        _check_factors(2.0**16, 2.0, 0.5, new_interval)
        launch_optim_kernel(self.main_scaler.set_growth_interval, int(new_interval))

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self.enabled

    def state_dict(self) -> dict[str, Any]:
        """torch.amp.GradScaler's state dict (empty when disabled), after pending work."""
        if not self.enabled:
            return {}
        self._maybe_sync(True)
        return self.main_scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from this class or from torch.amp.GradScaler."""
        if not self.enabled:
            return
        self.scaler_updated.clear()
        try:
            self._on_optim(self._load_kernel, dict(state_dict))
        finally:
            self.scaler_updated.set()

    def _load_kernel(self, state_dict: dict[str, Any]) -> None:
        self.main_scaler.load_state_dict(state_dict)
        self.next_scale.fill_(self.main_scaler.get_scale())

    def _on_optim(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Run `fn` on the optimizer thread and wait for it (inline when already there)."""
        launch_optim_kernel(fn, *args, **kwargs)
        if not on_optim_stream():
            synchronize_optim()

    def _maybe_sync(self, up_to_date: bool) -> None:
        if up_to_date and not on_optim_stream():
            synchronize_optim()


def _copy_scale(new_scale: float | Tensor | None) -> float | Tensor | None:
    if new_scale is None:
        return None
    if isinstance(new_scale, Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad:
            raise ConfigError("new_scale must be a float or a 1-element tensor without grad")
        return new_scale.detach().to("cpu", torch.float32).clone().reshape(())
    return float(new_scale)


def _check_factors(
    init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int
) -> None:
    if not init_scale > 0:
        raise ConfigError(f"init_scale must be > 0, got {init_scale}")
    if not growth_factor > 1.0:
        raise ConfigError(f"growth_factor must be > 1.0, got {growth_factor}")
    if not 0.0 < backoff_factor < 1.0:
        raise ConfigError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
    if int(growth_interval) != growth_interval or growth_interval < 1:
        raise ConfigError(f"growth_interval must be an integer >= 1, got {growth_interval}")
