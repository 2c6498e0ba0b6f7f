"""Prometheus metrics: what workers did (:class:`WorkerMetrics`) and where groups stand
(:class:`GroupCollector`, served by ``felixctl metrics``). Needs ``prometheus-client``
(the ``metrics`` extra)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from felix_redis.client import Client
from felix_redis.errors import FelixError, NotFound
from felix_redis.models import GroupInfo, StreamInfo

__all__ = ["BoundWorkerMetrics", "GroupCollector", "WorkerMetrics", "default_worker_metrics", "serve"]

WORKER_LABELS = ("tenant", "namespace", "stream", "group")
SHARD_LABELS = ("tenant", "namespace", "stream", "group", "shard")
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)


class WorkerMetrics:
    """The worker metrics, registered once per registry; ``bind`` labels them per group.

    - ``felix_worker_jobs_processed_total``: handlers that returned and whose record was acked
    - ``felix_worker_jobs_failed_total``: handlers that raised
    - ``felix_worker_jobs_retried_total``: records nacked for a later retry
    - ``felix_worker_jobs_dead_lettered_total``: records the worker dead-lettered
    - ``felix_worker_jobs_handed_back_total``: records handed back at shutdown
    - ``felix_worker_jobs_stale_total``: records whose lease was lost before the worker
      could settle them (a settle raised StaleClaim)
    - ``felix_worker_jobs_unsettled_total``: records the worker could not settle (a lost
      connection, another error): their leases lapse and they are delivered again
    - ``felix_worker_handler_duration_seconds``: handler run time (histogram)
    - ``felix_worker_in_flight``: records held by the worker right now
    """

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"felix_worker_jobs_{name}", doc, WORKER_LABELS, registry=registry)

        self.processed = counter("processed", "Jobs whose handler returned and whose record was acked.")
        self.failed = counter("failed", "Jobs whose handler raised.")
        self.retried = counter("retried", "Records nacked for a later retry.")
        self.dead_lettered = counter("dead_lettered", "Records the worker dead-lettered.")
        self.handed_back = counter("handed_back", "Records handed back unfinished at shutdown.")
        self.stale = counter("stale", "Records whose lease was lost before the worker could settle them.")
        self.unsettled = counter("unsettled", "Records the worker could not settle; they are delivered again.")
        self.duration = Histogram(
            "felix_worker_handler_duration_seconds", "Handler run time.", WORKER_LABELS,
            buckets=DURATION_BUCKETS, registry=registry,
        )
        self.in_flight = Gauge("felix_worker_in_flight", "Records held by the worker.", WORKER_LABELS,
                               registry=registry)

    def bind(self, tenant: str, namespace: str, stream: str, group: str) -> BoundWorkerMetrics:
        return BoundWorkerMetrics(self, (tenant, namespace, stream, group))


class BoundWorkerMetrics:
    """The worker metrics of one (tenant, namespace, stream, group)."""

    def __init__(self, metrics: WorkerMetrics, labels: tuple[str, str, str, str]) -> None:
        self._in_flight = metrics.in_flight.labels(*labels)
        self._duration = metrics.duration.labels(*labels)
        self._failed = metrics.failed.labels(*labels)
        self._by_outcome = {
            "acked": metrics.processed.labels(*labels),
            "retried": metrics.retried.labels(*labels),
            "dead": metrics.dead_lettered.labels(*labels),
            "handed_back": metrics.handed_back.labels(*labels),
            "stale": metrics.stale.labels(*labels),
            "unsettled": metrics.unsettled.labels(*labels),
        }

    def started(self) -> None:
        self._in_flight.inc()

    def released(self) -> None:
        self._in_flight.dec()

    def finished(self, outcome: str, duration_s: float, failed: bool) -> None:
        if outcome != "handed_back":
            self._duration.observe(duration_s)
        if failed:
            self._failed.inc()
        counter = self._by_outcome.get(outcome)
        if counter is not None:
            counter.inc()


_default: WorkerMetrics | None = None
_default_lock = threading.Lock()


def default_worker_metrics() -> WorkerMetrics:
    """The process-wide WorkerMetrics on the default registry (created once)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = WorkerMetrics()
        return _default


class GroupCollector(Collector):
    """Reads every group of every stream (optionally of one tenant / namespace) at each
    scrape and reports, per stream, group and shard: unfinished, lag, pending, owed, in
    flight, dead letters, position, tail and the age of the oldest unfinished record."""

    def __init__(self, client: Client, tenant: str | None = None, namespace: str | None = None) -> None:
        self.client = client
        self.tenant = tenant
        self.namespace = namespace

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        started = time.monotonic()
        families = _Families()
        up = 1
        try:
            for info, groups in self._read():
                families.add_stream(info)
                for group in groups:
                    families.add_group(group)
        except FelixError:
            up = 0
        yield from families.all()
        yield GaugeMetricFamily("felix_exporter_up", "1 if the last scrape read Redis without error.", up)
        yield GaugeMetricFamily("felix_exporter_scrape_duration_seconds", "Time the last scrape took.",
                                time.monotonic() - started)

    def _read(self) -> Iterator[tuple[StreamInfo, list[GroupInfo]]]:
        for tenant, namespace, stream in self.client.stream_list(self.tenant, self.namespace):
            try:
                info = self.client.stream_describe(tenant, namespace, stream)
                groups = [self.client.group_describe(tenant, namespace, stream, g) for g in info.groups]
            except NotFound:  # deleted while we looked
                continue
            yield info, groups


class _Families:
    """The gauge families of one scrape."""

    SHARD_GAUGES = (
        ("unfinished", "Records the group has not finished: pending + owed + in flight + scheduled."),
        ("lag", "Tail - position: the unfinished records and the finished ones above the position "
                "(which an unfinished record holds back); alert on felix_group_unfinished."),
        ("pending", "Records never delivered to the group yet (and due)."),
        ("scheduled", "Delayed records not yet due (published with a delay or a delivery time)."),
        ("owed", "Records waiting to be redelivered (nacked, lapsed, redriven), or delayed records the group "
                 "passed over once due."),
        ("in_flight", "Records held under a valid lease."),
        ("dead", "Dead letters of the group."),
        ("position", "Smallest offset the group has not finished."),
        ("trimmed", "Records bounded retention removed before the group finished them."),
    )

    def __init__(self) -> None:
        self.shard = {
            name: GaugeMetricFamily(f"felix_group_{'dead_letters' if name == 'dead' else name}", doc,
                                    labels=SHARD_LABELS)
            for name, doc in self.SHARD_GAUGES
        }
        self.age = GaugeMetricFamily(
            "felix_group_oldest_unfinished_age_seconds",
            "Age of the oldest unfinished record (0 when none).", labels=SHARD_LABELS)
        self.vt = GaugeMetricFamily("felix_group_visibility_timeout_seconds", "The group's visibility timeout.",
                                    labels=WORKER_LABELS)
        self.max_attempts = GaugeMetricFamily("felix_group_max_attempts", "Deliveries before a dead letter.",
                                              labels=WORKER_LABELS)
        self.tail = GaugeMetricFamily("felix_stream_tail", "Next offset of the shard (records ever published).",
                                      labels=("tenant", "namespace", "stream", "shard"))

    def add_stream(self, info: StreamInfo) -> None:
        for shard, tail in enumerate(info.tails):
            self.tail.add_metric([info.tenant, info.namespace, info.stream, str(shard)], tail)

    def add_group(self, info: GroupInfo) -> None:
        base = [info.tenant, info.namespace, info.stream, info.group]
        self.vt.add_metric(base, info.visibility_timeout_ms / 1000)
        self.max_attempts.add_metric(base, info.max_attempts)
        for state in info.shards:
            labels = [*base, str(state.shard)]
            for name, _doc in self.SHARD_GAUGES:
                self.shard[name].add_metric(labels, getattr(state, name))
            self.age.add_metric(labels, (state.oldest_unfinished_age_ms or 0) / 1000)

    def all(self) -> Iterator[Metric]:
        yield from self.shard.values()
        yield from (self.age, self.vt, self.max_attempts, self.tail)


def serve(
    client: Client, host: str = "127.0.0.1", port: int = 9108, *,
    tenant: str | None = None, namespace: str | None = None, registry: CollectorRegistry | None = None,
) -> tuple[Any, CollectorRegistry]:
    """Serves the group metrics over HTTP in a background thread; returns (server, registry)."""
    registry = registry if registry is not None else CollectorRegistry()
    registry.register(GroupCollector(client, tenant, namespace))
    server, _thread = start_http_server(port, host, registry=registry)
    return server, registry
