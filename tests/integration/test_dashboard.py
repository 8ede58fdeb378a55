"""The web dashboard in a real headless Chromium (Debian's package) driven by Playwright.

A real daemon with the fake worker serves the page; the tests click through it as a user
would and check what the daemon did through the REST API. Waits are on conditions (an
attribute reaching a value, a job reaching a status), never on fixed sleeps, so a loaded
machine makes them slower, not flaky. Screenshots go to the test's tmp dir.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import playwright.sync_api as playwright_sync
import pytest

from tests.integration.service_daemon import Daemon, spec

CHROMIUM = os.environ.get("RP_TEST_CHROMIUM", "/usr/bin/chromium")
TOKEN = "dash-secret-token"
WAIT_S = 90.0  # generous: the CI machine is shared; every wait ends as soon as it can

# Chromium logs every non-2xx response as a console error ("Failed to load resource: the
# server responded with a status of 409"). A test names the answers its page asks for on
# purpose (a refused token, a refused transition); anything else fails the test.
_STATUS_ERROR = re.compile(
    r"^Failed to load resource: the server responded with a status of (\d+)\b"
)
# While the daemon restarts, its port refuses connections for a moment.
_RESTART_NETWORK = re.compile(
    r"^Failed to load resource: net::ERR_(CONNECTION_REFUSED|EMPTY_RESPONSE|CONNECTION_RESET|INCOMPLETE_CHUNKED_ENCODING)"
)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).is_file():
        pytest.fail(
            f"no Chromium at {CHROMIUM}: install Debian's package (`apt-get install -y chromium`, "
            "as .ci/run does) or point RP_TEST_CHROMIUM at a Chromium binary"
        )
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--disable-gpu"])
        yield browser
        browser.close()


class Console:
    """Console errors and uncaught exceptions of a page, each tagged with the phase it was in."""

    def __init__(self, page: Any, *, expected_statuses: tuple[int, ...] = ()) -> None:
        self.expected_statuses = expected_statuses
        self.phase = "normal"
        self.errors: list[tuple[str, str]] = []
        page.on("console", lambda m: m.type == "error" and self.errors.append((self.phase, m.text)))
        page.on("pageerror", lambda e: self.errors.append(("uncaught", str(e))))

    def unexpected(self) -> list[tuple[str, str]]:
        def allowed(phase: str, text: str) -> bool:
            if phase == "uncaught":
                return False
            status = _STATUS_ERROR.match(text)
            if status and int(status[1]) in self.expected_statuses:
                return True
            return phase == "restart" and bool(_RESTART_NETWORK.match(text))

        return [(phase, text) for phase, text in self.errors if not allowed(phase, text)]


def wait_until(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.1)


def points(page: Any, chart: str = "#chart-loss") -> int:
    return int(page.get_attribute(chart, "data-points") or 0)


def shown_status(page: Any) -> str | None:
    return page.get_attribute("#job-status .badge", "data-status")


def test_dashboard_drives_jobs_with_a_token(
    make_daemon: Callable[..., Daemon], browser: Any, tmp_path: Path
) -> None:
    daemon = make_daemon(RP_TOKEN=TOKEN, FAKE_STEP_S="0.1")
    base = daemon.base_url

    # The page and its assets need no token and hold none; every API route still does, and
    # the dashboard's routes shadow none of the daemon's own.
    index = httpx.get(f"{base}/")
    assert index.status_code == 200 and "text/html" in index.headers["content-type"]
    assert TOKEN not in index.text
    assert "script-src 'self'" in index.headers["content-security-policy"]
    assert httpx.get(f"{base}/ui/app.js").status_code == 200
    assert httpx.get(f"{base}/ui/vendor/js-yaml.min.mjs").status_code == 200
    assert httpx.get(f"{base}/ui/nothing.js").status_code == 404
    assert httpx.get(f"{base}/ui/..%2Fapi%2Fdashboard.py").status_code == 404
    for path in ("/v1/jobs", "/v1/system", "/readyz", "/metrics", "/ui"):
        assert httpx.get(f"{base}{path}").status_code == 401, path
    with daemon.client() as api:
        assert api.get("/metrics").headers["content-type"].startswith("text/plain")
        assert api.get("/readyz").json()["status"] == "ready"

    context = browser.new_context(accept_downloads=True, viewport={"width": 1280, "height": 900})
    context.set_default_timeout(WAIT_S * 1000)
    page = context.new_page()
    console = Console(page, expected_statuses=(401, 409))
    page.on("dialog", lambda d: d.accept())  # the Cancel button's confirm()
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))

    # Token: asked once; a wrong one is refused and said so; the right one is kept.
    page.goto(f"{base}/")
    page.wait_for_selector("#token-dialog[open]")
    page.fill("#token-input", "not-the-token")
    page.click("#token-form button[type=submit]")
    page.wait_for_selector("#token-error:has-text('refused')")
    assert page.is_visible("#token-dialog[open]")
    page.fill("#token-input", TOKEN)
    page.click("#token-form button[type=submit]")
    page.wait_for_selector("#jobs-note:has-text('No jobs yet')")
    assert not page.is_visible("#token-dialog[open]")
    assert page.evaluate("sessionStorage.getItem('rp.token')") == TOKEN
    assert TOKEN not in page.content()

    # New job: the demo spec, submitted as YAML from the page.
    page.click("a[data-nav=new]")
    page.click("#load-demo")
    wait_until("the demo spec", lambda: "preset: qwen3" in page.input_value("#spec"))
    page.click("#submit-job")
    page.wait_for_url(re.compile(r"#/jobs/job-"))
    job_id = page.url.split("#/jobs/")[1]
    with daemon.client() as api:
        assert api.get(f"/v1/jobs/{job_id}").json()["spec"]["name"] == "demo"

    # The loss chart gains points while the job trains.
    first = wait_until("loss points", lambda: points(page) >= 3 and points(page))
    wait_until("more loss points", lambda: points(page) >= first + 5)
    page.wait_for_selector("#stream-state[data-state=live]")

    # Each control is enabled only where the API allows it: a running job resumes nothing.
    assert page.is_disabled("#resume-button") and page.is_enabled("#pause-button")
    # A refused transition (a page behind the job's state) is shown as the API's message.
    # (enabled and clicked in one step: the next redraw would disable it again)
    page.eval_on_selector("#resume-button", "b => { b.disabled = false; b.click(); }")
    page.wait_for_selector("#action-message.error:has-text('409')")
    assert "Resume refused (409 job_not_resumable)" in page.inner_text("#action-message")

    # Pause, then resume: the chart goes on from where it stopped.
    page.click("#pause-button")
    wait_until("paused", lambda: shown_status(page) == "paused")
    paused_at = daemon.wait_for(job_id, {"paused"})["progress"]["step"]
    page.click("#resume-button")
    wait_until("running again", lambda: shown_status(page) in ("queued", "running"))
    wait_until("points after resume", lambda: points(page) >= paused_at + 5)
    page.hover("#chart-loss", position={"x": 300, "y": 100})  # the crosshair's values
    page.screenshot(path=str(tmp_path / "job-running.png"), full_page=True)

    # A daemon restart drops the stream; the page reconnects with Last-Event-ID and the
    # job (checkpointed at shutdown, resumed at start) keeps adding points, none twice.
    before_restart = points(page)
    console.phase = "restart"
    daemon.stop()
    page.wait_for_selector("#stream-state[data-state=reconnecting]")
    daemon.start()  # same port, same data dir
    wait_until("live again", lambda: page.get_attribute("#stream-state", "data-state") == "live")
    wait_until("points after the restart", lambda: points(page) >= before_restart + 10)
    console.phase = "normal"
    page.check("#show-metrics")
    wait_until("a metrics row", lambda: page.locator("#events li.type-metrics").count() > 0)
    ids = [
        int(i)
        for i in page.eval_on_selector_all("#events li", "els => els.map(e => e.dataset.eventId)")
    ]
    assert len(ids) == len(set(ids)), "an event was shown twice after reconnecting"

    # Checkpoints: listed and downloadable (with the token, through a blob URL).
    page.wait_for_selector("#checkpoints tr[data-step] button")
    with page.expect_download() as download_info:
        page.click("#checkpoints tr[data-step] button")
    saved = tmp_path / "checkpoint.tar"
    download_info.value.save_as(saved)
    assert tarfile.is_tarfile(saved)
    with tarfile.open(saved) as tar:
        assert any(name.endswith("state.json") for name in tar.getnames())

    # A second job, cancelled from its page; cancelling again is refused.
    with daemon.client() as api:
        second = api.post("/v1/jobs", json=spec(name="second", train={"steps": 100000})).json()
    page.goto(f"{base}/#/jobs/{second['id']}")
    wait_until("second job shown", lambda: shown_status(page) in ("queued", "running"))
    page.click("#cancel-button")
    wait_until("cancelled", lambda: shown_status(page) == "cancelled")
    assert daemon.wait_for(second["id"], {"cancelled"})["status"] == "cancelled"
    # A finished job's controls are disabled: cancelling again is not offered.
    wait_until("cancel disabled", lambda: page.is_disabled("#cancel-button"))
    assert page.is_disabled("#pause-button") and page.is_disabled("#resume-button")

    # Jobs page: both jobs, live; the status filter narrows it to the cancelled one.
    page.click("a[data-nav=jobs]")
    wait_until("two rows", lambda: page.locator("#jobs-table tbody tr").count() == 2)
    page.select_option("#status-filter", "cancelled")
    wait_until(
        "only the cancelled job",
        lambda: (
            page.eval_on_selector_all(
                "#jobs-table tbody tr", "rows => rows.map(r => r.dataset.jobId)"
            )
            == [second["id"]]
        ),
    )
    page.select_option("#status-filter", "")
    daemon.wait_for(job_id, {"succeeded"}, timeout_s=WAIT_S)
    wait_until(
        "the demo job shown as succeeded",
        lambda: page.locator(
            f"#jobs-table tr[data-job-id='{job_id}'][data-status=succeeded]"
        ).count(),
    )
    page.screenshot(path=str(tmp_path / "jobs.png"), full_page=True)

    # System page.
    page.click("a[data-nav=system]")
    page.wait_for_selector("#queue:has-text('queued')")
    assert page.inner_text("#devices")  # a table, or the line saying there is no GPU
    assert "no job running" in page.inner_text("#gpu-share")  # both jobs have stopped
    assert "isa" in page.inner_text("#adam") or "not built" in page.inner_text("#adam")
    assert "torch" in page.inner_text("#versions")
    page.screenshot(path=str(tmp_path / "system.png"), full_page=True)

    # The token never went into a URL.
    assert not [url for url in requests if TOKEN in url]
    assert TOKEN not in daemon.log_path.read_text()
    assert console.unexpected() == []
    context.close()


def test_new_job_page_shows_validation_errors_without_a_token(
    make_daemon: Callable[..., Daemon], browser: Any, tmp_path: Path
) -> None:
    daemon = make_daemon(RP_AUTH="none")  # no token dialog in the way
    page = browser.new_page()
    page.set_default_timeout(WAIT_S * 1000)
    console = Console(page, expected_statuses=(422,))
    page.goto(f"{daemon.base_url}/#/new")

    # A YAML syntax error is named by line before anything is sent.
    page.fill("#spec", "model:\n  preset: qwen3\n data: [\n")
    page.click("#submit-job")
    page.wait_for_selector("#spec-errors:has-text('Line')")

    # The daemon's 422 names the field.
    page.fill("#spec", "model:\n  preset: qwen3\ndata:\n  train: synthetic\ntrain:\n  lr: -1\n")
    page.click("#submit-job")
    page.wait_for_selector("#spec-errors:has-text('train.lr')")
    assert "422" in page.inner_text("#spec-errors")

    # A dataset with a bad third line: the line number is shown.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": "b"}\nnot json\n')
    page.set_input_files("#data-file", str(bad))
    page.click("#upload-data")
    page.wait_for_selector("#upload-result.error li[data-line='3']")
    assert "line 3" in page.inner_text("#upload-result")
    assert page.inner_text("#upload-result li[data-line='3'] pre") == "not json"
    page.screenshot(path=str(tmp_path / "new-job-errors.png"), full_page=True)

    # A spec opened from a YAML file lands in the editor as it is.
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("# my run\nmodel: {preset: qwen3}\ndata: {train: synthetic}\n")
    page.set_input_files("#spec-file", str(spec_file))
    wait_until("the opened spec", lambda: page.input_value("#spec") == spec_file.read_text())

    # A good one, used in the spec, submitted as JSON.
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(5)))
    page.set_input_files("#data-file", str(good))
    page.click("#upload-data")
    page.click("#use-file")
    spec_text = page.input_value("#spec")
    assert "file-" in spec_text
    file_id = re.search(r"file-\w+", spec_text)[0]
    page.fill("#spec", json.dumps(spec(data={"train": file_id})))
    posts: list[str] = []
    page.on("request", lambda r: r.method == "POST" and "/v1/jobs" in r.url and posts.append(r.url))
    # Two clicks before the first answer (an impatient user): one Idempotency-Key, one job.
    page.evaluate(
        "() => { const b = document.querySelector('#submit-job'); b.click(); b.click(); }"
    )
    page.wait_for_url(re.compile(r"#/jobs/job-"))
    job_id = page.url.split("#/jobs/")[1]
    daemon.wait_for(job_id, {"succeeded"})
    assert len(posts) == 2
    with daemon.client() as api:
        assert [j["id"] for j in api.get("/v1/jobs").json()["data"]] == [job_id]
    page.wait_for_selector("#stream-state[data-state=ended]")
    assert not page.is_visible("#token-dialog[open]")
    page.screenshot(path=str(tmp_path / "job-done.png"), full_page=True)

    # "Edit as a new job": the New job page opens with this job's spec.
    page.click("#clone-button")
    page.wait_for_url(re.compile(r"#/new$"))
    wait_until("the cloned spec", lambda: file_id in page.input_value("#spec"))
    assert console.unexpected() == []
    page.close()


def test_a_finished_jobs_page_shows_its_log_once_and_no_controls(
    make_daemon: Callable[..., Daemon], browser: Any
) -> None:
    daemon = make_daemon(RP_TOKEN=TOKEN, FAKE_STEP_S="0.02")
    with daemon.client() as api:
        job = api.post("/v1/jobs", json=spec(name="finished", train={"steps": 6})).json()
        daemon.wait_for(job["id"], {"succeeded"})
        stored_log = api.get(f"/v1/jobs/{job['id']}/logs").text
    assert "fake worker attempt 1" in stored_log

    context = browser.new_context()
    context.set_default_timeout(WAIT_S * 1000)
    context.add_init_script(f"sessionStorage.setItem('rp.token', {json.dumps(TOKEN)})")
    page = context.new_page()
    console = Console(page)
    log_reads = {"sent": 0, "done": 0}
    is_log = re.compile(r"/v1/jobs/[^/]+/logs\b")

    def count(key: str) -> Callable[[Any], None]:
        return lambda r: is_log.search(r.url) and log_reads.__setitem__(key, log_reads[key] + 1)

    page.on("request", count("sent"))
    page.on("requestfinished", count("done"))
    page.on("requestfailed", count("done"))
    # The poll and the end of the stream both read the log as the page opens.
    page.goto(f"{daemon.base_url}/#/jobs/{job['id']}")
    page.wait_for_selector("#stream-state[data-state=ended]")
    wait_until("the status shown", lambda: shown_status(page) == "succeeded")

    def answered() -> bool:
        page.wait_for_timeout(100)  # Playwright delivers request events while it waits
        return log_reads["sent"] >= 2 and log_reads["sent"] == log_reads["done"]

    wait_until("every log read answered", answered)
    shown = page.inner_text("#worker-log")
    lines = [line for line in shown.splitlines() if line.strip()]
    assert lines and len(lines) == len(set(lines)), f"a log line shown twice: {shown!r}"
    assert shown.strip() == stored_log.strip()
    for action in ("pause", "resume", "cancel"):
        assert page.is_disabled(f"#{action}-button"), f"{action} enabled on a finished job"
    assert page.is_enabled("#clone-button")
    assert console.unexpected() == []
    context.close()


def _oracle(
    xs: list[float], ys: list[float | None], x0: float, x1: float, columns: int
) -> list[int]:
    """decimate.js's contract in Python: per pixel column, the first, lowest, highest, last."""
    scale = columns / (x1 - x0) if x1 > x0 else 0.0
    buckets: dict[int, list[int]] = {}
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if y is None or not math.isfinite(y) or x < x0 or x > x1:
            continue
        buckets.setdefault(min(columns - 1, math.floor((x - x0) * scale)), []).append(i)
    kept: list[int] = []
    for b in sorted(buckets):
        members = buckets[b]
        low = min(members, key=lambda i: (ys[i], i))
        high = min(members, key=lambda i: (-ys[i], i))  # type: ignore[operator]
        kept.extend(sorted({members[0], low, high, members[-1]}))
    return kept


_DECIMATE = """async ({ xs, ys, cases }) => {
  const { decimateMinMax } = await import("/ui/decimate.js");
  const fx = Float64Array.from(xs);
  const fy = Float64Array.from(ys, (y) => (y === null ? NaN : y));
  return cases.map(([x0, x1, columns]) => Array.from(decimateMinMax(fx, fy, fx.length, x0, x1, columns)));
}"""


def _decimate(page: Any, xs: list[float], ys: list[float | None], cases: list[tuple]) -> list:
    """decimate.js over one data set (sent once) for each (x0, x1, columns)."""
    return page.evaluate(_DECIMATE, {"xs": xs, "ys": ys, "cases": [list(c) for c in cases]})


def test_decimation_matches_its_oracle_and_bounds_what_is_drawn(
    make_daemon: Callable[..., Daemon], browser: Any
) -> None:
    daemon = make_daemon(RP_AUTH="none")  # no token dialog in the way
    page = browser.new_page()
    page.set_default_timeout(WAIT_S * 1000)
    console = Console(page)
    page.goto(f"{daemon.base_url}/#/system")
    rng = random.Random(0)
    n = 100_000
    xs: list[float] = []
    ys: list[float | None] = []
    spikes: list[int] = []
    x, level = 0.0, 5.0
    for i in range(n):
        x += rng.choice((1.0, 1.0, 2.0, 3.5))  # uneven steps: buckets hold 0 to many points
        level += rng.gauss(0, 0.01)
        y = level
        if rng.random() < 1e-4:  # rare spikes, up and down, must survive
            y += rng.choice((-50.0, 50.0))
            spikes.append(i)
        xs.append(x)
        ys.append(None if i % 97 == 0 and i not in spikes else y)
    cases = [
        (xs[0], xs[-1], 800),
        (xs[1000], xs[3000], 37),  # a window: points outside it are dropped
        (xs[0], xs[-1], 1),
    ]
    got = _decimate(page, xs, ys, cases)
    for case, indices in zip(cases, got, strict=True):
        assert indices == _oracle(xs, ys, *case), case
    full = got[0]
    assert len(full) <= 4 * 800
    assert spikes and set(spikes) <= set(full)
    # fewer points than columns: every finite one kept; one x: one bucket; nothing at all
    assert _decimate(page, xs[:5], ys[:5], [(xs[0], xs[4], 800)]) == [[1, 2, 3, 4]]
    assert _decimate(page, [3.0, 3.0, 3.0], [2.0, 1.0, 3.0], [(3.0, 3.0, 10)]) == [[0, 1, 2]]
    assert _decimate(page, [], [], [(0.0, 1.0, 10)]) == [[]]

    # The chart itself with 100,000 points: what it draws stays within 4 per pixel column.
    drawn = page.evaluate(
        """async (n) => {
          const { LineChart, Series } = await import("/ui/chart.js");
          const canvas = document.createElement("canvas");
          canvas.style.width = "800px";
          canvas.style.height = "200px";
          document.body.append(canvas);
          const chart = new LineChart(canvas, { title: "t", series: [new Series("a", "a", "#000")] });
          for (let i = 1; i <= n; i++) chart.series.get("a").push(i, Math.sin(i / 500) + (i % 7) / 10);
          const started = performance.now();
          chart.draw();
          return { drawn: chart.drawn, points: chart.pointCount(), ms: performance.now() - started };
        }""",
        n,
    )
    assert drawn["points"] == n
    assert 0 < drawn["drawn"] <= 4 * 800
    print(json.dumps({"chart_draw_100k_ms": round(drawn["ms"], 1)}))
    # Title and legend share the top row: on a narrow chart the legend drops its values
    # rather than run into the title (the DPO rewards chart overlapped at every width).
    legends = page.evaluate(
        """async () => {
          const { LineChart, Series } = await import("/ui/chart.js");
          return [360, 1400].map((width) => {
            const canvas = document.createElement("canvas");
            canvas.style.width = `${width}px`;
            canvas.style.height = "200px";
            document.body.append(canvas);
            const names = ["chosen", "rejected", "margins", "accuracies"];
            const chart = new LineChart(canvas, {
              title: "rewards (implicit, beta-scaled)",
              format: (v) => v.toFixed(3),
              series: names.map((n) => new Series(n, n, "#000")),
            });
            for (const n of names) chart.series.get(n).push(1, 0.123456);
            chart.draw();
            return canvas.dataset.legend;
          });
        }"""
    )
    assert legends == ["short", "full"]
    assert console.unexpected() == []
    page.close()


def test_docs_is_the_pages_api_view_with_every_route(
    make_daemon: Callable[..., Daemon], browser: Any
) -> None:
    """/docs (Swagger UI from a CDN: a 401 to a browser, blank offline) is now the
    dashboard's API view, served by the daemon and reading /openapi.json with the token."""
    daemon = make_daemon(RP_AUTH="none")  # no token dialog in the way
    page = browser.new_page()
    page.set_default_timeout(WAIT_S * 1000)
    console = Console(page)
    page.goto(f"{daemon.base_url}/docs")
    page.wait_for_selector("#api-routes tbody tr")
    assert page.url.endswith("/#/api")
    text = page.inner_text("#api-routes")
    assert "/v1/jobs/{job_id}/export" in text and "/v1/chat/completions" in text
    assert console.unexpected() == []
    page.close()


_SSE_PARSE = """async ({ chunks }) => {
  const { SseParser } = await import("/ui/api.js");
  const events = [];
  const retries = [];
  const parser = new SseParser((e) => events.push(e), (ms) => retries.push(ms));
  for (const chunk of chunks) parser.feed(chunk);
  return { events, retries };
}"""


def test_sse_parser_reads_the_daemons_stream_however_it_is_split(
    make_daemon: Callable[..., Daemon], browser: Any
) -> None:
    """The page's text/event-stream parser on a real stream, cut at every possible byte."""
    daemon = make_daemon(FAKE_STEP_S="0.01", RP_AUTH="none")  # no token dialog
    with daemon.client() as api:
        job = api.post("/v1/jobs", json=spec(train={"steps": 4, "checkpoint_interval": 2})).json()
        daemon.wait_for(job["id"], {"succeeded"})
        stored = api.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
        raw = api.get(f"/v1/jobs/{job['id']}/events", headers={"Accept": "text/event-stream"}).text
    # CRLF and CR line ends, a comment, a multi-line data field: the other framings allowed.
    extra = ": ping\r\nevent: note\rdata: a\ndata: b\r\n\r\n"
    text = raw + extra
    page = browser.new_page()
    page.set_default_timeout(WAIT_S * 1000)
    console = Console(page)
    page.goto(f"{daemon.base_url}/#/new")
    expected = [*stored, {"type": "note", "data": "a\nb"}]
    rng = random.Random(1)
    cuts = [[text], list(text), *([text[:k], text[k:]] for k in rng.sample(range(len(text)), 20))]
    for chunks in cuts:
        parsed = page.evaluate(_SSE_PARSE, {"chunks": chunks})
        assert parsed["retries"] == [3000]
        events = parsed["events"]
        assert events[-2]["type"] == "done"
        assert json.loads(events[-2]["data"]) == {"job_id": job["id"], "status": "succeeded"}
        got = [json.loads(e["data"]) for e in events[:-2]] + [
            {"type": events[-1]["type"], "data": events[-1]["data"]}
        ]
        assert [int(e["id"]) for e in events[:-2]] == [e["id"] for e in stored]
        assert got == expected
    assert console.unexpected() == []
    page.close()
