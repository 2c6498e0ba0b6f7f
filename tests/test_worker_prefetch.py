"""The Worker and AsyncWorker with ``prefetch``: a poll fetches that many records in one
round trip and runs them as slots free up; the finished jobs' acks go from the settle
thread (or task) while the loop hands out what was fetched; at shutdown what was
fetched and never run is released at once."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import click
import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

import felix_redis
import felix_redis.asyncio as aio
from felix_redis import InvalidArgument, Record
from felix_redis._driver import ShardedGroupBase
from felix_redis.aioworker import AsyncWorker
from felix_redis.metrics import WorkerMetrics
from felix_redis.worker import Worker
from felixctl.common import Ctl
from felixctl.worker_cmd import worker as worker_cmd
from tests.test_queued_acks import on_round_trips
from tests.test_worker import running

T, N, S, G = "acme", "prod", "jobs", "workers"


def unfinished(client: felix_redis.Client) -> int:
    return sum(s.unfinished for s in client.group_describe(T, N, S, G).shards)


@pytest.mark.parametrize("prefetch", [0, 64])
def test_a_prefetching_worker_runs_every_record_once_in_fewer_polls(
    worker_group: Callable[..., felix_redis.Client], monkeypatch: pytest.MonkeyPatch, prefetch: int
) -> None:
    c = worker_group(shards=4)
    for shard in range(4):
        c.publish_batch(T, N, S, [f"{shard}-{i}" for i in range(100)], shard=shard)
    polls: list[list[str]] = []
    on_round_trips(c, monkeypatch, lambda calls: polls.append(calls) if "group_poll" in calls else None)
    queued: list[Any] = []
    real_queue = ShardedGroupBase._queue_ack
    monkeypatch.setattr(ShardedGroupBase, "_queue_ack",
                        lambda self, item: queued.append(item) or real_queue(self, item))
    seen: list[bytes] = []
    lock = threading.Lock()

    def handler(record: Record) -> None:
        with lock:
            seen.append(record.payload)

    w = Worker(c, T, N, S, G, handler, concurrency=4, burst=True, prefetch=prefetch, handle_signals=False)
    w.run()
    assert sorted(seen) == sorted(f"{s}-{i}".encode() for s in range(4) for i in range(100))
    assert (w.stats.processed, w.stats.failed, w.stats.in_flight) == (400, 0, 0)
    # a job is reported acked once its ack returned: never queued on the group to go later
    assert queued == []
    assert unfinished(c) == 0
    if prefetch:
        assert len(polls) <= 30, len(polls)  # 400 / 64 fetches, and the shards' ends
    else:
        assert len(polls) >= 100, len(polls)  # 4 free slots a poll


def stopped_with_eight_fetched(c: felix_redis.Client, metrics: WorkerMetrics | None = None) -> Worker:
    """A worker of one slot and a prefetch of 8, stopped while its first job runs: one
    record handed back, the other seven fetched ahead and released."""
    c.publish_batch(T, N, S, [f"r{i}" for i in range(8)])
    started, release = threading.Event(), threading.Event()

    def handler(record: Record) -> None:
        started.set()
        release.wait(10)

    w = Worker(c, T, N, S, G, handler, concurrency=1, prefetch=8, grace_s=0.2, poll_wait_s=0.1,
               handle_signals=False, metrics=metrics)
    with running(w, release) as thread:
        assert started.wait(5)
        w.stop()
        thread.join(5)
        assert not thread.is_alive()
    return w


def test_stop_releases_what_the_worker_fetched_and_never_ran(
    worker_group: Callable[..., felix_redis.Client],
) -> None:
    c = worker_group()  # leases of 30 s: only a release makes them due now
    w = stopped_with_eight_fetched(c)
    assert (w.stats.processed, w.stats.handed_back) == (0, 1)
    again = c.group_poll(T, N, S, 0, G, max_records=16)
    # the one that ran was handed back, the seven fetched ahead released: all due now
    assert sorted(r.payload for r in again) == [f"r{i}".encode() for i in range(8)]
    # the one that ran counts its delivery; the released ones' are not counted
    assert {r.payload: r.attempts for r in again} == {b"r0": 2, **{f"r{i}".encode(): 1 for i in range(1, 8)}}


def test_async_worker_prefetches_and_releases_at_stop(
    worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient]
) -> None:
    c = worker_group(shards=2)
    c.publish_batch(T, N, S, [f"r{i}" for i in range(40)])
    seen: list[bytes] = []

    async def main() -> AsyncWorker:
        async with aclient() as client:
            hold = asyncio.Event()

            async def handler(record: Record) -> None:
                seen.append(record.payload)
                if len(seen) >= 20:
                    await hold.wait()  # the rest of the batch stays fetched ahead

            w = AsyncWorker(client, T, N, S, G, handler, concurrency=2, prefetch=16, grace_s=0.1,
                            poll_wait_s=0.1, handle_signals=False)
            task = asyncio.create_task(w.run())
            for _ in range(200):
                if len(seen) >= 21:
                    break
                await asyncio.sleep(0.02)
            w.stop()
            await asyncio.wait_for(task, 10)
            # released by the stop itself, before the client closes
            again.extend(c.group_sharded(T, N, S, G).poll(40))
            return w

    again: list[Any] = []
    w = asyncio.run(main())
    assert w.stats.processed == 19 and w.stats.handed_back == 2
    # everything not acked is due now: the two handed back and the fetched ahead released
    assert sorted(r.payload for r in again) == sorted({f"r{i}".encode() for i in range(40)} - set(seen[:19]))
    assert unfinished(c) == 40 - 19


@pytest.mark.parametrize("bad", [True, -1, 2.5, "8", 10_001])
def test_a_bad_prefetch_is_refused(worker_group: Callable[..., felix_redis.Client], bad: Any) -> None:
    c = worker_group()
    with pytest.raises(InvalidArgument, match="prefetch"):
        Worker(c, T, N, S, G, lambda r: None, prefetch=bad, handle_signals=False)


def test_cli_worker_prefetch(
    worker_group: Callable[..., felix_redis.Client], redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = worker_group()
    c.publish_batch(T, N, S, ["{}"] * 20)
    monkeypatch.setenv("WORKER_JOBS_URL", redis_url)
    made: list[int] = []
    real = felix_redis.Client.group_sharded

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        made.append(kwargs.get("prefetch", 0))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(felix_redis.Client, "group_sharded", spy)

    @click.group()
    @click.pass_context
    def main(ctx: click.Context) -> None:
        ctx.obj = Ctl(redis_url, T, N)

    main.add_command(worker_cmd)
    result = CliRunner().invoke(main, ["worker", S, G, "tests.support.worker_jobs:handle", "--burst",
                                       "--prefetch", "8"])
    assert result.exit_code == 0, result.output
    assert made == [8]
    assert c.group_describe(T, N, S, G).lag == 0
    result = CliRunner().invoke(main, ["worker", S, G, "tests.support.worker_jobs:handle", "--prefetch", "-1"])
    assert result.exit_code == 2


def test_a_shard_subset_prefetches_too(
    worker_group: Callable[..., felix_redis.Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = worker_group(shards=4)
    for shard in range(4):
        c.publish_batch(T, N, S, [f"{shard}-{i}" for i in range(50)], shard=shard)
    polls: list[list[str]] = []
    on_round_trips(c, monkeypatch, lambda calls: polls.append(calls) if "group_poll" in calls else None)
    seen: list[bytes] = []
    w = Worker(c, T, N, S, G, lambda r: seen.append(r.payload), concurrency=2, shards=[1, 3], burst=True,
               prefetch=32, handle_signals=False)
    w.run()
    assert sorted(seen) == sorted(f"{s}-{i}".encode() for s in (1, 3) for i in range(50))
    assert len(polls) <= 15, len(polls)  # 100 / 32 fetches and the shards' ends, not 100 / 2 polls


def test_the_heartbeat_counts_a_lease_from_the_fetch(
    worker_group: Callable[..., felix_redis.Client],
) -> None:
    """B waits 1 s of its 1.5 s lease fetched ahead while A runs, then runs 1.5 s itself:
    the heartbeat (every 0.5 s) must extend it from its fetch, not from its start, or
    it lapses while it runs and another consumer gets it."""
    c = worker_group(vt_ms=1_500)
    c.publish_batch(T, N, S, ["A", "B"])
    first, done = threading.Event(), threading.Event()

    def handler(record: Record) -> None:
        first.set()
        time.sleep(1.0 if record.payload == b"A" else 1.5)
        if record.payload == b"B":
            done.set()

    w = Worker(c, T, N, S, G, handler, concurrency=1, prefetch=2, poll_wait_s=0.1, handle_signals=False)
    taken = []
    with running(w, done):
        assert first.wait(5)  # A runs, B waits fetched ahead: another consumer polls from now on
        deadline = time.monotonic() + 5
        while not done.is_set() and time.monotonic() < deadline:
            taken += c.group_poll(T, N, S, 0, G, max_records=2)
            time.sleep(0.05)
    assert done.is_set()
    assert taken == []  # no lease lapsed: nothing was delivered elsewhere
    assert w.stats.processed == 2


def test_a_record_released_on_its_last_attempt_is_not_a_dead_letter(
    worker_group: Callable[..., felix_redis.Client],
) -> None:
    c = worker_group(max_attempts=1)
    registry = CollectorRegistry()
    w = stopped_with_eight_fetched(c, WorkerMetrics(registry))
    # fetched on their only allowed attempt and released: their delivery is not
    # counted, so none is a dead letter; the one handed back (it ran) is
    assert w.stats.dead_lettered == 1
    labels = {"tenant": T, "namespace": N, "stream": S, "group": G}
    assert registry.get_sample_value("felix_worker_jobs_dead_lettered_total", labels) == 1
    assert c.group_describe(T, N, S, G).dead == 1
    again = c.group_poll(T, N, S, 0, G, max_records=16)
    assert sorted(r.payload for r in again) == [f"r{i}".encode() for i in range(1, 8)]
    assert {r.attempts for r in again} == {1}


def test_a_record_that_waited_most_of_its_lease_fetched_ahead_is_released_not_run(
    worker_group: Callable[..., felix_redis.Client],
) -> None:
    """A prefetch too large for the lease (12 records of 0.25 s a slot, leases of 2 s):
    the records that waited in the buffer until little of their lease was left are
    released (due at once, not counted), not run, so no record runs in this worker and
    in another consumer at once; every record runs once."""
    c = worker_group(vt_ms=2_000)
    c.publish_batch(T, N, S, [f"r{i}" for i in range(12)])
    ran: list[bytes] = []
    taken: list[bytes] = []
    done = threading.Event()

    def handler(record: Record) -> None:
        ran.append(record.payload)
        time.sleep(0.25)
        if len(ran) + len(taken) >= 12:
            done.set()

    w = Worker(c, T, N, S, G, handler, concurrency=1, prefetch=12, poll_wait_s=0.1, grace_s=1,
               handle_signals=False)
    with running(w, done) as thread:
        deadline = time.monotonic() + 10
        while not done.is_set() and time.monotonic() < deadline:
            for record in c.group_poll(T, N, S, 0, G, max_records=1):  # another consumer
                taken.append(record.payload)
                c.group_ack(T, N, S, 0, G, record)
            if len(ran) + len(taken) >= 12:
                done.set()
            time.sleep(0.05)
        w.stop()
        thread.join(5)
    assert set(ran).isdisjoint(taken), (ran, taken)
    assert sorted(ran + taken) == sorted(f"r{i}".encode() for i in range(12))
    assert len(taken) > 0  # the late ones were released, and another consumer took some


def test_the_async_worker_releases_a_record_that_waited_most_of_its_lease(
    worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same in the AsyncWorker, by its heartbeat: handlers of 0.75 s, leases of 2 s,
    so the loop's next look at the buffer (at 2.25 s) would come after the leases lapsed;
    the heartbeat releases the late records before (and they run once, after a fetch of
    their own, with their first delivery's count)."""
    c = worker_group(vt_ms=2_000)
    c.publish_batch(T, N, S, [f"r{i}" for i in range(6)])
    ran: list[tuple[bytes, int]] = []

    async def handler(record: Record) -> None:
        ran.append((record.payload, record.attempts))
        await asyncio.sleep(0.75)

    async def main() -> None:
        async with aclient() as client:
            w = AsyncWorker(client, T, N, S, G, handler, concurrency=1, prefetch=6, poll_wait_s=0.1,
                            handle_signals=False)
            task = asyncio.create_task(w.run())
            deadline = time.monotonic() + 15
            while w.stats.processed < 6 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            w.stop()
            await asyncio.wait_for(task, 5)

    with caplog.at_level("WARNING", logger="felix_redis"):
        asyncio.run(main())
    assert sorted(ran) == [(f"r{i}".encode(), 1) for i in range(6)]  # once each, no delivery counted twice
    assert "released, not run" in caplog.text


def test_records_fetched_ahead_are_released_by_the_loop_when_the_heartbeat_is_held_up(
    worker_group: Callable[..., felix_redis.Client], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The heartbeat held up (one extend that takes 3 s): the loop itself does not
    hand out a record that waited in the buffer for most of its lease; it releases
    them, so no record runs here and in another consumer at once."""
    c = worker_group(vt_ms=2_000)
    c.publish_batch(T, N, S, [f"r{i}" for i in range(20)])
    ran: list[bytes] = []
    taken: list[bytes] = []

    def handler(record: Record) -> None:
        ran.append(record.payload)
        time.sleep(0.15)

    w = Worker(c, T, N, S, G, handler, concurrency=1, prefetch=20, poll_wait_s=0.1, grace_s=1,
               handle_signals=False)
    extend = w._group.extend
    stalls = [3.0]

    def slow_extend(item: Any, by: float | None = None) -> int:
        if stalls:
            time.sleep(stalls.pop())
        return extend(item, by)

    monkeypatch.setattr(w._group, "extend", slow_extend)
    with running(w):
        deadline = time.monotonic() + 10
        while len(set(ran + taken)) < 20 and time.monotonic() < deadline:
            for record in c.group_poll(T, N, S, 0, G, max_records=1):  # another consumer
                taken.append(record.payload)
                c.group_ack(T, N, S, 0, G, record)
            time.sleep(0.05)
    assert set(ran).isdisjoint(taken), (ran, taken)
    assert sorted(set(ran + taken)) == sorted(f"r{i}".encode() for i in range(20))
