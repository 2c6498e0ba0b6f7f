"""The worker runtime in-process: backoff and decisions, the sync and asyncio workers,
leases, hard limits, shutdown, shard subsets, logging and the CLI wiring."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import click
import pytest
from click.testing import CliRunner

import felix_redis
import felix_redis.asyncio as aio
from felix_redis import Record
from felix_redis.aioworker import AsyncWorker
from felix_redis.worker import Backoff, Fatal, Retry, Worker, decide, import_handler, parse_shards
from felixctl.common import Ctl
from felixctl.worker_cmd import metrics as metrics_cmd
from felixctl.worker_cmd import worker as worker_cmd

T, N, S, G = "acme", "prod", "jobs", "workers"


# -- pure pieces


def test_backoff_grows_exponentially_up_to_the_cap() -> None:
    b = Backoff(base_s=0.5, factor=3, max_s=10, jitter=0)
    assert [b.delay(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.5, 4.5, 10, 10]
    assert b.delay(10_000) == 10


def test_backoff_jitter_only_shortens_within_its_fraction() -> None:
    b = Backoff(base_s=2, factor=2, max_s=100, jitter=0.25)
    rng = random.Random(7)
    delays = [b.delay(3, rng) for _ in range(500)]
    assert all(6 <= d <= 8 for d in delays)
    assert max(delays) - min(delays) > 1.5


@pytest.mark.parametrize("bad", [dict(base_s=-1), dict(factor=0.5), dict(jitter=1.5), dict(max_s=-2)])
def test_backoff_refuses_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**bad)


def test_decide() -> None:
    b = Backoff(base_s=1, factor=2, max_s=60, jitter=0)
    assert decide(Fatal("bad card"), 1, 5, b) == decide(Fatal("bad card"), 4, 5, b)
    assert decide(Fatal("bad card"), 1, 5, b).reason == "bad card"
    assert decide(Fatal("bad card"), 1, 5, b).dead
    assert decide(KeyError("k"), 1, 5, b, (KeyError,)).dead
    retry = decide(ValueError("x"), 3, 5, b)
    assert (retry.dead, retry.delay_s, retry.reason) == (False, 4.0, "ValueError: x")
    assert decide(Retry(after=0.25), 1, 5, b).delay_s == 0.25
    assert decide(Retry(), 2, 5, b).delay_s == 2.0
    last = decide(Retry(after=1), 5, 5, b)
    assert last.dead and last.reason.startswith("failed 5 of 5 attempts: Retry")
    assert len(decide(ValueError("é" * 5000), 5, 5, b).reason.encode()) <= 4096


def test_parse_shards() -> None:
    assert parse_shards("0,2,5-7, 2") == [0, 2, 5, 6, 7]
    for bad in ("", "a", "1-", "-1", "1-x"):
        with pytest.raises(ValueError):
            parse_shards(bad)


def test_import_handler() -> None:
    assert import_handler("tests.support.worker_jobs:handle").__name__ == "handle"
    assert import_handler("tests.support.worker_jobs.ahandle").__name__ == "ahandle"
    with pytest.raises(ValueError):
        import_handler("nodots")
    with pytest.raises(ImportError):
        import_handler("no_such_module_here:f")
    with pytest.raises(AttributeError):
        import_handler("tests.support.worker_jobs:missing")


# -- the sync worker


@contextlib.contextmanager
def running(worker: Worker, *release: threading.Event, join_s: float = 10.0) -> Iterator[threading.Thread]:
    """Runs ``worker`` in a thread for the block. However the block ends, the events in
    ``release`` are set (handlers waiting on them return), the worker is stopped and its
    thread joined: a failing test leaves no worker running (and the run does not hang)."""
    thread = threading.Thread(target=worker.run, name="test-worker", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        for event in release:
            event.set()
        worker.stop()
        thread.join(join_s)
    assert not thread.is_alive(), f"the worker did not stop within {join_s}s"


def test_burst_worker_handles_every_record_of_every_shard(worker_group: Callable[..., felix_redis.Client]) -> None:
    c = worker_group(shards=3)
    for i in range(60):
        c.publish(T, N, S, str(i))
    seen: list[int] = []
    lock = threading.Lock()
    peak = [0, 0]

    def handler(record: Record) -> None:
        with lock:
            peak[0] += 1
            peak[1] = max(peak)
        time.sleep(0.005)
        with lock:
            seen.append(int(record.payload))
            peak[0] -= 1

    w = Worker(c, T, N, S, G, handler, concurrency=4, burst=True, handle_signals=False)
    w.run()
    assert sorted(seen) == list(range(60))
    assert 1 < peak[1] <= 4
    assert (w.stats.processed, w.stats.failed, w.stats.in_flight) == (60, 0, 0)
    assert c.group_describe(T, N, S, G).lag == 0


def test_outcomes_are_logged_one_line_each(
    worker_group: Callable[..., felix_redis.Client], caplog: pytest.LogCaptureFixture
) -> None:
    c = worker_group(max_attempts=2)
    c.publish(T, N, S, "ok")
    c.publish(T, N, S, "poison")

    def handler(record: Record) -> None:
        if record.payload == b"poison":
            raise Fatal("cannot parse")

    caplog.set_level(logging.DEBUG, logger="felix_redis.worker")
    Worker(c, T, N, S, G, handler, burst=True, handle_signals=False).run()
    lines = [r for r in caplog.records if r.getMessage().startswith("job ")]
    assert [r.levelno for r in lines] == [logging.DEBUG, logging.WARNING]
    ok, dead = (r.getMessage() for r in lines)
    assert "stream=acme/prod/jobs shard=0 offset=0 attempts=1 outcome=acked duration_ms=" in ok
    assert "offset=1 attempts=1 outcome=dead" in dead and "error='cannot parse'" in dead
    assert lines[1].felix_job["outcome"] == "dead"  # type: ignore[attr-defined]
    assert any("worker stopped" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def test_leases_are_extended_while_the_handler_runs(worker_group: Callable[..., felix_redis.Client]) -> None:
    """A handler runs for 3 visibility timeouts; the heartbeat (every third of it) keeps
    extending its lease, so no other poll gets the record meanwhile. The lease is 1 s so
    that a heartbeat late by most of a second on a loaded machine still lands in time."""
    vt_s = 1.0
    c = worker_group(vt_ms=int(vt_s * 1000))
    c.publish(T, N, S, "slow")
    attempts: list[int] = []
    started, release = threading.Event(), threading.Event()

    def handler(record: Record) -> None:
        attempts.append(record.attempts)
        started.set()
        release.wait(10)

    w = Worker(c, T, N, S, G, handler, poll_wait_s=0.1, handle_signals=False)
    with running(w, release):
        assert started.wait(5)
        deadline = time.monotonic() + 3 * vt_s
        while time.monotonic() < deadline:
            assert c.group_poll(T, N, S, 0, G) == [], "another poll got the record while it ran"
            time.sleep(0.05)
        release.set()
        deadline = time.monotonic() + 5
        while w.stats.processed == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert attempts == [1] and w.stats.processed == 1


def test_a_handler_past_the_hard_limit_loses_its_lease(worker_group: Callable[..., felix_redis.Client]) -> None:
    c = worker_group(vt_ms=300)
    c.publish(T, N, S, "stuck")
    started, release = threading.Event(), threading.Event()

    def handler(record: Record) -> None:
        started.set()
        release.wait(5)

    w = Worker(c, T, N, S, G, handler, hard_limit_s=0.2, poll_wait_s=0.1, grace_s=0.2, handle_signals=False)
    with running(w, release):
        assert started.wait(3)
        records = c.group_poll(T, N, S, 0, G, wait=3)
        assert [r.attempts for r in records] == [2]


def test_stop_lets_handlers_finish_within_grace_and_hands_back_the_rest(
    worker_group: Callable[..., felix_redis.Client],
) -> None:
    c = worker_group()
    c.publish(T, N, S, "quick")
    c.publish(T, N, S, "slow")
    started = threading.Barrier(3)
    release = threading.Event()

    def handler(record: Record) -> None:
        started.wait(5)
        if record.payload == b"quick":
            time.sleep(0.1)
        else:
            release.wait(10)

    w = Worker(c, T, N, S, G, handler, concurrency=2, grace_s=0.5, poll_wait_s=0.1, handle_signals=False)
    with running(w, release) as thread:
        started.wait(5)
        w.stop()
        thread.join(5)
        release.set()
        assert not thread.is_alive()
    assert (w.stats.processed, w.stats.handed_back) == (1, 1)
    info = c.group_describe(T, N, S, G)
    assert (info.in_flight, info.owed) == (0, 1)
    assert [r.payload for r in c.group_poll(T, N, S, 0, G)] == [b"slow"]


def test_a_shard_subset_only_polls_those_shards(worker_group: Callable[..., felix_redis.Client]) -> None:
    c = worker_group(shards=3)
    for shard in range(3):
        for _ in range(4):
            c.publish(T, N, S, f"s{shard}", shard=shard)
    seen: list[int] = []
    Worker(c, T, N, S, G, lambda r: seen.append(r.shard), shards=[0, 2], burst=True, concurrency=3,
           consumer="w-1", handle_signals=False).run()
    assert sorted(seen) == [0] * 4 + [2] * 4
    info = c.group_describe(T, N, S, G)
    assert [s.lag for s in info.shards] == [0, 4, 0]
    with pytest.raises(ValueError, match="no shard"):
        Worker(c, T, N, S, G, print, shards=[5], handle_signals=False).run()


def test_a_shard_subset_long_polls(worker_group: Callable[..., felix_redis.Client]) -> None:
    c = worker_group(shards=2)
    got = threading.Event()
    w = Worker(c, T, N, S, G, lambda r: got.set(), shards=[1], poll_wait_s=5, handle_signals=False)
    with running(w):
        time.sleep(0.2)
        started = time.monotonic()
        c.publish(T, N, S, "x", shard=1)
        assert got.wait(3) and time.monotonic() - started < 1.5


def test_acks_ride_on_the_next_poll(
    worker_group: Callable[..., felix_redis.Client], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the settle thread told to wait a minute, only polls can ack: the worker still
    drains the stream while it runs, so every finished job's ack went with a poll."""
    import felix_redis.worker as worker_module

    monkeypatch.setattr(worker_module, "ACK_LINGER_S", 60.0)
    c = worker_group(shards=2)
    for i in range(40):
        c.publish(T, N, S, str(i))
    seen: list[int] = []
    w = Worker(c, T, N, S, G, lambda r: seen.append(int(r.payload)), concurrency=4, poll_wait_s=0.2,
               handle_signals=False)
    with running(w) as thread:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (w.stats.processed < 36 or len(seen) < 40):
            time.sleep(0.02)
        # all handled; at most one poll's worth (the slots) may still wait for the next poll
        assert sorted(seen) == list(range(40))
        assert w.stats.processed >= 36
        shards = c.group_describe(T, N, S, G).shards
        assert shards[0].position + shards[1].position >= 36
        w.stop()
        thread.join(5)
        # the stop acks the rest at once, without waiting out the linger
        assert not thread.is_alive()
    assert (w.stats.processed, w.stats.in_flight) == (40, 0)
    assert c.group_describe(T, N, S, G).lag == 0


def test_a_quick_handler_runs_on_the_poll_loops_thread(worker_group: Callable[..., felix_redis.Client]) -> None:
    """After QUICK_RUNS quick runs on the handler threads, the loop runs the handler
    itself, record after record (no thread hop per record); every record is still
    handled once and acked."""
    from felix_redis.worker import QUICK_RUNS

    c = worker_group(shards=2)
    total = QUICK_RUNS * 8
    c.publish_batch(T, N, S, [str(i) for i in range(total)], shard=0)
    threads: dict[int, str] = {}

    def handler(record: Record) -> None:
        threads[int(record.payload)] = threading.current_thread().name

    w = Worker(c, T, N, S, G, handler, concurrency=8, burst=True, handle_signals=False)
    runner = threading.Thread(target=w.run, name="the-loop")
    runner.start()
    runner.join(30)
    assert not runner.is_alive()
    assert sorted(threads) == list(range(total))
    names = [threads[i] for i in range(total)]
    assert all(name.startswith("felix-handler-") for name in names[:QUICK_RUNS])
    # (a run over INLINE_MAX_S, such as a pause of the machine, sends QUICK_RUNS back to the threads)
    assert names.count("the-loop") >= QUICK_RUNS
    assert (w.stats.processed, w.stats.failed, w.stats.in_flight) == (total, 0, 0)
    assert c.group_describe(T, N, S, G).lag == 0


def _unfinished(c: felix_redis.Client) -> int:
    return sum(s.unfinished for s in c.group_describe(T, N, S, G).shards)


class _InlineRun:
    """A worker (sync or asyncio, on a thread of its own) whose handler is quick, fed
    QUICK_RUNS * 2 records until it runs handlers on its poll loop; then ``batch(n,
    last)`` publishes n - 1 quick records and ``last`` (a payload) in one call, which
    its next poll takes as one batch."""

    def __init__(self, c: felix_redis.Client, url: str, mode: str, on_last: Callable[[Any], None]) -> None:
        from felix_redis.worker import QUICK_RUNS

        self.c, self.handled = c, []  # type: ignore[var-annotated]
        self.on_last = on_last
        self.loop_name = ""
        c.publish_batch(T, N, S, ["q"] * (QUICK_RUNS * 2))
        self.worker: Any = None
        self.ready = threading.Event()
        if mode == "sync":
            def handler(record: Record) -> None:
                self.handle(record)

            self.worker = Worker(c, T, N, S, G, handler, concurrency=8, grace_s=10, handle_signals=False)
            self.runner = threading.Thread(target=self.worker.run, name="the-loop")
        else:
            async def ahandler(record: Record) -> None:
                self.handled.append(threading.current_thread().name)
                if record.payload != b"q":
                    await asyncio.to_thread(self.on_last, self)  # (awaits: the event loop runs on)

            def run() -> None:
                async def main() -> None:
                    async with aio.connect(url) as client:
                        self.worker = AsyncWorker(client, T, N, S, G, ahandler, concurrency=8, grace_s=10,
                                                  handle_signals=False)
                        self.aloop = asyncio.get_running_loop()
                        self.ready.set()
                        await self.worker.run()

                asyncio.run(main())

            self.runner = threading.Thread(target=run, name="the-loop")
        self.mode = mode
        self.runner.start()
        deadline = time.monotonic() + 20
        while (len(self.handled) < QUICK_RUNS * 2 or _unfinished(c)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.handled) == QUICK_RUNS * 2 and _unfinished(c) == 0

    def handle(self, record: Record) -> None:
        self.handled.append(threading.current_thread().name)
        if record.payload != b"q":
            self.on_last(self)

    def stop(self) -> None:
        if self.mode == "sync":
            self.worker.stop()
        else:
            self.aloop.call_soon_threadsafe(self.worker.stop)

    def join(self) -> None:
        self.runner.join(15)
        assert not self.runner.is_alive()


@pytest.mark.parametrize("mode", ["sync", "asyncio"])
def test_records_run_inline_are_acked_while_a_slow_one_holds_up_the_next_poll(
    worker_group: Callable[..., felix_redis.Client], redis_url: str, mode: str
) -> None:
    """A quick handler runs on the poll loop, whose next poll carries the acks; when one
    record of the batch turns slow, the records finished before it in that batch are
    acked within the ack linger all the same (a crash then redelivers only what did not
    finish), not after the slow one."""
    c = worker_group()
    seen: list[int] = []

    def slow(run: _InlineRun) -> None:
        assert run.handled[-1] == "the-loop"  # on the poll loop (or its event loop's task)
        seen.append(_unfinished(run.c))
        deadline = time.monotonic() + 3
        while _unfinished(run.c) > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(_unfinished(run.c))

    run = _InlineRun(c, redis_url, mode, slow)
    c.publish_batch(T, N, S, ["q", "q", "q", "slow"])
    deadline = time.monotonic() + 10
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    run.stop()
    run.join()
    assert seen[1] == 1, f"while the slow record ran, Redis held {seen} unfinished (want the slow one only)"
    assert _unfinished(c) == 0


def test_stop_during_an_inline_batch_acks_what_finished_without_waiting_out_the_grace(
    worker_group: Callable[..., felix_redis.Client], redis_url: str
) -> None:
    """stop() while the poll loop runs a batch's handlers: the records it finished are
    acked at the shutdown, which does not wait out grace_s for them."""
    c = worker_group()
    stopped: list[float] = []

    def stop_now(run: _InlineRun) -> None:
        run.stop()
        stopped.append(time.monotonic())

    run = _InlineRun(c, redis_url, "sync", stop_now)
    c.publish_batch(T, N, S, ["q", "q", "q", "stop"])
    run.join()
    took = time.monotonic() - stopped[0]
    assert took < 5, f"the shutdown took {took:.1f}s (grace_s is 10)"
    assert _unfinished(c) == 0 and run.worker.stats.processed == len(run.handled)


def test_a_slow_run_sends_the_batch_back_to_the_handler_threads(
    worker_group: Callable[..., felix_redis.Client],
) -> None:
    """A handler that was quick turns slow: the first slow run on the loop's thread sends
    the rest of its batch to the handler threads, where slow runs overlap (concurrency
    holds), and the loop does not run it again until it is quick again."""
    from felix_redis.worker import QUICK_RUNS

    c = worker_group()
    c.publish_batch(T, N, S, ["quick"] * (QUICK_RUNS + 16))
    lock = threading.Lock()
    running_now = [0, 0]
    slow_on: list[str] = []
    handled = [0]

    def handler(record: Record) -> None:
        with lock:
            handled[0] += 1
        if record.payload == b"slow":
            with lock:
                running_now[0] += 1
                running_now[1] = max(running_now)
                slow_on.append(threading.current_thread().name)
            time.sleep(0.1)
            with lock:
                running_now[0] -= 1

    w = Worker(c, T, N, S, G, handler, concurrency=8, poll_wait_s=0.2, handle_signals=False)
    with running(w) as loop:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and w.stats.processed < QUICK_RUNS + 16:
            time.sleep(0.01)
        assert w.stats.processed == QUICK_RUNS + 16
        c.publish_batch(T, N, S, ["slow"] * 8)
        while time.monotonic() < deadline and w.stats.processed < QUICK_RUNS + 24:
            time.sleep(0.01)
        assert w.stats.processed == QUICK_RUNS + 24
    assert len(slow_on) == 8
    assert slow_on.count(loop.name) <= 1  # the first slow run, at most
    assert running_now[1] >= 2
    assert c.group_describe(T, N, S, G).lag == 0


def test_an_interrupt_in_a_handler_on_the_loops_thread_stops_the_worker(
    worker_group: Callable[..., felix_redis.Client],
) -> None:
    """A KeyboardInterrupt raised by the handler while the loop runs it goes up out of
    run() as it would between polls; its record is handed back (due again at once) and
    the rest of its batch is handled by the handler threads in the grace period."""
    from felix_redis.worker import QUICK_RUNS

    c = worker_group()
    total = QUICK_RUNS * 4
    c.publish_batch(T, N, S, [str(i) for i in range(total)])
    handled: list[int] = []
    interrupted: list[int] = []
    raised: list[BaseException] = []

    def handler(record: Record) -> None:
        if not interrupted and threading.current_thread().name == "the-loop":
            interrupted.append(int(record.payload))
            raise KeyboardInterrupt
        handled.append(int(record.payload))

    w = Worker(c, T, N, S, G, handler, concurrency=8, poll_wait_s=0.2, handle_signals=False)

    def run() -> None:
        try:
            w.run()
        except BaseException as exc:
            raised.append(exc)

    runner = threading.Thread(target=run, name="the-loop")
    runner.start()
    runner.join(30)
    assert not runner.is_alive()
    assert len(interrupted) == 1 and [type(e) for e in raised] == [KeyboardInterrupt]
    assert interrupted[0] not in handled
    assert w.stats.handed_back == 1 and w.stats.in_flight == 0
    info = c.group_describe(T, N, S, G).shards[0]
    assert info.in_flight == 0 and info.owed >= 1  # handed back: due again at once
    # the rest of its batch was handled (else more would have been handed back), and acked
    assert w.stats.processed == len(handled) >= interrupted[0]


def test_a_finished_job_is_acked_while_the_loop_long_polls(
    worker_group: Callable[..., felix_redis.Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No next poll comes for a while (the loop waits in a 5 s long poll): the settle
    thread acks the finished job after the linger, and frees its slot."""
    import felix_redis.worker as worker_module

    monkeypatch.setattr(worker_module, "ACK_LINGER_S", 0.05)
    c = worker_group()
    c.publish(T, N, S, "x")
    w = Worker(c, T, N, S, G, lambda r: None, concurrency=2, poll_wait_s=5, handle_signals=False)
    with running(w):
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and w.stats.processed < 1:
            time.sleep(0.01)
        assert w.stats.processed == 1 and w.stats.in_flight == 0
        info = c.group_describe(T, N, S, G).shards[0]
        assert (info.position, info.in_flight) == (1, 0)


def test_a_poll_that_blows_up_still_gets_its_acks_applied(worker_group: Callable[..., felix_redis.Client]) -> None:
    """A bug or an interrupt in the poll that was to carry acks: run() raises, and the
    shutdown still acks those jobs (nothing is left to lapse and run twice)."""
    c = worker_group()
    for i in range(3):
        c.publish(T, N, S, str(i))
    seen: list[int] = []
    w = Worker(c, T, N, S, G, lambda r: seen.append(int(r.payload)), concurrency=3, poll_wait_s=0.2,
               handle_signals=False)
    real = w._source.poll

    def poll(max_records: int, wait: float | None = None, *, ack: list[object] | None = None) -> list[object]:
        if ack:
            raise RuntimeError("boom")
        return list(real(max_records, wait, ack=ack))

    w._source.poll = poll  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="boom"):
        w.run()
    assert sorted(seen) == [0, 1, 2]
    assert (w.stats.processed, w.stats.in_flight) == (3, 0)
    info = c.group_describe(T, N, S, G).shards[0]
    assert (info.position, info.in_flight) == (3, 0)


# -- the asyncio worker


def test_async_worker_acks_retries_and_dead_letters(
    worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient]
) -> None:
    c = worker_group(max_attempts=3)
    for payload in ("ok", "retry", "fatal", "boom"):
        c.publish(T, N, S, payload)
    running = [0, 0]

    async def handler(record: Record) -> None:
        running[0] += 1
        running[1] = max(running)
        await asyncio.sleep(0.01)
        running[0] -= 1
        if record.payload == b"retry" and record.attempts == 1:
            raise Retry(after=0)
        if record.payload == b"fatal":
            raise Fatal("nope")
        if record.payload == b"boom":
            raise KeyError("k")

    async def main() -> AsyncWorker:
        async with aclient() as client:
            w = AsyncWorker(client, T, N, S, G, handler, concurrency=3, dead_letter_on=(KeyError,),
                            burst=True, handle_signals=False)
            await w.run()
            return w

    w = asyncio.run(main())
    assert (w.stats.processed, w.stats.retried, w.stats.dead_lettered) == (2, 1, 2)
    assert running[1] == 3
    dead = {d.offset: d.reason for d in c.group_dead_letters(T, N, S, 0, G)}
    assert dead == {2: "nope", 3: "KeyError: 'k'"}
    assert c.group_describe(T, N, S, G).lag == 0


def test_async_worker_cancels_past_the_hard_limit_and_hands_back_on_stop(
    worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient]
) -> None:
    c = worker_group(vt_ms=300)
    c.publish(T, N, S, "stuck")
    cancelled: list[bytes] = []

    async def handler(record: Record) -> None:
        try:
            await asyncio.sleep(0.45 if record.payload == b"long" else 30)
        except asyncio.CancelledError:
            cancelled.append(record.payload)
            raise

    async def main() -> AsyncWorker:
        async with aclient() as client:
            w = AsyncWorker(client, T, N, S, G, handler, concurrency=2, hard_limit_s=0.5, grace_s=0.1,
                            poll_wait_s=0.1, backoff=Backoff(60, jitter=0), handle_signals=False)
            task = asyncio.create_task(w.run())
            try:
                deadline = time.monotonic() + 5
                while w.stats.retried == 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert w.stats.retried == 1  # "stuck" was cancelled at 0.5 s and nacked for 60 s
                await client.publish(T, N, S, "long")
                deadline = time.monotonic() + 5
                while w.stats.in_flight == 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert w.stats.in_flight == 1
            finally:
                w.stop()
                await asyncio.wait_for(task, 5)
            return w

    w = asyncio.run(main())
    assert cancelled == [b"stuck", b"long"]
    assert w.stats.handed_back == 1
    info = c.group_describe(T, N, S, G)
    assert (info.in_flight, info.owed) == (0, 2)


def test_async_worker_awaits_a_quick_handler_on_the_loops_own_task(
    worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient]
) -> None:
    """After QUICK_RUNS quick runs as tasks of their own, the poll loop awaits the
    handler itself (no task per record); a run that turned slow sends the rest of its
    batch back to tasks, where slow runs overlap; every record is handled once, acked."""
    from felix_redis.worker import QUICK_RUNS

    c = worker_group()
    total = QUICK_RUNS * 8
    c.publish_batch(T, N, S, [str(i) for i in range(total)])
    on_loop: list[int] = []
    handled: list[int] = []
    slow = [0, 0]

    async def main() -> AsyncWorker:
        async with aclient() as client:
            loop_task: list[asyncio.Task[Any] | None] = [None]

            async def handler(record: Record) -> None:
                label = -1 if record.payload == b"slow" else int(record.payload)
                if asyncio.current_task() is loop_task[0]:
                    on_loop.append(label)
                if label < 0:
                    slow[0] += 1
                    slow[1] = max(slow)
                    await asyncio.sleep(0.1)
                    slow[0] -= 1
                handled.append(label)

            w = AsyncWorker(client, T, N, S, G, handler, concurrency=8, poll_wait_s=0.2, handle_signals=False)
            loop_task[0] = task = asyncio.create_task(w.run())
            try:
                deadline = time.monotonic() + 10
                while w.stats.processed < total and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                await client.publish_batch(T, N, S, ["slow"] * 8)
                while w.stats.processed < total + 8 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
            finally:
                w.stop()
                await asyncio.wait_for(task, 5)
            return w

    w = asyncio.run(main())
    assert sorted(h for h in handled if h >= 0) == list(range(total)) and handled.count(-1) == 8
    assert not [i for i in on_loop if 0 <= i < QUICK_RUNS]  # the first runs were tasks of their own
    assert on_loop.count(-1) <= 1  # the first slow run, at most
    assert len(on_loop) >= QUICK_RUNS  # (a run over INLINE_MAX_S sends QUICK_RUNS back to tasks)
    assert slow[1] >= 2  # the first slow run on the loop sent the rest to tasks, which overlap
    assert (w.stats.processed, w.stats.in_flight) == (total + 8, 0)
    assert c.group_describe(T, N, S, G).lag == 0


def test_async_worker_cancelled_during_a_handler_on_the_loops_task_hands_it_back(
    worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient]
) -> None:
    """run() cancelled while the loop awaits a handler itself: the cancellation goes on
    up out of run(), and that record is handed back (due again at once), not left to
    its lease."""
    from felix_redis.worker import QUICK_RUNS

    c = worker_group()
    c.publish_batch(T, N, S, ["quick"] * (QUICK_RUNS + 8))
    stuck: list[bool] = []

    async def main() -> tuple[AsyncWorker, bool]:
        async with aclient() as client:
            loop_task: list[asyncio.Task[Any] | None] = [None]

            async def handler(record: Record) -> None:
                if record.payload == b"stuck" and asyncio.current_task() is loop_task[0]:
                    stuck.append(True)
                    await asyncio.sleep(30)

            w = AsyncWorker(client, T, N, S, G, handler, concurrency=8, poll_wait_s=0.2, grace_s=0.2,
                            handle_signals=False)
            loop_task[0] = task = asyncio.create_task(w.run())
            deadline = time.monotonic() + 10
            while w.stats.processed < QUICK_RUNS + 8 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await client.publish(T, N, S, "stuck")
            while not stuck and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            task.cancel()
            try:
                await asyncio.wait_for(task, 5)
            except asyncio.CancelledError:
                return w, True
            return w, False

    w, cancelled = asyncio.run(main())
    assert stuck == [True] and cancelled
    assert w.stats.handed_back == 1 and w.stats.in_flight == 0
    info = c.group_describe(T, N, S, G)
    assert (info.in_flight, info.owed) == (0, 1)


def test_async_worker_cancelled_again_during_its_shutdown_leaves_nothing_running(
    worker_group: Callable[..., felix_redis.Client], aclient: Callable[[], aio.AsyncClient]
) -> None:
    """A second cancellation while the shutdown waits out ``grace_s`` (what anyio's and
    TaskGroup's cancel scopes do: they cancel again at each await) ends run() at once,
    and nothing of the worker goes on: the heartbeat no longer extends the lease of the
    job it gave up (the record is due again once the lease lapses, at-least-once), the
    handler's task is cancelled, the settle task ends."""
    from prometheus_client import CollectorRegistry

    from felix_redis.metrics import WorkerMetrics

    c = worker_group(vt_ms=400)
    c.publish(T, N, S, "slow")
    cancelled: list[bytes] = []
    registry = CollectorRegistry()

    async def handler(record: Record) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(record.payload)
            raise

    async def main() -> tuple[AsyncWorker, list[asyncio.Task[Any]], list[int]]:
        async with aclient() as client:
            w = AsyncWorker(client, T, N, S, G, handler, concurrency=1, poll_wait_s=0.1, grace_s=10,
                            handle_signals=False, metrics=WorkerMetrics(registry))
            task = asyncio.create_task(w.run())
            deadline = time.monotonic() + 5
            while w.stats.in_flight == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert w.stats.in_flight == 1
            task.cancel()  # the shutdown now waits up to grace_s for the handler
            await asyncio.sleep(0.2)
            assert not task.done()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 2)
            helpers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            await asyncio.sleep(0.05)  # the cancelled tasks run their last step
            left = [t for t in helpers if not t.done()]
            # the lease is no longer extended: another consumer gets the record once it lapses
            attempts: list[int] = []
            deadline = time.monotonic() + 5
            while not attempts and time.monotonic() < deadline:
                attempts = [r.attempts for r in await client.group_poll(T, N, S, 0, G, wait=0.5)]
            return w, left, attempts

    w, left, attempts = asyncio.run(main())
    assert left == [] and cancelled == [b"slow"]
    assert attempts == [2]
    labels = {"tenant": T, "namespace": N, "stream": S, "group": G}
    assert w.stats.in_flight == 0 and registry.get_sample_value("felix_worker_in_flight", labels) == 0


def test_worker_interrupted_again_during_its_shutdown_stops_its_heartbeat(
    worker_group: Callable[..., felix_redis.Client],
) -> None:
    """A second KeyboardInterrupt (signals not handled by the worker) while the shutdown
    waits out ``grace_s``: run() ends, and the heartbeat thread stops with it, so the
    lease of the job it gave up lapses (the record is due again) rather than being
    extended for as long as the process lives."""
    import os
    import signal

    from prometheus_client import CollectorRegistry

    from felix_redis.metrics import WorkerMetrics

    c = worker_group(vt_ms=400)
    c.publish(T, N, S, "slow")
    release = threading.Event()
    registry = CollectorRegistry()
    w = Worker(c, T, N, S, G, lambda record: release.wait(10), concurrency=1, poll_wait_s=0.1, grace_s=10,
               handle_signals=False, metrics=WorkerMetrics(registry))
    interrupts: list[float] = []

    def interrupt() -> None:
        deadline = time.monotonic() + 5
        while w.stats.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(2):  # the second while the shutdown waits for the handler
            interrupts.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    thread = threading.Thread(target=interrupt)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            w.run()
        assert len(interrupts) == 2 and time.monotonic() - interrupts[1] < 2  # not a grace period later
    finally:
        thread.join(5)
        signal.signal(signal.SIGINT, old)
    try:
        heartbeat = next(t for t in w._threads if t.name == "felix-heartbeat")
        heartbeat.join(2)
        assert not heartbeat.is_alive()
        attempts: list[int] = []
        deadline = time.monotonic() + 5
        while not attempts and time.monotonic() < deadline:
            got = c.group_poll(T, N, S, 0, G, wait=0.5)
            attempts = [r.attempts for r in got]
        assert attempts == [2]
        c.group_ack(T, N, S, 0, G, got[0])
        # the job given up holds no slot and no gauge, and run() works again
        labels = {"tenant": T, "namespace": N, "stream": S, "group": G}
        assert w.stats.in_flight == 0 and registry.get_sample_value("felix_worker_in_flight", labels) == 0
    finally:
        release.set()
    c.publish_batch(T, N, S, ["again", "again"])
    with running(w):
        deadline = time.monotonic() + 5
        while w.stats.processed < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert w.stats.processed == 2


# -- CLI wiring


def test_cli_worker_burst_with_context_from_the_main_group(
    worker_group: Callable[..., felix_redis.Client], redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = worker_group()
    c.publish(T, N, S, '{}')
    monkeypatch.setenv("WORKER_JOBS_URL", redis_url)

    @click.group()
    @click.pass_context
    def main(ctx: click.Context) -> None:
        ctx.obj = Ctl(redis_url, T, N)

    main.add_command(worker_cmd)
    result = CliRunner().invoke(main, ["worker", S, G, "tests.support.worker_jobs:handle", "--burst"])
    assert result.exit_code == 0, result.output
    assert c.group_describe(T, N, S, G).lag == 0


def test_cli_worker_usage_and_operation_errors(worker_group: Callable[..., felix_redis.Client], redis_url: str) -> None:
    worker_group()
    runner = CliRunner()
    result = runner.invoke(worker_cmd, ["--redis-url", redis_url, S, G, "nope:nothing"])
    assert result.exit_code == 2 and "cannot import nope:nothing" in result.output
    result = runner.invoke(worker_cmd, ["--redis-url", redis_url, S, G, "tests.support.worker_jobs:handle",
                                        "--shards", "x"])
    assert result.exit_code == 2
    result = runner.invoke(worker_cmd, ["--redis-url", redis_url, "--tenant", T, "--namespace", N,
                                        "missing", G, "tests.support.worker_jobs:handle", "--burst"])
    assert result.exit_code == 1
    assert result.output.startswith("felixctl: error: ") and "missing" in result.output
    result = runner.invoke(metrics_cmd, ["--listen", "nowhere"])
    assert result.exit_code == 2


def test_stop_before_run_returns_at_once_and_run_can_be_repeated(
    worker_group: Callable[..., felix_redis.Client],
) -> None:
    c = worker_group()
    c.publish(T, N, S, "x")
    seen: list[bytes] = []
    w = Worker(c, T, N, S, G, lambda r: seen.append(r.payload), poll_wait_s=5, handle_signals=False)
    w.stop()
    started = time.monotonic()
    w.run()
    assert time.monotonic() - started < 1 and seen == []
    w.burst = True
    w.run()
    assert seen == [b"x"]
    with pytest.raises(TypeError, match="AsyncWorker"):
        Worker(c, T, N, S, G, handler_async_example)


async def handler_async_example(record: Record) -> None:
    """An async handler, which the sync Worker refuses."""
