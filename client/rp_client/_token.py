"""A daemon on this machine: its data directory's `token` file and `rp.sock` socket.

A daemon started without RP_TOKEN makes a random token and writes it (mode 0600) to
`$RP_DATA_DIR/token`; a client on the same machine, as the same user, reads it from there
when no token is given. Never for a remote daemon: its token is not in any local file.

The daemon also listens on `$RP_DATA_DIR/rp.sock` (mode 0600, in the 0700 directory). A
client given no URL (no argument, no RP_URL) talks over that socket when it exists, as
`psql` and `docker` do: a TCP port can be taken by another user's program while the daemon
is down, and the token read from the file would then go to that program.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import httpx

__all__ = ["default_socket", "default_token_file", "is_loopback_url", "read_token_file"]

DEFAULT_DATA_DIR = "./rp-data"  # the daemon's default RP_DATA_DIR (rp_service/settings.py)
SOCKET_NAME = "rp.sock"  # the daemon's Settings.socket_path, in its data directory


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


def _data_dir() -> Path:
    return Path(os.environ.get("RP_DATA_DIR") or DEFAULT_DATA_DIR)


def default_socket() -> Path | None:
    """`$RP_DATA_DIR/rp.sock` (default ./rp-data/rp.sock) when a socket is there, else None.

    The daemon leaves its socket in place when it stops: while it is down (a restart, an
    upgrade) connecting fails and the client says so, rather than sending the token to
    whatever holds the TCP port by then.
    """
    path = _data_dir() / SOCKET_NAME
    try:
        return path if path.is_socket() else None
    except OSError:
        return None


def default_token_file(base_url: str) -> Path | None:
    """`$RP_DATA_DIR/token` (default ./rp-data/token) for a daemon on loopback, else None."""
    if not is_loopback_url(base_url):
        return None
    return _data_dir() / "token"


def read_token_file(path: Path) -> str | None:
    """The token in `path`, or None when it is missing, unreadable or empty."""
    try:
        return path.read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None
