"""Streams: create, describe, list, delete, and publishing (offsets, routing, payloads)."""

from __future__ import annotations

import zlib
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

import felix_redis
from felix_redis import Client

T, N, S = "acme", "prod", "jobs"
LOG0 = "felix:{acme/prod/jobs/0}:log"
META0 = "felix:{acme/prod/jobs/0}:meta"


def server_ms(r: Any) -> int:
    sec, usec = r.time()
    return int(sec) * 1000 + int(usec) // 1000


def offsets(client: Client, shard: int = 0, stream: str = S) -> list[int]:
    return [r.offset for r in client.read(T, N, stream, shard, 0, 10_000)]


# ----------------------------------------------------------------------------- create


@pytest.mark.parametrize("kind", ["queue", "stream"])
@pytest.mark.parametrize("shards", [1, 3])
def test_create_and_describe(client: Client, kind: str, shards: int) -> None:
    before = server_ms(client.redis)
    assert client.stream_create(T, N, S, kind=kind, shards=shards) is True
    after = server_ms(client.redis)
    info = client.stream_describe(T, N, S)
    assert (info.tenant, info.namespace, info.stream) == (T, N, S)
    assert info.kind == kind
    assert info.shards == shards
    assert info.replication == 1
    assert info.consistency == "leader"
    assert info.retention_max_len is None and info.retention_max_age is None
    assert info.max_payload == 1024 * 1024
    assert info.groups == []
    assert info.tails == [0] * shards
    assert info.firsts == [0] * shards
    assert before <= info.created_ms <= after
    assert info.created_at.utcoffset() == timedelta(0)


def test_create_with_retention_is_described(client: Client) -> None:
    client.stream_create(T, N, S, retention_max_len=1000, retention_max_age=3600, max_payload=64)
    info = client.stream_describe(T, N, S)
    assert (info.retention_max_len, info.retention_max_age, info.max_payload) == (1000, 3600, 64)


def test_create_same_settings_again_is_a_noop(client: Client, unchanged: Any) -> None:
    assert client.stream_create(T, N, S, kind="stream", shards=2) is True
    client.publish(T, N, S, b"x", shard=1)
    with unchanged():
        assert client.stream_create(T, N, S, kind="stream", shards=2) is False
    assert client.stream_describe(T, N, S).tails == [0, 1]


@pytest.mark.parametrize(
    "other",
    [
        {"kind": "stream"},
        {"shards": 1},
        {"max_payload": 10},
        {"retention_max_len": 5},
        {"retention_max_age": 60},
    ],
)
def test_create_with_other_settings_fails(client: Client, unchanged: Any, other: dict[str, Any]) -> None:
    client.stream_create(T, N, S, kind="queue", shards=2)
    with unchanged(), pytest.raises(felix_redis.StreamExists):
        client.stream_create(T, N, S, **{"kind": "queue", "shards": 2, **other})


def test_describe_lists_groups_and_tails(client: Client) -> None:
    client.stream_create(T, N, S, shards=2)
    client.group_create(T, N, S, "b-workers")
    client.group_create(T, N, S, "a-audit")
    client.publish_batch(T, N, S, [b"1", b"2", b"3"], shard=1)
    info = client.stream_describe(T, N, S)
    assert info.groups == ["a-audit", "b-workers"]
    assert info.tails == [0, 3]


def test_describe_unknown_stream(client: Client) -> None:
    with pytest.raises(felix_redis.NotFound):
        client.stream_describe(T, N, "nope")


# ------------------------------------------------------------------------------- list


def test_list_filters_by_tenant_and_namespace(client: Client) -> None:
    assert client.stream_list() == []
    client.stream_create("acme", "prod", "jobs")
    client.stream_create("acme", "prod", "mail")
    client.stream_create("acme", "dev", "jobs")
    client.stream_create("other", "prod", "jobs")
    assert sorted(client.stream_list()) == [
        ("acme", "dev", "jobs"), ("acme", "prod", "jobs"), ("acme", "prod", "mail"),
        ("other", "prod", "jobs"),
    ]
    assert sorted(client.stream_list("acme")) == [
        ("acme", "dev", "jobs"), ("acme", "prod", "jobs"), ("acme", "prod", "mail"),
    ]
    assert sorted(client.stream_list("acme", "prod")) == [("acme", "prod", "jobs"), ("acme", "prod", "mail")]
    assert client.stream_list(namespace="dev") == [("acme", "dev", "jobs")]
    assert client.stream_list("nobody") == []


# ----------------------------------------------------------------------------- delete


def test_delete_removes_every_key(client: Client) -> None:
    # A plain (non-idempotent) publisher: producer state keys are covered separately.
    plain = Client(client.redis, idempotent_publish=False)
    client.stream_create(T, N, S, shards=3)
    client.stream_create(T, N, "keep")
    client.group_create(T, N, S, "workers", visibility_timeout_ms=60_000)
    client.group_create(T, N, S, "audit")
    for i in range(9):
        plain.publish(T, N, S, f"r{i}".encode())
    for shard in range(3):
        records = client.group_poll_as(T, N, S, shard, "workers", consumer="w1", max_records=2)
        client.group_nack(T, N, S, shard, "workers", records[0], delay=5)
        client.group_dead_letter(T, N, S, shard, "workers", records[1], reason="x")
        client.group_ack(T, N, S, shard, "audit", client.group_poll(T, N, S, shard, "audit")[0])
    keep = set(client.redis.keys("*{acme/prod/keep/*"))
    assert keep

    client.stream_delete(T, N, S)

    left = set(client.redis.keys("*")) - keep
    assert left <= {b"felix:streams:acme", b"felix:tenants"}
    assert client.stream_list() == [(T, N, "keep")]
    with pytest.raises(felix_redis.NotFound):
        client.stream_describe(T, N, S)
    with pytest.raises(felix_redis.NotFound):
        client.publish(T, N, S, b"x")
    with pytest.raises(felix_redis.NotFound):
        client.stream_delete(T, N, S)
    # The name can be used again, from scratch.
    assert client.stream_create(T, N, S) is True
    assert client.publish(T, N, S, b"new") == felix_redis.Published(0, 0)


# ---------------------------------------------------------------------------- publish


def test_publish_offsets_are_dense_from_zero_per_shard(client: Client) -> None:
    client.stream_create(T, N, S, shards=3)
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for i in range(30):
        p = client.publish(T, N, S, f"{i}", shard=i % 3 if i < 15 else (i * 7) % 3)
        got[p.shard].append(p.offset)
    for shard, offs in got.items():
        assert offs == list(range(len(offs)))
        assert offsets(client, shard) == offs
    assert client.stream_describe(T, N, S).tails == [len(got[0]), len(got[1]), len(got[2])]


def test_publish_batch_is_dense_and_atomic(client: Client, unchanged: Any) -> None:
    client.stream_create(T, N, S, max_payload=10)
    first = client.publish_batch(T, N, S, [b"a", b"b", b"c"])
    assert first == [felix_redis.Published(0, i) for i in range(3)]
    assert client.publish(T, N, S, b"d").offset == 3
    second = client.publish_batch(T, N, S, [f"{i}" for i in range(50)])
    assert [p.offset for p in second] == list(range(4, 54))
    # One bad payload refuses the whole batch: nothing is written.
    with unchanged(), pytest.raises(felix_redis.InvalidArgument):
        client.publish_batch(T, N, S, [b"ok", b"ok", b"x" * 11, b"ok"])
    with unchanged(), pytest.raises(felix_redis.InvalidArgument):
        client.publish_batch(T, N, S, [])
    assert offsets(client) == list(range(54))
    payloads = [r.payload for r in client.read(T, N, S, 0, 0, 100)]
    assert payloads == [b"a", b"b", b"c", b"d", *[f"{i}".encode() for i in range(50)]]


@pytest.mark.parametrize("key", ["order-42", "ключ", "a", "customer/17:x y"])
def test_publish_keyed_routes_by_crc32(client: Client, key: str) -> None:
    client.stream_create(T, N, S, shards=7)
    want = zlib.crc32(key.encode()) % 7
    assert felix_redis.shard_for_key(key.encode(), 7) == want
    for i in range(3):
        p = client.publish_keyed(T, N, S, key, f"p{i}")
        assert p == felix_redis.Published(want, i)
    p = client.publish(T, N, S, b"via publish", key=key)
    assert p == felix_redis.Published(want, 3)
    records = client.read(T, N, S, want, 0)
    assert [r.key for r in records] == [key] * 4
    assert [r.payload for r in records] == [b"p0", b"p1", b"p2", b"via publish"]
    assert sum(client.stream_describe(T, N, S).tails) == 4


def test_publish_keyed_keeps_key_on_delivered_record(client: Client) -> None:
    client.stream_create(T, N, S, shards=4)
    client.group_create(T, N, S, "workers")
    p = client.publish_keyed(T, N, S, "order-42", b"job")
    (record,) = client.group_poll(T, N, S, p.shard, "workers")
    assert (record.key, record.payload, record.offset) == ("order-42", b"job", p.offset)
    unkeyed = client.publish(T, N, S, b"plain", shard=p.shard)
    (record,) = client.group_poll(T, N, S, p.shard, "workers")
    assert record.offset == unkeyed.offset and record.key is None


def test_publish_without_key_or_shard_spreads_evenly(client: Client) -> None:
    client.stream_create(T, N, S, shards=4)
    shards = Counter(client.publish(T, N, S, f"{i}").shard for i in range(40))
    assert shards == {0: 10, 1: 10, 2: 10, 3: 10}
    batches = Counter(client.publish_batch(T, N, S, [b"a", b"b"])[0].shard for _ in range(8))
    assert batches == {0: 2, 1: 2, 2: 2, 3: 2}


def test_explicit_shard_wins_over_key(client: Client) -> None:
    client.stream_create(T, N, S, shards=4)
    key = "order-42"
    other = (zlib.crc32(key.encode()) + 1) % 4
    p = client.publish(T, N, S, b"x", shard=other, key=key)
    assert p.shard == other
    assert client.read(T, N, S, other, 0)[0].key == key


def test_payload_str_is_utf8_and_bytes_round_trip(client: Client) -> None:
    client.stream_create(T, N, S)
    client.group_create(T, N, S, "workers")
    binary = bytes(range(256)) + b"\x00\x00tail\x00"
    client.publish(T, N, S, "grüße ✓")
    client.publish(T, N, S, binary)
    client.publish(T, N, S, b"")
    a, b, c = client.group_poll(T, N, S, 0, "workers")
    assert a.payload == "grüße ✓".encode()
    assert isinstance(a.payload, bytes)
    assert b.payload == binary
    assert c.payload == b""
    assert [r.payload for r in client.read(T, N, S, 0, 0)] == [a.payload, binary, b""]


def test_published_at_is_server_time(client: Client) -> None:
    client.stream_create(T, N, S)
    client.group_create(T, N, S, "workers")
    before = server_ms(client.redis)
    client.publish_batch(T, N, S, [b"a", b"b"])
    after = server_ms(client.redis)
    records = client.group_poll(T, N, S, 0, "workers")
    for record in records:
        assert before <= record.published_ms <= after
        assert record.published_at.utcoffset() == timedelta(0)
        assert record.published_at.timestamp() * 1000 == pytest.approx(record.published_ms, abs=1)
    # One batch: one publish time.
    assert records[0].published_ms == records[1].published_ms


def test_max_payload(client: Client, unchanged: Any) -> None:
    client.stream_create(T, N, S, max_payload=10)
    assert client.publish(T, N, S, b"x" * 10).offset == 0
    with unchanged(), pytest.raises(felix_redis.InvalidArgument, match="at most 10"):
        client.publish(T, N, S, b"x" * 11)
    with unchanged(), pytest.raises(felix_redis.InvalidArgument):
        client.publish(T, N, S, "ü" * 6)  # 12 bytes in UTF-8
    assert client.publish(T, N, S, b"y").offset == 1


def test_log_entry_id_is_offset_dash_ms(client: Client) -> None:
    client.stream_create(T, N, S)
    before = server_ms(client.redis)
    for i in range(20):
        client.publish(T, N, S, f"r{i}")
    after = server_ms(client.redis)
    entries = client.redis.xrange(LOG0, "15", "15")
    assert len(entries) == 1
    entry_id, fields = entries[0]
    off, ms = entry_id.split(b"-")
    assert int(off) == 15
    assert before <= int(ms) <= after
    assert fields[b"p"] == b"r15"
    assert [int(e[0].split(b"-")[0]) for e in client.redis.xrange(LOG0)] == list(range(20))
    assert int(client.redis.hget(META0, "tail")) == 20


def test_read_from_offset(client: Client) -> None:
    client.stream_create(T, N, S)
    client.publish_batch(T, N, S, [f"{i}" for i in range(10)])
    records = client.read(T, N, S, 0, 4, 3)
    assert [(r.offset, r.payload, r.attempts) for r in records] == [(4, b"4", 0), (5, b"5", 0), (6, b"6", 0)]
    assert client.read(T, N, S, 0, 10) == []


def test_oversize_first_publish_writes_nothing(client: Client, unchanged: Any) -> None:
    client.stream_create(T, N, S, max_payload=10)
    with unchanged(), pytest.raises(felix_redis.InvalidArgument):
        client.publish(T, N, S, b"x" * 11)  # not even a producer id is taken
    with unchanged(), pytest.raises(felix_redis.InvalidArgument):
        client.publish_batch(T, N, S, [b"ok", b"x" * 11])


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
