"""The route class of OpenAI's routes: their request errors answer 400, as OpenAI's do.

The app's handler answers a request that fails validation with 422 (the native API's
rule). OpenAI answers 400 (`openai.BadRequestError`), and names an unknown parameter as
unsupported; this class turns the validation error into that before it reaches the handler.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from rp_service.errors import BODY_NOT_AN_OBJECT, BadRequest, body_is_not_an_object

__all__ = ["OpenAIRoute", "bad_request"]

_AUTO_PARAMS = ("hyperparameters.", "method.supervised.hyperparameters.")
_GRADER_TAGS = frozenset(
    {"string_check", "text_similarity", "multi", "python", "score_model", "label_model"}
)
_UNION_MEMBER = re.compile(r"literal\[.*\]|constrained-\w+|int|float|str")


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    # pydantic names the member of a union that failed ("literal['auto']", "constrained-int");
    # the parameter is what the caller knows.
    parts = [p for p in parts if not _UNION_MEMBER.fullmatch(p)]
    # A grader's discriminated union names its `type` tag after the grader's path
    # (grader.string_check.operation); the caller's path has no such step.
    parts = [
        p
        for i, p in enumerate(parts)
        if not (
            p in _GRADER_TAGS
            and i > 0
            and (parts[i - 1] == "grader" or parts[i - 2 : i - 1] == ["graders"])
        )
    ]
    return ".".join(parts) or None


def bad_request(exc: RequestValidationError) -> BadRequest:
    """The first validation error as OpenAI's 400, the rest in `details`."""
    details: list[dict[str, Any]] = []
    seen: set[str | None] = set()
    for err in exc.errors():
        param = _param(tuple(err.get("loc", ())))
        kind = err.get("type", "")
        if kind == "literal_error" and "'auto'" in str(err.get("msg", "")):
            continue  # "auto" | number: the number's error says what was wrong
        if param in seen:
            continue
        seen.add(param)
        if kind == "extra_forbidden":
            message = (
                f"unsupported parameter {param!r}: this daemon does not implement it; "
                "remove it (docs/API.md lists what each OpenAI route takes)"
            )
            code = "unsupported_parameter"
        elif kind == "missing":
            message, code = f"missing required parameter {param!r}", "missing_required_parameter"
        elif kind == "json_invalid":
            param, code = None, "invalid_json"
            message = "the body is not valid JSON"
        elif body_is_not_an_object(err):
            param, code, message = None, "invalid_json", BODY_NOT_AN_OBJECT
        else:
            text = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            if kind in (
                "greater_than_equal",
                "greater_than",
                "less_than_equal",
                "int_parsing",
                "float_parsing",
                "int_from_float",
            ):
                text += ' (or "auto")' if param and param.startswith(_AUTO_PARAMS) else ""
            message, code = f"{param}: {text}" if param else text, "invalid_value"
        details.append({"param": param, "message": message, "code": code})
    first = details[0] if details else {"param": None, "message": "invalid request", "code": None}
    message = first["message"]
    if len(details) > 1:
        message += f" (and {len(details) - 1} more: see details)"
    return BadRequest(message, code=first["code"], param=first["param"], details=details)


class OpenAIRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                raise bad_request(exc) from None

        return route
