"""`python -m rp_service`: start the daemon with settings from `RP_` environment variables."""

from __future__ import annotations

import logging
import sys

import uvicorn

from rp_service.app import create_app
from rp_service.jobs.store import Store, StoreUnusable
from rp_service.settings import Settings


def main() -> None:
    settings = Settings()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:  # before uvicorn: a refusal is one clear line, not a lifespan traceback
        Store(settings.db_path).check_existing()
    except StoreUnusable as exc:
        print(f"rp_service: refusing to start: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=20,
    )


if __name__ == "__main__":
    main()
