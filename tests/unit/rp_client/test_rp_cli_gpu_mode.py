"""`rp status` names the job's GPU mode and why (the job object's gpu_mode)."""

from __future__ import annotations

import httpx
from rp_client.cli import app
from typer.testing import CliRunner

from ._fakes import job_obj


def test_status_shows_the_gpu_mode_and_its_reason(make_client) -> None:
    reason = "engine.gpu_mode is 'ranks'"
    job = job_obj(status="running", gpu_mode={"mode": "ranks", "ranks": 4, "reason": reason})
    client, _ = make_client(lambda r: httpx.Response(200, json=job), max_retries=0)
    result = CliRunner().invoke(app, ["status", "job-1"], obj={"client": client})
    assert result.exit_code == 0, result.output
    line = next(x for x in result.stdout.splitlines() if x.startswith("gpu mode"))
    assert line.split(None, 2)[2] == f"ranks x 4: {reason}"
    piped = {"mode": "pipeline", "ranks": 1, "reason": "r", "overlap_calls": True}
    client, _ = make_client(
        lambda r: httpx.Response(200, json=job_obj(status="running", gpu_mode=piped)),
        max_retries=0,
    )
    result = CliRunner().invoke(app, ["status", "job-1"], obj={"client": client})
    line = next(x for x in result.stdout.splitlines() if x.startswith("gpu mode"))
    assert line.split(None, 2)[2] == "pipeline, calls overlapped: r"
    older = job_obj(status="running")  # a daemon from before the field: no line
    client, _ = make_client(lambda r: httpx.Response(200, json=older), max_retries=0)
    result = CliRunner().invoke(app, ["status", "job-1"], obj={"client": client})
    assert result.exit_code == 0 and "gpu mode" not in result.stdout
