"""The daemon's HTTP connections: uvicorn's h11 protocol with caps that keep requests served.

uvicorn's own `limit_concurrency` counts every open connection, so a thousand that never
send a request (no token needed) turn every request, `/healthz` included, into a 503.
Here a connection is *waiting* while it has no request in progress: just opened, its
request head half sent, or kept alive after a response. Waiting connections have caps of
their own, below the request cap, as PostgreSQL reserves connections and nginx limits
them per address:

    new / kept-alive connection --> waiting (oldest first) --request head--> busy
        past RP_MAX_IDLE_CONNECTIONS_PER_CLIENT: that address's oldest waiting one closed
        past RP_MAX_IDLE_CONNECTIONS:            the oldest waiting one closed
        (either once it has waited 2 s: a burst is read before any of it is closed)
        past 3/4 of either cap: a kept-alive connection is closed after 1 s, not
                                RP_KEEP_ALIVE_S
        no request head within RP_HEADER_TIMEOUT_S: closed
    busy: requests in progress; past RP_MAX_CONNECTIONS the request is answered 503

Closing the oldest (not refusing the newest) is what keeps a client that sends its
request at once served however many idle connections someone holds open.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "ConnectionLimits",
    "Waiting",
    "bind_tcp",
    "bind_unix",
    "connection_protocol",
    "raise_open_file_limit",
]

log = logging.getLogger(__name__)

_UNIX_CLIENT = "unix socket"  # the one "address" of every connection on the Unix socket
_REPORT_EVERY_S = 10.0  # closings of waiting connections are logged at most this often
# Past this share of a waiting cap, a connection kept alive after its response is closed
# after SHORT_KEEP_ALIVE_S instead of RP_KEEP_ALIVE_S: room is made before a cap is reached.
NEAR_CAP = 0.75
SHORT_KEEP_ALIVE_S = 1.0


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The caps (built from Settings by `python -m rp_service`)."""

    max_requests: int
    max_waiting: int
    max_waiting_per_client: int
    header_timeout_s: float
    # A connection younger than this is not closed to make room: a burst of new connections
    # (a reconnect storm) is accepted before their request heads are read, in the next
    # turns of the loop. Past a cap, the oldest is closed once it is this old.
    grace_s: float = 2.0


class Waiting:
    """The connections waiting for a request, oldest first, in total and per address.

    Each connection is anything with a `close_waiting()` method. Past a cap the oldest
    waiting connection over it is closed, at once when it has waited `grace_s`, else when
    it has (a timer on the running loop), if it is still waiting then.
    """

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        # connection -> (its address, since when it waits); dicts keep insertion order
        self._all: dict[Any, tuple[str, float]] = {}
        self._by_client: dict[str, dict[Any, None]] = {}
        self._over: set[str] = set()  # addresses over their cap, waiting out a grace
        self._timer: asyncio.TimerHandle | None = None
        self.closed = 0  # closed to make room, since the last report
        self._reported_at = time.monotonic()

    def __len__(self) -> int:
        return len(self._all)

    def of(self, client: str) -> int:
        return len(self._by_client.get(client, ()))

    def near_cap(self, client: str) -> bool:
        """Whether the waiting connections, in total or of `client`, are near their cap."""
        return len(self) >= NEAR_CAP * self.limits.max_waiting or (
            self.of(client) >= NEAR_CAP * self.limits.max_waiting_per_client
        )

    def add(self, conn: Any, client: str) -> None:
        """`conn` waits from now (it moves to the newest end)."""
        self.remove(conn)
        self._all[conn] = (client, time.monotonic())
        self._by_client.setdefault(client, {})[conn] = None
        self._over.add(client)
        self._enforce()

    def remove(self, conn: Any) -> None:
        entry = self._all.pop(conn, None)
        if entry is None:
            return
        mine = self._by_client[entry[0]]
        del mine[conn]
        if not mine:
            del self._by_client[entry[0]]

    def _enforce(self) -> None:
        """Close the oldest past each cap that are past their grace; time the rest."""
        now = time.monotonic()
        due: float | None = None
        for client in list(self._over):
            mine = self._by_client.get(client, {})
            due = self._trim(mine, self.limits.max_waiting_per_client, now, due)
            if len(mine) <= self.limits.max_waiting_per_client:
                self._over.discard(client)
        due = self._trim(self._all, self.limits.max_waiting, now, due)
        if due is not None and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(due - now, self._on_timer)

    def _trim(self, conns: dict[Any, Any], cap: int, now: float, due: float | None) -> float | None:
        while len(conns) > cap:
            oldest = next(iter(conns))
            ready_at = self._all[oldest][1] + self.limits.grace_s
            if ready_at > now:
                return ready_at if due is None else min(due, ready_at)
            self._close(oldest)
        return due

    def _on_timer(self) -> None:
        self._timer = None
        self._enforce()

    def _close(self, conn: Any) -> None:
        client = self._all[conn][0]
        self.remove(conn)
        conn.close_waiting()
        self.closed += 1
        now = time.monotonic()
        if now - self._reported_at >= _REPORT_EVERY_S:
            log.warning(
                "closed %d connections that sent no request, to make room for new ones "
                "(latest from %s; %d waiting now; RP_MAX_IDLE_CONNECTIONS=%d, "
                "RP_MAX_IDLE_CONNECTIONS_PER_CLIENT=%d)",
                self.closed,
                client,
                len(self._all),
                self.limits.max_waiting,
                self.limits.max_waiting_per_client,
            )
            self.closed = 0
            self._reported_at = now


class _LimitedProtocol(H11Protocol):
    limits: ConnectionLimits  # both set by connection_protocol(): one pair per server
    waiting: Waiting

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None  # uvicorn's count of connections: replaced below
        self._client_key = _UNIX_CLIENT
        inner = self.app

        async def app_or_busy(scope: Any, receive: Any, send: Any) -> None:
            # This request's own task is in `tasks` already.
            if len(self.tasks) > self.limits.max_requests:
                log.warning(
                    "%d requests in progress, over RP_MAX_CONNECTIONS=%d: answered 503",
                    len(self.tasks),
                    self.limits.max_requests,
                )
                await service_unavailable(scope, receive, send)
            else:
                await inner(scope, receive, send)

        self.app = app_or_busy

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.client is not None:
            self._client_key = self.client[0]
        self._start_waiting()

    def connection_lost(self, exc: Exception | None) -> None:
        self.waiting.remove(self)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request head arrived: busy until its response
            self.waiting.remove(self)

    def handle_websocket_upgrade(self, event: Any) -> None:
        self.waiting.remove(self)  # the connection is the WebSocket protocol's from here
        super().handle_websocket_upgrade(event)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.waiting.near_cap(self._client_key) and self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()  # uvicorn's RP_KEEP_ALIVE_S: shortened
            self.timeout_keep_alive_task = self.loop.call_later(
                min(SHORT_KEEP_ALIVE_S, self.timeout_keep_alive), self.timeout_keep_alive_handler
            )
        self._start_waiting()

    def close_waiting(self) -> None:
        """Closed to make room (see Waiting): only ever while no request is in progress."""
        if not self.transport.is_closing():
            self.transport.close()

    def _start_waiting(self) -> None:
        waited_for = self.cycle  # a request that starts after now makes a new cycle
        self.loop.call_later(self.limits.header_timeout_s, self._header_deadline, waited_for)
        self.waiting.add(self, self._client_key)

    def _header_deadline(self, waited_for: Any) -> None:
        idle = waited_for is None or waited_for.response_complete
        if idle and self.cycle is waited_for and not self.transport.is_closing():
            self.transport.close()  # no request began in time: free its slot and its file


def connection_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """The protocol class to give uvicorn as `http=` (uvicorn's `limit_concurrency` unset):
    one class per server, so its listeners (TCP and the Unix socket) share the caps."""
    return type(
        "RoundPipeH11Protocol",
        (_LimitedProtocol,),
        {"limits": limits, "waiting": Waiting(limits)},
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


def bind_tcp(host: str, port: int) -> socket.socket:
    """A TCP socket bound as uvicorn binds one (SO_REUSEADDR: a socket of a daemon that just
    stopped, in TIME_WAIT, does not count as taken); raises OSError when the port is held."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def bind_unix(path: Path) -> socket.socket:
    """A Unix socket at `path`, mode 0600 from the start; any file already there is removed
    first (a socket left by a daemon that was killed: the caller holds the data directory's
    lock, so no live daemon owns it). Raises OSError (a path too long for a socket, say)."""
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # no moment at which another user could connect
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    return sock
