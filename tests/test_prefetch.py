"""Prefetch (``group_sharded(..., prefetch=N)``): a poll fetches ``N`` records in one
round trip and hands them out ``max_records`` at a time; what it fetched and did not hand
out is leased to the consumer, released at close, and delivered again after its lease
when the process dies (at-least-once: nothing lost)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import felix_redis
import felix_redis.asyncio as felix_async
from felix_redis import InvalidArgument
from tests.test_queued_acks import G, N, S, T, make, on_round_trips, unfinished

ROOT = Path(__file__).resolve().parent.parent


def round_trips(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The scripts (or commands) of each round trip ``client`` makes from now on."""
    trips: list[list[str]] = []
    on_round_trips(client, monkeypatch, trips.append)
    return trips


def test_a_prefetching_poll_fetches_once_and_hands_out_max_records_at_a_time(
    redis_client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = redis_client
    make(client, 64)
    group = client.group_sharded(T, N, S, G, prefetch=32)
    assert group.prefetch == 32
    trips = round_trips(client, monkeypatch)
    handed: list[bytes] = []
    sizes, made = [], []
    while True:
        before = len(trips)
        items = group.poll(8)
        made.append(len(trips) - before)
        if not items:
            break
        sizes.append(len(items))
        if len(handed) == 0:
            assert group.fetched_ahead == 24  # leased to this consumer, not handed out yet
        for item in items:
            handed.append(item.payload)
            group.ack(item, wait=False)
    assert sizes == [8] * 8
    assert sorted(handed) == sorted(f"r{i}".encode() for i in range(64))  # each once
    # the first poll of each 32 fetched them (its lead shard ran dry after 16: two
    # trips), the three after it made no round trip; then the last, empty poll
    assert made[1:4] == made[5:8] == [0, 0, 0], made
    assert made[0] > 0 and made[4] > 0 and made[8] > 0, made
    group.close()
    assert unfinished(client) == 0


def test_a_poll_asking_more_than_the_prefetch_fetches_what_it_asks(
    redis_client: felix_redis.Client
) -> None:
    make(redis_client, 40, shards=1)
    group = redis_client.group_sharded(T, N, S, G, prefetch=8)
    assert len(group.poll(20)) == 20 and group.fetched_ahead == 0
    assert len(group.poll(4)) == 4 and group.fetched_ahead == 4
    assert len(group.poll(16)) == 4  # what was fetched ahead comes first, alone
    assert len(group.poll(16)) == 12  # the rest
    assert group.poll(16) == []


@pytest.mark.parametrize("bad", [True, -1, 1.5, "8", 10_001, None])
def test_a_bad_prefetch_is_refused(redis_client: felix_redis.Client, redis_url: str, bad: Any) -> None:
    with pytest.raises(InvalidArgument, match="prefetch"):
        redis_client.group_sharded(T, N, S, G, prefetch=bad)

    async def run() -> None:
        client = felix_async.connect(redis_url)
        try:
            with pytest.raises(InvalidArgument, match="prefetch"):
                client.group_sharded(T, N, S, G, prefetch=bad)
        finally:
            await client.close()

    asyncio.run(run())


def test_bad_arguments_take_nothing_fetched_ahead(redis_client: felix_redis.Client) -> None:
    make(redis_client, 16, shards=2)
    group = redis_client.group_sharded(T, N, S, G, prefetch=16)
    first = group.poll(4)
    assert len(first) == 4 and group.fetched_ahead == 12
    for bad in [{"max_records": 0}, {"max_records": 10_001}, {"wait": -1.0}, {"wait": float("nan")},
                {"ack": [first[0], "not-a-claim"]}, {"ack": "0:1:1"}]:
        with pytest.raises(InvalidArgument):
            group.poll(**{"max_records": 4, **bad})
        assert group.fetched_ahead == 12, bad
    assert group.queued_acks == 0  # the good ack beside the bad one was not queued either
    # an ack given to a poll served from what was fetched ahead is queued, to ride on
    # the next fetch
    second = group.poll(4, ack=first)
    assert len(second) == 4 and group.queued_acks == 4
    group.flush()
    assert unfinished(redis_client) == 12


def test_a_release_does_not_count_the_delivery(redis_client: felix_redis.Client) -> None:
    """A record fetched ahead and released at close was never handed to the caller: its
    next delivery says the same attempts as the one released (a retry's too), and it
    never becomes a dead letter for it, however often a process fetches and exits."""
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, G, max_attempts=2)
    redis_client.publish_batch(T, N, S, [f"r{i}" for i in range(4)])
    for record in redis_client.group_poll(T, N, S, 0, G, max_records=4):
        redis_client.group_nack(T, N, S, 0, G, record)  # attempts 1 spent: the next is 2, the last
    for turn in range(3):
        group = redis_client.group_sharded(T, N, S, G, prefetch=4)
        held = group.poll(1)
        assert [i.attempts for i in held] == [2] and group.fetched_ahead == 3 - turn
        group.nack(held[0])  # its last attempt: a dead letter
        group.close()
    info = redis_client.group_describe(T, N, S, G)
    assert info.dead == 3
    last = redis_client.group_sharded(T, N, S, G).poll(4)
    assert [i.attempts for i in last] == [2]


def test_close_releases_what_was_fetched_ahead(redis_client: felix_redis.Client) -> None:
    make(redis_client, 16, shards=2)  # leases of 30 s: only a release hands them out now
    group = redis_client.group_sharded(T, N, S, G, prefetch=16)
    held = group.poll(4)
    for item in held[:2]:
        group.ack(item, wait=False)
    group.close()
    assert group.fetched_ahead == 0 and group.queued_acks == 0
    other = redis_client.group_sharded(T, N, S, G).poll(16)
    # the 12 never handed out are due again at once, their delivery not counted (the
    # next says attempts 1 again); the two handed out and not acked stay leased to the
    # first holder
    assert sorted(i.payload for i in other) == sorted({f"r{i}".encode() for i in range(16)}
                                                       - {i.payload for i in held})
    assert {i.attempts for i in other} == {1}
    assert unfinished(redis_client) == 14


CHILD = textwrap.dedent("""
    import os, sys
    import felix_redis
    client = felix_redis.connect(sys.argv[1])
    group = client.group_sharded("acme", "prod", "jobs", "workers", prefetch=8)
    items = group.poll(2)
    assert len(items) == 2 and group.fetched_ahead == 6, items
    for item in items:
        group.ack(item)
    if sys.argv[2] == "client-close":
        client.close()
    if sys.argv[2] != "exit":
        os._exit(0)  # killed: no interpreter exit, no atexit
""")


@pytest.mark.parametrize("end", ["killed", "exit", "client-close"])
def test_a_process_that_ends_with_records_fetched_ahead_has_them_delivered_again(
    redis_client: felix_redis.Client, redis_url: str, tmp_path: Path, end: str
) -> None:
    make(redis_client, 8, shards=2, vt_ms=1_000)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    done = subprocess.run([sys.executable, str(script), redis_url, end], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    group = redis_client.group_sharded(T, N, S, G)
    if end == "killed":
        assert group.poll(8) == []  # leased to the dead process until the lease lapses
        time.sleep(1.2)
    # else released at the interpreter's exit or the client's close: due again at once
    again = group.poll(8)
    # a lapsed lease counts the delivery; a release does not
    assert len(again) == 6 and {i.attempts for i in again} == ({2} if end == "killed" else {1})
    for item in again:
        group.ack(item)
    assert unfinished(redis_client) == 0  # the two acked and the six again: none lost


def test_asyncio_prefetch_hands_out_in_turn_and_releases_at_close(
    redis_client: felix_redis.Client, redis_url: str
) -> None:
    make(redis_client, 24, shards=2)
    held: list[bytes] = []  # handed out and not acked: leased to the closed client
    acked: list[bytes] = []

    async def run() -> None:
        client = felix_async.connect(redis_url)
        group = client.group_sharded(T, N, S, G, prefetch=12)
        first = await group.poll(4)
        acked.extend(i.payload for i in first)
        assert len(first) == 4 and group.fetched_ahead == 8
        second = await group.poll(4, ack=first)
        assert len(second) == 4 and group.queued_acks == 4
        with pytest.raises(InvalidArgument):
            await group.poll(0)
        assert group.fetched_ahead == 4
        await group.close()  # the 4 fetched ahead released, the 4 queued acks sent
        assert group.fetched_ahead == 0 and group.queued_acks == 0
        third = await group.poll(2)  # fetches 12 again: 10 ahead, released by the client's close
        assert len(third) == 2 and group.fetched_ahead == 10
        held.extend(i.payload for i in second + third)
        await client.close()
        assert group.fetched_ahead == 0

    asyncio.run(run())
    rest = redis_client.group_sharded(T, N, S, G).poll(24)
    # every record but the 4 + 2 handed out and not acked is due now (released, or never
    # fetched), none lost
    assert sorted(i.payload for i in rest) == sorted({f"r{i}".encode() for i in range(24)} - set(held) - set(acked))
    assert unfinished(redis_client) == 20


# -------------------------------------------------- found by a review (each failed before its fix)


def test_two_polls_at_once_on_one_group_hand_each_record_out_once(
    redis_client: felix_redis.Client, redis_url: str
) -> None:
    make(redis_client, 64, shards=4)

    async def run() -> list[bytes]:
        client = felix_async.connect(redis_url)
        group = client.group_sharded(T, N, S, G, prefetch=16)
        handed: list[bytes] = []
        for _ in range(100):
            # both find the buffer empty and fetch: the second's records join the first's
            pair = await asyncio.gather(group.poll(1), group.poll(1))
            handed += [i.payload for items in pair for i in items]
            if not any(pair):
                break
        await client.close()
        return handed

    handed = asyncio.run(run())
    # a fetch that replaced what the other left in the buffer would lose those records
    # (leased, handed to nobody, not released)
    assert sorted(handed) == sorted(f"r{i}".encode() for i in range(64))


@pytest.mark.parametrize("mode", ["sync", "asyncio"])
def test_a_group_dropped_while_holding_records_is_released_by_the_clients_close(
    redis_client: felix_redis.Client, redis_url: str, mode: str
) -> None:
    make(redis_client, 8, shards=2)
    if mode == "sync":
        client = felix_redis.connect(redis_url)

        def take_two() -> None:
            group = client.group_sharded(T, N, S, G, prefetch=8)
            assert len(group.poll(2)) == 2 and group.fetched_ahead == 6

        take_two()
        gc.collect()  # the group is gone: only the client can release its records
        client.close()
    else:
        async def run() -> None:
            aclient = felix_async.connect(redis_url)

            async def take_two() -> None:
                group = aclient.group_sharded(T, N, S, G, prefetch=8)
                assert len(await group.poll(2)) == 2 and group.fetched_ahead == 6

            await take_two()
            gc.collect()
            await aclient.close()

        asyncio.run(run())
    again = redis_client.group_sharded(T, N, S, G).poll(8)
    assert len(again) == 6 and {i.attempts for i in again} == {1}


def test_close_releases_what_was_fetched_ahead_in_one_round_trip(
    redis_client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    make(redis_client, 40, shards=4)
    group = redis_client.group_sharded(T, N, S, G, prefetch=40)
    assert len(group.poll(4)) == 4 and group.fetched_ahead == 36
    trips = round_trips(redis_client, monkeypatch)
    group.close()
    # one nack per record, all in one round trip (a nack each would make a close with
    # Redis down wait out the retries 36 times)
    assert [trip for trip in trips if "group_nack" in trip] == [["group_nack"] * 36]


FORK = textwrap.dedent("""
    import json, os, sys
    import felix_redis
    client = felix_redis.connect(sys.argv[1])
    group = client.group_sharded("acme", "prod", "jobs", "workers", prefetch=8)
    assert len(group.poll(2)) == 2 and group.fetched_ahead == 6
    pid = os.fork()
    if pid == 0:
        print(json.dumps({"child_holds": group.fetched_ahead}), flush=True)
        sys.exit(0)  # a normal exit: the child's atexit runs
    os.waitpid(pid, 0)
    other = felix_redis.connect(sys.argv[1]).group_sharded("acme", "prod", "jobs", "workers")
    taken = len(other.poll(8))  # the child's exit released nothing of the parent's
    mine = group.poll(8)
    for item in mine:
        group.ack(item)
    print(json.dumps({"taken_by_another": taken, "parent_handed": len(mine)}), flush=True)
""")


def test_a_forked_child_neither_hands_out_nor_releases_the_parents_records(
    redis_client: felix_redis.Client, redis_url: str, tmp_path: Path
) -> None:
    make(redis_client, 8, shards=2)
    script = tmp_path / "fork.py"
    script.write_text(FORK)
    done = subprocess.run([sys.executable, str(script), redis_url], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines == [{"child_holds": 0}, {"taken_by_another": 0, "parent_handed": 6}]


def test_asyncio_a_cancelled_poll_keeps_what_was_fetched_ahead_and_its_acks(
    redis_client: felix_redis.Client, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make(redis_client, 16, shards=2)

    async def run() -> None:
        client = felix_async.connect(redis_url)
        group = client.group_sharded(T, N, S, G, prefetch=16)
        first = await group.poll(4)
        real_ack = group.ack

        async def cancelled_ack(item: Any, wait: bool = True) -> None:
            raise asyncio.CancelledError

        monkeypatch.setattr(group, "ack", cancelled_ack)
        with pytest.raises(asyncio.CancelledError):
            await group.poll(4, ack=first)
        assert group.fetched_ahead == 12  # nothing taken by the cancelled poll
        monkeypatch.setattr(group, "ack", real_ack)
        for item in first:
            await group.ack(item, wait=False)
        real_drive = client._drive

        async def cancelled_drive(plan: Any) -> Any:
            plan.close()
            raise asyncio.CancelledError

        monkeypatch.setattr(client, "_drive", cancelled_drive)
        with pytest.raises(asyncio.CancelledError):
            await group.flush()
        assert group.queued_acks == 4  # put back: they may not have gone
        monkeypatch.setattr(client, "_drive", real_drive)
        await group.close()
        await client.close()

    asyncio.run(run())
    assert unfinished(redis_client) == 12  # the 4 acked; 12 released, due again


@pytest.mark.parametrize("bad", ["2", "yes", "0"])
def test_a_crafted_release_flag_is_refused_and_changes_nothing(redis_client: felix_redis.Client, bad: str) -> None:
    """group_nack's release argument, crafted past the client: anything but '1' or ''
    is refused (FELIX_INVALID naming it) before any write; the lease stands."""
    from redis.exceptions import ResponseError

    from tests.support.scripts import run_script

    make(redis_client, 1, shards=1)
    record = redis_client.group_poll(T, N, S, 0, G)[0]
    cache = redis_client.core.cache
    keys = list(cache.group_shard_keys(cache.name(T, N, S), 0, G)[0])
    before = redis_client.group_describe(T, N, S, G)
    with pytest.raises(ResponseError, match=r"FELIX_INVALID.*release"):
        run_script(redis_client, "group_nack", keys, [record.offset, record.attempts, 0, bad])
    after = redis_client.group_describe(T, N, S, G)
    assert (after.in_flight, after.owed, after.dead) == (before.in_flight, before.owed, before.dead) == (1, 0, 0)


def test_a_poll_that_finds_the_buffer_emptied_under_it_fetches(redis_client: felix_redis.Client) -> None:
    """Two threads polling one group: one saw records fetched ahead, the other took the
    last of them before it could. It fetches (a round trip, with its acks) rather than
    return nothing while records are due (``wait`` applies when the buffer is empty)."""
    make(redis_client, 12, shards=1)
    group = redis_client.group_sharded(T, N, S, G, prefetch=4)
    first = group.poll(2)
    assert len(first) == 2 and group.fetched_ahead == 2
    other: list[Any] = []
    checked = group._checked_refs

    def racing(ack: Any) -> Any:  # the other thread, between the look and the take
        other.extend(group._from_buffer(16))
        return checked(ack)

    group._checked_refs = racing  # type: ignore[method-assign]
    got = group.poll(2, wait=3.0, ack=first)
    assert len(other) == 2
    assert len(got) == 2 and {i.payload for i in got}.isdisjoint({i.payload for i in first + other})
    group.flush()
    assert unfinished(redis_client) == 12 - 2  # the acks given went with the fetch


def test_an_asyncio_groups_forked_child_holds_none_of_its_parents_records(
    redis_client: felix_redis.Client, redis_url: str
) -> None:
    """As the sync client's: a forked child neither hands out nor releases the records
    its parent fetched ahead; the parent hands them out."""
    make(redis_client, 8, shards=1)

    async def main() -> tuple[int, int]:
        client = felix_async.connect(redis_url)
        group = client.group_sharded(T, N, S, G, prefetch=8)
        assert len(await group.poll(2)) == 2 and group.fetched_ahead == 6
        pid = os.fork()
        if pid == 0:  # the child: nothing held, nothing to hand out or release
            held = group.fetched_ahead, group._from_buffer(6), group._take_buffer()
            os._exit(0 if held == (0, [], []) else 1)
        _, status = os.waitpid(pid, 0)
        rest = await group.poll(6)
        await client.close()
        return status, len(rest)

    status, rest = asyncio.run(main())
    assert status == 0 and rest == 6


def test_asyncio_a_release_cancelled_before_its_call_went_still_releases(
    redis_client: felix_redis.Client, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close (an AsyncWorker's stop) cancelled while its release waits for a
    connection: the records are out of the buffer already, so the release goes on to its
    end; they are due again at once, their delivery not counted (not left leased until
    their lease lapses)."""
    make(redis_client, 8, shards=1)

    async def main() -> None:
        client = felix_async.connect(redis_url)
        group = client.group_sharded(T, N, S, G, prefetch=8)
        assert len(await group.poll(2)) == 2 and group.fetched_ahead == 6
        real = client._execute

        async def slow(op: Any) -> Any:
            await asyncio.sleep(0.3)  # the pool slow to hand out a connection: nothing sent yet
            return await real(op)

        monkeypatch.setattr(client, "_execute", slow)
        closing = asyncio.ensure_future(group.close())
        await asyncio.sleep(0.1)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert group.fetched_ahead == 0 and len(client._releases) == 1  # the release's own task
        await client.close()  # waits for it, then closes its connection with the others
        assert not client._releases

    clients = len(redis_client.redis.client_list())
    asyncio.run(main())
    assert len(redis_client.redis.client_list()) <= clients  # no connection left open
    rest = redis_client.group_sharded(T, N, S, G, consumer="other").poll(8)
    assert len(rest) == 6 and all(item.record.attempts == 1 for item in rest)
