"""`client.fine_tuning.alpha.graders` of the official `openai` SDK against the app in-process
(rp_service/openai/graders.py): validate, run, and the 400s that name the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest
from fastapi.testclient import TestClient

from rp_service.app import create_app
from rp_service.settings import Settings

LOOPBACK = "http://127.0.0.1:8321"


@pytest.fixture(scope="module")
def app_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    # One app for the module: its start-up (store, orchestrator) is most of a test's time.
    settings = Settings(data_dir=tmp_path_factory.mktemp("data"), gpus="none", token="tok")
    with TestClient(create_app(settings), base_url=LOOPBACK) as client:
        yield client


@pytest.fixture
def sdk(app_client: TestClient) -> openai.OpenAI:
    """The SDK with its requests answered by the app in this process."""

    def forward(request: httpx2.Request) -> httpx2.Response:
        answer = app_client.request(
            request.method, str(request.url), headers=dict(request.headers), content=request.content
        )
        return httpx2.Response(
            answer.status_code, headers=answer.headers.raw, content=answer.content
        )

    http = httpx2.Client(transport=httpx2.MockTransport(forward))
    return openai.OpenAI(api_key="tok", base_url=f"{LOOPBACK}/v1", http_client=http, max_retries=0)


CHECK: dict[str, Any] = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


def test_validate_returns_the_grader(sdk: openai.OpenAI) -> None:
    answer = sdk.fine_tuning.alpha.graders.validate(grader=CHECK)  # type: ignore[arg-type]
    assert answer.grader is not None and answer.grader.type == "string_check"
    assert answer.grader.name == "exact"


def test_run_scores_a_sample(sdk: openai.OpenAI) -> None:
    run = sdk.fine_tuning.alpha.graders.run
    hit = run(grader=CHECK, model_sample="42", item={"answer": "42"})  # type: ignore[arg-type]
    assert hit.reward == 1.0
    assert hit.metadata.name == "exact" and hit.metadata.type == "string_check"
    assert hit.metadata.errors.invalid_variable_error is False
    miss = run(grader=CHECK, model_sample="41", item={"answer": "42"})  # type: ignore[arg-type]
    assert miss.reward == 0.0


def test_run_of_a_multi_grader_reports_sub_rewards(sdk: openai.OpenAI) -> None:
    grader = {
        "type": "multi",
        "name": "both",
        "graders": {
            "exact": CHECK,
            "city": CHECK
            | {"name": "city", "input": "{{sample.output_json.city}}", "operation": "ilike"},
        },
        "calculate_output": "0.25 * exact + 0.75 * city",
    }
    answer = sdk.fine_tuning.alpha.graders.run(
        grader=grader,  # type: ignore[arg-type]
        model_sample='{"city": "PARIS"}',
        item={"answer": "paris"},
    )
    assert answer.reward == pytest.approx(0.75)
    assert answer.sub_rewards == {"exact": 0.0, "city": 1.0}


def test_a_missing_variable_is_reward_zero_with_its_flag(sdk: openai.OpenAI) -> None:
    answer = sdk.fine_tuning.alpha.graders.run(grader=CHECK, model_sample="x", item={})  # type: ignore[arg-type]
    assert answer.reward == 0.0
    assert answer.metadata.errors.invalid_variable_error is True


@pytest.mark.parametrize(
    ("grader", "param", "words"),
    [
        (CHECK | {"operation": "regex"}, "grader.operation", "eq"),
        (
            CHECK | {"type": "text_similarity", "evaluation_metric": "cosine", "operation": None},
            "grader.evaluation_metric",
            "cosine",
        ),
        (
            {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1\n"},
            "grader.type",
            "RP_ALLOW_PYTHON_GRADERS",
        ),
        (
            {"type": "multi", "name": "m", "graders": {"a": CHECK}, "calculate_output": "a.real"},
            "grader.calculate_output",
            "not allowed",
        ),
        (
            {
                "type": "multi",
                "name": "m",
                "graders": {"a": CHECK | {"operation": "x"}},
                "calculate_output": "a",
            },
            "grader.graders.a.operation",
            "eq",
        ),
    ],
)
def test_graders_that_cannot_run_are_400_naming_the_field(
    sdk: openai.OpenAI, grader: dict[str, Any], param: str, words: str
) -> None:
    grader = {k: v for k, v in grader.items() if v is not None}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.fine_tuning.alpha.graders.validate(grader=grader)  # type: ignore[arg-type]
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["param"] == param, body
    assert words in body["message"]


def test_python_graders_run_when_the_operator_allows_them(
    sdk: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RP_ALLOW_PYTHON_GRADERS", "1")
    source = "def grade(sample, item):\n    return len(sample['output_text']) / item['n']\n"
    grader = {"type": "python", "name": "length", "source": source}
    answer = sdk.fine_tuning.alpha.graders.run(grader=grader, model_sample="abc", item={"n": 4})  # type: ignore[arg-type]
    assert answer.reward == pytest.approx(0.75)
    broken = sdk.fine_tuning.alpha.graders.run(grader=grader, model_sample="abc", item={"n": 0})  # type: ignore[arg-type]
    assert broken.reward == 0.0
    assert broken.metadata.errors.python_grader_runtime_error is True
    assert "ZeroDivisionError" in (broken.metadata.errors.python_grader_runtime_error_details or "")
