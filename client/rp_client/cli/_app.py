"""The `rp` typer app, its global options, and how commands get a client and report errors."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console

from .._client import Client
from ..errors import APIConnectionError, APIError, APIStatusError
from ..models import Job

EXIT_OK = 0
EXIT_FAILED = 1  # the job failed or was cancelled; the daemon or the connection failed
EXIT_USAGE = 2  # bad arguments, a bad spec, an unknown id, an illegal transition

F = TypeVar("F", bound=Callable[..., Any])

app = typer.Typer(
    name="rp",
    help="Drive a RoundPipe daemon: submit, watch, pause, resume and cancel training jobs.\n\n"
    "Exit codes: 0 ok, 1 the job failed or was cancelled (or the daemon was unreachable), "
    "2 usage error (bad arguments or spec, unknown id, illegal transition).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _options(
    ctx: typer.Context,
    url: str = typer.Option(
        None, "--url", help="Daemon base URL [env RP_URL; default http://127.0.0.1:8321]."
    ),
    token: str = typer.Option(None, "--token", help="Bearer token [env RP_TOKEN]."),
) -> None:
    if not isinstance(ctx.obj, dict):
        ctx.obj = {}
    ctx.obj.setdefault("url", url)
    ctx.obj.setdefault("token", token)


def get_client(ctx: typer.Context) -> Client:
    """The client for this invocation (tests put a ready one in `obj["client"]`)."""
    root = ctx.find_root()
    if not isinstance(root.obj, dict):
        root.obj = {}
    client = root.obj.get("client")
    if client is None:
        client = Client(root.obj.get("url"), token=root.obj.get("token"))
        root.obj["client"] = client
        root.call_on_close(client.close)
    return client


def stdout() -> Console:
    """A console for tables; wide when piped, so ids are never cut for a script."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=250)
    return console


def printable(text: str) -> str:
    """`text` with control and invisible characters escaped (ESC as \\x1b), so a job name or
    a log line cannot move the cursor, recolour or rewrite the terminal."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def fail(message: str, code: int = EXIT_FAILED) -> typer.Exit:
    """Prints `error: message` on stderr; returns the Exit to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def exit_code_for(exc: APIError) -> int:
    if isinstance(exc, APIStatusError) and 400 <= exc.status_code < 500:
        return EXIT_USAGE
    return EXIT_FAILED


def handle_errors(fn: F) -> F:
    """Turns SDK errors into one `error: ...` line and an exit code, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except APIConnectionError as exc:
            raise fail(str(exc), EXIT_FAILED) from None
        except APIError as exc:
            raise fail(str(exc), exit_code_for(exc)) from None
        except TimeoutError as exc:
            raise fail(str(exc), EXIT_FAILED) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, default=str) + "\n")
    sys.stdout.flush()


def job_exit_code(job: Job) -> int:
    return EXIT_OK if job.status == "succeeded" else EXIT_FAILED
