"""A DPO job's page in a real headless Chromium: the reward, accuracy and log-probability
charts beside the loss, one point a step each, from a real worker's tiny DPO job; an SFT
job's page has none of them."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rp_service.demo import demo_spec
from tests.integration.service_daemon import Daemon, spec
from tests.integration.test_dashboard import WAIT_S, Console, browser, points, wait_until

__all__ = ["browser"]  # the module-scoped Chromium fixture, shared with test_dashboard.py

TOKEN = "dpo-dash-token"
STEPS = 6
# chart id -> the metrics it plots (TRL's names)
CHARTS = {
    "#chart-rewards": ("rewards/chosen", "rewards/rejected", "rewards/margins"),
    "#chart-accuracy": ("rewards/accuracies",),
    "#chart-logps": ("logps/chosen", "logps/rejected"),
}


def _open(browser: Any, url: str) -> tuple[Any, Any, Console]:
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    context.set_default_timeout(WAIT_S * 1000)
    context.add_init_script(f"sessionStorage.setItem('rp.token', {json.dumps(TOKEN)})")
    page = context.new_page()
    console = Console(page)
    page.goto(url)
    return context, page, console


def _chart_ids(page: Any) -> list[str]:
    return page.eval_on_selector_all("section.charts canvas", "cs => cs.map((c) => c.id)")


def test_a_dpo_jobs_page_charts_its_rewards_beside_the_loss(
    make_daemon: Callable[..., Daemon], browser: Any
) -> None:
    # The fake worker runs the SFT job; a job named "real…" goes to the real worker.
    daemon = make_daemon(RP_TOKEN=TOKEN, FAKE_STEP_S="0.02")
    body = spec(
        name="real-dpo",
        model=demo_spec()["model"],
        data={"train": "synthetic", "format": "preference", "seq_len": 48},
        train={
            "steps": STEPS,
            "batch_size": 3,
            "checkpoint_interval": 0,
            "eval_interval": 0,
            "objective": "dpo",
            "method": "lora",
            "lr": 0.01,
        },
        dpo={"beta": 0.5},
    )
    with daemon.client() as api:
        r = api.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        job = r.json()
    # opened while the job runs: the charts appear with its first metrics event
    context, page, console = _open(browser, f"{daemon.base_url}/#/jobs/{job['id']}")
    done = daemon.wait_for(job["id"], {"succeeded", "failed"}, timeout_s=240)
    assert done["status"] == "succeeded", done
    for chart, keys in CHARTS.items():
        want = STEPS * len(keys)
        wait_until(f"{want} points in {chart}", lambda c=chart, w=want: points(page, c) == w)
    wait_until("the loss chart", lambda: points(page) == STEPS)
    assert _chart_ids(page) == [
        "chart-loss",
        "chart-rewards",
        "chart-accuracy",
        "chart-logps",
        "chart-lr",
        "chart-speed",
        "chart-memory",
    ]
    for chart in CHARTS:
        assert int(page.get_attribute(chart, "data-drawn") or 0) == points(page, chart)
    with daemon.client() as api:
        series = api.get(f"/v1/jobs/{job['id']}/metrics").json()["columns"]
    # the summary shows the latest step's accuracy and margin, as the API has them
    wait_until(
        "the summary's reward rows", lambda: "reward margin" in page.inner_text("#job-summary")
    )
    summary = page.inner_text("#job-summary")
    assert f"reward accuracy\n{series['rewards/accuracies'][-1]:.3g}" in summary
    page.screenshot(path=str(daemon.data_dir.parent / "dpo-job.png"), full_page=True)
    assert console.unexpected() == []
    context.close()

    with daemon.client() as api:
        sft = api.post("/v1/jobs", json=spec(name="sft", train={"steps": 5})).json()
        daemon.wait_for(sft["id"], {"succeeded"})
    context, page, console = _open(browser, f"{daemon.base_url}/#/jobs/{sft['id']}")
    page.wait_for_selector("#stream-state[data-state=ended]")
    wait_until("the SFT loss chart", lambda: points(page) == 5)
    assert _chart_ids(page) == ["chart-loss", "chart-lr", "chart-speed", "chart-memory"]
    assert "reward" not in page.inner_text("#job-summary")
    assert console.unexpected() == []
    context.close()
