"""The daemon's HTTP connections: uvicorn's h11 protocol with a deadline for request headers.

uvicorn closes a kept-alive connection after `timeout_keep_alive`, but a connection that
never sends (or never finishes) its request headers stays open for good, and every such
connection counts against `limit_concurrency` and an open file. Here each connection must
start a request within `header_timeout_s` of opening, or of its previous response.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["raise_open_file_limit", "with_header_timeout"]

log = logging.getLogger(__name__)


class _DeadlineProtocol(H11Protocol):
    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        waited_for = self.cycle  # a request that starts after now makes a new cycle
        self.loop.call_later(self.header_timeout_s, self._header_deadline, waited_for)

    def _header_deadline(self, waited_for: Any) -> None:
        idle = waited_for is None or waited_for.response_complete
        if idle and self.cycle is waited_for and not self.transport.is_closing():
            self.transport.close()  # no request began in time: free its slot and its file


def with_header_timeout(header_timeout_s: float) -> type[H11Protocol]:
    """The protocol class to give uvicorn as `http=`."""
    return type(
        "RoundPipeH11Protocol", (_DeadlineProtocol,), {"header_timeout_s": header_timeout_s}
    )


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's open-file soft limit to its hard limit; returns (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft, hard
