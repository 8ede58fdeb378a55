"""Connections that send nothing, or send slowly, never stop requests (issue 46, items 1, 11).

Every daemon here is `python -m rp_service` on 127.0.0.1 with the fake worker; the idle
connections are raw sockets (from 127.0.0.2 and 127.0.0.3 where the address matters:
all of 127/8 is loopback on Linux).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from tests.integration.service_daemon import REPO, Daemon, spec

TOKEN = "connections-token"


def _open(daemon: Daemon, count: int, *, source: str = "127.0.0.1") -> list[socket.socket]:
    """`count` connections: every other one sends half a request head, the rest nothing."""
    socks = []
    for i in range(count):
        sock = socket.create_connection(
            ("127.0.0.1", daemon.port), timeout=5, source_address=(source, 0)
        )
        if i % 2:
            sock.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        socks.append(sock)
    return socks


def _reply(sock: socket.socket) -> bytes:
    """Everything the daemon sends until it closes the connection."""
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    return reply


def _is_closed(sock: socket.socket, wait_s: float) -> bool:
    """Whether the daemon closed `sock` (EOF or reset) within `wait_s`."""
    sock.settimeout(wait_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_hundreds_of_idle_connections_leave_requests_served(make_daemon) -> None:
    """Two rounds of 150 idle connections against a request cap of 100: on a daemon whose
    cap counted connections every request here was a 503."""
    daemon: Daemon = make_daemon(RP_TOKEN=TOKEN, RP_MAX_CONNECTIONS="100", RP_HEADER_TIMEOUT_S="30")
    idle: list[socket.socket] = []
    try:
        for _ in range(2):
            idle += _open(daemon, 150)
            with daemon.client() as c:  # a new connection each round, as a probe makes
                assert c.get("/healthz").status_code == 200
                r = c.get("/v1/jobs")
                assert r.status_code == 200, r.text
        # At most the idle cap (half of 100) is still open, once the newest are past their
        # grace (2 s): the oldest were closed.
        time.sleep(2.5)
        still_open = sum(not _is_closed(s, 0.01) for s in idle[-60:])
        assert still_open <= 50
    finally:
        for sock in idle:
            sock.close()


def test_one_address_cannot_close_another_ones_idle_connections(make_daemon) -> None:
    daemon: Daemon = make_daemon(
        RP_TOKEN=TOKEN,
        RP_MAX_CONNECTIONS="200",
        RP_MAX_IDLE_CONNECTIONS="100",
        RP_MAX_IDLE_CONNECTIONS_PER_CLIENT="10",
        RP_HEADER_TIMEOUT_S="30",
    )
    mine = _open(daemon, 5, source="127.0.0.3")
    flood = _open(daemon, 80, source="127.0.0.2")
    try:
        with daemon.client() as c:
            assert c.get("/v1/jobs").status_code == 200  # the flood has been accepted by now
        closed = sum(_is_closed(s, 2.0) for s in flood[:70])
        assert closed == 70  # 127.0.0.2 keeps its 10 newest, no more
        assert not any(_is_closed(s, 0.2) for s in mine)  # 127.0.0.3's are all still open
    finally:
        for sock in mine + flood:
            sock.close()


def _healthz_kept_alive(sock: socket.socket) -> None:
    """GET /healthz on a kept-alive connection; returns once the response is read whole."""
    sock.settimeout(10)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)


def test_kept_alive_connections_close_sooner_near_the_idle_cap(make_daemon) -> None:
    daemon: Daemon = make_daemon(
        RP_MAX_CONNECTIONS="100", RP_KEEP_ALIVE_S="30", RP_HEADER_TIMEOUT_S="60"
    )
    kept = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
    idle: list[socket.socket] = []
    try:
        _healthz_kept_alive(kept)
        assert not _is_closed(kept, 1.5)  # far from the cap: RP_KEEP_ALIVE_S (30 s)
        idle = _open(daemon, 45)  # 46 of the idle cap's 50: past three quarters of it
        with daemon.client() as c:  # accepted after the 45 (the listen queue is in order)
            assert c.get("/healthz").status_code == 200
        _healthz_kept_alive(kept)
        started = time.monotonic()
        assert _is_closed(kept, 5.0)
        assert time.monotonic() - started < 3.0  # after ~1 s, not 30
    finally:
        kept.close()
        for sock in idle:
            sock.close()


# ---------------------------------------------------------------- slow bodies


def _upload_head(port: int, length: int) -> bytes:
    return (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {TOKEN}\r\n"
        "Content-Type: multipart/form-data; boundary=b\r\n"
        f"Content-Length: {length}\r\n\r\n"
        # the start of a valid body: the file's bytes follow, one at a time
        '--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
    ).encode()


def test_uploads_at_one_byte_a_second_are_cut_and_free_their_slots(make_daemon) -> None:
    """Four uploads trickling 1 byte per 0.5 s held all four upload slots for good."""
    daemon: Daemon = make_daemon(
        RP_TOKEN=TOKEN, RP_MAX_CONCURRENT_UPLOADS="4", RP_BODY_TIMEOUT_S="1.5"
    )
    slow = []
    for _ in range(4):
        sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
        sock.sendall(_upload_head(daemon.port, 100_000))
        slow.append(sock)
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.5):
            for sock in slow:
                try:
                    sock.sendall(b"x")
                except OSError:
                    pass

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    started = time.monotonic()
    try:
        for sock in slow:
            reply = _reply(sock)  # and then the daemon closes it
            assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
            assert b"request_timeout" in reply and b"RP_BODY_TIMEOUT_S" in reply, reply
        assert time.monotonic() - started < 8
        with daemon.client() as c:
            r = c.post(
                "/v1/files",
                files={"file": ("a.jsonl", b'{"text": "hi"}\n')},
                data={"purpose": "fine-tune"},
            )
            assert r.status_code in (200, 201), r.text
    finally:
        stop.set()
        trickler.join(timeout=5)
        for sock in slow:
            sock.close()
    log = daemon.log_path.read_text()
    assert log.count("arrived too slowly") >= 4, log[-2000:]


def test_a_json_body_that_stalls_is_cut_with_408(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_TOKEN=TOKEN, RP_BODY_TIMEOUT_S="1")
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        sock.sendall(
            (
                f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                "Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"
            ).encode()
        )
        reply = _reply(sock)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"connection: close" in reply.lower()
        assert b"RP_BODY_MIN_RATE" in reply


def test_the_socket_path_is_private(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_TOKEN=TOKEN)
    path = daemon.data_dir / "rp.sock"
    assert path.is_socket()
    assert path.stat().st_mode & 0o777 == 0o600
    assert daemon.data_dir.stat().st_mode & 0o777 == 0o700
    daemon.stop()
    # It stays: a client finds it and is refused while the daemon is down (a restart, an
    # upgrade), rather than sending the token to whatever holds the TCP port by then.
    assert path.is_socket()
    daemon.env["RP_UNIX_SOCKET"] = "false"
    daemon.start()
    assert not path.exists()  # turned off: removed, so clients use TCP


# ---------------------------------------------------------------- the Unix socket


class _StandIn:
    """A TCP listener on the port a client would use by default, recording what it gets:
    another user's program waiting for a token while the daemon is down."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.received = b""
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(1)
                try:
                    self.received += conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def local_client(make_daemon, monkeypatch) -> Iterator[tuple[Daemon, _StandIn]]:
    """A daemon that wrote its token file, and a client environment with no RP_URL and no
    RP_TOKEN whose default URL is a stand-in's."""
    from rp_client import _base

    daemon: Daemon = make_daemon()
    stand_in = _StandIn()
    monkeypatch.setattr(_base, "DEFAULT_BASE_URL", stand_in.url)
    monkeypatch.delenv("RP_URL", raising=False)
    monkeypatch.delenv("RP_TOKEN", raising=False)
    monkeypatch.setenv("RP_DATA_DIR", str(daemon.data_dir))
    try:
        yield daemon, stand_in
    finally:
        stand_in.close()


def test_the_sdk_uses_the_socket_and_never_sends_the_token_to_the_tcp_port(
    local_client: tuple[Daemon, _StandIn], monkeypatch
) -> None:
    from rp_client import AsyncClient, Client
    from rp_client.errors import APIStatusError

    daemon, stand_in = local_client
    token = daemon.token
    assert token
    with Client(max_retries=0) as client:
        assert client.demo_spec()  # authenticated, served by the daemon
        assert client.where == f"unix socket {daemon.data_dir / 'rp.sock'}"

    async def spec() -> object:
        async with AsyncClient(max_retries=0) as client:
            return await client.demo_spec()

    assert asyncio.run(spec()) is not None
    assert stand_in.connections == 0 and token.encode() not in stand_in.received
    # RP_URL set explicitly keeps TCP (and sending the token there is then the user's call).
    monkeypatch.setenv("RP_URL", stand_in.url)
    with Client(max_retries=0) as client, pytest.raises(APIStatusError):
        client.demo_spec()  # the stand-in's 503
    assert stand_in.connections == 1


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_stopped_daemons_socket_is_an_error_not_a_fall_back_to_tcp(
    local_client: tuple[Daemon, _StandIn], how: str
) -> None:
    """A restart or an upgrade (a clean stop), or a crash: the socket stays, and the
    client is refused there instead of sending the token to the TCP port's new holder."""
    from rp_client import Client
    from rp_client.errors import APIConnectionError

    daemon, stand_in = local_client
    getattr(daemon, how)()
    assert (daemon.data_dir / "rp.sock").is_socket()
    with Client(max_retries=0) as client, pytest.raises(APIConnectionError) as info:
        client.demo_spec()
    assert "unix socket" in str(info.value)
    assert stand_in.connections == 0


def test_rp_on_this_machine_goes_through_the_socket(make_daemon) -> None:
    """The daemon is on a random port, not rp's default one: `rp jobs` with no RP_URL can
    only reach it (with the token of its data directory) through the socket."""
    daemon: Daemon = make_daemon()
    with daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(name="via-socket", train={"steps": 2})).json()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "client"), str(REPO)])
    env["RP_DATA_DIR"] = str(daemon.data_dir)
    listed = subprocess.run(
        [sys.executable, "-m", "rp_client", "jobs"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    assert job["id"] in listed.stdout


# ---------------------------------------------------------------- log followers

LOG_FOLLOWERS = 250


async def _follow_log(port: int, job_id: str, connected: asyncio.Event) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            (
                f"GET /v1/jobs/{job_id}/logs?follow=true HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n"
            ).encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        connected.set()
        body = b""
        while size := int((await reader.readline()).split(b";")[0], 16):  # chunked coding
            body += (await reader.readexactly(size + 2))[:-2]
        return body
    finally:
        writer.close()


def _healthz_ms(port: int) -> float:
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert _reply(sock).startswith(b"HTTP/1.1 200")
    return (time.perf_counter() - started) * 1000


def test_hundreds_of_log_followers_leave_healthz_fast(make_daemon) -> None:
    """Each follower read the store and the file every 0.5 s on the shared thread pool: 900
    of them made /healthz wait up to 1.5 s. Now one reader per job serves them all."""
    daemon: Daemon = make_daemon(RP_TOKEN=TOKEN, FAKE_STEP_S="0.05")
    with daemon.client() as c:
        r = c.post("/v1/jobs", json=spec(name="followed", train={"steps": 60}))
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
    times_ms: list[float] = []

    async def load() -> list[bytes]:
        connected = [asyncio.Event() for _ in range(LOG_FOLLOWERS)]
        followers = [asyncio.create_task(_follow_log(daemon.port, job_id, e)) for e in connected]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in connected)), timeout=60)
        for _ in range(20):  # from a thread: this loop is busy reading the followers
            times_ms.append(await asyncio.to_thread(_healthz_ms, daemon.port))
            await asyncio.sleep(0.05)
        return await asyncio.wait_for(asyncio.gather(*followers), timeout=120)

    bodies = asyncio.run(load())
    whole = (daemon.data_dir / "jobs" / job_id / "worker.log").read_bytes()
    assert bodies == [whole] * LOG_FOLLOWERS  # every follower: the whole log, then the end
    times_ms.sort()
    print(f"LOG_FOLLOWERS healthz ms: p50 {times_ms[10]:.0f}, max {times_ms[-1]:.0f}")
    assert times_ms[-2] < 500, times_ms
