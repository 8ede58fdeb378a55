"""Uploads and downloads between host memory and devices.

Layers are uploaded into per-device replicas: a copy of the layer's module structure whose
parameters and buffers are placeholders, rebound to freshly uploaded device tensors for
each job, so the host model is never touched by a device thread. Activations travel as
flat lists of leaves (tensors and plain values).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .device import DeviceManager

__all__ = [
    "LayerReplica",
    "UploadedGroup",
    "async_d2h",
    "async_h2d",
    "download_buffers",
    "make_replica",
    "release_group",
    "upload_layers",
]

log = logging.getLogger(__name__)


# A submodule with a method of this name has it called after each upload, on the compute
# stream, with the freshly uploaded device tensors bound (engine.lora merges its adapters
# into the device copy of the frozen weight there).
AFTER_UPLOAD_HOOK = "rp_after_upload"


@dataclass
class LayerReplica:
    """A device-side twin of one host layer; tensors are rebound on every upload."""

    module: nn.Module
    params: list[tuple[nn.Parameter, nn.Parameter]]  # (host, placeholder)
    buffers: list[tuple[torch.Tensor, torch.Tensor]]  # (host, placeholder)
    after_upload: list[Any] = field(default_factory=list)  # AFTER_UPLOAD_HOOK methods


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
    return LayerReplica(module, params, buffers, hooks)


@dataclass
class UploadedGroup:
    """A layer group resident on a device for one job."""

    layer_ids: list[int]
    replicas: list[LayerReplica]
    device_tensors: dict[int, torch.Tensor] = field(default_factory=dict)  # id(host) -> device
    buffer_versions: dict[int, int] = field(default_factory=dict)  # id(host buffer) -> _version

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


def upload_layers(
    dev: DeviceManager,
    replicas: Sequence[LayerReplica],
    layer_ids: Sequence[int],
    *,
    saved_buffers: dict[int, torch.Tensor] | None = None,
) -> UploadedGroup:
    """Upload a layer group's parameters and buffers into `replicas` on `dev`.

    The compute stream waits for the upload; the host does not. `saved_buffers` maps a host
    buffer to the value it had before the forward, for a recompute that must see the same
    buffers as the forward did.
    """
    group = UploadedGroup(list(layer_ids), list(replicas))
    with dev.on(dev.param_upstream):
        for rep in replicas:
            for host, ph in rep.params:
                d = group.device_tensors.get(id(host))
                if d is None:
                    d = _copy_to(dev, host.detach())
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
        for d in group.device_tensors.values():
            dev.mark_used(d, dev.compute_stream)
    hooks = [hook for rep in replicas for hook in rep.after_upload]
    if hooks:
        with dev.compute(), torch.no_grad():
            for hook in hooks:
                hook()
    return group


def download_buffers(
    dev: DeviceManager, group: UploadedGroup, saved_buffers: dict[int, torch.Tensor] | None
) -> None:
    """Copy buffers the forward changed back to the host.

    Unchanged buffers (the usual case: rotary tables, masks) are detected by their version
    counter and skipped. With `saved_buffers`, a changed buffer's previous host value is
    kept there first, so the recompute replays the forward from the same state.
    """
    changed: list[tuple[torch.Tensor, torch.Tensor]] = []
    for rep in group.replicas:
        for host, bh in rep.buffers:
            if bh._version != group.buffer_versions.get(id(host), bh._version):
                changed.append((host, bh))
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


def release_group(group: UploadedGroup) -> None:
    """Drop the device tensors (the allocator reuses them once the streams are done)."""
    for rep in group.replicas:
        for _, ph in rep.params:
            ph.data = torch.empty(0, dtype=ph.dtype)
            ph.grad = None
        for _, bh in rep.buffers:
            bh.data = torch.empty(0, dtype=bh.dtype)
    group.device_tensors.clear()


def async_h2d(
    dev: DeviceManager,
    host_ready_event: Iterable[torch.cuda.Event | None],
    host_tensors: Iterable[Any],
    keep_requires_grad: bool = False,
) -> list[Any]:
    """Upload the tensors of a flat list on the activation stream; other leaves pass."""
    for ev in host_ready_event:
        dev.wait_event(dev.upstream, ev)
    out: list[Any] = []
    with dev.on(dev.upstream):
        for t in host_tensors:
            if isinstance(t, torch.Tensor):
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


def async_d2h(
    dev: DeviceManager, device_tensors: Iterable[Any], keep_requires_grad: bool = False
) -> tuple[list[Any], torch.cuda.Event | None]:
    """Download the tensors of a flat list to the host; return it and the event to wait on.

    The download stream waits for the compute stream first. Host tensors are pinned on
    CUDA (so the copy is asynchronous), detached unless `keep_requires_grad`.
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
            if isinstance(t, torch.Tensor):
                h = _pinned_like(t) if t.is_cuda else torch.empty_like(t)
                h.copy_(t.detach(), non_blocking=True)
                dev.mark_used(t, dev.downstream)
                if keep_requires_grad and t.requires_grad:
                    h.requires_grad_(True)
                out.append(h)
            else:
                out.append(t)
    return out, dev.record(dev.downstream)
