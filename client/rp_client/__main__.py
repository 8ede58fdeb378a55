"""`python -m rp_client` runs the `rp` command."""

from __future__ import annotations

from .cli import main

main()
