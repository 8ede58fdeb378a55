"""`rp chat`: talk to a trained model, its answers streamed as they are written."""

from __future__ import annotations

import sys
from typing import Any

import typer

from ._app import app, get_client, handle_errors

_QUIT = {"/quit", "/exit"}


def _answer(client: Any, model: str, messages: list[dict[str, str]], options: dict) -> str:
    """Stream one answer to stdout; return its text."""
    parts: list[str] = []
    for piece in client.chat.stream(model, messages, **options):
        parts.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(parts)


@app.command()
@handle_errors
def chat(
    ctx: typer.Context,
    model: str = typer.Argument(
        ..., metavar="JOB_OR_MODEL", help="A job id, a model id (ft:...), or a base folder name."
    ),
    prompt: str = typer.Option(None, "--prompt", "-p", help="Ask this once, print, exit."),
    system: str = typer.Option(None, "--system", help="A system message first."),
    max_tokens: int = typer.Option(None, "--max-tokens", min=1, help="Longest answer."),
    temperature: float = typer.Option(
        None, "--temperature", "-t", min=0, max=2, help="0: greedy [default: 1]."
    ),
    seed: int = typer.Option(None, "--seed", help="Sampling seed."),
) -> None:
    """Chat with a fine-tuned model: an interactive prompt (the conversation is kept;
    /quit or Ctrl-D ends it), or one answer with --prompt. The first answer waits while
    the daemon loads the model."""
    client = get_client(ctx)
    options = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed}
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    if prompt is not None:
        _answer(client, model, [*history, {"role": "user", "content": prompt}], options)
        return
    interactive = sys.stdin.isatty()
    if interactive:
        typer.echo(f"chatting with {model}; /quit or Ctrl-D to end", err=True)
    while True:
        try:
            question = input("> " if interactive else "")
        except EOFError:
            break
        if question.strip() in _QUIT:
            break
        if not question.strip():
            continue
        history.append({"role": "user", "content": question})
        history.append({"role": "assistant", "content": _answer(client, model, history, options)})
