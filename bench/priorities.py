"""Priorities across streams: the Worker's drain over three streams, as a ratio to the
same Worker on one stream.

One private ``redis-server``; each round publishes ``--jobs`` no-op records and drains
them with a ``felix_redis.Worker`` (``--concurrency`` handler threads, ``burst=True``,
in this process), in each layout:

- **one**: all records on one stream (the baseline);
- **three, strict**: a third on each of three streams, the worker over
  ``[urgent, default, bulk]`` in strict order (it drains ``urgent``, then ``default``
  while asking ``urgent`` first at every poll, then ``bulk``);
- **three, weighted**: the same with ``weights=[6, 3, 1]``;
- **three busy, strict / weighted**: ``--jobs`` records on *each* of the three streams,
  timed until ``--jobs`` records were handled (every stream still busy throughout: the
  issue's "three busy streams"), against **one busy**: ``3 * --jobs`` records on one
  stream, timed the same way.

Every stream has ``--shards`` shards. Layouts alternate within a round; a ratio is the
median over the rounds of each round's rate against that round's baseline.

    python bench/priorities.py [--jobs 20000] [--shards 1] [--concurrency 16] [--rounds 3] [--out FILE]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import felix_redis
from felix_redis.testing.server import RedisServer
from felix_redis.worker import Worker

T, N, G = "bench", "prio", "workers"
STREAMS = ["urgent", "default", "bulk"]
PAYLOAD = b"x" * 16
BATCH = 1000


def reset(client: felix_redis.Client, shards: int) -> None:
    client.redis.flushall()
    for stream in ["one", *STREAMS]:
        client.stream_create(T, N, stream, shards=shards)
        client.group_create(T, N, stream, G)


def fill(client: felix_redis.Client, stream: str, count: int) -> None:
    for start in range(0, count, BATCH):
        client.publish_batch(T, N, stream, [PAYLOAD] * min(BATCH, count - start))


def drain(client: felix_redis.Client, streams: Any, jobs: int, concurrency: int,
          weights: list[int] | None = None, stop_at: int | None = None) -> float:
    """Jobs per second: a worker over ``streams`` until ``stop_at`` records were handled
    (burst: until nothing is left)."""
    handled = [0]
    lock = threading.Lock()
    done = threading.Event()

    def handle(record: Any) -> None:
        with lock:
            handled[0] += 1
            if stop_at is not None and handled[0] >= stop_at:
                done.set()

    worker = Worker(client, T, N, streams, G, handle, weights=weights, concurrency=concurrency,
                    burst=stop_at is None, handle_signals=False, poll_wait_s=0.5)
    if stop_at is not None:
        threading.Thread(target=lambda: (done.wait(600), worker.stop()), daemon=True).start()
    started = time.perf_counter()
    worker.run()
    elapsed = time.perf_counter() - started
    count = handled[0] if stop_at is None else stop_at
    if stop_at is None and count != jobs:
        raise RuntimeError(f"drained {count} of {jobs} records")
    return count / elapsed


def one_round(client: felix_redis.Client, args: argparse.Namespace) -> dict[str, float]:
    jobs, conc = args.jobs, args.concurrency
    rates: dict[str, float] = {}
    reset(client, args.shards)
    fill(client, "one", jobs)
    rates["one"] = drain(client, "one", jobs, conc)
    for label, weights in (("three_strict", None), ("three_weighted", [6, 3, 1])):
        reset(client, args.shards)
        for i, stream in enumerate(STREAMS):
            fill(client, stream, jobs // 3 + (1 if i < jobs % 3 else 0))
        rates[label] = drain(client, STREAMS, jobs, conc, weights)
    reset(client, args.shards)
    fill(client, "one", 3 * jobs)
    rates["one_busy"] = drain(client, "one", jobs, conc, stop_at=jobs)
    for label, weights in (("three_busy_strict", None), ("three_busy_weighted", [6, 3, 1])):
        reset(client, args.shards)
        for stream in STREAMS:
            fill(client, stream, jobs)
        rates[label] = drain(client, STREAMS, jobs, conc, weights, stop_at=jobs)
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rounds = []
    with RedisServer(extra=["--save", "", "--appendonly", "no"]) as server:
        client = felix_redis.connect(server.url)
        try:
            version = client.redis.info("server")["redis_version"]
            for _ in range(args.rounds):
                rounds.append(one_round(client, args))
        finally:
            client.close()
    labels = list(rounds[0])
    doc: dict[str, Any] = {
        "server": version, "jobs": args.jobs, "shards": args.shards, "concurrency": args.concurrency,
        "rounds": args.rounds,
        "rates": {label: [round(r[label]) for r in rounds] for label in labels},
        "ratios_to_one_stream": {
            label: round(statistics.median(r[label] / r["one_busy" if "busy" in label else "one"] for r in rounds), 3)
            for label in labels if label not in ("one", "one_busy")},
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
