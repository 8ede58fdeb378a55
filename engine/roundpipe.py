"""RoundPipe and AutoRoundPipe: the model wrappers users train with."""

from __future__ import annotations

import bisect
import collections
import contextlib
import inspect
import logging
import os
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .accel import graphs
from .accel.weight_buffers import attach_second_copies, publish_param
from .attribute import LayerAttribute, ParamAttribute
from .batch import (
    RoundPipePackedData,
    TensorChunkSpec,
    _Replicate,
    guess_split_spec,
    merge_outputs,
    split_args_kwargs,
    split_label,
)
from .context import OptimizerCtx, doing_optimizer
from .device import DeviceManager, get_devices, get_next_device, get_num_devices
from .errors import ConfigError, GradientsDisabledError
from .memory import get_model_size, pin_module
from .optim_stream import check_optim_error, launch_optim_kernel, synchronize_optim
from .parallel.data_parallel import AUTO_GROUP, attach_data_parallel, resolve_process_group
from .planning import one_device
from .planning.memory_plan import check_engine_allocation
from .run import Act, RunState, backward_job, forward_job, fused_job
from .run_config import FullRoundPipeRunConfig, RoundPipeRunConfig
from .scheduler import ModelExecutePlan, RunType, group_param_cap, publish_wait_ms_per_gb
from .threads import AnnotatedEvent
from .timer import ModelTimer
from .transfer import LayerReplica, UploadedGroup, make_replica, upload_layers

__all__ = ["AutoRoundPipe", "RoundPipe", "RoundPipeBase", "get_call_location"]

log = logging.getLogger(__name__)

# After how many timed iterations the automatic plan is made again (ModelTimer.updates).
_REPLAN_AFTER_UPDATES = (1, 3, 10)

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def get_call_location(depth: int) -> str:
    """'file:line' of the frame `depth` levels above the caller of this function."""
    frame = inspect.currentframe()
    try:
        for _ in range(depth + 1):
            if frame is None or frame.f_back is None:
                break
            frame = frame.f_back
        if frame is None:
            return "<unknown>"
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    finally:
        del frame


def _default_loss(outputs: Any, labels: Any) -> Any:
    return outputs


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
        object.__setattr__(self, "optim_updated", AnnotatedEvent("optim_updated", set_=True))
        object.__setattr__(self, "_optim_ahead", False)  # optimizer copies newer than the model
        object.__setattr__(self, "_dp", None)  # DataParallel when a process group is in effect
        # The optimizer thread's time per step, by phase (the last steps): publishing the
        # weights, folding the gradients, waiting for an overlapped call, step_fn.
        object.__setattr__(self, "step_phases", collections.deque(maxlen=64))

    # ---- attribute shim ----------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            for target in (self.__dict__.get("original_model"), self._modules.get("model")):
                if target is not None and hasattr(target, name):
                    return getattr(target, name)
            raise

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_rp_initialized") and name not in self.__dict__:
            orig = self.__dict__.get("original_model")
            if (
                orig is not None
                and not isinstance(value, (nn.Module, nn.Parameter))
                and hasattr(orig, name)
            ):
                setattr(orig, name, value)
                return
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        orig = self.__dict__.get("original_model")
        if self.__dict__.get("_rp_initialized") and orig is not None and hasattr(orig, name):
            delattr(orig, name)
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
                    ParamAttribute.set(p, j, self.optim_dtype or p.dtype, self.optim_grad_dtype)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:  # type: ignore[override]
        """Model parameters; the optimizer-side copies inside a step_fn."""
        if doing_optimizer():
            return self.optim_parameters()
        return super().parameters(recurse)

    def named_parameters(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Named model parameters; the optimizer-side copies inside a step_fn."""
        if doing_optimizer():
            return self.optim_named_parameters(prefix, remove_duplicate)
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
        for p in super().parameters(True):
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
        weights from before this step (staleness one). Synchronous: wait, so the next
        iteration uses the updated weights. An error in step_fn surfaces at the next call.
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
        launch_optim_kernel(self._step_kernel, step_fn, args, kwargs, not is_async, pending, events)
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
    ) -> None:
        """On the optimizer thread: publish w[k], take the gradients, then update.

        `pending`: the call whose backward may still run (overlapped calls): each layer is
        published once that call's uploads of it are done, each gradient taken once it is
        downloaded. `events`: this step's (param_copied, grad_copied) per layer.
        """
        # "swapped": parameters published by swapping in the copy the optimizer wrote.
        phases = {"publish_s": 0.0, "fold_s": 0.0, "wait_s": 0.0, "step_fn_s": 0.0, "swapped": 0.0}
        start = time.perf_counter()
        try:
            if self._dp is not None:
                self._dp.publish_weights_take_grads(self)
            else:
                published = self._optim_ahead
                _publish_weights_take_grads(self, self._params_by_owner(), pending, events, phases)
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
                with OptimizerCtx():
                    step_fn(*args, **kwargs)
                phases["step_fn_s"] = time.perf_counter() - t0
            finally:
                # Also after a failed step_fn: it may have updated some master weights
                # before raising, and the model must not drift from them.
                object.__setattr__(self, "_optim_ahead", True)
            if sync:
                self.sync_optim_param()
        finally:
            for param_copied, grad_copied in events:
                param_copied.set()
                grad_copied.set()
            self.optim_updated.set()
            phases["total_s"] = time.perf_counter() - start
            self.step_phases.append(phases)

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
        """Write the LoRA adapters in peft's format (see `engine.adapters.lora.save_adapter`);
        `merged_path`: also the model with the adapters folded in, HF format."""
        from .adapters.lora import save_adapter

        save_adapter(self, path, merged_path=merged_path)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: pending host gradients, optimizer-side and model `.grad`."""
        self.finish_pending()
        synchronize_optim()
        for p, pa in self._all_params():
            pa.grad_pending = False
            if pa.optim is not None:
                pa.optim.grad = None
            p.grad = None


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


def _owner_users(
    layer_params: list[list[tuple[nn.Parameter, ParamAttribute]]],
) -> list[set[int]]:
    """Per owner layer, the layers that use a parameter it owns (tied weights: the
    embedding's owner is used by the head too)."""
    users: list[set[int]] = [set() for _ in layer_params]
    for j, params in enumerate(layer_params):
        for _, pa in params:
            users[pa.owner_layer].add(j)
    return users


def _replayable_layers(
    layers: list[nn.Module], layer_params: list[list[tuple[nn.Parameter, ParamAttribute]]]
) -> list[bool]:
    """Per layer, whether it may replay (engine.accel.graphs): it opts in and shares no parameter
    with another layer (a slot holds one layer's own tensors)."""
    uses: dict[int, int] = {}
    for params in layer_params:
        for p, _ in params:
            uses[id(p)] = uses.get(id(p), 0) + 1
    return [
        graphs.layer_may_replay(layer) and all(uses[id(p)] == 1 for p, _ in params)
        for layer, params in zip(layers, layer_params, strict=True)
    ]


def _publish_weights_take_grads(
    owner: RoundPipeBase,
    groups: list[list[tuple[nn.Parameter, ParamAttribute]]],
    pending: RunState | None = None,
    events: list[tuple[Any, Any]] | None = None,
    phases: dict[str, float] | None = None,
) -> None:
    """On the optimizer thread, per layer and in layer order: publish the weights of the
    previous step into the model (if newer), then fold the new gradients into the
    optimizer-side ones, setting each layer's event as soon as its part is done.

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
        param_copied.set()
    object.__setattr__(owner, "_optim_ahead", False)
    order = list(zip(events, groups, strict=True))
    if pending is not None:
        order.reverse()
    for (_, grad_copied), params in order:
        for p, pa in params:
            if pending is not None and pa.optim is not None:
                with clock("wait_s"):
                    pending.wait_grads(p)
            with clock("fold_s"):
                pa.fold_grad()
        # A gradient read in place stays the optimizer's until step_fn returns (the
        # caller sets every event then).
        if not any(pa.grad_in_place for _, pa in params):
            grad_copied.set()


class RoundPipe(RoundPipeBase):
    """Runs an nn.Sequential (or any module, as one layer) with layers streamed from host memory.

    Args:
        model: The module; an nn.Sequential's children are the layers.
        optim_dtype: dtype of the optimizer-side weights (e.g. torch.float32 for an fp16
            model). Default: the parameters' dtype.
        name: A name for traces and logs. Default: the caller's file:line.
        model_run_config: Defaults for every call.
        pin_model: 'alloc' (torch pinned memory, fastest transfers), 'register'
            (cudaHostRegister in place, less host memory, CUDA only), 'arena' (one
            cudaHostRegister'ed block holding the parameters and their host gradient
            buffers: no power-of-two rounding per tensor) or 'off'.
        process_group: Data parallel over this torch.distributed group (engine.parallel.data_parallel).
            Default: the default group when one is initialised with several ranks; None:
            single-process even then.
        shard_optimizer: Under data parallel, keep the fp32 masters (and so the optimizer
            state) of this rank's shard only (ZeRO stage 1); False: every rank keeps all.
        optim_grad_dtype: dtype of the gradients the optimizer-side parameters get.
            Default: `optim_dtype` (a separate buffer the downloaded gradient is folded
            into). The model's dtype: the optimizer reads the downloaded half-precision
            gradient in place (4 bytes per parameter less with fp32 masters); the next
            iteration's gradient downloads then wait for the whole step. Needs an
            optimizer that takes such gradients (engine.optim.Adam does).
        host_memory_budget: Bytes the engine's own host allocations (pinned model,
            gradient buffers, optimizer-side copies) may take; over it, construction
            raises HostMemoryError before allocating. Default: RP_HOST_MEMORY_BUDGET, or
            the machine's available memory less a margin (engine.planning.memory_plan).
        overlap_calls: `forward_backward` returns once its losses are on the host, and its
            backward jobs finish while the next call's forward jobs start (one call's
            drain overlaps the next call's fill: what several GPUs lose at every call's
            ends). The step publishes a layer's new weights once the call's uploads of it
            are done and takes each gradient once it is down, so results are those of the
            calls one after the other. Until `synchronize()` (or the next call), `.grad`
            and the call's backward errors are not there yet. Calls whose inputs need
            gradients, and data parallel, run as without it.
        double_buffer_weights: Keep a second host copy of the half-precision weights that
            engine.optim.Adam writes in its update pass; the next step publishes by
            swapping the two instead of converting the fp32 masters (engine.accel.weight_buffers:
            the optimizer thread's publish goes from a pass over the model to nothing).
            Costs the model's trainable bytes again in host memory (2 per parameter).
            Default: on with `overlap_calls`, whose steps publish while a call runs.
            Other optimizers work as without it; data parallel ignores it.
    """

    def __init__(
        self,
        model: nn.Module,
        optim_dtype: torch.dtype | None = None,
        name: str | None = None,
        model_run_config: RoundPipeRunConfig = RoundPipeRunConfig(),
        pin_model: str = "alloc",
        process_group: Any = AUTO_GROUP,
        shard_optimizer: bool = True,
        *,
        optim_grad_dtype: torch.dtype | None = None,
        host_memory_budget: int | None = None,
        overlap_calls: bool = False,
        double_buffer_weights: bool | None = None,
    ) -> None:
        if pin_model not in ("alloc", "register", "arena", "off"):
            raise ConfigError(
                f"pin_model must be 'alloc', 'register', 'arena' or 'off', got {pin_model!r}"
            )
        if pin_model == "register" and not torch.cuda.is_available():
            raise ConfigError(
                "pin_model='register' uses cudaHostRegister and needs CUDA; "
                "use pin_model='alloc' or 'off' without a GPU"
            )
        if not isinstance(model_run_config, RoundPipeRunConfig):
            raise ConfigError("model_run_config must be a RoundPipeRunConfig")
        super().__init__(
            model,
            name=name or get_call_location(1),
            optim_dtype=optim_dtype,
            optim_grad_dtype=optim_grad_dtype,
        )
        get_devices()  # parse RP_DEVICES now: a bad value fails at construction
        if any(t.device.type != "cpu" for t in [*model.parameters(), *model.buffers()]):
            model.to("cpu")
        layers = list(model.children()) if isinstance(model, nn.Sequential) else [model]
        if not layers:
            raise ConfigError("model is an empty nn.Sequential; give it at least one layer")
        if double_buffer_weights is None:
            double_buffer_weights = overlap_calls
        check_engine_allocation(
            model,
            optim_dtype=optim_dtype,
            optim_grad_dtype=optim_grad_dtype,
            pin_model=pin_model,
            budget_bytes=host_memory_budget,
            double_buffer_weights=bool(double_buffer_weights),
        )
        arena_grads = pin_module(model, pin_model)
        object.__setattr__(self, "model_run_config", model_run_config)
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "num_layers", len(layers))
        object.__setattr__(self, "layer_attrs", [LayerAttribute(i) for i in range(len(layers))])
        object.__setattr__(self, "layer_size", [get_model_size(layer) / 1e9 for layer in layers])
        object.__setattr__(self, "model_timer", ModelTimer([s * 1e9 for s in self.layer_size]))
        object.__setattr__(self, "activation_meter", one_device.ActivationMeter(len(layers)))
        self._attach_param_attributes(layers)
        for p, pa in self._all_params():
            if id(p) in arena_grads:
                pa.grad_host = arena_grads[id(p)]
        layer_params: list[list[tuple[nn.Parameter, ParamAttribute]]] = []
        for layer in layers:
            seen: set[int] = set()
            lp = []
            for p in layer.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    lp.append((p, ParamAttribute.get(p)))
            layer_params.append(lp)
        object.__setattr__(self, "layer_params", layer_params)
        object.__setattr__(self, "_may_replay", _replayable_layers(layers, layer_params))
        object.__setattr__(self, "_owner_users", _owner_users(layer_params))
        object.__setattr__(self, "overlap_calls", bool(overlap_calls))
        object.__setattr__(self, "_pending_run", None)
        object.__setattr__(self, "_replay_wanted", True)
        object.__setattr__(self, "_replicas", {})
        object.__setattr__(self, "_replica_lock", threading.Lock())
        object.__setattr__(self, "_plans", {})
        dp = attach_data_parallel(self, process_group, shard_optimizer=shard_optimizer)
        object.__setattr__(self, "_dp", dp)
        second = 0
        if double_buffer_weights and dp is None:
            second = attach_second_copies(self._all_params(), pinned=pin_model != "off")
        object.__setattr__(self, "second_copy_bytes", second)
        object.__setattr__(self, "_rp_initialized", True)

    # ---- device-side copies --------------------------------------------------------------
    def _replica(self, dev: DeviceManager, layer_id: int) -> LayerReplica:
        key = (dev.id, layer_id)
        rep = self._replicas.get(key)
        if rep is None:
            with self._replica_lock:
                rep = self._replicas.get(key)
                if rep is None:
                    rep = make_replica(self.layers[layer_id])
                    self._replicas[key] = rep
        return rep

    def upload_group(
        self,
        dev: DeviceManager,
        layer_ids: range,
        run: RunState,
        saved_buffers: dict[int, torch.Tensor] | None = None,
        *,
        slots: bool = False,
        slot_grads: bool = False,
    ) -> UploadedGroup:
        """Upload a layer group to `dev` once the optimizer has published its weights.

        With `slots`, layers that may replay (engine.accel.graphs) go into the device's slots;
        `slot_grads`: their .grad are the slots' zeroed gradient buffers (backward jobs).
        """
        owners = sorted({pa.owner_layer for j in layer_ids for _, pa in self.layer_params[j]})
        for o in owners:
            run.wait(run.param_copied[o])
        replicas = [self._replica(dev, j) for j in layer_ids]
        replayer = graphs.replayer(dev) if slots and self._replay_wanted else None
        slot_list = (
            replayer.acquire(replicas, [self._may_replay[j] for j in layer_ids])
            if replayer is not None
            else None
        )
        group = upload_layers(
            dev,
            replicas,
            layer_ids,
            saved_buffers=saved_buffers,
            slots=slot_list,
            slot_grads=slot_grads,
        )
        run.note_upload(layer_ids, group.uploaded)
        return group

    def publish_ms_per_gb(self) -> float | None:
        """Milliseconds the step took to publish a GB of weights (median of the last steps),
        plus their upload at 50 GB/s: what an overlapped call's first job waits per GB of
        its layers (ModelExecutePlan.auto). None before a step has published."""
        times = [p["publish_s"] for p in self.step_phases if p.get("publish_s")]
        total_gb = sum(self.layer_size)
        if not times or total_gb <= 0:
            return None
        return publish_wait_ms_per_gb(statistics.median(times), total_gb)

    def finish_pending(self) -> None:
        """Wait for the rest of an overlapped call (its backward jobs); raise its error."""
        run = self.__dict__.get("_pending_run")
        if run is None:
            return
        object.__setattr__(self, "_pending_run", None)
        run.join()
        self.model_timer.update_times()

    def stop_replay(self) -> None:
        """Run this model's layers as they are from now on (a state over
        engine.accel.graphs.REPLAY_MAX_TOKENS was seen), and give the slots' memory back."""
        if self._replay_wanted:
            object.__setattr__(self, "_replay_wanted", False)
            log.info(
                "%s: micro-batches over the replay limit; layers run without replay", self.name
            )
            graphs.drop_all_slots()

    # ---- planning ---------------------------------------------------------------------------
    def _plan(self, run_type: RunType, cfg: FullRoundPipeRunConfig) -> ModelExecutePlan:
        if cfg.execute_plan is not None:
            cfg.execute_plan.check_valid(self.num_layers, run_type)
            return cfg.execute_plan
        updates = self.model_timer.updates
        # Re-planned after the 1st, 3rd and 10th timed iteration: by the 10th, the moving
        # average has forgotten the early iterations (host allocations, cold caches).
        maturity = bisect.bisect_right(_REPLAN_AFTER_UPDATES, updates)
        overlap = self.overlap_calls and run_type == "fused"
        key = (run_type, get_num_devices(), maturity, cfg.num_microbatch, overlap)
        plan = self._plans.get(key)
        if plan is None:
            single = _one_cuda_device()
            plan = ModelExecutePlan.auto(
                run_type,
                self,
                num_microbatch=cfg.num_microbatch,
                overlap=overlap,
                by_size=single and one_device.GROUP_BY_SIZE,
            )
            # recompute_grain 'layer' asks for one layer's activations at a time: the tail
            # stays as planned then.
            if run_type == "fused" and single and cfg.recompute_grain == "stage":
                plan = self._widen_tail(plan)
            self._plans[key] = plan
            log.debug("%s: %s plan %s", self.name, run_type, plan)
        return plan

    def _widen_tail(self, plan: ModelExecutePlan) -> ModelExecutePlan:
        """On one GPU, the automatic fused plan with the top backward group's layers moved
        into the tail as far as their measured activations fit (engine.planning.one_device)."""
        if not one_device.WIDEN_TAIL:
            return plan
        device = get_devices()[0].device
        widened = one_device.widen_tail(
            plan,
            self.activation_meter,
            self.layer_size,
            one_device.DeviceRoom.of(device),
            group_param_cap(),  # auto's default cap per group
        )
        if widened is not plan:
            log.info("%s: one GPU, fused tail widened: %s", self.name, widened)
        return widened

    def _meter_for_call(self) -> one_device.ActivationMeter | None:
        """The activation meter, for the first calls on one GPU (None otherwise)."""
        devices = get_devices()
        meter = self.activation_meter
        if not meter.wanted(devices[0].device, len(devices)):
            return None
        meter.calls += 1
        return meter

    # ---- inputs ------------------------------------------------------------------------------
    def _split_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], cfg: FullRoundPipeRunConfig
    ) -> tuple[list[Act], list[bool], int | None, list[Any] | None]:
        """Micro-batches of the arguments, per-leaf requires_grad, batch size, chunk specs."""
        if len(args) == 1 and not kwargs and isinstance(args[0], RoundPipePackedData):
            packed = args[0]
            packed.synchronize()
            rows = [((x,), {}) for x in packed]
            specs = None
            batch = None
        else:
            rows, batch = split_args_kwargs(args, kwargs, cfg.num_microbatch, cfg.split_input)
            specs = None
            if not callable(cfg.split_input) or isinstance(cfg.split_input, (tuple, list)):
                if cfg.split_input is None:
                    spec_tree, _ = guess_split_spec((args, kwargs))
                else:
                    spec_tree = cfg.split_input
                specs = pytree.tree_flatten(spec_tree)[0]
        acts = []
        flags: list[bool] = []
        for k, row in enumerate(rows):
            leaves, tree = pytree.tree_flatten(row)
            acts.append(Act(leaves, tree, None, is_args=True))
            if k == 0:
                flags = [isinstance(t, torch.Tensor) and t.requires_grad for t in leaves]
        return acts, flags, batch, specs

    # ---- forward ---------------------------------------------------------------------------------
    def forward(
        self,
        *args: Any,
        roundpipe_run_config: RoundPipeRunConfig = RoundPipeRunConfig(),
        **kwargs: Any,
    ) -> Any:
        """Run the model over micro-batches; the output supports `.backward()` when grads are on.

        Raises:
            RuntimeError: requires_grad=True was asked for while gradients are disabled.
        """
        self.finish_pending()
        check_optim_error()
        if not isinstance(roundpipe_run_config, RoundPipeRunConfig):
            raise ConfigError("roundpipe_run_config must be a RoundPipeRunConfig")
        if roundpipe_run_config.requires_grad and not torch.is_grad_enabled():
            raise GradientsDisabledError(
                "run_config.requires_grad=True but gradients are disabled (torch.no_grad()); "
                "enable them or drop requires_grad"
            )
        cfg = FullRoundPipeRunConfig(
            roundpipe_run_config, self.model_run_config, num_devices=get_num_devices()
        )
        acts, flags, _, specs = self._split_inputs(args, kwargs, cfg)
        wants_grad = (
            cfg.requires_grad
            and torch.is_grad_enabled()
            and (any(p.requires_grad for p, _ in self._all_params()) or any(flags))
        )
        if wants_grad and cfg.output_fn is not None:
            raise ConfigError(
                "run_config.output_fn is for forwards without gradients; run this forward "
                "under torch.no_grad() or with requires_grad=False"
            )
        run_type: RunType = "train" if wants_grad else "infer"
        plan = self._plan(run_type, cfg)
        run = RunState(self, cfg, plan, run_type, acts, flags)
        for g in range(len(plan.fwd_plan)):
            run.launch(get_next_device(), forward_job, g, name=f"fwd{g}")
        run.join()
        self.model_timer.update_times()
        synchronize_optim()
        outputs = [a.rebuild(a.leaves) for a in run.outputs if a is not None]
        if cfg.merge_output is False:
            return RoundPipePackedData(outputs)
        merged = merge_outputs(outputs, cfg.merge_output)
        if wants_grad:
            merged = _attach_backward(self, run, merged, outputs, args, kwargs, specs, cfg)
        return _to_device(merged, cfg.output_device)

    def _run_backward(self, run: RunState) -> None:
        """Backward of a 'train' run, once autograd delivers the output gradients."""
        if run.backward_done:
            raise RuntimeError("RoundPipe does not support backward twice through the same forward")
        run.backward_done = True
        check_optim_error()
        for b, layer_ids in enumerate(run.plan.bwd_plan):
            run.claim_grads(run.backward_job_index(b), layer_ids)
        run.jobs = []
        for b in range(len(run.plan.bwd_plan)):
            run.launch(get_next_device(), backward_job, b, name=f"bwd{b}")
        run.join()
        self.model_timer.update_times()

    def forward_backward(
        self,
        input_args: tuple[Any, ...] = (),
        input_kwargs: dict[str, Any] | None = None,
        label: Any = None,
        loss_fn: Callable[[Any, Any], Any] = _default_loss,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig = RoundPipeRunConfig(),
    ) -> Any:
        """Forward and backward over every micro-batch, fused so stages interleave.

        `loss_fn(outputs, label)` runs on the device per micro-batch and is backpropagated;
        returns the sum of the losses over micro-batches (a list of sums when loss_fn returns
        a sequence), and with `return_outputs` also the merged outputs.
        """
        check_optim_error()
        if not torch.is_grad_enabled():
            raise GradientsDisabledError(
                "forward_backward needs gradients; it was called under torch.no_grad()"
            )
        if not isinstance(input_args, tuple):
            input_args = (input_args,)
        input_kwargs = dict(input_kwargs or {})
        if not isinstance(run_config, RoundPipeRunConfig):
            raise ConfigError("run_config must be a RoundPipeRunConfig")
        cfg = FullRoundPipeRunConfig(
            run_config, self.model_run_config, num_devices=get_num_devices()
        )
        if self._dp is not None:  # the global batch in; this rank's rows go on
            input_args, input_kwargs, label = self._dp.take_share(
                input_args, input_kwargs, label, cfg
            )
        acts, flags, batch, specs = self._split_inputs(input_args, input_kwargs, cfg)
        labels = split_label(label, len(acts), cfg.split_label, batch)
        plan = self._plan("fused", cfg)
        run = RunState(
            self,
            cfg,
            plan,
            "fused",
            acts,
            flags,
            labels=labels,
            loss_fn=loss_fn,
            return_outputs=return_outputs,
        )
        run.meter = self._meter_for_call()
        n_fwd = len(plan.fwd_plan)
        for part in range(run.tail_split):
            run.claim_grads(run.fused_job_index(part), plan.fwd_plan[-1])
        for b, layer_ids in enumerate(plan.bwd_plan):
            run.claim_grads(run.backward_job_index(b), layer_ids)
        overlap = self.overlap_calls and self._dp is None and not any(flags)
        if not overlap:
            self.finish_pending()
        run.previous = self.__dict__.get("_pending_run")
        for g in range(n_fwd - 1):
            run.launch(get_next_device(), forward_job, g, name=f"fwd{g}")
        for part in range(run.tail_split):
            run.launch(get_next_device(), fused_job, part, name=f"fused{part}")
        for b in range(len(plan.bwd_plan)):
            run.launch(get_next_device(), backward_job, b, name=f"bwd{b}")
        if overlap:
            # Return with the losses; the backward jobs go on, overlapping the next call's
            # forward jobs. The call before this one is done by now (its last jobs ran
            # before this call's): finish it (its timings, an error it raised).
            run.wait_losses()
            self.finish_pending()
            run.previous = None
            object.__setattr__(self, "_pending_run", run)
        else:
            run.join()
            self.model_timer.update_times()
            # The step before this iteration must end before the next step can start
            # anyway; waiting here costs no overlap and surfaces a failed step_fn at this
            # call.
            synchronize_optim()
        loss = _sum_losses(run)
        if self._dp is not None:
            loss = self._dp.reduce_loss(loss)
        if any(flags):
            _backprop_to_inputs(run, input_args, input_kwargs, specs)
        if not return_outputs:
            return loss
        outputs = [a.rebuild(a.leaves) for a in run.outputs if a is not None]
        if cfg.merge_output is False:
            return loss, RoundPipePackedData(outputs)
        return loss, _to_device(merge_outputs(outputs, cfg.merge_output), cfg.output_device)


def _one_cuda_device() -> bool:
    """Whether the engine drives exactly one device, a GPU (engine.planning.one_device's plans)."""
    devices = get_devices()
    return len(devices) == 1 and devices[0].is_cuda


def _to_device(tree: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return tree
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def _sum_losses(run: RunState) -> Any:
    per_mb = [a for a in run.losses if a is not None]
    if not per_mb:
        return None
    if per_mb[0].tree:  # loss_fn returned a sequence: one sum per position
        return [sum(a.leaves[k] for a in per_mb) for k in range(len(per_mb[0].leaves))]
    total = per_mb[0].leaves[0]
    for a in per_mb[1:]:
        total = total + a.leaves[0]
    return total


def _merge_input_grads(
    run: RunState, n_leaves: int, flags: list[bool], specs: list[Any] | None
) -> list[torch.Tensor | None]:
    """Per-leaf gradients of the original inputs from the per-micro-batch gradients."""
    grads: list[torch.Tensor | None] = []
    for k in range(n_leaves):
        if not flags[k]:
            grads.append(None)
            continue
        parts = [a.leaves[k] if a is not None else None for a in run.input_grads]
        if any(p is None for p in parts):
            grads.append(None)
            continue
        spec = specs[k] if specs is not None else TensorChunkSpec(0)
        if isinstance(spec, TensorChunkSpec):
            grads.append(torch.cat(parts, dim=spec.split_dim))
        else:  # replicated: every micro-batch contributed
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            grads.append(total)
    return grads


def _backprop_to_inputs(
    run: RunState, args: tuple[Any, ...], kwargs: dict[str, Any], specs: list[Any] | None
) -> None:
    """Send the input gradients of forward_backward into the graph the inputs came from."""
    leaves, _ = pytree.tree_flatten((args, kwargs))
    flags = [isinstance(t, torch.Tensor) and t.requires_grad for t in leaves]
    grads = _merge_input_grads(run, len(leaves), flags, specs)
    pairs = [(t, g) for t, g, f in zip(leaves, grads, flags, strict=True) if f and g is not None]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g.to(t.device) for t, g in pairs])


class _RoundPipeBackward(torch.autograd.Function):
    """Connects a RoundPipe forward's outputs to autograd; backward runs the backward jobs."""

    @staticmethod
    def forward(ctx: Any, handle: dict[str, Any], tag: torch.Tensor, *inputs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.handle = handle
        outs = handle["float_outputs"]
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:  # type: ignore[override]
        h = ctx.handle
        run: RunState = h["run"]
        model: RoundPipe = h["model"]
        per_mb_outputs: list[list[Any]] = h["per_mb_leaves"]
        float_idx: list[int] = h["float_idx"]
        out_specs: list[Any] = h["out_specs"]
        m = run.num_microbatch
        per_mb_grads: list[list[Any]] = [[None] * len(per_mb_outputs[0]) for _ in range(m)]
        for g, k in zip(grad_outputs, float_idx, strict=True):
            if g is None:
                continue
            column = [leaves[k] for leaves in per_mb_outputs]
            spec = out_specs[k]
            if spec is _Replicate:
                per_mb_grads[0][k] = g
                continue
            if column[0].dim() == 0:
                pieces = list(g.unbind(0))
            else:
                dim = spec.split_dim if isinstance(spec, TensorChunkSpec) else 0
                pieces = list(torch.split(g, [c.size(dim) for c in column], dim=dim))
            for i in range(m):
                per_mb_grads[i][k] = pieces[i].contiguous()
        run.grad_states = [Act(per_mb_grads[i], None, None) for i in range(m)]
        model._run_backward(run)
        grads = _merge_input_grads(run, len(h["input_leaves"]), h["input_flags"], h["input_specs"])
        req = [g for g, f in zip(grads, h["input_flags"], strict=True) if f]
        return (None, None, *req)


def _attach_backward(
    model: RoundPipe,
    run: RunState,
    merged: Any,
    outputs: list[Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    specs: list[Any] | None,
    cfg: FullRoundPipeRunConfig,
) -> Any:
    leaves, tree = pytree.tree_flatten(merged)
    float_idx = [
        k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    if not float_idx:
        return merged
    if callable(cfg.merge_output) and not isinstance(cfg.merge_output, (bool, tuple, list, dict)):
        raise ConfigError(
            "a merge_output callable cannot carry gradients back through forward(); "
            "use forward_backward(), the automatic merge, or a chunk-spec tree"
        )
    out_specs = (
        [True] * len(leaves)
        if cfg.merge_output is True
        else pytree.tree_flatten(cfg.merge_output)[0]
    )
    input_leaves, _ = pytree.tree_flatten((args, kwargs))
    input_flags = [isinstance(t, torch.Tensor) and t.requires_grad for t in input_leaves]
    handle = {
        "run": run,
        "model": model,
        "float_outputs": [leaves[k] for k in float_idx],
        "float_idx": float_idx,
        "per_mb_leaves": [pytree.tree_flatten(o)[0] for o in outputs],
        "out_specs": out_specs,
        "input_leaves": input_leaves,
        "input_flags": input_flags,
        "input_specs": specs,
    }
    tag = torch.zeros((), requires_grad=True)
    req_inputs = [t for t, f in zip(input_leaves, input_flags, strict=True) if f]
    outs = _RoundPipeBackward.apply(handle, tag, *req_inputs)
    new_leaves = list(leaves)
    for k, o in zip(float_idx, outs, strict=True):
        new_leaves[k] = o
    return pytree.tree_unflatten(new_leaves, tree)


class AutoRoundPipe(RoundPipeBase):
    """Optimizer-side parameters and the asynchronous step over an arbitrary model.

    The model runs as it is (its RoundPipe submodules stream their layers; the rest runs on
    the host); every parameter, inside RoundPipe submodules or not, gets an optimizer-side
    copy, and `step` updates them all on the optimizer thread.
    """

    def __init__(
        self,
        model: nn.Module,
        name: str | None = None,
        optim_dtype: torch.dtype | None = None,
        optim_grad_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            model,
            name=name or get_call_location(1),
            optim_dtype=optim_dtype,
            optim_grad_dtype=optim_grad_dtype,
        )
        subs = [m for m in model.modules() if isinstance(m, RoundPipe)]
        if any(s._dp is not None for s in subs) or (
            resolve_process_group(kwargs.get("process_group", AUTO_GROUP)) is not None
        ):
            raise ConfigError(
                "data parallel needs a model that wraps as one RoundPipe (a preset or an "
                "nn.Sequential); this one was auto-split. Wrap it as a Sequential, or pass "
                "process_group=None to train it single-process on each rank"
            )
        object.__setattr__(self, "_subs", subs)
        # Parameters outside RoundPipe submodules form one pseudo-layer (owner 0 here).
        object.__setattr__(self, "layer_attrs", [LayerAttribute(0)])
        for p in model.parameters():
            if not ParamAttribute.has(p):
                ParamAttribute.set(p, 0, optim_dtype or p.dtype, optim_grad_dtype)
        object.__setattr__(self, "_rp_initialized", True)

    def _loose_params(self) -> list[tuple[nn.Parameter, ParamAttribute]]:
        inside = {id(p) for s in self._subs for p in nn.Module.parameters(s)}
        return [(p, pa) for p, pa in self._all_params() if id(p) not in inside]

    @property
    def module_param_uploaded_events(self) -> list[Any]:
        return [a.param_copied for s in self._subs for a in s.layer_attrs] + [
            self.layer_attrs[0].param_copied
        ]

    @property
    def module_gradient_ready_events(self) -> list[Any]:
        return [a.grad_copied for s in self._subs for a in s.layer_attrs] + [
            self.layer_attrs[0].grad_copied
        ]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped model (after the optimizer published this iteration's weights)."""
        check_optim_error()
        self.layer_attrs[0].param_copied.wait()
        self.layer_attrs[0].grad_copied.wait()
        return self.model(*args, **kwargs)

    def step(
        self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any, **kwargs: Any
    ) -> None:
        """Like RoundPipe.step, over every parameter of the model."""
        if not callable(step_fn):
            raise ConfigError(f"step_fn must be callable, got {type(step_fn).__name__}")
        check_optim_error()
        # Host-side autograd left the loose gradients in .grad: hand them to the optimizer.
        for p, pa in self._loose_params():
            if p.grad is not None:
                pa.grad_host = p.grad
                pa.grad_pending = True
                p.grad = None
        events = [*self.module_param_uploaded_events, *self.module_gradient_ready_events]
        for e in events:
            e.clear()
        self.optim_updated.clear()
        launch_optim_kernel(self._auto_step_kernel, step_fn, args, kwargs, not is_async)
        if not is_async:
            synchronize_optim()

    def _auto_step_kernel(
        self, step_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], sync: bool
    ) -> None:
        owners: list[RoundPipeBase] = [*self._subs, self]
        try:
            for owner in owners:
                groups = owner._params_by_owner() if owner is not self else [self._loose_params()]
                _publish_weights_take_grads(owner, groups)
            try:
                with OptimizerCtx():
                    step_fn(*args, **kwargs)
            finally:  # as in RoundPipe._step_kernel: a failed step_fn may have updated some
                for owner in owners:
                    object.__setattr__(owner, "_optim_ahead", True)
            if sync:
                for owner in owners:
                    owner.sync_optim_param()
        finally:
            for e in [*self.module_param_uploaded_events, *self.module_gradient_ready_events]:
                e.set()
            self.optim_updated.set()

    def synchronize(self) -> None:
        """Wait for every step; loose parameters and RoundPipe submodules are brought up to date."""
        synchronize_optim()
        for s in self._subs:
            s.sync_optim_param()
        loose = self._loose_params()
        if self._optim_ahead:
            for p, pa in loose:
                if pa.optim is not None:
                    p.data.copy_(pa.optim.data)
            object.__setattr__(self, "_optim_ahead", False)
        for p, pa in self._all_params():
            if p.grad is not None and id(p) in {id(q) for q, _ in loose}:
                pa.grad_host, pa.grad_pending, p.grad = p.grad, True, None
            pa.fold_grad()
            p.grad = (
                pa.optim.grad.detach().to(p.dtype, copy=True)
                if pa.optim is not None and pa.optim.grad is not None
                else None
            )

    def sync_optim_param(self) -> None:
        """Copy every newer optimizer-side weight into the model."""
        for s in self._subs:
            s.sync_optim_param()
        if self._optim_ahead:
            for p, pa in self._loose_params():
                if pa.optim is not None:
                    p.data.copy_(pa.optim.data)
            object.__setattr__(self, "_optim_ahead", False)
