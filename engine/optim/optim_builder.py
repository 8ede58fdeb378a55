"""The seeds' `optim_builder` by its name: build, load and cache the C optimizer functions.

The build itself lives in `_native` (cffi over csrc/, the installed build first, else one
compiled into a cache keyed by `get_cpu_flags_hash()` and the sources); this module hands
out its functions by name, e.g. ``get_optim_function("rp_adam_step")``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from . import _native

__all__ = [
    "get_cpu_flags_hash",
    "get_optim_function",
    "load_optim_function",
    "loaded_optim_functions",
]

loaded_optim_functions: dict[str, Callable[..., Any]] = {}
"""The functions handed out so far, by name."""

_lock = threading.Lock()
_PREFIX = "rp_"  # every function csrc/adam.h exports


def get_cpu_flags_hash() -> str:
    """A short hash of the machine type and the CPU's feature flags (part of the cache key
    of a build made here: a build for other flags is not reused)."""
    return _native.cpu_flags_hash()


def load_optim_function(name: str) -> Callable[..., Any]:
    """The C function `name` of csrc/adam.h, building the library first if it is not
    installed (once per process; later calls reuse it).

    Raises:
        ConfigError: no such function (the message lists them).
        NativeBuildError: the library is not installed and cannot be compiled here.
    """
    lib = _native.load().lib
    exported = sorted(n for n in dir(lib) if n.startswith(_PREFIX))
    if name not in exported:
        raise ConfigError(
            f"no C optimizer function {name!r}; csrc/adam.h exports {', '.join(exported)}"
        )
    fn: Callable[..., Any] = getattr(lib, name)
    with _lock:
        loaded_optim_functions[name] = fn
    return fn


def get_optim_function(name: str) -> Callable[..., Any]:
    """The C function `name` (see `load_optim_function`), from the cache after the first call."""
    fn = loaded_optim_functions.get(name)
    return fn if fn is not None else load_optim_function(name)
