"""Host memory for model tensors: pinning (alloc / register / arena / off) and size helpers."""

from __future__ import annotations

import logging
import mmap
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from .errors import ConfigError

__all__ = [
    "PACKED_ATTR",
    "PinMode",
    "get_model_active_size",
    "get_model_size",
    "host_block",
    "host_tensors",
    "packed_form",
    "pin_module",
    "pin_module_alloc",
    "pin_module_arena",
    "pin_module_register",
    "pin_tensor",
]

log = logging.getLogger(__name__)

PinMode = Literal["alloc", "register", "arena", "off"]
_PIN_MODES = ("alloc", "register", "arena", "off")
# Every tensor of the arena starts on this boundary (a cache line and the AVX-512 width; the
# kernels' non-temporal stores want 32 bytes).
ARENA_ALIGN_BYTES = 64


def arena_slot_bytes(nbytes: int) -> int:
    """Bytes a tensor of `nbytes` takes in the arena (rounded up to ARENA_ALIGN_BYTES)."""
    return -(-nbytes // ARENA_ALIGN_BYTES) * ARENA_ALIGN_BYTES


# A frozen parameter stored packed in host memory (engine.adapters.nf4) carries its packed
# form under this attribute; its own storage is a broadcast stand-in of a few bytes. Pinning
# and the memory checks use the packed tensors, the upload decodes them on the device.
PACKED_ATTR = "rp_packed"


def packed_form(t: torch.Tensor) -> Any:
    """The packed form of a parameter stored packed (an `NF4Weight`), else None."""
    return getattr(t, PACKED_ATTR, None)


def host_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The host tensors that hold `t`'s value: its packed tensors, else `t` itself."""
    packed = packed_form(t)
    return packed.tensors() if packed is not None else [t]


def _pinning_possible() -> bool:
    return torch.cuda.is_available()


def pin_tensor(t: torch.Tensor) -> torch.Tensor:
    """A pinned copy of `t` (or `t` itself when pinning is impossible or already done)."""
    if not _pinning_possible() or t.is_pinned():
        return t
    return t.pin_memory()


def _module_tensors(mod: nn.Module) -> list[torch.Tensor]:
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for t in [*mod.parameters(), *mod.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.extend(host_tensors(t))
    return out


def pin_module_alloc(mod: nn.Module) -> None:
    """Move parameters and buffers into pinned host memory allocated by torch."""
    if not _pinning_possible():
        return  # virtual CPU devices copy from pageable memory; nothing to pin
    for t in _module_tensors(mod):
        if not t.is_pinned():
            t.data = t.data.pin_memory()


def pin_module_register(mod: nn.Module) -> None:
    """Pin parameters and buffers where they are, with cudaHostRegister."""
    cudart = torch.cuda.cudart()
    for t in _module_tensors(mod):
        if t.is_pinned() or t.numel() == 0:
            continue
        if not t.data.is_contiguous():
            t.data = t.data.contiguous()
        storage = t.untyped_storage()
        err = cudart.cudaHostRegister(storage.data_ptr(), storage.nbytes(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed with error {int(err)}")


def _register(t: torch.Tensor) -> None:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed with error {int(err)}")


class _Mapping(mmap.mmap):
    """An anonymous mapping; a subclass because mmap itself takes no weak references."""


def _unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def host_block(
    nbytes: int, *, pinned: bool, fill: Callable[[torch.Tensor], None] | None = None
) -> torch.Tensor:
    """A uint8 host tensor of exactly `nbytes` (page-aligned), registered with
    cudaHostRegister when `pinned` and CUDA is there.

    `fill(block)` runs before the block is registered. Registering locks the block and so
    faults in every page at once: a block filled from tensors that are freed as they are
    copied then peaks at its own size plus one tensor, where filling after registering
    peaks at twice the model (measured on a 70B NF4 base: 82.8 GiB of RSS while pinning
    40.6 GiB, 47.6 GiB after).

    A registration must end before its memory goes back to the system: a later mapping
    at the same addresses would otherwise count as registered, and copies from it fail
    ("invalid argument") or read stale pages. The block is an anonymous mapping that the
    tensor's storage keeps alive, unregistered just before it is unmapped (once the last
    tensor viewing it is gone).
    """
    if nbytes <= 0 or not (pinned and torch.cuda.is_available()):
        block = torch.empty(max(nbytes, 0), dtype=torch.uint8)
        if fill is not None:
            fill(block)
        return block
    mapping = _Mapping(-1, nbytes)
    block = torch.frombuffer(mapping, dtype=torch.uint8)
    if fill is not None:
        fill(block)
    _register(block)
    done = weakref.finalize(mapping, _unregister, block.data_ptr())
    done.atexit = False  # at exit the process's mappings go with CUDA's context
    return block


def pin_module_arena(mod: nn.Module) -> dict[int, torch.Tensor]:
    """Move parameters and buffers into one host block, pinned once; add gradient buffers.

    torch's pinned allocator rounds every allocation up to a power of two (a 96 MiB MLP
    weight takes 128 MiB, a 1.2 GiB embedding 2 GiB), and so would one big pinned tensor;
    an ordinary allocation registered with cudaHostRegister is pinned at its exact size.
    The block also holds a host gradient buffer (model dtype) for every parameter that
    requires grad, so the gradient downloads need no pinned allocations of their own.
    Without CUDA the block is ordinary memory with the same layout.

    Returns:
        id(parameter) -> its gradient buffer.
    """
    tensors = _module_tensors(mod)
    grad_of = [t for t in tensors if isinstance(t, nn.Parameter) and t.requires_grad]
    sizes = [arena_slot_bytes(t.numel() * t.element_size()) for t in [*tensors, *grad_of]]
    offset = 0

    def take(arena: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        nbytes = t.numel() * t.element_size()
        view = arena[offset : offset + nbytes].view(t.dtype).view(t.shape)
        offset += arena_slot_bytes(nbytes)
        return view

    def move_in(arena: torch.Tensor) -> None:
        with torch.no_grad():
            for t in tensors:
                view = take(arena, t)
                view.copy_(t.data)
                t.data = view  # the old storage is freed here (peak: one tensor, not the model)

    # Filled before it is pinned (host_block's `fill`): the copies free the model as they go.
    arena = host_block(sum(sizes), pinned=True, fill=move_in)
    return {id(t): take(arena, t) for t in grad_of}


def pin_module(mod: nn.Module, mode: str) -> dict[int, torch.Tensor]:
    """Pin `mod`'s tensors per `mode` ('alloc', 'register', 'arena' or 'off').

    Returns:
        The host gradient buffers made with the parameters ('arena'), by id(parameter);
        empty for the other modes (the downloads allocate their own).
    """
    if mode not in _PIN_MODES:
        raise ConfigError(f"pin_model must be 'alloc', 'register', 'arena' or 'off', got {mode!r}")
    if mode == "register" and not torch.cuda.is_available():
        raise ConfigError(
            "pin_model='register' uses cudaHostRegister and needs CUDA; "
            "use pin_model='alloc' or 'off' without a GPU"
        )
    if mode == "alloc":
        pin_module_alloc(mod)
    elif mode == "register":
        pin_module_register(mod)
    elif mode == "arena":
        return pin_module_arena(mod)
    return {}


def get_model_size(model: nn.Module, recurse: bool = True) -> int:
    """Bytes of `model`'s parameters and buffers."""
    tensors = [*model.parameters(recurse=recurse), *model.buffers(recurse=recurse)]
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def get_model_active_size(model: nn.Module, recurse: bool = True) -> int:
    """Bytes of `model`'s parameters that require grad."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters(recurse=recurse):
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
