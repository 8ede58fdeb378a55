"""Folding a call's gradients into the optimizer's while its backward still runs (issue 44).

The step's first work used to be the fold of every downloaded gradient into the optimizer-side
one (an fp32 copy per parameter) and, with clipping, a pass over all of them for the norm.
With `step_staleness=0` both stood between the end of the backward and the next call's
first layer (which waits for layer 0's update). Here a kernel queued on the optimizer thread
by each `forward_backward` takes the layers from the last down, the order the backward
downloads their gradients: once a parameter's gradient of this call is down
(`RunState.wait_grads`) it makes ready the gradient the optimizer will read
(`ParamAttribute.fold_ahead`) and keeps its sum of squares with it (engine.optim._sumsq), one
C call per layer. Where the optimizer-side gradient would be a plain copy of the download,
the step hands the download itself over as a deferred copy (engine.optim._deferred):
engine.optim.Adam reads the half-precision buffer in place, so there is no copy to make and
the sum is taken over the download (2 bytes an element, widened in registers: the same sums
as over the fp32 copy). Only where a step_fn read a deferred copy before (a torch optimizer,
say) does the kernel make the copy, which the step's fold then takes as it is
(`fold_grad`). `Adam.grad_norm` adds the kept sums: what is left before layer 0 can be
published is the sum of the kept sums, the clip coefficient and layer 0's update, which
reads 2 bytes of gradient an element instead of 4. The call's end still waits for the last
gradient to land and be summed: the tied embedding's, downloaded last, now one read of it.

Nothing changes a bit of the results. A kept sum or a copy is taken only if the download
buffer (and the copy) were not written since (version counters): a second call before the
step (gradient accumulation) adds its download to the buffer, so the step sums or refolds
unless that call's own kernel did again, which it does once its download is down. A
gradient the optimizer kept from the step before (a step_fn that does not zero it) is left
to the step's fold, which adds to it. The kept sums are the C library's per-tensor sums,
which do not depend on how the tensors are batched, on the ISA path or on the gradient's
dtype (half or its fp32 copy), and the norm adds them with math.fsum, whose result does not
depend on their order.

The kernel runs on the optimizer thread, after the step before (so a step_fn's zero_grad has
dropped the gradients it read, or the kernel leaves them to the step), and `forward_backward` waits for it as it waits for that step
(synchronize_optim), so the next call's downloads never meet it. Overlapped calls fold in the
step kernel already (publish_weights_take_grads waits for each gradient).

Data parallel folds as it reduces, so its kernel is the reduction itself
(`DataParallel.reduce_ahead`): each layer's gradients, summed across ranks (sharded: each
rank keeping its rows) as soon as the backward has downloaded them, the last layer first on
every rank, so the collectives meet in one order. The step then finds nothing left to
reduce. Before it, a step with `step_staleness=0` started with every layer's reduction (on
2 ranks of 2 H200s, the service's 1.7B job ran at 1.24x one rank).
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING

import torch

from .optim import _sumsq
from .optim_stream import launch_optim_kernel
from .run_state import RunAborted

if TYPE_CHECKING:
    from .roundpipe import RoundPipe
    from .run_state import RunState

__all__ = ["FOLD_STATS", "fold_ahead_of_step"]

FOLD_STATS = 64  # calls whose fold-ahead times a model keeps (RoundPipe.fold_phases)


def fold_ahead_of_step(model: RoundPipe, run: RunState) -> dict[str, float] | None:
    """Queue the fold of `run`'s gradients on the optimizer thread (see the module doc;
    with data parallel, their reduction); nothing when the model's `_fold_ahead` switch is
    off.

    Returns the call's entry in `model.fold_phases`, which the kernel fills: "fold_s", the
    seconds spent copying (where a copy is made) and summing; "params", the gradients made
    ready; the caller adds
    "end_wait_s", how long the call's end waited for the optimizer thread (this kernel and,
    with staleness one, the step before).
    """
    if not model.__dict__.get("_fold_ahead", True):
        return None
    phases = model.__dict__.get("fold_phases")
    if phases is None:
        phases = collections.deque(maxlen=FOLD_STATS)
        object.__setattr__(model, "fold_phases", phases)
    stats = {"fold_s": 0.0, "params": 0.0, "end_wait_s": 0.0}
    kernel = _fold_kernel if model._dp is None else _reduce_kernel
    launch_optim_kernel(kernel, model, run, stats)  # may raise a failed step's error
    phases.append(stats)
    return stats


def _fold_kernel(model: RoundPipe, run: RunState, stats: dict[str, float]) -> None:
    """On the optimizer thread: per layer, last first, wait for each trainable parameter's
    gradient of this call, make ready what the optimizer will read (the download itself
    where the step defers the copy, else the copy), and keep the layer's sums of squares."""
    keep_sums = _sumsq.can_keep()
    try:
        for params in reversed(model._params_by_owner()):
            grads: list[torch.Tensor] = []
            for p, pa in params:
                if pa.optim is None:
                    continue
                run.wait_grads(p)
                t0 = time.perf_counter()
                grad = pa.fold_ahead()
                if grad is not None:
                    grads.append(grad)
                stats["fold_s"] += time.perf_counter() - t0
            if grads and keep_sums:
                t0 = time.perf_counter()
                _sumsq.keep(grads)
                stats["fold_s"] += time.perf_counter() - t0
            stats["params"] += len(grads)
    except RunAborted:
        return  # the call failed (it raises its own error); the step folds what is left


def _reduce_kernel(model: RoundPipe, run: RunState, stats: dict[str, float]) -> None:
    """On the optimizer thread (data parallel): reduce each layer's gradients across ranks
    once this call has downloaded them (DataParallel.reduce_ahead)."""
    assert model._dp is not None
    try:
        model._dp.reduce_ahead(run.wait_grads, stats)
    except RunAborted:
        # This rank's call failed; the other ranks' kernels wait in a collective until the
        # group's timeout names this rank, as any collective a dead rank left does.
        return
