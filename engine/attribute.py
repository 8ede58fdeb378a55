"""Per-layer and per-parameter state shared by the device threads and the optimizer thread.

The step protocol (staleness one). For every layer, two events:

    main thread            optimizer thread (step k)              device threads (iteration k+1)
    step(): clear both --> copy optim -> model params (w[k]) --> set param_copied --> uploads wait
                           fold model grads -> optim grads   --> set grad_copied  --> grad downloads wait
                           step_fn (w[k] -> w[k+1])          ... runs while iteration k+1 computes

so iteration k+1 computes with w[k], the weights from before step k was applied, and never
sees a mix of two versions: w[k+1] reaches the model params only at the start of step k+1
(or at once with a synchronous step, or at synchronize()).

With optim_memory='compact' step_fn writes the model params themselves: a layer's
param_copied is set once the optimizer reports the weights it owns updated (layer 0 first;
engine.context.StepProgress) or step_fn returns, and grad_copied when step_fn returns, so
iteration k+1 computes with w[k+1], its forward following the optimizer layer by layer.

The fold usually finds its work done: during iteration k's backward a kernel on the
optimizer thread (engine.fold_ahead) copies each gradient as it lands (`fold_ahead`), and
the step's `fold_grad` takes the copy if neither buffer was written since. Where the copy
would be plain (no gradient kept from before to add to), the step hands the optimizer the
download itself as a deferred copy instead (engine.optim._deferred): engine.optim.Adam
reads it in place, and the copy is made only if step_fn reads `.grad` otherwise. Such a
layer's download buffer is then the optimizer's until step_fn returns (grad_copied waits
for it, as with `grad_in_place`).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from .errors import ConfigError
from .optim import _deferred
from .threads import AnnotatedEvent

__all__ = ["OPTIM_MEMORY_MODES", "LayerAttribute", "ParamAttribute", "resolve_optim_memory"]

OPTIM_MEMORY_MODES = ("default", "compact")


def resolve_optim_memory(
    mode: str,
    params: list[nn.Parameter],
    *,
    optim_dtype: torch.dtype | None,
    optim_grad_dtype: torch.dtype | None,
    double_buffer_weights: bool | None,
) -> torch.dtype | None:
    """Check RoundPipe's `optim_memory` against the other options; returns the
    `optim_grad_dtype` to use.

    'compact' (issue 35): the trainable bf16 weights are the optimizer's masters (no
    separate copy) and the optimizer reads the downloaded bf16 gradient in place; with
    engine.optim.Adam(state_dtype=torch.uint8) that is about 6 bytes of host memory per
    trainable parameter. The step writes the weights the next iteration's uploads read, so
    an upload of a layer waits for the update of the weights it owns (as the optimizer
    reports them: engine.context.StepProgress; else for the whole step): the next
    iteration computes with the updated weights.
    """
    if mode not in OPTIM_MEMORY_MODES:
        raise ConfigError(f"optim_memory must be 'default' or 'compact', got {mode!r}")
    if mode == "default":
        return optim_grad_dtype
    wrong = sorted({str(p.dtype) for p in params if p.requires_grad and p.dtype != torch.bfloat16})
    if wrong:
        raise ConfigError(
            f"optim_memory='compact' keeps the bf16 weights as the masters; the model has "
            f"trainable {', '.join(wrong)} parameters: convert it with model.to(torch.bfloat16)"
        )
    for name, value in (("optim_dtype", optim_dtype), ("optim_grad_dtype", optim_grad_dtype)):
        if value not in (None, torch.bfloat16):
            raise ConfigError(
                f"optim_memory='compact' uses the bf16 weights and gradients; leave {name} "
                f"unset (got {value})"
            )
    if double_buffer_weights:
        raise ConfigError(
            "optim_memory='compact' keeps no second weight copy; leave double_buffer_weights unset"
        )
    return torch.bfloat16


class LayerAttribute:
    """Events that order one layer's uploads and gradient downloads against the optimizer."""

    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id
        self.param_copied = AnnotatedEvent(f"layer{layer_id}.param_copied", set_=True)
        self.grad_copied = AnnotatedEvent(f"layer{layer_id}.grad_copied", set_=True)

    def renew(self) -> None:
        """New, unset events for the next step, leaving the current ones to whoever holds
        them. With overlapped calls a call still running waits on the step before the one
        being launched: clearing its events would make it wait on a step that waits on it.
        """
        self.param_copied = AnnotatedEvent(f"layer{self.layer_id}.param_copied")
        self.grad_copied = AnnotatedEvent(f"layer{self.layer_id}.grad_copied")


class ParamAttribute:
    """Host-side companions of one model parameter.

    Attributes:
        owner_layer: The first layer that uses the parameter; its LayerAttribute's events
            guard this parameter (tied weights are used by several layers).
        optim: The optimizer-side copy (fp32 master when `optim_dtype` asks for it); what
            `parameters()` yields inside a step_fn.
        grad_host: Gradients downloaded since the last step (model dtype, pinned on CUDA);
            meaningful only while `grad_pending`.
        grad_pending: `grad_host` holds gradients the optimizer has not folded in yet.
        grad_in_place: The optimizer reads `grad_host` itself as its gradient (the model
            dtype: no separate buffer; `optim_grad_dtype` equal to the model dtype). The
            next gradient download then waits for the whole step, not just the fold.
        defer_copy: The step may hand the optimizer `grad_host` as a deferred copy of its
            gradient (engine.optim._deferred) instead of copying it; turned off for good
            once a step_fn read the copy (it is then made while the backward runs again).
    """

    def __init__(
        self,
        param: nn.Parameter,
        owner_layer: int,
        optim_dtype: torch.dtype,
        optim_grad_dtype: torch.dtype | None = None,
        share_master: bool = False,
    ) -> None:
        self.owner_layer = owner_layer
        self.optim: nn.Parameter | None = None
        self.grad_in_place = False
        # The optimizer-side parameter shares the model weight's storage (optim_memory=
        # 'compact'): nothing to publish, and uploads must wait for its update.
        self.master_shared = share_master and param.requires_grad
        if param.requires_grad:
            if share_master:
                self.optim = nn.Parameter(param.detach(), requires_grad=True)
            else:
                master = param.detach().to(optim_dtype, copy=True)
                self.optim = _deferred.DeferredGradParameter(master, requires_grad=True)
            grad_dtype = optim_grad_dtype or optim_dtype
            if grad_dtype not in (optim_dtype, param.dtype):
                raise ConfigError(
                    f"optim_grad_dtype must be the optimizer dtype ({optim_dtype}) or the "
                    f"model's ({param.dtype}), got {grad_dtype}"
                )
            self.grad_in_place = optim_grad_dtype is not None and grad_dtype == param.dtype
            if self.grad_in_place and grad_dtype != optim_dtype:
                if not hasattr(self.optim, "grad_dtype"):
                    raise ConfigError(
                        "optim_grad_dtype other than optim_dtype needs torch >= 2.10 "
                        "(Tensor.grad_dtype); use the default"
                    )
                self.optim.grad_dtype = grad_dtype
        self.defer_copy = self.optim is not None and not self.grad_in_place
        self.grad_host: torch.Tensor | None = None
        self.grad_pending = False
        self.grad_event: torch.cuda.Event | None = None  # completes the last grad download
        self.optim_grad_buffer: torch.Tensor | None = None
        # fold_ahead's copy: (grad_host, its version then, the buffer, its version then)
        self.folded_ahead: tuple[torch.Tensor, int, torch.Tensor, int] | None = None
        self.lock = threading.Lock()

    @classmethod
    def get(cls, t: torch.Tensor) -> ParamAttribute:
        """The ParamAttribute attached to `t`."""
        return t._rp_attr  # type: ignore[attr-defined,no-any-return]

    @classmethod
    def has(cls, t: torch.Tensor) -> bool:
        """Whether `t` has a ParamAttribute."""
        return hasattr(t, "_rp_attr")

    @classmethod
    def set(
        cls,
        t: nn.Parameter,
        layer_id: int,
        optim_dtype: torch.dtype,
        optim_grad_dtype: torch.dtype | None = None,
        share_master: bool = False,
    ) -> ParamAttribute:
        """Attach a new ParamAttribute to `t` (owned by `layer_id`)."""
        attr = cls(t, layer_id, optim_dtype, optim_grad_dtype, share_master)
        t._rp_attr = attr  # type: ignore[attr-defined]
        return attr

    def accumulates(self) -> bool:
        """Whether the next gradient download must add to `grad_host` (not overwrite it)."""
        if self.grad_host is None:
            return False
        if self.grad_pending:
            return True
        # In place, grad_host *is* the optimizer's gradient until the optimizer drops it.
        return (
            self.grad_in_place
            and self.optim is not None
            and _deferred.stored(self.optim) is self.grad_host
        )

    def may_defer(self) -> bool:
        """Whether the step may hand the optimizer the download buffer as a deferred copy of
        its gradient instead of copying it (see the module doc)."""
        return self.defer_copy and isinstance(self.optim, _deferred.DeferredGradParameter)

    def fold_grad(self, *, defer: bool = False) -> bool:
        """Add the pending host gradient into the optimizer-side gradient; True when the
        copy `fold_ahead` made of it was still current and is taken as it is.

        `defer` (the step, which calls `settle_grad` once step_fn has returned): a plain
        copy is handed over deferred where `may_defer`; the download buffer is then the
        optimizer's until step_fn returns.
        """
        ahead, self.folded_ahead = self.folded_ahead, None
        if not self.grad_pending or self.optim is None or self.grad_host is None:
            self.grad_pending = False
            return False
        g = self.grad_host
        held = _deferred.stored(self.optim)  # a deferred copy lives within one step: none here
        taken = False
        if self.grad_in_place and (held is None or held is g):
            # The downloads already accumulated into g (accumulates()): hand it over as is.
            self.optim.grad = g
        elif held is None:
            taken = ahead is not None and _still_current(ahead, g, self.optim_grad_buffer)
            if taken:
                self.optim.grad = self.optim_grad_buffer
            elif defer and self.may_defer():
                _deferred.defer(
                    self.optim, g, buffer=lambda: self._buffer_for(g), on_read=self._copy_read
                )
            else:
                self.optim.grad = self._copy_into_buffer(g)
        else:
            self.optim.grad.add_(g)
        self.grad_pending = False
        return taken

    def settle_grad(self) -> None:
        """Make the copy of a gradient the step handed over deferred and step_fn kept (once
        step_fn has returned: the next download overwrites the buffer it is a copy of)."""
        if self.optim is not None:
            _deferred.settle(self.optim)

    def fold_ahead(self) -> torch.Tensor | None:
        """Make now, while other layers' backward runs, the copy fold_grad would make of
        the pending gradient (into the reused buffer); call it once the gradient is down.
        fold_grad takes the copy if neither it nor the download buffer changed since
        (another call's download adds to the buffer first: call this again after it).
        Where the step will hand the download over as a deferred copy (`may_defer`) there is
        nothing to copy. Returns the gradient the optimizer will read (the copy, or the
        download buffer read in place), for its sum of squares; None when fold_grad is left
        to do it all (nothing pending, or an optimizer-side gradient kept from before to add
        to)."""
        with self.lock:
            self.folded_ahead = None
            if not self.grad_pending or self.optim is None or self.grad_host is None:
                return None
            g = self.grad_host
            held = _deferred.stored(self.optim)
            if self.grad_in_place and (held is None or held is g):
                return g  # fold_grad hands the download buffer over as it is
            if held is not None:
                return None
            if self.may_defer():
                return g  # the step hands it over deferred: engine.optim.Adam reads g
            copy = self._copy_into_buffer(g)
            self.folded_ahead = (g, g._version, copy, copy._version)
            return copy

    def _copy_read(self) -> None:
        """A step_fn read a deferred copy (a torch optimizer, say): from now on the copy is
        made while the backward runs, as without deferring."""
        self.defer_copy = False

    def _buffer_for(self, g: torch.Tensor) -> torch.Tensor:
        """The optimizer-side gradient buffer for `g`'s shape, reused from step to step:
        allocating (and page-faulting) a fresh fp32 gradient for every parameter each step
        costs more than the copy itself."""
        assert self.optim is not None
        buf = self.optim_grad_buffer
        if buf is None or buf.shape != g.shape:
            buf = torch.empty(g.shape, dtype=self.optim.dtype)
            self.optim_grad_buffer = buf
        return buf

    def _copy_into_buffer(self, g: torch.Tensor) -> torch.Tensor:
        buf = self._buffer_for(g)
        buf.copy_(g)
        return buf


def _still_current(
    ahead: tuple[torch.Tensor, int, torch.Tensor, int],
    grad_host: torch.Tensor,
    buffer: torch.Tensor | None,
) -> bool:
    """Whether fold_ahead's copy is still that of the download buffer: neither written since
    (every write of either is an in-place torch op, which moves the version counter)."""
    host, host_version, copy, copy_version = ahead
    return (
        host is grad_host
        and host._version == host_version
        and copy is buffer
        and copy._version == copy_version
    )
