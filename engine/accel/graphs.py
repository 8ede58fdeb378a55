"""Replayed layer work: CUDA graphs of a job's layers, captured once, replayed per micro-batch.

Over ~600 lines only with this docstring: the replay contract, the slots and the Replayer
that captures and replays are one mechanism.

Why: one process issues the work of every GPU it drives, and a decoder layer's call through
torch.compile and autograd costs the host a fixed time whatever the layer's size, about a
hundred times what replaying a captured CUDA graph of the same work costs
(bench/layer_issue.py; the figures are in bench/RESULTS.md). With many GPUs or many
micro-batches that host time, not the GPUs, bounded a step.

Which calls replay: a layer opts in with a method `rp_replay_key(carry)`, called on the
layer's input in the context the call runs in (grad mode, autocast, the engine's
ForwardCtx / RecomputeCtx). It returns None where the call must run as it is, else a
hashable key, and a key promises that:
1. the call reads tensors only from the carry's state (the carry itself if it is a tensor,
   else `carry[0]`), the layer's parameters and buffers and its recompute data, and returns
   the carry with the state replaced by a tensor of the same shape, dtype and device, every
   other item passed on unchanged;
2. its device work can be captured in a CUDA graph: no host synchronisation, no random
   numbers, no buffer changes, `save_for_recompute` with tensors only;
3. layers whose calls give equal keys compute the same function of those tensors, their
   parameters and buffers having equal shapes and dtypes in the same order.
The presets' decoder layers implement it (`engine.models._decoder.DecoderLayer`).

Slots: a graph reads and writes fixed addresses, while an upload used to put a layer's
tensors anywhere. Layers that may replay are uploaded into slots instead: per device two
sets of them (jobs alternate between the sets, so the next job's upload still overlaps
this job's compute), a slot holding one layer's parameters and buffers and the gradient
buffers its backward accumulates into. A graph is keyed by the slots its layers used, so
a graph captured through layer 3's replica replays for layer 9 uploaded into those slots.

What replays, per micro-batch (engine.run):
- forward jobs: runs of replayable layers without grad (a run ends where the backward needs
  a layer's input), saving what the layers save for their recompute;
- backward jobs: the replayable top of a layer group: recompute with grad and backward in
  one graph, the parameter gradients accumulated in the slots' buffers; layers below it
  (the embedding) recompute and backpropagate as before, from the graph's input gradient.
The fused tail (the head with its loss) runs as before. Inputs are copied into the graph's
static tensors and outputs cloned out of them on the compute stream, so transfers of one
micro-batch never race the next replay. The graphs of a device share one memory pool; its
replays all run on the compute stream, one at a time.

Results are bit for bit those of the calls the graphs were captured from (same kernels);
`ENABLED = False` runs every call as it is.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..context import ForwardCtx, RecomputeCtx
from ..errors import RoundPipeError
from ..transfer import AFTER_UPLOAD_HOOK

if TYPE_CHECKING:
    from ..device import DeviceManager
    from ..transfer import LayerReplica

__all__ = [
    "ENABLED",
    "MAX_GRAPHS_PER_DEVICE",
    "REPLAY_MAX_TOKENS",
    "Replayer",
    "Slot",
    "drop_all_slots",
    "layer_may_replay",
    "replayer",
    "state_of",
    "stats",
    "too_many_tokens",
    "with_state",
]

log = logging.getLogger(__name__)

# Engine-wide switch, read at every job: False runs every layer call as it is.
ENABLED: bool = True
# Micro-batches whose state has more tokens (its elements over the last dimension) than
# this run as they are: their GPU time dwarfs the host's, and a graph keeps its
# activations in a pool of its own, beside the allocator's memory. At 32,768 tokens a
# micro-batch replay gained nothing on one GPU and cost GPU memory; from 16,384 tokens down
# the host's issue time is what grows (bench/RESULTS.md). None: no limit.
REPLAY_MAX_TOKENS: int | None = 16384
# Distinct graphs per device (slots x layer keys x passes); past it, new ones run as they are.
MAX_GRAPHS_PER_DEVICE = 64
# Tests: replay on virtual CPU devices too, with an eager stand-in for the graph that runs
# the captured function again at each replay (the slots, static tensors and stitching are
# then exercised without a GPU).
REPLAY_ON_CPU: bool = False

_counts = {"captures": 0, "replays": 0, "failed": 0}
_counts_lock = threading.Lock()


def _count(name: str) -> None:
    with _counts_lock:
        _counts[name] += 1


def stats() -> dict[str, int]:
    """Graphs captured, replays and failed captures in this process so far."""
    with _counts_lock:
        return dict(_counts)


def state_of(carry: Any) -> Tensor | None:
    """The tensor a replayable layer transforms: the carry, or its first item."""
    if isinstance(carry, Tensor):
        return carry
    if isinstance(carry, (tuple, list)) and carry and isinstance(carry[0], Tensor):
        return carry[0]
    return None


def with_state(carry: Any, state: Tensor) -> Any:
    """`carry` with its state replaced by `state`."""
    if isinstance(carry, Tensor):
        return state
    return type(carry)((state, *carry[1:]))


def layer_may_replay(layer: nn.Module) -> bool:
    """Whether a layer opts in to replay (its calls still decide, see the module docstring).

    Layers with an after-upload hook (LoRA folds its adapters into the uploaded weight
    there) are left out: the fold would have to be part of the upload into a slot.
    """
    if not callable(getattr(layer, "rp_replay_key", None)):
        return False
    return not any(hasattr(m, AFTER_UPLOAD_HOOK) for m in layer.modules())


def too_many_tokens(state: Tensor) -> bool:
    """Whether a state is over REPLAY_MAX_TOKENS (its elements over its last dimension)."""
    if REPLAY_MAX_TOKENS is None:
        return False
    tokens = state.numel() // max(state.shape[-1], 1) if state.dim() else 1
    return tokens > REPLAY_MAX_TOKENS


# ---- slots ------------------------------------------------------------------------------


@dataclass(eq=False)
class Slot:
    """Device tensors one layer is uploaded into, so graphs find it at fixed addresses.

    `weights_free` / `grads_free`: events after which the last job using the slot no longer
    reads its weights (compute stream) / its gradient buffers (download stream).
    """

    number: int
    params: list[Tensor]
    buffers: list[Tensor]
    requires_grad: list[bool]
    grads: list[Tensor | None] | None = None  # allocated by the first backward job
    weights_free: Any = None
    grads_free: Any = None

    def gradient_buffers(self) -> list[Tensor | None]:
        """The gradient buffers (allocated on first use), None for frozen parameters."""
        if self.grads is None:
            self.grads = [
                torch.zeros_like(p) if rg else None
                for p, rg in zip(self.params, self.requires_grad, strict=True)
            ]
        return self.grads


def _signature(rep: LayerReplica) -> tuple[Any, ...]:
    """What a slot must match: the replica's type and its tensors' shapes and dtypes."""
    params = tuple((tuple(host.shape), host.dtype, host.requires_grad) for host, _ in rep.params)
    buffers = tuple((tuple(host.shape), host.dtype) for host, _ in rep.buffers)
    return (type(rep.module), params, buffers)


# ---- graphs -------------------------------------------------------------------------------

# A graph's work: body(capturing, layers) runs the layers on the segment's static tensors
# and returns its output tensor; `capturing` is False for the uncaptured warm-up run.
_Body = Callable[[bool, Sequence[nn.Module]], Tensor]


class _CudaGraph:
    """A captured CUDA graph; `replay` returns the capture's outputs (the same tensors)."""

    def __init__(self, owner: Replayer) -> None:
        self.owner = owner
        self.graph = torch.cuda.CUDAGraph()
        self.result: Any = None

    def capture(self, body: _Body, modules: Sequence[nn.Module]) -> None:
        """Run the body once uncaptured (compiles, sets up kernels and handles on the
        capture stream), then capture it; raises where the work cannot be captured."""
        dev, stream = self.owner.dev, self.owner.stream
        stream.wait_stream(dev.compute_stream)
        with torch.cuda.stream(stream):
            body(False, modules)
            # thread_local: the other device threads keep running (and synchronising)
            # while this one captures.
            self.graph.capture_begin(pool=self.owner.pool, capture_error_mode="thread_local")
            try:
                self.result = body(True, modules)
            finally:
                self.graph.capture_end()
        dev.compute_stream.wait_stream(stream)

    def replay(self, modules: Sequence[nn.Module]) -> Any:
        """Run the captured work (on the slots, whichever layers are bound to them)."""
        self.graph.replay()
        return self.result


class _EagerGraph:
    """The stand-in on virtual CPU devices (tests): runs the body again at each replay,
    through the replaying job's layers (bound to the same slots the graph would read)."""

    def __init__(self, owner: Replayer) -> None:
        self.body: _Body | None = None

    def capture(self, body: _Body, modules: Sequence[nn.Module]) -> None:
        self.body = body

    def replay(self, modules: Sequence[nn.Module]) -> Any:
        assert self.body is not None
        return self.body(True, modules)


@dataclass(eq=False)
class _Segment:
    """One graph and its static tensors."""

    graph: _CudaGraph | _EagerGraph
    state_in: Tensor
    grad_out: Tensor | None = None  # backward: the output state's gradient
    saved_in: list[tuple[Tensor, ...] | None] = field(default_factory=list)  # recompute data
    saved_out: list[tuple[Tensor, ...] | None] = field(default_factory=list)  # forward saves


_MISSING = object()


@contextmanager
def _grads_unbound(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Parameters without .grad meanwhile (a warm-up must not add to the slots' buffers)."""
    params = [p for m in modules for p in m.parameters()]
    kept = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, kept, strict=True):
            p.grad = g


def _autocast_key() -> tuple[Any, ...]:
    return tuple(
        (dev, torch.get_autocast_dtype(dev))
        for dev in ("cuda", "cpu")
        if torch.is_autocast_enabled(dev)
    )


def _metas(data: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    if data is None:
        return None
    return tuple((tuple(t.shape), t.dtype) for t in data)


def _noop_save(*_: Any) -> None:
    """Stands in for a save function while a key is asked for (nothing is run)."""


class Replayer:
    """The slots, graphs, memory pool and capture stream of one device."""

    def __init__(self, dev: DeviceManager) -> None:
        self.dev = dev
        self.is_cuda = dev.is_cuda
        self.stream = torch.cuda.Stream(dev.device) if dev.is_cuda else None
        self.pool = torch.cuda.graph_pool_handle() if dev.is_cuda else None
        self._sets: dict[tuple[Any, int], list[Slot]] = {}
        self._jobs = 0
        self._numbers = itertools.count()
        self._graphs: dict[Hashable, _Segment | None] = {}
        self._warned = False
        # acquire() and _capture() run on this device's worker thread, drop_slots() on any
        # thread (a job on another device that saw a micro-batch over the replay limit):
        # without the lock a drop between two layers of one acquire left it indexing an
        # emptied set (the IndexError of 4-GPU runs).
        self._lock = threading.Lock()

    # ---- slots --------------------------------------------------------------------------
    def acquire(
        self, replicas: Sequence[LayerReplica], wanted: Sequence[bool]
    ) -> list[Slot | None]:
        """Slots for a job's layers (None where not `wanted`), from the set of this job's
        parity: consecutive jobs on a device use different sets."""
        if not any(wanted):
            return [None] * len(replicas)
        with self._lock:
            parity = self._jobs % 2
            self._jobs += 1
            used: dict[Any, int] = {}
            out: list[Slot | None] = []
            for rep, want in zip(replicas, wanted, strict=True):
                if not want:
                    out.append(None)
                    continue
                sig = _signature(rep)
                slots = self._sets.setdefault((sig, parity), [])
                k = used.get(sig, 0)
                used[sig] = k + 1
                if k == len(slots):
                    slots.append(self._new_slot(rep))
                out.append(slots[k])
            return out

    def _new_slot(self, rep: LayerReplica) -> Slot:
        device = self.dev.device
        return Slot(
            number=next(self._numbers),
            params=[torch.empty(h.shape, dtype=h.dtype, device=device) for h, _ in rep.params],
            buffers=[torch.empty(h.shape, dtype=h.dtype, device=device) for h, _ in rep.buffers],
            requires_grad=[h.requires_grad for h, _ in rep.params],
        )

    def drop_slots(self) -> None:
        """Forget the slots and graphs (their memory returns once in-flight work is done).

        Safe from any thread: a job holding slots of the dropped sets keeps them until it
        ends. What this drops is freed with this device current, whichever thread asks."""
        with self._lock:
            dropped = (self._sets, self._graphs)
            self._sets, self._graphs = {}, {}
        with torch.cuda.device(self.dev.device) if self.is_cuda else _nothing():
            del dropped

    # ---- which layers replay ------------------------------------------------------------
    def _span(
        self,
        modules: Sequence[nn.Module],
        slots: Sequence[Slot | None],
        start: int,
        carry: Any,
        context: Callable[[int], Any],
        stop_before: Callable[[int], bool],
    ) -> list[Hashable]:
        """Keys of the layers from `start` that replay as one graph on input `carry`
        (empty: run layer `start` as it is). Every layer of a run keeps the carry's shape,
        so the later layers' keys are asked on the same input."""
        state = state_of(carry)
        if state is None or too_many_tokens(state):
            return []
        keys: list[Hashable] = []
        for k in range(start, len(modules)):
            if k > start and stop_before(k):
                break
            if slots[k] is None:
                break
            with context(k):
                key = modules[k].rp_replay_key(carry)  # type: ignore[operator]
            if key is None:
                break
            keys.append(key)
        return keys

    def forward_span(
        self,
        modules: Sequence[nn.Module],
        slots: Sequence[Slot | None],
        start: int,
        carry: Any,
        *,
        saving: bool,
        stop_before: Callable[[int], bool],
    ) -> list[Hashable]:
        """Keys of the no-grad forward run from layer `start` (see `_span`)."""
        save = _noop_save if saving else None
        return self._span(modules, slots, start, carry, lambda _: ForwardCtx(save), stop_before)

    def backward_span(
        self,
        modules: Sequence[nn.Module],
        slots: Sequence[Slot | None],
        start: int,
        carry: Any,
        recompute_data: Sequence[tuple[Any, ...] | None],
    ) -> list[Hashable]:
        """Keys of the recompute from layer `start` to the last layer, all of which must
        replay (the graph backpropagates from the group's output)."""
        keys = self._span(
            modules,
            slots,
            start,
            carry,
            lambda k: RecomputeCtx(recompute_data[k]),
            lambda _: False,
        )
        return keys if start + len(keys) == len(modules) else []

    # ---- capture and replay ----------------------------------------------------------------
    def _new_graph(self) -> _CudaGraph | _EagerGraph:
        return _CudaGraph(self) if self.is_cuda else _EagerGraph(self)

    def _capture(self, key: Hashable, make: Callable[[], _Segment]) -> _Segment | None:
        """The segment of `key`, captured on first use; None where it cannot be."""
        with self._lock:
            seg = self._graphs.get(key, _MISSING)
            count = len(self._graphs)
        if seg is not _MISSING:
            return seg  # type: ignore[return-value]
        if count >= MAX_GRAPHS_PER_DEVICE:
            if not self._warned:
                self._warned = True
                log.warning(
                    "%s: %d graphs captured; further layer groups run without replay",
                    self.dev.name,
                    count,
                )
            return None
        try:
            seg = make()
        except (RuntimeError, RoundPipeError) as exc:
            # Work that cannot be captured (an op that synchronises, say) runs as it is.
            _count("failed")
            log.warning(
                "%s: layer group runs without replay (capture failed: %s)", self.dev.name, exc
            )
            seg = None
        else:
            _count("captures")
        with self._lock:
            self._graphs[key] = seg
        return seg

    def run_forward(
        self,
        modules: Sequence[nn.Module],
        slots: Sequence[Slot],
        keys: Sequence[Hashable],
        carry: Any,
        save_fns: Sequence[Callable[..., None]] | None,
    ) -> Any | None:
        """The no-grad forward of `modules` on `carry` by replay (None: run them as they
        are); what each layer saves for its recompute goes to its `save_fns` entry."""
        state = state_of(carry)
        assert state is not None
        key = (
            "fwd",
            tuple(s.number for s in slots),
            tuple(keys),
            save_fns is not None,
            _autocast_key(),
        )

        def make() -> _Segment:
            seg = _Segment(self._new_graph(), torch.empty_like(state))
            seg.saved_out = [None] * len(modules)
            seg.state_in.copy_(state)

            def body(capturing: bool, layers: Sequence[nn.Module]) -> Tensor:
                cur = with_state(carry, seg.state_in)
                for k, module in enumerate(layers):

                    def save(*data: Any, k: int = k) -> None:
                        if not all(isinstance(t, Tensor) for t in data):
                            raise RoundPipeError("replayed layers may save tensors only")
                        seg.saved_out[k] = tuple(data)

                    with ForwardCtx(save if save_fns is not None else None):
                        cur = module(cur)
                out = state_of(cur)
                assert out is not None
                return out

            seg.graph.capture(body, modules)
            return seg

        replayed = self._replay(key, make, modules, lambda seg: seg.state_in.copy_(state))
        if replayed is None:
            return None
        out, seg = replayed
        if save_fns is not None:
            with self.dev.compute():
                for fn, data in zip(save_fns, seg.saved_out, strict=True):
                    if data is not None:
                        fn(*(t.clone() for t in data))
        return with_state(carry, out)

    def run_backward(
        self,
        modules: Sequence[nn.Module],
        slots: Sequence[Slot],
        keys: Sequence[Hashable],
        carry: Any,
        grad_out: Tensor,
        recompute_data: Sequence[tuple[Any, ...] | None],
    ) -> Tensor | None:
        """Recompute `modules` from `carry` with grad and backpropagate `grad_out` by
        replay; returns the input state's gradient (None: run them as they are). The
        parameters' gradients are added to their .grad (the slots' buffers)."""
        state = state_of(carry)
        assert state is not None
        key = (
            "bwd",
            tuple(s.number for s in slots),
            tuple(keys),
            tuple(_metas(d) for d in recompute_data),
            _autocast_key(),
        )

        def make() -> _Segment:
            seg = _Segment(
                self._new_graph(),
                torch.empty_like(state, requires_grad=False),
                grad_out=torch.empty_like(grad_out, dtype=state.dtype),
                saved_in=[
                    None if d is None else tuple(torch.empty_like(t) for t in d)
                    for d in recompute_data
                ],
            )
            self._fill(seg, state, grad_out, recompute_data)

            def body(capturing: bool, layers: Sequence[nn.Module]) -> Tensor:
                with _grads_unbound(layers) if not capturing else _nothing():
                    leaf = seg.state_in.detach().requires_grad_(True)
                    cur = with_state(carry, leaf)
                    for module, data in zip(layers, seg.saved_in, strict=True):
                        with RecomputeCtx(data):
                            cur = module(cur)
                    out = state_of(cur)
                    assert out is not None and seg.grad_out is not None
                    torch.autograd.backward(out, seg.grad_out)
                if leaf.grad is None:
                    raise RoundPipeError("the replayed layers do not depend on their input")
                return leaf.grad

            seg.graph.capture(body, modules)
            return seg

        replayed = self._replay(
            key, make, modules, lambda seg: self._fill(seg, state, grad_out, recompute_data)
        )
        return None if replayed is None else replayed[0]

    def _replay(
        self,
        key: Hashable,
        make: Callable[[], _Segment],
        modules: Sequence[nn.Module],
        fill: Callable[[_Segment], Any],
    ) -> tuple[Tensor, _Segment] | None:
        """Replay the segment of `key` (captured by `make` on first use) after `fill` has
        copied the micro-batch's inputs into it; returns a clone of its output (the next
        replay overwrites the static one) and the segment. None where it is not captured."""
        seg = self._capture(key, make)
        if seg is None:
            return None
        with self.dev.compute():
            fill(seg)
            out = seg.graph.replay(modules).clone()
        _count("replays")
        return out, seg

    @staticmethod
    def _fill(
        seg: _Segment,
        state: Tensor,
        grad_out: Tensor,
        recompute_data: Sequence[tuple[Any, ...] | None],
    ) -> None:
        """Copy a micro-batch's inputs into the backward graph's static tensors."""
        seg.state_in.copy_(state.detach())
        assert seg.grad_out is not None
        seg.grad_out.copy_(grad_out)
        for static, data in zip(seg.saved_in, recompute_data, strict=True):
            if static is not None and data is not None:
                for s, t in zip(static, data, strict=True):
                    s.copy_(t)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


_REPLAYERS: weakref.WeakKeyDictionary[DeviceManager, Replayer] = weakref.WeakKeyDictionary()
_replayers_lock = threading.Lock()


def replayer(dev: DeviceManager) -> Replayer | None:
    """The device's Replayer, or None where layers do not replay (switched off, or a
    virtual CPU device outside the tests)."""
    if not ENABLED or not (dev.is_cuda or REPLAY_ON_CPU):
        return None
    rep = _REPLAYERS.get(dev)
    if rep is None:
        with _replayers_lock:
            rep = _REPLAYERS.get(dev)
            if rep is None:
                rep = Replayer(dev)
                _REPLAYERS[dev] = rep
    return rep


def drop_all_slots() -> None:
    """Forget every device's slots and graphs (see `Replayer.drop_slots`)."""
    with _replayers_lock:
        for rep in list(_REPLAYERS.values()):
            rep.drop_slots()
