"""Install-time build of the C Adam through cffi; everything else lives in pyproject.toml."""

from pathlib import Path

from setuptools import setup

_BUILD = Path(__file__).parent / "csrc" / "build_adam.py"

# engine.optim builds the same module into a cache at first use when this step is skipped
# (e.g. some editable installs), so the install never depends on it succeeding here.
setup(
    cffi_modules=[f"{_BUILD.relative_to(Path(__file__).parent)}:ffibuilder"]
    if _BUILD.exists()
    else []
)
