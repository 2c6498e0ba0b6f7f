"""Regression tests for bugs found while testing issue 4: long waits past the socket
timeout, producer sequences after NotReplicated or a cancel, claim strings in sharded
groups."""
from __future__ import annotations

import pytest

import felix_redis

T, N, S, G = "acme", "prod", "jobs", "workers"


def test_sharded_settle_with_claim_string_is_routed_or_refused(client: felix_redis.Client) -> None:
    """ShardedGroup.ack/nack/extend/dead_letter with a claim string leak AttributeError."""
    client.stream_create(T, N, S, shards=4)
    client.group_create(T, N, S, G)
    client.publish(T, N, S, b"x", shard=2)
    group = client.group_sharded(T, N, S, G)
    (item,) = group.poll(4)
    with pytest.raises(felix_redis.InvalidArgument):
        group.ack("not a claim")  # type: ignore[arg-type]
    # a claim string names its shard: it can be routed like an Item
    assert group.nack(item.claim) is False  # type: ignore[arg-type]


def _land_then_raise(client, monkeypatch, exc):
    real = client._execute
    left = [1]

    def lossy(op):
        if type(op).__name__ == "Eval" and op.script == "publish" and left[0]:
            left[0] -= 1
            real(op)
            raise exc
        return real(op)

    monkeypatch.setattr(client, "_execute", lossy)


def test_producer_after_not_replicated_does_not_drop_the_next_record(client, monkeypatch) -> None:
    """NotReplicated (the script ran on the primary) leaves the producer's sequence
    behind; the next publish re-uses it and is answered as a duplicate: silently dropped."""
    client.stream_create(T, N, S)
    producer = client.idempotent_producer()
    _land_then_raise(client, monkeypatch, felix_redis.NotReplicated("simulated: 0 of 1 replicas"))
    with pytest.raises(felix_redis.NotReplicated):
        producer.publish(T, N, S, b"first")
    second = producer.publish(T, N, S, b"second")
    payloads = [r.payload for r in client.read(T, N, S, 0, 0)]
    assert payloads == [b"first", b"second"], payloads
    assert second.offset == 1


def test_plain_publish_after_not_replicated_does_not_drop_the_next_record(client, monkeypatch) -> None:
    """the pooled producer goes back to the pool one sequence behind."""
    client.stream_create(T, N, S)
    _land_then_raise(client, monkeypatch, felix_redis.NotReplicated("simulated: 0 of 1 replicas"))
    with pytest.raises(felix_redis.NotReplicated):
        client.publish(T, N, S, b"first")
    second = client.publish(T, N, S, b"second")
    payloads = [r.payload for r in client.read(T, N, S, 0, 0)]
    assert payloads == [b"first", b"second"], payloads
    assert second.offset == 1


def test_async_publish_cancelled_after_landing_does_not_drop_the_next_record(backend, monkeypatch) -> None:
    """a plain publish cancelled (asyncio.wait_for timeout) after its script ran
    returns its pooled producer to the pool one sequence behind; the next publish is
    answered as a duplicate of the cancelled one and silently dropped."""
    import asyncio

    import felix_redis.asyncio as fa

    async def main() -> None:
        c = fa.connect(backend[0])
        await c.stream_create(T, N, S)
        real = c._execute
        left = [1]

        async def slow_reply(op):
            result = await real(op)
            if type(op).__name__ == "Eval" and op.script == "publish" and left[0]:
                left[0] -= 1
                await asyncio.sleep(10)  # the reply is slow to come back
            return result

        monkeypatch.setattr(c, "_execute", slow_reply)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(c.publish(T, N, S, b"first"), 0.2)
        import gc
        gc.collect()
        second = await c.publish(T, N, S, b"second")
        payloads = [r.payload for r in await c.read(T, N, S, 0, 0)]
        await c.close()
        assert payloads == [b"first", b"second"], payloads
        assert second.offset == 1

    asyncio.run(main())


def test_async_idempotent_producer_cancelled_after_landing(backend, monkeypatch) -> None:
    """same with AsyncIdempotentProducer."""
    import asyncio

    import felix_redis.asyncio as fa

    async def main() -> None:
        c = fa.connect(backend[0])
        await c.stream_create(T, N, S)
        producer = await c.idempotent_producer()
        real = c._execute
        left = [1]

        async def slow_reply(op):
            result = await real(op)
            if type(op).__name__ == "Eval" and op.script == "publish" and left[0]:
                left[0] -= 1
                await asyncio.sleep(10)
            return result

        monkeypatch.setattr(c, "_execute", slow_reply)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(producer.publish(T, N, S, b"first"), 0.2)
        second = await producer.publish(T, N, S, b"second")
        payloads = [r.payload for r in await c.read(T, N, S, 0, 0)]
        await c.close()
        assert payloads == [b"first", b"second"], payloads
        assert second.offset == 1

    asyncio.run(main())


def test_idle_long_poll_longer_than_5_seconds(redis_client) -> None:
    """redis-py 8 defaults socket_timeout to 5 s; an XREAD BLOCK of ~5 s or
    more times out on the socket, the retry layer repeats the same BlockAny until retry_for
    is spent, and the poll raises ConnectionFailed after ~40 s instead of [] after `wait`."""
    import time

    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, G)
    start = time.monotonic()
    assert redis_client.group_poll(T, N, S, 0, G, wait=6) == []
    assert time.monotonic() - start < 8


def test_idle_subscription_with_default_block(redis_client) -> None:
    """Subscription's default block is 5.0 s: an idle subscriber fails the same way."""
    import time

    redis_client.stream_create(T, N, S)
    sub = redis_client.subscribe(T, N, S, start="latest")  # block=5.0
    start = time.monotonic()
    assert sub.poll() == []
    assert time.monotonic() - start < 7


def test_async_idle_long_poll_longer_than_5_seconds(redis_client, redis_url) -> None:
    """The same, asyncio."""
    import asyncio
    import time

    import felix_redis.asyncio as fa

    async def main() -> None:
        c = fa.connect(redis_url)
        await c.stream_create(T, N, S)
        await c.group_create(T, N, S, G)
        start = time.monotonic()
        try:
            assert await c.group_poll(T, N, S, 0, G, wait=6) == []
        finally:
            await c.close()
        assert time.monotonic() - start < 8

    asyncio.run(main())


def test_long_poll_longer_than_socket_timeout(redis_url, raw) -> None:
    """wait longer than the URL's socket_timeout fails too."""
    import time

    sep = "&" if "?" in redis_url else "?"
    client = felix_redis.connect(f"{redis_url}{sep}socket_timeout=0.5")
    try:
        client.stream_create(T, N, S)
        client.group_create(T, N, S, G)
        start = time.monotonic()
        assert client.group_poll(T, N, S, 0, G, wait=1.5) == []
        assert time.monotonic() - start < 3
    finally:
        client.close()


def test_reclaim_wakes_other_long_pollers_for_what_it_left_owed(client, backend) -> None:
    """Reclaim makes the consumer's in-flight records owed now, but does not
    wake the group's long-pollers; what the reclaiming poll did not take waits until
    another poller's block ends (up to its whole wait)."""
    import threading
    import time

    client.stream_create(T, N, S)
    client.group_create(T, N, S, G, visibility_timeout_ms=30_000)
    for i in range(3):
        client.publish(T, N, S, b"%d" % i)
    assert len(client.group_poll_as(T, N, S, 0, G, consumer="w-7", max_records=3)) == 3
    other = felix_redis.connect(backend[0])
    got: list = []

    def long_poll() -> None:
        got.extend(other.group_poll(T, N, S, 0, G, max_records=10, wait=4))
        got.append(time.monotonic())

    thread = threading.Thread(target=long_poll, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)
        start = time.monotonic()
        (back,) = client.group_poll_as(T, N, S, 0, G, consumer="w-7", reclaim=True, max_records=1)
        thread.join(10)
        assert not thread.is_alive(), "the long poll never returned"
    finally:
        other.close()
    records, woke = got[:-1], got[-1]
    assert sorted(r.offset for r in records) == sorted({0, 1, 2} - {back.offset})
    assert woke - start < 1.0, f"the other poller woke after {woke - start:.2f}s"


def test_stream_create_with_more_shards_than_existing_writes_nothing(client: felix_redis.Client, unchanged) -> None:
    client.stream_create(T, N, S, shards=2)
    with unchanged(), pytest.raises(felix_redis.StreamExists):
        client.stream_create(T, N, S, shards=3)


def test_stream_delete_removes_producer_state_too(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S, shards=2)
    client.publish(T, N, S, b"a", shard=0)
    client.idempotent_producer().publish(T, N, S, b"b", shard=1)
    client.stream_delete(T, N, S)
    # the producer states lived in the shards' meta hashes; only the registry is left
    assert set(client.redis.keys("*")) <= {b"felix:streams:acme", b"felix:tenants"}


def test_sharded_batches_reload_scripts_after_script_flush(redis_client: felix_redis.Client, raw) -> None:
    """A batch's calls answered NOSCRIPT did not run: the scripts are loaded and only
    those calls are sent again (a restarted or newly promoted server has none)."""
    redis_client.stream_create(T, N, S, shards=3)
    redis_client.group_create(T, N, S, G)
    for shard in range(3):
        redis_client.publish_batch(T, N, S, [b"a", b"b"], shard=shard)
    group = redis_client.group_sharded(T, N, S, G)
    raw.script_flush()
    items = group.poll(6)
    assert sorted(i.claim for i in items) == sorted(f"{s}:{o}:1" for s in range(3) for o in range(2))
    raw.script_flush()
    assert group.ack_many(items) == 6
    assert redis_client.group_describe(T, N, S, G).lag == 0


def test_ack_many_tells_in_flight_owed_finished_and_repeats_apart(client: felix_redis.Client) -> None:
    """group_ack removes leases first and sorts out the rest only when some were not in
    flight: one call with leased, owed, finished and repeated offsets must still answer
    for each, finish the unfinished ones and leave no group state behind."""
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G)
    client.publish_batch(T, N, S, [b"a", b"b", b"c", b"d"])
    a, b, c, d = client.group_poll(T, N, S, 0, G, max_records=4)
    assert client.group_ack(T, N, S, 0, G, c) is True
    client.group_nack(T, N, S, 0, G, b, delay=60)  # owed, due in a minute
    statuses = client.group_ack_many(T, N, S, 0, G, [d.offset, b.offset, c.offset, a.offset, d.offset])
    assert statuses == [True, True, False, True, False]
    info = client.group_describe(T, N, S, G).shards[0]
    assert (info.in_flight, info.owed, info.position) == (0, 0, 4)
    keys = client.group_keys(T, N, S, G)[0]
    for role in ("attempts", "done", "owed"):
        assert not client.redis.exists(keys[role]), role
    # nothing left to hand out, and a repeat of the whole ack changes nothing
    assert client.group_poll(T, N, S, 0, G, max_records=4) == []
    assert client.group_ack_many(T, N, S, 0, G, [a.offset, b.offset]) == [False, False]


def test_a_poll_takes_one_lease_that_acks_nacks_and_lapses_split(client: felix_redis.Client) -> None:
    """A poll's new records share one lease: two members (the lease key's and the held
    key's) however many records it covers. A record leaving it (ack, nack, extend,
    lapse) splits it, the rest keeping the expiry; counts are per record; both keys go
    with the last lease, whichever way it ends."""
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G)
    client.publish_batch(T, N, S, [b"x"] * 100)
    keys = client.group_keys(T, N, S, G)[0]
    lease, held = keys["lease"], keys["held"]
    raw = client.redis
    records = client.group_poll(T, N, S, 0, G, max_records=100)
    ((first, expiry),) = raw.zrange(lease, 0, -1, withscores=True)
    assert (first, raw.zrange(held, 0, -1, withscores=True)) == (b"0", [(b"0", 99.0)])
    assert client.group_describe(T, N, S, G).in_flight == 100
    assert client.group_ack_many(T, N, S, 0, G, records[10:20]) == [True] * 10
    client.group_nack(T, N, S, 0, G, records[50], delay=60)
    assert raw.zrange(held, 0, -1, withscores=True) == [(b"0", 9.0), (b"20", 49.0), (b"51", 99.0)]
    assert {s for _, s in raw.zrange(lease, 0, -1, withscores=True)} == {expiry}
    later = client.group_extend(T, N, S, 0, G, records[30], by=600)
    assert raw.zscore(lease, "30") == later and raw.zscore(held, "30") == 30
    assert raw.zrange(held, 0, -1, withscores=True) == [
        (b"0", 9.0), (b"20", 29.0), (b"30", 30.0), (b"31", 49.0), (b"51", 99.0)]
    info = client.group_describe(T, N, S, G).shards[0]
    assert (info.in_flight, info.owed) == (89, 1)
    # the lease of 51..99 lapses: the next poll takes its 49 records back, owed, and
    # hands them out again with the nacked one when due (here: 1 record per poll)
    raw.zadd(lease, {"51": 1}, xx=True)
    info = client.group_describe(T, N, S, G).shards[0]
    assert (info.in_flight, info.owed) == (40, 50)
    (again,) = client.group_poll(T, N, S, 0, G, max_records=1)
    assert (again.offset, again.attempts) == (51, 2)
    info = client.group_describe(T, N, S, G).shards[0]
    assert (info.in_flight, info.owed) == (41, 49)
    client.group_ack_many(T, N, S, 0, G, range(100))
    assert not raw.exists(lease) and not raw.exists(held)
    assert client.group_describe(T, N, S, G).shards[0].position == 100


def test_leases_an_older_version_wrote_still_work(client: felix_redis.Client) -> None:
    """An older felix-redis kept one lease member per record (and, while leases existed,
    a member at +inf that is no lease) and no held key: each such member is a lease of
    one record, and the +inf member is removed by the next script that may write."""
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G)
    client.publish_batch(T, N, S, [b"a", b"b", b"c"])
    keys = client.group_keys(T, N, S, G)[0]
    lease, held = keys["lease"], keys["held"]
    raw = client.redis
    a, b = client.group_poll(T, N, S, 0, G, max_records=2)
    raw.delete(lease, held)
    sentinel = ("~felix-redis: keeps this sorted set a skiplist; not a lease, "
                "removed with the last lease (docs/keys.md)~")
    raw.zadd(lease, {"0": 10**13, "1": 10**13, sentinel: float("inf")})  # as an older version left it
    assert client.group_describe(T, N, S, G).in_flight == 2  # read only: counted as it is
    assert raw.zscore(lease, sentinel) is not None
    (c,) = client.group_poll(T, N, S, 0, G, max_records=1)
    assert raw.zscore(lease, sentinel) is None
    assert client.group_describe(T, N, S, G).in_flight == 3
    assert client.group_extend(T, N, S, 0, G, a, by=60) > 10**12  # an older lease found by its claim
    client.group_nack(T, N, S, 0, G, b, delay=60)
    assert client.group_describe(T, N, S, G).shards[0].owed == 1
    assert client.group_ack_many(T, N, S, 0, G, [a.offset, b.offset, c.offset]) == [True, True, True]
    assert not raw.exists(lease) and not raw.exists(held)
