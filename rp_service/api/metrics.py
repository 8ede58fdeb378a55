"""Prometheus: jobs by state, queue length, events, tokens/s per running job, latency,
and a running DPO job's TRL-named metrics (`rewards/margins` -> `rp_job_rewards_margins`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rp_service.api.deps import MetricsRegistryDep
from rp_service.jobs.orchestrator import Orchestrator
from rp_service.jobs.outputs import PREFERENCE_COLUMNS
from rp_service.jobs.store import JobRecord
from rp_service.schemas import JobStatus

router = APIRouter(tags=["metrics"])

_STATUSES: tuple[str, ...] = JobStatus.__args__  # type: ignore[attr-defined]


def preference_series_name(key: str) -> str:
    """The Prometheus name of a DPO metric: TRL's `rewards/chosen` is not a valid metric
    name (`[a-zA-Z_:][a-zA-Z0-9_:]*`), so `/` becomes `_` under the `rp_job_` prefix."""
    return "rp_job_" + key.replace("/", "_")


class _JobCollector(Collector):
    """Reads the store at scrape time, so the numbers are never stale."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        store = self.orchestrator.store
        counts = store.count_by_status()
        jobs = GaugeMetricFamily("rp_jobs", "Jobs by status.", labels=["status"])
        for status in _STATUSES:
            jobs.add_metric([status], counts.get(status, 0))
        yield jobs
        yield GaugeMetricFamily(
            "rp_queue_length", "Jobs waiting to run.", value=counts.get("queued", 0)
        )
        yield CounterMetricFamily(
            "rp_events",
            "Events stored since the daemon started.",
            value=self.orchestrator.events_appended,
        )
        tps = GaugeMetricFamily(
            "rp_job_tokens_per_second",
            "Training throughput of each running job.",
            labels=["job_id"],
        )
        running = store.jobs_with_status(["running", "pausing"])
        for job in running:
            value = job.metrics.get("tokens_per_second")
            if isinstance(value, int | float):
                tps.add_metric([job.id], float(value))
        yield tps
        yield from _preference_families(running)


def _preference_families(jobs: list[JobRecord]) -> Iterator[GaugeMetricFamily]:
    """One gauge per TRL-named DPO metric, one sample per running DPO job (its last step)."""
    for key in PREFERENCE_COLUMNS:
        family = GaugeMetricFamily(
            preference_series_name(key),
            f"DPO jobs: TRL's {key} at the latest step of each running job.",
            labels=["job_id"],
        )
        for job in jobs:
            value = job.metrics.get(key)
            if isinstance(value, int | float):
                family.add_metric([job.id], float(value))
        yield family


def build_registry(orchestrator: Orchestrator) -> tuple[CollectorRegistry, Histogram]:
    """A registry of one app (tests build many apps in one process) and its latency histogram."""
    registry = CollectorRegistry()
    registry.register(_JobCollector(orchestrator))
    latency = Histogram(
        "rp_request_duration_seconds",
        "HTTP request latency by route.",
        ["method", "route", "status"],
        registry=registry,
    )
    return registry, latency


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(registry: MetricsRegistryDep) -> Response:
    """Prometheus text format."""
    body = await asyncio.to_thread(generate_latest, registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
