"""Where the token of a daemon on this machine is: its data directory's `token` file.

A daemon started without RP_TOKEN makes a random token and writes it (mode 0600) to
`$RP_DATA_DIR/token`; a client on the same machine, as the same user, reads it from there
when no token is given. Never for a remote daemon: its token is not in any local file.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import httpx

__all__ = ["default_token_file", "is_loopback_url", "read_token_file"]

DEFAULT_DATA_DIR = "./rp-data"  # the daemon's default RP_DATA_DIR (rp_service/settings.py)


def is_loopback_url(url: str) -> bool:
    try:
        host = httpx.URL(url).host
    except (httpx.InvalidURL, ValueError):
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_token_file(base_url: str) -> Path | None:
    """`$RP_DATA_DIR/token` (default ./rp-data/token) for a daemon on loopback, else None."""
    if not is_loopback_url(base_url):
        return None
    return Path(os.environ.get("RP_DATA_DIR") or DEFAULT_DATA_DIR) / "token"


def read_token_file(path: Path) -> str | None:
    """The token in `path`, or None when it is missing, unreadable or empty."""
    try:
        return path.read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None
