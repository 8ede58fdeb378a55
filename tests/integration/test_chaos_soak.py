"""Chaos soak: jobs keep coming while the daemon and its workers are SIGKILLed at random.

Phase 1 (chaos): a submitter thread posts small jobs (the fake worker, plus two real ones
that train the demo model) every fraction of a second, each with an Idempotency-Key that it
re-sends until one answer arrives; a follower thread reads jobs over SSE and reconnects
with Last-Event-ID through every outage; the test SIGKILLs a random worker, then the daemon,
and restarts the daemon, for CYCLES cycles. Phase 2 (leaks): one daemon runs LEAK_JOBS more
jobs (a worker SIGKILLed now and then); its RSS and open fds (store connections aside: at
most one per thread) after 20 jobs and after all of them must stay within RSS_SLACK_BYTES
and FD_SLACK. Then every job must have succeeded,
every checkpoint on disk must load, event ids must be 1..n per job, and /metrics must hold
one row per step. Phase 3 (disk full): the daemon restarts with RP_MIN_FREE_BYTES above
the free space (a full disk, injected: CI cannot mount a small filesystem), while a job that
has checkpointed is re-queued; every submission must get a clear 507 disk_full, the job must
pause (waiting_for_disk) at its next checkpoint with no half-written one left and its
checkpoints all kept and loading; once space is back (the floor lowered again) a new job
runs to success and the paused one resumes by itself and finishes. Phase 4 (serving):
while jobs train, threads send chat requests for 6 s to a served model (the fake serving
process, tests/integration/fake_serving.py): plain ones (answers checked), ones with four
stop sequences of the longest length allowed, a stop over it (400), whole answers whose
client hangs up (the process must be told to cancel each), streams closed after a chunk;
no answer may wait behind an abandoned one, and every job must succeed with gap-free
events. Seeded by RP_SOAK_SEED; the figures are printed at the end.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from rp_service.openai.chat_schemas import MAX_STOP_CHARS
from rp_service.worker import checkpoint as ckpt
from tests.integration.service_daemon import Daemon, spec
from tests.unit.rp_service.test_serving_guards import _folder, _reference

SEED = int(os.environ.get("RP_SOAK_SEED", "21"))
CYCLES = 24
LEAK_JOBS = 200
RSS_SLACK_BYTES = 24 << 20  # daemon RSS after LEAK_JOBS jobs vs after 20
FD_SLACK = 4  # open fds other than store connections, same comparison
_TERMINAL = {"succeeded", "failed", "cancelled"}
_FAKE_WEIGHTS = bytes(range(256)) * 5  # what fake_worker.py writes in every checkpoint


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _fd_count(pid: int) -> int:
    """Open fds of `pid` other than the store's: each thread of the daemon's thread pool
    opens its own SQLite connection (2 fds) the first time the pool grows to it, which is
    bounded by the pool, not by the number of jobs; `_store_fds_bounded` checks those."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        count += not target.endswith(("rp.sqlite3", "rp.sqlite3-wal"))
    return count


def _store_fds_bounded(pid: int) -> bool:
    """At most one store connection (db + wal) per live thread of the daemon."""
    store = sum(
        os.readlink(f"/proc/{pid}/fd/{fd}").endswith(("rp.sqlite3", "rp.sqlite3-wal"))
        for fd in os.listdir(f"/proc/{pid}/fd")
    )
    return store <= 2 * len(os.listdir(f"/proc/{pid}/task"))


def _sigkill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


class _Submitter(threading.Thread):
    """Posts jobs until stopped; a lost answer is retried with the same Idempotency-Key."""

    def __init__(self, daemon: Daemon, rng: random.Random, real_spec: dict[str, Any]) -> None:
        super().__init__(name="soak-submitter", daemon=True)
        self.daemon_ = daemon
        self.rng = rng
        self.real_spec = real_spec
        self.stop = threading.Event()
        self.ids: list[str] = []
        self.retried_posts = 0

    def body(self) -> dict[str, Any]:
        n = len(self.ids)
        if n in (3, 30):  # two real trainings among the fakes
            return {**self.real_spec, "name": f"real-{n}"}
        steps = self.rng.randint(6, 20)
        return spec(name=f"soak-{n}", train={"steps": steps, "checkpoint_interval": 3})

    def submit(self, body: dict[str, Any]) -> str:
        key = str(uuid.UUID(int=self.rng.getrandbits(128)))
        while True:
            try:
                r = httpx.post(
                    f"{self.daemon_.base_url}/v1/jobs",
                    json=body,
                    headers={"Idempotency-Key": key, **self.daemon_.headers()},
                    timeout=10,
                )
                if r.status_code in (200, 201):
                    return r.json()["id"]
                assert r.status_code == 503, r.text  # only "not ready" may be refused
            except httpx.HTTPError:
                self.retried_posts += 1
            time.sleep(0.1)

    def run(self) -> None:
        while not self.stop.is_set():
            self.ids.append(self.submit(self.body()))
            self.stop.wait(self.rng.uniform(0.05, 0.4))


class _Follower(threading.Thread):
    """Follows jobs over SSE like a browser: reconnect with Last-Event-ID, note any gap."""

    def __init__(self, daemon: Daemon, submitter: _Submitter) -> None:
        super().__init__(name="soak-follower", daemon=True)
        self.daemon_ = daemon
        self.submitter = submitter
        self.stop = threading.Event()
        self.followed = 0
        self.reconnects = 0
        self.events = 0
        self.gaps: list[tuple[str, int, int]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            ids = self.submitter.ids
            if not ids:
                time.sleep(0.1)
                continue
            self.follow(ids[-1])
            self.followed += 1

    def follow(self, job_id: str) -> None:
        last = 0
        while not self.stop.is_set():
            headers = {"Accept": "text/event-stream", **self.daemon_.headers()}
            if last:
                headers["Last-Event-ID"] = str(last)
            try:
                with httpx.Client(base_url=self.daemon_.base_url, timeout=10) as client:
                    url = f"/v1/jobs/{job_id}/events"
                    with connect_sse(client, "GET", url, headers=headers) as source:
                        for sse in source.iter_sse():
                            if sse.event == "done":
                                return
                            if not sse.data:
                                continue
                            event_id = json.loads(sse.data)["id"]
                            if event_id != last + 1:
                                self.gaps.append((job_id, last, event_id))
                            last = event_id
                            self.events += 1
            except httpx.HTTPError:
                pass
            self.reconnects += 1
            time.sleep(0.1)


def _wait_all(daemon: Daemon, ids: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    jobs: dict[str, dict[str, Any]] = {}
    with daemon.client() as c:
        for job_id in ids:
            while True:
                job = c.get(f"/v1/jobs/{job_id}").json()
                if job["status"] in _TERMINAL or time.monotonic() > deadline:
                    jobs[job_id] = job
                    break
                time.sleep(0.1)
    return jobs


def _all_events(c: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while True:
        after = events[-1]["id"] if events else 0
        page = c.get(f"/v1/jobs/{job_id}/events", params={"after": after, "limit": 1000}).json()
        events += page["data"]
        if not page["has_more"]:
            return events


def _check_checkpoints(job_dir: Path, real: bool) -> int:
    """Load every committed checkpoint of a job; return how many."""
    root = job_dir / "checkpoints"
    found = (
        [p for p in root.glob("step-*") if (p / "state.json").is_file()] if root.is_dir() else []
    )
    for path in found:
        if real:
            tensors, state = ckpt.read_checkpoint(path)
            assert state["step"] == int(path.name.split("-")[1])
            assert all(t.isfinite().all() for group in tensors.values() for t in group.values())
        else:
            assert json.loads((path / "state.json").read_text())["step"] == int(
                path.name.split("-")[1]
            )
            assert (path / "weights.bin").read_bytes() == _FAKE_WEIGHTS
    return len(found)


def _idle_figures(daemon: Daemon) -> tuple[int, int]:
    """RSS and fds of the daemon once it has nothing running (sampled after a pause)."""
    with daemon.client() as c:
        for _ in range(300):
            counts = Counter(
                j["status"] for j in c.get("/v1/jobs", params={"limit": 50}).json()["data"]
            )
            if not counts.keys() - _TERMINAL:
                break
            time.sleep(0.1)
    time.sleep(1.0)
    assert daemon.proc is not None
    assert _store_fds_bounded(daemon.proc.pid)
    return _rss_bytes(daemon.proc.pid), _fd_count(daemon.proc.pid)


def _disk_full_phase(daemon: Daemon) -> dict[str, Any]:
    """Phase 3: the disk fills while a job runs and submissions keep coming, then frees."""
    with daemon.client() as c:
        job_id = c.post(
            "/v1/jobs", json=spec(name="fill", train={"steps": 400, "checkpoint_interval": 3})
        ).json()["id"]
    daemon.wait_for_step(job_id, 4)
    daemon.stop()  # graceful: the job checkpoints and goes back to the queue
    free = shutil.disk_usage(daemon.data_dir).free
    daemon.env["RP_MIN_FREE_BYTES"] = str(free + (1 << 30))  # the disk is now "full"
    daemon.start()
    refused = 0
    with daemon.client() as c:
        ids_before = [j["id"] for j in c.get("/v1/jobs", params={"limit": 100}).json()["data"]]
        for n in range(20):
            r = c.post("/v1/jobs", json=spec(name=f"refused-{n}"))
            assert r.status_code == 507 and r.json()["error"]["code"] == "disk_full", r.text
            refused += 1
        ids_after = [j["id"] for j in c.get("/v1/jobs", params={"limit": 100}).json()["data"]]
        assert ids_after == ids_before  # no refused submission left a row
    paused = daemon.wait_for(job_id, {"paused", *_TERMINAL}, timeout_s=60)
    assert paused["status"] == "paused", paused
    assert paused["error"]["code"] == "waiting_for_disk", paused
    root = daemon.data_dir / "jobs" / job_id / "checkpoints"
    half_written = [p.name for p in root.iterdir() if not (p / "state.json").is_file()]
    assert half_written == []
    kept = _check_checkpoints(daemon.data_dir / "jobs" / job_id, real=False)
    with daemon.client() as c:
        listed = c.get(f"/v1/jobs/{job_id}/checkpoints").json()["data"]
    assert kept == len(listed) >= 2  # none pruned (a failed job was cut to 1)
    daemon.stop()
    del daemon.env["RP_MIN_FREE_BYTES"]  # space is back
    daemon.start()
    with daemon.client() as c:
        after = c.post("/v1/jobs", json=spec(name="after-full", train={"steps": 4})).json()
    assert daemon.wait_for(after["id"], _TERMINAL)["status"] == "succeeded"
    # The paused job is re-queued by the disk watch, by itself, and finishes.
    assert daemon.wait_for(job_id, _TERMINAL, timeout_s=120)["status"] == "succeeded"
    with daemon.client() as c:
        assert c.delete(f"/v1/jobs/{job_id}").status_code == 200
    assert not (daemon.data_dir / "jobs" / job_id).exists()
    return {
        "disk_full_submissions_refused": refused,
        "disk_full_jobs_paused_and_finished": 1,
        "half_written_checkpoints": len(half_written),
    }


class _Chatter(threading.Thread):
    """Sends chat requests of random kinds until stopped; tallies what came back."""

    def __init__(self, daemon: Daemon, rng: random.Random, model: str, index: int) -> None:
        super().__init__(name="soak-chatter", daemon=True)
        self.index = index
        self.daemon_ = daemon
        self.rng = rng
        self.model = model
        self.stop = threading.Event()
        self.tally: Counter[str] = Counter()
        self.slowest_s = 0.0  # the slowest plain answer (8 tokens)
        self.failures: list[str] = []

    def post(self, body: dict[str, Any], timeout_s: float = 30) -> httpx.Response:
        return httpx.post(
            f"{self.daemon_.base_url}/v1/chat/completions",
            json={"model": self.model, **body},
            headers=self.daemon_.headers(),
            timeout=timeout_s,
        )

    def plain(self) -> None:
        text = self.rng.choice(["abcab", "hello world", "xyzzy"])
        stop = [self.rng.choice(["ca", "o w", "zz", "q"])]
        started = time.monotonic()
        r = self.post({"messages": [{"role": "user", "content": text}], "max_tokens": 8,
                       "stop": stop})  # fmt: skip
        if r.status_code == 503:  # the queue was full: said so, with when to come back
            assert r.json()["error"]["code"] == "serving_queue_full", r.text
            assert int(r.headers["retry-after"]) >= 1
            self.tally["queue_full_503"] += 1
            return
        assert r.status_code == 200, r.text
        self.slowest_s = max(self.slowest_s, time.monotonic() - started)
        want, _ = _reference((text * 8)[:8], stop)
        assert r.json()["choices"][0]["message"]["content"] == want, (text, stop, r.text)
        self.tally["plain"] += 1

    def big_stops(self) -> None:
        stops = ["a" * (MAX_STOP_CHARS - 1) + c for c in "bcde"]
        r = self.post({"messages": [{"role": "user", "content": "a"}], "max_tokens": 200,
                       "stop": stops})  # fmt: skip
        if r.status_code == 503:
            self.tally["queue_full_503"] += 1
            return
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == "a" * 200 and choice["finish_reason"] == "length"
        too_long = self.post({"messages": [{"role": "user", "content": "a"}],
                              "stop": "a" * 250_000})  # fmt: skip
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "stop"
        self.tally["big_stops"] += 1

    def hang_up(self) -> None:
        """A whole answer of 100,000 tokens (~17 min) whose client leaves after 0.3 s."""
        body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 100_000}
        try:
            r = self.post(body, timeout_s=0.3)
        except httpx.ReadTimeout:
            self.tally["disconnects"] += 1
            return
        assert r.status_code == 503, r.text  # the queue was full: nothing to cancel
        self.tally["queue_full_503"] += 1

    def stream_closed(self) -> None:
        body = {"messages": [{"role": "user", "content": "stream"}], "max_tokens": 100_000,
                "stream": True}  # fmt: skip
        with httpx.stream(
            "POST",
            f"{self.daemon_.base_url}/v1/chat/completions",
            json={"model": self.model, **body},
            headers=self.daemon_.headers(),
            timeout=30,
        ) as r:
            if r.status_code == 503:
                self.tally["queue_full_503"] += 1
                return
            assert r.status_code == 200
            for n, _ in enumerate(r.iter_lines()):
                if n >= 4:  # the role chunk and one of text (each line + a blank one)
                    break
        self.tally["streams_closed"] += 1

    def run(self) -> None:
        kinds = [self.hang_up, self.stream_closed, self.big_stops, self.plain, self.plain]
        first = True
        while not self.stop.is_set():
            queue_full = self.tally["queue_full_503"]
            # Each chatter starts with its own kind (every kind runs, however slow the box),
            # then picks at random.
            kind = kinds[self.index % len(kinds)] if first else self.rng.choice(kinds)
            first = False
            try:
                kind()
            except (AssertionError, httpx.HTTPError) as exc:
                self.failures.append(repr(exc)[:500])
            if self.tally["queue_full_503"] > queue_full:
                self.stop.wait(0.2)  # not Retry-After's 5 s: the phase lasts 10 s


def _serving_phase(daemon: Daemon, rng: random.Random) -> dict[str, Any]:
    """Phase 4: chat requests of every kind against a served model while jobs train."""
    root = daemon.data_dir.parent / "models"
    _folder(root, "served")
    log = daemon.data_dir.parent / "fake-serving.log"
    daemon.stop()
    daemon.env.update(
        RP_MODEL_ROOTS=str(root),
        RP_SERVING_MODULE="fake_serving",
        FAKE_SERVE_TOKEN_S="0.01",
        FAKE_SERVE_LOG=str(log),
        RP_SERVE_MAX_QUEUED="3",
    )
    daemon.start()
    with daemon.client() as c:
        job_ids = [
            c.post("/v1/jobs", json=spec(name=f"beside-chat-{n}", train={"steps": 250,
                   "checkpoint_interval": 25})).json()["id"]
            for n in range(3)
        ]  # fmt: skip
    chatters = [_Chatter(daemon, random.Random(rng.random()), "served", k) for k in range(4)]
    for chatter in chatters:
        chatter.start()
    time.sleep(6.0)
    for chatter in chatters:
        chatter.stop.set()
    for chatter in chatters:
        chatter.join(timeout=60)
    failures = [f for chatter in chatters for f in chatter.failures]
    assert failures == [], failures[:5]
    tally = sum((chatter.tally for chatter in chatters), Counter())
    # No answer waits behind an abandoned one: the next request is answered at once.
    started = time.monotonic()
    with daemon.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={"model": "served", "messages": [{"role": "user", "content": "ok"}],
                  "max_tokens": 2},
        )  # fmt: skip
    after_s = time.monotonic() - started
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok", r.text
    assert after_s < 5.0, after_s
    done = [line.split() for line in log.read_text().splitlines() if line.startswith("done ")]
    cancels = sum(line.startswith(("cancel ", "skipped ")) for line in log.read_text().splitlines())
    longest = max(int(d[3]) for d in done)
    assert longest < 100_000 and tally["disconnects"] > 0 and tally["streams_closed"] > 0
    assert cancels >= tally["disconnects"] + tally["streams_closed"], (cancels, tally)
    jobs = _wait_all(daemon, job_ids, timeout_s=120)
    assert {j["status"] for j in jobs.values()} == {"succeeded"}, jobs
    with daemon.client() as c:
        for job_id in job_ids:
            events = _all_events(c, job_id)
            assert [e["id"] for e in events] == list(range(1, len(events) + 1)), job_id
    return {
        "chat_plain_answers": tally["plain"],
        "chat_big_stop_requests": tally["big_stops"],
        "chat_disconnects_cancelled": tally["disconnects"],
        "chat_streams_closed": tally["streams_closed"],
        "chat_queue_full_503": tally["queue_full_503"],
        "chat_cancels_seen_by_process": cancels,
        "chat_longest_generation_tokens": longest,
        "chat_slowest_plain_s": round(max(c.slowest_s for c in chatters), 2),
        "chat_answer_after_s": round(after_s, 2),
        "jobs_beside_chat_succeeded": len(jobs),
    }


@pytest.mark.timeout(600)
def test_chaos_soak(make_daemon, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    rng = random.Random(SEED)
    daemon: Daemon = make_daemon(
        FAKE_STEP_S="0.02", RP_MAX_CPU_JOBS="3", RP_MAX_ATTEMPTS="1000", RP_LOG_LEVEL="warning"
    )
    with daemon.client() as c:
        real = c.get("/v1/demo").json()
    real["train"].update(steps=8, checkpoint_interval=2, eval_interval=0, keep_checkpoints=2)
    submitter = _Submitter(daemon, random.Random(SEED + 1), real)
    follower = _Follower(daemon, submitter)
    submitter.start()
    follower.start()
    kills = Counter()
    # ---------------------------------------------------------------- phase 1: chaos
    for _ in range(CYCLES):
        time.sleep(rng.uniform(0.3, 1.5))
        assert daemon.proc is not None
        workers = _children(daemon.proc.pid)
        if workers and _sigkill(rng.choice(workers)):
            kills["worker"] += 1
        time.sleep(rng.uniform(0.1, 1.0))
        daemon.kill()
        kills["daemon"] += 1
        daemon.start()
    submitter.stop.set()
    submitter.join(timeout=60)
    chaos_ids = list(submitter.ids)
    chaos_jobs = _wait_all(daemon, chaos_ids, timeout_s=180)
    follower.stop.set()
    follower.join(timeout=30)
    chaos_s = time.monotonic() - started
    # ---------------------------------------------------------------- phase 2: leaks
    daemon.stop()
    daemon.start()
    leak_ids: list[str] = []
    figures: dict[int, tuple[int, int]] = {}
    with daemon.client() as c:
        while len(leak_ids) < LEAK_JOBS:
            batch = min(10, LEAK_JOBS - len(leak_ids))
            for _ in range(batch):
                body = spec(
                    name=f"leak-{len(leak_ids)}", train={"steps": 6, "checkpoint_interval": 2}
                )
                leak_ids.append(c.post("/v1/jobs", json=body).json()["id"])
            assert daemon.proc is not None
            if len(leak_ids) % 40 == 0:
                time.sleep(0.2)
                workers = _children(daemon.proc.pid)
                if workers and _sigkill(rng.choice(workers)):
                    kills["worker"] += 1
            _wait_all(daemon, leak_ids[-batch:], timeout_s=120)
            if len(leak_ids) in (20, LEAK_JOBS):
                figures[len(leak_ids)] = _idle_figures(daemon)
    leak_jobs = _wait_all(daemon, leak_ids, timeout_s=60)
    # ---------------------------------------------------------------- checks
    jobs = {**chaos_jobs, **leak_jobs}
    statuses = Counter(j["status"] for j in jobs.values())
    assert statuses == {"succeeded": len(jobs)}, {
        k: (j["status"], j["error"]) for k, j in jobs.items() if j["status"] != "succeeded"
    }
    assert len(set(chaos_ids)) == len(chaos_ids)  # a re-sent key never made a second job
    tally = Counter()
    with daemon.client() as c:
        for job_id, job in jobs.items():
            events = _all_events(c, job_id)
            assert [e["id"] for e in events] == list(range(1, len(events) + 1)), job_id
            statuses_seen = [e["data"]["status"] for e in events if e["type"] == "status"]
            assert statuses_seen[0] == "queued" and statuses_seen[-1] == "succeeded"
            tally["resumes"] += sum("daemon restarted" in e["message"] for e in events)
            tally["retries"] += sum("retry" in e["data"] for e in events if e["type"] == "status")
            tally["replays"] += sum("replayed_steps" in e["data"] for e in events)
            series = c.get(f"/v1/jobs/{job_id}/metrics").json()["columns"]
            total = job["spec"]["train"]["steps"]
            assert series["step"] == list(range(1, total + 1)), job_id  # one row per step
            is_real = job["name"].startswith("real")
            tally["checkpoints"] += _check_checkpoints(daemon.data_dir / "jobs" / job_id, is_real)
            for record in c.get(f"/v1/jobs/{job_id}/checkpoints").json()["data"]:
                assert Path(record["path"]).is_dir()
            if is_real:
                tally["real"] += 1
                assert (Path(job["output_model_path"]) / "config.json").is_file()
            if rng.random() < 0.1:  # a late reader: Last-Event-ID from a random point
                start = rng.randrange(len(events))
                headers = {"Accept": "text/event-stream", "Last-Event-ID": str(start)}
                url = f"/v1/jobs/{job_id}/events"
                seen = []
                with connect_sse(c, "GET", url, headers=headers) as source:
                    for sse in source.iter_sse():
                        if sse.event == "done":
                            break
                        if sse.data:
                            seen.append(json.loads(sse.data)["id"])
                assert seen == list(range(start + 1, len(events) + 1))
                tally["late_readers"] += 1
    assert follower.gaps == []
    assert tally["real"] == 2
    rss20, fds20 = figures[20]
    rss_end, fds_end = figures[LEAK_JOBS]
    report = {
        "seed": SEED,
        "jobs": len(jobs),
        "chaos_jobs": len(chaos_jobs),
        "real_jobs": tally["real"],
        "daemon_kills": kills["daemon"],
        "worker_kills": kills["worker"],
        "resumes_after_daemon_kill": tally["resumes"],
        "retries_after_worker_death": tally["retries"],
        "replayed_step_ranges": tally["replays"],
        "checkpoints_loaded": tally["checkpoints"],
        "sse_followed_jobs": follower.followed,
        "sse_reconnects": follower.reconnects,
        "sse_events": follower.events,
        "late_readers": tally["late_readers"],
        "submit_posts_retried": submitter.retried_posts,
        "rss_mib_after_20": round(rss20 / 2**20, 1),
        f"rss_mib_after_{LEAK_JOBS}": round(rss_end / 2**20, 1),
        "fds_after_20": fds20,
        f"fds_after_{LEAK_JOBS}": fds_end,
        "chaos_s": round(chaos_s, 1),
        "total_s": round(time.monotonic() - started, 1),
    }
    report.update(_disk_full_phase(daemon))
    report.update(_serving_phase(daemon, rng))
    report["total_s"] = round(time.monotonic() - started, 1)
    with capsys.disabled():
        print("\nchaos soak:", json.dumps(report))
    assert kills["daemon"] >= 20 and kills["worker"] >= 10
    assert tally["resumes"] > 0 and tally["retries"] > 0
    assert rss_end - rss20 <= RSS_SLACK_BYTES, report
    assert fds_end - fds20 <= FD_SLACK, report
