"""A stream's ``replication`` and ``consistency`` on real servers (CONTRACT guarantee 10).

A primary with one replica on loopback: ``quorum``/``all`` writes return only once the
replica confirmed them, else ``NotReplicated`` (the write is applied on the primary);
``leader`` writes never wait; ``stream_create`` refuses more copies than the deployment
holds. Also: a wrapped ``Sentinel.master_for`` client, and the Sentinel URL options.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator

import pytest
import redis

import felix_redis
import felix_redis.asyncio as felix_async
from felix_redis.connection import async_client, parse_url, sync_client
from felix_redis.testing.server import RedisServer, redis_server_binary
from felix_redis.testing.topology import SentinelTopology

pytestmark = pytest.mark.skipif(
    redis_server_binary() is None, reason="redis-server is not installed (apt install redis-server)"
)

T, N = "acme", "prod"


class Pair:
    def __init__(self) -> None:
        self.primary = RedisServer()
        self.replica: RedisServer | None = None

    def start(self) -> Pair:
        self.primary.start()
        self.replica = RedisServer(extra=["--replicaof", "127.0.0.1", str(self.primary.port)])
        self.replica.start()
        self.wait_linked()
        return self

    def wait_linked(self, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        with redis.Redis(port=self.primary.port) as conn:
            while conn.info("replication").get("slave0", {}).get("state") != "online":
                assert time.monotonic() < deadline, "the replica did not come online"
                time.sleep(0.05)

    @contextlib.contextmanager
    def replica_paused(self) -> Iterator[None]:
        """SIGSTOP the replica: still connected, but it confirms nothing."""
        assert self.replica is not None and self.replica.process is not None
        os.kill(self.replica.process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.replica.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        for server in (self.replica, self.primary):
            if server is not None:
                server.stop()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    p = Pair()
    try:
        yield p.start()
    finally:
        p.stop()


_names = iter(range(10**6))


@pytest.fixture
def client(pair: Pair) -> Iterator[felix_redis.Client]:
    c = felix_redis.connect(pair.primary.url)
    yield c
    c.close()


def _stream(client: felix_redis.Client, **settings: object) -> str:
    name = f"s{next(_names)}"
    client.stream_create(T, N, name, **settings)  # type: ignore[arg-type]
    client.group_create(T, N, name, "workers")
    return name


def test_create_refuses_more_copies_than_the_primary_has_unless_forced(
    client: felix_redis.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """replication=2 with one replica: created quietly, its writes confirmed.
    replication=3 with one replica (2 copies): refused before anything is written, the
    error naming both numbers; force=True creates it with a warning, and an ``all``
    stream's writes then raise NotReplicated, applied on the primary."""
    with caplog.at_level(logging.WARNING, logger="felix_redis"):
        assert client.stream_create(T, N, "two-quorum", replication=2, consistency="quorum")
    assert not caplog.records
    client.group_create(T, N, "two-quorum", "workers")
    assert client.publish(T, N, "two-quorum", b"confirmed").offset == 0

    for consistency in ("leader", "quorum", "all"):
        with pytest.raises(felix_redis.InvalidArgument, match=r"replication=3 asks for 3 copies.*has 2 now"):
            client.stream_create(T, N, f"three-{consistency}", shards=3, replication=3, consistency=consistency)
        with pytest.raises(felix_redis.NotFound):
            client.stream_describe(T, N, f"three-{consistency}")
        assert (T, N, f"three-{consistency}") not in client.stream_list(T, N)

    # the creation itself WAITs for 2 replicas, like every write of an 'all' stream
    with caplog.at_level(logging.WARNING, logger="felix_redis"), \
            pytest.raises(felix_redis.NotReplicated, match="applied on every shard"):
        client.stream_create(T, N, "three-all", replication=3, consistency="all", force=True)
    (warning,) = caplog.records
    assert "has 2 now" in warning.getMessage() and "created anyway" in warning.getMessage()
    assert client.stream_describe(T, N, "three-all").replication == 3
    with pytest.raises(felix_redis.NotReplicated):
        client.publish(T, N, "three-all", b"unconfirmed")
    assert [r.payload for r in client.read(T, N, "three-all", 0, 0)] == [b"unconfirmed"]
    # the same call again: the stream exists with these settings, nothing to refuse (and
    # nothing to write: its WAIT still finds too few replicas)
    with pytest.raises(felix_redis.NotReplicated):
        client.stream_create(T, N, "three-all", replication=3, consistency="all")


def test_admin_writes_on_a_forced_stream_reach_every_shard_and_can_be_completed(
    client: felix_redis.Client,
) -> None:
    """On a stream whose writes cannot be confirmed (forced, all copies asked for), a
    multi-shard administrative call still writes every shard, then raises NotReplicated:
    the group is whole (listed, described), and group_delete removes it from every
    shard; stream_delete removes the stream."""
    with pytest.raises(felix_redis.NotReplicated, match="applied on every shard"):
        client.stream_create(T, N, "forced", shards=4, replication=3, consistency="all", force=True)
    assert client.stream_describe(T, N, "forced").shards == 4
    with pytest.raises(felix_redis.NotReplicated, match="not confirmed on: group g on stream acme/prod/forced shard 3"):
        client.group_create(T, N, "forced", "g")
    assert client.group_list(T, N, "forced") == ["g"]
    assert len(client.group_describe(T, N, "forced", "g").shards) == 4
    with pytest.raises(felix_redis.NotReplicated):
        client.group_configure(T, N, "forced", "g", max_attempts=9)
    assert client.group_describe(T, N, "forced", "g").max_attempts == 9
    with pytest.raises(felix_redis.NotReplicated):
        client.group_delete(T, N, "forced", "g")
    assert client.group_list(T, N, "forced") == []
    with pytest.raises(felix_redis.NotFound):
        client.group_delete(T, N, "forced", "g")
    with pytest.raises(felix_redis.NotReplicated):
        client.stream_delete(T, N, "forced")
    with pytest.raises(felix_redis.NotFound):
        client.stream_describe(T, N, "forced")
    assert (T, N, "forced") not in client.stream_list(T, N)


@pytest.mark.parametrize("consistency", ["quorum", "all"])
def test_unconfirmed_writes_raise_not_replicated_and_are_applied(
    client: felix_redis.Client, pair: Pair, consistency: str
) -> None:
    stream = _stream(client, replication=2, consistency=consistency)
    first = client.publish(T, N, stream, b"confirmed")
    (record,) = client.group_poll(T, N, stream, 0, "workers")
    with pair.replica_paused():
        started = time.monotonic()
        with pytest.raises(felix_redis.NotReplicated, match=r"0 of 1 required replica.*may not survive"):
            client.publish(T, N, stream, b"unconfirmed")
        assert time.monotonic() - started < 5  # WAIT's own timeout (2 s), not a hang
        with pytest.raises(felix_redis.NotReplicated):
            client.group_ack(T, N, stream, 0, "workers", record)
    # Both writes were applied on the primary.
    assert [r.payload for r in client.read(T, N, stream, 0, 0)] == [b"confirmed", b"unconfirmed"]
    shard = client.group_describe(T, N, stream, "workers").shards[0]
    assert (shard.position, shard.tail, shard.in_flight) == (first.offset + 1, 2, 0)


def test_leader_writes_do_not_wait(client: felix_redis.Client, pair: Pair) -> None:
    stream = _stream(client, replication=2, consistency="leader")
    with pair.replica_paused():
        started = time.monotonic()
        assert client.publish(T, N, stream, b"x").offset == 0
        assert time.monotonic() - started < 1


def test_a_replica_that_is_gone_fails_fast_and_new_replicated_streams_are_refused(
    client: felix_redis.Client, caplog: pytest.LogCaptureFixture
) -> None:
    # A primary of its own with a replica we stop for good.
    p = Pair()
    try:
        p.start()
        c = felix_redis.connect(p.primary.url)
        stream = _stream(c, replication=2, consistency="quorum")
        assert p.replica is not None
        p.replica.stop()
        with pytest.raises(felix_redis.NotReplicated, match="0 of 1"):
            c.publish(T, N, stream, b"alone")
        with pytest.raises(felix_redis.InvalidArgument, match=r"replication=2 .* has 1 now \(itself and 0 connected"):
            c.stream_create(T, N, "another", replication=2, consistency="quorum")
        with caplog.at_level(logging.WARNING, logger="felix_redis"), pytest.raises(felix_redis.NotReplicated):
            c.stream_create(T, N, "another", replication=2, consistency="quorum", force=True)
        assert "itself and 0 connected replica(s)" in caplog.text
        with pytest.raises(felix_redis.NotReplicated, match="0 of 1"):
            c.publish(T, N, "another", b"alone too")
        c.close()
    finally:
        p.stop()


def test_scripts_are_reloaded_after_noscript(client: felix_redis.Client, pair: Pair) -> None:
    """A restarted or promoted server has an empty script cache: the quorum write path
    (EVALSHA + WAIT on one connection) loads the script and runs it again."""
    stream = _stream(client, replication=2, consistency="quorum")
    client.publish(T, N, stream, b"a")
    with redis.Redis(port=pair.primary.port) as raw:
        raw.script_flush()
    assert client.publish(T, N, stream, b"b").offset == 1
    (record, _) = client.group_poll(T, N, stream, 0, "workers", max_records=2)
    with redis.Redis(port=pair.primary.port) as raw:
        raw.script_flush()
    assert client.group_ack(T, N, stream, 0, "workers", record)


def test_async_quorum_writes(pair: Pair) -> None:
    sync = felix_redis.connect(pair.primary.url)
    stream = _stream(sync, replication=2, consistency="quorum")

    async def run() -> None:
        client = felix_async.connect(pair.primary.url)
        try:
            assert (await client.publish(T, N, stream, b"a")).offset == 0
            with redis.Redis(port=pair.primary.port) as raw:
                raw.script_flush()
            assert (await client.publish(T, N, stream, b"b")).offset == 1
            with pair.replica_paused():
                results = await asyncio.gather(
                    *(client.publish(T, N, stream, f"c{i}") for i in range(5)), return_exceptions=True
                )
                assert [type(r).__name__ for r in results] == ["NotReplicated"] * 5
        finally:
            await client.close()

    try:
        asyncio.run(run())
        assert sync.stream_describe(T, N, stream).tails == [7]
    finally:
        sync.close()


def test_a_publish_after_not_replicated_is_a_new_record(client: felix_redis.Client, pair: Pair) -> None:
    """The unreplicated publish used its sequence: the next one must not be taken for
    a re-send of it (and dropped)."""
    stream = _stream(client, replication=2, consistency="quorum")
    producer = client.idempotent_producer()
    with pair.replica_paused(), pytest.raises(felix_redis.NotReplicated):
        producer.publish(T, N, stream, b"unconfirmed")
    published = producer.publish(T, N, stream, b"next")
    (stored,) = client.read(T, N, stream, 0, published.offset, 1)
    assert stored.payload == b"next"


def test_wrapping_a_sentinel_master_client() -> None:
    with SentinelTopology(replicas=1, sentinels=3) as topology:
        master = topology.sentinel_client().master_for(topology.service_name)
        client = felix_redis.Client(master)
        try:
            client.stream_create(T, N, "jobs", replication=2, consistency="quorum")
            client.group_create(T, N, "jobs", "workers")
            assert client.publish(T, N, "jobs", b"via master_for").offset == 0
            (record,) = client.group_poll(T, N, "jobs", 0, "workers")
            assert client.group_ack(T, N, "jobs", 0, "workers", record)
            # The URL form reaches the same primary.
            by_url = felix_redis.connect(topology.url)
            assert by_url.stream_describe(T, N, "jobs").tails == [1]
            by_url.close()
        finally:
            client.close()


def test_sentinel_url_options_reach_the_right_connections() -> None:
    url = ("rediss+sentinel://app:secret@s1:26379,s2:26380/orders/3"
           "?sentinel_password=spw&ssl_cert_reqs=none&ssl_ca_certs=/etc/ca.pem")
    parsed = parse_url(url)
    assert parsed.hosts == [("s1", 26379), ("s2", 26380)]
    assert (parsed.service, parsed.db, parsed.username, parsed.password) == ("orders", 3, "app", "secret")
    for raw in (sync_client(url), async_client(url)):
        pool = raw.connection_pool
        assert pool.service_name == "orders"
        data = pool.connection_kwargs
        assert (data["username"], data["password"], data["db"]) == ("app", "secret", 3)
        assert data["ssl_cert_reqs"] == "none" and data["ssl_ca_certs"] == "/etc/ca.pem"
        for sentinel in pool.sentinel_manager.sentinels:
            kwargs = sentinel.connection_pool.connection_kwargs
            assert kwargs["password"] == "spw"  # the sentinels' own password, not the data one
            assert "SSL" in sentinel.connection_pool.connection_class.__name__
