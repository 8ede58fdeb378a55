"""jsonl dataset formats and their line checks: what an upload and training both accept.

Five formats, one JSON object a line (blank lines are skipped, but counted in line
numbers): ``text`` ``{"text": str}``; ``chat`` ``{"messages": [{"role", "content"}, ...]}``;
``prompt_completion`` ``{"prompt": str, "completion": str}``; ``preference`` (pairs for
DPO, see `preference`); ``prompt`` (GRPO's rows: ``{"messages": [...]}`` without an
assistant turn, OpenAI's reinforcement rows, or ``{"prompt": str | messages}`` without a
completion, TRL's; any other keys are the item the grader reads). No torch here: the daemon checks uploads with these functions
without loading it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from rp_service.errors import JobFailure

from .preference import check_preference, is_preference

__all__ = [
    "CHAT_ROLES",
    "FORMATS",
    "DataFormat",
    "DataFormatError",
    "iter_records",
    "read_records",
    "validate_jsonl",
]

DataFormat = Literal["text", "chat", "prompt_completion", "preference", "prompt"]
FORMATS: tuple[DataFormat, ...] = ("text", "chat", "prompt_completion", "preference", "prompt")
IGNORE_INDEX = -100
"""Label value that takes no loss (padding, prompts, non-assistant chat turns)."""

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
_MAX_SHOWN = 80  # characters of a bad value quoted back in an error message


class DataFormatError(JobFailure, ValueError):
    """A dataset line is malformed; `line` is its 1-based line number (0: the whole file).

    `param` is None: the caller knows which of data.train / data.valid it read.
    """

    def __init__(self, message: str, *, line: int) -> None:
        super().__init__("invalid_data", message, line=line)
        self.args = (f"line {line}: {message}" if line else message,)
        self.line = line

    def in_field(self, param: str) -> JobFailure:
        """This error as the job's failure, naming the field that read the file
        (``data.train line 3: ...``)."""
        where = f"{param} line {self.line}: " if self.line else f"{param}: "
        return JobFailure("invalid_data", where + self.message, param=param, line=self.line)


# ---------------------------------------------------------------- parsing and validation


def _require_str(record: dict[str, Any], key: str, *, where: str = "") -> str:
    value = record.get(key)
    if not isinstance(value, str):
        got = "missing" if key not in record else f"a {type(value).__name__}"
        raise ValueError(f'"{where}{key}" must be a string, got {got}')
    return value


def _check_text(record: dict[str, Any]) -> None:
    if not _require_str(record, "text"):
        raise ValueError('"text" is empty')


def _check_prompt_completion(record: dict[str, Any]) -> None:
    _require_str(record, "prompt")
    if not _require_str(record, "completion"):
        raise ValueError('"completion" is empty: there would be nothing to train on')


def _check_messages(messages: Any, key: str = "messages") -> bool:
    """Check a list of chat messages; return whether an assistant turn is among them."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'"{key}" must be a non-empty list of {{"role", "content"}} objects')
    has_assistant = False
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f'"messages[{i}]" must be an object with "role" and "content"')
        role = _require_str(message, "role", where=f"messages[{i}].")
        if role not in CHAT_ROLES:
            raise ValueError(
                f'"messages[{i}].role" is {role[:_MAX_SHOWN]!r}; allowed: {sorted(CHAT_ROLES)}'
            )
        _require_str(message, "content", where=f"messages[{i}].")
        has_assistant = has_assistant or role == "assistant"
    return has_assistant


def _check_chat(record: dict[str, Any]) -> None:
    if not _check_messages(record.get("messages")):
        raise ValueError(
            '"messages" has no "assistant" message: there would be nothing to train on'
        )


def _check_prompt(record: dict[str, Any]) -> None:
    if "messages" in record:
        if _check_messages(record["messages"]) and record["messages"][-1]["role"] == "assistant":
            raise ValueError(
                '"messages" ends with an assistant turn: a prompt row ends where the model '
                "is to answer (a user or system turn)"
            )
        return
    prompt = record.get("prompt")
    if isinstance(prompt, list):
        _check_messages(prompt, "prompt")
    elif not _require_str(record, "prompt").strip():
        raise ValueError('"prompt" is empty')


_CHECKS = {
    "text": _check_text,
    "chat": _check_chat,
    "prompt_completion": _check_prompt_completion,
    "preference": check_preference,
    "prompt": _check_prompt,
}


def _detect(record: dict[str, Any]) -> DataFormat:
    if is_preference(record):
        return "preference"
    if "messages" in record:
        messages = record["messages"]
        # no assistant turn: nothing to imitate, a prompt to answer (reinforcement rows)
        if isinstance(messages, list) and not any(
            isinstance(m, dict) and m.get("role") == "assistant" for m in messages
        ):
            return "prompt"
        return "chat"
    if "prompt" in record and "completion" not in record:
        return "prompt"
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    keys = ", ".join(sorted(record)[:8]) or "none"
    raise ValueError(
        'cannot tell the format: expected a "text", "messages" or "prompt"/"completion" key '
        '(or "chosen"/"rejected", "preferred_output" for preference pairs), '
        f"found keys: {keys}"
    )


def _lines(source: str | Path | Iterable[str | bytes]) -> Iterator[str | bytes]:
    if isinstance(source, (str, Path)):
        with open(source, "rb") as f:
            yield from f
    else:
        yield from source


def _where(exc: json.JSONDecodeError, text: str) -> str:
    """The decoder's message with a column inside the line: an error found where the line
    ended (an unclosed object, say) is said to be there, not at a column past the end."""
    line = text.rstrip("\r\n")
    what = exc.msg.removesuffix(" at")  # "Invalid control character at"
    if exc.pos >= len(line):
        return f"{what} where the line ends, after column {len(line)}"
    return f"{what} at column {exc.pos + 1}"


def iter_records(
    source: str | Path | Iterable[str | bytes], format: str = "auto"
) -> Iterator[tuple[int, DataFormat, dict[str, Any]]]:
    """Yield `(line_number, format, record)` for each non-blank line, validating as it goes.

    Args:
        source: a jsonl file path, or its lines (str or bytes).
        format: ``auto`` (decided by the first record; every later line must match it),
            ``text``, ``chat``, ``prompt_completion``, ``preference`` or ``prompt``.

    Raises:
        DataFormatError: at the first malformed line, naming it.
    """
    if format != "auto" and format not in _CHECKS:
        raise DataFormatError(f"unknown format {format!r}; use auto, {', '.join(FORMATS)}", line=0)
    fmt: DataFormat | None = None if format == "auto" else format  # type: ignore[assignment]
    for number, raw in enumerate(_lines(source), start=1):
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError as exc:
            raise DataFormatError(f"not valid UTF-8 ({exc.reason})", line=number) from exc
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataFormatError(f"not valid JSON ({_where(exc, text)})", line=number) from exc
        except RecursionError:
            raise DataFormatError(
                "nested too deeply to parse (JSON arrays or objects inside one another)",
                line=number,
            ) from None
        if not isinstance(record, dict):
            raise DataFormatError(
                f"expected a JSON object, got a {type(record).__name__}", line=number
            )
        try:
            if fmt is None:
                fmt = _detect(record)
            _CHECKS[fmt](record)
        except ValueError as exc:
            raise DataFormatError(f"{exc} (format {fmt or 'auto'})", line=number) from exc
        yield number, fmt, record


def validate_jsonl(
    path_or_lines: str | Path | Iterable[str | bytes], format: str = "auto"
) -> tuple[int, DataFormat]:
    """Check a whole jsonl dataset; return `(record_count, detected_format)`.

    Raises:
        DataFormatError: the first malformed line, or ``line=0`` for a file without records.
    """
    count = 0
    fmt: DataFormat | None = None
    for _, line_format, _record in iter_records(path_or_lines, format):
        count += 1
        fmt = line_format
    if count == 0 or fmt is None:
        raise DataFormatError("the dataset has no records (every line is blank)", line=0)
    return count, fmt


def read_records(
    source: str | Path | Iterable[str | bytes], format: str = "auto"
) -> tuple[DataFormat, list[dict[str, Any]]]:
    """All records of a dataset and its format (validated as in `validate_jsonl`)."""
    records: list[dict[str, Any]] = []
    fmt: DataFormat | None = None
    for _, line_format, record in iter_records(source, format):
        records.append(record)
        fmt = line_format
    if fmt is None:
        raise DataFormatError("the dataset has no records (every line is blank)", line=0)
    return fmt, records
