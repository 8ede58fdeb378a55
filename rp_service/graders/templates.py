"""`{{item.x}}` and `{{sample.output_text}}` templates, rendered as OpenAI's graders do."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from .base import Sample

__all__ = ["TemplateError", "render_template", "template_references"]

# A name path: `item`, `item.a.b`, `sample.output_json.x`; spaces inside the braces allowed.
_TAG = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_\-]+)*)\s*\}\}")
_ROOTS = ("item", "sample")


class TemplateError(LookupError):
    """A template names a variable the sample or item does not have."""


def template_references(text: str) -> list[str]:
    """The dotted names the template uses, in order (for validating a spec)."""
    return [match.group(1) for match in _TAG.finditer(text)]


def check_template(text: str) -> str | None:
    """Why the template cannot render for any sample (a root other than item/sample), or None."""
    for name in template_references(text):
        root = name.split(".", 1)[0]
        if root not in _ROOTS:
            return f"unknown template variable {{{{{name}}}}}: names start with item. or sample."
    return None


def render_template(text: str, sample: Sample, item: Mapping[str, Any]) -> str:
    """`text` with each `{{name.path}}` replaced by its value.

    Strings are inserted as they are; other values (numbers, lists, objects) as JSON, so
    `{{item}}` or `{{sample.output_json}}` give the whole object. Raises TemplateError for a
    name that does not resolve.
    """
    return _TAG.sub(lambda match: _as_text(_resolve(match.group(1), sample, item)), text)


def _resolve(name: str, sample: Sample, item: Mapping[str, Any]) -> Any:
    root, *path = name.split(".")
    value: Any
    if root == "item":
        value = item
    elif root == "sample":
        value = {"output_text": sample.output_text, "output_json": sample.output_json}
    else:
        raise TemplateError(f"unknown template variable {{{{{name}}}}}")
    for i, key in enumerate(path):
        if isinstance(value, Mapping) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            where = ".".join([root, *path[:i]])
            raise TemplateError(f"{{{{{name}}}}}: {where} has no {key!r}")
    if value is None and path[:1] == ["output_json"]:
        raise TemplateError(f"{{{{{name}}}}}: the sample is not a JSON object")
    return value


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)
