"""RunState: what the jobs of one call share, and the waits between them.

A call's jobs (engine.run) run on device threads; they meet here: the micro-batches' data
on the host (`HostData`), grouped by lifetime: what the caller gave (`CallArgs`, read
only), what moves between the jobs and comes out of the call (`MicroBatchFlow`), what the
forward keeps for the recompute and the backward (`SavedForBackward`); then the tracker's
semaphores, the gradient claims that order downloads of a parameter shared by several
jobs, and, for overlapped calls, the uploads and gradients the optimizer thread waits on.
Every wait gives up (`RunAborted`) once another job failed.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from .attribute import ParamAttribute
from .device import DeviceManager, Job
from .errors import RoundPipeError
from .planning.one_device import ActivationMeter
from .scheduler import ModelExecutePlan, ModelTracker, RunType
from .threads import interruptible_wait
from .timer import IterTimer

if TYPE_CHECKING:
    from .roundpipe import RoundPipe
    from .run_config import FullRoundPipeRunConfig

__all__ = [
    "CallArgs",
    "HostData",
    "MicroBatchFlow",
    "RunAborted",
    "RunState",
    "SavedForBackward",
]

_POLL_S = 0.05


class RunAborted(RoundPipeError):
    """Another job of the same call failed; this one stopped early."""


@dataclass
class HostData:
    """A micro-batch's data on the host: flat leaves, their tree, the event that makes them valid."""

    leaves: list[Any]
    tree: Any
    event: Any = None
    is_args: bool = False  # (args, kwargs) of layer 0 rather than one layer output

    def rebuild(self, leaves: list[Any]) -> Any:
        return pytree.tree_unflatten(leaves, self.tree)


def _autocast_state() -> list[tuple[str, torch.dtype]]:
    """The autocast settings of the calling thread (autocast is thread-local)."""
    out = []
    for dev in ("cuda", "cpu"):
        if torch.is_autocast_enabled(dev):
            out.append((dev, torch.get_autocast_dtype(dev)))
    return out


@dataclass(slots=True)
class CallArgs:
    """What the caller gave besides the inputs; read only while the call runs."""

    # Which leaves of the caller's inputs want an input gradient (first layer only).
    requires_grad: list[bool]
    labels: list[Any]  # per micro-batch, the loss function's second argument
    loss_fn: Callable[[Any, Any], Any] | None
    return_outputs: bool  # a fused call also hands back the last layer's outputs
    # The calling thread's autocast (thread-local), entered again on every device thread.
    autocast: list[tuple[str, torch.dtype]]


@dataclass(slots=True)
class MicroBatchFlow:
    """Per micro-batch, what moves between the call's jobs and what the call returns."""

    # The output of the last layer group that ran forward (the caller's inputs at first).
    activations: list[HostData]
    # The gradient of the output of the last layer group that ran backward.
    output_grads: list[HostData | None]
    losses: list[HostData | None]
    outputs: list[HostData | None]
    input_grads: list[HostData | None]  # the caller's inputs' gradients

    @classmethod
    def starting(cls, inputs: list[HostData]) -> MicroBatchFlow:
        n = len(inputs)
        return cls(list(inputs), [None] * n, [None] * n, [None] * n, [None] * n)


@dataclass(slots=True)
class SavedForBackward:
    """What the forward keeps on the host for the recompute and the backward, by (layer,
    micro-batch) where the backward needs a layer's input."""

    inputs: dict[tuple[int, int], HostData] = field(default_factory=dict)
    rng_states: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # What layers passed to save_for_recompute (engine.context).
    recompute_data: dict[tuple[int, int], HostData] = field(default_factory=dict)
    # The layers' buffers as the forward left them (engine.transfer.download_buffers).
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)


class RunState:
    """What the jobs of one call share."""

    def __init__(
        self,
        model: RoundPipe,
        cfg: FullRoundPipeRunConfig,
        plan: ModelExecutePlan,
        run_type: RunType,
        inputs: list[HostData],
        input_requires_grad: list[bool],
        *,
        labels: list[Any] | None = None,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        return_outputs: bool = False,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.plan = plan
        self.run_type = run_type
        self.num_microbatch = len(inputs)
        self.enable_grad = run_type != "infer"
        self.tracker = ModelTracker(plan, model.num_layers, cfg.recompute_grain)
        # The fused tail's jobs (micro-batch i on job i mod tail_split); more jobs than
        # micro-batches would leave some with nothing to do.
        self.tail_split = min(plan.tail_split, len(inputs)) if run_type == "fused" else 1
        # Per micro-batch, since the tail's jobs take micro-batches out of order: the input
        # of the fused tail is ready, and the tail has handed back its input gradient.
        self.tail_input_ready = [threading.Event() for _ in inputs]
        self.tail_done = [threading.Event() for _ in inputs]
        self.call = CallArgs(
            requires_grad=input_requires_grad,
            labels=labels or [None] * self.num_microbatch,
            loss_fn=loss_fn,
            return_outputs=return_outputs,
            autocast=_autocast_state(),
        )
        self.flow = MicroBatchFlow.starting(inputs)
        self.saved = SavedForBackward()
        # The call's jobs: a failure's errors and the abort every wait watches, then what
        # join() finishes (device events, timers).
        self.abort = threading.Event()
        self.errors: list[BaseException] = []
        self.grad_claims: dict[int, list[int]] = {}
        self.grad_issued: dict[tuple[int, int], threading.Event] = {}
        self.end_events: list[Any] = []
        self.timers: list[IterTimer] = []
        self.jobs: list[Job] = []
        self._lock = threading.Lock()
        self.backward_done = False
        # Set on the first calls on one GPU: jobs measure their activations' memory there
        # (engine.planning.one_device).
        self.meter: ActivationMeter | None = None
        # Overlapped calls (RoundPipe overlap_calls): the call before this one, whose
        # gradient downloads this call's must follow, and per layer the uploads this call
        # will make from the host copies (the step may publish new weights over a layer's
        # host copy only once they are done).
        self.previous: RunState | None = None
        # The step events this call waits on, as they are at its launch (overlapped calls:
        # a later step gets new ones, see LayerAttribute.renew).
        attrs = getattr(model, "layer_attrs", [])
        self.param_copied = [a.param_copied for a in attrs]
        self.grad_copied = [a.grad_copied for a in attrs]
        self._uploads_left: Counter[int] = Counter()
        if run_type == "fused":
            for r in plan.fwd_plan[:-1]:
                self._uploads_left.update(r)
            for _ in range(self.tail_split):
                self._uploads_left.update(plan.fwd_plan[-1])
            for r in plan.bwd_plan:
                self._uploads_left.update(r)
        self._upload_events: dict[int, list[Any]] = {j: [] for j in self._uploads_left}
        self._uploads_done = {j: threading.Event() for j in self._uploads_left}

    # ---- waiting with abort -------------------------------------------------------------
    def wait(self, waitable: threading.Semaphore | threading.Event) -> None:
        """Block on a semaphore or event, giving up when another job failed."""
        while True:
            ok = (
                waitable.acquire(timeout=_POLL_S)
                if isinstance(waitable, threading.Semaphore)
                else waitable.wait(timeout=_POLL_S)
            )
            if ok:
                return
            if self.abort.is_set():
                raise RunAborted("aborted because another job of this call failed")

    def add_end_event(self, ev: Any) -> None:
        if ev is not None:
            with self._lock:
                self.end_events.append(ev)

    # ---- gradient ordering for parameters shared by several jobs -------------------------
    def claim_grads(self, job_index: int, layer_ids: range) -> None:
        """Register, in launch order, that a job will produce grads for these layers' params."""
        seen: set[int] = set()
        for j in layer_ids:
            for p, _ in self.model.layer_params[j]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                self.grad_claims.setdefault(id(p), []).append(job_index)
                self.grad_issued[(id(p), job_index)] = threading.Event()

    # ---- launching and finishing -----------------------------------------------------------
    def launch(self, dev: DeviceManager, fn: Callable[..., None], *args: Any, name: str) -> None:
        def guarded(d: DeviceManager, *a: Any) -> None:
            try:
                fn(d, self, *a)
            except RunAborted:
                raise
            except BaseException as exc:
                with self._lock:
                    self.errors.append(exc)
                self.abort.set()
                raise

        self.jobs.append(dev.submit(guarded, *args, name=name))

    def join(self) -> None:
        """Wait for every job and its device work; raise the first job error."""
        for job in self.jobs:
            interruptible_wait(job.done.wait)
        if self.errors:
            exc = self.errors[0]
            raise exc
        for ev in self.end_events:
            ev.synchronize()
        for t in self.timers:
            t.flush()

    # ---- overlapped calls --------------------------------------------------------------------
    def note_upload(self, layer_ids: range, event: Any) -> None:
        """A job uploaded these layers from the host copies (complete after `event`)."""
        with self._lock:
            for j in layer_ids:
                if j not in self._uploads_left:
                    continue
                self._upload_events[j].append(event)
                self._uploads_left[j] -= 1
                if self._uploads_left[j] == 0:
                    self._uploads_done[j].set()

    def wait_uploads(self, layer_ids: Iterable[int]) -> None:
        """Block until this call's uploads of these layers are done (the optimizer thread,
        before publishing new weights into their host copies)."""
        for j in layer_ids:
            done = self._uploads_done.get(j)
            if done is None:
                continue
            self.wait(done)
            for ev in self._upload_events[j]:
                if ev is not None:
                    ev.synchronize()

    def wait_grads(self, param: torch.nn.Parameter) -> None:
        """Block until this call's gradient of `param` is in its host buffer (the optimizer
        thread before folding it; the next call before adding to it)."""
        claims = self.grad_claims.get(id(param))
        if not claims:
            return
        self.wait(self.grad_issued[(id(param), claims[-1])])
        ev = ParamAttribute.get(param).grad_event
        if ev is not None:
            ev.synchronize()

    def wait_losses(self) -> None:
        """Block until every micro-batch's loss (and output, if asked for) is on the host;
        the backward jobs may still run. Raises the error of a job that failed."""
        try:
            for done in self.tail_done:
                self.wait(done)
        except RunAborted:
            self.join()  # raises the failed job's own error
            raise
        flow = self.flow
        acts = [*flow.losses, *(flow.outputs if self.call.return_outputs else [])]
        for act in acts:
            if act is not None and act.event is not None:
                act.event.synchronize()

    # ---- micro-batch inputs ------------------------------------------------------------------
    def wait_forward_input(self, group: int, mb: int) -> HostData:
        if group > 0:
            self.wait(self.tracker.fwd_sem[group - 1])
        return self.flow.activations[mb]

    def wait_tail_input(self, mb: int) -> HostData:
        if len(self.plan.fwd_plan) > 1:
            self.wait(self.tail_input_ready[mb])
        return self.flow.activations[mb]

    def tail_micro_batches(self, part: int) -> range:
        """The micro-batches of the fused tail's job `part`."""
        return range(part, self.num_microbatch, self.tail_split)

    def fused_job_index(self, part: int) -> int:
        """Launch position of the fused tail's job `part` (gradient accumulation order)."""
        return len(self.plan.fwd_plan) - 1 + part

    def backward_job_index(self, bwd_id: int) -> int:
        """Launch position of backward group `bwd_id` among this call's jobs."""
        extra = self.tail_split - 1 if self.run_type == "fused" else 0
        return len(self.plan.fwd_plan) + extra + bwd_id
