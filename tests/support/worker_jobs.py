"""Handlers for the worker tests, imported by worker subprocesses as
``tests.support.worker_jobs:handle`` (and in-process by tests/test_worker.py).

The payload is JSON that says what to do:
``{"sleep": s}`` sleep s seconds; ``{"sleep_first": s}`` sleep only on the first attempt;
``{"fail_times": n}`` raise ValueError on the first n attempts; ``{"retry_after": s}``
raise Retry(after=s) on the first attempt; ``{"fatal": reason}`` raise Fatal(reason);
``{"always_fail": true}`` raise ValueError every time.

Every start and finish is pushed as JSON to the Redis list ``EVENTS`` on
``$WORKER_JOBS_URL`` (pid, claim, time), so a test can see who did what and when.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import redis

from felix_redis.models import Record
from felix_redis.worker import Fatal, Retry

EVENTS = "worker-test:events"

_conn: redis.Redis | None = None


def _redis() -> redis.Redis:
    global _conn
    if _conn is None:
        _conn = redis.Redis.from_url(os.environ["WORKER_JOBS_URL"])
    return _conn


def event(kind: str, record: Record, **extra: Any) -> None:
    item = {"kind": kind, "pid": os.getpid(), "shard": record.shard, "offset": record.offset,
            "attempts": record.attempts, "t": time.time(), **extra}
    _redis().rpush(EVENTS, json.dumps(item))


def events(r: redis.Redis, kind: str | None = None) -> list[dict[str, Any]]:
    out = [json.loads(x) for x in r.lrange(EVENTS, 0, -1)]
    return [e for e in out if kind is None or e["kind"] == kind]


def _plan(record: Record) -> tuple[dict[str, Any], float]:
    spec: dict[str, Any] = json.loads(record.payload) if record.payload.startswith(b"{") else {}
    sleep = float(spec.get("sleep", 0))
    if record.attempts == 1:
        sleep += float(spec.get("sleep_first", 0))
    return spec, sleep


def _verdict(spec: dict[str, Any], record: Record) -> None:
    if "fatal" in spec:
        raise Fatal(spec["fatal"])
    if spec.get("always_fail"):
        raise ValueError(f"always fails (attempt {record.attempts})")
    if record.attempts <= int(spec.get("fail_times", 0)):
        raise ValueError(f"fails on attempt {record.attempts}")
    if "retry_after" in spec and record.attempts == 1:
        raise Retry(after=float(spec["retry_after"]))


def handle(record: Record) -> None:
    """The sync test handler."""
    spec, sleep = _plan(record)
    event("start", record)
    time.sleep(sleep)
    try:
        _verdict(spec, record)
    except Exception as exc:
        event("error", record, error=repr(exc))
        raise
    event("done", record)


async def ahandle(record: Record) -> None:
    """The async test handler."""
    spec, sleep = _plan(record)
    event("start", record)
    await asyncio.sleep(sleep)
    try:
        _verdict(spec, record)
    except Exception as exc:
        event("error", record, error=repr(exc))
        raise
    event("done", record)
