"""Find, build, cache and load the C Adam (csrc/), and hold its ISA and thread settings.

The library comes from one of two places:

1. `engine.optim._adam_cffi`, compiled by cffi when the package was installed;
2. a cache directory, `$RP_ADAM_CACHE_DIR` or `~/.cache/roundpipe/adam` (XDG aware), where
   it is compiled once from csrc/ when (1) is missing or stale, e.g. in an editable
   checkout on a new machine. The cache key is a hash of the CPU flags and of the sources,
   so a changed kernel or another CPU gets its own build.

The ISA is chosen at run time from the CPU's flags (AVX-512, then AVX2, then scalar);
`set_isa()` or `RP_ADAM_ISA` forces one, and `"torch"` asks for the plain-torch fallback
that never loads the library. Threads default to the physical cores available to the
process; `set_num_threads()` or `RP_ADAM_THREADS` changes that.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ..device import (
    adam_cache_dir_setting,
    adam_isa_setting,
    adam_threads_setting,
    c_compiler_setting,
)
from ..errors import ConfigError, RoundPipeError

__all__ = [
    "ABI_VERSION",
    "ISAS",
    "TORCH_FALLBACK",
    "NativeBuildError",
    "NativeLib",
    "available_isas",
    "cpu_flags_hash",
    "get_isa",
    "get_num_threads",
    "load",
    "loaded",
    "native_info",
    "physical_cores",
    "set_isa",
    "set_num_threads",
    "source_hash",
]

log = logging.getLogger(__name__)

ABI_VERSION = 8
"""The RP_ADAM_ABI_VERSION (csrc/adam.h) this Python side speaks."""

ISAS: dict[str, int] = {"scalar": 0, "avx2": 1, "avx512": 2}
"""Native paths by name, with their RP_ISA_* ids; "torch" is the non-native fallback."""

TORCH_FALLBACK = "torch"
_MODULE_NAME = "engine.optim._adam_cffi"
_CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
# Every file the build reads: the C sources and headers, and the build script itself.
_SOURCE_SUFFIXES = (".c", ".h", ".py")


class NativeBuildError(RoundPipeError, RuntimeError):
    """The C Adam is not installed and could not be compiled here."""


@dataclass(frozen=True, slots=True)
class NativeLib:
    """The loaded cffi module and where it came from."""

    lib: Any
    ffi: Any
    path: str
    origin: str  # "install" (built with the package) or "cache" (built at run time)
    built_now: bool  # compiled by this process


_lock = threading.Lock()
_loaded: NativeLib | None = None
_forced_isa: str | None = None
_num_threads: int | None = None


def cpu_flags_hash() -> str:
    """A short hash of the machine type and the CPU's feature flags."""
    flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith(("flags", "Features")):  # x86 / arm
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    text = f"{platform.machine()}|{flags}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def source_hash() -> str:
    """A short hash of csrc/ and of what the build depends on (Python ABI, cffi)."""
    import cffi

    digest = hashlib.sha256()
    for path in sorted(_CSRC_DIR.iterdir()):
        if path.is_file() and path.suffix in _SOURCE_SUFFIXES:
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    digest.update(f"{suffix}|{cffi.__version__}".encode())
    return digest.hexdigest()[:16]


def _cache_root() -> Path:
    configured = adam_cache_dir_setting()
    if configured is not None:
        return Path(configured)
    return Path.home() / ".cache" / "roundpipe" / "adam"


def _load_module_from(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise NativeBuildError(f"cannot load the C Adam from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wrap(module: ModuleType, origin: str, built_now: bool) -> NativeLib | None:
    """The module as a NativeLib, or None when it speaks another ABI (a stale build)."""
    if module.lib.rp_adam_abi_version() != ABI_VERSION:
        return None
    return NativeLib(module.lib, module.ffi, str(module.__file__), origin, built_now)


def _compiler_hint() -> str:
    named = (c_compiler_setting() or "").split()
    if named and not shutil.which(named[0]):
        what = f"the C compiler that CC names ({named[0]}: not found), or unset CC,"
    elif named or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"):
        what = "the Python headers (python3-dev)"
    else:
        what = "a C compiler and the Python headers"
    return (
        f"install {what} (Debian/Ubuntu: `apt-get install build-essential python3-dev`; "
        "Fedora: `dnf install gcc python3-devel`) and retry, reinstall the package with "
        "`pip install .` on a machine that has them, or opt into torch's slower Adam with "
        "`engine.optim.set_isa('torch')` / RP_ADAM_ISA=torch"
    )


def _build_into_cache() -> NativeLib:
    """Compile csrc/ once into the cache (under a file lock) and load it."""
    if not (_CSRC_DIR / "build_adam.py").is_file():
        raise NativeBuildError(
            "the compiled C Adam (engine.optim._adam_cffi) is missing and its sources "
            f"(csrc/) are not at {_CSRC_DIR}; reinstall the package with `pip install .`"
        )
    key = f"{cpu_flags_hash()}-{source_hash()}"
    root = _cache_root()
    target = root / key / f"_adam_cffi{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock_file:
        # Another process may be building the same key: wait for it, then reuse its build.
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        built_now = False
        if not target.is_file():
            start_s = time.monotonic()
            log.info("C Adam: no installed build; compiling csrc/ into %s", target.parent)
            _compile(target)
            built_now = True
            log.info(
                "C Adam: compiled into %s in %.1f s (cache key %s)",
                target,
                time.monotonic() - start_s,
                key,
            )
        native = _wrap(_load_module_from(target), "cache", built_now)
    if native is None:
        raise NativeBuildError(f"the cached C Adam at {target} speaks another ABI; delete it")
    return native


def _compile(target: Path) -> None:
    spec = importlib.util.spec_from_file_location("_rp_build_adam", _CSRC_DIR / "build_adam.py")
    assert spec is not None and spec.loader is not None  # the file exists (checked above)
    build_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_module)
    builder = build_module.make_ffibuilder(absolute_paths=True)
    with tempfile.TemporaryDirectory(dir=target.parent.parent, prefix="build-") as tmp:
        try:
            built = Path(builder.compile(tmpdir=tmp, verbose=False))
        except Exception as exc:  # cffi raises VerificationError; distutils its own errors
            raise NativeBuildError(
                f"the C Adam is not installed and compiling it failed ({exc}); " + _compiler_hint()
            ) from exc
        target.parent.mkdir(parents=True, exist_ok=True)
        # Rename into place: a reader never sees a half-written library.
        staged = target.with_suffix(".partial")
        shutil.copyfile(built, staged)
        os.replace(staged, target)


def load() -> NativeLib:
    """The C Adam library: the installed build if usable, else the cached one (built once)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            native: NativeLib | None = None
            try:
                module = importlib.import_module(_MODULE_NAME)
                native = _wrap(module, "install", False)
                if native is None:
                    log.warning("C Adam: the installed build is stale; using a cached build")
            except ImportError:
                log.debug("C Adam: no installed build (%s)", _MODULE_NAME)
            _loaded = native or _build_into_cache()
        return _loaded


def loaded() -> bool:
    """Whether `load()` has run: the library is in memory, nothing left to build."""
    return _loaded is not None


def physical_cores() -> int:
    """Physical cores this process may run on (SMT siblings counted once)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
        except OSError:
            return len(cpus) or os.cpu_count() or 1
        cores.add((package, core))
    return max(1, len(cores))


def _positive_int(value: Any, name: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return number


def set_num_threads(n: int | None) -> None:
    """Use `n` threads for the C Adam; None goes back to RP_ADAM_THREADS or the cores."""
    global _num_threads
    _num_threads = None if n is None else _positive_int(n, "num_threads")


def get_num_threads() -> int:
    """Threads the C Adam uses: set_num_threads(), else RP_ADAM_THREADS, else physical cores."""
    if _num_threads is not None:
        return _num_threads
    env = adam_threads_setting()
    if env:
        return _positive_int(env, "RP_ADAM_THREADS")
    return physical_cores()


def _check_isa_name(name: str, source: str) -> str:
    name = name.strip().lower()
    allowed = ("auto", *ISAS, TORCH_FALLBACK)
    if name not in allowed:
        raise ConfigError(f"{source} must be one of {', '.join(allowed)}; got {name!r}")
    return name


def set_isa(name: str | None) -> None:
    """Force an ISA path: "scalar", "avx2", "avx512", "torch" (no C), or None/"auto"."""
    global _forced_isa
    if name is None:
        _forced_isa = None
        return
    name = _check_isa_name(name, "isa")
    if name in ISAS and not load().lib.rp_adam_isa_supported(ISAS[name]):
        raise ConfigError(f"isa {name!r} is not supported by this CPU; have {available_isas()}")
    _forced_isa = None if name == "auto" else name


def available_isas() -> list[str]:
    """Native paths this CPU can run, fastest last."""
    lib = load().lib
    return [name for name, isa in ISAS.items() if lib.rp_adam_isa_supported(isa)]


def get_isa() -> str:
    """The path in use: the forced one, else RP_ADAM_ISA, else the best the CPU has."""
    name = _forced_isa
    if name is None:
        env = adam_isa_setting()
        name = _check_isa_name(env, "RP_ADAM_ISA") if env else "auto"
    if name == TORCH_FALLBACK:
        return name
    lib = load().lib
    if name == "auto":
        best = lib.rp_adam_best_isa()
        return next(key for key, value in ISAS.items() if value == best)
    if not lib.rp_adam_isa_supported(ISAS[name]):
        raise ConfigError(
            f"RP_ADAM_ISA={name} is not supported by this CPU; have {available_isas()}"
        )
    return name


_q8_lookup: str | None = None


def q8_lookup(lib: Any) -> str:
    """How the AVX-512 path looks up its 8-bit tables: "permute" or "gather" (the same
    values either way). Timed once per process on the first call (rp_adam_q8_calibrate:
    about a millisecond), since the faster one depends on the CPU: permutes took the kernel
    to 1.5x on AMD Zen, where a gather is slow; Intel runs permutes on one port."""
    global _q8_lookup
    if _q8_lookup is None:
        with _lock:
            if _q8_lookup is None:
                chosen = lib.rp_adam_q8_calibrate()
                _q8_lookup = "permute" if lib.rp_adam_get_q8_permute() else "gather"
                if chosen >= 0:
                    log.info("C Adam: 8-bit table lookups by %s (timed)", _q8_lookup)
    return _q8_lookup


def native_info() -> dict[str, Any]:
    """What /v1/system reports about the C Adam: ISA, threads, library and its origin."""
    info: dict[str, Any] = {"threads": get_num_threads(), "abi_version": ABI_VERSION}
    try:
        isa = get_isa()
        info["isa"] = isa
        if isa == TORCH_FALLBACK and _loaded is None:
            info.update(library=None, origin=None, available_isas=[])
            return info
        native = load()
        info.update(
            library=native.path,
            origin=native.origin,
            built_now=native.built_now,
            available_isas=available_isas(),
        )
    except (NativeBuildError, ConfigError) as exc:
        info.update(isa=None, library=None, origin=None, error=str(exc))
    return info
