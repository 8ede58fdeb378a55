"""A GRPO job's page in a real headless Chromium: the reward, per-grader reward, KL, clip
fraction, completion length and grader-error charts beside the loss, one point a step per
series, and the rollouts' rewards in the samples table as text (a grader named like HTML
stays text); an SFT job's page has none of it. The fake worker writes the events (tests/integration/fake_worker.py:
`fake_grpo_metrics`, a job named "fake-grpo…")."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tests.integration.fake_worker import FAKE_GRADERS, fake_grpo_metrics
from tests.integration.service_daemon import Daemon, spec
from tests.integration.test_dashboard import WAIT_S, Console, browser, points, wait_until

__all__ = ["browser"]  # the module-scoped Chromium fixture, shared with test_dashboard.py

TOKEN = "grpo-dash-token"
STEPS = 6
PROMPTS = ["Add 2 and 3.", "Name a colour."]
# chart id -> how many series it plots
CHARTS = {
    "#chart-reward": 2,
    "#chart-grader-rewards": len(FAKE_GRADERS),
    "#chart-kl": 1,
    "#chart-clip": 1,
    "#chart-completion": 1,
    "#chart-grader-errors": 1,
}


def _rewards_shown(page: Any) -> list[list[str]]:
    """(reward, by grader) of each row of the newest step's rollouts."""
    return page.evaluate(
        """() => [...document.querySelectorAll('#samples-table tbody')[0].rows].map((r) => [
            r.querySelector('.sample-reward').textContent,
            r.querySelector('.sample-rewards').textContent,
        ])"""
    )


def test_a_grpo_jobs_page_charts_its_rewards_and_an_sft_jobs_page_does_not(
    make_daemon: Callable[..., Daemon], browser: Any
) -> None:
    daemon = make_daemon(RP_TOKEN=TOKEN, FAKE_STEP_S="0.05")
    body = spec(
        name="fake-grpo",
        train={"steps": STEPS, "eval_interval": 3, "sample_prompts": PROMPTS},
    )
    with daemon.client() as api:
        r = api.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        job = r.json()
    context = browser.new_context(viewport={"width": 1280, "height": 1400})
    context.set_default_timeout(WAIT_S * 1000)
    context.add_init_script(f"sessionStorage.setItem('rp.token', {json.dumps(TOKEN)})")
    page = context.new_page()
    console = Console(page)
    page.goto(f"{daemon.base_url}/#/jobs/{job['id']}")
    assert daemon.wait_for(job["id"], {"succeeded", "failed"})["status"] == "succeeded"

    for chart, series in CHARTS.items():
        want = STEPS * series
        wait_until(f"{want} points in {chart}", lambda c=chart, w=want: points(page, c) == w)
    ids = page.eval_on_selector_all("section.charts canvas", "cs => cs.map((c) => c.id)")
    assert ids == [
        "chart-loss",
        *(c.removeprefix("#") for c in CHARTS),
        "chart-lr",
        "chart-speed",
        "chart-memory",
    ]

    # the API's series carry the scalar reward columns (rp_service/jobs/outputs.py)
    with daemon.client() as api:
        columns = api.get(f"/v1/jobs/{job['id']}/metrics").json()["columns"]
    expected = [fake_grpo_metrics(step) for step in range(1, STEPS + 1)]
    assert columns["reward_mean"] == [m["reward_mean"] for m in expected]
    assert columns["kl"] == [m["kl"] for m in expected]

    # the summary shows the last step's mean reward and error count (the job's metrics)
    last = fake_grpo_metrics(STEPS)
    wait_until(
        "the summary's reward rows", lambda: "reward mean" in page.inner_text("#job-summary")
    )
    summary = page.inner_text("#job-summary")
    assert f"reward mean\n{last['reward_mean']:.3g}" in summary
    assert f"grader errors\n{last['grader_errors']}" in summary

    # rollouts: a reward column and each grader's score, as text
    wait_until(
        "the last step's rollouts",
        lambda: page.query_selector(f"#samples-table tbody[data-step='{STEPS}']"),
    )
    headers = page.eval_on_selector_all(
        "#samples-table thead th", "hs => hs.map((h) => h.textContent)"
    )
    assert headers == ["Step", "Prompt", "Completion", "Reward", "By grader"]
    assert _rewards_shown(page) == [
        ["0", f"{FAKE_GRADERS[0]}: 0, {FAKE_GRADERS[1]}: 0.5"],
        ["0.25", f"{FAKE_GRADERS[0]}: 1, {FAKE_GRADERS[1]}: 0.5"],
    ]
    assert page.query_selector("#samples-table b") is None  # the HTML-like name is text
    page.screenshot(path=str(daemon.data_dir.parent / "grpo-job.png"), full_page=True)
    assert console.unexpected() == []

    # an SFT job's page on the same daemon: none of it
    with daemon.client() as api:
        sft = api.post("/v1/jobs", json=spec(name="sft", train=body["train"] | {"steps": 4})).json()
        daemon.wait_for(sft["id"], {"succeeded"})
    page.goto(f"{daemon.base_url}/#/jobs/{sft['id']}")
    page.wait_for_selector("#stream-state[data-state=ended]")
    wait_until(
        "the SFT samples", lambda: page.query_selector("#samples-table tbody[data-step='4']")
    )
    assert page.query_selector("#chart-reward") is None
    headers = page.eval_on_selector_all(
        "#samples-table thead th", "hs => hs.map((h) => h.textContent)"
    )
    assert headers == ["Step", "Prompt", "Completion"]
    assert "reward" not in page.inner_text("#job-summary")
    assert console.unexpected() == []
    context.close()
