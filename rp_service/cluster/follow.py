"""Follow a job's data-parallel ranks until rank 0 ends: the loop both launchers share.

`rp_service.cluster.driver` (ranks on the nodes of a Ray cluster) and
`rp_service.cluster.local` (ranks on the GPUs of this box) are read by the orchestrator as
a worker is: stdout is the event pipe, the exit status the outcome, SIGTERM cancels and
SIGUSR1 pauses. Both hold one `RankHandle` a rank and hand them to `follow_ranks`, which

- passes rank 0's event lines on to stdout and every rank's log lines on to stderr (the
  job's worker.log), each prefixed with its rank;
- passes SIGTERM and SIGUSR1 on to every rank, once each;
- returns rank 0's exit status; a rank that ends in failure while rank 0 runs fails the
  attempt with that rank's error once the others had `grace_s` to end (rank 0 may still
  say why), a rank killed by a signal before rank 0 failed fails it as `node_lost` (the
  retryable code: rank 0's error is then only its lost peer), and a handle that can no
  longer be read (`RankLost`) fails it at once. Every rank still running at the end is
  killed.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from rp_service.worker.main import EXIT_CANCELLED, EXIT_PAUSED, EventWriter

__all__ = ["RankHandle", "RankLost", "Signals", "follow_ranks", "start_launcher"]

_POLL_S = 0.1
RANK_GRACE_S = 10.0  # how long the others may take to end once one rank has ended

# (code, message, param) -> the launcher's exit status, after emitting the error event
Fail = Callable[[str, str, str | None], int]


class RankLost(Exception):
    """A rank's handle can no longer be read (its node left the cluster): the message says
    what happened, for the job's error."""


class RankHandle(Protocol):
    """One rank's process, wherever it runs."""

    def take(self) -> tuple[list[str], list[str], int | None]:
        """stdout and stderr lines since the last take, and the exit status once the
        process has ended with its output read (None before); RankLost when unreadable."""
        ...

    def signal(self, signum: int) -> None: ...

    def kill(self) -> None:
        """SIGKILL the rank and wait for it (nothing when it has ended)."""
        ...


class Signals:
    """SIGTERM and SIGUSR1 noted for the loop (which passes them on to the ranks)."""

    def __init__(self) -> None:
        self.cancel = False
        self.pause = False
        signal.signal(signal.SIGTERM, self._on)
        signal.signal(signal.SIGUSR1, self._on)

    def _on(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGTERM:
            self.cancel = True
        else:
            self.pause = True


def start_launcher(argv: list[str] | None, module: str) -> tuple[Path, EventWriter, Signals] | None:
    """A launcher's start, as the worker's: `python -m MODULE JOB_DIR` parsed (None, with the
    usage on stderr, otherwise), signals noted, stdout taken for the events, logging to
    stderr (the job's worker.log)."""
    from rp_service.worker.main import _take_stdout

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m {module} JOB_DIR", file=sys.stderr)
        return None
    signals = Signals()
    emit = EventWriter(_take_stdout())
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return Path(args[0]), emit, signals


def follow_ranks(
    ranks: Sequence[RankHandle],
    emit: EventWriter,
    signals: Signals,
    fail: Fail,
    *,
    grace_s: float = RANK_GRACE_S,
    one_device_each: bool = False,
) -> int:
    """Pass lines and signals on until rank 0 ends; rank 0's exit status (or `fail`'s).

    `one_device_each` (the ranks of one box, one device a rank): rank 0's metrics events
    carry every rank's `gpu_share`, rank r's device named `cuda:r` (`cpu-virtual:r`), the
    r-th of the job's GPUs as the daemon counts them: GET /v1/system shows each GPU's share.
    """
    codes: list[int | None] = [None] * len(ranks)
    forwarded_pause = forwarded_cancel = False
    other_failed_at: float | None = None
    rank_errors: dict[int, str] = {}
    shares: dict[int, list[Any]] | None = {} if one_device_each else None
    while True:
        if signals.cancel and not forwarded_cancel:
            forwarded_cancel = True
            _signal_all(ranks, signal.SIGTERM)
        if signals.pause and not forwarded_pause:
            forwarded_pause = True
            _signal_all(ranks, signal.SIGUSR1)
        for rank, handle in enumerate(ranks):
            if codes[rank] is not None:
                continue
            try:
                out, err, code = handle.take()
            except RankLost as exc:
                _kill_all(ranks)
                return fail("node_lost", str(exc), None)
            _pass_on(rank, out, err, emit, rank_errors, shares)
            codes[rank] = code
        if codes[0] is not None:
            break
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0, EXIT_PAUSED)]
        if failed and other_failed_at is None:
            other_failed_at = time.monotonic()  # rank 0 may still say why
        if failed and other_failed_at is not None and time.monotonic() - other_failed_at > grace_s:
            _kill_all(ranks)
            rank, code = failed[0]
            return _other_rank_failed(fail, rank, code, rank_errors.get(rank))
        time.sleep(_POLL_S)
    # ranks killed by a signal while rank 0 ran (the OOM killer, kill -9)
    killed = [(r, c) for r, c in enumerate(codes) if r > 0 and c is not None and c < 0]
    deadline = time.monotonic() + grace_s
    while any(c is None for c in codes[1:]) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        for rank, handle in enumerate(ranks):
            if codes[rank] is None:
                try:
                    out, err, codes[rank] = handle.take()
                except RankLost:
                    codes[rank] = -signal.SIGKILL
                    continue
                _pass_on(rank, out, err, emit, rank_errors, shares)
    _kill_all(ranks)
    assert codes[0] is not None
    if killed and codes[0] not in (0, EXIT_PAUSED, EXIT_CANCELLED):
        # rank 0's own error is then only its lost peer (a collective's broken
        # connection): the attempt fails as node_lost, which the daemon retries
        return _other_rank_failed(fail, *killed[0], None)
    return codes[0]


def _pass_on(
    rank: int,
    out: list[str],
    err: list[str],
    emit: EventWriter,
    rank_errors: dict[int, str],
    shares: dict[int, list[Any]] | None,
) -> None:
    for line in err:
        print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)
    if rank == 0:
        for line in out:
            emit.raw(line if not shares else _with_shares(line, shares))
        return
    for line in out:  # the last error a rank reported, should it end
        if '"level": "error"' in line:
            rank_errors[rank] = line
        elif shares is not None and '"gpu_share"' in line:
            share = _metrics_share(line)
            if share is not None:
                shares[rank] = [_renamed(d, rank) for d in share]


def _metrics_share(line: str) -> list[Any] | None:
    """The `gpu_share` of a metrics event line, None for any other line."""
    try:
        event = json.loads(line)
        share = event["data"]["gpu_share"] if event.get("type") == "metrics" else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return share if isinstance(share, list) else None


def _renamed(device: Any, rank: int) -> Any:
    """Rank `rank`'s own device (`cuda:0`, the one it sees) as the job's `cuda:rank`."""
    if isinstance(device, dict) and isinstance(device.get("device"), str):
        return {**device, "device": f"{device['device'].split(':')[0]}:{rank}"}
    return device


def _with_shares(line: str, shares: dict[int, list[Any]]) -> str:
    """Rank 0's line, a metrics event's `gpu_share` extended with the other ranks' latest."""
    if _metrics_share(line) is None:
        return line
    event = json.loads(line)
    event["data"]["gpu_share"] += [d for r in sorted(shares) for d in shares[r]]
    return json.dumps(event)


def _other_rank_failed(fail: Fail, rank: int, code: int, error_line: str | None) -> int:
    if error_line is not None:
        try:
            data = json.loads(error_line).get("data") or {}
        except ValueError:
            data = {}
        message = f"rank {rank}: {data.get('message') or error_line}"
        return fail(str(data.get("code") or "rank_failed"), message, data.get("param"))
    if code < 0:  # killed: the machine's fault (as a local worker killed by a signal)
        return fail("node_lost", f"rank {rank} was killed by signal {-code}", None)
    return fail("rank_failed", f"rank {rank} exited with status {code}", None)


def _signal_all(ranks: Sequence[RankHandle], signum: int) -> None:
    for handle in ranks:
        handle.signal(int(signum))


def _kill_all(ranks: Sequence[RankHandle]) -> None:
    for handle in ranks:
        handle.kill()
