"""The "tiny" spec of the README and of docs/SDK.md is tiny: every width is set, so the
model is a tenth of a million parameters (it kept the preset's 16 heads and 3072-wide MLP:
10.6 M parameters, minutes for 100 CPU steps instead of seconds)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from rp_service.data.tokenizer import BYTE_VOCAB_SIZE
from rp_service.schemas import JobSpec
from rp_service.worker.modeling import build_model

ROOT = Path(__file__).resolve().parents[3]


def _readme_spec() -> dict:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```yaml\n(# spec\.yaml.*?)```", text, re.S)
    assert block is not None
    return yaml.safe_load(block.group(1))


def _sdk_spec() -> dict:
    text = (ROOT / "docs" / "SDK.md").read_text()
    literal = re.search(r"\nspec = (\{\n.*?\n\})\n", text, re.S)
    assert literal is not None
    return ast.literal_eval(literal.group(1))


@pytest.mark.parametrize("read", [_readme_spec, _sdk_spec], ids=["README", "SDK.md"])
def test_the_tiny_spec_is_tiny(read) -> None:
    spec = JobSpec.model_validate(read())
    model = build_model(
        preset=spec.model.preset,
        config_overrides=dict(spec.model.config),
        path=None,
        dtype="float32",
        vocab_size=BYTE_VOCAB_SIZE,
        seed=0,
    )
    assert sum(p.numel() for p in model.parameters()) < 200_000
