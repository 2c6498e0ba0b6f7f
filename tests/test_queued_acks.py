"""Queued acks (``ShardedGroup.ack(item, wait=False)``): the README's loop in one round
trip per batch, and what a queued ack guarantees — sent with the next poll, after a short
linger, at flush, close, describe and interpreter exit; lost only with the process, and
then the records come again (at-least-once)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

import felix_redis
import felix_redis.asyncio as felix_async
from felix_redis import ConnectionFailed, InvalidArgument
from felix_redis.plans import Batch, Eval

T, N, S, G = "acme", "prod", "jobs", "workers"
ROOT = Path(__file__).resolve().parent.parent


def make(client: felix_redis.Client, records: int, shards: int = 4, vt_ms: int = 30_000) -> None:
    client.stream_create(T, N, S, shards=shards)
    client.group_create(T, N, S, G, visibility_timeout_ms=vt_ms)
    if records:
        client.publish_batch(T, N, S, [f"r{i}" for i in range(records)])


def unfinished(client: felix_redis.Client) -> int:
    return sum(s.unfinished for s in client.group_describe(T, N, S, G).shards)


def on_round_trips(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch,
                   record: Callable[[list[str]], None]) -> None:
    """Calls ``record`` with the scripts (or commands) of each round trip ``client``
    makes from now on."""
    real = client._execute

    def spy(op: Any) -> Any:
        if type(op) is Eval:
            record([op.script])
        elif type(op) is Batch:
            record([e.script if type(e) is Eval else e.args[0] for e in op.ops])
        return real(op)

    monkeypatch.setattr(client, "_execute", spy)


def scripts_sent(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the scripts ``client`` calls from now on, in order."""
    sent: list[str] = []

    def record(calls: list[str]) -> None:
        # an ack rides on a poll's round trip (a poll, or a look at idle shards), never alone
        others = [c for c in calls if c != "group_ack"]
        sent.extend(others or calls)

    on_round_trips(client, monkeypatch, record)
    return sent


def test_the_readme_loop_sends_its_acks_with_the_next_poll(
    redis_client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = redis_client
    make(client, 64)
    group = client.group_sharded(T, N, S, G)
    sent = scripts_sent(client, monkeypatch)
    handled = []
    while items := group.poll(16):
        for item in items:
            handled.append(item.payload)
            assert group.ack(item, wait=False) is None
        assert group.queued_acks == len(items)
    assert len(handled) == 64 and group.queued_acks == 0  # the last, empty poll took them along
    assert "group_ack" not in sent, "an ack went in a round trip of its own"
    assert unfinished(client) == 0
    # the same loop acking at once: one call per ack
    client.publish_batch(T, N, S, [b"x"] * 16)
    sent.clear()
    for item in group.poll(16):
        assert group.ack(item) is True
    assert sent.count("group_ack") == 16


def test_a_queued_ack_is_settled_before_this_client_describes_the_group(redis_client: felix_redis.Client) -> None:
    make(redis_client, 8)
    group = redis_client.group_sharded(T, N, S, G)
    items = group.poll(8)
    for item in items:
        group.ack(item, wait=False)
    assert unfinished(redis_client) == 0  # describe sent them first


def test_queued_acks_go_after_a_short_linger_without_another_call(
    redis_client: felix_redis.Client, redis_url: str
) -> None:
    make(redis_client, 8)
    group = redis_client.group_sharded(T, N, S, G)
    for item in group.poll(8):
        group.ack(item, wait=False)
    with felix_redis.connect(redis_url) as other:  # sees only what reached Redis
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and sum(s.unfinished for s in other.group_describe(T, N, S, G).shards):
            time.sleep(0.005)
        assert sum(s.unfinished for s in other.group_describe(T, N, S, G).shards) == 0
    assert group.queued_acks == 0


@pytest.mark.parametrize("mode", ["sync", "asyncio"])
def test_an_ack_queued_after_a_poll_took_the_others_waits_its_own_linger(
    redis_client: felix_redis.Client, redis_url: str, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The linger starts at the first ack queued: when a poll took along the acks an
    earlier linger was for, an ack queued after that poll is not sent alone at that
    earlier linger's end (it would have ridden on the next poll), but at its own."""
    import felix_redis.asyncio as aio_module
    import felix_redis.client as client_module

    linger = 1.0  # (wide: the test's steps must fall inside it on a loaded machine)
    monkeypatch.setattr(client_module if mode == "sync" else aio_module, "ACK_LINGER_S", linger)
    make(redis_client, 8, shards=1)

    def check(queued_acks: Any, first: list[Any], second: list[Any], poll: Any, ack: Any, sleep: Any) -> Any:
        # (a generator of steps, run by the sync or asyncio driver below)
        for item in first:
            yield ack(item)  # the linger starts: ends at t0 + linger
        t0 = time.monotonic()
        yield poll()  # takes the 4 acks along
        assert queued_acks() == 0
        yield sleep(0.6 * linger)
        yield ack(second[0])  # queued at ~t0 + 0.6 linger: its own linger ends at ~t0 + 1.6 linger
        yield sleep(max(0.0, t0 + 1.2 * linger - time.monotonic()))
        assert queued_acks() == 1, "the earlier linger's end sent an ack queued after the poll that took the others"
        deadline = time.monotonic() + 3 * linger
        while queued_acks() and time.monotonic() < deadline:
            yield sleep(0.02)
        assert queued_acks() == 0  # sent at its own linger's end

    if mode == "sync":
        group = redis_client.group_sharded(T, N, S, G)
        items = group.poll(8)
        for _step in check(lambda: group.queued_acks, items[:4], items[4:], lambda: group.poll(1),
                          lambda i: group.ack(i, wait=False), time.sleep):
            pass
        group.close()
    else:
        async def run() -> None:
            client = felix_async.connect(redis_url)
            group = client.group_sharded(T, N, S, G)
            items = await group.poll(8)
            for step in check(lambda: group.queued_acks, items[:4], items[4:], lambda: group.poll(1),
                              lambda i: group.ack(i, wait=False), asyncio.sleep):
                await step
            await group.close()
            await client.close()

        asyncio.run(run())
    assert unfinished(redis_client) == 3  # the 3 items never acked


def test_flush_and_close_send_the_queued_acks(redis_client: felix_redis.Client, redis_url: str) -> None:
    make(redis_client, 8)
    raw = redis.Redis.from_url(redis_url)

    def settled_in_redis() -> int:
        with felix_redis.connect(redis_url) as other:
            return 8 - sum(s.unfinished for s in other.group_describe(T, N, S, G).shards)

    with redis_client.group_sharded(T, N, S, G) as group:
        items = group.poll(8)
        for item in items[:4]:
            group.ack(item, wait=False)
        assert group.flush() == 4 and group.queued_acks == 0 and settled_in_redis() == 4
        assert group.flush() == 0
        for item in items[4:]:
            group.ack(item, wait=False)
    assert group.queued_acks == 0 and settled_in_redis() == 8  # closed by the with block
    raw.close()


def test_a_bad_reference_is_refused_at_once_and_nothing_is_queued(
    redis_client: felix_redis.Client, redis_url: str
) -> None:
    make(redis_client, 1)
    group = redis_client.group_sharded(T, N, S, G)
    for bad in ("nope", 12, None, "0:x:1"):
        with pytest.raises(InvalidArgument):
            group.ack(bad, wait=False)  # type: ignore[arg-type]
    # well formed, but no shard 9: refused at once where the client knows the shards
    # (it made or polled the stream), else refused when sent, and dropped
    with pytest.raises(felix_redis.NotFound, match="shard 9 does not exist"):
        group.ack("9:0:1", wait=False)
    assert group.queued_acks == 0
    with felix_redis.connect(redis_url) as fresh:
        blind = fresh.group_sharded(T, N, S, G)
        blind.ack("9:0:1", wait=False)
        with pytest.raises(felix_redis.NotFound, match="shard 9 does not exist"):
            blind.flush()
        assert blind.queued_acks == 0
    (item,) = group.poll(1)
    group.ack(item, wait=False)
    assert group.flush() == 1


def test_a_poll_that_fails_keeps_the_acks_it_took_along_queued(
    redis_client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    make(redis_client, 8, shards=1)
    group = redis_client.group_sharded(T, N, S, G)
    items = group.poll(8)
    for item in items:
        group.ack(item, wait=False)
    real = redis_client._execute
    monkeypatch.setattr(redis_client, "_execute", lambda op: (_ for _ in ()).throw(ConnectionFailed("lost")))
    with pytest.raises(ConnectionFailed):
        group.poll(8)
    assert group.queued_acks == 8
    monkeypatch.setattr(redis_client, "_execute", real)
    assert group.poll(8) == [] and group.queued_acks == 0
    assert unfinished(redis_client) == 0


CHILD = textwrap.dedent("""
    import os, sys
    import felix_redis
    client = felix_redis.connect(sys.argv[1])
    group = client.group_sharded("acme", "prod", "jobs", "workers")
    items = group.poll(4)
    assert len(items) == 4, items
    for item in items:
        group.ack(item, wait=False)
    if sys.argv[2] == "close":
        group.close()
    if sys.argv[2] == "client-close":
        client.close()
    if sys.argv[2] != "exit":
        os._exit(0)  # killed: no interpreter exit, no atexit
""")


@pytest.mark.parametrize("end", ["killed", "close", "client-close", "exit"])
def test_a_process_killed_with_queued_acks_has_its_records_delivered_again(
    redis_client: felix_redis.Client, redis_url: str, tmp_path: Path, end: str,
) -> None:
    make(redis_client, 4, shards=2, vt_ms=500)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    done = subprocess.run([sys.executable, str(script), redis_url, end], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    time.sleep(0.8)  # past the leases
    again = redis_client.group_sharded(T, N, S, G).poll(8)
    if end == "killed":
        # the acks never left: the records come again, none lost
        assert sorted((i.payload, i.attempts) for i in again) == [(f"r{i}".encode(), 2) for i in range(4)]
    else:
        assert again == []  # sent at close, or at interpreter exit
        assert unfinished(redis_client) == 0


def test_asyncio_queued_acks_ride_on_the_poll_linger_and_close(
    redis_client: felix_redis.Client, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make(redis_client, 48)

    async def run() -> None:
        client = felix_async.connect(redis_url)
        sent: list[str] = []
        real = client._execute

        async def spy(op: Any) -> Any:
            if type(op) is Eval:
                sent.append(op.script)
            elif type(op) is Batch:  # acks beside a poll (or a look) ride on its round trip
                calls = [e.script if type(e) is Eval else e.args[0] for e in op.ops]
                sent.extend([c for c in calls if c != "group_ack"] or calls)
            return await real(op)

        monkeypatch.setattr(client, "_execute", spy)
        group = client.group_sharded(T, N, S, G)
        items = await group.poll(16)
        for item in items:
            assert await group.ack(item, wait=False) is None
        items = await group.poll(16)  # carries the first 16
        assert "group_ack" not in sent and group.queued_acks == 0
        for item in items:
            await group.ack(item, wait=False)
        await asyncio.sleep(0.2)  # the linger sends them
        assert group.queued_acks == 0 and unfinished(redis_client) == 16
        async with group:
            for item in await group.poll(16):
                await group.ack(item, wait=False)
        assert group.queued_acks == 0
        await client.close()

    asyncio.run(run())
    assert unfinished(redis_client) == 0


# -------------------------------------------------- found by a review (each failed before its fix)


def test_acks_a_failed_poll_kept_are_sent_by_describe_and_close_too(
    redis_client: felix_redis.Client, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make(redis_client, 8, shards=1)
    client = felix_redis.connect(redis_url)
    group = client.group_sharded(T, N, S, G)
    real = client._execute

    def slow_failure(op: Any) -> Any:
        time.sleep(0.03)  # the linger fires meanwhile, and finds the queue empty
        raise ConnectionFailed("lost")

    for _ in range(2):
        for item in group.poll(4):
            group.ack(item, wait=False)
        monkeypatch.setattr(client, "_execute", slow_failure)
        with pytest.raises(ConnectionFailed):
            group.poll(4)
        monkeypatch.setattr(client, "_execute", real)
        if _ == 0:
            assert sum(s.unfinished for s in client.group_describe(T, N, S, G).shards) == 4  # 4 not polled yet
        else:
            client.close()
    assert unfinished(redis_client) == 0


def test_describe_waits_for_a_flush_under_way(
    redis_client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    make(redis_client, 2, shards=1)
    group = redis_client.group_sharded(T, N, S, G)
    real_flush = group.flush
    started = []

    def slow_flush() -> int:
        started.append(time.monotonic())
        time.sleep(0.3)
        return real_flush()

    monkeypatch.setattr(group, "flush", slow_flush)
    for item in group.poll(2):
        group.ack(item, wait=False)
    deadline = time.monotonic() + 5
    while not started and time.monotonic() < deadline:
        time.sleep(0.002)
    assert started, "the linger never flushed"
    assert unfinished(redis_client) == 0  # describe waited for the flusher's send


def test_a_forked_child_closes_its_client_though_a_parent_thread_held_the_lane(
    redis_client: felix_redis.Client, redis_url: str
) -> None:
    make(redis_client, 0, shards=1)
    client = felix_redis.connect(redis_url)
    client.publish(T, N, S, b"x")  # the lane has its connection
    assert client._lane is not None
    client._lane.lock.acquire()  # as a handler or the acks' flusher would, mid-call, at the fork
    pid = os.fork()
    if pid == 0:  # the child: must not wait for a lock nobody here will release
        import signal

        signal.alarm(5)
        try:
            client.close()
            os._exit(0)
        except BaseException:
            os._exit(1)
    client._lane.lock.release()
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child hung or failed in client.close()"
    client.close()


def test_asyncio_close_waits_for_a_flush_under_way(
    redis_client: felix_redis.Client, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make(redis_client, 2, shards=1)

    async def run() -> None:
        client = felix_async.connect(redis_url)
        group = client.group_sharded(T, N, S, G)
        real_flush = group.flush
        started = []

        async def slow_flush() -> int:
            started.append(1)
            await asyncio.sleep(0.3)
            return await real_flush()

        monkeypatch.setattr(group, "flush", slow_flush)
        for item in await group.poll(2):
            await group.ack(item, wait=False)
        while not started:
            await asyncio.sleep(0.002)
        await client.close()  # must wait for that send, not leave it to be cancelled

    asyncio.run(run())
    assert unfinished(redis_client) == 0
