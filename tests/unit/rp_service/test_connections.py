"""The caps on connections that wait for a request (rp_service/connections.py: Waiting)."""

from __future__ import annotations

import asyncio

from rp_service.connections import ConnectionLimits, Waiting


class _Conn:
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False

    def close_waiting(self) -> None:
        self.closed = True


def _waiting(total: int, per_client: int) -> Waiting:
    return Waiting(ConnectionLimits(100, total, per_client, 10.0, grace_s=0.0))


def test_past_the_per_client_cap_that_clients_oldest_is_closed() -> None:
    waiting = _waiting(total=10, per_client=2)
    a1, a2, a3, b1 = _Conn("a1"), _Conn("a2"), _Conn("a3"), _Conn("b1")
    waiting.add(b1, "b")
    waiting.add(a1, "a")
    waiting.add(a2, "a")
    waiting.add(a3, "a")
    assert [c.closed for c in (a1, a2, a3, b1)] == [True, False, False, False]
    assert waiting.of("a") == 2 and waiting.of("b") == 1 and len(waiting) == 3


def test_past_the_total_cap_the_oldest_of_all_is_closed() -> None:
    waiting = _waiting(total=3, per_client=3)
    conns = [_Conn(str(i)) for i in range(5)]
    for i, conn in enumerate(conns):
        waiting.add(conn, f"client{i}")
    assert [c.closed for c in conns] == [True, True, False, False, False]
    assert len(waiting) == 3 and waiting.of("client0") == 0


def test_a_busy_connection_is_never_closed_and_a_kept_alive_one_starts_anew() -> None:
    waiting = _waiting(total=2, per_client=2)
    old, busy, new = _Conn("old"), _Conn("busy"), _Conn("new")
    waiting.add(old, "a")
    waiting.add(busy, "a")
    waiting.remove(busy)  # its request head arrived
    waiting.add(old, "a")  # kept alive after a response: now the newest
    waiting.add(new, "a")
    waiting.add(_Conn("newest"), "a")
    assert not busy.closed and not new.closed and old.closed
    waiting.remove(old)  # its connection_lost: removing twice is harmless
    assert len(waiting) == 2


def test_a_burst_is_closed_only_past_its_grace_and_only_if_still_waiting() -> None:
    waiting = Waiting(ConnectionLimits(100, 100, 2, 10.0, grace_s=0.2))
    burst = [_Conn(str(i)) for i in range(6)]

    async def run() -> list[bool]:
        for conn in burst:
            waiting.add(conn, "a")
        assert not any(c.closed for c in burst)  # all young: their heads may be on the way
        waiting.remove(burst[0])  # its request head arrived meanwhile: busy
        await asyncio.sleep(0.3)
        return [c.closed for c in burst]

    assert asyncio.run(run()) == [False, True, True, True, False, False]
    assert waiting.of("a") == 2
