"""The job page's Samples panel in a real headless Chromium: the `sample` events of each
evaluation, newest step first, as text (a prompt that looks like HTML stays text), through
a pause and a resume and a reload of the page.

The fake worker writes the samples (tests/integration/fake_worker.py): each completion
names its prompt, step and attempt, so the page's text can be checked exactly.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.integration.service_daemon import Daemon, spec
from tests.integration.test_dashboard import TOKEN, WAIT_S, Console, browser, wait_until

__all__ = ["browser"]  # the module-scoped Chromium fixture, shared with test_dashboard.py

PROMPTS = ["Tell me a story.", '<img src=x onerror="window.hacked=1"> & <b>bold</b>']
EVERY, STEPS = 3, 12


def shown(page: Any) -> list[tuple[int, list[str], list[str]]]:
    """(step, prompts, completions) of each step in the panel, top to bottom."""
    rows = page.evaluate(
        """() => [...document.querySelectorAll('#samples-table tbody')].map((b) => [
            Number(b.dataset.step),
            [...b.querySelectorAll('.sample-prompt')].map((c) => c.textContent),
            [...b.querySelectorAll('.sample-completion')].map((c) => c.textContent),
        ])"""
    )
    return [(step, prompts, completions) for step, prompts, completions in rows]


def expected(step: int, attempt: int) -> list[str]:
    return [f"{p} at step {step} (attempt {attempt})" for p in PROMPTS]


def test_the_samples_panel_lists_each_evaluation_through_pause_and_resume(
    make_daemon: Callable[..., Daemon], browser: Any, tmp_path: Path
) -> None:
    daemon = make_daemon(RP_TOKEN=TOKEN, FAKE_STEP_S="0.15")
    body = spec(
        name="samples",
        train={"steps": STEPS, "eval_interval": EVERY, "sample_prompts": PROMPTS},
    )
    context = browser.new_context()
    context.set_default_timeout(WAIT_S * 1000)
    context.add_init_script(f"sessionStorage.setItem('rp.token', {json.dumps(TOKEN)})")
    page = context.new_page()
    console = Console(page)
    with daemon.client() as api:
        # One CPU job at a time: a long job ahead keeps ours queued, so its panel is seen
        # empty however slowly the page loads; cancelling it lets ours start.
        ahead = api.post("/v1/jobs", json=spec(name="ahead", train={"steps": 10_000})).json()
        job = api.post("/v1/jobs", json=body).json()
        page.goto(f"{daemon.base_url}/#/jobs/{job['id']}")
        page.wait_for_selector("#samples:not([hidden])")  # the spec asks for samples
        assert page.is_visible("#samples-empty")
        assert api.get(f"/v1/jobs/{job['id']}").json()["status"] == "queued"
        assert api.post(f"/v1/jobs/{ahead['id']}/cancel").status_code == 200

        page.wait_for_selector(f"#samples-table tbody[data-step='{EVERY}']")
        assert api.post(f"/v1/jobs/{job['id']}/pause").status_code == 200
        paused = daemon.wait_for(job["id"], {"paused"})
        before = [s for s in range(EVERY, paused["progress"]["step"] + 1, EVERY)]
        wait_until("the samples before the pause", lambda: len(shown(page)) == len(before))
        assert shown(page) == [(s, PROMPTS, expected(s, 1)) for s in reversed(before)]
        assert not page.is_visible("#samples-empty")

        assert api.post(f"/v1/jobs/{job['id']}/resume").status_code == 200
        daemon.wait_for(job["id"], {"succeeded"})
        steps = list(range(STEPS, 0, -EVERY))
        wait_until("every evaluation's samples", lambda: [s for s, _, _ in shown(page)] == steps)
        want = [(s, PROMPTS, expected(s, 1 if s in before else 2)) for s in steps]
        assert shown(page) == want

        page.reload()  # the stored events rebuild the panel
        wait_until("the panel after a reload", lambda: shown(page) == want)
        # the job's GPU mode and its reason, as `rp status` prints them (a CPU daemon)
        mode = api.get(f"/v1/jobs/{job['id']}").json()["gpu_mode"]
        dd = page.locator("#job-summary dt:text-is('GPU mode') + dd")
        assert dd.inner_text() == f"pipeline: {mode['reason']}"
        page.screenshot(path=str(tmp_path / "samples.png"), full_page=True)
    # the HTML-looking prompt is text: no element came of it, nothing ran
    assert page.query_selector("#samples-table img, #samples-table b") is None
    assert page.evaluate("() => window.hacked") is None
    assert console.unexpected() == []
    context.close()
