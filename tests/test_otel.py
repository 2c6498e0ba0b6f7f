"""OpenTelemetry (issue 21, part 2): felix_redis.otel.instrument() makes a publish in a
span a PRODUCER span whose context the records carry in their headers, and each handler
call of the Worker and AsyncWorker a CONSUMER span of that trace; a failed handler is an
error span with a nack or dead-letter event, a redelivery a second span of the same
trace. Checked with the SDK's in-memory exporter in this process, and across processes
with a ``felixctl worker`` subprocess that exports its spans to a file.

Every test turns tracing off again (the fixture), so no other test runs instrumented.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import felix_redis
import felix_redis.asyncio as fa
from felix_redis import otel
from felix_redis.aioworker import AsyncWorker
from felix_redis.client import Client
from felix_redis.models import Record
from felix_redis.worker import Backoff, Retry, Worker

T, N, S, G = "acme", "prod", "jobs", "workers"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def spans() -> Iterator[tuple[InMemorySpanExporter, TracerProvider]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.instrument(tracer_provider=provider)
    try:
        yield exporter, provider
    finally:
        otel.uninstrument()
        provider.shutdown()


def setup(client: Any, shards: int = 1, **group: Any) -> None:
    client.stream_create(T, N, S, shards=shards)
    client.group_create(T, N, S, G, **group)


def by_kind(exporter: InMemorySpanExporter, kind: SpanKind) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.kind is kind]


def test_a_publish_in_a_span_is_a_producer_span_and_the_record_carries_its_context(
    redis_client: felix_redis.Client, spans: tuple[InMemorySpanExporter, TracerProvider]
) -> None:
    exporter, provider = spans
    client = redis_client
    setup(client)
    with provider.get_tracer("test").start_as_current_span("request") as request:
        published = client.publish(T, N, S, b"a", headers={"tenant-id": "7"})
        batch = client.publish_batch(T, N, S, [b"b", b"c"])
        keyed = client.publish_keyed(T, N, S, "k", b"d")
        via_producer = client.idempotent_producer().publish(T, N, S, b"e")
    producers = by_kind(exporter, SpanKind.PRODUCER)
    assert len(producers) == 4  # publish_keyed is one span (it publishes a batch of one)
    trace_id = request.get_span_context().trace_id
    for span in producers:
        assert span.context.trace_id == trace_id
        assert span.parent is not None and span.parent.span_id == request.get_span_context().span_id
        assert span.name == f"publish {T}/{N}/{S}"
        attrs = dict(span.attributes or {})
        assert attrs["messaging.system"] == "felix_redis"
        assert attrs["messaging.destination.name"] == f"{T}/{N}/{S}"
        assert attrs["messaging.operation.type"] == "send"
    assert dict(producers[0].attributes or {})["messaging.message.id"] == f"{published.shard}:{published.offset}"
    assert dict(producers[1].attributes or {})["messaging.batch.message_count"] == 2
    records = client.read(T, N, S, 0, 0, 10)
    assert [r.payload for r in records] == [b"a", b"b", b"c", b"d", b"e"]
    for record, span in zip(records, [producers[0], producers[1], producers[1], producers[2], producers[3]],
                            strict=True):
        _version, tid, sid, _flags = record.headers["traceparent"].split("-")
        assert (int(tid, 16), int(sid, 16)) == (trace_id, span.context.span_id), record.headers
    assert records[0].headers["tenant-id"] == "7"  # the caller's headers are kept
    assert {published.offset, batch[0].offset, keyed.offset, via_producer.offset} <= {r.offset for r in records}


def test_without_a_current_span_or_once_off_a_publish_adds_nothing(
    redis_client: felix_redis.Client, spans: tuple[InMemorySpanExporter, TracerProvider]
) -> None:
    exporter, provider = spans
    client = redis_client
    setup(client)
    client.publish(T, N, S, b"no span")
    otel.uninstrument()
    assert Client.publish.__name__ == "publish" and not hasattr(Client.publish, "__wrapped__")
    with provider.get_tracer("test").start_as_current_span("request"):
        client.publish(T, N, S, b"off")
    assert [s.name for s in exporter.get_finished_spans()] == ["request"]
    assert [r.headers for r in client.read(T, N, S, 0, 0, 10)] == [{}, {}]


def test_a_caller_traceparent_wins_and_the_header_limit_is_kept(
    redis_client: felix_redis.Client, spans: tuple[InMemorySpanExporter, TracerProvider]
) -> None:
    _exporter, provider = spans
    client = redis_client
    setup(client)
    mine = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    full = {f"h{i}": "v" for i in range(64)}
    with provider.get_tracer("test").start_as_current_span("request"):
        client.publish(T, N, S, b"a", headers={"traceparent": mine})
        client.publish(T, N, S, b"b", headers=full)
    a, b = client.read(T, N, S, 0, 0, 10)
    assert a.headers["traceparent"] == mine
    assert b.headers == full


def _run_worker(client: felix_redis.Client, handler: Any, **kw: Any) -> None:
    Worker(client, T, N, S, G, handler, burst=True, handle_signals=False, **kw).run()


def test_the_worker_runs_each_handler_call_in_a_consumer_span_of_the_publish_trace(
    redis_client: felix_redis.Client, spans: tuple[InMemorySpanExporter, TracerProvider]
) -> None:
    exporter, provider = spans
    client = redis_client
    setup(client)
    with provider.get_tracer("test").start_as_current_span("request") as request:
        client.publish(T, N, S, b"job")
    client.publish(T, N, S, b"untraced")
    inside: list[tuple[int, int]] = []

    def handler(record: Record) -> None:
        from opentelemetry import trace

        ctx = trace.get_current_span().get_span_context()
        inside.append((ctx.trace_id, ctx.span_id))

    _run_worker(client, handler)
    producer = by_kind(exporter, SpanKind.PRODUCER)[0]
    consumers = by_kind(exporter, SpanKind.CONSUMER)
    assert len(consumers) == 2
    traced, untraced = sorted(consumers, key=lambda s: dict(s.attributes or {})["messaging.message.id"])
    assert traced.context.trace_id == request.get_span_context().trace_id
    assert traced.parent is not None and traced.parent.span_id == producer.context.span_id
    assert untraced.parent is None and untraced.context.trace_id != traced.context.trace_id
    attrs = dict(traced.attributes or {})
    assert attrs["messaging.consumer.group.name"] == G
    assert attrs["messaging.operation.type"] == "process"
    assert attrs["messaging.message.id"] == "0:0:1"
    assert attrs["messaging.felix_redis.attempts"] == 1
    assert traced.name == f"process {T}/{N}/{S}"
    assert (traced.context.trace_id, traced.context.span_id) in inside  # the handler ran inside it
    assert traced.status.status_code is not StatusCode.ERROR


def test_a_worker_over_several_streams_names_each_records_own_stream_and_its_groups_attempts(
    redis_client: felix_redis.Client, spans: tuple[InMemorySpanExporter, TracerProvider]
) -> None:
    exporter, provider = spans
    client = redis_client
    for stream, attempts in (("urgent", 1), ("bulk", 3)):
        client.stream_create(T, N, stream)
        client.group_create(T, N, stream, G, max_attempts=attempts)
        with provider.get_tracer("test").start_as_current_span("request"):
            client.publish(T, N, stream, b"fails")

    def handler(record: Record) -> None:
        raise RuntimeError("no")

    Worker(client, T, N, ["urgent", "bulk"], G, handler, burst=True, handle_signals=False,
           backoff=Backoff(base_s=5.0)).run()
    consumers = by_kind(exporter, SpanKind.CONSUMER)
    events = {s.name: [e.name for e in s.events] for s in consumers}
    # urgent's group allows one attempt: a dead letter; bulk's three: a nack
    assert events == {f"process {T}/{N}/urgent": ["felix_redis.dead_letter", "exception"],
                      f"process {T}/{N}/bulk": ["felix_redis.nack", "exception"]}
    assert {dict(s.attributes or {})["messaging.destination.name"] for s in consumers} == {
        f"{T}/{N}/urgent", f"{T}/{N}/bulk"}


def test_a_failed_handler_is_an_error_span_with_a_nack_event_and_the_redelivery_a_span_of_the_same_trace(
    redis_client: felix_redis.Client, spans: tuple[InMemorySpanExporter, TracerProvider]
) -> None:
    exporter, provider = spans
    client = redis_client
    setup(client, max_attempts=3)
    with provider.get_tracer("test").start_as_current_span("request"):
        client.publish(T, N, S, b"flaky")
        client.publish(T, N, S, b"doomed")

    def handler(record: Record) -> None:
        if record.payload == b"doomed":
            raise ValueError("never works")
        if record.attempts == 1:
            raise Retry(after=0)

    _run_worker(client, handler, backoff=Backoff(base_s=0.0, max_s=0.0, jitter=0.0))
    consumers = by_kind(exporter, SpanKind.CONSUMER)
    flaky = [s for s in consumers if dict(s.attributes or {})["messaging.message.id"].startswith("0:0:")]
    doomed = [s for s in consumers if dict(s.attributes or {})["messaging.message.id"].startswith("0:1:")]
    assert [dict(s.attributes or {})["messaging.felix_redis.attempts"] for s in flaky] == [1, 2]
    assert len({s.context.trace_id for s in flaky + doomed}) == 1
    first, second = flaky
    assert first.status.status_code is StatusCode.ERROR
    assert sorted(e.name for e in first.events) == ["exception", "felix_redis.nack"]
    assert second.status.status_code is not StatusCode.ERROR and not second.events
    assert len(doomed) == 3
    assert sorted(e.name for e in doomed[-1].events) == ["exception", "felix_redis.dead_letter"]
    assert all(s.status.status_code is StatusCode.ERROR for s in doomed)
    assert [(d.offset, d.attempts) for d in client.group_dead_letters(T, N, S, 0, G)] == [(1, 3)]


def test_asyncio_publish_and_async_worker_are_traced(
    redis_url: str, raw: redis.Redis, spans: tuple[InMemorySpanExporter, TracerProvider]
) -> None:
    exporter, provider = spans

    async def main() -> None:
        client = await fa.connect(redis_url)
        try:
            await client.stream_create(T, N, S, shards=1)
            await client.group_create(T, N, S, G)
            with provider.get_tracer("test").start_as_current_span("request"):
                await client.publish(T, N, S, b"a")
                await (await client.idempotent_producer()).publish_batch(T, N, S, [b"b"])

            async def handler(record: Record) -> None:
                await asyncio.sleep(0)

            await AsyncWorker(client, T, N, S, G, handler, burst=True, handle_signals=False).run()
        finally:
            await client.close()

    asyncio.run(main())
    producers = by_kind(exporter, SpanKind.PRODUCER)
    consumers = by_kind(exporter, SpanKind.CONSUMER)
    assert len(producers) == 2 and len(consumers) == 2
    parent_of = {dict(c.attributes or {})["messaging.message.id"]: c.parent for c in consumers}
    assert parent_of["0:0:1"] is not None and parent_of["0:0:1"].span_id == producers[0].context.span_id
    assert parent_of["0:1:1"] is not None and parent_of["0:1:1"].span_id == producers[1].context.span_id


def test_one_trace_from_a_publish_here_to_the_handler_of_a_felixctl_worker_process(
    redis_client: felix_redis.Client, redis_url: str, tmp_path: Path,
    spans: tuple[InMemorySpanExporter, TracerProvider],
) -> None:
    """The worker process sets up its own tracer provider and calls instrument() in the
    handler's module (tests/support/traced_jobs.py), exporting to a file."""
    exporter, provider = spans
    client = redis_client
    setup(client)
    with provider.get_tracer("test").start_as_current_span("request"):
        client.publish(T, N, S, b"remote")
    producer = by_kind(exporter, SpanKind.PRODUCER)[0]
    out = tmp_path / "spans.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FELIX_TEST_SPANS": str(out)}
    args = [sys.executable, "-m", "felixctl.worker_cmd", "worker", "--redis-url", redis_url, "--tenant", T,
            "--namespace", N, "--poll-wait", "0.2", "--burst", S, G, "tests.support.traced_jobs:handle"]
    done = subprocess.run(args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + 10
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    remote = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(remote) == 1, remote
    span = remote[0]
    assert span["kind"] == "SpanKind.CONSUMER"
    assert int(span["context"]["trace_id"], 16) == producer.context.trace_id
    assert int(span["parent_id"], 16) == producer.context.span_id
    assert span["attributes"]["messaging.message.id"] == "0:0:1"
