"""Host memory for model tensors: pinning (alloc / register / off) and size helpers."""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import nn

from .errors import ConfigError

__all__ = [
    "PinMode",
    "get_model_active_size",
    "get_model_size",
    "pin_module",
    "pin_module_alloc",
    "pin_module_register",
    "pin_tensor",
]

log = logging.getLogger(__name__)

PinMode = Literal["alloc", "register", "off"]
_PIN_MODES = ("alloc", "register", "off")


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
            out.append(t)
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


def pin_module(mod: nn.Module, mode: str) -> None:
    """Pin `mod`'s tensors per `mode` ('alloc', 'register' or 'off')."""
    if mode not in _PIN_MODES:
        raise ConfigError(f"pin_model must be 'alloc', 'register' or 'off', got {mode!r}")
    if mode == "register" and not torch.cuda.is_available():
        raise ConfigError(
            "pin_model='register' uses cudaHostRegister and needs CUDA; "
            "use pin_model='alloc' or 'off' without a GPU"
        )
    if mode == "alloc":
        pin_module_alloc(mod)
    elif mode == "register":
        pin_module_register(mod)


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
