"""The job page's chat panel in a real headless Chromium: the base's and the fine-tuned
model's answers side by side, equal to what the API answers for the same request."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.service_daemon import Daemon
from tests.integration.test_dashboard import Console, browser, wait_until

__all__ = ["browser"]  # the module-scoped Chromium fixture, shared with test_dashboard.py
from tests.integration.test_openai_api import MODEL, _chat, _jsonl, _tiny_model

TOKEN = "chat-dash-token"
PROMPT = "What is 2 plus 2?"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("models")
    _tiny_model(root)
    daemon = Daemon(
        tmp_path_factory.mktemp("dash-chat") / "data",
        {"RP_TOKEN": TOKEN, "RP_MODEL_ROOTS": str(root), "RP_WORKER_MODULE": "rp_service.worker"},
    )
    daemon.start()
    yield daemon
    daemon.stop()


def _lora_job(client: openai.OpenAI) -> Any:
    train = client.files.create(
        file=("train.jsonl", _jsonl([_chat(i) for i in range(8)])), purpose="fine-tune"
    )
    job = client.fine_tuning.jobs.create(
        model=MODEL,
        training_file=train.id,
        method={
            "type": "supervised",
            "supervised": {
                "hyperparameters": {"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 10},
                "lora": {"rank": 4, "alpha": 64},
            },
        },  # type: ignore[typeddict-unknown-key]
    )
    deadline = time.monotonic() + 300
    while job.status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
        job = client.fine_tuning.jobs.retrieve(job.id)
    assert job.status == "succeeded", job
    return job


def test_the_chat_panel_shows_base_and_fine_tuned_answers(
    daemon: Daemon, browser: Any, tmp_path: Path
) -> None:
    client = openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key=TOKEN, max_retries=0)
    job = _lora_job(client)
    expected = {
        model: client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPT}],
            temperature=0,
            max_completion_tokens=MAX_TOKENS,
        )
        .choices[0]
        .message.content
        for model in (MODEL, job.fine_tuned_model)
    }

    context = browser.new_context(viewport={"width": 1280, "height": 1400})
    context.set_default_timeout(120_000)
    page = context.new_page()
    console = Console(page, expected_statuses=(401,))
    page.goto(f"{daemon.base_url}/")
    page.wait_for_selector("#token-dialog[open]")
    page.fill("#token-input", TOKEN)
    page.click("#token-form button[type=submit]")
    page.goto(f"{daemon.base_url}/#/jobs/{job.id}")
    page.wait_for_selector("#chat-panel:not([hidden])")
    wait_until("the models named", lambda: page.inner_text("#chat-base-model") == MODEL)
    assert page.inner_text("#chat-tuned-model") == job.fine_tuned_model
    page.fill("#chat-prompt", PROMPT)
    page.fill("#chat-max-tokens", str(MAX_TOKENS))
    page.click("#chat-send")
    for side in ("base", "tuned"):
        page.wait_for_selector(f"#chat-{side}[data-state=done]")
    assert page.text_content("#chat-base") == expected[MODEL]
    assert page.text_content("#chat-tuned") == expected[job.fine_tuned_model]
    assert page.get_attribute("#chat-tuned", "data-finish") in ("stop", "length")
    page.screenshot(path=str(tmp_path / "chat-panel.png"), full_page=True)

    # The base of a job: the longest model name its path ends with; none for a preset.
    found = page.evaluate(
        """async () => {
          const { baseModelId } = await import("/ui/pages/chat.js");
          const ids = ["a", "org/a", "b"];
          return [
            baseModelId({ model: { path: "/models/org/a" } }, ids),
            baseModelId({ model: { path: "/models/xa" } }, ids),
            baseModelId({ model: { preset: "qwen3" } }, ids),
          ];
        }"""
    )
    assert found == ["org/a", None, None]
    assert console.unexpected() == []
    context.close()
