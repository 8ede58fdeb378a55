"""KV-cached batched generation for a model too big to copy onto one GPU (GRPO's rollouts).

Why stream: a base that does not fit on the GPU (the 70B NF4 recipe: 140 GB decoded)
leaves `generation.RolloutSampler` no room for its copy, and the engine's path has no KV
cache (`sampling`: one forward over the whole sequence a token, quadratic in the
completion's length). A KV cache needs the decoder's weights at every token, and they live
in host memory; the trainer already streams them layer by layer, so the sampler does too:
each forward (the prefill, then each one-token step of the whole batch) uploads every
decoder layer in turn and drops it after its compute. What stays on the device is small:
the KV cache of the batch, the modules outside the decoder layers (embeddings, final norm,
rotary, output head), the LoRA adapters' A and B, and at most two layers' weights (the one
computing, the next uploading). The trainer and the sampler never hold two copies.

Why a skeleton of the HF model with hooks, not a forward of our own: HF's forward keeps
its masks, rotary positions, sliding windows and cache bookkeeping for every family, and
`RolloutSampler`'s decode loop (token choice, rows leaving the batch and the cache) runs
unchanged on it. The skeleton is the host model's deep copy with the layers' weights as
meta tensors; a forward pre-hook binds a layer's uploaded weights, a forward hook puts the
stand-ins back, so nothing outlives its layer's call.

The upload of layer i + 1 overlaps layer i's compute: it runs on a side CUDA stream, and
the compute stream waits for its event before the layer runs. The side stream first waits
for the compute stream's event after the layer dropped last, whose memory the caching
allocator hands to this upload (freed blocks go back to the stream that allocated them):
so two layers are held, never three. An NF4 weight is uploaded packed (a quarter of the
bytes) and decoded on the device, on the side stream (`engine.memory.packed_form`'s
`to_device`, as the engine's own upload). On CPU devices the copies are plain and
sequential.

The cost: every token's forward uploads every layer, so a decode step takes about the
layers' bytes over the host link (70B NF4: ~35 GB at ~55 GB/s, ~0.65 s) for the whole
batch, whatever its rows; a big group batch is what amortises it. Current weights come for
free: a layer's upload reads the host parameters as they are (full fine-tuning), and
`refresh` copies the trainable resident ones (LoRA's A and B, or the head and
embeddings). The layers' buffers, if any, stay resident.

Packed on the device (`packed_resident`, placement "packed"): where the layers' weights
are NF4 and frozen (LoRA or QLoRA over an NF4 base) and their packed bytes fit beside the
KV cache (70B: ~35 GB of codes and absmax against 140 GB decoded), each layer's packed
tensors are uploaded once, at its first forward of a step's rollouts, and kept; every
later forward decodes them on the device (~52 ms a token for 70B: 35 GB read and 140 GB
written at 3.35 TB/s, by arithmetic) instead of moving them over the host link (~0.65 s).
At most two decoded layers are held, as when streaming. The packed copies go with the
other resident modules after the step (`release`). Trainable layer weights (full
fine-tuning) are never kept: the optimizer changes them between steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .generation import (
    RolloutSampler,
    _adapter_weights,
    _device_copy,
    _device_value,
    _param_bytes,
)

__all__ = [
    "StreamedRolloutSampler",
    "decoder_layers",
    "packed_device_bytes",
    "streamed_device_bytes",
]

log = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers HF's forward runs, in order (`model.model.layers`, as the engine's
    presets find them); empty when the model has no such list."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return []
    count = getattr(model.config, "num_hidden_layers", None) or len(layers)
    return list(layers)[:count]


def _streamed_ids(model: nn.Module, layers: list[nn.Module]) -> set[int]:
    """Ids of the parameters that are streamed: the decoder layers' own, but LoRA's A and B
    and any weight a module outside the layers shares."""
    from engine.adapters.lora import lora_modules

    inside = {id(m) for layer in layers for m in layer.modules()}
    outside = {
        id(p)
        for m in model.modules()
        if id(m) not in inside
        for p in m._parameters.values()
        if p is not None
    }
    adapters = {id(w) for _, m in lora_modules(model) for w in _adapter_weights(m)}
    return {id(p) for layer in layers for p in layer.parameters()} - outside - adapters


def _streamed_layer_bytes(layers: list[nn.Module], streamed: set[int]) -> list[int]:
    """Each layer's streamed weights' bytes on the device (an NF4 weight decoded)."""
    return [
        sum(p.numel() * p.element_size() for p in layer.parameters() if id(p) in streamed)
        for layer in layers
    ]


def streamed_device_bytes(model: nn.Module) -> int | None:
    """Most bytes `StreamedRolloutSampler` holds on the device for `model`, its KV cache
    and activations aside: all but the layers' streamed weights, plus two layers of them;
    None where the decoder layers are not found (no streaming)."""
    layers = decoder_layers(model)
    if not layers:
        return None
    sizes = _streamed_layer_bytes(layers, _streamed_ids(model, layers))
    return _param_bytes(model) - sum(sizes) + 2 * max(sizes)


def packed_device_bytes(model: nn.Module) -> int | None:
    """Most bytes a `packed_resident` sampler holds on the device for `model`, its KV
    cache and activations aside: the modules outside the layers, every layer's streamed
    weights as the host holds them (an NF4 weight's packed codes and absmax), and two
    decoded layers. None where that is not offered: no decoder layers, no NF4 weight among
    them (a full copy is as small), or a trainable one (the optimizer changes it)."""
    from engine.memory import packed_form

    streamed_bytes = streamed_device_bytes(model)
    if streamed_bytes is None:
        return None
    layers = decoder_layers(model)
    streamed = _streamed_ids(model, layers)
    weights = {id(p): p for layer in layers for p in layer.parameters() if id(p) in streamed}
    if not any(packed_form(p) is not None for p in weights.values()) or any(
        p.requires_grad for p in weights.values()
    ):
        return None
    # what streaming holds, plus every streamed weight kept as the host holds it
    return streamed_bytes + sum(_host_bytes(p) for p in weights.values())


def _resident_form(host: Tensor, device: torch.device, *, non_blocking: bool) -> Any:
    """`host`'s value kept on `device` as the host holds it: an NF4 weight's packed codes
    and absmax (an `NF4Weight` on the device, decoded at each use), else the tensor."""
    from engine.memory import packed_form

    packed = packed_form(host)
    if packed is None:
        return _device_value(host, device, non_blocking=non_blocking)
    return dataclasses.replace(
        packed,
        packed=packed.packed.to(device, non_blocking=non_blocking),
        absmax=packed.absmax.to(device, non_blocking=non_blocking),
    )


def _host_bytes(p: Tensor) -> int:
    """Bytes an upload of `p` moves: its packed tensors' for an NF4 weight."""
    from engine.memory import host_tensors

    return sum(t.numel() * t.element_size() for t in host_tensors(p))


@dataclass(eq=False, slots=True)
class _Slot:
    """One streamed parameter of a layer: where the skeleton holds it, and its host value."""

    module: nn.Module  # the skeleton's module
    name: str
    host: nn.Parameter
    stand_in: nn.Parameter  # meta, bound between the layer's calls


@dataclass(eq=False, slots=True)
class _Fetched:
    """A layer's weights on the device (by id of the host parameter) and when they are."""

    values: dict[int, Tensor]
    ready: torch.cuda.Event | None  # on the side stream; None on CPU


def _layer_slots(host: nn.Module, skeleton: nn.Module, streamed: set[int]) -> list[_Slot]:
    slots = []
    pairs = zip(host.named_modules(), skeleton.named_modules(), strict=True)
    for (name, host_module), (twin_name, module) in pairs:
        assert name == twin_name  # a deep copy keeps the module order
        for pname, p in host_module._parameters.items():
            if p is not None and id(p) in streamed:
                stand_in = module._parameters[pname]
                assert stand_in is not None
                slots.append(_Slot(module, pname, p, stand_in))  # type: ignore[arg-type]
    return slots


class StreamedRolloutSampler(RolloutSampler):
    """`RolloutSampler` whose device copy has no decoder-layer weights: each forward
    streams them from the host model, two layers at most on the device (see the module
    doc). `keep` as RolloutSampler's: whether the resident modules stay between steps.
    `packed_resident`: each layer's weights uploaded once and kept as the host holds them
    (NF4 packed), decoded at every forward (`packed_device_bytes` says where it applies)."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        *,
        keep: bool = False,
        packed_resident: bool = False,
    ) -> None:
        super().__init__(model, device, keep=keep)
        self.packed_resident = packed_resident
        # id of a host layer weight -> its device form (packed_resident): an NF4Weight
        # on the device, or the tensor itself
        self._resident: dict[int, Any] = {}
        self._layers = decoder_layers(model)
        if not self._layers:
            raise ValueError("a streamed sampler needs the HF layout's model.model.layers")
        self._streamed = _streamed_ids(model, self._layers)
        self._slots: list[list[_Slot]] = []  # per layer, built with the skeleton
        self._held: dict[int, _Fetched] = {}  # layers on the device: computing or uploading
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        # The compute stream's event after the layer it dropped last (CUDA only).
        self._freed: torch.cuda.Event | None = None
        self.uploaded_bytes = 0  # host bytes the layer uploads have moved, in all

    @property
    def device_bytes(self) -> int:
        """Most bytes of weights this sampler holds on the device (`streamed_device_bytes`,
        or `packed_device_bytes` when packed_resident)."""
        got = (packed_device_bytes if self.packed_resident else streamed_device_bytes)(self.host)
        assert got is not None
        return got

    def _upload(self) -> nn.Module:
        model, self._trained = _device_copy(self.host, self.device, left_out=self._streamed)
        self._slots = []
        for j, (host, layer) in enumerate(zip(self._layers, decoder_layers(model), strict=True)):
            self._slots.append(_layer_slots(host, layer, self._streamed))
            layer.register_forward_pre_hook(functools.partial(self._enter, j))
            layer.register_forward_hook(functools.partial(self._leave, j))
        return model

    def _fetch(self, j: int) -> _Fetched:
        """Start the upload of layer `j`'s weights (on the side stream, on a GPU)."""
        side = self._side
        values: dict[int, Tensor] = {}
        compute = torch.cuda.current_stream(self.device) if side is not None else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if side is not None and self._freed is not None:
                # This upload reuses the memory of the layer dropped last: not before the
                # compute stream is done reading it.
                side.wait_event(self._freed)
            for slot in self._slots[j]:
                if id(slot.host) not in values:
                    values[id(slot.host)] = self._device_weight(slot.host, compute)
            ready = side.record_event() if side is not None else None
        fetched = self._held[j] = _Fetched(values, ready)
        return fetched

    def _device_weight(self, host: nn.Parameter, compute: torch.cuda.Stream | None) -> Tensor:
        """`host`'s value on the device for one forward, made on the current stream (the
        side stream on a GPU; `compute` is the stream the layer runs on): uploaded from
        the host, or (packed_resident) decoded from its kept device form."""
        from engine.adapters.nf4 import NF4Weight

        non_blocking = compute is not None
        if not self.packed_resident:
            self.uploaded_bytes += _host_bytes(host)
            return _device_value(host, self.device, non_blocking=non_blocking)
        form = self._resident.get(id(host))
        if form is None:
            form = _resident_form(host, self.device, non_blocking=non_blocking)
            self._resident[id(host)] = form
            self.uploaded_bytes += _host_bytes(host)
            if isinstance(form, Tensor) and compute is not None:
                # made on the side stream, read by the compute stream at every forward:
                # its memory must not be reused before the compute stream is done with it
                form.record_stream(compute)
        if isinstance(form, NF4Weight):
            return form.to_device(self.device, non_blocking=non_blocking)
        return form

    def _enter(self, j: int, *_: Any) -> None:
        """Layer `j`'s forward pre-hook: bind its weights, start the next layer's upload."""
        fetched = self._held.get(j) or self._fetch(j)
        if fetched.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(fetched.ready)
        for slot in self._slots[j]:
            slot.module._parameters[slot.name] = fetched.values[id(slot.host)]  # type: ignore[assignment]
        if j + 1 < len(self._slots):
            self._fetch(j + 1)  # overlaps this layer's compute

    def _leave(self, j: int, *_: Any) -> None:
        """Layer `j`'s forward hook: put the stand-ins back, so its weights are freed."""
        for slot in self._slots[j]:
            slot.module._parameters[slot.name] = slot.stand_in
        del self._held[j]
        if self._side is not None:
            self._freed = torch.cuda.current_stream(self.device).record_event()

    def _drop_layers(self) -> None:
        """Unbind and forget every layer on the device (a forward that raised leaves some)."""
        if not self._held:
            return
        for j in list(self._held):
            for slot in self._slots[j]:
                slot.module._parameters[slot.name] = slot.stand_in
        self._held.clear()
        if self._side is not None:
            # The raising layer's kernels may still be queued: the next upload, which may
            # reuse its memory, waits for all the compute stream holds now.
            self._freed = torch.cuda.current_stream(self.device).record_event()

    def _logits(self, ids: Tensor, mask: Tensor, positions: Tensor, cache: Any) -> Tensor:
        try:
            return super()._logits(ids, mask, positions, cache)
        finally:
            self._drop_layers()  # no layer outlives its forward, even one that raised

    def release(self) -> None:
        """Drop the resident modules from the device (the next `refresh` uploads them)."""
        self._drop_layers()
        # The slots hold the skeleton's modules, whose hooks hold this sampler. `_freed`
        # stays: the next upload may reuse memory the last forward's kernels still read.
        self._slots = []
        self._resident = {}  # the packed copies: uploaded again at the next step's rollouts
        super().release()
