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
from felix_redis import InvalidArgument, NotFound, Record, caches
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
    [3], Shard.ONE, rec(0, 7), rec(1, 7), rec(0, 9, attempts=0), Item(rec(0, 11), S), Item(rec(2, 11), S),
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
    # meta, log, the group's keys and the shard's due index (the groups set is not passed)
    assert [op.keys for op in polls] == [list(keys.values())[:2] + list(keys.values())[3:]] * 2
    assert polls[0].keys[-1] == keys["due"]
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
    client.core.cache.settings_ttl_s = 0
    client.group_poll(T, N, S, 1, G)
    client.group_ack_many(T, N, S, 1, G, [0])
    client.publish(T, N, S, b"x", shard=1)
    assert [op.script for op in seen[1:]] == ["stream_info", "group_poll", "stream_info", "group_ack",
                                              "stream_info", "publish"]
    client.core.cache.settings_ttl_s = 60.0
    client.stream_delete(T, N, S)
    client.stream_create(T, N, S, shards=1)
    client.group_create(T, N, S, G)
    with pytest.raises(NotFound, match="shard 1 does not exist"):
        client.group_poll(T, N, S, 1, G)
    with pytest.raises(NotFound, match="shard 1 does not exist"):
        client.group_ack_many(T, N, S, 1, G, [0])
    assert client.group_poll(T, N, S, 0, G) == []


def test_the_caches_are_bounded(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(caches, "CACHE_MAX", 4)
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
    assert len(core.cache.groups) <= 4 and len(core.cache.names) <= 4 and len(core.cache.shards) <= 4
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


# ------------------------------------------------------------------ publish fast path


def plan_eval(client: felix_redis.Client, *args: Any) -> Eval:
    """The publish Eval the checked plan yields for a one-payload publish (not run)."""
    tenant, namespace, stream, payload, shard, key, producer = args
    plan = client.core.publish(tenant, namespace, stream, [payload], shard, key, producer)
    op = next(plan)
    plan.close()
    assert type(op) is Eval and op.script == "publish"
    return op


def test_quick_publish_sends_what_the_plan_sends(client: felix_redis.Client) -> None:
    """The fast path builds, from the caches, the very call the checked plan builds; and
    leaves every case it does not cover to the plan."""
    client.stream_create(T, N, S, shards=3)
    client.publish(T, N, S, b"warm")  # names and settings cached
    core = client.core
    producer = P.ProducerState(12345, local=True)
    producer.sequences[(f"{T}/{N}/{S}", 2)] = 6
    for shard, key, held in [(None, None, producer), (2, None, producer), (0, None, producer),
                             (None, "order-1", producer), (1, b"order-2", producer),
                             (None, None, None), (1, "order-3", None)]:  # None: without producer state
        # the same round-robin position for both
        core._round_robin = iter([7, 7])  # type: ignore[assignment]
        quick = core.quick_publish(T, N, S, b"x", shard, key, held)
        assert quick is not None
        op, slot = quick
        want = plan_eval(client, T, N, S, b"x", shard, key, held)
        assert (op.keys, op.args, op.context, op.replicas) == (want.keys, want.args, want.context, want.replicas)
        # the shard named by the key's hash tag (PATH/SHARD, or PATH/SHARD~SALT when spread)
        assert slot == (f"{T}/{N}/{S}", int(op.keys[0].split("/")[-1].split("}")[0].split("~")[0]))
        assert op.args[2] == (0 if held is None else producer.sequences.get(slot, 0) + 1)
    big = b"x" * (1024 * 1024 + 1)
    for args in [
        (Name(T), N, S, b"x", None, None, producer),  # not an exact str: never from the caches
        (T, N, "other", b"x", None, None, producer),  # a stream not seen yet
        (T, N, S, b"x", True, None, producer),  # a bool is no shard
        (T, N, S, b"x", 3, None, producer),  # no such shard
        (T, N, S, b"x", -1, None, producer),
        (T, N, S, big, None, None, producer),  # oversize: the plan refuses it
        (T, N, S, b"x", None, None, P.ProducerState()),  # no producer id yet
    ]:
        assert core.quick_publish(*args) is None
    core.cache.settings_ttl_s = 0  # stale settings: the plan reads them again
    assert core.quick_publish(T, N, S, b"x", None, None, producer) is None
    core.cache.settings_ttl_s = 60.0
    client.stream_create(T, N, "kept", retention_max_len=10)
    client.publish(T, N, "kept", b"warm")
    assert core.quick_publish(T, N, "kept", b"x", None, None, producer) is None  # it trims after publishing
    with pytest.raises(InvalidArgument, match="record key must not be empty"):
        core.quick_publish(T, N, S, b"x", None, "", producer)


def lose_first_reply(client: Any, monkeypatch: pytest.MonkeyPatch, asynchronous: bool = False) -> list[Any]:
    """The next publish script runs but its reply is lost (ConnectionFailed)."""
    real = client._execute
    ops: list[Any] = []

    def lose(op: Any) -> bool:
        ops.append(op)
        return type(op) is Eval and op.script == "publish" and sum(
            type(o) is Eval and o.script == "publish" for o in ops) == 1

    if asynchronous:
        async def alossy(op: Any) -> Any:
            result = await real(op)
            if lose(op):
                raise felix_redis.ConnectionFailed("simulated: reply lost")
            return result
        monkeypatch.setattr(client, "_execute", alossy)
    else:
        def lossy(op: Any) -> Any:
            result = real(op)
            if lose(op):
                raise felix_redis.ConnectionFailed("simulated: reply lost")
            return result
        monkeypatch.setattr(client, "_execute", lossy)
    return ops


@pytest.mark.parametrize("how", ["publish", "producer", "keyed"])
def test_fast_path_lost_reply_lands_once(
    client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A plain publish (borrowed producer) and an idempotent producer's publish on the
    fast path: a lost reply is sent again with the same sequence and lands once; the
    sequence moves on afterwards."""
    client.stream_create(T, N, S)
    producer = client.idempotent_producer()

    def publish(payload: bytes) -> felix_redis.Published:
        if how == "publish":
            return client.publish(T, N, S, payload)
        if how == "producer":
            return producer.publish(T, N, S, payload)
        return producer.publish_keyed(T, N, S, "k", payload)

    assert publish(b"warm").offset == 0  # caches filled: the next call takes the fast path
    ops = lose_first_reply(client, monkeypatch)
    assert publish(b"once").offset == 1
    sends = [op for op in ops if type(op) is Eval]
    assert len(sends) == 2 and sends[0].args == sends[1].args  # the same producer and sequence
    assert any(type(op) is P.Sleep for op in ops)
    assert publish(b"after").offset == 2
    assert [r.payload for r in client.read(T, N, S, 0, 0)] == [b"warm", b"once", b"after"]


def test_fast_path_refusal_keeps_the_sequence_and_interrupt_resets_it(
    client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.stream_create(T, N, S)
    producer = client.idempotent_producer()
    producer.publish(T, N, S, b"a")
    pid = producer.id
    real = client._execute

    def refuse(op: Any) -> Any:
        raise felix_redis.NotFound("simulated: stream deleted")

    monkeypatch.setattr(client, "_execute", refuse)
    with pytest.raises(NotFound, match="simulated"):
        producer.publish(T, N, S, b"b")
    monkeypatch.setattr(client, "_execute", real)
    assert producer.id == pid  # refused before anything was written: same producer
    assert producer.publish(T, N, S, b"b").offset == 1

    def interrupt(op: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(client, "_execute", interrupt)
    with pytest.raises(KeyboardInterrupt):
        producer.publish(T, N, S, b"c")
    monkeypatch.setattr(client, "_execute", real)
    assert producer.id is None  # outcome unknown: a new producer from here on
    assert producer.publish(T, N, S, b"c").offset == 2
    assert producer.id not in (None, pid)


def test_async_fast_path_lost_reply_lands_once(backend: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        c = fa.connect(backend[0])
        try:
            await c.stream_create(T, N, S)
            producer = await c.idempotent_producer()
            assert (await c.publish(T, N, S, b"warm")).offset == 0
            ops = lose_first_reply(c, monkeypatch, asynchronous=True)
            assert (await c.publish(T, N, S, b"once")).offset == 1
            assert len([op for op in ops if type(op) is Eval]) == 2
            monkeypatch.undo()
            ops = lose_first_reply(c, monkeypatch, asynchronous=True)
            assert (await producer.publish_keyed(T, N, S, "k", b"twice")).offset == 2
            assert len([op for op in ops if type(op) is Eval]) == 2
            assert (await c.publish(T, N, S, "after")).offset == 3
            assert [r.payload for r in await c.read(T, N, S, 0, 0)] == [b"warm", b"once", b"twice", b"after"]
        finally:
            await c.close()

    asyncio.run(scenario())
