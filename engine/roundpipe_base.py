"""RoundPipeBase: what RoundPipe and AutoRoundPipe share.

Optimizer-side copies of the parameters (what a torch optimizer updates inside a step_fn),
the attribute shim that reaches the original model, and the step: on the optimizer thread,
publish the previous step's weights into the model and fold the new gradients into the
optimizer-side ones, layer by layer (`publish_weights_take_grads`: a plain copy is handed
over deferred, engine.optim._deferred, and made after step_fn only if step_fn kept the
gradient, `settle_grads`), then run step_fn; with weights the optimizer writes in place
(optim_memory='compact'), publish each layer as soon as the optimizer reports its weights
updated (`_LayerProgress`). With `step_staleness=0` the same goes for every mode: the step
publishes each layer's new weights as the optimizer reports them, so the next call computes
with them and waits for them layer by layer.
`engine.roundpipe` re-exports the class (the seed's place for it).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .accel.weight_buffers import publish_param
from .adapters.peft_format import save_adapter
from .attribute import ParamAttribute
from .call_site import get_call_location
from .context import OptimizerCtx, doing_optimizer
from .errors import ConfigError
from .optim import _deferred
from .optim_stream import check_optim_error, launch_optim_kernel, synchronize_optim
from .threads import AnnotatedEvent, track_open

if TYPE_CHECKING:
    from .run_state import RunState

__all__ = [
    "STEP_STALENESS",
    "RoundPipeBase",
    "check_step_staleness",
    "publish_weights_take_grads",
    "settle_grads",
]

STEP_STALENESS = (0, 1)


def check_step_staleness(value: object) -> int:
    """`step_staleness` as given, if it is 0 or 1 (ConfigError otherwise)."""
    if isinstance(value, bool) or value not in STEP_STALENESS:
        raise ConfigError(
            f"step_staleness must be 0 (the next call computes with this step's weights) "
            f"or 1 (with the weights from before it), got {value!r}"
        )
    return int(value)  # type: ignore[call-overload]


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


class RoundPipeBase(nn.Module):
    """What RoundPipe and AutoRoundPipe share: optimizer-side parameters and the step.

    Every parameter gets a ParamAttribute with an optimizer-side copy (in `optim_dtype`,
    default the parameter's dtype). Inside a step_fn (an OptimizerCtx) `parameters()` and
    `named_parameters()` yield those copies, so any torch optimizer works.
    """

    def __init__(
        self,
        model: nn.Module,
        name: str | None = None,
        optim_dtype: torch.dtype | None = None,
        optim_grad_dtype: torch.dtype | None = None,
        step_staleness: int = 1,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be an nn.Module, got {type(model).__name__}")
        self.model = model
        object.__setattr__(self, "name", name or get_call_location(2))
        object.__setattr__(self, "original_model", None)
        object.__setattr__(self, "optim_dtype", optim_dtype)
        object.__setattr__(self, "optim_grad_dtype", optim_grad_dtype)
        object.__setattr__(self, "layer_attrs", [])
        # Which weights the call after an asynchronous step computes with: 1, those from
        # before the step (the seeds'); 0, the step's own, each layer published as the
        # optimizer finishes it (the compact mode always works so).
        object.__setattr__(self, "step_staleness", check_step_staleness(step_staleness))
        object.__setattr__(self, "optim_updated", AnnotatedEvent("optim_updated", set_=True))
        object.__setattr__(self, "_optim_ahead", False)  # optimizer copies newer than the model
        # Private switch (tests, benchmarks): False publishes the weights the optimizer
        # writes in place only when step_fn returns, not layer by layer (_LayerProgress).
        object.__setattr__(self, "_publish_as_updated", True)
        object.__setattr__(self, "_dp", None)  # DataParallel when a process group is in effect
        # This model's round robin over the devices: its own, so its jobs land on the same
        # devices whatever other models ran before it in the process (compiled kernels are
        # tuned per GPU, so the device a layer runs on can change its last bits).
        object.__setattr__(self, "_device_cursor", 0)
        # The optimizer thread's time per step, by phase (the last steps): publishing the
        # weights, folding the gradients, waiting for an overlapped call, step_fn.
        object.__setattr__(self, "step_phases", collections.deque(maxlen=64))
        track_open(self)  # closed at interpreter exit unless closed before (weakly held)

    # ---- attribute shim ----------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            for target in (self.__dict__.get("original_model"), self._modules.get("model")):
                if target is not None and hasattr(target, name):
                    return getattr(target, name)
            raise

    def _mirrors(self, name: str) -> list[nn.Module]:
        """Where a write of attribute `name` goes once initialised: the wrapped model and the
        original one (reads fall through to them), unless `name` is this wrapper's own (set
        in its __init__, or a class attribute such as a property or method)."""
        if not self.__dict__.get("_rp_initialized") or name in self.__dict__:
            return []
        if hasattr(type(self), name) or name in self._modules or name in self._parameters:
            return []
        targets = (self.__dict__.get("original_model"), self._modules.get("model"))
        return [t for t in dict.fromkeys(targets) if t is not None]

    def __setattr__(self, name: str, value: Any) -> None:
        targets = self._mirrors(name)
        if targets and not isinstance(value, (nn.Module, nn.Parameter)):
            for target in targets:
                setattr(target, name, value)
            return
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        holders = [t for t in self._mirrors(name) if hasattr(t, name)]
        if holders:
            for target in holders:
                delattr(target, name)
            return
        super().__delattr__(name)

    def set_original_model(self, original_model: nn.Module) -> None:
        """Attach the pre-wrap model so its attributes (config, ...) stay reachable."""
        object.__setattr__(self, "original_model", original_model)

    # ---- parameters ----------------------------------------------------------------------
    def _attach_param_attributes(self, layers: list[nn.Module]) -> None:
        """Give every parameter a ParamAttribute owned by the first layer using it."""
        for j, layer in enumerate(layers):
            for p in layer.parameters():
                if not ParamAttribute.has(p):
                    ParamAttribute.set(
                        p,
                        j,
                        self.optim_dtype or p.dtype,
                        self.optim_grad_dtype,
                        share_master=self.__dict__.get("optim_memory") == "compact",
                    )

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:  # type: ignore[override]
        """Model parameters; the optimizer-side copies inside a step_fn."""
        if doing_optimizer():
            return self.optim_parameters()
        # nn.Module.parameters() goes through named_parameters(), which warns here
        return (p for _, p in nn.Module.named_parameters(self, recurse=recurse))

    def named_parameters(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Named model parameters, with a warning against using them directly (the seeds'
        RoundPipeBase); the optimizer-side copies inside a step_fn."""
        if doing_optimizer():
            return self.optim_named_parameters(prefix, remove_duplicate)
        warnings.warn(
            f"{type(self).__name__}.named_parameters() outside a step_fn gives the model "
            "copy of the weights: build the optimizer from optim_parameters() (or "
            "optim_named_parameters()), and call synchronize() before reading them",
            UserWarning,
            stacklevel=2,
        )
        return super().named_parameters(prefix, recurse, remove_duplicate)

    def optim_named_parameters(
        self, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Named optimizer-side parameters (fp32 masters with optim_dtype=float32)."""
        for name, p in super().named_parameters(prefix, True, remove_duplicate):
            if ParamAttribute.has(p):
                optim = ParamAttribute.get(p).optim
                if optim is not None:
                    yield name, optim

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        """Optimizer-side parameters: build the optimizer from these."""
        for _, p in self.optim_named_parameters():
            yield p

    def _all_params(self) -> list[tuple[nn.Parameter, ParamAttribute]]:
        out = []
        for _, p in nn.Module.named_parameters(self):
            if ParamAttribute.has(p):
                out.append((p, ParamAttribute.get(p)))
        return out

    # ---- step ------------------------------------------------------------------------------
    def finish_pending(self) -> None:
        """Wait for the rest of an overlapped call (RoundPipe overlap_calls); none here."""

    def _params_by_owner(self) -> list[list[tuple[nn.Parameter, ParamAttribute]]]:
        owned: list[list[tuple[nn.Parameter, ParamAttribute]]] = [[] for _ in self.layer_attrs]
        for p, pa in self._all_params():
            owned[pa.owner_layer].append((p, pa))
        return owned

    def step(
        self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any, **kwargs: Any
    ) -> None:
        """Run `step_fn(*args, **kwargs)` on the optimizer thread.

        Asynchronous (default): return at once; the next iteration computes with the
        weights from before this step (staleness one), or, with `step_staleness=0`, with
        this step's, its upload of each layer waiting for that layer's update (layer 0
        first: docs/HOST_MEMORY_MODES.md). Synchronous: wait, so the next iteration uses
        the updated weights. An error in step_fn surfaces at the next call.
        """
        if not callable(step_fn):
            raise ConfigError(f"step_fn must be callable, got {type(step_fn).__name__}")
        check_optim_error()
        pending = self.__dict__.get("_pending_run")
        for attr in self.layer_attrs:
            if self.__dict__.get("overlap_calls"):
                attr.renew()  # the pending call keeps waiting on the step before
            else:
                attr.param_copied.clear()
                attr.grad_copied.clear()
        events = [(attr.param_copied, attr.grad_copied) for attr in self.layer_attrs]
        self.optim_updated.clear()
        # Read at the call: `step_staleness` may change between steps (the service sets it
        # on the model it wrapped).
        fresh = is_async and check_step_staleness(self.step_staleness) == 0
        launch_optim_kernel(
            self._step_kernel, step_fn, args, kwargs, not is_async, pending, events, fresh
        )
        if not is_async:
            synchronize_optim()

    def _step_kernel(
        self,
        step_fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        sync: bool,
        pending: RunState | None,
        events: list[tuple[Any, Any]],
        fresh: bool = False,
    ) -> None:
        """On the optimizer thread: publish w[k], take the gradients, then update.

        `pending`: the call whose backward may still run (overlapped calls): each layer is
        published once that call's uploads of it are done, each gradient taken once it is
        downloaded. `events`: this step's (param_copied, grad_copied) per layer.
        `fresh` (step_staleness=0): publish each layer as the optimizer reports it updated.
        """
        # "swapped": parameters published by swapping in the copy the optimizer wrote;
        # "early_layers": layers published while step_fn ran, "first_layer_s" after how
        # long the first (weights the optimizer writes in place, _LayerProgress);
        # "folded_ahead": gradients whose fold was done while the backward ran
        # (engine.fold_ahead), leaving "fold_s" next to nothing; "deferred": gradients
        # handed over as deferred copies (engine.optim._deferred), nothing to copy.
        phases = {
            "publish_s": 0.0,
            "fold_s": 0.0,
            "wait_s": 0.0,
            "step_fn_s": 0.0,
            "swapped": 0.0,
            "early_layers": 0.0,
            "first_layer_s": 0.0,
            "folded_ahead": 0.0,
            "deferred": 0.0,
        }
        start = time.perf_counter()
        # _LayerProgress, or data parallel's PublishAsUpdated
        progress: Any = None
        groups: list[list[tuple[nn.Parameter, ParamAttribute]]] = []
        try:
            if self._dp is not None:
                self._dp.publish_weights_take_grads(self, hold_weights=fresh)
                if fresh and self._publish_as_updated:
                    progress = self._dp.progress(self)
            else:
                published = self._optim_ahead
                groups = self._params_by_owner()
                publish_weights_take_grads(self, groups, pending, events, phases, hold=fresh)
                if self._publish_as_updated:
                    progress = _LayerProgress.of(
                        groups,
                        events,
                        publish=fresh,
                        pending=pending,
                        users=self.__dict__.get("_owner_users"),
                    )
                if published and self.__dict__.get("second_copy_bytes") and not phases["swapped"]:
                    _warn_once(
                        f"second-copy:{id(self)}",
                        f"{self.name}: double_buffer_weights is on but the step function's "
                        "optimizer did not write the second weight copy (engine.optim.Adam "
                        "does), so each step converts the weights as without it; pass "
                        "double_buffer_weights=False to save its host memory",
                    )
            try:
                t0 = time.perf_counter()
                with OptimizerCtx(progress):
                    step_fn(*args, **kwargs)
                phases["step_fn_s"] = time.perf_counter() - t0
                if progress is not None:
                    progress.report(self.name, phases, t0)
            finally:
                # Also after a failed step_fn: it may have updated some master weights
                # before raising, and the model must not drift from them.
                object.__setattr__(self, "_optim_ahead", True)
            if sync:
                self.sync_optim_param()
            elif fresh:
                self._publish_rest(groups, events, progress, pending, phases)
        finally:
            try:
                settle_grads(groups)  # before grad_copied lets the next downloads in
            finally:
                for param_copied, grad_copied in events:
                    param_copied.set()
                    grad_copied.set()
                self.optim_updated.set()
                phases["total_s"] = time.perf_counter() - start
                self.step_phases.append(phases)

    def _publish_rest(
        self,
        groups: list[list[tuple[nn.Parameter, ParamAttribute]]],
        events: list[tuple[Any, Any]],
        progress: _LayerProgress | None,
        pending: RunState | None,
        phases: dict[str, float],
    ) -> None:
        """After step_fn (staleness zero): publish, layer 0 first, the layers the optimizer
        did not report (torch's optimizers report none), each released as it lands."""
        if self._dp is not None:
            self._dp.publish_in_order(self, progress)
            return
        clock = _PhaseClock(phases)
        users = self.__dict__.get("_owner_users")
        for j, params in enumerate(groups):
            if progress is not None and progress.published(j):
                continue
            if pending is not None and users is not None:
                with clock("wait_s"):
                    pending.wait_uploads(users[j])
            with clock("publish_s"):
                for p, pa in params:
                    publish_param(p, pa)
            events[j][0].set()
        object.__setattr__(self, "_optim_ahead", False)

    def sync_optim_param(self) -> None:
        """Copy the optimizer-side weights into the model parameters (if newer)."""
        if self._dp is not None:
            self._dp.sync_optim_param(self)
            return
        if not self._optim_ahead:
            return
        for p, pa in self._all_params():
            publish_param(p, pa)
        object.__setattr__(self, "_optim_ahead", False)

    def synchronize(self) -> None:
        """Wait for every step; then the model's parameters hold the latest weights and
        `.grad` the gradients accumulated since the optimizer last zeroed them (under
        data parallel: summed over ranks; a collective, every rank calls it)."""
        self.finish_pending()
        if self._dp is not None:
            self._dp.synchronize(self)
            return
        synchronize_optim()
        self.sync_optim_param()
        for p, pa in self._all_params():
            pa.fold_grad()
            if pa.optim is not None and pa.optim.grad is not None:
                p.grad = pa.optim.grad.detach().to(p.dtype, copy=True)
            else:
                p.grad = None

    def save_adapter(self, path: str | os.PathLike[str], *, merged_path: Any = None) -> None:
        """Write the LoRA adapters in peft's format (see
        `engine.adapters.peft_format.save_adapter`); `merged_path`: also the model with the
        adapters folded in, HF format."""
        save_adapter(self, path, merged_path=merged_path)

    def rp_unwrap(self) -> tuple[nn.Module, nn.Module]:
        """(the module this wrapper runs, the user's model behind it): how code the wrappers
        import (engine.adapters) looks through one without importing them."""
        return self.model, self.original_model or self.model

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: pending host gradients, optimizer-side and model `.grad`."""
        self.finish_pending()
        synchronize_optim()
        for p, pa in self._all_params():
            pa.grad_pending = False
            pa.folded_ahead = None
            if pa.optim is not None:
                pa.optim.grad = None
            p.grad = None

    # ---- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the queued steps, then stop what this model owns; a second call does nothing.

        Under data parallel the engine's own process groups are destroyed and their worker
        threads joined (engine.parallel.data_parallel: DataParallel.close), so nothing of
        the engine outlives the user's process group. The optimizer and device threads,
        shared by every model, stop when no open model is left (a later model starts
        them again). It publishes nothing: call `synchronize()` first to read the latest
        weights and `.grad`. Runs by itself at interpreter exit; `with RoundPipe(...) as
        rp:` closes at the block's end.
        """
        from .device import reset_devices
        from .optim_stream import shutdown_optim
        from .threads import any_open, mark_closed

        if not mark_closed(self):
            return
        try:
            self.finish_pending()
            synchronize_optim()  # the queued steps' collectives end on every rank
        finally:
            for sub in self.__dict__.get("_subs", ()):
                sub.close()
            if self._dp is not None:
                self._dp.close()
            if not any_open():
                shutdown_optim()
                reset_devices()

    def __enter__(self) -> RoundPipeBase:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _PhaseClock:
    """`with clock(name):` adds the block's seconds to `phases[name]` (no-op without)."""

    def __init__(self, phases: dict[str, float] | None) -> None:
        self.phases = phases

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.phases is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start


class _LayerProgress:
    """The StepProgress (engine.context) of a step whose next call computes with its
    weights: those the optimizer writes in place (optim_memory='compact'), or, with
    `publish` (step_staleness=0), every trainable one, published into the model as its
    layer's last weight is reported. A layer's param_copied is set once the optimizer
    reports every such weight the layer owns updated, so the next call's uploads of the
    first layers start while the optimizer updates the later ones.

    A layer's uploads wait on the event of the owner of each parameter they read, so a
    tied weight counts once, for its owner, and guards every layer that uses it. The
    gradients stay the optimizer's until step_fn returns (grad_copied: a step_fn's
    zero_grad() after the step decides whether the next download adds to them).
    """

    def __init__(
        self,
        layer_of: dict[int, int],
        left: list[int],
        events: list[Any],
        groups: list[list[tuple[nn.Parameter, ParamAttribute]]] | None = None,
        pending: RunState | None = None,
        users: list[list[int]] | None = None,
    ) -> None:
        self._layer_of = layer_of  # id(optimizer-side parameter) -> owner layer
        self._left = left  # per layer, its weights not reported yet
        self._events = events  # per layer, param_copied
        self._groups = groups  # per layer, what to publish into the model (None: nothing)
        self._pending = pending  # an overlapped call still uploading the old weights
        self._users = users  # per owner layer, the layers that read its weights
        self._done = [False] * len(left)
        self.publish_s = 0.0
        self._reported: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (param, version)
        self._again = False  # a parameter was reported twice
        self._lock = threading.Lock()
        self._first_s: float | None = None
        self.early = 0  # layers published so far

    @classmethod
    def of(
        cls,
        groups: list[list[tuple[nn.Parameter, ParamAttribute]]],
        events: list[tuple[Any, Any]],
        *,
        publish: bool = False,
        pending: RunState | None = None,
        users: list[list[int]] | None = None,
    ) -> _LayerProgress | None:
        """The progress of this step, or None when the next call waits for no weight
        (every layer was published before step_fn). `publish`: also publish each layer's
        updated masters into the model (step_staleness=0), after `pending`'s uploads of
        the layers reading them (`users`)."""
        layer_of: dict[int, int] = {}
        left = [0] * len(groups)
        for j, params in enumerate(groups):
            for _, pa in params:
                if _held(pa, publish):
                    assert pa.optim is not None
                    layer_of[id(pa.optim)] = j
                    left[j] += 1
        if not layer_of:
            return None
        return cls(
            layer_of,
            left,
            [param_copied for param_copied, _ in events],
            groups if publish else None,
            pending,
            users,
        )

    def published(self, j: int) -> bool:
        """Whether layer `j`'s weights went out while step_fn ran."""
        return self._done[j]

    def order(self, param: torch.Tensor) -> int:
        """The owner layer; after every layer for a parameter not the model's."""
        return self._layer_of.get(id(param), len(self._left))

    def updated(self, param: torch.Tensor) -> None:
        """Count `param` done; set its owner's param_copied when it was the last one."""
        j = self._layer_of.get(id(param))
        if j is None:
            return
        with self._lock:
            if id(param) in self._reported:
                self._again = True
                return
            self._reported[id(param)] = (param, param._version)
            self._left[j] -= 1
            if self._left[j]:
                return
            self.early += 1
            if self._first_s is None:
                self._first_s = time.perf_counter()
        if self._groups is not None:
            t0 = time.perf_counter()
            if self._pending is not None and self._users is not None:
                self._pending.wait_uploads(self._users[j])
            for p, pa in self._groups[j]:
                publish_param(p, pa)
            self.publish_s += time.perf_counter() - t0
        self._done[j] = True
        self._events[j].set()

    def report(self, name: str, phases: dict[str, float], start: float) -> None:
        """Put the early publishing into `phases` and warn if step_fn broke its promise:
        it wrote a weight after reporting it updated (in-place torch ops bump a tensor's
        version counter; the C Adam's writes do not, nor do they need to)."""
        phases["early_layers"] = float(self.early)
        phases["publish_s"] = phases.get("publish_s", 0.0) + self.publish_s
        if self._first_s is not None:
            phases["first_layer_s"] = self._first_s - start
        if self._again or any(p._version != v for p, v in self._reported.values()):
            _warn_once(
                f"written-after-update:{name}",
                f"{name}: the step function changed weights after its optimizer reported "
                "them updated (optim_memory='compact' or step_staleness=0); the next call may have uploaded "
                "them mid-change. Change weights before the optimizer's step, and step "
                "each parameter once per step function",
            )


def _held(pa: ParamAttribute, publish: bool) -> bool:
    """Whether the next call's upload of this weight waits for this step's update of it:
    written in place (compact), or trainable when the step publishes updates (`publish`)."""
    return pa.optim is not None and (pa.master_shared or publish)


def publish_weights_take_grads(
    owner: RoundPipeBase,
    groups: list[list[tuple[nn.Parameter, ParamAttribute]]],
    pending: RunState | None = None,
    events: list[tuple[Any, Any]] | None = None,
    phases: dict[str, float] | None = None,
    *,
    hold: bool = False,
) -> None:
    """On the optimizer thread, per layer and in layer order: publish the weights of the
    previous step into the model (if newer), then fold the new gradients into the
    optimizer-side ones, setting each layer's event as soon as its part is done.
    `hold` (step_staleness=0): a layer with trainable weights keeps its param_copied
    clear: the next call waits for this step's update of them.

    With a `pending` call still running (overlapped calls), a layer is published once
    that call's uploads of the layers using its parameters are done, and the gradients are
    taken from the last layer down (the order the backward downloads them), each once it
    is down. `phases` gets the seconds spent publishing, folding and waiting.
    """
    clock = _PhaseClock(phases)
    users = owner.__dict__.get("_owner_users")
    if events is None:
        events = [(attr.param_copied, attr.grad_copied) for attr in owner.layer_attrs]
    for j, ((param_copied, _), params) in enumerate(zip(events, groups, strict=True)):
        if owner._optim_ahead:
            if pending is not None and users is not None:
                with clock("wait_s"):
                    pending.wait_uploads(users[j])
            with clock("publish_s"):
                swapped = sum(publish_param(p, pa) for p, pa in params)
            if phases is not None:
                phases["swapped"] = phases.get("swapped", 0.0) + swapped
        # Weights the optimizer writes in place (optim_memory='compact'), or any trainable
        # one with `hold`: the event waits for their update (_LayerProgress, or the
        # caller once step_fn has returned).
        if not any(_held(pa, hold) for _, pa in params):
            param_copied.set()
    object.__setattr__(owner, "_optim_ahead", False)
    order = list(zip(events, groups, strict=True))
    if pending is not None:
        order.reverse()
    for (_, grad_copied), params in order:
        in_place = False
        for p, pa in params:
            if pending is not None and pa.optim is not None:
                with clock("wait_s"):
                    pending.wait_grads(p)
            with clock("fold_s"):
                taken = pa.fold_grad(defer=True)
            deferred = pa.optim is not None and _deferred.deferred(pa.optim) is not None
            in_place = in_place or pa.grad_in_place or deferred
            if phases is not None:
                # "folded_ahead": copied while the backward ran (fold_ahead); "deferred":
                # handed over uncopied, engine.optim.Adam reads the download itself
                for key, counts in (("folded_ahead", taken), ("deferred", deferred)):
                    if counts:
                        phases[key] = phases.get(key, 0.0) + 1
        # A download buffer the optimizer reads (in place, or deferred) stays the
        # optimizer's until step_fn returns: the caller settles the deferred copies then,
        # and sets every event.
        if not in_place:
            grad_copied.set()


def settle_grads(groups: list[list[tuple[nn.Parameter, ParamAttribute]]]) -> None:
    """Once step_fn has returned: copy what it kept of the gradients the step handed over
    deferred (ParamAttribute.settle_grad), before the next downloads may overwrite them."""
    for params in groups:
        for _, pa in params:
            pa.settle_grad()
