"""The `rp` command line: typer commands over the SDK, one module per noun."""

# ruff: noqa: I001  (the command modules are imported in the order `rp --help` lists them)
from __future__ import annotations

from ._app import app
from . import jobs, metrics, files, checkpoints, export, chat, system, serve, demo  # noqa: F401  (they register commands)

__all__ = ["app", "main"]


def main() -> None:
    """Entry point of the `rp` console script."""
    app()
