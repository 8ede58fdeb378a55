"""RoundPipe and AutoRoundPipe: the model wrappers users train with.

Over ~600 lines: RoundPipe's construction (pinning, per-layer parameters, data parallel,
second weight copies) and its entry points (forward, forward_backward) with the plan
choice between them are one mechanism; what stands apart lives beside it: RoundPipeBase
and the step (roundpipe_base), the autograd bridge (autograd_bridge), call-site naming
(call_site), one iteration's jobs (run).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .accel import graphs
from .accel.fp8 import use_fp8_matmuls
from .accel.weight_buffers import attach_second_copies
from .attribute import LayerAttribute, ParamAttribute, resolve_optim_memory
from .autograd_bridge import attach_backward, attach_backward_packed, backprop_to_inputs
from .batch import Batch
from .call_site import get_call_location
from .context import OptimizerCtx
from .device import (
    DeviceManager,
    get_devices,
    get_num_devices,
    set_gpu_memory_cap,
)
from .errors import ConfigError, GradientsDisabledError
from .fold_ahead import fold_ahead_of_step
from .memory import get_model_active_size, get_model_size, pin_module
from .optim_stream import check_optim_error, launch_optim_kernel, synchronize_optim
from .parallel.data_parallel import AUTO_GROUP, attach_data_parallel, resolve_process_group
from .planning import one_device
from .planning.allocation_check import check_engine_allocation
from .planning.gpu_memory import check_gpu_memory_cap, resolve_max_gpu_memory
from .planning.search import group_param_cap
from .planning.simulate import publish_wait_ms_per_gb
from .roundpipe_base import (
    RoundPipeBase,
    check_step_staleness,
    publish_weights_take_grads,
    settle_grads,
)
from .run import backward_job, forward_job, fused_job
from .run_config import FullRoundPipeRunConfig, RoundPipeRunConfig
from .run_state import HostData, RunState
from .scheduler import ModelExecutePlan, RunType
from .timer import ModelTimer
from .transfer import (
    LayerReplica,
    UploadedGroup,
    kernel_written_buffers,
    make_replica,
    upload_layers,
)

__all__ = ["AutoRoundPipe", "RoundPipe", "RoundPipeBase"]

log = logging.getLogger(__name__)

# After how many timed iterations the automatic plan is made again (ModelTimer.updates).
_REPLAN_AFTER_UPDATES = (1, 3, 10)


def _default_loss(outputs: Any, labels: Any) -> Any:
    return outputs


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
        optim_memory: 'default', or 'compact': the bf16 weights are the optimizer's
            masters and its gradient the downloaded bf16 one, read in place (no other
            copy); with engine.optim.Adam(state_dtype=torch.uint8) about 6 bytes of host
            memory per trainable parameter instead of 12 (docs/HOST_MEMORY_MODES.md). The
            next iteration then computes with the updated weights: its upload of a layer
            waits for the update of that layer's weights (layer by layer with an optimizer
            that reports them, as engine.optim.Adam does; else for the whole step). Needs
            a bf16 model; not with data parallel.
        step_staleness: Which weights the call after an asynchronous `step` computes
            with. 1 (default, the seeds' meaning of `is_async=True`): those from before
            the step, while the step runs under it. 0: the step's own, as with
            `is_async=False`, at nearly the asynchronous step's speed: the optimizer
            updates the layers in the order the next forward needs them and publishes
            each as it finishes (with an optimizer that reports them, as engine.optim.Adam
            does; else after step_fn), the next call's upload of a layer waiting for that
            layer only. optim_memory='compact' always works so. Results equal the
            synchronous step's bit for bit (docs/HOST_MEMORY_MODES.md, "Staleness").
        max_gpu_memory: Cap on each engine device's GPU memory: GiB as a number (24), bytes
            from 2**20 up, or a string with a unit ('24GiB'); default RP_GPU_MEMORY_GIB,
            else none. The plan sizes for a card that large and, on CUDA, the caching
            allocator cannot reserve past it (docs/ENGINE.md, "GPU memory").
        layers_per_group: Every call runs groups of this many consecutive layers
            (`ModelExecutePlan.grouped` over this model's layers, the last group the fused
            tail) instead of the automatic plan; not with model_run_config.execute_plan.
        matmul_precision: 'bf16' (default): linear layers multiply in the model's dtype.
            'fp8': every `nn.Linear` of the layers but the output head (and MoE routers)
            multiplies bf16 inputs in float8, forward and backward, with scales from each
            operand's amax (engine.accel.fp8); needs a bf16 model, and GPUs of compute
            capability >= 8.9 to be faster (CPU devices emulate it, for tests).
        fp8_recipe: With 'fp8': 'rowwise' (default; a scale per row, all e4m3),
            'tensorwise' (a scale per tensor, gradients e5m2) or 'rowwise_with_gw_hp'
            (rowwise, the weight gradient's matmul in bf16). docs/PERFORMANCE.md ("FP8").
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
        optim_memory: str = "default",
        max_gpu_memory: float | str | None = None,
        layers_per_group: int | None = None,
        step_staleness: int = 1,
        matmul_precision: str = "bf16",
        fp8_recipe: str = "rowwise",
    ) -> None:
        optim_grad_dtype = resolve_optim_memory(
            optim_memory,
            list(model.parameters()) if isinstance(model, nn.Module) else [],
            optim_dtype=optim_dtype,
            optim_grad_dtype=optim_grad_dtype,
            double_buffer_weights=double_buffer_weights,
        )
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
            step_staleness=0 if optim_memory == "compact" else step_staleness,
        )
        object.__setattr__(self, "optim_memory", optim_memory)
        get_devices()  # parse RP_DEVICES now: a bad value fails at construction
        if any(t.device.type != "cpu" for t in [*model.parameters(), *model.buffers()]):
            model.to("cpu")
        layers = list(model.children()) if isinstance(model, nn.Sequential) else [model]
        if not layers:
            raise ConfigError("model is an empty nn.Sequential; give it at least one layer")
        use_fp8_matmuls(self.name, layers, matmul_precision, fp8_recipe)
        if double_buffer_weights is None:
            double_buffer_weights = overlap_calls
        gpu_cap = resolve_max_gpu_memory(max_gpu_memory)
        if gpu_cap is not None:
            check_gpu_memory_cap(
                gpu_cap,
                [get_model_size(layer) for layer in layers],
                [get_model_active_size(layer) for layer in layers],
            )
        check_engine_allocation(
            model,
            optim_dtype=optim_dtype,
            optim_grad_dtype=optim_grad_dtype,
            pin_model=pin_model,
            budget_bytes=host_memory_budget,
            double_buffer_weights=bool(double_buffer_weights),
            optim_memory=optim_memory,
        )
        arena_grads = pin_module(model, pin_model)
        if gpu_cap is not None:
            set_gpu_memory_cap(gpu_cap)
        object.__setattr__(self, "max_gpu_memory_bytes", gpu_cap)
        if layers_per_group is not None:
            if model_run_config.execute_plan is not None:
                raise ConfigError(
                    "give layers_per_group or model_run_config.execute_plan, not both",
                    field="layers_per_group",
                )
            plan = ModelExecutePlan.grouped(len(layers), layers_per_group)
            model_run_config = dataclasses.replace(model_run_config, execute_plan=plan)
            log.info("%s: layer groups of %d: %s", self.name, layers_per_group, plan)
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
        if dp is not None and optim_memory == "compact":
            raise ConfigError("optim_memory='compact' does not run under data parallel yet")
        object.__setattr__(self, "_dp", dp)
        second = 0
        if double_buffer_weights and dp is None:
            second = attach_second_copies(self._all_params(), pinned=pin_model != "off")
        object.__setattr__(self, "second_copy_bytes", second)
        object.__setattr__(self, "_rp_initialized", True)

    # ---- device-side copies --------------------------------------------------------------
    @property
    def num_microbatch(self) -> int:
        """Micro-batches a call makes unless its own run config says otherwise: the
        model_run_config's num_microbatch, else the engine's default on its devices."""
        full = FullRoundPipeRunConfig(
            RoundPipeRunConfig(), self.model_run_config, num_devices=get_num_devices()
        )
        return full.num_microbatch

    def _replica(self, dev: DeviceManager, layer_id: int) -> LayerReplica:
        key = (dev.id, layer_id)
        rep = self._replicas.get(key)
        if rep is None:
            with self._replica_lock:
                rep = self._replicas.get(key)
                if rep is None:
                    rep = make_replica(self.layers[layer_id])
                    self._replicas[key] = rep
        rep.follow_training_mode()
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

    @contextmanager
    def replay_paused(self) -> Iterator[None]:
        """Inside the block, this model's layers run as they are (no CUDA graph capture or
        replay; other models are not affected): for calls whose shapes change every time,
        where a graph captured for each would only take GPU memory and graph slots."""
        wanted = self._replay_wanted
        object.__setattr__(self, "_replay_wanted", False)
        try:
            yield
        finally:
            object.__setattr__(self, "_replay_wanted", wanted)

    # ---- planning ---------------------------------------------------------------------------
    def _plan(self, run_type: RunType, cfg: FullRoundPipeRunConfig) -> ModelExecutePlan:
        if cfg.execute_plan is not None:
            cfg.execute_plan.check_valid(self.num_layers, run_type)
            return self._tail_in_one_job(cfg.execute_plan)
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
            plan = self._tail_in_one_job(plan)
            self._plans[key] = plan
            log.debug("%s: %s plan %s", self.name, run_type, plan)
        return plan

    def _tail_in_one_job(self, plan: ModelExecutePlan) -> ModelExecutePlan:
        """`plan` with its fused tail in one job if a tail layer writes a buffer: the jobs of
        a split tail run at once on several devices, each would update its own copy (a
        BatchNorm's running statistics) and the last one downloaded would win. Python
        writes show at the first call's download; the first call never splits the tail
        (the split needs measured times)."""
        if plan.tail_split == 1:
            return plan
        written = {j for (_, j), rep in self._replicas.items() if rep.wrote_buffers}
        tail = plan.fwd_plan[-1]
        if not any(j in written or kernel_written_buffers(self.layers[j]) for j in tail):
            return plan
        log.debug("%s: the fused tail writes buffers; it runs in one job", self.name)
        return ModelExecutePlan.from_ranges(plan.fwd_plan, plan.bwd_plan)

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
    @staticmethod
    def _host_data(batch: Batch) -> list[HostData]:
        """The micro-batches of the arguments as the jobs take them."""
        return [
            HostData(leaves, tree, None, is_args=True)
            for leaves, tree in zip(batch.flatten_states, batch.flatten_specs, strict=True)
        ]

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
        batch = Batch(args, kwargs, cfg)
        flags = batch.requires_grad
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
        run = RunState(self, cfg, plan, run_type, self._host_data(batch), flags)
        for g in range(len(plan.fwd_plan)):
            run.launch(self._next_device(), forward_job, g, name=f"fwd{g}")
        run.join()
        self.model_timer.update_times()
        synchronize_optim()
        outputs = [a.rebuild(a.leaves) for a in run.flow.outputs if a is not None]
        specs = batch.split_specs
        if cfg.merge_output is False and wants_grad:
            outputs = attach_backward_packed(self, run, outputs, args, kwargs, specs)
        batch.store_outputs(outputs)
        merged = batch.dump(cfg)
        if cfg.merge_output is False:
            return merged
        if wants_grad:
            merged = attach_backward(self, run, merged, outputs, args, kwargs, specs, cfg)
        return _to_device(merged, cfg.output_device)

    def _next_device(self) -> DeviceManager:
        """The next device of this model's round robin (`_device_cursor`), which goes on from
        call to call: a call's first job runs on the device after the previous call's last."""
        devices = get_devices()
        index = self._device_cursor % len(devices)
        object.__setattr__(self, "_device_cursor", (index + 1) % len(devices))
        return devices[index]

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
            run.launch(self._next_device(), backward_job, b, name=f"bwd{b}")
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
        batch = Batch(input_args, input_kwargs, cfg, label)
        flags = batch.requires_grad
        plan = self._plan("fused", cfg)
        run = RunState(
            self,
            cfg,
            plan,
            "fused",
            self._host_data(batch),
            flags,
            labels=batch.label_list,
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
        # Before the jobs: launching it may raise a failed step's error (nothing to undo then).
        fold = None if overlap else fold_ahead_of_step(self, run)
        try:
            for g in range(n_fwd - 1):
                run.launch(self._next_device(), forward_job, g, name=f"fwd{g}")
            for part in range(run.tail_split):
                run.launch(self._next_device(), fused_job, part, name=f"fused{part}")
            for b in range(len(plan.bwd_plan)):
                run.launch(self._next_device(), backward_job, b, name=f"bwd{b}")
        except BaseException:
            run.abort.set()  # the fold kernel must not wait for downloads that never come
            raise
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
            # call. The fold kernel ends here too: the next call's downloads never meet it.
            waited = time.perf_counter()
            synchronize_optim()
            if fold is not None:
                fold["end_wait_s"] = time.perf_counter() - waited
        # A loss HostData's tree says whether loss_fn returned a sequence.
        batch.loss_list = [
            list(a.leaves) if a.tree else a.leaves[0] for a in run.flow.losses if a is not None
        ]
        loss = _sum_losses(run)
        if self._dp is not None:
            loss = self._dp.reduce_loss(loss)
        if any(flags):
            backprop_to_inputs(run, input_args, input_kwargs, batch.split_specs)
        if not return_outputs:
            return loss
        batch.store_outputs([a.rebuild(a.leaves) for a in run.flow.outputs if a is not None])
        if cfg.merge_output is False:
            return loss, batch.dump(cfg)
        return loss, _to_device(batch.dump(cfg), cfg.output_device)


def _one_cuda_device() -> bool:
    """Whether the engine drives exactly one device, a GPU (engine.planning.one_device's plans)."""
    devices = get_devices()
    return len(devices) == 1 and devices[0].is_cuda


def _to_device(tree: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return tree
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def _sum_losses(run: RunState) -> Any:
    per_mb = [a for a in run.flow.losses if a is not None]
    if not per_mb:
        return None
    if per_mb[0].tree:  # loss_fn returned a sequence: one sum per position
        return [sum(a.leaves[k] for a in per_mb) for k in range(len(per_mb[0].leaves))]
    total = per_mb[0].leaves[0]
    for a in per_mb[1:]:
        total = total + a.leaves[0]
    return total


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
        step_staleness: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            model,
            name=name or get_call_location(1),
            optim_dtype=optim_dtype,
            optim_grad_dtype=optim_grad_dtype,
            step_staleness=step_staleness,
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
        # id(loose parameter) -> (the .grad synchronize() left, its version then)
        object.__setattr__(self, "_grad_mirrors", {})
        object.__setattr__(self, "_rp_initialized", True)

    def _loose_params(self) -> list[tuple[nn.Parameter, ParamAttribute]]:
        inside = {id(p) for s in self._subs for _, p in nn.Module.named_parameters(s)}
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
        self._take_loose_grads()
        events = [*self.module_param_uploaded_events, *self.module_gradient_ready_events]
        for e in events:
            e.clear()
        self.optim_updated.clear()
        fresh = is_async and check_step_staleness(self.step_staleness) == 0
        launch_optim_kernel(self._auto_step_kernel, step_fn, args, kwargs, not is_async or fresh)
        if not is_async:
            synchronize_optim()

    def _take_loose_grads(self) -> None:
        """Hand the loose parameters' .grad (host autograd's) to the optimizer side.

        After synchronize() a loose .grad mirrors the optimizer-side gradient, which holds it
        already: left as it was, nothing is added again; accumulated into by another
        backward, it is the whole gradient now; replaced or cleared (zero_grad), the sum
        it mirrored goes with it.
        """
        mirrors = self._grad_mirrors
        for p, pa in self._loose_params():
            mirror = mirrors.pop(id(p), None)
            if mirror is not None:
                tensor, version = mirror
                if p.grad is tensor and tensor._version == version:
                    p.grad = None
                    continue
                if pa.optim is not None:
                    pa.optim.grad = None
            if p.grad is not None:
                pa.grad_host, pa.grad_pending, p.grad = p.grad, True, None

    def _auto_step_kernel(
        self, step_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], sync: bool
    ) -> None:
        owners: list[RoundPipeBase] = [*self._subs, self]
        taken: list[list[tuple[nn.Parameter, ParamAttribute]]] = []
        try:
            for owner in owners:
                groups = owner._params_by_owner() if owner is not self else [self._loose_params()]
                taken.extend(groups)
                publish_weights_take_grads(owner, groups)
            try:
                with OptimizerCtx():
                    step_fn(*args, **kwargs)
            finally:  # as in RoundPipe._step_kernel: a failed step_fn may have updated some
                for owner in owners:
                    object.__setattr__(owner, "_optim_ahead", True)
            if sync:  # also step_staleness=0: the forward of an auto-split model waits
                # for the whole step anyway (its loose layer's event)
                for owner in owners:
                    owner.sync_optim_param()
        finally:
            try:
                settle_grads(taken)  # before the events let the next downloads in
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
        self._take_loose_grads()
        loose_ids = {id(p) for p, _ in loose}
        for p, pa in self._all_params():
            pa.fold_grad()
            p.grad = (
                pa.optim.grad.detach().to(p.dtype, copy=True)
                if pa.optim is not None and pa.optim.grad is not None
                else None
            )
            if p.grad is not None and id(p) in loose_ids:
                self._grad_mirrors[id(p)] = (p.grad, p.grad._version)

    def sync_optim_param(self) -> None:
        """Copy every newer optimizer-side weight into the model."""
        for s in self._subs:
            s.sync_optim_param()
        if self._optim_ahead:
            for p, pa in self._loose_params():
                if pa.optim is not None:
                    p.data.copy_(pa.optim.data)
            object.__setattr__(self, "_optim_ahead", False)
