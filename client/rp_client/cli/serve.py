"""`rp serve`: run the daemon here (`python -m rp_service`) with options as RP_ settings."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ._app import EXIT_FAILED, app, fail
from ._daemon import (
    INSTALL_HINT,
    daemon_env,
    dashboard_url,
    exec_daemon,
    server_installed,
    token_file,
)


@app.command()
def serve(
    host: str = typer.Option(None, "--host", help="Bind address [RP_HOST, 127.0.0.1]."),
    port: int = typer.Option(None, "--port", help="Port [RP_PORT, 8321]."),
    data_dir: Path = typer.Option(None, "--data-dir", help="Store, files, jobs [RP_DATA_DIR]."),
    token: str = typer.Option(None, "--token", help="Require this bearer token [RP_TOKEN]."),
    gpus: str = typer.Option(None, "--gpus", help="all | none | ids like 0,1 [RP_GPUS]."),
    cpu_devices: int = typer.Option(None, "--cpu-devices", help="[RP_CPU_DEVICES]"),
    model_root: list[Path] = typer.Option(
        None, "--model-root", help="Allowed local model directory (repeatable)."
    ),
    dataset_root: list[Path] = typer.Option(
        None, "--dataset-root", help="Allowed local dataset directory (repeatable)."
    ),
    log_level: str = typer.Option(None, "--log-level", help="[RP_LOG_LEVEL]"),
) -> None:
    """Run the RoundPipe daemon in the foreground (needs the server package)."""
    if not server_installed():
        raise fail(INSTALL_HINT, EXIT_FAILED)
    env = daemon_env(
        host=host,
        port=port,
        data_dir=data_dir.resolve() if data_dir else None,
        token=token,
        gpus=gpus,
        cpu_devices=cpu_devices,
        model_roots=[str(p.resolve()) for p in model_root] if model_root else None,
        dataset_roots=[str(p.resolve()) for p in dataset_root] if dataset_root else None,
        log_level=log_level,
    )
    sys.stderr.write(f"dashboard: {dashboard_url(env)} (it asks for the token once)\n")
    if not env.get("RP_TOKEN") and env.get("RP_AUTH", "token") != "none":
        where = token_file(env)
        sys.stderr.write(
            f"token: in {where} (made on the first start; `rp` and the SDK on this machine "
            "read it, give it to others as RP_TOKEN)\n"
        )
    code = exec_daemon(env)
    raise typer.Exit(code if code >= 0 else 1)
