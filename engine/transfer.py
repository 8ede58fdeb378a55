"""Uploads and downloads between host memory and devices.

Layers are uploaded into per-device replicas: a copy of the layer's module structure whose
parameters and buffers are placeholders, rebound to freshly uploaded device tensors for
each job, so the host model is never touched by a device thread. Activations travel as
flat lists of leaves (tensors and plain values).

torch's caching pinned-host allocator rounds every request up to a power of two, so a
1.25 GiB hidden state would take 2 GiB of pinned memory. The engine's own big activations
(never the user's) are therefore kept as HostPieces: pinned buffers whose sizes are powers
of two, which the allocator serves at their exact size and reuses across iterations.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .device import DeviceManager
from .memory import packed_form

if TYPE_CHECKING:
    from .accel.graphs import Slot

__all__ = [
    "PIECES_MIN_BYTES",
    "PIECE_GRANULE_BYTES",
    "HostPieces",
    "LayerReplica",
    "UploadedGroup",
    "async_d2h",
    "async_h2d",
    "download_buffers",
    "kernel_written_buffers",
    "make_replica",
    "piece_sizes",
    "release_group",
    "upload_layers",
]

log = logging.getLogger(__name__)


# A submodule with a method of this name has it called after each upload, on the compute
# stream, with the freshly uploaded device tensors bound (engine.adapters.lora merges its adapters
# into the device copy of the frozen weight there).
AFTER_UPLOAD_HOOK = "rp_after_upload"

# Downloads with pieces=True of tensors at least this big go into HostPieces. Below it a
# single pinned tensor wastes less than this in rounding, and small tensors are many.
# memory_plan._PIECES_MIN_BYTES mirrors it.
PIECES_MIN_BYTES = 64 << 20
# Piece sizes are multiples of this (and powers of two): at most one granule is wasted,
# and a tensor needs at most one piece per set bit of its size in granules.
# memory_plan._PIECE_GRANULE_BYTES mirrors it.
PIECE_GRANULE_BYTES = 2 << 20


@dataclass
class LayerReplica:
    """A device-side twin of one host layer; tensors are rebound on every upload."""

    module: nn.Module
    params: list[tuple[nn.Parameter, nn.Parameter]]  # (host, placeholder)
    buffers: list[tuple[torch.Tensor, torch.Tensor]]  # (host, placeholder)
    after_upload: list[Any] = field(default_factory=list)  # AFTER_UPLOAD_HOOK methods
    # id of a host buffer that torch's own kernel writes in place without bumping its
    # version counter (the running statistics of batch and instance norms) -> its host
    # module: downloaded after every job of that module in training mode, since no changed
    # version shows the writes.
    kernel_written: dict[int, nn.Module] = field(default_factory=dict)
    # (host submodule, its twin): the twins follow the host's train()/eval() at every job
    modules: list[tuple[nn.Module, nn.Module]] = field(default_factory=list)
    wrote_buffers: bool = False  # a job has downloaded a buffer this layer changed

    def follow_training_mode(self) -> None:
        """Set each twin's `training` to its host module's (a replica is made once, the
        mode may change between calls: dropout and batch norm read it)."""
        for host, twin in self.modules:
            if twin.training != host.training:
                twin.training = host.training


def make_replica(layer: nn.Module) -> LayerReplica:
    """Copy `layer`'s structure with empty placeholders instead of its tensors."""
    memo: dict[int, Any] = {}
    params: list[tuple[nn.Parameter, nn.Parameter]] = []
    buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
    for p in layer.parameters():
        if id(p) not in memo:
            ph = nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
            memo[id(p)] = ph
            params.append((p, ph))
    for b in layer.buffers():
        if id(b) not in memo:
            bh = torch.empty(0, dtype=b.dtype)
            memo[id(b)] = bh
            buffers.append((b, bh))
    module = copy.deepcopy(layer, memo)
    hooks = [
        getattr(m, AFTER_UPLOAD_HOOK) for m in module.modules() if hasattr(m, AFTER_UPLOAD_HOOK)
    ]
    pairs = list(zip(layer.modules(), module.modules(), strict=True))
    return LayerReplica(module, params, buffers, hooks, kernel_written_buffers(layer), pairs)


def kernel_written_buffers(layer: nn.Module) -> dict[int, nn.Module]:
    """id -> module of the running mean and variance of `layer`'s batch and instance norms:
    the batch_norm kernel updates them in place (in training mode) and leaves their version
    counter as it was (num_batches_tracked is a Python `+= 1`, which counts)."""
    return {
        id(b): m
        for m in layer.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
        for b in (m.running_mean, m.running_var)
        if b is not None
    }


@dataclass
class UploadedGroup:
    """A layer group resident on a device for one job."""

    layer_ids: list[int]
    replicas: list[LayerReplica]
    device_tensors: dict[int, torch.Tensor] = field(default_factory=dict)  # id(host) -> device
    buffer_versions: dict[int, int] = field(default_factory=dict)  # id(host buffer) -> _version
    slots: list[Slot | None] = field(default_factory=list)  # per replica (engine.accel.graphs)
    uploaded: Any = None  # event: the upload from the host copies is done (None on CPU)

    @property
    def modules(self) -> list[nn.Module]:
        return [r.module for r in self.replicas]

    def unique_params(self) -> list[tuple[nn.Parameter, list[nn.Parameter]]]:
        """Each host parameter once, with every placeholder bound to it in this group."""
        order: list[nn.Parameter] = []
        holders: dict[int, list[nn.Parameter]] = {}
        for rep in self.replicas:
            for host, ph in rep.params:
                if id(host) not in holders:
                    order.append(host)
                    holders[id(host)] = []
                holders[id(host)].append(ph)
        return [(h, holders[id(h)]) for h in order]


def _copy_to(dev: DeviceManager, src: torch.Tensor) -> torch.Tensor:
    if dev.is_cuda:
        dst = torch.empty_like(src, device=dev.device)
        dst.copy_(src, non_blocking=True)
        return dst
    return src.detach().clone()


def _upload_param(
    dev: DeviceManager, host: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A parameter's value on `dev` (into `out` if given): a packed one (engine.memory.
    PACKED_ATTR) is copied packed and decoded there, on the current (upload) stream."""
    packed = packed_form(host)
    if packed is not None:
        return packed.to_device(dev.device, non_blocking=dev.is_cuda, out=out)
    if out is None:
        return _copy_to(dev, host.detach())
    return out.copy_(host.detach(), non_blocking=dev.is_cuda)


def upload_layers(
    dev: DeviceManager,
    replicas: Sequence[LayerReplica],
    layer_ids: Sequence[int],
    *,
    saved_buffers: dict[int, torch.Tensor] | None = None,
    slots: Sequence[Slot | None] | None = None,
    slot_grads: bool = False,
) -> UploadedGroup:
    """Upload a layer group's parameters and buffers into `replicas` on `dev`.

    The compute stream waits for the upload; the host does not. `saved_buffers` maps a host
    buffer to the value it had before the forward, for a recompute that must see the same
    buffers as the forward did. A replica with a slot (engine.accel.graphs) is uploaded into the
    slot's tensors, once the last job using the slot no longer reads them; with
    `slot_grads` its parameters' .grad are the slot's gradient buffers, zeroed (a backward
    job: autograd and the replayed graphs add into them).
    """
    slot_list = list(slots) if slots is not None else [None] * len(replicas)
    group = UploadedGroup(list(layer_ids), list(replicas), slots=slot_list)
    with dev.on(dev.param_upstream):
        for rep, slot in zip(replicas, slot_list, strict=True):
            if slot is not None:
                _upload_into_slot(dev, rep, slot, group, saved_buffers)
                continue
            for host, ph in rep.params:
                d = group.device_tensors.get(id(host))
                if d is None:
                    d = _upload_param(dev, host)
                    group.device_tensors[id(host)] = d
                ph.data = d
                ph.grad = None
            for host, bh in rep.buffers:
                d = group.device_tensors.get(id(host))
                if d is None:
                    src = saved_buffers.get(id(host), host) if saved_buffers else host
                    d = _copy_to(dev, src)
                    group.device_tensors[id(host)] = d
                bh.data = d
                group.buffer_versions[id(host)] = bh._version
    if dev.is_cuda:
        uploaded = dev.record(dev.param_upstream)
        dev.wait_event(dev.compute_stream, uploaded)
        group.uploaded = uploaded
        for d in group.device_tensors.values():
            dev.mark_used(d, dev.compute_stream)
    if slot_grads:
        _bind_slot_grads(dev, replicas, slot_list)
    hooks = [hook for rep in replicas for hook in rep.after_upload]
    if hooks:
        with dev.compute(), torch.no_grad():
            for hook in hooks:
                hook()
    return group


def _upload_into_slot(
    dev: DeviceManager,
    rep: LayerReplica,
    slot: Slot,
    group: UploadedGroup,
    saved_buffers: dict[int, torch.Tensor] | None,
) -> None:
    """Copy one layer's tensors into its slot and bind the replica to them (on the
    parameter upload stream, which waits until the slot's last job no longer reads it)."""
    dev.wait_event(dev.param_upstream, slot.weights_free)
    for (host, ph), d in zip(rep.params, slot.params, strict=True):
        _upload_param(dev, host, d)
        ph.data = d
        ph.grad = None
    for (host, bh), d in zip(rep.buffers, slot.buffers, strict=True):
        src = saved_buffers.get(id(host), host) if saved_buffers else host
        d.copy_(src, non_blocking=dev.is_cuda)
        bh.data = d
        group.buffer_versions[id(host)] = bh._version


def _bind_slot_grads(
    dev: DeviceManager, replicas: Sequence[LayerReplica], slots: Sequence[Slot | None]
) -> None:
    """Zero the slots' gradient buffers (once their last downloads are done) and make them
    the parameters' .grad."""
    buffers: list[torch.Tensor] = []
    with dev.compute():
        for rep, slot in zip(replicas, slots, strict=True):
            if slot is None:
                continue
            dev.wait_event(dev.compute_stream, slot.grads_free)
            for (_, ph), g in zip(rep.params, slot.gradient_buffers(), strict=True):
                if g is not None:
                    ph.grad = g
                    buffers.append(g)
        if buffers:
            torch._foreach_zero_(buffers)


def download_buffers(
    dev: DeviceManager, group: UploadedGroup, saved_buffers: dict[int, torch.Tensor] | None
) -> None:
    """Copy buffers the forward changed back to the host.

    Unchanged buffers (the usual case: rotary tables, masks) are detected by their version
    counter and skipped; the norms' running statistics, which the kernel writes without
    counting a version, always come back. With `saved_buffers`, a changed buffer's previous
    host value is kept there first, so the recompute replays the forward from the same state.
    """
    changed: list[tuple[torch.Tensor, torch.Tensor]] = []
    for rep in group.replicas:
        for host, bh in rep.buffers:
            norm = rep.kernel_written.get(id(host))
            written = norm is not None and norm.training
            if written or bh._version != group.buffer_versions.get(id(host), bh._version):
                changed.append((host, bh))
                rep.wrote_buffers = True
    if not changed:
        return
    if saved_buffers is not None:
        for host, _ in changed:
            saved_buffers.setdefault(id(host), host.detach().clone())
    dev.wait_stream(dev.downstream, dev.compute_stream)
    with dev.on(dev.downstream):
        for host, bh in changed:
            host.data.copy_(bh.data, non_blocking=dev.is_cuda)
    ev = dev.record(dev.downstream)
    if ev is not None:
        ev.synchronize()


def release_group(group: UploadedGroup, dev: DeviceManager | None = None) -> None:
    """Drop the device tensors (the allocator reuses them once the streams are done); the
    group's slots are free for a later job once this job's compute and downloads are."""
    if dev is not None and any(s is not None for s in group.slots):
        weights_free = dev.record(dev.compute_stream)
        grads_free = dev.record(dev.downstream)
        for slot in group.slots:
            if slot is not None:
                slot.weights_free, slot.grads_free = weights_free, grads_free
    for rep in group.replicas:
        for _, ph in rep.params:
            ph.data = torch.empty(0, dtype=ph.dtype)
            ph.grad = None
        for _, bh in rep.buffers:
            bh.data = torch.empty(0, dtype=bh.dtype)
    group.device_tensors.clear()


def piece_sizes(nbytes: int, granule: int = PIECE_GRANULE_BYTES) -> list[int]:
    """Power-of-two sizes, largest first, that together hold `nbytes` rounded up to `granule`.

    The binary decomposition of the rounded size: each piece is a power of two of at least
    `granule` bytes, the waste is under one granule, and a size below 2**k granules needs
    at most k pieces.
    """
    if granule <= 0 or granule & (granule - 1):
        raise ValueError(f"granule must be a power of two, got {granule}")
    if nbytes <= 0:
        return []
    total = -(-nbytes // granule) * granule
    sizes = []
    bit = 1 << (total.bit_length() - 1)
    while bit >= granule:
        if total & bit:
            sizes.append(bit)
        bit >>= 1
    return sizes


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous tensor's bytes."""
    return t.reshape(-1).view(torch.uint8)


@dataclass(eq=False)
class HostPieces:
    """A tensor's bytes on the host, split over 1-D uint8 buffers (`pieces`) in order.

    The buffers hold the bytes of the contiguous tensor of `shape` and `dtype` one after
    the other; the last ones may be longer than the bytes left (padding, never read).
    """

    shape: torch.Size
    dtype: torch.dtype
    pieces: list[torch.Tensor]
    requires_grad: bool = False  # the downloaded tensor did (async_d2h keep_requires_grad)

    @classmethod
    def empty(
        cls,
        shape: torch.Size,
        dtype: torch.dtype,
        *,
        pin: bool,
        granule: int = PIECE_GRANULE_BYTES,
    ) -> HostPieces:
        """Uninitialised pieces for a tensor of `shape` and `dtype` (pinned if `pin`)."""
        nbytes = math.prod(shape) * dtype.itemsize
        pieces = [
            torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in piece_sizes(nbytes, granule)
        ]
        return cls(torch.Size(shape), dtype, pieces)

    @property
    def nbytes(self) -> int:
        """The tensor's bytes (without the padding of the last piece)."""
        return math.prod(self.shape) * self.dtype.itemsize

    def _ranges(self) -> Iterator[tuple[torch.Tensor, int, int]]:
        """(piece, offset into the tensor's bytes, bytes used in the piece) in order."""
        offset, nbytes = 0, self.nbytes
        for piece in self.pieces:
            used = min(piece.numel(), nbytes - offset)
            if used <= 0:
                return
            yield piece, offset, used
            offset += used

    def copy_from(self, src: torch.Tensor, *, non_blocking: bool) -> None:
        """Copy `src` (any strides, on any device) into the pieces, one copy per piece.

        A non-contiguous `src` is made contiguous first, on the current stream.
        """
        if src.shape != self.shape or src.dtype != self.dtype:
            raise ValueError(
                f"HostPieces of {tuple(self.shape)} {self.dtype} cannot hold "
                f"{tuple(src.shape)} {src.dtype}"
            )
        flat = _flat_bytes(src.detach().contiguous())
        for piece, offset, used in self._ranges():
            piece[:used].copy_(flat[offset : offset + used], non_blocking=non_blocking)

    def to_device(self, device: torch.device, *, non_blocking: bool) -> torch.Tensor:
        """A new tensor on `device` with the pieces' bytes: one allocation, one copy a piece."""
        out = torch.empty(self.shape, dtype=self.dtype, device=device)
        flat = _flat_bytes(out)
        for piece, offset, used in self._ranges():
            flat[offset : offset + used].copy_(piece[:used], non_blocking=non_blocking)
        return out

    @classmethod
    def of(cls, t: torch.Tensor, *, pin: bool, granule: int = PIECE_GRANULE_BYTES) -> HostPieces:
        """A synchronous copy of `t` in new pieces (tests and host-side callers)."""
        hp = cls.empty(t.shape, t.dtype, pin=pin, granule=granule)
        hp.copy_from(t, non_blocking=False)
        return hp


def async_h2d(
    dev: DeviceManager,
    host_ready_event: Iterable[torch.cuda.Event | None],
    host_tensors: Iterable[Any],
    keep_requires_grad: bool = False,
) -> list[Any]:
    """Upload the tensors and HostPieces of a flat list on the activation stream.

    Other leaves pass unchanged. A HostPieces becomes one device tensor (requiring grad
    under the same rule as a tensor).
    """
    for ev in host_ready_event:
        dev.wait_event(dev.upstream, ev)
    out: list[Any] = []
    with dev.on(dev.upstream):
        for t in host_tensors:
            if isinstance(t, HostPieces):
                d = t.to_device(dev.device, non_blocking=dev.is_cuda)
                if keep_requires_grad and t.requires_grad:
                    d.requires_grad_(True)
                out.append(d)
            elif isinstance(t, torch.Tensor):
                d = _copy_to(dev, t.detach())
                if keep_requires_grad and t.requires_grad:
                    d.requires_grad_(True)
                out.append(d)
            else:
                out.append(t)
    if dev.is_cuda:
        dev.wait_stream(dev.compute_stream, dev.upstream)
        for d in out:
            if isinstance(d, torch.Tensor):
                dev.mark_used(d, dev.compute_stream)
    return out


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


def _wants_pieces(t: torch.Tensor) -> bool:
    return t.is_cuda and t.numel() * t.element_size() >= PIECES_MIN_BYTES


def async_d2h(
    dev: DeviceManager,
    device_tensors: Iterable[Any],
    keep_requires_grad: bool = False,
    *,
    pieces: bool = False,
) -> tuple[list[Any], torch.cuda.Event | None]:
    """Download the tensors of a flat list to the host; return it and the event to wait on.

    The download stream waits for the compute stream first. Host tensors are pinned on
    CUDA (so the copy is asynchronous), detached unless `keep_requires_grad`.

    Args:
        pieces: CUDA tensors of at least PIECES_MIN_BYTES come back as HostPieces, which
            only async_h2d reads: for the engine's own data, never for what the caller gets.
    """
    items = list(device_tensors)
    if not dev.is_cuda:
        out = []
        for t in items:
            if isinstance(t, torch.Tensor):
                h = t.detach()
                if keep_requires_grad and t.requires_grad:
                    h.requires_grad_(True)
                out.append(h)
            else:
                out.append(t)
        return out, None
    dev.wait_stream(dev.downstream, dev.compute_stream)
    out = []
    with dev.on(dev.downstream):
        for t in items:
            if isinstance(t, torch.Tensor) and pieces and _wants_pieces(t):
                hp = HostPieces.empty(t.shape, t.dtype, pin=True, granule=PIECE_GRANULE_BYTES)
                hp.copy_from(t, non_blocking=True)
                dev.mark_used(t, dev.downstream)
                hp.requires_grad = keep_requires_grad and t.requires_grad
                out.append(hp)
            elif isinstance(t, torch.Tensor):
                h = _pinned_like(t) if t.is_cuda else torch.empty_like(t)
                h.copy_(t.detach(), non_blocking=True)
                dev.mark_used(t, dev.downstream)
                if keep_requires_grad and t.requires_grad:
                    h.requires_grad_(True)
                out.append(h)
            else:
                out.append(t)
    return out, dev.record(dev.downstream)
