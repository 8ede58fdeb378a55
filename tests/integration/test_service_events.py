"""Server-sent events over a real socket: order, `Last-Event-ID` resume, the final `done`."""

from __future__ import annotations

import json

import httpx
from httpx_sse import connect_sse

from tests.integration.service_daemon import Daemon, spec


def _read(client: httpx.Client, url: str, *, headers: dict[str, str], stop_after: int | None):
    """(ids, types, done payload) read from one SSE connection; stops early after N events."""
    ids: list[int] = []
    types: list[str] = []
    done = None
    retry = None
    with connect_sse(client, "GET", url, headers=headers) as source:
        assert source.response.status_code == 200
        assert "gzip" not in source.response.headers.get("content-encoding", "")
        for sse in source.iter_sse():
            if sse.retry is not None and retry is None:
                retry = sse.retry
            if sse.event == "done":
                done = json.loads(sse.data)
                break
            if not sse.data:
                continue
            event = json.loads(sse.data)
            assert sse.id == str(event["id"])
            assert sse.event == event["type"]
            ids.append(event["id"])
            types.append(event["type"])
            if stop_after is not None and len(ids) >= stop_after:
                break
    return ids, types, done, retry


def test_sse_reconnect_with_last_event_id_loses_and_duplicates_nothing(
    service_daemon: Daemon,
) -> None:
    with service_daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(train={"steps": 40})).json()
        url = f"/v1/jobs/{job['id']}/events"
        accept = {"Accept": "text/event-stream"}
        first, _, done, retry = _read(c, url, headers=accept, stop_after=7)
        assert retry == 3000
        assert done is None
        # Reconnect from the last id we saw, twice, while the job keeps producing events.
        second, _, _, _ = _read(
            c, url, headers={**accept, "Last-Event-ID": str(first[-1])}, stop_after=9
        )
        third, types, done, _ = _read(
            c, url, headers={**accept, "Last-Event-ID": str(second[-1])}, stop_after=None
        )
        assert done == {"job_id": job["id"], "status": "succeeded"}
        seen = first + second + third
        stored = [e["id"] for e in c.get(url, params={"limit": 1000}).json()["data"]]
        assert seen == stored == list(range(1, len(stored) + 1))
        assert types[-1] == "status"


def test_sse_of_a_finished_job_replays_then_says_done(service_daemon: Daemon) -> None:
    with service_daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(train={"steps": 3})).json()
        service_daemon.wait_for(job["id"], {"succeeded"})
        url = f"/v1/jobs/{job['id']}/events"
        ids, _, done, _ = _read(c, url, headers={"Accept": "text/event-stream"}, stop_after=None)
        assert done["status"] == "succeeded"
        page = c.get(url, params={"after": 2, "limit": 2}).json()
        assert [e["id"] for e in page["data"]] == [3, 4]
        assert page["has_more"] is True
        assert ids[:4] == [1, 2, 3, 4]
        # `after` on the stream means the same as Last-Event-ID.
        tail, _, _, _ = _read(
            c, url + f"?after={ids[-2]}", headers={"Accept": "text/event-stream"}, stop_after=None
        )
        assert tail == ids[-1:]


def test_sse_sends_pings(make_daemon) -> None:
    daemon = make_daemon(RP_SSE_PING_S="0.2", FAKE_STEP_S="0.5")
    with daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(train={"steps": 100000})).json()
        daemon.wait_for(job["id"], {"running"})
        with c.stream(
            "GET", f"/v1/jobs/{job['id']}/events", headers={"Accept": "text/event-stream"}
        ) as r:
            seen = b""
            for chunk in r.iter_bytes():
                seen += chunk
                if b": ping" in seen:
                    break
        assert b"retry: 3000" in seen
        c.post(f"/v1/jobs/{job['id']}/cancel")
