"""The worker process of the chaos test (tests/test_chaos.py).

Run as ``python -m tests.support.chaos_jobs URL LOGDIR CONSUMER CONCURRENCY TENANT NAMESPACE STREAM GROUP``:
a :class:`felix_redis.Worker` (the real runtime: threads, batched acks, heartbeats,
backoff) with a handler driven by the payload, writing a delivery log.

The delivery log is one JSON line per event, appended with ``O_APPEND`` and one
``write`` per line to ``LOGDIR/worker-PID.jsonl``, so a SIGKILL loses at most the line
being written (the reader skips a torn last line). Times are the Redis server's
(``TIME``, microseconds), read on a separate connection:

- ``poll``: one line per record a poll handed out, with ``tb`` (TIME before the poll
  call, <= the server time the lease started) and ``ta`` (TIME after it returned, >=
  the lease start); written before any handler sees the record;
- ``start`` / ``end``: the handler began / is about to return (``ok``) or raise;
  ``end`` is written *before* the worker can ack or nack, so every settle of a record
  follows a logged ``end``;
- ``settle``: the worker's outcome line for the record (acked, retried, dead, stale,
  handed_back), from its log, with the TIME after it.

The payload is JSON: ``{"id": unique, "sleep": s, "fail": n, "poison": bool}``; the
handler sleeps ``s`` seconds and raises on the first ``n`` attempts, or always when
``poison``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import redis

from felix_redis.client import Client, Item, ShardedGroup
from felix_redis.models import Record
from felix_redis.worker import Backoff, Worker


class EventLog:
    """Appends JSON lines to one file, one ``write`` per line."""

    def __init__(self, path: str, time_url: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._time = redis.Redis.from_url(time_url)
        self._local = threading.local()

    def now_us(self) -> int:
        """The Redis server's clock, in microseconds."""
        seconds, micros = self._time.time()
        return int(seconds) * 1_000_000 + int(micros)

    def write(self, **fields: Any) -> None:
        os.write(self.fd, (json.dumps(fields, separators=(",", ":")) + "\n").encode())


LOG: EventLog | None = None
CONSUMER = ""


def _log() -> EventLog:
    assert LOG is not None, "chaos_jobs.main() sets up the log"
    return LOG


class LoggingGroup(ShardedGroup):
    """A ShardedGroup that logs every hand-out with server times around the poll."""

    def poll(self, max_records: int = 16, wait: float | None = None, *, ack: Any = None) -> list[Item]:
        log = _log()
        before = log.now_us()
        items = super().poll(max_records, wait, ack=ack)
        if items:
            after = log.now_us()
            for item in items:
                log.write(e="poll", c=self.consumer, pid=os.getpid(), s=item.shard, o=item.offset,
                          a=item.attempts, tb=before, ta=after)
        return items


class LoggingClient(Client):
    """A Client whose sharded groups log their hand-outs."""

    def group_sharded(
        self, tenant: str, namespace: str, stream: str | Sequence[str], group: str, consumer: str | None = None,
        reclaim: bool = True, shards: Iterable[int] | None = None, weights: Sequence[int] | None = None,
    ) -> ShardedGroup:
        return LoggingGroup(self, tenant, namespace, stream, group, consumer, reclaim, shards, weights)


def handle(record: Record) -> None:
    """Sleeps, then fails on the first ``fail`` attempts (always when ``poison``)."""
    log = _log()
    spec = json.loads(record.payload)
    where = {"c": CONSUMER, "pid": os.getpid(), "s": record.shard, "o": record.offset, "a": record.attempts}
    log.write(e="start", t=log.now_us(), **where)
    time.sleep(float(spec.get("sleep", 0)))
    fail = bool(spec.get("poison")) or record.attempts <= int(spec.get("fail", 0))
    log.write(e="end", t=log.now_us(), ok=not fail, **where)
    if fail:
        raise ValueError(f"chaos: {'poison' if spec.get('poison') else 'planned failure'} {spec['id']}")


class OutcomeHandler(logging.Handler):
    """Turns the worker's job outcome log lines into ``settle`` events."""

    def emit(self, record: logging.LogRecord) -> None:
        job = getattr(record, "felix_job", None)
        if job is None:
            return
        log = _log()
        log.write(e="settle", c=CONSUMER, pid=os.getpid(), s=job["shard"], o=job["offset"], a=job["attempts"],
                  outcome=job["outcome"], t=log.now_us())


def main(argv: list[str]) -> None:
    global LOG, CONSUMER
    url, logdir, consumer, concurrency, tenant, namespace, stream, group = argv
    CONSUMER = consumer
    LOG = EventLog(os.path.join(logdir, f"worker-{os.getpid()}.jsonl"), url)
    worker_log = logging.getLogger("felix_redis.worker")
    worker_log.setLevel(logging.DEBUG)
    worker_log.propagate = False
    worker_log.addHandler(OutcomeHandler())
    errors = logging.StreamHandler(sys.stderr)
    errors.setLevel(logging.WARNING)
    worker_log.addHandler(errors)
    client = LoggingClient(redis.Redis.from_url(url, socket_timeout=10), url=url, retry_for=5)
    worker = Worker(
        client, tenant, namespace, stream, group, handle,
        concurrency=int(concurrency), consumer=consumer,
        backoff=Backoff(base_s=0.05, factor=2.0, max_s=0.4, jitter=0.2),
        poll_wait_s=0.5, grace_s=5.0,
    )
    worker.run()
    client.close()


if __name__ == "__main__":
    if len(sys.argv) != 9:
        sys.exit("usage: python -m tests.support.chaos_jobs"
                 " URL LOGDIR CONSUMER CONCURRENCY TENANT NAMESPACE STREAM GROUP")
    main(sys.argv[1:])
    sys.exit(0)

