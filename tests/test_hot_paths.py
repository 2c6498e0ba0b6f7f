"""The client's fast paths for poll, ack and publish (cached names and keys, plain ints
and Records taken as they are, EVALSHA without redis-py's Script object) behave exactly
like the checked paths: same results, same errors, nothing written on bad input, and
the scripts are loaded again when the server forgot them. No timing assertions."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from typing import Any

import pytest

import felix_redis
import felix_redis.asyncio as fa
from felix_redis import InvalidArgument, NotFound, Record
from felix_redis import protocol as P
from felix_redis.client import Item
from felix_redis.models import DeadLetter
from felix_redis.protocol import Eval, offsets_of, resolve

T, N, S, G = "acme", "prod", "jobs", "workers"


class Shard(enum.IntEnum):
    ONE = 1


class Name(str):
    """A str subclass: accepted as a name, never served from the caches."""


def rec(shard: int = 0, offset: int = 0, attempts: int = 1) -> Record:
    return Record(shard, offset, attempts, b"x", None, 0)


REFS: list[Any] = [
    0, 1, 15, 2**52, 2**52 + 1, -1, True, False, 1.0, "0:3:1", "0:3", "1:3:1", "bad", b"3", None,
    [3], Shard.ONE, rec(0, 7), rec(1, 7), rec(0, 9, attempts=0), Item(rec(0, 11)), Item(rec(2, 11)),
    DeadLetter(0, 12, 5, "r", 0), DeadLetter(1, 12, 5, "r", 0),
]


def outcome(call: Callable[[], Any]) -> Any:
    try:
        return ("ok", call())
    except Exception as exc:  # the comparison is the point
        return (type(exc), str(exc))


@pytest.mark.parametrize("ref", REFS, ids=repr)
@pytest.mark.parametrize("shard", [0, 1])
def test_offsets_of_agrees_with_resolve(ref: Any, shard: int) -> None:
    assert outcome(lambda: offsets_of([ref], shard)) == outcome(
        lambda: [resolve(ref, shard, need_attempts=False).offset])


def test_offsets_of_stops_at_the_first_bad_ref() -> None:
    with pytest.raises(InvalidArgument, match="shard 1, not shard 0"):
        offsets_of([1, 2, rec(1, 3), "nonsense"], 0)


def group_poll_evals(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch) -> list[Eval]:
    """Every Eval the client runs from now on."""
    real = client._execute
    seen: list[Eval] = []

    def spy(op: Any) -> Any:
        if type(op) is Eval:
            seen.append(op)
        return real(op)

    monkeypatch.setattr(client, "_execute", spy)
    return seen


def test_repeated_calls_send_the_same_keys_and_errors_stay_the_same(
    client: felix_redis.Client, unchanged: Callable[[], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    client.stream_create(T, N, S, shards=2)
    client.group_create(T, N, S, G)
    client.publish_batch(T, N, S, [b"a", b"b", b"c"], shard=1)
    seen = group_poll_evals(client, monkeypatch)
    first = client.group_poll(T, N, S, 1, G, max_records=1)
    again = client.group_poll(T, N, S, 1, G, max_records=1)
    assert [r.claim for r in first + again] == ["1:0:1", "1:1:1"]
    keys = client.group_keys(T, N, S, G, 1)[1]
    polls = [op for op in seen if op.script == "group_poll"]
    assert [op.keys for op in polls] == [list(keys.values())[:2] + list(keys.values())[3:]] * 2
    assert all(op.context == f"group {G} on stream {T}/{N}/{S} shard 1" for op in polls)
    # the cached path and the checked path give the same answers for the same input
    assert client.group_ack_many(T, N, S, 1, G, [first[0], again[0].offset]) == [True, True]
    assert client.group_ack(T, N, S, Shard.ONE, G, 0) is False  # an int subclass still works
    assert client.group_ack(T, N, S, 1, Name(G), 1) is False  # so does a str subclass
    assert client.group_poll(Name(T), Name(N), Name(S), 1, G)[0].claim == "1:2:1"

    bad: list[tuple[Callable[[], Any], type[Exception], str]] = [
        (lambda: client.group_poll(T, N, S, True, G), InvalidArgument, "shard must be an integer, got True"),
        (lambda: client.group_poll(T, N, S, 1.0, G), InvalidArgument, "shard must be an integer, got 1.0"),
        (lambda: client.group_poll(T, N, S, -1, G), InvalidArgument, "shard must be between"),
        (lambda: client.group_poll(T, N, S, 2, G), NotFound, "shard 2 does not exist"),
        (lambda: client.group_poll(T, N, S, 1, G, max_records=True), InvalidArgument, "max_records"),
        (lambda: client.group_poll(T, N, S, 1, G, max_records=0), InvalidArgument, "max_records"),
        (lambda: client.group_poll(T, N, S, 1, b"workers"), InvalidArgument, "group name must be a string"),
        (lambda: client.group_poll(T, N, S, 1, "wor kers"), InvalidArgument, "is not allowed"),
        (lambda: client.group_poll(T, N, [S], 1, G), InvalidArgument, "stream name must be a string"),
        (lambda: client.group_ack_many(T, N, S, True, G, [0]), InvalidArgument, "shard must be an integer"),
        (lambda: client.group_ack_many(T, N, S, 1, G, [0, rec(0, 1)]), InvalidArgument, "not shard 1"),
        (lambda: client.group_ack_many(T, N, S, 1, G, [0, -1]), InvalidArgument, "offset must be between"),
        (lambda: client.group_ack_many(T, N, S, 1, G, [0, True]), InvalidArgument, "expected a Record"),
        (lambda: client.group_ack_many(T, N, S, 1, G, "0"), InvalidArgument, "offsets must be a list"),
        (lambda: client.group_ack_many(T, N, S, 1, G, [0] * 10_001), InvalidArgument, "at most 10000"),
        (lambda: client.group_ack(T, N, S, 1, G, 1.5), InvalidArgument, "expected a Record"),
        (lambda: client.publish(T, N, S, 42), InvalidArgument, "payload must be bytes or str, got int"),
        (lambda: client.publish(T, N, S, b"x", shard=True), InvalidArgument, "shard must be an integer"),
        (lambda: client.publish(T, N, S, b"x", shard=2), NotFound, "shard 2 does not exist"),
        (lambda: client.publish(T, N, S, b"x", key=""), InvalidArgument, "record key must not be empty"),
        (lambda: client.publish(T, N, S, b"x" * (1024 * 1024 + 1)), InvalidArgument, "bytes; this stream accepts"),
    ]
    with unchanged():
        for call, error, message in bad:
            with pytest.raises(error, match=message):
                call()


def test_publish_equals_a_batch_of_one(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S, shards=3)
    assert client.publish(T, N, S, "text", shard=2) == felix_redis.Published(2, 0)
    assert client.publish(T, N, S, bytearray(b"raw"), shard=2) == felix_redis.Published(2, 1)
    keyed = client.publish(T, N, S, b"k", key="order-1")
    assert keyed.shard == felix_redis.shard_for_key(b"order-1", 3)
    assert client.publish_batch(T, N, S, [b"k"], key="order-1")[0] == felix_redis.Published(
        keyed.shard, keyed.offset + 1)
    assert [r.payload for r in client.read(T, N, S, 2, 0)] == [b"text", b"raw"]
    shards = {client.publish(T, N, S, b"rr").shard for _ in range(9)}
    assert shards == {0, 1, 2}  # round-robin, as before


def test_settings_are_reloaded_after_their_ttl_and_after_a_delete(
    client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.stream_create(T, N, S, shards=2)
    client.group_create(T, N, S, G)
    client.publish(T, N, S, b"x", shard=1)
    assert len(client.group_poll(T, N, S, 1, G)) == 1
    seen = group_poll_evals(client, monkeypatch)
    client.group_poll(T, N, S, 1, G)
    assert [op.script for op in seen] == ["group_poll"]  # settings and keys from the caches
    client.core.settings_ttl_s = 0
    client.group_poll(T, N, S, 1, G)
    client.group_ack_many(T, N, S, 1, G, [0])
    client.publish(T, N, S, b"x", shard=1)
    assert [op.script for op in seen[1:]] == ["stream_info", "group_poll", "stream_info", "group_ack",
                                              "stream_info", "publish"]
    client.core.settings_ttl_s = 60.0
    client.stream_delete(T, N, S)
    client.stream_create(T, N, S, shards=1)
    client.group_create(T, N, S, G)
    with pytest.raises(NotFound, match="shard 1 does not exist"):
        client.group_poll(T, N, S, 1, G)
    with pytest.raises(NotFound, match="shard 1 does not exist"):
        client.group_ack_many(T, N, S, 1, G, [0])
    assert client.group_poll(T, N, S, 0, G) == []


def test_the_caches_are_bounded(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(P, "CACHE_MAX", 4)
    client.stream_create(T, N, S, shards=2)
    groups = [f"g{i}" for i in range(6)]
    for group in groups:
        client.group_create(T, N, S, group)
    client.publish_batch(T, N, S, [b"a"], shard=0)
    got: list[str] = []
    for _ in range(2):
        for group in groups:
            for shard in (0, 1):
                got += [f"{group} {r.claim}" for r in client.group_poll(T, N, S, shard, group)]
    assert got == [f"{group} 0:0:1" for group in groups]
    for group in groups:
        assert client.group_ack_many(T, N, S, 0, group, [0]) == [True]
    core = client.core
    assert len(core._groups) <= 4 and len(core._names) <= 4 and len(core._shards) <= 4
    assert client.group_describe(T, N, S, "g5").shards[0].position == 1


def test_ack_and_poll_across_shards_use_the_same_keys(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S, shards=3)
    client.group_create(T, N, S, G)
    for shard in range(3):
        client.publish_batch(T, N, S, [b"a", b"b"], shard=shard)
    client.group_poll(T, N, S, 1, G, max_records=1)  # warm the cache for one shard
    group = client.group_sharded(T, N, S, G)
    items = group.poll(10)
    assert sorted(i.claim for i in items) == sorted(
        f"{s}:{o}:1" for s in range(3) for o in range(2) if (s, o) != (1, 0))
    assert group.ack_many(items) == 5
    assert client.group_ack(T, N, S, 1, G, 0) is True
    assert client.group_describe(T, N, S, G).lag == 0


def test_scripts_are_loaded_again_after_script_flush(
    redis_client: felix_redis.Client, raw: Any, redis_url: str
) -> None:
    """Without the Script object the client still answers NOSCRIPT by loading the script
    (a restarted or newly promoted server has none) and running the call again."""
    c = redis_client
    c.stream_create(T, N, S)
    c.group_create(T, N, S, G)
    raw.script_flush()
    assert c.publish(T, N, S, b"a") == felix_redis.Published(0, 0)
    raw.script_flush()
    records = c.group_poll(T, N, S, 0, G)
    assert [r.claim for r in records] == ["0:0:1"]
    raw.script_flush()
    assert c.group_ack_many(T, N, S, 0, G, records) == [True]

    async def scenario() -> None:
        ac = fa.connect(redis_url)
        try:
            raw.script_flush()
            assert (await ac.publish(T, N, S, b"b")).offset == 1
            raw.script_flush()
            got = await ac.group_poll(T, N, S, 0, G)
            assert [r.claim for r in got] == ["0:1:1"]
            raw.script_flush()
            assert await ac.group_ack_many(T, N, S, 0, G, [r.offset for r in got]) == [True]
        finally:
            await ac.close()

    asyncio.run(scenario())


def test_async_publish_and_drain_match_the_sync_client(backend: tuple[str, Any]) -> None:
    url = backend[0]

    async def scenario() -> None:
        c = fa.connect(url)
        try:
            await c.stream_create(T, N, S, shards=2)
            await c.group_create(T, N, S, G)
            assert await c.publish(T, N, S, "a", shard=1) == felix_redis.Published(1, 0)
            with pytest.raises(InvalidArgument, match="payload must be bytes or str, got list"):
                await c.publish(T, N, S, [b"a"])
            with pytest.raises(InvalidArgument, match="shard must be an integer, got True"):
                await c.group_poll(T, N, S, True, G)
            records = await c.group_poll(T, N, S, 1, G)
            again = await c.group_poll(T, N, S, 1, G)
            assert [r.claim for r in records] == ["1:0:1"] and again == []
            with pytest.raises(InvalidArgument, match="not shard 0"):
                await c.group_ack_many(T, N, S, 0, G, records)
            assert await c.group_ack_many(T, N, S, 1, G, records) == [True]
            assert await c.group_ack_many(T, N, S, 1, G, [0]) == [False]
        finally:
            await c.close()

    asyncio.run(scenario())


def test_checked_names_are_remembered_but_bad_names_are_always_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from felix_redis import keys

    monkeypatch.setattr(keys, "_checked", set())
    monkeypatch.setattr(keys, "_CHECKED_MAX", 3)
    for name in ["a", "b", "c", "d", "a"]:
        assert keys.check_name(name, "group") == name
    assert len(keys._checked) <= 3
    for bad, message in [("", "must not be empty"), ("a b", "is not allowed"), ("x" * 65, "characters long"),
                         (b"a", "must be a string, got bytes"), (None, "must be a string, got NoneType")]:
        with pytest.raises(InvalidArgument, match=message):
            keys.check_name(bad, "group")
    assert keys.check_name(Name("a"), "group") == "a"
    with pytest.raises(InvalidArgument, match="is not allowed"):
        keys.check_name(Name("a b"), "group")
