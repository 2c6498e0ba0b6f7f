"""felix-redis on a real Redis Cluster (3 primaries, 1 replica each, on loopback).

Shards spread over the primaries by their hash tags; every key of one shard lives in
one slot; quorum writes send WAIT to the node that took the write (sync and asyncio);
keyed publishes, sharded polling, long polls, describe and felixctl work across nodes.
The failover of a cluster primary under load is in ``test_failover.py``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.cluster import ClusterNode, RedisCluster

import felix_redis
import felix_redis.asyncio as felix_async
import felix_redis.client
from felix_redis.plans import Batch, Cmd, Eval
from felix_redis.testing.server import redis_server_binary
from felix_redis.testing.topology import ClusterTopology

pytestmark = pytest.mark.skipif(
    redis_server_binary() is None or shutil.which("redis-cli") is None,
    reason="redis-server and redis-cli are needed to form a cluster",
)

T, N = "acme", "prod"
SHARDS = 6


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterTopology]:
    with ClusterTopology(primaries=3, replicas_per_primary=1) as topology:
        yield topology


@pytest.fixture
def client(cluster: ClusterTopology) -> Iterator[felix_redis.Client]:
    c = felix_redis.connect(cluster.url)
    yield c
    c.close()


_names = iter(range(10**6))


def _stream(client: felix_redis.Client, **settings: Any) -> str:
    name = f"s{next(_names)}"
    settings.setdefault("shards", SHARDS)
    client.stream_create(T, N, name, **settings)
    return name


def _port_of(client: felix_redis.Client, stream: str, shard: int) -> int:
    """Port of the primary that holds ``shard`` of ``stream``."""
    return int(client.redis.get_node_from_key(client.core.name(T, N, stream).shard_keys(shard)[0]).port)


@contextlib.contextmanager
def _paused(port: int) -> Iterator[None]:
    """SIGSTOP the node on ``port`` (a replica that stops confirming), SIGCONT after."""
    pid = int(redis.Redis(port=port).info("server")["process_id"])
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_every_key_of_a_shard_shares_one_slot_and_shards_spread_over_all_primaries(
    client: felix_redis.Client, cluster: ClusterTopology
) -> None:
    stream = _stream(client)
    client.group_create(T, N, stream, "workers")
    name = client.core.name(T, N, stream)
    any_node = redis.Redis(port=cluster.primary_ports()[0])
    ports = set()
    for shard in range(SHARDS):
        keys = [*name.shard_keys(shard), *name.group_key_list(shard, "workers"), name.groups_key(shard)]
        slots = {int(any_node.execute_command("CLUSTER KEYSLOT", key)) for key in keys}
        assert len(slots) == 1, f"shard {shard}'s keys span slots {slots}"
        assert slots == {client.redis.keyslot(keys[0])}
        ports.add(_port_of(client, stream, shard))
    assert ports == set(cluster.primary_ports())


def test_keyed_publishes_route_by_key_and_land_on_the_shards_nodes(
    client: felix_redis.Client, cluster: ClusterTopology
) -> None:
    stream = _stream(client, replication=2, consistency="quorum")
    for i in range(60):
        key = f"customer-{i}"
        published = client.publish_keyed(T, N, stream, key, f"order-{i}")
        assert published.shard == zlib.crc32(key.encode()) % SHARDS
        # The record is on the node that owns the shard's slot, read straight from it.
        log_key = client.core.name(T, N, stream).shard_keys(published.shard)[1]
        node = redis.Redis(port=_port_of(client, stream, published.shard))
        assert node.xlen(log_key) >= 1
    tails = client.stream_describe(T, N, stream).tails
    assert sum(tails) == 60
    assert all(t > 0 for t in tails)


def test_replication_is_checked_against_every_shards_primary(client: felix_redis.Client) -> None:
    """Every primary has one replica: 2 copies. replication=2 with quorum is made and
    confirmed on every shard; replication=3 is refused, naming a shard and both numbers,
    nothing written."""
    assert client.stream_create(T, N, "two", shards=SHARDS, replication=2, consistency="quorum")
    assert {client.publish(T, N, "two", b"x", shard=s).offset for s in range(SHARDS)} == {0}
    with pytest.raises(felix_redis.InvalidArgument, match=r"replication=3 .* shard \d+'s primary has 2 now"):
        client.stream_create(T, N, "three", shards=SHARDS, replication=3, consistency="quorum")
    with pytest.raises(felix_redis.NotFound):
        client.stream_describe(T, N, "three")


def test_quorum_write_waits_on_the_node_that_took_it(client: felix_redis.Client, cluster: ClusterTopology) -> None:
    """Pause the replica of shard 0's primary: writes to shard 0 raise NotReplicated
    (and are applied); writes to shards on the other primaries are confirmed."""
    stream = _stream(client, replication=2, consistency="quorum")
    client.group_create(T, N, stream, "workers")
    primary = _port_of(client, stream, 0)
    other = next(s for s in range(SHARDS) if _port_of(client, stream, s) != primary)
    (replica,) = cluster.replica_ports(primary)
    with _paused(replica):
        with pytest.raises(felix_redis.NotReplicated, match=r"shard 0.*0 of 1 required replica"):
            client.publish(T, N, stream, b"unconfirmed", shard=0)
        assert client.publish(T, N, stream, b"confirmed", shard=other).offset == 0
    # Applied on the primary all the same; the next publish is a record of its own.
    (record,) = client.read(T, N, stream, 0, 0, 10)
    assert record.payload == b"unconfirmed"
    assert client.publish(T, N, stream, b"next", shard=0).offset == 1


def test_async_quorum_write_waits_on_the_node_that_took_it(cluster: ClusterTopology) -> None:
    sync = felix_redis.connect(cluster.url)
    stream = _stream(sync, replication=2, consistency="quorum")
    sync.group_create(T, N, stream, "workers")
    primary = _port_of(sync, stream, 0)
    other = next(s for s in range(SHARDS) if _port_of(sync, stream, s) != primary)
    (replica,) = cluster.replica_ports(primary)

    async def run() -> None:
        client = felix_async.connect(cluster.url)
        try:
            # Many writes at once open several connections to shard 0's primary.
            confirmed = await asyncio.gather(*(client.publish(T, N, stream, f"a{i}", shard=0) for i in range(20)))
            assert sorted(p.offset for p in confirmed) == list(range(20))
            with _paused(replica):
                # Each WAIT must go out on the connection of its own write: on another
                # connection it would see that connection's older, confirmed writes.
                results = await asyncio.gather(
                    *(client.publish(T, N, stream, f"b{i}", shard=0) for i in range(20)), return_exceptions=True
                )
                assert [type(r).__name__ for r in results] == ["NotReplicated"] * 20
                assert (await client.publish(T, N, stream, b"c", shard=other)).offset == 0
            records = await client.group_poll(T, N, stream, 0, "workers", max_records=100)
            assert len(records) == 40
        finally:
            await client.close()

    try:
        asyncio.run(run())
    finally:
        sync.close()


def test_sharded_group_polls_and_long_polls_across_nodes(client: felix_redis.Client) -> None:
    stream = _stream(client, replication=2, consistency="quorum")
    client.group_create(T, N, stream, "workers")
    for shard in range(SHARDS):
        client.publish(T, N, stream, f"r{shard}", shard=shard)
    group = client.group_sharded(T, N, stream, "workers")
    items = group.poll(16)
    assert sorted(i.shard for i in items) == list(range(SHARDS))
    assert group.ack_many(items) == SHARDS
    assert group.poll(16) == []

    # A long poll blocks on every node at once; a publish to a shard held by a node
    # other than shard 0's wakes it at once.
    far = next(s for s in range(SHARDS) if _port_of(client, stream, s) != _port_of(client, stream, 0))
    result: list[Any] = []
    waiter = threading.Thread(target=lambda: result.append((group.poll(4, wait=8), time.monotonic())), daemon=True)
    waiter.start()
    time.sleep(0.5)
    sent_at = time.monotonic()
    client.publish(T, N, stream, b"wake", shard=far)
    waiter.join(timeout=15)
    assert not waiter.is_alive(), "the long poll never returned"
    (items, got_at), = result
    assert [(i.shard, i.payload) for i in items] == [(far, b"wake")]
    # woken by the publish, not by the end of its 8 s wait (the bound leaves a loaded
    # machine seconds)
    assert got_at - sent_at < 4.0, f"the long poll answered {got_at - sent_at:.2f}s after the publish"


def test_a_group_over_several_streams_long_polls_all_of_them_across_nodes(client: felix_redis.Client) -> None:
    """Priorities across streams on a Cluster: one long poll blocks on every shard of
    every stream, wherever its node; a publish to the last stream, on a node other than
    the first stream's shard 0, wakes it."""
    first, last = _stream(client, shards=1), _stream(client, shards=SHARDS)
    for stream in (first, last):
        client.group_create(T, N, stream, "workers")
    group = client.group_sharded(T, N, [first, last], "workers", weights=[2, 1])
    assert group.poll(8) == []
    far = next(s for s in range(SHARDS) if _port_of(client, last, s) != _port_of(client, first, 0))
    result: list[Any] = []
    waiter = threading.Thread(target=lambda: result.append((group.poll(4, wait=8), time.monotonic())), daemon=True)
    waiter.start()
    time.sleep(0.5)
    sent_at = time.monotonic()
    client.publish(T, N, last, b"wake", shard=far)
    waiter.join(timeout=15)
    assert not waiter.is_alive(), "the long poll never returned"
    (items, got_at), = result
    assert [(i.stream, i.shard, i.payload) for i in items] == [(last, far, b"wake")]
    assert got_at - sent_at < 4.0, f"the long poll answered {got_at - sent_at:.2f}s after the publish"
    client.publish(T, N, first, b"urgent")
    assert group.ack_many(items) == 1
    assert [(i.stream, i.payload) for i in group.poll(4)] == [(first, b"urgent")]


def test_async_sharded_long_poll_across_nodes(cluster: ClusterTopology) -> None:
    sync = felix_redis.connect(cluster.url)
    stream = _stream(sync)
    sync.group_create(T, N, stream, "workers")
    far = next(s for s in range(SHARDS) if _port_of(sync, stream, s) != _port_of(sync, stream, 0))

    async def run() -> None:
        client = felix_async.connect(cluster.url)
        try:
            group = client.group_sharded(T, N, stream, "workers")
            started = time.monotonic()
            poll = asyncio.ensure_future(group.poll(4, wait=8))
            await asyncio.sleep(0.5)
            await client.publish(T, N, stream, b"wake", shard=far)
            items = await asyncio.wait_for(poll, 15)
            assert [(i.shard, i.payload) for i in items] == [(far, b"wake")]
            assert time.monotonic() - started < 4.5  # woken by the publish, not by the 8 s wait
        finally:
            await client.close()

    try:
        asyncio.run(run())
    finally:
        sync.close()


def test_describe_across_nodes(client: felix_redis.Client) -> None:
    stream = _stream(client, replication=2, consistency="quorum")
    client.group_create(T, N, stream, "workers")
    for shard in range(SHARDS):
        for i in range(shard + 1):
            client.publish(T, N, stream, f"{shard}-{i}", shard=shard)
    group = client.group_sharded(T, N, stream, "workers")
    taken = group.poll(3)
    info = client.stream_describe(T, N, stream)
    assert info.tails == [s + 1 for s in range(SHARDS)]
    assert (info.replication, info.consistency) == (2, "quorum")
    described = client.group_describe(T, N, stream, "workers")
    assert [s.tail for s in described.shards] == [s + 1 for s in range(SHARDS)]
    assert sum(s.in_flight for s in described.shards) == len(taken) == 3
    assert sum(s.lag for s in described.shards) == sum(range(1, SHARDS + 1))


def test_the_dashboards_reads_across_nodes(client: felix_redis.Client, cluster: ClusterTopology) -> None:
    """stream_overview, group_dead_letters_all, read_at and group_consumers over shards on
    different nodes (the Batch runs one pipeline per node there), sync and asyncio."""
    stream = _stream(client)
    client.group_create(T, N, stream, "workers")
    for shard in range(SHARDS):
        client.publish(T, N, stream, f"p{shard}", shard=shard)
    assert len({_port_of(client, stream, s) for s in range(SHARDS)}) > 1
    for shard in range(SHARDS):
        (rec,) = client.group_poll_as(T, N, stream, shard, "workers", f"c{shard % 2}", max_records=1)
        if shard % 2:
            client.group_dead_letter(T, N, stream, shard, "workers", rec.claim, reason=f"bad {shard}")
    info, groups = client.stream_overview(T, N, stream)
    assert info.tails == [1] * SHARDS and info.nodes is not None
    described = groups["workers"]
    assert isinstance(described, felix_redis.GroupInfo)
    assert described.dead == SHARDS // 2 and described.in_flight == SHARDS - SHARDS // 2
    dead = client.group_dead_letters_all(T, N, stream, "workers")
    assert [d.shard for d in dead] == [s for s in range(SHARDS) if s % 2]
    found = client.read_at(T, N, stream, [(d.shard, d.offset) for d in dead])
    assert [r.payload for r in found if r] == [f"p{s}".encode() for s in range(SHARDS) if s % 2]
    assert client.group_consumers(T, N, stream, "workers") == {"c0": [f"{s}:0" for s in range(0, SHARDS, 2)]}

    async def from_asyncio() -> None:
        ac = felix_async.connect(cluster.url)
        try:
            _info, again = await ac.stream_overview(T, N, stream)
            assert isinstance(again["workers"], felix_redis.GroupInfo) and again["workers"].dead == SHARDS // 2
            assert len(await ac.group_dead_letters_all(T, N, stream, "workers")) == SHARDS // 2
        finally:
            await ac.close()
    asyncio.run(from_asyncio())


def test_wrapping_a_redis_cluster_client(cluster: ClusterTopology) -> None:
    raw = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cluster.startup_nodes])
    client = felix_redis.Client(raw)
    try:
        stream = _stream(client, replication=2, consistency="quorum")
        client.group_create(T, N, stream, "workers")
        published = client.idempotent_producer().publish_keyed(T, N, stream, "k", b"via wrapped cluster")
        (record,) = client.group_poll(T, N, stream, published.shard, "workers")
        assert record.payload == b"via wrapped cluster"
        assert client.group_ack(T, N, stream, published.shard, "workers", record)
    finally:
        client.close()


def test_felixctl_on_a_cluster_url(client: felix_redis.Client, cluster: ClusterTopology) -> None:
    stream = _stream(client)
    client.group_create(T, N, stream, "workers")
    for shard in range(SHARDS):
        client.publish(T, N, stream, b"x", shard=shard)

    def felixctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "felixctl", "--redis-url", cluster.url, "--tenant", T, "--namespace", N, *args],
            capture_output=True, text=True, timeout=60,
        )

    described = felixctl("group", "describe", stream, "workers", "-o", "json")
    assert described.returncode == 0, described.stderr
    doc = json.loads(described.stdout)
    shards = doc["shards"] if isinstance(doc, dict) else doc
    assert [s["tail"] for s in shards] == [1] * SHARDS
    polled = felixctl("group", "poll", stream, "workers", "--max", "6")
    assert polled.returncode == 0, polled.stderr
    assert len(polled.stdout.splitlines()) == SHARDS
    # 2 copies, which every primary has: made, no warning
    big = felixctl("stream", "create", "big", "--shards", "2", "--replication", "2", "--consistency", "quorum")
    assert big.returncode == 0 and big.stderr == "", big.stderr
    # 3 copies: refused, one error line
    big3 = felixctl("stream", "create", "big3", "--shards", "2", "--replication", "3", "--consistency", "all")
    assert big3.returncode == 1
    assert big3.stderr.startswith("felixctl: error:") and "has 2 now" in big3.stderr


def test_prune_libraries_on_every_primary(client: felix_redis.Client) -> None:
    """An old version's library on every primary is deleted from each; this version's stays."""
    rc = client.redis
    old = "felix_00000000abcd"
    current = felix_redis.scripts.library().name
    client.load_library()
    code = f"#!lua name={old}\nredis.register_function('{old}_noop', function() return 1 end)"
    rc.execute_command("FUNCTION LOAD", "REPLACE", code, target_nodes=RedisCluster.PRIMARIES)

    def names(node: ClusterNode) -> set[bytes]:
        return {entry[1] for entry in rc.execute_command("FUNCTION LIST", target_nodes=node)}

    primaries = rc.get_primaries()
    assert len(primaries) == 3 and all({old.encode(), current.encode()} <= names(n) for n in primaries)
    assert client.prune_libraries() == [old]
    assert all(names(n) == {current.encode()} for n in primaries)
    assert client.prune_libraries() == []


# --------------------------------------------------------------------------- batches

def _poll_calls(client: felix_redis.Client, stream: str, groups: list[str]) -> list[Any]:
    """group_poll calls, one per shard, of ``groups[shard % len(groups)]``."""
    calls = []
    shards = client.stream_describe(T, N, stream).shards
    for shard in range(shards):
        _name, _settings, _shard, keys, context = client._drive(
            client.core.group_op(T, N, stream, shard, groups[shard % len(groups)]))
        calls.append(Eval("group_poll", list(keys), [16, "", 0], context))
    return calls


@contextlib.contextmanager
def _checkouts() -> Iterator[collections.Counter[int]]:
    """Connections taken from the synchronous node pools, by node port: every call or
    pipeline sent takes one (the old one-call-at-a-time batch took one per call)."""
    counts: collections.Counter[int] = collections.Counter()
    original = redis.ConnectionPool.get_connection

    def spy(self: redis.ConnectionPool, *args: Any, **kwargs: Any) -> Any:
        counts[int(self.connection_kwargs["port"])] += 1
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(redis.ConnectionPool, "get_connection", spy)
        yield counts


def _nodes_of(client: felix_redis.Client, stream: str, shards: range | list[int]) -> collections.Counter[int]:
    return collections.Counter(_port_of(client, stream, s) for s in shards)


def test_a_batch_over_shards_on_several_nodes_is_one_pipeline_per_node(client: felix_redis.Client) -> None:
    """A Batch of script calls over 9 shards on 3 primaries takes one connection (one
    round trip) per node, not one per call; so do stream_describe's, group_describe's
    and a sharded group's ack_many."""
    stream = _stream(client, shards=9)
    client.group_create(T, N, stream, "workers")
    for shard in range(9):
        client.publish(T, N, stream, f"r{shard}", shard=shard)
    nodes = _nodes_of(client, stream, range(9))
    assert len(nodes) == 3 and max(nodes.values()) >= 2
    calls = _poll_calls(client, stream, ["workers"])
    with _checkouts() as counts:
        replies = client._execute(Batch(calls))
    assert dict(counts) == {port: 1 for port in nodes}
    assert [int(r[4]) for r in replies] == [1] * 9  # each shard's record, in the calls' order

    with _checkouts() as counts:
        info = client.stream_describe(T, N, stream)
    assert info.tails == [1] * 9
    # shard 0's info first, then one pipeline per node for the rest
    assert sum(counts.values()) == 1 + len(_nodes_of(client, stream, range(1, 9)))
    with _checkouts() as counts:
        described = client.group_describe(T, N, stream, "workers")
    assert described.in_flight == 9
    assert max(counts.values()) <= 2 and sum(counts.values()) <= 1 + len(nodes)

    for shard in range(9):
        client.publish(T, N, stream, f"again{shard}", shard=shard)
    group = client.group_sharded(T, N, stream, "workers")
    items = group.poll(64)
    assert sorted(i.shard for i in items) == list(range(9))
    with _checkouts() as counts:
        assert group.ack_many(items) == 9
    assert dict(counts) == {port: 1 for port in nodes}


def test_a_batchs_replies_keep_the_calls_order_with_errors_in_place(client: felix_redis.Client) -> None:
    """Polls of a group that exists and of one that does not, alternating over shards
    on every node, a keyed command and one with no key: each reply (or NotFound) is at
    its call's place."""
    stream = _stream(client, shards=9)
    client.group_create(T, N, stream, "workers")
    for shard in range(9):
        client.publish(T, N, stream, f"r{shard}", shard=shard)
    calls = _poll_calls(client, stream, ["workers", "missing", "workers"])
    meta = client.core.name(T, N, stream).shard_keys(4)[0]
    calls[4:4] = [Cmd("EXISTS", meta, key=meta), Cmd("PING")]
    replies = client._execute(Batch(calls))
    kinds = [type(r).__name__ if isinstance(r, Exception) else "ok" for r in replies]
    assert kinds == ["ok", "NotFound", "ok", "ok", "ok", "ok", "NotFound", "ok", "ok", "NotFound", "ok"]
    assert replies[4] == 1 and replies[5] in (b"PONG", True, "PONG")
    assert "group missing" in str(replies[1]) and "shard 1" in str(replies[1])
    polled = [r for r in replies[:4] + replies[6:] if not isinstance(r, Exception)]
    assert [int(r[4]) for r in polled] == [1] * 6


def test_a_batch_loads_the_library_on_the_node_that_lost_it(client: felix_redis.Client) -> None:
    """FUNCTION FLUSH and SCRIPT FLUSH on the node holding the most shards: the batch's
    calls there are sent again once the library is loaded on that node; the others
    are answered at once."""
    stream = _stream(client, shards=9)
    client.group_create(T, N, stream, "workers")
    for shard in range(9):
        client.publish(T, N, stream, f"r{shard}", shard=shard)
    calls = _poll_calls(client, stream, ["workers"])
    client._execute(Batch(calls))  # every node has the library now
    ((port, held),) = _nodes_of(client, stream, range(9)).most_common(1)
    assert held >= 2
    node = redis.Redis(port=port)
    node.function_flush()
    node.script_flush()
    assert node.function_list() == []
    for shard in range(9):
        client.publish(T, N, stream, f"s{shard}", shard=shard)
    replies = client._execute(Batch(calls))
    assert [type(r).__name__ if isinstance(r, Exception) else int(r[4]) for r in replies] == [1] * 9
    if client._runner.functions:
        assert [lib[b"library_name"] if isinstance(lib, dict) else lib[1] for lib in node.function_list()] == [
            felix_redis.scripts.library().name.encode()]


def test_a_batch_follows_moved_after_a_stale_slot_map(
    client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's slot map names the wrong node for some shards' slots: those calls
    come back MOVED from the pipeline (they did not run), the slot map is read again
    and they are sent on their own to the right node; every reply is in its place."""
    seen: list[Any] = []
    original = felix_redis.client.pool_call_many

    def recording(pool: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
        replies = original(pool, commands)
        seen.extend(replies)
        return replies

    monkeypatch.setattr(felix_redis.client, "pool_call_many", recording)
    stream = _stream(client, shards=9)
    client.group_create(T, N, stream, "workers")
    for shard in range(9):
        client.publish(T, N, stream, f"r{shard}", shard=shard)
    calls = _poll_calls(client, stream, ["workers"])
    manager = client.redis.nodes_manager
    ports = [_port_of(client, stream, s) for s in range(9)]
    wrong = next(n for n in client.redis.get_primaries() if n.port != ports[0])
    moved = [s for s in range(9) if ports[s] == ports[0]]
    for shard in moved:
        manager.slots_cache[client.redis.keyslot(calls[shard].keys[0])] = [wrong]
    replies = client._execute(Batch(calls))
    assert [type(r).__name__ if isinstance(r, Exception) else int(r[4]) for r in replies] == [1] * 9
    assert sum(isinstance(r, redis.exceptions.MovedError) for r in seen) == len(moved)
    # the slot map was read again
    assert all(_port_of(client, stream, s) == ports[s] for s in range(9))


def test_a_nodes_lost_pipeline_fails_its_calls_only(
    client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipeline that loses its connection: each of that node's calls gets
    ConnectionFailed (as a lone call would), the other nodes' calls their replies."""
    stream = _stream(client, shards=9)
    client.group_create(T, N, stream, "workers")
    for shard in range(9):
        client.publish(T, N, stream, f"r{shard}", shard=shard)
    calls = _poll_calls(client, stream, ["workers"])
    ports = [_port_of(client, stream, s) for s in range(9)]
    ((lost, held),) = collections.Counter(ports).most_common(1)
    assert held >= 2
    original = felix_redis.client.pool_call_many

    def failing(pool: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
        if int(pool.connection_kwargs["port"]) == lost:
            raise redis.exceptions.ConnectionError("Connection reset by peer (test)")
        return original(pool, commands)

    monkeypatch.setattr(felix_redis.client, "pool_call_many", failing)
    replies = client._execute(Batch(calls))
    for shard, reply in enumerate(replies):
        if ports[shard] == lost:
            assert isinstance(reply, felix_redis.ConnectionFailed), reply
            assert "Connection reset by peer (test)" in str(reply)
        else:
            assert int(reply[4]) == 1


def test_async_batch_is_one_pipeline_per_node(cluster: ClusterTopology) -> None:
    """The asyncio client: one connection per node for a Batch (the nodes at once), the
    replies in the calls' order with NotFound in place, the library loaded again on a
    node that lost it, and a sharded group's ack_many one pipeline per node."""
    sync = felix_redis.connect(cluster.url)
    stream = _stream(sync, shards=9)
    sync.group_create(T, N, stream, "workers")
    for shard in range(9):
        sync.publish(T, N, stream, f"r{shard}", shard=shard)
    nodes = _nodes_of(sync, stream, range(9))
    calls = _poll_calls(sync, stream, ["workers", "missing", "workers"])
    ((port, held),) = nodes.most_common(1)
    assert held >= 2
    counts: collections.Counter[int] = collections.Counter()
    original = AsyncClusterNode.acquire_connection

    def spy(self: AsyncClusterNode) -> Any:
        counts[int(self.port)] += 1
        return original(self)

    async def run() -> None:
        client = felix_async.connect(cluster.url)
        try:
            await client.stream_describe(T, N, stream)  # the slot map and the library, first
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(AsyncClusterNode, "acquire_connection", spy)
                replies = await client._execute(Batch(calls))
                assert dict(counts) == {p: 1 for p in nodes}
            kinds = [type(r).__name__ if isinstance(r, Exception) else int(r[4]) for r in replies]
            assert kinds == [1, "NotFound", 1, 1, "NotFound", 1, 1, "NotFound", 1]

            node = redis.Redis(port=port)
            node.function_flush()
            node.script_flush()
            for shard in range(9):
                await client.publish(T, N, stream, f"s{shard}", shard=shard)
            again = await client._execute(Batch([c for i, c in enumerate(calls) if i % 3 != 1]))
            assert [int(r[4]) for r in again] == [1] * 6
            if client._runner.functions:
                assert len(node.function_list()) == 1

            for shard in range(9):
                await client.publish(T, N, stream, f"t{shard}", shard=shard)
            group = client.group_sharded(T, N, stream, "workers")
            items = await group.poll(64)
            assert {i.shard for i in items} == set(range(9))
            counts.clear()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(AsyncClusterNode, "acquire_connection", spy)
                assert await group.ack_many(items) == len(items)
            assert dict(counts) == {p: 1 for p in nodes}
        finally:
            await client.close()

    try:
        asyncio.run(run())
    finally:
        sync.close()
