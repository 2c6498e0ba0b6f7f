"""Prometheus metrics: the exporter (``felixctl metrics``) and the worker metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import felix_redis
from felix_redis.metrics import GroupCollector, WorkerMetrics
from felix_redis.worker import Backoff, Fatal, Worker

ROOT = Path(__file__).resolve().parent.parent
T, N = "acme", "prod"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def shard_labels(tenant: str, stream: str, group: str, shard: int) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"tenant": tenant, "namespace": N, "stream": stream, "group": group,
                         "shard": str(shard)}.items()))


@pytest.fixture
def busy(redis_client: felix_redis.Client, first_lead_zero: None) -> felix_redis.Client:
    """Two tenants' streams with records in every state: acked, in flight, owed, dead, pending
    (the sharded poll's first lead pinned to shard 0, so which shard holds what is known)."""
    c = redis_client
    c.stream_create(T, N, "jobs", shards=3)
    c.stream_create("other", N, "mail")
    c.group_create(T, N, "jobs", "workers")
    c.group_create(T, N, "jobs", "audit")
    c.group_create("other", N, "mail", "senders")
    for i in range(30):
        c.publish(T, N, "jobs", f"job {i}", shard=i % 3)
    for i in range(4):
        c.publish("other", N, "mail", f"mail {i}")
    group = c.group_sharded(T, N, "jobs", "workers")
    items = group.poll(12)
    group.ack_many(items[:5])
    group.nack_after(items[5], 60)
    group.dead_letter(items[6], "bad")
    c.group_poll("other", N, "mail", 0, "senders", 2)
    return c


def check_against_describe(client: felix_redis.Client, got: Samples) -> int:
    """Asserts every exported shard gauge equals group_describe; returns how many shards."""
    checked = 0
    for tenant, namespace, stream in client.stream_list():
        for group in client.stream_describe(tenant, namespace, stream).groups:
            info = client.group_describe(tenant, namespace, stream, group)
            for st in info.shards:
                labels = shard_labels(tenant, stream, group, st.shard)
                for field, metric in (("lag", "lag"), ("pending", "pending"), ("owed", "owed"),
                                      ("in_flight", "in_flight"), ("dead", "dead_letters"),
                                      ("position", "position")):
                    assert got[(f"felix_group_{metric}", labels)] == getattr(st, field), (metric, labels)
                age = got[("felix_group_oldest_unfinished_age_seconds", labels)]
                expected = (st.oldest_unfinished_age_ms or 0) / 1000
                assert abs(age - expected) < 2.0, (age, expected)
                checked += 1
    return checked


@pytest.fixture
def exporter(busy: felix_redis.Client, redis_url: str) -> Iterator[str]:
    """A ``felixctl metrics`` process on a free port; yields its /metrics URL."""
    args = [sys.executable, "-m", "felixctl.worker_cmd", "metrics", "--redis-url", redis_url,
            "--listen", "127.0.0.1:0"]
    proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address, proc.stderr.read() if proc.stderr else ""
        yield f"http://{address}/metrics"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_exporter_output_parses_and_matches_group_describe(exporter: str, busy: felix_redis.Client) -> None:
    with urllib.request.urlopen(exporter, timeout=10) as response:
        text = response.read().decode()
    got = samples(text)
    assert check_against_describe(busy, got) == 3 + 3 + 1
    workers0 = shard_labels(T, "jobs", "workers", 0)
    assert got[("felix_group_dead_letters", workers0)] + got[
        ("felix_group_dead_letters", shard_labels(T, "jobs", "workers", 1))] + got[
        ("felix_group_dead_letters", shard_labels(T, "jobs", "workers", 2))] == 1
    assert got[("felix_group_in_flight", shard_labels("other", "mail", "senders", 0))] == 2
    assert got[("felix_exporter_up", ())] == 1
    tail = got[("felix_stream_tail", (("namespace", N), ("shard", "0"), ("stream", "jobs"), ("tenant", T)))]
    assert tail == 10
    vt = (("group", "workers"), ("namespace", N), ("stream", "jobs"), ("tenant", T))
    assert got[("felix_group_visibility_timeout_seconds", vt)] == 30
    assert got[("felix_group_max_attempts", vt)] == 5


def test_collector_scope_and_fresh_numbers_at_each_scrape(busy: felix_redis.Client) -> None:
    registry = CollectorRegistry()
    registry.register(GroupCollector(busy, tenant="other"))
    got = samples(generate_latest(registry).decode())
    streams = {dict(labels).get("stream") for name, labels in got if name.startswith("felix_group_")}
    assert streams == {"mail"}
    busy.group_ack(T, N, "jobs", 0, "workers", 0)
    busy.publish("other", N, "mail", "one more")
    again = samples(generate_latest(registry).decode())
    labels = shard_labels("other", "mail", "senders", 0)
    assert again[("felix_group_lag", labels)] == got[("felix_group_lag", labels)] + 1


def test_worker_metrics_count_outcomes(redis_client: felix_redis.Client) -> None:
    c = redis_client
    c.stream_create(T, N, "jobs")
    c.group_create(T, N, "jobs", "workers", max_attempts=2)
    for payload in ("ok", "ok", "fail", "fatal"):
        c.publish(T, N, "jobs", payload)

    def handler(record: felix_redis.Record) -> None:
        if record.payload == b"fatal":
            raise Fatal("no")
        if record.payload == b"fail":
            raise RuntimeError("again")

    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    worker = Worker(c, T, N, "jobs", "workers", handler, concurrency=2, burst=True, metrics=metrics,
                    backoff=Backoff(0, jitter=0), handle_signals=False)
    worker.run()
    worker.run()  # picks up the retry, whose delay was 0; its second failure is its last
    got = samples(generate_latest(registry).decode())
    labels = (("group", "workers"), ("namespace", N), ("stream", "jobs"), ("tenant", T))
    assert got[("felix_worker_jobs_processed_total", labels)] == 2
    assert got[("felix_worker_jobs_failed_total", labels)] == 3
    assert got[("felix_worker_jobs_retried_total", labels)] == 1
    assert got[("felix_worker_jobs_dead_lettered_total", labels)] == 2
    assert got[("felix_worker_handler_duration_seconds_count", labels)] == 5
    assert got[("felix_worker_in_flight", labels)] == 0
    assert c.group_describe(T, N, "jobs", "workers").lag == 0
