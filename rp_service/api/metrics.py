"""Prometheus: jobs by state, queue length, events, tokens/s per running job, latency."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rp_service.jobs.orchestrator import Orchestrator
from rp_service.schemas import JobStatus

router = APIRouter(tags=["metrics"])

_STATUSES: tuple[str, ...] = JobStatus.__args__  # type: ignore[attr-defined]


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
        for job in store.jobs_with_status(["running", "pausing"]):
            value = job.metrics.get("tokens_per_second")
            if isinstance(value, int | float):
                tps.add_metric([job.id], float(value))
        yield tps


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
async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    body = await asyncio.to_thread(generate_latest, request.app.state.metrics_registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
