"""What the workers report when a settle fails, and which handlers each accepts.

A settle (a failed handler's nack or dead letter, the ack of a finished job, the
hand-back at shutdown) that fails with :class:`felix_redis.StaleClaim` is outcome
``stale``: the lease was lost. One that fails with any other FelixError (a lost
connection here) is ``unsettled``: logged at WARNING with ``settle_error=...``, counted
in ``WorkerStats.unsettled``, and the record comes back when its lease lapses, so
nothing is lost. Every test runs the sync :class:`Worker` (threads) and the
:class:`AsyncWorker` (asyncio) alike, against the real Redis, with the failure injected
into the worker's own sharded group.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import felix_redis
import felix_redis.asyncio as aio
import felix_redis.worker as worker_module
from felix_redis import ConnectionFailed, FelixError, Record, StaleClaim
from felix_redis._runtime import ACK_TRIES
from felix_redis.aioworker import AsyncWorker
from felix_redis.metrics import WorkerMetrics
from felix_redis.worker import Fatal, Worker

T, N, S, G = "acme", "prod", "jobs", "workers"

#: The visibility timeout of these tests' groups: short, so an unsettled record comes
#: back soon, yet long enough that a loaded machine settles a healthy job within it.
VT_MS = 1000

KINDS = ["sync", "async"]

AnyWorker = Worker | AsyncWorker


# -- harness


def lost_connection() -> ConnectionFailed:
    return ConnectionFailed("injected: connection to Redis lost")


def stale_claim() -> StaleClaim:
    return StaleClaim("injected: the claim is stale")


def faulty(kind: str, real: Callable[..., Any], fail: Callable[..., FelixError | None]) -> Callable[..., Any]:
    """``real`` (a method of the worker's sharded group), except that it raises what
    ``fail(*args, **kwargs)`` returns, when that is not None, before sending anything.
    ``kind``: "sync" (a plain method) or "async" (a coroutine method)."""
    if kind == "sync":

        def method(*args: Any, **kwargs: Any) -> Any:
            error = fail(*args, **kwargs)
            if error is not None:
                raise error
            return real(*args, **kwargs)

        return method

    async def amethod(*args: Any, **kwargs: Any) -> Any:
        error = fail(*args, **kwargs)
        if error is not None:
            raise error
        return await real(*args, **kwargs)

    return amethod


def as_handler(kind: str, logic: Callable[[Record], None]) -> Callable[[Record], Any]:
    """``logic`` as the handler the worker of ``kind`` takes."""
    if kind == "sync":
        return logic

    async def handler(record: Record) -> None:
        await asyncio.sleep(0)
        logic(record)

    return handler


def run_worker(
    kind: str,
    c: felix_redis.Client,
    aclient: Callable[[], aio.AsyncClient],
    handler: Callable[[Record], Any],
    patch: Callable[[Any], None],
    until: Callable[[AnyWorker], bool],
    timeout: float,
    release: threading.Event | None = None,
    **options: Any,
) -> AnyWorker:
    """Runs a worker of ``kind`` with ``handler`` on acme/prod/jobs, group ``workers``,
    ``patch`` applied to its sharded group, until ``until(worker)`` holds (at most
    ``timeout`` seconds), then stops it and waits (bounded) for it to finish. ``release``
    is set once the sync worker stopped (a handler blocked on it then returns)."""
    options.setdefault("poll_wait_s", 0.1)
    if kind == "sync":
        w = Worker(c, T, N, S, G, handler, handle_signals=False, **options)
        patch(w._group)
        thread = threading.Thread(target=w.run, name="test-worker", daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and not until(w):
                time.sleep(0.01)
        finally:
            w.stop()
            thread.join(15)
            if release is not None:
                release.set()
        assert not thread.is_alive(), "the worker did not stop within 15 s"
        return w

    async def main() -> AsyncWorker:
        async with aclient() as client:
            aw = AsyncWorker(client, T, N, S, G, handler, handle_signals=False, **options)
            patch(aw._group)
            task = asyncio.create_task(aw.run())
            try:
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline and not until(aw) and not task.done():
                    await asyncio.sleep(0.01)
            finally:
                aw.stop()
                await asyncio.wait_for(task, 15)
            return aw

    return asyncio.run(main())


def job_lines(caplog: pytest.LogCaptureFixture, outcome: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "felix_redis.worker" and r.getMessage().startswith("job ")
            and f" outcome={outcome} " in r.getMessage()]


def wait_for_redelivery(c: felix_redis.Client, timeout: float = 10.0) -> list[Record]:
    """The records a plain poll of shard 0 gets within ``timeout`` seconds (the lease a
    stopped worker held lapses meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = c.group_poll(T, N, S, 0, G, wait=0.2)
        if records:
            return records
    return []


# -- a failed handler's nack or dead letter


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("settle", "error", "outcome"),
    [
        ("nack", lost_connection, "unsettled"),
        ("dead_letter", lost_connection, "unsettled"),
        ("nack", stale_claim, "stale"),
        ("dead_letter", stale_claim, "stale"),
    ],
)
def test_a_failed_handlers_settle_that_fails_is_unsettled_or_stale_and_the_record_comes_back(
    kind: str, settle: str, error: Callable[[], FelixError], outcome: str,
    worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The handler fails its first delivery (ValueError: a nack for a retry; Fatal: a
    dead letter) and that settle raises: a lost connection is ``unsettled``, a StaleClaim
    ``stale``, and never the other one. Nothing was settled, so the lease lapses and the
    record is delivered again (attempts 2), when the handler succeeds."""
    c = worker_group(vt_ms=VT_MS)
    c.publish(T, N, S, "x")
    attempts: list[int] = []
    settles: list[str] = []

    def logic(record: Record) -> None:
        attempts.append(record.attempts)
        if record.attempts == 1:
            raise Fatal("cannot parse") if settle == "dead_letter" else ValueError("boom")

    def patch(group: Any) -> None:
        def fail(*args: Any, **kwargs: Any) -> FelixError:
            settles.append(settle)
            return error()

        setattr(group, settle, faulty(kind, getattr(group, settle), fail))

    caplog.set_level(logging.DEBUG, logger="felix_redis.worker")
    registry = CollectorRegistry()
    w = run_worker(kind, c, aclient, as_handler(kind, logic), patch,
                   until=lambda w: w.stats.processed >= 1 and w.stats.in_flight == 0, timeout=20,
                   metrics=WorkerMetrics(registry))

    assert attempts == [1, 2], "the record was not delivered again after its lease lapsed"
    assert settles == [settle]
    other = "stale" if outcome == "unsettled" else "unsettled"
    assert getattr(w.stats, outcome) == 1 and getattr(w.stats, other) == 0, w.stats
    labels = {"tenant": T, "namespace": N, "stream": S, "group": G}
    assert registry.get_sample_value(f"felix_worker_jobs_{outcome}_total", labels) == 1
    assert registry.get_sample_value(f"felix_worker_jobs_{other}_total", labels) == 0
    assert (w.stats.failed, w.stats.processed, w.stats.retried, w.stats.dead_lettered, w.stats.in_flight) == (
        1, 1, 0, 0, 0), w.stats
    [line] = job_lines(caplog, outcome)
    assert job_lines(caplog, other) == []
    message = line.getMessage()
    assert line.levelno == logging.WARNING
    assert "shard=0 offset=0 attempts=1 " in message
    assert ("error='cannot parse'" if settle == "dead_letter" else "error='ValueError: boom'") in message
    if outcome == "unsettled":
        assert "settle_error=ConnectionFailed(" in message and "connection to Redis lost" in message
    else:
        assert "settle_error=" not in message
    assert line.felix_job["outcome"] == outcome  # type: ignore[attr-defined]
    # the second delivery was acked: nothing is owed, in flight or dead
    info = c.group_describe(T, N, S, G)
    assert (info.lag, info.in_flight, info.owed) == (0, 0, 0)
    assert c.group_dead_letters(T, N, S, 0, G) == []


# -- the ack, tried ACK_TRIES times


@pytest.mark.parametrize("kind", KINDS)
def test_an_ack_that_fails_every_try_is_unsettled_and_the_record_comes_back(
    kind: str, worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The handler returns; the poll that carries its ack loses the connection, and so
    does each of the ACK_TRIES acks sent on their own: the job is ``unsettled`` with
    ``ack_failed=true`` (not stale, not processed). The lease lapses, the record is
    delivered again, and that delivery is acked (the connection is back)."""
    monkeypatch.setattr(worker_module, "ACK_LINGER_S", 60.0)  # only polls ack while the loop runs
    c = worker_group(vt_ms=VT_MS)
    c.publish(T, N, S, "x")
    attempts: list[int] = []
    separate_acks: list[int] = []
    failed_polls: list[int] = []
    left = [ACK_TRIES]  # ack_many calls still to fail

    def logic(record: Record) -> None:
        attempts.append(record.attempts)

    def fail_poll(*args: Any, ack: Any = None, **kwargs: Any) -> FelixError | None:
        acks = list(ack or [])
        if acks and left[0] > 0:
            failed_polls.append(len(acks))
            return lost_connection()
        return None

    def fail_ack_many(items: Any) -> FelixError | None:
        separate_acks.append(len(list(items)))
        if left[0] > 0:
            left[0] -= 1
            return lost_connection()
        return None

    def patch(group: Any) -> None:
        group.poll = faulty(kind, group.poll, fail_poll)
        group.ack_many = faulty(kind, group.ack_many, fail_ack_many)

    caplog.set_level(logging.DEBUG, logger="felix_redis.worker")
    w = run_worker(kind, c, aclient, as_handler(kind, logic), patch,
                   until=lambda w: w.stats.processed >= 1 and w.stats.in_flight == 0, timeout=20)

    assert attempts == [1, 2], "the record was not delivered again after its lease lapsed"
    assert failed_polls == [1]
    assert separate_acks[:ACK_TRIES] == [1] * ACK_TRIES  # tried ACK_TRIES times, then given up
    assert (w.stats.unsettled, w.stats.stale, w.stats.processed, w.stats.failed, w.stats.in_flight) == (
        1, 0, 1, 0, 0), w.stats
    [line] = job_lines(caplog, "unsettled")
    assert line.levelno == logging.WARNING
    assert "offset=0 attempts=1 " in line.getMessage() and "ack_failed=true" in line.getMessage()
    assert line.felix_job["outcome"] == "unsettled"  # type: ignore[attr-defined]
    assert job_lines(caplog, "stale") == []
    assert sum("ack of 1 record(s) failed" in r.getMessage() for r in caplog.records) == ACK_TRIES
    info = c.group_describe(T, N, S, G)
    assert (info.lag, info.in_flight, info.owed) == (0, 0, 0)


# -- the hand-back at shutdown


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("error", "outcome"), [(lost_connection, "unsettled"), (stale_claim, "stale")])
def test_a_hand_back_that_fails_at_shutdown_is_unsettled_or_stale(
    kind: str, error: Callable[[], FelixError], outcome: str,
    worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A handler still runs at the end of the grace period; the nack that hands its
    record back raises. A lost connection is ``unsettled`` (``reason=shutdown``,
    ``settle_error=...``), a StaleClaim ``stale``; neither is ``handed_back``. The record
    was not handed back, so it comes back once its lease lapses (attempts 2)."""
    c = worker_group(vt_ms=VT_MS)
    c.publish(T, N, S, "slow")
    started, release = threading.Event(), threading.Event()
    nacks: list[float] = []

    def slow(record: Record) -> None:
        started.set()
        release.wait(30)

    async def aslow(record: Record) -> None:
        started.set()
        await asyncio.sleep(30)  # cancelled at the end of the grace period

    def fail(item: Any, delay: float = 0.0) -> FelixError:
        nacks.append(delay)
        return error()

    def patch(group: Any) -> None:
        group.nack = faulty(kind, group.nack, fail)

    caplog.set_level(logging.DEBUG, logger="felix_redis.worker")
    w = run_worker(kind, c, aclient, slow if kind == "sync" else aslow, patch,
                   until=lambda w: started.is_set(), timeout=10, release=release, grace_s=0.2)

    assert started.is_set()
    assert nacks == [0.0]  # the hand-back: a nack due at once
    other = "stale" if outcome == "unsettled" else "unsettled"
    assert getattr(w.stats, outcome) == 1 and getattr(w.stats, other) == 0, w.stats
    assert (w.stats.handed_back, w.stats.processed, w.stats.failed, w.stats.in_flight) == (0, 0, 0, 0), w.stats
    [line] = job_lines(caplog, outcome)
    assert job_lines(caplog, other) == [] and job_lines(caplog, "handed_back") == []
    message = line.getMessage()
    assert line.levelno == logging.WARNING and "reason=shutdown" in message
    assert ("settle_error=ConnectionFailed(" in message) == (outcome == "unsettled")
    # nothing handed it back: it is still in flight until its lease lapses
    records = wait_for_redelivery(c)
    assert [(r.payload, r.attempts) for r in records] == [(b"slow", 2)]


# -- which handlers each worker takes


async def async_handler(record: Record) -> None:
    """An async def."""


def plain_handler(record: Record) -> None:
    """A plain function."""


class AsyncCallable:
    """An object whose ``__call__`` is an async def."""

    async def __call__(self, record: Record) -> None:
        pass


class PlainCallable:
    """An object whose ``__call__`` is a plain method."""

    def __call__(self, record: Record) -> None:
        pass


ASYNC_HANDLERS = [async_handler, AsyncCallable(), functools.partial(async_handler)]
PLAIN_HANDLERS = [plain_handler, PlainCallable(), functools.partial(plain_handler), print]
IDS = ["function", "callable object", "partial"]


@pytest.mark.parametrize("handler", ASYNC_HANDLERS, ids=IDS)
def test_worker_refuses_async_handlers_naming_asyncworker(
    handler: Any, worker_group: Callable[..., felix_redis.Client],
) -> None:
    """The sync worker would call it, get a coroutine it never awaits, and ack the record."""
    c = worker_group()
    with pytest.raises(TypeError, match=r"async def.*felix_redis\.aioworker\.AsyncWorker"):
        Worker(c, T, N, S, G, handler, handle_signals=False)


@pytest.mark.parametrize("handler", PLAIN_HANDLERS, ids=[*IDS, "builtin"])
def test_worker_takes_plain_handlers(handler: Any, worker_group: Callable[..., felix_redis.Client]) -> None:
    c = worker_group()
    assert Worker(c, T, N, S, G, handler, handle_signals=False).handler is handler


@pytest.mark.parametrize("handler", PLAIN_HANDLERS, ids=[*IDS, "builtin"])
def test_async_worker_refuses_plain_handlers_naming_worker(
    handler: Any, aclient: Callable[[], aio.AsyncClient],
) -> None:
    """The async worker would await what a plain function returns (None: a TypeError
    after the handler ran, on every record)."""

    async def main() -> None:
        async with aclient() as client:
            with pytest.raises(TypeError, match=r"not an async def.*felix_redis\.worker\.Worker\b"):
                AsyncWorker(client, T, N, S, G, handler, handle_signals=False)
            with pytest.raises(felix_redis.InvalidArgument, match="callable"):
                AsyncWorker(client, T, N, S, G, "not a function", handle_signals=False)

    asyncio.run(main())


@pytest.mark.parametrize("handler", ASYNC_HANDLERS, ids=IDS)
def test_async_worker_takes_async_handlers(handler: Any, aclient: Callable[[], aio.AsyncClient]) -> None:
    async def main() -> None:
        async with aclient() as client:
            assert AsyncWorker(client, T, N, S, G, handler, handle_signals=False).handler is handler

    asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_an_accepted_callable_object_handler_runs_and_acks(
    kind: str, worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient],
) -> None:
    """The callable objects each worker takes are awaited (async) or called (sync): the
    record is handled once and acked."""
    c = worker_group()
    c.publish(T, N, S, "x")
    seen: list[bytes] = []

    class Sync:
        def __call__(self, record: Record) -> None:
            seen.append(record.payload)

    class Async:
        async def __call__(self, record: Record) -> None:
            await asyncio.sleep(0)
            seen.append(record.payload)

    w = run_worker(kind, c, aclient, Sync() if kind == "sync" else Async(), lambda group: None,
                   until=lambda w: w.stats.processed >= 1, timeout=10)
    assert seen == [b"x"] and (w.stats.processed, w.stats.failed) == (1, 0)
    assert c.group_describe(T, N, S, G).lag == 0
