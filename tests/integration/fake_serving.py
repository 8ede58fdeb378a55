"""A stand-in for `python -m rp_service.serving BASE_JSON` that follows the serving protocol
(rp_service/serving/process.py) without a model: fast to start, so the daemon's guards
around serving can be tested in a second.

Its "answer" repeats the last message's text one character per token, each token taking
FAKE_SERVE_TOKEN_S seconds (default 0.02), up to `max_tokens` (default 16); stop sequences
are cut with the real `StopMatcher`. It loads in FAKE_SERVE_LOAD_S seconds (default 0).
Each line it writes to FAKE_SERVE_LOG (if set) is one fact the tests read: `ready PID
TOKEN-PRESENT`, `start ID`, `cancel ID`, `skipped ID` (cancelled before it started),
`done ID REASON TOKENS`, `unload DIR`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any


def _load_stops() -> Any:
    """rp_service/serving/stops.py alone: importing the package would import the daemon's
    side (a second of start-up per process on a slow box)."""
    path = Path(__file__).resolve().parents[2] / "rp_service" / "serving" / "stops.py"
    spec = importlib.util.spec_from_file_location("_rp_stops", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


StopMatcher = _load_stops().StopMatcher

_cancelled: dict[str, threading.Event] = {}
_out_lock = threading.Lock()


def _send(**message: Any) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def _note(line: str) -> None:
    path = os.environ.get("FAKE_SERVE_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _answer(request: dict[str, Any]) -> None:
    rid = request["id"]
    flag = _cancelled.setdefault(rid, threading.Event())
    if flag.is_set():
        _note(f"skipped {rid}")
        return
    _note(f"start {rid}")
    text = request["messages"][-1]["content"] or "."
    limit = int(request.get("max_tokens") or 16)
    _send(id=rid, type="start", prompt_tokens=len(request["messages"]))
    matcher = StopMatcher(list(request.get("stop") or []))
    step_s = float(os.environ.get("FAKE_SERVE_TOKEN_S", "0.02"))
    reason, tokens = "length", 0
    for tokens in range(1, limit + 1):
        time.sleep(step_s)
        if flag.is_set():
            reason = "stop"
            break
        send, matched = matcher.feed(text[(tokens - 1) % len(text)])
        if send:
            _send(id=rid, type="delta", text=send)
        if matched:
            reason = "stop"
            break
    else:
        if rest := matcher.flush():
            _send(id=rid, type="delta", text=rest)
    _note(f"done {rid} {reason} {tokens}")
    _send(
        id=rid,
        type="done",
        finish_reason=reason,
        completion_tokens=tokens,
        prompt_tokens=len(request["messages"]),
    )


def _read(requests: queue.Queue[dict[str, Any] | None]) -> None:
    for line in sys.stdin:
        message = json.loads(line)
        if message.get("op") == "cancel":
            _note(f"cancel {message['id']}")
            _cancelled.setdefault(message["id"], threading.Event()).set()
        elif message.get("op") == "unload":
            _note(f"unload {message['adapter']}")
        else:
            requests.put(message)
    requests.put(None)


def main() -> int:
    time.sleep(float(os.environ.get("FAKE_SERVE_LOAD_S", "0")))
    _note(f"ready {os.getpid()} {'RP_TOKEN' in os.environ}")
    _send(type="ready", load_s=0.0, pid=os.getpid())
    requests: queue.Queue[dict[str, Any] | None] = queue.Queue()
    threading.Thread(target=_read, args=(requests,), daemon=True).start()
    while (request := requests.get()) is not None:
        _answer(request)
    return 0


if __name__ == "__main__":
    sys.exit(main())
