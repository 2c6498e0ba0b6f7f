"""felix_redis.asyncio: the same scenarios as the sync client, as coroutines.

pytest-asyncio is not a dependency: each test is a plain test running ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import felix_redis
import felix_redis.asyncio as fa
from felix_redis.protocol import Batch, BlockAny, Eval

T, N, S, G = "acme", "prod", "jobs", "workers"

Scenario = Callable[[fa.AsyncClient, str], Awaitable[None]]


def run(url: str, scenario: Scenario) -> None:
    async def main() -> None:
        client = fa.connect(url)
        try:
            await scenario(client, url)
        finally:
            await client.close()

    asyncio.run(main())


def lose_replies(client: fa.AsyncClient, monkeypatch: pytest.MonkeyPatch, land: bool = True) -> list[Any]:
    """The next publish script runs (if ``land``), then its reply is lost."""
    real = client._execute
    ops: list[Any] = []
    left = [1]

    async def lossy(op: Any) -> Any:
        ops.append(op)
        if type(op) is Eval and op.script == "publish" and left[0]:
            left[0] -= 1
            if land:
                await real(op)
            raise felix_redis.ConnectionFailed("simulated: connection reset before the reply")
        return await real(op)

    monkeypatch.setattr(client, "_execute", lossy)
    return ops


# ------------------------------------------------------------ every call


def test_every_stream_and_group_call(backend: tuple[str, Any]) -> None:
    async def scenario(c: fa.AsyncClient, url: str) -> None:
        assert await c.stream_create(T, N, S, shards=2) is True
        assert await c.stream_create(T, N, S, shards=2) is False
        assert await c.stream_list() == [(T, N, S)]
        info = await c.stream_describe(T, N, S)
        assert (info.shards, info.kind, info.tails) == (2, "queue", [0, 0])

        assert (await c.publish(T, N, S, b"a", shard=0)).offset == 0
        assert (await c.publish(T, N, S, "b", shard=0)).offset == 1
        batch = await c.publish_batch(T, N, S, [b"c", b"d"], shard=1)
        assert [(p.shard, p.offset) for p in batch] == [(1, 0), (1, 1)]
        keyed = await c.publish_keyed(T, N, S, "order-1", b"e")
        assert keyed.shard == felix_redis.shard_for_key(b"order-1", 2)
        assert [r.payload for r in await c.read(T, N, S, 0, 0)][:2] == [b"a", b"b"]

        await c.group_create(T, N, S, G, visibility_timeout_ms=30_000, max_attempts=3)
        with pytest.raises(felix_redis.GroupExists):
            await c.group_create(T, N, S, G)
        assert await c.group_list(T, N, S) == [G]
        await c.group_configure(T, N, S, G, max_attempts=4)

        a, b = (await c.group_poll(T, N, S, 0, G, max_records=2))[:2]
        assert (a.claim, b.claim) == ("0:0:1", "0:1:1")
        assert await c.group_ack(T, N, S, 0, G, a) is True
        assert await c.group_nack(T, N, S, 0, G, b) is False
        (b2,) = await c.group_poll(T, N, S, 0, G, max_records=1)
        assert b2.attempts == 2
        expiry = await c.group_extend(T, N, S, 0, G, b2, by=60)
        assert expiry > 0
        await c.group_dead_letter(T, N, S, 0, G, b2, reason="bad")
        (dead,) = await c.group_dead_letters(T, N, S, 0, G)
        assert (dead.offset, dead.attempts, dead.reason) == (1, 2, "bad")
        assert await c.group_redrive(T, N, S, 0, G) == 1
        (b3,) = await c.group_poll_as(T, N, S, 0, G, consumer="w-7", max_records=1)
        assert b3.attempts == 1
        (b4,) = await c.group_poll_as(T, N, S, 0, G, consumer="w-7", reclaim=True)
        assert (b4.offset, b4.attempts) == (1, 2)
        await c.group_dead_letter(T, N, S, 0, G, b4)
        assert await c.group_discard(T, N, S, 0, G) == 1

        shard1 = await c.group_poll(T, N, S, 1, G)
        assert await c.group_ack_many(T, N, S, 1, G, shard1) == [True] * len(shard1)
        described = await c.group_describe(T, N, S, G)
        assert (described.max_attempts, described.visibility_timeout_ms) == (4, 30_000)
        assert [(s.position, s.lag, s.in_flight, s.dead) for s in described.shards] == [
            (info_tail, 0, 0, 0) for info_tail in (await c.stream_describe(T, N, S)).tails]

        with pytest.raises(felix_redis.StaleClaim):
            await c.group_nack(T, N, S, 0, G, a)
        with pytest.raises(felix_redis.NotFound):
            await c.group_poll(T, N, S, 5, G)
        with pytest.raises(felix_redis.InvalidArgument):
            await c.group_poll(T, N, S, 0, G, wait=-1)

        await c.group_delete(T, N, S, G)
        assert await c.group_list(T, N, S) == []
        await c.stream_delete(T, N, S)
        with pytest.raises(felix_redis.NotFound):
            await c.stream_describe(T, N, S)

    run(backend[0], scenario)


def test_context_manager_closes(backend: tuple[str, Any]) -> None:
    async def main() -> None:
        async with fa.connect(backend[0]) as c:
            assert await c.stream_create(T, N, S) is True

    asyncio.run(main())


# ---------------------------------------------------------------- long polls


def test_long_poll_wakes_within_50ms(redis_client: felix_redis.Client, redis_url: str) -> None:
    async def scenario(c: fa.AsyncClient, url: str) -> None:
        await c.stream_create(T, N, S)
        await c.group_create(T, N, S, G)
        publisher = fa.connect(url)
        try:
            await publisher.publish(T, N, S, b"warm-up")
            assert len(await c.group_poll(T, N, S, 0, G)) == 1
            latencies, round_trips = [], []
            for trial in range(7):
                started = time.monotonic()
                await c.group_describe(T, N, S, G)  # one round trip, on this machine, now
                round_trips.append(time.monotonic() - started)
                stamp: list[float] = []

                async def publish(payload: bytes = b"t%d" % trial, stamp: list[float] = stamp) -> None:
                    await asyncio.sleep(0.1)
                    stamp.append(time.monotonic())
                    await publisher.publish(T, N, S, payload)

                task = asyncio.ensure_future(publish())
                records = await c.group_poll(T, N, S, 0, G, wait=3)
                got = time.monotonic()
                await task
                assert [r.payload for r in records] == [b"t%d" % trial]
                latencies.append(got - stamp[0])
                await c.group_ack(T, N, S, 0, G, records[0])
        finally:
            await publisher.close()
        # about three round trips and a task switch: within 50 ms, or 8 round trips when
        # a loaded machine makes one slower (see test_long_poll's twin)
        bound = max(0.050, 8 * statistics.median(round_trips))
        assert statistics.median(latencies) < bound, (latencies, round_trips)
        assert max(latencies) < 1.0, latencies

    run(redis_url, scenario)


def test_long_poll_does_not_block_the_event_loop(backend: tuple[str, Any]) -> None:
    """Two long polls and a publisher share one loop: the block is awaited, not slept."""

    async def scenario(c: fa.AsyncClient, url: str) -> None:
        await c.stream_create(T, N, S, shards=2)
        await c.group_create(T, N, S, G)
        other = fa.connect(url)
        try:
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            async def publish() -> None:
                await asyncio.sleep(0.3)
                await other.publish(T, N, S, b"zero", shard=0)
                await other.publish(T, N, S, b"one", shard=1)

            tick = asyncio.ensure_future(ticker())
            start = time.monotonic()
            zero, one, _ = await asyncio.gather(
                c.group_poll(T, N, S, 0, G, wait=4), other.group_poll(T, N, S, 1, G, wait=4), publish())
            elapsed = time.monotonic() - start
            tick.cancel()
            assert [r.payload for r in zero] == [b"zero"]
            assert [r.payload for r in one] == [b"one"]
            assert elapsed < 2.0
            assert ticks >= 10, "the event loop was blocked during the long poll"
        finally:
            await other.close()

    run(backend[0], scenario)


def test_long_poll_race_window(backend: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(c: fa.AsyncClient, url: str) -> None:
        await c.stream_create(T, N, S)
        await c.group_create(T, N, S, G)
        other = fa.connect(url)
        real = c._execute
        fired: list[bool] = []

        async def racing(op: Any) -> Any:
            if type(op) is BlockAny and not fired:
                await other.publish(T, N, S, b"racer")
                fired.append(True)
            return await real(op)

        monkeypatch.setattr(c, "_execute", racing)
        try:
            start = time.monotonic()
            records = await c.group_poll(T, N, S, 0, G, wait=4)
            assert fired
            assert [r.payload for r in records] == [b"racer"]
            assert time.monotonic() - start < 1.0
        finally:
            await other.close()

    run(backend[0], scenario)


def test_a_wake_up_and_the_poll_that_takes_the_record_are_one_round_trip(
        redis_url: str, raw: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the sync client's (tests/test_long_poll.py): the poll that takes a record
    published during the block went behind the block, in the same write."""
    async def scenario(c: fa.AsyncClient, url: str) -> None:
        await c.stream_create(T, N, S)
        await c.group_create(T, N, S, G)
        await c.group_poll(T, N, S, 0, G)  # scripts loaded, settings cached
        other = fa.connect(url)
        answers: list[Any] = []
        real = c._execute

        async def spy(op: Any) -> Any:
            answer = await real(op)
            answers.append((op, answer))
            return answer

        async def publish() -> None:
            await asyncio.sleep(0.3)
            await other.publish(T, N, S, b"job")

        monkeypatch.setattr(c, "_execute", spy)
        try:
            records, _ = await asyncio.gather(c.group_poll(T, N, S, 0, G, wait=5), publish())
        finally:
            await other.close()
        assert [r.payload for r in records] == [b"job"]
        assert [type(op).__name__ for op, _ in answers] == ["Eval", "BlockAny"], answers
        assert type(answers[1][1]).__name__ == "Took" and answers[1][1].moved
        assert await c.group_ack(T, N, S, 0, G, records[0]) is True

    run(redis_url, scenario)


def test_long_poll_wakes_on_nack_and_lapse(backend: tuple[str, Any]) -> None:
    async def scenario(c: fa.AsyncClient, url: str) -> None:
        await c.stream_create(T, N, S)
        await c.group_create(T, N, S, G, visibility_timeout_ms=4000)
        await c.publish(T, N, S, b"job")
        (held,) = await c.group_poll(T, N, S, 0, G)

        async def nack() -> None:
            await asyncio.sleep(0.1)
            await c.group_nack(T, N, S, 0, G, held)

        start = time.monotonic()
        records, _ = await asyncio.gather(c.group_poll(T, N, S, 0, G, wait=8), nack())
        assert [r.attempts for r in records] == [2]
        assert time.monotonic() - start < 2.0  # the nack woke it: the lease had 4 s to run

        # now a lease that lapses after 300 ms
        await c.group_extend(T, N, S, 0, G, records[0], by=0.3)
        start = time.monotonic()
        records = await c.group_poll(T, N, S, 0, G, wait=8)
        assert [r.attempts for r in records] == [3]
        assert 0.2 <= time.monotonic() - start < 4.0  # the lapse woke it, not the 8 s wait

    run(backend[0], scenario)


def test_long_poll_elapses(backend: tuple[str, Any]) -> None:
    async def scenario(c: fa.AsyncClient, url: str) -> None:
        await c.stream_create(T, N, S)
        await c.group_create(T, N, S, G)
        start = time.monotonic()
        assert await c.group_poll(T, N, S, 0, G, wait=0.3) == []
        assert 0.25 <= time.monotonic() - start < 2.0

    run(backend[0], scenario)


# ---------------------------------------------------------------- sharded


@pytest.mark.usefixtures("first_lead_zero")
def test_sharded_group(backend: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(c: fa.AsyncClient, url: str) -> None:
        await c.stream_create(T, N, S, shards=4)
        await c.group_create(T, N, S, G, visibility_timeout_ms=30_000)
        for shard in range(4):
            await c.publish_batch(T, N, S, [b"%d" % i for i in range(10)], shard=shard)
        group = c.group_sharded(T, N, S, G)
        items = await group.poll(16)
        assert Counter(i.shard for i in items) == {0: 10, 1: 6}  # the lead ran dry, the next shard filled up

        ops: list[Any] = []
        real = c._execute

        async def spy(op: Any) -> Any:
            ops.append(op)
            return await real(op)

        monkeypatch.setattr(c, "_execute", spy)
        assert await group.ack_many(items[:6]) == 6
        assert sum(type(e) is Eval and e.script == "group_ack"
                   for op in ops for e in (op.ops if type(op) is Batch else [op])) == len({i.shard for i in items[:6]})
        monkeypatch.undo()

        assert await group.ack_many(items[8:]) == 8
        six, seven = items[6], items[7]
        assert await group.nack(six) is False
        assert await group.nack_after(seven, 60) is False
        batch = await group.poll(16)
        (again,) = [i for i in batch if i.attempts == 2]
        assert (again.shard, again.offset) == (six.shard, six.offset)
        rest = [i for i in batch if i.attempts == 1]
        assert await group.ack_many(rest) == len(rest)
        assert await group.extend(again, by=30) > 0
        await group.dead_letter(again, reason="nope")
        assert [d.offset for d in await c.group_dead_letters(T, N, S, again.shard, G)] == [again.offset]
        assert await group.ack(seven) is True  # owed (nacked with a delay): an ack finishes it
        assert await group.ack(seven) is False  # finished already
        while batch := await group.poll(16):
            rest += batch
            assert await group.ack_many(batch) == len(batch)
        assert len(rest) == 40 - 16
        assert len({(i.shard, i.offset) for i in rest}) == len(rest)
        assert all(s.lag == 0 for s in (await c.group_describe(T, N, S, G)).shards)

    run(backend[0], scenario)


def test_sharded_long_poll_across_all_shards(backend: tuple[str, Any]) -> None:
    async def scenario(c: fa.AsyncClient, url: str) -> None:
        await c.stream_create(T, N, S, shards=4)
        await c.group_create(T, N, S, G)
        other = fa.connect(url)
        stamp: list[float] = []

        async def publish() -> None:
            await asyncio.sleep(0.2)
            stamp.append(time.monotonic())
            await other.publish(T, N, S, b"three", shard=3)

        try:
            items, _ = await asyncio.gather(c.group_sharded(T, N, S, G).poll(8, wait=2), publish())
            assert [(i.shard, i.payload) for i in items] == [(3, b"three")]
            assert time.monotonic() - stamp[0] < 0.5
        finally:
            await other.close()

    run(backend[0], scenario)


def test_a_reconnect_makes_the_sharded_group_ask_again_and_calls_alone_do_not(redis_url: str) -> None:
    """An asyncio client watches its connections as the sync one does: calls on a kept
    connection leave the client's epoch alone (the group keeps what it knows of idle
    shards), a connection the server dropped and the client made again bumps it once
    (the group asks every shard again: a restart may have rolled the logs back)."""
    import redis

    async def main() -> None:
        client = fa.connect(redis_url)
        killer = redis.Redis.from_url(redis_url)
        try:
            await client.stream_create(T, N, "reconnects", shards=2)
            await client.group_create(T, N, "reconnects", G)
            group = client.group_sharded(T, N, "reconnects", G)
            assert await group.poll(4) == []
            before = client.core.epoch
            for _ in range(5):
                await client.publish(T, N, "reconnects", b"x", shard=0)
            assert client.core.epoch == before
            conn = client._lane.conn  # the connection the client's calls use
            await conn.send_command("CLIENT", "ID")
            killer.client_kill_filter(_id=int(await conn.read_response()))
            await asyncio.sleep(0.2)
            await client.publish(T, N, "reconnects", b"y", shard=1)
            assert client.core.epoch > before
            got = await group.poll(16)
            assert sorted(i.payload for i in got) == [b"x"] * 5 + [b"y"]
        finally:
            killer.close()
            await client.close()

    asyncio.run(main())


# --------------------------------------------------------------- producers


def test_idempotent_producer(backend: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(c: fa.AsyncClient, url: str) -> None:
        await c.stream_create(T, N, S)
        a = await c.idempotent_producer()
        b = await c.idempotent_producer()
        assert a.id is not None and b.id is not None and a.id != b.id
        assert (await a.publish(T, N, S, b"first")).offset == 0
        lose_replies(c, monkeypatch)
        assert (await a.publish(T, N, S, b"once")).offset == 1
        monkeypatch.undo()
        assert (await c.stream_describe(T, N, S)).tails == [2]
        assert [p.offset for p in await a.publish_batch(T, N, S, [b"x", b"y"])] == [2, 3]
        assert (await b.publish_keyed(T, N, S, "k", b"z")).offset == 4
        # concurrent use of one producer is serialised, never a sequence error
        offsets = await asyncio.gather(*(a.publish(T, N, S, b"%d" % i) for i in range(20)))
        assert sorted(p.offset for p in offsets) == list(range(5, 25))

    run(backend[0], scenario)


def test_plain_publish_lost_reply_lands_once(backend: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(c: fa.AsyncClient, url: str) -> None:
        await c.stream_create(T, N, S)
        ops = lose_replies(c, monkeypatch)
        assert (await c.publish(T, N, S, b"once")).offset == 0
        assert sum(type(op) is Eval and op.script == "publish" for op in ops) == 2
        assert (await c.stream_describe(T, N, S)).tails == [1]
        assert (await c.publish(T, N, S, b"next")).offset == 1

    run(backend[0], scenario)


def test_sequence_error(backend: tuple[str, Any]) -> None:
    async def scenario(c: fa.AsyncClient, url: str) -> None:
        await c.stream_create(T, N, S)
        producer = await c.idempotent_producer()
        await producer.publish(T, N, S, b"a")
        producer._state.sequences[(c.core.name(T, N, S).path, 0)] = 7
        with pytest.raises(felix_redis.SequenceError):
            await producer.publish(T, N, S, b"b")
        assert (await producer.publish(T, N, S, b"c")).offset == 1  # starts over as a new producer
        assert (await c.stream_describe(T, N, S)).tails == [2]

    run(backend[0], scenario)


def test_gather_of_50_publishes(backend: tuple[str, Any]) -> None:
    async def scenario(c: fa.AsyncClient, url: str) -> None:
        await c.stream_create(T, N, S, shards=2)
        published = await asyncio.gather(*(c.publish(T, N, S, b"%d" % i) for i in range(50)))
        assert len(set(published)) == 50
        tails = (await c.stream_describe(T, N, S)).tails
        assert sum(tails) == 50
        for shard in range(2):
            assert sorted(p.offset for p in published if p.shard == shard) == list(range(tails[shard]))
        one = await asyncio.gather(*(c.publish(T, N, S, b"s%d" % i, shard=1) for i in range(50)))
        assert sorted(p.offset for p in one) == list(range(tails[1], tails[1] + 50))

    run(backend[0], scenario)


# --------------------------------------------------------------- subscribe


def test_subscribe_async_for(backend: tuple[str, Any]) -> None:
    async def scenario(c: fa.AsyncClient, url: str) -> None:
        await c.stream_create(T, N, S, shards=2)
        await c.group_create(T, N, S, G)
        for i in range(6):
            await c.publish(T, N, S, b"%d" % i, shard=i % 2)
        sub = await c.subscribe(T, N, S, start="earliest", block=0.2)
        seen = []
        async for record in sub:
            seen.append((record.shard, record.offset, record.attempts))
            if len(seen) == 6:
                break
        assert sorted(seen) == [(0, 0, 0), (0, 1, 0), (0, 2, 0), (1, 0, 0), (1, 1, 0), (1, 2, 0)]
        for shard in range(2):
            assert [o for s, o, _ in seen if s == shard] == [0, 1, 2]

        replay = await c.subscribe(T, N, S, start={0: 2}, shards=[0], block=0.1)
        assert [r.offset for r in await replay.poll()] == [2]
        latest = await c.subscribe(T, N, S, start="latest", block=0.1)
        assert await latest.poll() == []
        # the group never noticed the readers
        assert [s.position for s in (await c.group_describe(T, N, S, G)).shards] == [0, 0]
        with pytest.raises(felix_redis.InvalidArgument):
            await c.subscribe(T, N, S, start="newest")

    run(backend[0], scenario)


def test_subscribe_wakes_on_publish(backend: tuple[str, Any]) -> None:
    async def scenario(c: fa.AsyncClient, url: str) -> None:
        await c.stream_create(T, N, S)
        sub = await c.subscribe(T, N, S, start="latest", block=4)
        stamp: list[float] = []

        async def publish() -> None:
            await asyncio.sleep(0.2)
            stamp.append(time.monotonic())
            await c.publish(T, N, S, b"news")

        async def first() -> Any:
            async for record in sub:
                return record
            return None

        record, _ = await asyncio.gather(first(), publish())
        assert record.payload == b"news"
        assert time.monotonic() - stamp[0] < 0.5

    run(backend[0], scenario)


def test_group_sharded_can_be_awaited_like_every_other_call(backend: tuple[str, Any]) -> None:
    async def scenario() -> None:
        client = fa.connect(backend[0])
        await client.stream_create(T, N, S, shards=2)
        await client.group_create(T, N, S, G)
        await client.publish(T, N, S, b"x", shard=1)
        group = await client.group_sharded(T, N, S, G)
        (item,) = await group.poll(4)
        assert await group.ack(item)
        plain = client.group_sharded(T, N, S, G)
        assert await plain.poll(4) == []
        await client.close()

    asyncio.run(scenario())


def test_contract_names_and_awaitable_connect(backend: tuple[str, Any]) -> None:
    """felix_redis.asyncio has the contract's names: Client wraps a redis.asyncio client,
    and connect() gives a client whether or not it is awaited."""
    import redis.asyncio

    assert fa.Client is fa.AsyncClient

    async def scenario() -> None:
        client = await fa.connect(backend[0])
        assert isinstance(client, fa.Client)
        await client.stream_create(T, N, S)
        published = await client.publish(T, N, S, b"x")
        shard, offset = published
        assert (shard, offset) == (0, 0) and published == (0, 0)
        await client.close()
        if backend[0].startswith("redis://"):
            wrapped = fa.Client(redis.asyncio.Redis.from_url(backend[0]))
            assert [r.payload for r in await wrapped.read(T, N, S, 0, 0)] == [b"x"]
            await wrapped.close()

    asyncio.run(scenario())


def test_a_client_of_the_other_flavour_is_refused(redis_url: str) -> None:
    """A sync redis-py client given to the asyncio Client, or an asyncio one to the sync
    Client, is refused at once, naming what to use, instead of failing later."""
    import redis
    import redis.asyncio

    with pytest.raises(felix_redis.InvalidArgument, match=r"redis\.asyncio client"):
        fa.Client(redis.Redis.from_url(redis_url))
    with pytest.raises(felix_redis.InvalidArgument, match=r"felix_redis\.asyncio\.Client"):
        felix_redis.Client(redis.asyncio.Redis.from_url(redis_url))


def test_plain_publish_survives_a_shard_that_forgot_its_sequences(backend: tuple[str, Any]) -> None:
    """As the sync test in test_producer.py: the client's own publish starts over."""
    raw = backend[1]

    async def scenario(c: fa.AsyncClient, url: str) -> None:
        await c.stream_create(T, N, S)
        await c.publish(T, N, S, b"a", shard=0)
        meta = f"felix:{{{T}/{N}/{S}/0}}:meta"
        (field,) = [f for f in raw.hkeys(meta) if f.startswith(b"producer:")]
        saved = raw.hget(meta, field)
        await c.publish(T, N, S, b"b", shard=0)
        raw.hset(meta, field, saved)
        assert (await c.publish(T, N, S, b"c", shard=0)).offset == 2
        assert (await c.publish_batch(T, N, S, [b"d"], shard=0))[0].offset == 3
        assert [r.payload for r in await c.read(T, N, S, 0, 0)] == [b"a", b"b", b"c", b"d"]

    run(backend[0], scenario)
