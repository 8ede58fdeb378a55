"""`python -m rp_service`: start the daemon with settings from `RP_` environment variables."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import tempfile
from typing import Any

import uvicorn
from pydantic import ValidationError

from rp_service.app import create_app
from rp_service.connections import (
    ConnectionLimits,
    bind_tcp,
    bind_unix,
    connection_protocol,
    raise_open_file_limit,
)
from rp_service.datadir import DataDir, DataDirLocked
from rp_service.jobs.store import Store, StoreUnusable
from rp_service.settings import Settings

log = logging.getLogger("rp_service")


def _refuse(message: str) -> SystemExit:
    """One clear line on stderr and exit status 2, never a traceback."""
    print(f"rp_service: refusing to start: {message}", file=sys.stderr)
    return SystemExit(2)


def _settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()))
            text = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            problems.append(f"RP_{where.upper()}: {text}" if where else text)
        raise _refuse("; ".join(problems)) from None


def _parse_args(argv: list[str] | None) -> None:
    """`--help` lists the settings; the daemon takes no other argument (a typo, or an option
    meant for `rp serve`, is refused before anything starts or is written)."""
    names = ", ".join(f"RP_{name.upper()}" for name in Settings.model_fields)
    parser = argparse.ArgumentParser(
        prog="python -m rp_service",
        description="The RoundPipe training daemon. Settings come from RP_ environment "
        "variables (defaults: 127.0.0.1:8321, data in ./rp-data, a bearer token written to "
        "<data dir>/token); docs/SERVICE.md describes each. `rp serve` starts it with "
        "options.",
        epilog=f"Settings: {names}.",
    )
    parser.parse_args(argv)


def _listen(settings: Settings) -> list[socket.socket]:
    """The sockets the daemon serves, bound before the app starts: a port another program
    holds is refused in one clear line (uvicorn would run the lifespan, log "ready", then
    exit 3 on the bind). Beside TCP, the Unix socket in the data directory when enabled."""
    try:
        sockets = [bind_tcp(settings.host, settings.port)]
    except OSError as exc:
        raise _refuse(
            f"cannot listen on {settings.host}:{settings.port} ({exc.strerror or exc}): "
            "another daemon or program holds it; stop it or choose another port (RP_PORT, "
            "rp serve --port)"
        ) from None
    host, port = sockets[0].getsockname()[:2]
    where = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    # The socket file stays when the daemon stops: a client that finds it gets "connection
    # refused" while the daemon is down (a restart, an upgrade), rather than sending the
    # token file's token to whatever holds the TCP port by then. Turned off: removed.
    if not settings.unix_socket:
        settings.socket_path.unlink(missing_ok=True)
    else:
        try:
            sockets.append(bind_unix(settings.socket_path))
            where += f" and unix socket {settings.socket_path}"
        except OSError as exc:
            log.warning(
                "no unix socket at %s (%s): clients on this machine use TCP",
                settings.socket_path,
                exc.strerror or exc,
            )
    log.info("listening on %s", where)
    return sockets


def _serve(settings: Settings, app: Any, sockets: list[socket.socket]) -> None:
    limits = ConnectionLimits(
        max_requests=settings.max_connections,
        max_waiting=settings.idle_connections,
        max_waiting_per_client=min(
            settings.max_idle_connections_per_client, settings.idle_connections
        ),
        header_timeout_s=settings.header_timeout_s,
    )
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        timeout_graceful_shutdown=20,
        http=connection_protocol(limits),
        timeout_keep_alive=settings.keep_alive_s,
        h11_max_incomplete_event_size=settings.max_header_bytes,
    )
    uvicorn.Server(config).run(sockets=sockets)


def main(argv: list[str] | None = None) -> None:
    _parse_args(argv)
    settings = _settings()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Before uvicorn, so a refusal is one clear line, not a lifespan traceback; the lock
    # before the store, so a second daemon never reads it or touches the first one's workers.
    data = DataDir(settings.data_dir)
    try:
        data.claim()
    except DataDirLocked as exc:
        raise _refuse(str(exc)) from None
    except OSError as exc:
        raise _refuse(f"cannot use the data directory {settings.data_dir}: {exc}") from None
    try:
        Store(settings.db_path).check_existing()
    except StoreUnusable as exc:
        raise _refuse(str(exc)) from None
    sockets = _listen(settings)
    settings.spool_dir.mkdir(mode=0o700, exist_ok=True)
    tempfile.tempdir = str(settings.spool_dir)  # multipart uploads spool here, not in /tmp
    soft, _ = raise_open_file_limit()
    if settings.auth == "none":
        log.warning("RP_AUTH=none: no token is asked for (loopback only: %s)", settings.host)
    elif settings.token is None:
        data.token()
        print(f"rp_service: bearer token in {data.token_path}", file=sys.stderr)
    log.info(
        "open files: up to %d; requests in progress: up to %d; idle connections: up to %d "
        "(%d per client)",
        soft,
        settings.max_connections,
        settings.idle_connections,
        settings.max_idle_connections_per_client,
    )
    _serve(settings, create_app(settings, data_dir=data), sockets)


if __name__ == "__main__":
    main()
