"""Fan-out under load: 200 followers of one job's events plus 50 concurrent submissions.

Every follower must see the identical gap-free sequence ending in `done`, every submission
must be answered, `/healthz` on a new connection each time (as a liveness probe asks) must
stay quick meanwhile, and a kept-alive health client must never be dropped. The probe runs
in a process of its own, so its figures are the daemon's latency and not this test's event
loop. Loopback only; bounded in count and time.
The figures are printed as one JSON line (run with `-s` to see it on success).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import multiprocessing
import os
import socket
import statistics
import time
from typing import Any

import httpx

from tests.integration.service_daemon import Daemon, spec

FOLLOWERS = 200
SUBMISSIONS = 50
STEPS = 300  # the followed job: ~300 metrics events at FAKE_STEP_S apart
STEP_S = "0.02"
PROBE_EVERY_S = 0.05
DEADLINE_S = 240.0
TOKEN = "fanout-load-token"
HEALTHZ_P99_MS = 200.0
HEALTHZ_MAX_MS = 500.0


def _probe(port: int, stop: Any, out: Any) -> None:
    """Time GET /healthz, each on a new connection, until `stop` is set; send the ms back.

    Between two of those, the same request on one kept-alive connection: it must never be
    dropped (a starved loop once closed it mid-request).
    """
    request = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    kept = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    times_ms: list[float] = []
    failures: list[str] = []
    while not stop.is_set():
        started = time.perf_counter()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(request.encode())
                reply = b""
                while chunk := sock.recv(65536):
                    reply += chunk
            if not reply.startswith(b"HTTP/1.1 200"):
                failures.append(reply[:80].decode(errors="replace"))
        except OSError as exc:
            failures.append(repr(exc))
        times_ms.append((time.perf_counter() - started) * 1000)
        try:
            kept.request("GET", "/healthz")
            with kept.getresponse() as response:
                response.read()
                if response.status != 200 or response.will_close:
                    failures.append(
                        f"kept-alive: {response.status}, closing: {response.will_close}"
                    )
        except (OSError, http.client.HTTPException) as exc:
            failures.append(f"kept-alive: {exc!r}")
            kept.close()
        time.sleep(PROBE_EVERY_S)
    kept.close()
    out.send((times_ms, failures))


async def _follow(port: int, job_id: str, connected: asyncio.Event | None) -> bytes:
    """The whole body of one SSE stream, read over a raw socket (cheaper than a client)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            (
                f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Authorization: Bearer {TOKEN}\r\nAccept: text/event-stream\r\n\r\n"
            ).encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"transfer-encoding: chunked" in head.lower(), head
        assert b"content-encoding" not in head.lower(), head
        if connected is not None:
            connected.set()
        body = bytearray()
        while True:  # chunked transfer coding, until the zero-size chunk
            size = int((await reader.readline()).split(b";")[0].strip(), 16)
            if size == 0:
                return bytes(body)
            body += (await reader.readexactly(size + 2))[:-2]
    finally:
        writer.close()


def _parse(body: bytes) -> list[dict[str, str]]:
    """SSE blocks as {field: value}; a comment line is kept as {"comment": text}."""
    blocks = []
    for raw in body.replace(b"\r\n", b"\n").decode().split("\n\n"):
        if not raw:
            continue
        block: dict[str, str] = {}
        for line in raw.split("\n"):
            name, _, value = line.partition(":")
            block[name or "comment"] = value.removeprefix(" ")
        blocks.append(block)
    return blocks


async def _submit(client: httpx.AsyncClient, i: int) -> tuple[int, float]:
    started = time.perf_counter()
    r = await client.post("/v1/jobs", json=spec(name=f"load-{i}", train={"steps": 5}))
    return r.status_code, (time.perf_counter() - started) * 1000


async def _load(port: int, job_id: str) -> tuple[list[bytes], list[tuple[int, float]]]:
    connected = [asyncio.Event() for _ in range(FOLLOWERS)]
    followers = [asyncio.create_task(_follow(port, job_id, e)) for e in connected]
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=DEADLINE_S,
        limits=httpx.Limits(max_connections=SUBMISSIONS),
    ) as client:
        # Submit while the followers stream: all of them connected is the starting gun.
        while sum(e.is_set() for e in connected) < FOLLOWERS:
            done = [t for t in followers if t.done() and t.exception() is not None]
            if done:
                raise done[0].exception()  # type: ignore[misc]
            await asyncio.sleep(0.01)
        submissions = await asyncio.gather(*(_submit(client, i) for i in range(SUBMISSIONS)))
    bodies = await asyncio.gather(*followers)
    return list(bodies), list(submissions)


def _stored_events(daemon: Daemon, job_id: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    with daemon.client() as c:
        while True:
            page = c.get(
                f"/v1/jobs/{job_id}/events", params={"after": len(events), "limit": 1000}
            ).json()
            events += page["data"]
            if not page["has_more"]:
                return events


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def test_200_followers_and_50_submissions_keep_the_daemon_responsive(make_daemon) -> None:
    daemon = make_daemon(RP_TOKEN=TOKEN, FAKE_STEP_S=STEP_S)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    receive, send = ctx.Pipe(duplex=False)
    probe = ctx.Process(target=_probe, args=(daemon.port, stop, send), daemon=True)
    probe.start()
    try:
        time.sleep(0.5)  # a few idle probes first, as a baseline in the same series
        with daemon.client() as c:
            r = c.post("/v1/jobs", json=spec(name="followed", train={"steps": STEPS}))
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
        started = time.perf_counter()
        bodies, submissions = asyncio.run(
            asyncio.wait_for(_load(daemon.port, job_id), timeout=DEADLINE_S)
        )
        duration_s = time.perf_counter() - started
    finally:
        stop.set()
        times_ms, failures = receive.recv() if receive.poll(30) else ([], ["no probe result"])
        probe.join(timeout=10)

    stored = _stored_events(daemon, job_id)
    status = {"followed": daemon.wait_for(job_id, {"succeeded"}, timeout_s=30)["status"]}
    figures = {
        "followers": FOLLOWERS,
        "submissions": SUBMISSIONS,
        "events": len(stored),
        "duration_s": round(duration_s, 2),
        "healthz_probes": len(times_ms),
        "healthz_p50_ms": round(statistics.median(times_ms), 1) if times_ms else None,
        "healthz_p99_ms": round(_percentile(times_ms, 0.99), 1) if times_ms else None,
        "healthz_max_ms": round(max(times_ms), 1) if times_ms else None,
        "submit_max_ms": round(max(ms for _, ms in submissions), 1),
        "probe_failures": len(failures),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    print("FANOUT_LOAD " + json.dumps(figures))

    # Every follower: `retry` first, then the stored events in order, then `done`; and all
    # followers saw the very same bytes of every event.
    assert [e["id"] for e in stored] == list(range(1, len(stored) + 1))
    assert len(stored) >= STEPS + 4
    sequences = []
    for body in bodies:
        blocks = [b for b in _parse(body) if b.get("comment") != "ping"]
        assert blocks[0] == {"retry": "3000"}
        assert blocks[-1]["event"] == "done"
        assert json.loads(blocks[-1]["data"]) == {"job_id": job_id, "status": "succeeded"}
        sequences.append(blocks[1:-1])
    assert all(seq == sequences[0] for seq in sequences)
    assert [(int(b["id"]), b["event"], json.loads(b["data"])) for b in sequences[0]] == [
        (e["id"], e["type"], e) for e in stored
    ]
    assert status["followed"] == "succeeded"
    assert [code for code, _ in submissions] == [201] * SUBMISSIONS
    assert failures == []
    assert len(times_ms) >= 20
    assert figures["healthz_p99_ms"] < HEALTHZ_P99_MS, figures
    assert figures["healthz_max_ms"] < HEALTHZ_MAX_MS, figures
