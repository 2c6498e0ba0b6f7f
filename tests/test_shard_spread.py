"""A stream's shards spread evenly over the Redis Cluster slots (docs/keys.md).

Shard i of N gets a hash tag whose slot lies just after A + i * 16384 / N, A being the
slot of shard 0's tag: so a Cluster's primaries, each holding a contiguous range of
slots, hold shards in proportion to their share of the slots. Streams made before the
tags were spread keep their plain tags.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator

import pytest
import redis

import felix_redis
from felix_redis.keys import CLUSTER_SLOTS, SPREAD_WINDOW, StreamName, key_slot, spread_tag
from felix_redis.testing.server import redis_server_binary
from felix_redis.testing.topology import ClusterTopology

T, N = "acme", "prod"


@pytest.mark.parametrize("shards", [2, 3, 4, 6, 7, 16, 64, 100, 257, 1024])
def test_every_shard_lies_just_after_its_target(shards: int) -> None:
    path = f"{T}/{N}/s{shards}"
    anchor = key_slot(f"{path}/0")
    sample = range(shards) if shards <= 100 else [*range(5), shards // 2, shards - 1]
    for shard in sample:
        tag = spread_tag(path, shard, shards)
        if shard == 0:
            assert tag == f"{path}/0"
            continue
        assert tag.startswith(f"{path}/{shard}~")
        target = (anchor + shard * CLUSTER_SLOTS // shards) % CLUSTER_SLOTS
        assert (key_slot(tag) - target) % CLUSTER_SLOTS < SPREAD_WINDOW, (shard, tag, key_slot(tag), target)
        assert spread_tag(path, shard, shards) == tag  # the same tag in every process


def test_spread_tags_share_out_like_the_slot_ranges() -> None:
    """On the three equal slot ranges redis-cli makes, N shards land N/3 on each (+-1;
    exactly N/3 unless a stream's targets fall within SPREAD_WINDOW slots of a range's
    edge: about one stream in 40, none of these)."""
    ranges = [(0, 5460), (5461, 10922), (10923, 16383)]
    for stream in ("orders", "payments", "emails", "cj", "jobs"):
        for shards in (3, 6, 12, 30):
            name = StreamName.of("felix", T, N, stream).laid_out(shards)
            counts = Counter(next(i for i, (lo, hi) in enumerate(ranges) if lo <= key_slot(name.tag(s)) <= hi)
                             for s in range(shards))
            assert set(counts.values()) == {shards // 3} and len(counts) == 3, (stream, shards, counts)


def test_plain_names_keep_plain_tags() -> None:
    name = StreamName.of("felix", T, N, "old")
    assert name.spread == 0
    assert [name.tag(s) for s in range(4)] == [f"{T}/{N}/old/{s}" for s in range(4)]
    assert name.laid_out(4).tag(0) == name.tag(0)  # shard 0: the same either way


@pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")
def test_a_stream_made_with_plain_tags_keeps_them(redis_url: str, raw: redis.Redis) -> None:
    """A stream whose shard 0 records no spread (made before spreading) is addressed by
    its plain tags: create again, publish, poll, ack, describe, delete."""
    raw.flushdb()
    c = felix_redis.connect(redis_url)
    try:
        plain = StreamName.of("felix", T, N, "old")
        args = ["queue", "4", "0", "1", "leader", "0", "0", "1048576", plain.path, "0", "safe", "0"]
        for shard in reversed(range(4)):
            meta, _log, conf = plain.publish_keys(shard)
            c._eval(felix_redis.protocol.Eval("stream_create", plain.publish_keys(shard),
                                              [*args[:2], str(shard), *args[3:]], "raw"))
            raw.hdel(conf, "spread")  # made before spreading: no spread
        raw.zadd(f"felix:streams:{T}", {plain.path: 0})
        raw.sadd("felix:tenants", T)
        assert c.stream_create(T, N, "old", shards=4) is False
        for shard in range(4):  # the settings in conf, out of publishers' reach
            meta, _log, conf = plain.publish_keys(shard)
            assert set(raw.hkeys(meta)) == {b"tail", b"first"}
            assert raw.hget(conf, "kind") == b"queue" and raw.hget(conf, "shard") == str(shard).encode()
            assert raw.hexists(conf, "created")
        c.group_create(T, N, "old", "g")
        published = c.publish(T, N, "old", b"x", shard=3)
        assert raw.xlen(plain.shard_keys(3)[1]) == 1 and published.offset == 0
        (record,) = c.group_poll(T, N, "old", 3, "g")
        assert c.group_ack(T, N, "old", 3, "g", record) is True
        assert raw.exists(plain.group_key_list(3, "g")[0])
        assert c.stream_describe(T, N, "old").tags == [f"{T}/{N}/old/{s}" for s in range(4)]
        c.stream_delete(T, N, "old")
        assert not raw.keys(f"felix:{{{T}/{N}/old/*")
    finally:
        c.close()


@pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")
def test_a_new_stream_records_its_spread(redis_url: str, raw: redis.Redis) -> None:
    raw.flushdb()
    c = felix_redis.connect(redis_url)
    try:
        c.stream_create(T, N, "new", shards=6)
        info = c.stream_describe(T, N, "new")
        assert info.tags == [spread_tag(f"{T}/{N}/new", s, 6) for s in range(6)]
        assert info.nodes is None  # not a Cluster
        assert raw.hget(f"felix:{{{T}/{N}/new/0}}:conf", "spread") == b"6"
        assert not raw.hexists(f"felix:{{{T}/{N}/new/0}}:meta", "spread")  # settings are not in meta
        for shard in range(1, 6):
            assert raw.exists(f"felix:{{{info.tags[shard]}}}:meta")
        assert not raw.exists(f"felix:{{{T}/{N}/new/1}}:meta")
        with pytest.raises(felix_redis.StreamExists):
            c.stream_create(T, N, "new", shards=5)
    finally:
        c.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterTopology]:
    if redis_server_binary() is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are needed for a cluster")
    with ClusterTopology(primaries=3, replicas_per_primary=0) as topology:
        yield topology


@pytest.mark.parametrize("shards", [3, 6, 12])
def test_shards_spread_over_the_cluster_primaries(cluster: ClusterTopology, shards: int) -> None:
    """The issue's reproduction: a 6-shard stream on 3 primaries put 4 shards on one.
    Now each primary holds shards / 3 of them, as describe and felixctl show."""
    c = felix_redis.connect(cluster.url)
    try:
        stream = f"spread{shards}"
        c.stream_create(T, N, stream, shards=shards)
        info = c.stream_describe(T, N, stream)
        assert info.nodes is not None and len(info.nodes) == shards
        per_node = Counter(info.nodes)
        assert len(per_node) == 3 and set(per_node.values()) == {shards // 3}, per_node
        # the keys really live there
        for shard, node in enumerate(info.nodes):
            port = int(node.rsplit(":", 1)[1])
            assert redis.Redis(port=port).exists(c.core.name(T, N, stream).shard_keys(shard)[0])
        env = {**os.environ, "FELIX_REDIS_URL": cluster.url, "FELIX_TENANT": T, "FELIX_NAMESPACE": N}
        env.pop("FELIX_REDIS_URL_FILE", None)
        shown = subprocess.run([sys.executable, "-m", "felixctl", "stream", "describe", stream],
                               capture_output=True, text=True, env=env, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert "SLOT" in shown.stdout and "NODE" in shown.stdout
        for node, slot in zip(info.nodes, info.slots, strict=True):
            assert f"{slot}" in shown.stdout and node in shown.stdout
        as_json = subprocess.run([sys.executable, "-m", "felixctl", "stream", "describe", stream, "-o", "json"],
                                 capture_output=True, text=True, env=env, timeout=60)
        states = json.loads(as_json.stdout)["shard_states"]
        assert [s["node"] for s in states] == info.nodes and [s["slot"] for s in states] == info.slots
    finally:
        c.close()
