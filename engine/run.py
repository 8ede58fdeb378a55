"""One call's work: micro-batches through layer groups on the devices, recompute, backward.

The main thread builds a RunState, queues one job per layer group on the next device in
round-robin, and waits. A group starts micro-batch i once the group before it has finished
micro-batch i (ModelTracker semaphores); the data itself travels through host memory with
events, so a device never blocks on another device's stream.

Jobs:
- forward_job: forward of a group over all micro-batches (no autograd graph); keeps the
  inputs (and RNG states) the backward will re-run from.
- fused_job: forward + loss + backward of the last group, no recompute; with a plan's
  `tail_split` > 1, several fused jobs on consecutive devices share the micro-batches
  (job s takes s, s + tail_split, ...), so the head with its loss is not one long job.
- backward_job: re-runs a group's forward from its kept input ('stage': the whole group,
  then one backward; 'layer': one layer at a time), backpropagates, and hands the input
  gradient to the group before it.
Parameter gradients are accumulated on the device over micro-batches and downloaded once per
job into the host gradient buffer (ParamAttribute.grad_host). What the jobs share, and
their waits on each other, is the RunState (engine.run_state).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, overload

import torch
from torch.utils import _pytree as pytree

from .accel import graphs
from .attribute import ParamAttribute
from .context import ForwardCtx, RecomputeCtx
from .device import DeviceManager
from .errors import ConfigError, RoundPipeError
from .planning.one_device import ActivationMeter
from .run_state import HostData, RunState
from .timer import IterTimer, annotate
from .transfer import UploadedGroup, async_d2h, async_h2d, download_buffers, release_group

__all__ = [
    "backward_job",
    "download_param_grads",
    "forward_job",
    "fused_job",
]

log = logging.getLogger(__name__)


def _flatten(obj: Any) -> tuple[list[Any], Any]:
    return pytree.tree_flatten(obj)


@contextlib.contextmanager
def _autocast(run: RunState) -> Any:
    with contextlib.ExitStack() as stack:
        for dev_type, dtype in run.call.autocast:
            stack.enter_context(torch.autocast(dev_type, dtype=dtype))
        yield


def _requires_grad_leaves(leaves: list[Any], flags: list[bool] | None) -> list[bool]:
    """Mark float tensors as needing grad (or per `flags` for the user's inputs)."""
    out = []
    for k, t in enumerate(leaves):
        want = (
            isinstance(t, torch.Tensor)
            and (t.is_floating_point() or t.is_complex())
            and (flags is None or flags[k])
        )
        if want:
            t.requires_grad_(True)
        out.append(want)
    return out


def _call_layer(module: torch.nn.Module, carry: Any, is_args: bool) -> Any:
    if is_args:
        args, kwargs = carry
        return module(*args, **kwargs)
    return module(carry)


def _make_save_fn(run: RunState, dev: DeviceManager, layer_id: int, mb: int) -> Callable[..., None]:
    def save(*data: Any) -> None:
        key = (layer_id, mb)
        if key in run.saved.recompute_data:
            raise RoundPipeError(
                f"save_for_recompute was called twice in layer {layer_id}; call it at most once "
                "per layer and forward"
            )
        leaves, tree = _flatten(data)
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise RoundPipeError(
                    f"save_for_recompute in layer {layer_id} got a tensor that requires grad; "
                    "save .detach()ed tensors"
                )
        host, ev = async_d2h(dev, leaves, pieces=True)
        run.saved.recompute_data[key] = HostData(host, tree, ev)

    return save


def _recompute_data(
    run: RunState, dev: DeviceManager, layer_id: int, mb: int
) -> tuple[Any, ...] | None:
    """What layer `layer_id` saved in micro-batch `mb`'s forward, uploaded (or None)."""
    saved = run.saved.recompute_data.get((layer_id, mb))
    if saved is None:
        return None
    leaves = async_h2d(dev, [saved.event], saved.leaves)
    return tuple(saved.rebuild(leaves))


def _replay(dev: DeviceManager, run: RunState, group: UploadedGroup) -> graphs.Replayer | None:
    """The device's Replayer where this job's layers may replay (they have slots)."""
    if not any(s is not None for s in group.slots):
        return None
    return graphs.replayer(dev)


def _state_too_large(run: RunState, carry: Any) -> bool:
    """Whether the carry's state is over the replay limit; then this model stops using
    slots (engine.accel.graphs.REPLAY_MAX_TOKENS: long sequences gain nothing from replay)."""
    state = graphs.state_of(carry)
    if state is None or not graphs.too_many_tokens(state):
        return False
    run.model.stop_replay()
    return True


def _run_forward_layers(
    run: RunState,
    dev: DeviceManager,
    modules: list[torch.nn.Module],
    layer_ids: range,
    carry: Any,
    is_args: bool,
    mb: int,
    *,
    keep_for_backward: bool,
    group: UploadedGroup | None = None,
) -> Any:
    """Run layers on the device; keep inputs/RNG/saved data that a later recompute needs.

    With the job's `group` (a no-grad forward), runs of layers that may replay go through
    their captured graph (engine.accel.graphs); a run ends where the backward needs a layer's
    input, which is downloaded between layers.
    """
    tracker = run.tracker
    replayer = _replay(dev, run, group) if group is not None else None
    slots = group.slots if group is not None else []

    def needs_input(k: int) -> bool:
        return keep_for_backward and tracker.backward_need_input(layer_ids[k])

    k = 0
    while k < len(layer_ids):
        j = layer_ids[k]
        if needs_input(k) and k > 0:
            leaves, tree = _flatten(carry)
            host, ev = async_d2h(dev, leaves, pieces=True)
            run.saved.inputs[(j, mb)] = HostData(host, tree, ev, is_args=False)
        if needs_input(k) and run.cfg.preserve_rng_state:
            run.saved.rng_states[(j, mb)] = dev.get_rng_state()
        if replayer is not None and not (is_args and k == 0) and not _state_too_large(run, carry):
            keys = replayer.forward_span(
                modules, slots, k, carry, saving=keep_for_backward, stop_before=needs_input
            )
            if keys:
                stop = k + len(keys)
                save_fns = (
                    [_make_save_fn(run, dev, layer_ids[i], mb) for i in range(k, stop)]
                    if keep_for_backward
                    else None
                )
                with annotate(f"{run.model.name}.fwd{j}-{layer_ids[stop - 1]}.mb{mb}.replay"):
                    out = replayer.run_forward(
                        modules[k:stop],
                        slots[k:stop],
                        keys,
                        carry,
                        save_fns,  # type: ignore[arg-type]
                    )
                if out is not None:
                    carry, k = out, stop
                    continue
                replayer = None  # not captured: the rest runs as it is
        save_fn = _make_save_fn(run, dev, j, mb) if keep_for_backward else None
        with ForwardCtx(save_fn), annotate(f"{run.model.name}.fwd{j}.mb{mb}"):
            carry = _call_layer(modules[k], carry, is_args and k == 0)
        k += 1
    return carry


def forward_job(dev: DeviceManager, run: RunState, group_id: int) -> None:
    """Forward of one layer group over every micro-batch."""
    layer_ids = run.plan.fwd_plan[group_id]
    dev.throttle()
    group = run.model.upload_group(dev, layer_ids, run, slots=True)
    timer = IterTimer(run.model.model_timer, "fwd", dev.is_cuda)
    run.timers.append(timer)
    last = group_id == len(run.plan.fwd_plan) - 1
    try:
        for mb in range(run.num_microbatch):
            act = run.wait_forward_input(group_id, mb)
            if run.enable_grad and run.tracker.backward_need_input(layer_ids.start):
                run.saved.inputs[(layer_ids.start, mb)] = act
            leaves = async_h2d(dev, [act.event], act.leaves)
            with (
                dev.compute(),
                torch.no_grad(),
                _autocast(run),
                timer.time(layer_ids, dev.compute_stream),
            ):
                out = _run_forward_layers(
                    run,
                    dev,
                    group.modules,
                    layer_ids,
                    act.rebuild(leaves),
                    act.is_args,
                    mb,
                    keep_for_backward=run.enable_grad,
                    group=group,
                )
                if last and run.cfg.output_fn is not None:
                    out = run.cfg.output_fn(out, mb)
            out_leaves, tree = _flatten(out)
            # The last group's outputs go to the caller: real tensors, not HostPieces.
            host, ev = async_d2h(dev, out_leaves, pieces=not last)
            run.flow.activations[mb] = HostData(host, tree, ev)
            if last:
                run.flow.outputs[mb] = run.flow.activations[mb]
                run.add_end_event(ev)
            run.tracker.forward_notify(group_id)
            if group_id == len(run.plan.fwd_plan) - 2:
                run.tail_input_ready[mb].set()
        download_buffers(dev, group, run.saved.buffers if run.enable_grad else None)
    finally:
        dev.job_issued()
        release_group(group, dev)


def fused_job(dev: DeviceManager, run: RunState, part: int = 0) -> None:
    """Forward, loss and backward of the last layer group over its share of the
    micro-batches (all of them unless the plan splits the tail)."""
    group_id = len(run.plan.fwd_plan) - 1
    layer_ids = run.plan.fwd_plan[group_id]
    dev.throttle()
    group = run.model.upload_group(dev, layer_ids, run)
    timer = run.model.model_timer
    fwd_timer = IterTimer(timer, "fwd", dev.is_cuda)
    bwd_timer = IterTimer(timer, "bwd", dev.is_cuda)
    run.timers += [fwd_timer, bwd_timer]
    fwd_shares, bwd_shares = timer.shares("fwd", layer_ids), timer.shares("bwd", layer_ids)
    assert run.call.loss_fn is not None
    try:
        for mb in run.tail_micro_batches(part):
            act = run.wait_tail_input(mb)
            leaves = async_h2d(dev, [act.event], act.leaves)
            flags = _requires_grad_leaves(leaves, run.call.requires_grad if group_id == 0 else None)
            label_leaves, label_tree = _flatten(run.call.labels[mb])
            label_dev = pytree.tree_unflatten(async_h2d(dev, [], label_leaves), label_tree)
            meter = run.meter if mb == 0 else None  # the first micro-batch's (one_device)
            with dev.compute(), torch.enable_grad(), _autocast(run):
                before = ActivationMeter.allocated(dev.device) if meter is not None else 0
                with fwd_timer.time(layer_ids, dev.compute_stream, shares=fwd_shares):
                    out = _run_forward_layers(
                        run,
                        dev,
                        group.modules,
                        layer_ids,
                        act.rebuild(leaves),
                        act.is_args,
                        mb,
                        keep_for_backward=False,
                    )
                    loss = run.call.loss_fn(out, label_dev)
                if meter is not None:
                    meter.record_tail(
                        layer_ids.start, ActivationMeter.allocated(dev.device) - before
                    )
                losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
                for item in losses:
                    if not isinstance(item, torch.Tensor):
                        raise ConfigError(
                            f"loss_fn must return a tensor or a sequence of tensors, got {type(item).__name__}"
                        )
                differentiable = [x for x in losses if x.requires_grad]
                with bwd_timer.time(layer_ids, dev.compute_stream, shares=bwd_shares):
                    if differentiable:
                        total = (
                            differentiable[0]
                            if len(differentiable) == 1
                            else torch.stack([x.sum() for x in differentiable]).sum()
                        )
                        if total.dim() != 0:
                            total = total.sum()
                        torch.autograd.backward(total)
            loss_host, ev = async_d2h(dev, [x.detach() for x in losses])
            run.flow.losses[mb] = HostData(loss_host, isinstance(loss, (list, tuple)), ev)
            run.add_end_event(ev)
            if run.call.return_outputs:
                out_leaves, tree = _flatten(out)
                host, oev = async_d2h(
                    dev, [x.detach() if isinstance(x, torch.Tensor) else x for x in out_leaves]
                )
                run.flow.outputs[mb] = HostData(host, tree, oev)
                run.add_end_event(oev)
            grads = [t.grad if f else None for t, f in zip(leaves, flags, strict=True)]
            _hand_back_input_grads(run, dev, grads, mb, to_user=group_id == 0)
            run.tail_done[mb].set()
            run.tracker.fused_forward_notify()
            del out, loss, losses, differentiable, leaves, grads
        download_param_grads(dev, run, group, job_index=run.fused_job_index(part))
        download_buffers(dev, group, None)
    finally:
        dev.job_issued()
        release_group(group, dev)


def _hand_back_input_grads(
    run: RunState, dev: DeviceManager, grads: list[Any], mb: int, *, to_user: bool
) -> None:
    """Download a micro-batch's input gradients: for the group before this one, or, for
    the first layer, for the caller's inputs."""
    host, ev = async_d2h(dev, grads, pieces=not to_user)
    if to_user:
        run.flow.input_grads[mb] = HostData(host, None, ev)
        run.add_end_event(ev)
    else:
        run.flow.output_grads[mb] = HostData(host, None, ev)


def backward_job(dev: DeviceManager, run: RunState, bwd_id: int) -> None:
    """Recompute and backward of one backward group over every micro-batch."""
    layer_ids = run.plan.bwd_plan[bwd_id]
    dev.throttle()
    group = run.model.upload_group(
        dev, layer_ids, run, saved_buffers=run.saved.buffers, slots=True, slot_grads=True
    )
    timer = IterTimer(run.model.model_timer, "bwd", dev.is_cuda)
    run.timers.append(timer)
    upstream_done: threading.Semaphore | None = None
    if bwd_id > 0:
        upstream_done = run.tracker.bwd_sem[bwd_id - 1]
    # else 'fused': the tail's jobs hand gradients back out of order (tail_done per
    # micro-batch); 'train': every output gradient is there before we start
    first_group = layer_ids.start == 0
    try:
        for mb in range(run.num_microbatch):
            if upstream_done is not None:
                run.wait(upstream_done)
            elif run.run_type == "fused":
                run.wait(run.tail_done[mb])
            output_grad = run.flow.output_grads[mb]
            assert output_grad is not None
            carry_grads = async_h2d(dev, [output_grad.event], output_grad.leaves)
            with (
                dev.compute(),
                torch.enable_grad(),
                _autocast(run),
                timer.time(layer_ids, dev.compute_stream),
            ):
                if run.cfg.recompute_grain == "stage":
                    steps = [layer_ids]
                else:
                    steps = [range(j, j + 1) for j in reversed(layer_ids)]
                for span in steps:
                    carry_grads = _recompute_backward(
                        run, dev, group, layer_ids, span, mb, carry_grads
                    )
            _hand_back_input_grads(run, dev, carry_grads, mb, to_user=first_group)
            run.tracker.backward_notify(bwd_id)
        download_param_grads(dev, run, group, job_index=run.backward_job_index(bwd_id))
    finally:
        dev.job_issued()
        release_group(group, dev)


def _recompute_backward(
    run: RunState,
    dev: DeviceManager,
    group: UploadedGroup,
    job_layers: range,
    span: range,
    mb: int,
    grads_out: list[Any],
) -> list[Any]:
    """Recompute layers `span` of micro-batch `mb` from their saved input and backpropagate
    `grads_out` (the gradients of their output leaves); returns the input leaves' gradients.

    Where the top of `span` may replay (engine.accel.graphs), the layers below it recompute as
    before, the top recomputes and backpropagates in its graph, and autograd carries the
    graph's input gradient down through the layers below.
    """
    inp = run.saved.inputs[(span.start, mb)]
    leaves = async_h2d(dev, [inp.event], inp.leaves)
    flags = _requires_grad_leaves(leaves, run.call.requires_grad if span.start == 0 else None)
    carry = inp.rebuild(leaves)
    offset = span.start - job_layers.start
    modules = group.modules[offset : offset + len(span)]
    slots = group.slots[offset : offset + len(span)]
    data = _LazyRecomputeData(run, dev, span, mb)
    replayer = _replay(dev, run, group)
    grad_state = grads_out[0] if grads_out and isinstance(grads_out[0], torch.Tensor) else None
    replayed = False
    # The first micro-batch's activations, layer by layer (engine.planning.one_device): what the
    # allocator holds after each layer's recompute beyond before it (its saved data too).
    meter = run.meter if mb == 0 else None
    held_from = ActivationMeter.allocated(dev.device) if meter is not None else 0
    with dev.rng_restored(run.saved.rng_states.get((span.start, mb))):
        for k, j in enumerate(span):
            if (
                replayer is not None
                and grad_state is not None
                and not (inp.is_args and k == 0)
                and not _state_too_large(run, carry)
            ):
                keys = replayer.backward_span(modules, slots, k, carry, data)
                if keys:
                    with annotate(f"{run.model.name}.re{j}-{span.stop - 1}.mb{mb}.replay"):
                        replayed = _replay_backward(
                            replayer, modules[k:], slots[k:], keys, carry, grad_state, data[k:]
                        )
                    if replayed:
                        break
                    replayer = None  # not captured: the rest runs as it is
            before = ActivationMeter.allocated(dev.device) if meter is not None else 0
            with RecomputeCtx(data[k]), annotate(f"{run.model.name}.re{j}.mb{mb}"):
                carry = _call_layer(modules[k], carry, inp.is_args and k == 0)
            if meter is not None:
                meter.record_layer(j, ActivationMeter.allocated(dev.device) - before)
    if not replayed:
        if meter is not None:
            meter.record_held(ActivationMeter.allocated(dev.device) - held_from)
        outs, _ = _flatten(carry)
        pairs = [
            (o, g)
            for o, g in zip(outs, grads_out, strict=False)
            if isinstance(o, torch.Tensor) and o.requires_grad and isinstance(g, torch.Tensor)
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
    return [t.grad if f else None for t, f in zip(leaves, flags, strict=True)]


class _LazyRecomputeData(Sequence[tuple[Any, ...] | None]):
    """The saved data of layers `span` in micro-batch `mb`, each uploaded when first read.

    An upload makes the compute stream wait for it: reading a layer's data just before its
    recompute lets its upload run under the recompute of the layer before (at long
    sequences a layer's saved attention is large; uploading a whole group's up front cost
    time: bench/RESULTS.md). A replayed span reads its layers' data together, as its graph needs it.
    """

    def __init__(self, run: RunState, dev: DeviceManager, span: range, mb: int) -> None:
        self._run, self._dev, self._span, self._mb = run, dev, span, mb
        self._uploaded: dict[int, tuple[Any, ...] | None] = {}

    def __len__(self) -> int:
        return len(self._span)

    def _get(self, k: int) -> tuple[Any, ...] | None:
        if k not in self._uploaded:
            self._uploaded[k] = _recompute_data(self._run, self._dev, self._span[k], self._mb)
        return self._uploaded[k]

    @overload
    def __getitem__(self, k: int) -> tuple[Any, ...] | None: ...
    @overload
    def __getitem__(self, k: slice) -> list[tuple[Any, ...] | None]: ...
    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            return [self._get(i) for i in range(len(self))[k]]
        return self._get(range(len(self))[k])


def _replay_backward(
    replayer: graphs.Replayer,
    modules: list[torch.nn.Module],
    slots: list[Any],
    keys: list[Any],
    carry: Any,
    grad_state: torch.Tensor,
    data: list[tuple[Any, ...] | None],
) -> bool:
    """Backpropagate `grad_state` through `modules` by replay, then on through autograd to
    whatever produced the carry's state; False where the graph could not be captured."""
    grad_in = replayer.run_backward(modules, slots, keys, carry, grad_state, data)
    if grad_in is None:
        return False
    state = graphs.state_of(carry)
    assert state is not None
    if state.requires_grad:
        if state.is_leaf:  # the job's saved input: its gradient goes to the group before
            state.grad = grad_in
        else:  # the output of layers recomputed below the replayed ones
            torch.autograd.backward(state, grad_in)
    return True


def download_param_grads(
    dev: DeviceManager, run: RunState, group: UploadedGroup, *, job_index: int
) -> None:
    """Download the group's accumulated parameter gradients into the host buffers.

    A parameter used by several jobs of this call (tied weights) is accumulated in launch
    order: a later job waits for the earlier job's download, adds the host value on its
    device, and downloads the sum. Before overwriting a host buffer, the job waits until
    the optimizer has folded the previous iteration's gradients out of it (grad_copied).
    """
    for host, holders in group.unique_params():
        if not host.requires_grad:
            continue
        grads = [ph.grad for ph in holders if ph.grad is not None]
        if not grads:
            # Unused in this job (a shared module's bias, say): a later job that uses it
            # must not wait for a download that never comes.
            issued = run.grad_issued.get((id(host), job_index))
            if issued is not None:
                issued.set()
            continue
        with dev.compute():
            g = grads[0]
            for extra in grads[1:]:
                g = g + extra
        claims = run.grad_claims.get(id(host), [job_index])
        pos = claims.index(job_index)
        if pos > 0:
            run.wait(run.grad_issued[(id(host), claims[pos - 1])])
        elif run.previous is not None:
            # Calls overlap and no step came between: add to the previous call's gradient,
            # once it is down.
            run.previous.wait_grads(host)
        pa = ParamAttribute.get(host)
        run.wait(run.grad_copied[pa.owner_layer])
        with pa.lock:
            if pa.accumulates():
                prev = async_h2d(dev, [pa.grad_event], [pa.grad_host])[0]
                with dev.compute():
                    g = g + prev
            if pa.grad_host is None:
                pa.grad_host = torch.empty(host.shape, dtype=host.dtype, pin_memory=dev.is_cuda)
            dev.wait_stream(dev.downstream, dev.compute_stream)
            with dev.on(dev.downstream):
                pa.grad_host.copy_(g.detach(), non_blocking=dev.is_cuda)
                dev.mark_used(g, dev.downstream)
            ev = dev.record(dev.downstream)
            pa.grad_event = ev
            pa.grad_pending = True
        run.add_end_event(ev)
        issued = run.grad_issued.get((id(host), job_index))
        if issued is not None:
            issued.set()
