"""Samples in the JobSpec: train.sample_prompts / sample_max_tokens, defaults and 422s that
name the field and say how to fix it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rp_service.app import create_app
from rp_service.schemas import MAX_SAMPLE_PROMPT_CHARS, MAX_SAMPLE_PROMPTS, JobSpec
from rp_service.settings import Settings

BASE = {
    "model": {"preset": "qwen3", "config": {"hidden_size": 64, "head_dim": 16}},
    "data": {"train": "synthetic"},
}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path / "data", gpus="none", auth="none")
    with TestClient(create_app(settings), base_url="http://127.0.0.1:8321") as c:
        yield c


def test_no_prompts_and_64_tokens_by_default_and_the_spec_round_trips() -> None:
    spec = JobSpec.model_validate(BASE)
    assert spec.train.sample_prompts == [] and spec.train.sample_max_tokens == 64
    prompts = ["Tell me a story.", "  2 + 2 =\n"]  # kept as given, whitespace included
    body = {**BASE, "train": {"sample_prompts": prompts, "sample_max_tokens": 1024}}
    dumped = JobSpec.model_validate(body).model_dump(mode="json")
    assert dumped["train"]["sample_prompts"] == prompts
    assert JobSpec.model_validate(dumped).model_dump(mode="json") == dumped
    eight = [str(i) for i in range(MAX_SAMPLE_PROMPTS)]
    longest = "x" * MAX_SAMPLE_PROMPT_CHARS
    for ok in (eight, [longest]):
        assert JobSpec.model_validate({**BASE, "train": {"sample_prompts": ok}})


@pytest.mark.parametrize(
    ("train", "param", "words"),
    [
        ({"sample_prompts": [f"p{i}" for i in range(9)]}, "train.sample_prompts", "at most 8"),
        ({"sample_prompts": ["ok", "  \n"]}, "train.sample_prompts", "prompt 1 is empty"),
        ({"sample_prompts": ["ok", ""]}, "train.sample_prompts", "give it some text"),
        (
            {"sample_prompts": ["x" * (MAX_SAMPLE_PROMPT_CHARS + 1)]},
            "train.sample_prompts",
            f"shorten it to at most {MAX_SAMPLE_PROMPT_CHARS}",
        ),
        ({"sample_prompts": "hello"}, "train.sample_prompts", "list"),
        ({"sample_prompts": [1]}, "train.sample_prompts.0", "string"),
        ({"sample_max_tokens": 0}, "train.sample_max_tokens", "greater than or equal to 1"),
        ({"sample_max_tokens": 1025}, "train.sample_max_tokens", "less than or equal to 1024"),
    ],
)
def test_bad_sample_settings_are_422_naming_the_field(
    client: TestClient, train: dict, param: str, words: str
) -> None:
    r = client.post("/v1/jobs", json={**BASE, "train": train})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"] and err["message"].startswith(param)
