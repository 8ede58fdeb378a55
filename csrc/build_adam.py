"""The cffi build of the C Adam (out-of-line API mode), module `engine.optim._adam_cffi`.

setup.py names `csrc/build_adam.py:ffibuilder`, so `pip install .` compiles it with the
package. `engine.optim._native` calls `make_ffibuilder(absolute_paths=True)` to build the
same module into a cache directory when the install-time build is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

from cffi import FFI

__all__ = [
    "COMPILE_ARGS",
    "INCLUDES",
    "MODULE_NAME",
    "SOURCES",
    "ffibuilder",
    "make_ffibuilder",
]

MODULE_NAME = "engine.optim._adam_cffi"
CSRC_DIR = Path(__file__).resolve().parent
SOURCES = ("adam.c", "adam_avx2.c", "adam_avx512.c")
HEADER = "adam.h"
# What the sources include: the vector kernel, written once, over one SIMD layer per ISA.
# Named as `depends`, so setuptools rebuilds on a change and puts them in an sdist.
INCLUDES = (HEADER, "simd.h", "simd_avx2.h", "simd_avx512.h", "adam_vector.h")
# -ffp-contract=off: the compiler must not fuse a multiply and an add into an fma of its
# own, or the ISA paths (and torch) would round differently. The ISA files enable their
# instruction sets per function (target attributes), so no -m flags and no -march=native:
# one build runs on every x86-64 CPU and picks its path at run time.
COMPILE_ARGS = ("-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-pthread")
LINK_ARGS = ("-pthread",)


def _cdef_text(header: str) -> str:
    """The header without preprocessor lines other than integer #defines (cffi's cdef)."""
    lines = [
        line
        for line in header.splitlines()
        if not line.startswith("#") or line.startswith("#define")
    ]
    return "\n".join(lines)


def _path(name: str, absolute: bool) -> str:
    path = CSRC_DIR / name
    if absolute:
        return str(path)
    # setuptools wants sources relative to the project root, where pip runs the build.
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def make_ffibuilder(*, absolute_paths: bool = False) -> FFI:
    """An FFI ready to compile the library.

    Args:
        absolute_paths: Name the sources by absolute path (cffi's `compile()` changes to
            its temporary directory, where relative paths would not resolve).
    """
    builder = FFI()
    builder.cdef(_cdef_text((CSRC_DIR / HEADER).read_text()))
    builder.set_source(
        MODULE_NAME,
        '#include <stdint.h>\n#include "adam.h"\n',
        sources=[_path(name, absolute_paths) for name in SOURCES],
        include_dirs=[_path(".", absolute_paths)],
        depends=[_path(name, absolute_paths) for name in INCLUDES],
        extra_compile_args=list(COMPILE_ARGS),
        extra_link_args=list(LINK_ARGS),
        libraries=["m"],
    )
    return builder


ffibuilder = make_ffibuilder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
