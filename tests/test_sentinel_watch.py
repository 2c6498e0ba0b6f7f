"""The Sentinel watch (felix_redis/sentinel_watch.py): a client learns of a new primary
from the sentinels' +switch-master announcements, on every sentinel, without a call of
its own, so it never writes to an old primary that is still running."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

import felix_redis
import felix_redis.asyncio as felix_async
from felix_redis.sentinel_watch import announced
from felix_redis.testing.server import redis_server_binary
from felix_redis.testing.topology import SentinelTopology

T, N, S = "acme", "prod", "orders"


def test_announcements_are_read_for_their_service_only() -> None:
    message = {"type": "message", "channel": b"+switch-master",
               "data": b"mymaster 127.0.0.1 6400 127.0.0.1 6401"}
    assert announced(message, "mymaster") == ("127.0.0.1", 6401)
    assert announced(message, "other") is None
    assert announced({**message, "type": "subscribe"}, "mymaster") is None
    assert announced({**message, "data": b"mymaster 127.0.0.1"}, "mymaster") is None
    assert announced(None, "mymaster") is None


@pytest.fixture
def topology() -> Iterator[SentinelTopology]:
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    # the launcher's settings (down-after 2 s): one failover, not a second one right
    # after it (felix_redis.testing.topology.SETTINGS)
    with SentinelTopology(replicas=2, sentinels=3, extra=("--repl-diskless-sync-delay", "0")) as t:
        yield t


def _until(check: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_a_handed_over_primary_is_left_at_once_sync_and_asyncio(topology: SentinelTopology) -> None:
    """SENTINEL FAILOVER: the old primary keeps running (and taking writes) until the
    sentinels turn it into a replica, up to 10 s later. Idle clients (no call during the
    failover) learn the new primary from the announcement, and their next write goes
    there: nothing is written to the old primary after the switch."""
    c = felix_redis.connect(topology.url)
    loop = asyncio.new_event_loop()
    a = loop.run_until_complete(felix_async.connect(topology.url))
    try:
        c.stream_create(T, N, S, shards=1)
        assert c.publish(T, N, S, b"before").offset == 0
        loop.run_until_complete(a.publish(T, N, S, b"async before"))
        host, port = topology.sentinel_addresses[1]
        with redis.Redis(host=host, port=port, socket_timeout=5) as sentinel:
            sentinel.execute_command("SENTINEL", "FAILOVER", topology.service_name)
        new_host, new_port = topology.wait_for_failover(timeout=30)
        # the sync client's watch moves its pool without a call of its own
        assert _until(lambda: tuple(c.redis.connection_pool.master_address or ()) == (new_host, new_port), 5)
        assert c._watch is not None and c._watch.switches >= 1

        async def asyncio_side() -> None:  # the loop runs: the async watch reads too
            deadline = time.monotonic() + 5
            while tuple(a.redis.connection_pool.master_address or ()) != (new_host, new_port):
                assert time.monotonic() < deadline, "the asyncio client did not hear of the new primary"
                await asyncio.sleep(0.02)
            await a.publish(T, N, S, b"async after")

        loop.run_until_complete(asyncio_side())
        c.publish(T, N, S, b"after")
        # each write goes to one server: on the new primary, both went there (a write
        # taken by the old one would be lost when the sentinels turn it into a replica)
        log = c.core.name(T, N, S).shard_keys(0)[1]
        with redis.Redis(port=new_port) as new:
            assert [e[1][b"p"] for e in new.xrange(log)] == [b"before", b"async before", b"async after", b"after"]
    finally:
        c.close()
        loop.run_until_complete(a.close())
        loop.close()


def test_a_sentinel_that_has_not_heard_of_the_failover_is_passed_over() -> None:
    """A sentinel that has not heard of a failover yet still names the old primary, and
    redis-py takes the first sentinel's answer. Here that sentinel never hears: two
    sentinels watch two separate servers under one service name, the first (asked
    first) naming ``old``. After the announcement that the service moved to ``new``,
    both clients write to ``new`` (their watches look, and their lanes connect anew),
    and nothing more reaches ``old``: without the managers passing over the out-of-date
    answer, the look gives up after LOOK_S and the writes go to ``old``."""
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    with SentinelTopology(replicas=0, sentinels=1) as lagging, SentinelTopology(replicas=0, sentinels=1) as told:
        old = ("127.0.0.1", lagging.primary.port)
        new = ("127.0.0.1", told.primary.port)
        sentinels = ",".join(f"{h}:{p}" for h, p in lagging.sentinel_addresses + told.sentinel_addresses)
        url = f"redis+sentinel://{sentinels}/{lagging.service_name}/0"
        with felix_redis.connect(f"redis://127.0.0.1:{new[1]}") as direct:
            direct.stream_create(T, N, S, shards=1)
        c = felix_redis.connect(url)
        loop = asyncio.new_event_loop()
        a = loop.run_until_complete(felix_async.connect(url))
        try:
            c.stream_create(T, N, S, shards=1)  # on old: the first sentinel names it
            assert c.publish(T, N, S, b"before").offset == 0
            loop.run_until_complete(a.publish(T, N, S, b"async before"))
            assert c._watch is not None and a._watch is not None
            c._watch.heard((old, new))  # what +switch-master <service> old new brings

            async def asyncio_side() -> None:
                assert a._watch is not None
                await a._watch.heard((old, new))
                await a.publish(T, N, S, b"async after")

            loop.run_until_complete(asyncio_side())
            c.publish(T, N, S, b"after")
            assert tuple(c.redis.connection_pool.master_address) == new
            log = c.core.name(T, N, S).shard_keys(0)[1]
            with redis.Redis(port=old[1]) as o, redis.Redis(port=new[1]) as n:
                assert [e[1][b"p"] for e in o.xrange(log)] == [b"before", b"async before"]
                assert sorted(e[1][b"p"] for e in n.xrange(log)) == [b"after", b"async after"]
        finally:
            c.close()
            loop.run_until_complete(a.close())
            loop.close()
