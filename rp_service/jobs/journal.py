"""The worker's event journal: what a SIGKILLed daemon had not yet stored.

A worker writes each event line to ``events-<attempt>.jsonl`` in its job directory (named
by ``event_journal`` in spec.json) before its stdout pipe. When the daemon dies, lines in that pipe, or
read but not yet committed, are gone from the pipe but not from the journal: at start-up
`recover` stores the metrics, sample and checkpoint events of the interrupted attempt that
the store lacks (keyed by step), so a step the resumed run does not train again keeps its
one value (and its samples) and a committed checkpoint its row. Other lost lines (logs) are not worth a schema
change to track and stay only in the journal.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rp_service.jobs.pipe import WorkerHandle, journal_path
from rp_service.jobs.store import JobRecord, Store

__all__ = ["recover"]

log = logging.getLogger(__name__)

_BY_ATTEMPT = ("metrics", "sample")  # events whose data carries the attempt that made them


def _stored_steps(store: Store, job: JobRecord, type_: str) -> set[int]:
    """Steps of the `type_` events of the job's current attempt already in the store."""
    steps: set[int] = set()
    after = 0
    while True:
        page = store.list_events(job.id, after=after, limit=1000, type_=type_)
        steps.update(
            e.data["step"]
            for e in page
            if e.data.get("attempt") == job.attempt and isinstance(e.data.get("step"), int)
        )
        if len(page) < 1000:
            return steps
        after = page[-1].id


def recover(store: Store, job: JobRecord, job_dir: Path) -> int:
    """Store the interrupted attempt's metrics/sample/checkpoint events the store lacks;
    blocking. Returns how many were stored.
    """
    path = journal_path(job_dir, job.attempt)
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return 0
    stored = {type_: _stored_steps(store, job, type_) for type_ in _BY_ATTEMPT}
    checkpoints = {c.step for c in store.list_checkpoints(job.id)}
    handle = WorkerHandle(job_id=job.id, gpus=[], attempt=job.attempt)
    handle.metrics = dict(job.metrics)
    recovered = 0
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue  # the worker was killed in the middle of this line
        if not isinstance(obj, dict) or obj.get("type") not in (*_BY_ATTEMPT, "checkpoint"):
            continue
        step = obj.get("data", {}).get("step") if isinstance(obj.get("data"), dict) else None
        if not isinstance(step, int):
            continue
        if step in stored.get(obj["type"], ()):
            continue
        if obj["type"] == "checkpoint" and step in checkpoints:
            continue
        event = handle.read_line(line)
        if event is None:
            continue
        if event["type_"] == "metrics" and step < int(job.progress.get("step") or 0):
            event.pop("job_fields", None)  # an older step must not move the progress back
        store.append_event(job.id, **event)
        recovered += 1
    if recovered:
        log.warning("job %s: %d events recovered from %s", job.id, recovered, path)
    return recovered
