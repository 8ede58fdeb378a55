"""`fine_tuning.alpha.graders`: validate a grader spec and run it on one sample.

A spec that cannot run here (an unknown metric, a bad formula, python graders off) is a
400 naming the field; a sample that fails to grade is a 200 with reward 0 and OpenAI's
error flags set, as OpenAI answers it.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from rp_service.errors import BadRequest
from rp_service.graders import (
    Grader,
    GraderConfigError,
    GraderSpec,
    Sample,
    build_grader,
    python_graders_allowed,
)
from rp_service.openai.grader_schemas import (
    GraderRunErrors,
    GraderRunMetadata,
    GraderRunRequest,
    GraderRunResponse,
    GraderValidateRequest,
    GraderValidateResponse,
)
from rp_service.settings import Settings

__all__ = ["Graders"]


class Graders:
    """The grader routes' logic; python graders run in a scratch directory under the data dir."""

    def __init__(self, settings: Settings) -> None:
        self._scratch = settings.data_dir / "graders"

    async def validate(self, body: GraderValidateRequest) -> GraderValidateResponse:
        """The spec back when it can run here; BadRequest naming the field otherwise."""
        await asyncio.to_thread(self._check, body.grader)
        return GraderValidateResponse(grader=body.grader)

    async def run(self, body: GraderRunRequest) -> GraderRunResponse:
        """The grader's reward for `model_sample` against `item`, with OpenAI's metadata."""
        return await asyncio.to_thread(self._run, body)

    def _check(self, spec: GraderSpec) -> None:
        with tempfile.TemporaryDirectory(dir=self._scratch_dir()) as workdir:
            self._build(spec, Path(workdir)).close()

    def _run(self, body: GraderRunRequest) -> GraderRunResponse:
        sample = Sample(body.model_sample, output_json=_json_object(body.model_sample))
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=self._scratch_dir()) as workdir:
            grader = self._build(body.grader, Path(workdir))
            try:
                result = grader.grade([sample], [body.item or {}])
            finally:
                grader.close()
        detail = result.error_details[0] if result.error_details else None
        sub = {k: v[0] for k, v in result.by_grader.items() if k != body.grader.name}
        return GraderRunResponse(
            reward=result.scores[0],
            sub_rewards=sub,
            metadata=GraderRunMetadata(
                errors=_error_flags(detail),
                execution_time=time.monotonic() - started,
                name=body.grader.name,
                scores={k: v[0] for k, v in result.by_grader.items()},
                type=body.grader.type,
            ),
        )

    def _build(self, spec: GraderSpec, workdir: Path) -> Grader:
        try:
            return build_grader(spec, allow_python=python_graders_allowed(), workdir=workdir)
        except GraderConfigError as exc:
            raise BadRequest(exc.message, code="invalid_grader", param=exc.field) from None

    def _scratch_dir(self) -> Path:
        self._scratch.mkdir(parents=True, exist_ok=True)
        return self._scratch


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _error_flags(detail: str | None) -> GraderRunErrors:
    """OpenAI's flags for a failed sample, from the grader's "Kind: message" detail."""
    if detail is None:
        return GraderRunErrors()
    if "TemplateError" in detail:
        return GraderRunErrors(invalid_variable_error=True)
    if "TimeoutError" in detail:
        return GraderRunErrors(unresponsive_reward_error=True)
    if "PythonGraderError" in detail:
        return GraderRunErrors(
            python_grader_runtime_error=True, python_grader_runtime_error_details=detail
        )
    return GraderRunErrors(other_error=True)
