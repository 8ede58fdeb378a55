"""Exports of a finished job's model (GGUF), run in a child process: the daemon never
imports torch, so `python -m rp_service.export` loads and writes the model (docs/EXPORT.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys

from rp_service.errors import Conflict, InvalidRequest
from rp_service.jobs.store import JobRecord
from rp_service.schemas import Export, ExportRequest
from rp_service.settings import Settings

__all__ = ["export_job"]

log = logging.getLogger(__name__)

# Exports hold a whole model in host memory: one at a time (a second waits its turn).
_ONE_AT_A_TIME = asyncio.Lock()


async def export_job(settings: Settings, job: JobRecord, request: ExportRequest) -> Export:
    """Write the job's model as `request` asks into `<job dir>/export/`; the Export.

    Raises:
        Conflict: the job has not succeeded (no trained model yet).
        InvalidRequest: llama.cpp cannot load this model (the child's ExportError).
    """
    if job.status != "succeeded" or not job.output_model_path:
        raise Conflict(
            f"job {job.id} is {job.status}; its model can be exported once it succeeded",
            code="job_not_succeeded",
            param="job_id",
        )
    payload = {
        "output": job.output_model_path,
        "spec": job.spec,
        "type": request.type,
        "dest": str(settings.jobs_dir / job.id / "export"),
        "name": job.id,
    }
    async with _ONE_AT_A_TIME:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rp_service.export",
            json.dumps(payload),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
    message = err.decode(errors="replace").strip().splitlines()
    if proc.returncode == 2:
        raise InvalidRequest(
            f"{request.format} export of job {job.id}: {message[-1] if message else 'refused'}",
            code="not_exportable",
            param="format",
        )
    if proc.returncode != 0:
        log.error("export of %s failed (exit %s): %s", job.id, proc.returncode, "\n".join(message))
        raise RuntimeError(f"the export process exited {proc.returncode}")
    result = json.loads(out.decode().strip().splitlines()[-1])
    return Export(
        job_id=job.id,
        format=request.format,
        type=request.type,
        path=result["path"],
        modelfile=result["modelfile"],
        size_bytes=result["bytes"],
    )
