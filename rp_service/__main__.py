"""`python -m rp_service`: start the daemon with settings from `RP_` environment variables."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import tempfile

import uvicorn
from pydantic import ValidationError

from rp_service.app import create_app
from rp_service.connections import raise_open_file_limit, with_header_timeout
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


def _check_port(host: str, port: int) -> None:
    """Refuse a port another program listens on, before the app starts: uvicorn runs the
    lifespan (which logs "ready") before it binds, then exits 3 on the bind."""
    if port == 0:
        return  # any free port: nothing to collide with
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # as uvicorn binds: SO_REUSEADDR, so a socket of a daemon that just stopped
        # (TIME_WAIT) does not count as taken
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise _refuse(
                f"cannot listen on {host}:{port} ({exc.strerror or exc}): another daemon or "
                "program holds it; stop it or choose another port (RP_PORT, rp serve --port)"
            ) from None


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
    _check_port(settings.host, settings.port)
    settings.spool_dir.mkdir(mode=0o700, exist_ok=True)
    tempfile.tempdir = str(settings.spool_dir)  # multipart uploads spool here, not in /tmp
    soft, _ = raise_open_file_limit()
    if settings.auth == "none":
        log.warning("RP_AUTH=none: no token is asked for (loopback only: %s)", settings.host)
    elif settings.token is None:
        data.token()
        print(f"rp_service: bearer token in {data.token_path}", file=sys.stderr)
    log.info("open files: up to %d; connections: up to %d", soft, settings.max_connections)
    uvicorn.run(
        create_app(settings, data_dir=data),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=20,
        http=with_header_timeout(settings.header_timeout_s),
        limit_concurrency=settings.max_connections,
        timeout_keep_alive=settings.keep_alive_s,
        h11_max_incomplete_event_size=settings.max_header_bytes,
    )


if __name__ == "__main__":
    main()
