"""What OpenTelemetry tracing (felix_redis.otel) costs, as ratios to the same work untraced.

One private ``redis-server``, one run, the variants alternating in every round (each
ratio is the median over the rounds of that round's ratio):

- **publish**: ``client.publish`` of 64-byte records one by one: never instrumented
  (``off``); instrumented, no span current (``on, no span``: nothing is added);
  instrumented inside a span, with the SDK recording every span (``on, traced``: each
  publish is a PRODUCER span and its record carries ``traceparent``);
- **worker**: a burst ``Worker`` (concurrency 1, no-op handler) draining records: not
  instrumented (``off``), and instrumented with the SDK recording a CONSUMER span per
  handler call, the records carrying a trace context (``on, traced``).

    python bench/otel.py [--records 5000] [--rounds 5] [--out FILE]

Needs ``opentelemetry-sdk``. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import felix_redis
from felix_redis import otel
from felix_redis.testing.server import RedisServer
from felix_redis.worker import Worker

T, N = "bench", "bench"
PAYLOAD = b"x" * 64


def publish_rate(client: felix_redis.Client, stream: str, records: int, provider: TracerProvider | None) -> float:
    started = time.perf_counter()
    if provider is None:
        for _ in range(records):
            client.publish(T, N, stream, PAYLOAD, shard=0)
    else:
        with provider.get_tracer("bench").start_as_current_span("request"):
            for _ in range(records):
                client.publish(T, N, stream, PAYLOAD, shard=0)
    return records / (time.perf_counter() - started)


def worker_rate(client: felix_redis.Client, stream: str, records: int) -> float:
    started = time.perf_counter()
    Worker(client, T, N, stream, "g", lambda record: None, burst=True, handle_signals=False).run()
    took = time.perf_counter() - started
    if client.group_describe(T, N, stream, "g").shards[0].unfinished:
        raise RuntimeError(f"the worker left records of {stream} unfinished")
    return records / took


def median_ratio(these: list[float], base: list[float]) -> float:
    return round(statistics.median(t / b for t, b in zip(these, base, strict=True)), 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=5000, help="records per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (a ratio: the median of the rounds')")
    parser.add_argument("--out", default=None, help="also write the JSON document here")
    args = parser.parse_args(argv)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    pub: dict[str, list[float]] = {"off": [], "on, no span": [], "on, traced": []}
    work: dict[str, list[float]] = {"off": [], "on, traced": []}
    with RedisServer(extra=["--save", "", "--appendonly", "no"]) as server:
        client = felix_redis.connect(server.url)
        try:
            for r in range(args.rounds):
                for kind in pub:
                    stream = f"pub-{r}-{kind.replace(', ', '-').replace(' ', '-')}"
                    client.stream_create(T, N, stream, shards=1)
                    if kind != "off":
                        otel.instrument(tracer_provider=provider)
                    try:
                        pub[kind].append(publish_rate(client, stream, args.records,
                                                      provider if kind == "on, traced" else None))
                    finally:
                        otel.uninstrument()
                    exporter.clear()
                for kind in work:
                    stream = f"work-{r}-{'off' if kind == 'off' else 'on'}"
                    client.stream_create(T, N, stream, shards=1)
                    client.group_create(T, N, stream, "g")
                    if kind == "off":
                        for start in range(0, args.records, 1000):
                            client.publish_batch(T, N, stream, [PAYLOAD] * min(1000, args.records - start), shard=0)
                        work[kind].append(worker_rate(client, stream, args.records))
                    else:
                        otel.instrument(tracer_provider=provider)
                        try:
                            with provider.get_tracer("bench").start_as_current_span("request"):
                                for start in range(0, args.records, 1000):
                                    client.publish_batch(T, N, stream, [PAYLOAD] * min(1000, args.records - start),
                                                         shard=0)
                            exporter.clear()
                            work[kind].append(worker_rate(client, stream, args.records))
                            consumers = sum(1 for s in exporter.get_finished_spans() if s.name.startswith("process"))
                            if consumers != args.records:
                                raise RuntimeError(f"{consumers} consumer spans for {args.records} records")
                        finally:
                            otel.uninstrument()
                        exporter.clear()
        finally:
            client.close()
    doc: dict[str, Any] = {
        "records": args.records, "rounds": args.rounds,
        "publish_per_s": {k: round(max(v)) for k, v in pub.items()},
        "publish_ratio": {k: median_ratio(v, pub["off"]) for k, v in pub.items() if k != "off"},
        "worker_per_s": {k: round(max(v)) for k, v in work.items()},
        "worker_ratio": {"on, traced": median_ratio(work["on, traced"], work["off"])},
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
