"""`rp export`: a job's trained model as GGUF for llama.cpp and Ollama."""

from __future__ import annotations

import sys

import typer

from ._app import app, get_client, handle_errors, print_json


@app.command()
@handle_errors
def export(
    ctx: typer.Context,
    job_id: str = typer.Argument(..., metavar="JOB"),
    format: str = typer.Option("gguf", "--format", help="gguf (llama.cpp, Ollama)."),
    type: str = typer.Option("f16", "--type", help="f16 | q8_0 | f32: the matrices' type."),
    json_out: bool = typer.Option(False, "--json", help="Print the export as JSON."),
) -> None:
    """Export a succeeded job's model (a LoRA job merged); prints the file and Modelfile."""
    done = get_client(ctx).jobs.export(job_id, format=format, type=type)
    if json_out:
        print_json(done.model_dump(mode="json"))
        return
    sys.stdout.write(f"{done.path}\n")
    sys.stderr.write(
        f"{done.size_bytes:,} bytes; Ollama: cd {done.modelfile.rsplit('/', 1)[0]} && "
        f"ollama create {job_id} -f Modelfile\n"
    )
