"""Sharded groups: one group polled fairly across every shard of a stream, with settles
routed to the item's shard and long polls that block on all shards at once."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import felix_redis
from felix_redis.keys import GROUP_ROLES
from felix_redis.protocol import Batch, BlockAny, Eval

T, N, S, G = "acme", "prod", "jobs", "workers"


@pytest.fixture
def other(backend: tuple[str, Any]) -> Iterator[felix_redis.Client]:
    c = felix_redis.connect(backend[0])
    yield c
    c.close()


def setup(client: felix_redis.Client, shards: int = 4, fill: dict[int, int] | None = None, **group: Any) -> None:
    client.stream_create(T, N, S, shards=shards)
    client.group_create(T, N, S, G, **group)
    for shard, count in (fill or {}).items():
        for start in range(0, count, 1000):
            client.publish_batch(
                T, N, S, [b"%d-%d" % (shard, i) for i in range(start, min(count, start + 1000))], shard=shard)


def spy(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    ops: list[Any] = []
    real = client._execute

    def run(op: Any) -> Any:
        ops.append(op)
        return real(op)

    monkeypatch.setattr(client, "_execute", run)
    return ops


def later(fn: Callable[[], Any], after: float) -> threading.Thread:
    def run() -> None:
        time.sleep(after)
        fn()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------------- fairness


def test_poll_takes_from_every_shard(client: felix_redis.Client) -> None:
    setup(client, fill={0: 100, 1: 100, 2: 100, 3: 100})
    group = client.group_sharded(T, N, S, G)
    items = group.poll(8)
    assert len(items) == 8
    assert Counter(i.shard for i in items) == {0: 2, 1: 2, 2: 2, 3: 2}
    for item in items:
        assert item.attempts == 1
        assert item.payload == b"%d-%d" % (item.shard, item.offset)
        assert item.claim == f"{item.shard}:{item.offset}:1"
    # offset order within each shard
    for shard in range(4):
        assert [i.offset for i in items if i.shard == shard] == [0, 1]


def test_poll_fills_up_from_shards_that_have_more(client: felix_redis.Client) -> None:
    setup(client, fill={0: 100, 1: 1, 3: 100})
    group = client.group_sharded(T, N, S, G)
    items = group.poll(16)
    assert len(items) == 16
    counts = Counter(i.shard for i in items)
    assert counts[1] == 1 and counts[2] == 0
    assert counts[0] >= 4 and counts[3] >= 4
    assert len({(i.shard, i.offset) for i in items}) == 16


def test_hot_shard_does_not_starve_the_others(client: felix_redis.Client) -> None:
    setup(client, fill={0: 1000, 1: 10, 2: 10, 3: 10})
    group = client.group_sharded(T, N, S, G)
    drained_at: dict[int, int] = {}
    seen: Counter[int] = Counter()
    for n in range(1, 21):
        items = group.poll(16)
        assert len(items) == 16
        seen.update(i.shard for i in items)
        for shard in (1, 2, 3):
            if seen[shard] == 10 and shard not in drained_at:
                drained_at[shard] = n
        group.ack_many(items)
    assert set(drained_at) == {1, 2, 3}, seen
    assert max(drained_at.values()) <= 4, drained_at
    # and the hot shard got everything else
    assert seen[0] == 20 * 16 - 30


def test_small_polls_rotate_over_shards(client: felix_redis.Client) -> None:
    setup(client, fill={0: 10, 1: 10, 2: 10, 3: 10})
    group = client.group_sharded(T, N, S, G)
    shards = [group.poll(1)[0].shard for _ in range(8)]
    assert Counter(shards) == {0: 2, 1: 2, 2: 2, 3: 2}, shards


def test_poll_skips_empty_shards(client: felix_redis.Client) -> None:
    setup(client, fill={2: 3})
    group = client.group_sharded(T, N, S, G)
    for _ in range(3):
        (item,) = group.poll(1)
        assert item.shard == 2
        group.ack(item)
    assert group.poll(4) == []


def test_redeliveries_come_first_on_their_shard(client: felix_redis.Client) -> None:
    setup(client, shards=2, fill={0: 5, 1: 5})
    group = client.group_sharded(T, N, S, G)
    items = group.poll(4)
    for item in items:
        assert group.nack(item) is False
    again = group.poll(4)
    assert sorted((i.shard, i.offset, i.attempts) for i in again) == sorted(
        (i.shard, i.offset, 2) for i in items)


# ------------------------------------------------------------------- routing


def test_settles_are_routed_to_the_items_shard(client: felix_redis.Client) -> None:
    setup(client, fill={0: 2, 1: 2, 2: 2, 3: 2}, visibility_timeout_ms=30_000)
    group = client.group_sharded(T, N, S, G)
    items = {(i.shard, i.offset): i for i in group.poll(8)}
    assert len(items) == 8

    assert group.ack(items[1, 0]) is True
    assert group.ack(items[1, 0]) is False  # already finished
    assert group.nack(items[2, 0]) is False
    assert group.nack_after(items[3, 1], 60) is False
    expiry = group.extend(items[0, 1], by=120)
    group.dead_letter(items[3, 0], reason="bad card")

    shards = client.group_describe(T, N, S, G).shards
    assert [s.position for s in shards] == [0, 1, 0, 1]
    assert [s.in_flight for s in shards] == [2, 1, 1, 0]
    assert [s.owed for s in shards] == [0, 0, 1, 1]
    assert [s.dead for s in shards] == [0, 0, 0, 1]
    (dead,) = client.group_dead_letters(T, N, S, 3, G)
    assert (dead.offset, dead.attempts, dead.reason) == (0, 1, "bad card")
    assert client.group_dead_letters(T, N, S, 0, G) == []

    # the extended lease is 120 s from now, by the server's clock
    server_ms = client.redis.time()
    now_ms = server_ms[0] * 1000 + server_ms[1] // 1000
    assert 119_000 < expiry - now_ms <= 120_000

    # only the nack with no delay is due: it comes back on shard 2, attempts 2
    (redelivered,) = group.poll(8)
    assert (redelivered.shard, redelivered.offset, redelivered.attempts) == (2, 0, 2)


def test_settles_accept_records_and_stale_claims_fail(client: felix_redis.Client) -> None:
    setup(client, fill={1: 1})
    group = client.group_sharded(T, N, S, G)
    (item,) = group.poll(4)
    assert group.nack(item.record) is False
    with pytest.raises(felix_redis.StaleClaim):
        group.nack(item)
    (again,) = group.poll(4)
    assert again.attempts == 2
    assert group.ack(again.record) is True


def test_ack_many_batches_per_shard(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    setup(client, fill={0: 10, 1: 10, 2: 10, 3: 10})
    group = client.group_sharded(T, N, S, G)
    items = group.poll(16) + group.poll(16)
    assert len(items) == 32
    ops = spy(client, monkeypatch)
    assert group.ack_many(items) == 32
    assert len(ops) == 1 and type(ops[0]) is Batch, "one round trip for all shards"
    acks = [op for op in ops[0].ops if type(op) is Eval and op.script == "group_ack"]
    assert len(acks) == 4, [op.script for op in ops[0].ops]
    assert sorted(len(op.args) for op in acks) == [8, 8, 8, 8]
    assert group.ack_many(items) == 0  # finished already
    assert group.ack_many([]) == 0
    info = client.group_describe(T, N, S, G)
    assert [s.position for s in info.shards] == [8, 8, 8, 8]
    assert [s.in_flight for s in info.shards] == [0, 0, 0, 0]


def test_bad_poll_arguments_are_refused(client: felix_redis.Client) -> None:
    setup(client, shards=2, fill={0: 1})
    group = client.group_sharded(T, N, S, G)
    for bad in (0, -1, 10_001, True, "4"):
        with pytest.raises(felix_redis.InvalidArgument):
            group.poll(bad)  # type: ignore[arg-type]
    with pytest.raises(felix_redis.InvalidArgument):
        group.poll(4, wait=-1)
    with pytest.raises(felix_redis.NotFound):
        client.group_sharded(T, N, S, "nobody").poll(4)
    with pytest.raises(felix_redis.InvalidArgument):
        client.group_sharded(T, N, S, G, consumer="bad name").poll(4)


# ----------------------------------------------------------------- long polls


def test_long_poll_wakes_on_publish_to_any_shard(client: felix_redis.Client, other: felix_redis.Client) -> None:
    setup(client)
    group = client.group_sharded(T, N, S, G)
    stamp: list[float] = []

    def publish() -> None:
        stamp.append(time.monotonic())
        other.publish(T, N, S, b"to-3", shard=3)

    thread = later(publish, 0.2)
    items = group.poll(8, wait=2)
    got = time.monotonic()
    thread.join(5)
    assert [(i.shard, i.offset, i.payload) for i in items] == [(3, 0, b"to-3")]
    assert got - stamp[0] < 0.5


def test_long_poll_blocks_once_on_all_shards(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    setup(client)
    group = client.group_sharded(T, N, S, G)
    group.poll(4)  # settings cached
    ops = spy(client, monkeypatch)
    start = time.monotonic()
    assert group.poll(4, wait=1) == []
    assert time.monotonic() - start >= 0.9
    blocks = [op for op in ops if type(op) is BlockAny]
    assert 1 <= len(blocks) <= 2
    keys = {key for key, _ in blocks[0].streams}
    name = client.core.name(T, N, S)
    for shard in range(4):
        assert name.shard_keys(shard)[1] in keys  # every shard's log
        assert name.group_key_list(shard, G)[GROUP_ROLES.index("wake")] in keys  # every shard's wake stream
    assert len([op for op in ops if type(op) is Eval]) <= 4 * (len(blocks) + 1)


def test_long_poll_publish_in_the_race_window(
    client: felix_redis.Client, other: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup(client)
    group = client.group_sharded(T, N, S, G)
    real = client._execute
    fired: list[bool] = []

    def racing(op: Any) -> Any:
        if type(op) is BlockAny and not fired:
            other.publish(T, N, S, b"racer", shard=2)
            fired.append(True)
        return real(op)

    monkeypatch.setattr(client, "_execute", racing)
    start = time.monotonic()
    items = group.poll(8, wait=4)
    assert fired
    assert [(i.shard, i.payload) for i in items] == [(2, b"racer")]
    assert time.monotonic() - start < 1.0


def test_long_poll_wakes_on_nack_on_any_shard(client: felix_redis.Client, other: felix_redis.Client) -> None:
    setup(client, fill={1: 1})
    (item,) = other.group_sharded(T, N, S, G).poll(4)
    group = client.group_sharded(T, N, S, G)
    thread = later(lambda: other.group_nack(T, N, S, 1, G, item.record), 0.2)
    start = time.monotonic()
    items = group.poll(4, wait=4)
    thread.join(5)
    assert [(i.shard, i.offset, i.attempts) for i in items] == [(1, 0, 2)]
    assert time.monotonic() - start < 1.5


def test_long_poll_wakes_at_a_lapse_on_any_shard(client: felix_redis.Client, other: felix_redis.Client) -> None:
    setup(client, fill={2: 1}, visibility_timeout_ms=300)
    other.group_sharded(T, N, S, G).poll(4)
    group = client.group_sharded(T, N, S, G)
    start = time.monotonic()
    items = group.poll(4, wait=4)
    elapsed = time.monotonic() - start
    assert [(i.shard, i.offset, i.attempts) for i in items] == [(2, 0, 2)]
    assert 0.2 <= elapsed < 1.5


def test_long_poll_elapses(client: felix_redis.Client) -> None:
    setup(client)
    start = time.monotonic()
    assert client.group_sharded(T, N, S, G).poll(4, wait=0.3) == []
    assert 0.25 <= time.monotonic() - start < 2.0


# -------------------------------------------------------------- named consumers


def test_sharded_consumer_reclaims_its_records_on_every_shard(client: felix_redis.Client) -> None:
    setup(client, fill={0: 2, 1: 2, 2: 2, 3: 2}, visibility_timeout_ms=30_000)
    first = client.group_sharded(T, N, S, G, consumer="w-7")
    mine = first.poll(4)
    theirs = client.group_sharded(T, N, S, G, consumer="w-8").poll(4)
    assert len(mine) == len(theirs) == 4
    # w-7 restarts: its first poll takes back its own records, attempts + 1
    restarted = client.group_sharded(T, N, S, G, consumer="w-7")
    back = restarted.poll(16)
    assert sorted((i.shard, i.offset, i.attempts) for i in back) == sorted(
        (i.shard, i.offset, 2) for i in mine)
    # only once: later polls do not reclaim what it now holds
    assert restarted.poll(16) == []
    for item in theirs:
        assert client.group_sharded(T, N, S, G).ack(item) is True


def test_item_and_dead_letter_carry_the_contract_fields(client: felix_redis.Client) -> None:
    """An Item has its record's published_at; a DeadLetter's time is when it died (both
    the server's clock, timezone-aware); Published unpacks as (shard, offset)."""
    setup(client, shards=2)
    shard, offset = client.publish(T, N, S, b"x", shard=1)
    assert (shard, offset) == (1, 0)
    group = client.group_sharded(T, N, S, G)
    (item,) = group.poll(4)
    assert item.published_at == item.record.published_at and item.published_at.tzinfo is not None
    group.dead_letter(item, "bad card")
    (letter,) = client.group_dead_letters(T, N, S, 1, G)
    assert letter.time == letter.dead_at and letter.time.tzinfo is not None
    assert letter.time >= item.published_at


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
