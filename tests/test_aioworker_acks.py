"""The asyncio worker's acks: a finished job's ack rides on the next poll
(``poll(..., ack=...)``); the settle task acks those no poll took within
``felix_redis.worker.ACK_LINGER_S``, and everything at once on stop; a failed poll's
acks are sent again on their own."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest

import felix_redis
import felix_redis.asyncio as aio
import felix_redis.worker as worker_module
from felix_redis import Record
from felix_redis.aioworker import AsyncWorker
from felix_redis.errors import FelixError

T, N, S, G = "acme", "prod", "jobs", "workers"


async def noop(record: Record) -> None:
    """A handler that does nothing."""




class Spy:
    """Counts what the worker's sharded group sends: acks carried by polls, separate acks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_polls_with_acks: int = 0) -> None:
        self.poll_acks: list[int] = []  # records each poll carried, in order
        self.separate_acks: list[int] = []  # records each ack_many call carried
        self.fail_left = fail_polls_with_acks
        poll, ack_many = aio.AsyncShardedGroup.poll, aio.AsyncShardedGroup.ack_many
        spy = self

        async def spy_poll(
            self: aio.AsyncShardedGroup, max_records: int = 16, wait: float | None = None, *,
            ack: Iterable[Any] | None = None,
        ) -> list[Any]:
            acks = list(ack or [])
            if acks and spy.fail_left > 0:
                spy.fail_left -= 1
                raise FelixError("injected poll failure")  # before anything was sent
            spy.poll_acks.append(len(acks))
            return await poll(self, max_records, wait, ack=acks)

        async def spy_ack_many(self: aio.AsyncShardedGroup, items: Iterable[Any]) -> int:
            items = list(items)
            spy.separate_acks.append(len(items))
            return await ack_many(self, items)

        monkeypatch.setattr(aio.AsyncShardedGroup, "poll", spy_poll)
        monkeypatch.setattr(aio.AsyncShardedGroup, "ack_many", spy_ack_many)


async def wait_until(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not check():
        await asyncio.sleep(0.01)
    return check()


def test_async_acks_ride_on_the_next_poll(
    worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the settle task told to wait a minute, only polls can ack: the worker still
    drains the stream while it runs, so every finished job's ack went with a poll."""
    monkeypatch.setattr(worker_module, "ACK_LINGER_S", 60.0)
    spy = Spy(monkeypatch)
    c = worker_group(shards=2)
    for i in range(40):
        c.publish(T, N, S, str(i))
    seen: list[int] = []

    async def handler(record: Record) -> None:
        await asyncio.sleep(0)
        seen.append(int(record.payload))

    async def main() -> tuple[AsyncWorker, float]:
        async with aclient() as client:
            w = AsyncWorker(client, T, N, S, G, handler, concurrency=4, poll_wait_s=0.2, handle_signals=False)
            task = asyncio.create_task(w.run())
            await wait_until(lambda: w.stats.processed >= 36 and len(seen) == 40, 10)
            # all handled; at most one poll's worth (the slots) may still wait for the next poll
            assert sorted(seen) == list(range(40))
            assert w.stats.processed >= 36
            info = c.group_describe(T, N, S, G)
            assert sum(s.position for s in info.shards) >= 36
            assert spy.separate_acks == []  # no ack went on its own while the loop polled
            assert sum(spy.poll_acks) >= w.stats.processed  # a poll in flight may carry more
            assert max(spy.poll_acks) > 1  # several finished jobs share one poll
            w.stop()
            started = time.monotonic()
            await asyncio.wait_for(task, 5)
            return w, time.monotonic() - started

    w, stopping_took = asyncio.run(main())
    # the stop acks the rest at once, without waiting out the linger
    assert stopping_took < 2
    assert (w.stats.processed, w.stats.in_flight) == (40, 0)
    assert sum(spy.poll_acks) + sum(spy.separate_acks) == 40
    assert c.group_describe(T, N, S, G).lag == 0


def test_async_a_finished_job_is_acked_while_the_loop_long_polls(
    worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No next poll comes for a while (the loop waits in a 5 s long poll): the settle
    task acks the finished job after the linger, and frees its slot."""
    monkeypatch.setattr(worker_module, "ACK_LINGER_S", 0.05)
    spy = Spy(monkeypatch)
    c = worker_group()
    c.publish(T, N, S, "x")

    async def main() -> AsyncWorker:
        async with aclient() as client:
            w = AsyncWorker(client, T, N, S, G, noop, concurrency=2, poll_wait_s=5, handle_signals=False)
            task = asyncio.create_task(w.run())
            assert await wait_until(lambda: w.stats.processed >= 1, 3)
            assert w.stats.processed == 1 and w.stats.in_flight == 0
            info = c.group_describe(T, N, S, G).shards[0]
            assert (info.position, info.in_flight) == (1, 0)
            assert spy.separate_acks == [1]  # the settle task's, not a poll's
            w.stop()
            await asyncio.wait_for(task, 7)
            return w

    w = asyncio.run(main())
    assert (w.stats.processed, w.stats.in_flight) == (1, 0)


def test_async_a_failed_poll_acks_its_finished_jobs_on_their_own(
    worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A poll that carried acks raised: those acks may not have been applied, so the
    worker acks the jobs again in a call of their own (the linger is a minute here)."""
    monkeypatch.setattr(worker_module, "ACK_LINGER_S", 60.0)
    spy = Spy(monkeypatch, fail_polls_with_acks=1)
    c = worker_group()
    c.publish(T, N, S, "a")
    c.publish(T, N, S, "b")

    async def main() -> AsyncWorker:
        async with aclient() as client:
            w = AsyncWorker(client, T, N, S, G, noop, concurrency=1, poll_wait_s=0.2, handle_signals=False)
            task = asyncio.create_task(w.run())
            assert await wait_until(lambda: w.stats.processed >= 2, 5)
            assert spy.separate_acks == [1]  # the failed poll's ack, sent again
            assert spy.poll_acks.count(1) == 1  # the second job's ack rode on a poll
            assert c.group_describe(T, N, S, G).shards[0].position == 2
            w.stop()
            await asyncio.wait_for(task, 5)
            return w

    with caplog.at_level(logging.ERROR, logger="felix_redis.worker"):
        w = asyncio.run(main())
    assert "poll failed" in caplog.text and "injected poll failure" in caplog.text
    assert (w.stats.processed, w.stats.stale, w.stats.in_flight) == (2, 0, 0)
    assert c.group_describe(T, N, S, G).lag == 0


def test_async_burst_acks_with_polls_and_stops_without_waiting_out_the_linger(
    worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_module, "ACK_LINGER_S", 60.0)
    spy = Spy(monkeypatch)
    c = worker_group(shards=3)
    for i in range(30):
        c.publish(T, N, S, str(i))

    async def handler(record: Record) -> None:
        await asyncio.sleep(0.002)

    async def main() -> AsyncWorker:
        async with aclient() as client:
            w = AsyncWorker(client, T, N, S, G, handler, concurrency=4, burst=True, poll_wait_s=5,
                            handle_signals=False)
            await asyncio.wait_for(w.run(), 4)
            return w

    started = time.monotonic()
    w = asyncio.run(main())
    assert time.monotonic() - started < 4
    assert (w.stats.processed, w.stats.in_flight) == (30, 0)
    assert spy.separate_acks == [] and sum(spy.poll_acks) == 30
    assert c.group_describe(T, N, S, G).lag == 0


def test_async_cancelled_run_still_acks_the_finished_jobs(
    worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run task is cancelled while its poll carries acks: the shutdown acks those
    jobs again (acks are idempotent) instead of leaving their leases to lapse."""
    monkeypatch.setattr(worker_module, "ACK_LINGER_S", 60.0)
    c = worker_group()
    c.publish(T, N, S, "x")
    carried = asyncio.Event()
    poll = aio.AsyncShardedGroup.poll

    async def slow_poll(
        self: aio.AsyncShardedGroup, max_records: int = 16, wait: float | None = None, *,
        ack: Iterable[Any] | None = None,
    ) -> list[Any]:
        acks = list(ack or [])
        if acks:
            carried.set()
            await asyncio.sleep(30)  # cancelled here, before anything was sent
        return await poll(self, max_records, wait, ack=acks)

    monkeypatch.setattr(aio.AsyncShardedGroup, "poll", slow_poll)

    async def main() -> AsyncWorker:
        async with aclient() as client:
            w = AsyncWorker(client, T, N, S, G, noop, concurrency=1, poll_wait_s=0.2, handle_signals=False)
            task = asyncio.create_task(w.run())
            await asyncio.wait_for(carried.wait(), 3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 5)
            return w

    w = asyncio.run(main())
    assert (w.stats.processed, w.stats.in_flight) == (1, 0)
    info = c.group_describe(T, N, S, G).shards[0]
    assert (info.position, info.in_flight) == (1, 0)


def test_async_a_job_finishing_during_the_grace_period_is_acked_at_once(
    worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a stop no poll comes: a handler that finishes within the grace period is
    acked at once, not after the linger (a minute here)."""
    monkeypatch.setattr(worker_module, "ACK_LINGER_S", 60.0)
    c = worker_group()
    c.publish(T, N, S, "x")
    started, release = asyncio.Event(), asyncio.Event()

    async def handler(record: Record) -> None:
        started.set()
        await release.wait()

    async def main() -> tuple[AsyncWorker, float]:
        async with aclient() as client:
            w = AsyncWorker(client, T, N, S, G, handler, concurrency=2, poll_wait_s=0.2, grace_s=10,
                            handle_signals=False)
            task = asyncio.create_task(w.run())
            await asyncio.wait_for(started.wait(), 3)
            w.stop()
            await asyncio.sleep(0.3)  # the loop has left; the worker waits for the handler
            assert not task.done()
            stopped = time.monotonic()
            release.set()
            await asyncio.wait_for(task, 15)
            return w, time.monotonic() - stopped

    w, took = asyncio.run(main())
    assert took < 2
    assert (w.stats.processed, w.stats.handed_back, w.stats.in_flight) == (1, 0, 0)
    info = c.group_describe(T, N, S, G).shards[0]
    assert (info.position, info.in_flight) == (1, 0)
