"""The scripts' ack lists and the position's walk over finished records.

``group_ack`` and ``group_poll`` take an argument as an offset when ``tonumber`` reads a
whole number with as many digits as the argument has characters and the list holds no
exponent or hex letter, and check each argument on anything else; acks
in strictly ascending order skip the table of members seen. These tests send argument
lists straight to the scripts (as a client of another language would) and check that
every shape gives the answer the argument-by-argument path gives, and that bad input
changes nothing. The position, held back by one record while thousands after it were
finished, passes them all in a few commands once that record is acked."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import redis

import felix_redis
from felix_redis import InvalidArgument, NotFound, scripts
from tests.conftest import dump_keyspace, finished_runs

T, N, S, G = "acme", "prod", "jobs", "workers"


def keys(client: felix_redis.Client) -> list[str]:
    name = client.core.name(T, N, S)
    return [*name.shard_keys(0), *name.group_key_list(0, G)]


def fcall(raw: redis.Redis, script: str, ks: list[str], args: list[Any]) -> Any:
    return raw.fcall(scripts.library().functions[script], len(ks), *ks, *args)


def position(client: felix_redis.Client) -> int:
    return client.group_describe(T, N, S, G).shards[0].position


def all_delivered(client: felix_redis.Client, total: int) -> list[felix_redis.Record]:
    """A stream of ``total`` records, all delivered to G (in flight), in offset order."""
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G)
    client.publish_batch(T, N, S, [b"x"] * total, shard=0)
    records: list[felix_redis.Record] = []
    while len(records) < total:
        records += client.group_poll(T, N, S, 0, G, max_records=1000)
    return records


@pytest.fixture
def delivered(redis_client: felix_redis.Client) -> felix_redis.Client:
    """20 records, all delivered to G and in flight."""
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, G)
    redis_client.publish_batch(T, N, S, [f"r{i}".encode() for i in range(20)], shard=0)
    assert len(redis_client.group_poll(T, N, S, 0, G, max_records=20)) == 20
    return redis_client


@pytest.mark.parametrize(
    ("args", "statuses", "pos"),
    [
        (["0", "1", "2"], [1, 1, 1], 3),  # in order from the position: the run path
        (["2", "1", "0"], [1, 1, 1], 3),  # descending: sorted
        (["3", "3", "0"], [1, 0, 1], 1),  # a repeat counts once
        (["5", "7"], [1, 1], 0),  # above the position: remembered as finished
        (["00", "01"], [1, 1], 2),  # not canonical: the argument-by-argument path reads 0 and 1
        (["-0", "1"], [1, 1], 2),  # likewise (int_arg reads -0 as 0)
        (["1", "1", "2"], [1, 0, 1], 0),  # ascending with a repeat: the repeat counts once
    ],
)
def test_ack_lists_of_every_shape(delivered: felix_redis.Client, raw: redis.Redis, args: list[str],
                                  statuses: list[int], pos: int) -> None:
    assert fcall(raw, "group_ack", keys(delivered), args) == statuses
    assert position(delivered) == pos
    # acking the same list again finds every record finished
    assert fcall(raw, "group_ack", keys(delivered), args) == [0] * len(args)


@pytest.mark.parametrize("bad", [
    ["1,2"], ["1", ""], [""], ["-1"], ["+2"], ["1 "], [" 12"], ["x"], ["1", "1e3"], ["1e2"], ["12e2"],
    ["1E2"], ["0x1"], ["0xFFFFF"], ["inf"], ["nan"], ["1.0"], ["1.5"], ["1\0"], ["\t1"], ["1" * 17],
])
def test_bad_ack_lists_are_refused_and_change_nothing(delivered: felix_redis.Client, raw: redis.Redis,
                                                     bad: list[str]) -> None:
    before = dump_keyspace(raw)
    with pytest.raises(redis.ResponseError, match="FELIX_INVALID offset must be"):
        fcall(raw, "group_ack", keys(delivered), ["0", *bad])
    with pytest.raises(redis.ResponseError, match="FELIX_INVALID offset must be"):
        fcall(raw, "group_poll", keys(delivered), ["1", "", "0", "0", *bad])
    assert dump_keyspace(raw) == before


def test_an_ack_of_an_offset_never_delivered_changes_nothing(delivered: felix_redis.Client,
                                                           raw: redis.Redis) -> None:
    """Each offset of an ack is settled on its own (issue 25): one never delivered is
    answered -1 and changes nothing; an offset out of range refuses the whole call."""
    before = dump_keyspace(raw)
    for big in ["20", "999999999999999", "4503599627370496"]:  # next, 15 digits, 16 digits
        assert fcall(raw, "group_ack", keys(delivered), [big]) == [-1]
    with pytest.raises(redis.ResponseError, match="FELIX_INVALID offset must be between"):
        fcall(raw, "group_ack", keys(delivered), ["0", "4503599627370497"])
    assert dump_keyspace(raw) == before
    # the client: NotFound for the one never delivered, nothing written
    with pytest.raises(NotFound):
        delivered.group_ack_many(T, N, S, 0, G, [20])
    with pytest.raises(InvalidArgument):
        delivered.group_ack_many(T, N, S, 0, G, [-1])
    assert dump_keyspace(raw) == before


def test_position_walks_a_long_finished_run(client: felix_redis.Client) -> None:
    """Records finished while the one at the position is held back are remembered; when
    it is acked, the position passes them all and the group keeps nothing of them."""
    total = 3000
    records = all_delivered(client, total)
    # out of order: the later half first, then the earlier, the first record held back
    assert all(client.group_ack_many(T, N, S, 0, G, records[1500:]))
    assert all(client.group_ack_many(T, N, S, 0, G, records[1:1500]))
    info = client.group_describe(T, N, S, G).shards[0]
    assert (info.position, info.in_flight) == (0, 1)
    # 2,999 finished records above the position: remembered as one run, not one each
    gk = client.group_keys(T, N, S, G)[0]
    assert finished_runs(client.redis, gk) == [(1, 2999)]
    assert client.group_ack_many(T, N, S, 0, G, records[:1]) == [True]
    info = client.group_describe(T, N, S, G).shards[0]
    assert (info.position, info.in_flight, info.lag) == (total, 0, 0)
    assert not client.redis.exists(gk["done"]) and client.redis.hget(gk["group"], "top") is None


def test_position_walk_takes_a_few_commands_not_one_per_record(redis_client: felix_redis.Client,
                                                              raw: redis.Redis) -> None:
    total = 5000
    records = all_delivered(redis_client, total)
    redis_client.group_ack_many(T, N, S, 0, G, records[1:])
    raw.config_resetstat()
    assert redis_client.group_poll(T, N, S, 0, G, ack=records[:1]) == []
    stats = raw.info("commandstats")
    assert position(redis_client) == total
    # 4999 records passed in one step: the run after the position is looked up and removed
    assert stats["cmdstat_zrem"]["calls"] <= 2  # the lease, and the run
    assert stats["cmdstat_zrange"]["calls"] <= 4


def test_acks_in_order_behind_a_held_record_cost_no_command_on_the_done_key(redis_client: felix_redis.Client,
                                                                          raw: redis.Redis) -> None:
    """While another consumer holds the record at the position, each poll's acks (the
    previous batch, in order) extend the top run in the group hash: no command on the
    done key, where looking up the run to extend and rewriting it took two."""
    c = redis_client
    c.stream_create(T, N, S)
    c.group_create(T, N, S, G)
    c.publish_batch(T, N, S, [b"x"] * 200, shard=0)
    (held,) = c.group_poll(T, N, S, 0, G, max_records=1)  # another consumer's record
    batch = c.group_poll(T, N, S, 0, G, max_records=16)
    raw.config_resetstat()
    for _ in range(10):
        batch = c.group_poll(T, N, S, 0, G, max_records=16, ack=batch)
    assert all(c.group_ack_many(T, N, S, 0, G, batch))
    stats = raw.info("commandstats")
    # per poll two ZRANGEs (the earliest lease; the lease the acks leave) and two ZADDs
    # (the new records' lease and its range), one ZRANGE for the last acks; nothing more
    assert (stats["cmdstat_zrange"]["calls"], stats["cmdstat_zadd"]["calls"]) == (21, 20)
    assert "cmdstat_zscore" not in stats
    gk = c.group_keys(T, N, S, G)[0]
    assert not raw.exists(gk["done"]) and raw.hget(gk["group"], "top") == b"1-176"
    assert finished_runs(raw, gk) == [(1, 176)]
    assert c.group_ack(T, N, S, 0, G, held) is True
    assert position(c) == 177 and raw.hget(gk["group"], "top") is None


def test_position_walk_stops_at_the_first_unfinished_record(client: felix_redis.Client) -> None:
    records = all_delivered(client, 2000)
    # everything but 0 and 1500 finished: acking 0 moves the position to 1500, not past it
    client.group_ack_many(T, N, S, 0, G, records[1:1500] + records[1501:])
    client.group_ack_many(T, N, S, 0, G, records[:1])
    info = client.group_describe(T, N, S, G).shards[0]
    assert (info.position, info.in_flight) == (1500, 1)
    client.group_ack_many(T, N, S, 0, G, records[1500:1501])
    info = client.group_describe(T, N, S, G).shards[0]
    assert (info.position, info.in_flight, info.lag) == (2000, 0, 0)


def test_acks_of_owed_and_finished_records_in_ascending_lists(delivered: felix_redis.Client,
                                                             raw: redis.Redis) -> None:
    """An ascending list mixing in-flight, owed (nacked) and finished records: the owed
    one is finished too, the finished one reported as such."""
    records = delivered.group_poll(T, N, S, 0, G, max_records=1)  # nothing left to poll
    assert records == []
    ks = keys(delivered)
    assert fcall(raw, "group_ack", ks, ["0"]) == [1]
    delivered.group_nack(T, N, S, 0, G, "0:2:1", delay=60)  # record 2 owed, due in a minute
    info = delivered.group_describe(T, N, S, G).shards[0]
    assert (info.position, info.in_flight, info.owed) == (1, 18, 1)
    assert fcall(raw, "group_ack", ks, ["0", "1", "2", "3"]) == [0, 1, 1, 1]
    info = delivered.group_describe(T, N, S, G).shards[0]
    assert (info.position, info.in_flight, info.owed) == (4, 16, 0)
    # the owed record left the owed set: a poll does not hand it out again
    assert delivered.group_poll(T, N, S, 0, G, max_records=5) == []


def test_done_runs_split_on_redrive_and_merge_on_ack(client: felix_redis.Client) -> None:
    """Finished records above a held-back position are runs; a dead letter redriven
    from the middle of one splits it, and its ack joins the halves again."""
    records = all_delivered(client, 12)
    gk = client.group_keys(T, N, S, G)[0]
    assert all(client.group_ack_many(T, N, S, 0, G, records[1:4] + records[6:10]))
    client.group_dead_letter(T, N, S, 0, G, records[4], reason="bad")
    client.group_dead_letter(T, N, S, 0, G, records[5], reason="bad")
    assert finished_runs(client.redis, gk) == [(1, 9)]
    assert client.group_redrive(T, N, S, 0, G, [4]) == 1
    assert finished_runs(client.redis, gk) == [(1, 3), (5, 9)]
    # the top run (the highest, kept in the group hash) and a run below it split too
    assert all(client.group_ack_many(T, N, S, 0, G, records[11:]))
    client.group_dead_letter(T, N, S, 0, G, records[10], reason="bad")
    assert finished_runs(client.redis, gk) == [(1, 3), (5, 11)]
    assert client.redis.hget(gk["group"], "top") == b"5-11"
    assert client.group_redrive(T, N, S, 0, G, [10]) == 1
    assert finished_runs(client.redis, gk) == [(1, 3), (5, 9), (11, 11)]
    assert client.group_redrive(T, N, S, 0, G, [5]) == 1
    assert finished_runs(client.redis, gk) == [(1, 3), (6, 9), (11, 11)]
    again = client.group_poll(T, N, S, 0, G, max_records=5)
    assert sorted(r.offset for r in again) == [4, 5, 10]  # a redrive starts a record afresh
    assert all(client.group_ack_many(T, N, S, 0, G, again))
    assert finished_runs(client.redis, gk) == [(1, 11)]
    assert client.group_ack(T, N, S, 0, G, records[0]) is True
    info = client.group_describe(T, N, S, G).shards[0]
    assert (info.position, info.in_flight, info.lag) == (12, 0, 0)
    assert not client.redis.exists(gk["done"]) and client.redis.hget(gk["group"], "top") is None


def test_done_runs_stay_as_few_as_the_holes_between_them(client: felix_redis.Client) -> None:
    """Acks in any order: the done key never holds more runs than there are unfinished
    records above the position, plus one."""
    import random

    records = all_delivered(client, 400)
    gk = client.group_keys(T, N, S, G)[0]
    order = list(range(1, 400))
    random.Random(7).shuffle(order)
    held = set(range(400))
    for start in range(0, len(order), 13):
        batch = order[start:start + 13]
        assert all(client.group_ack_many(T, N, S, 0, G, [records[i] for i in batch]))
        held -= set(batch)
        position = client.group_describe(T, N, S, G).shards[0].position
        assert position == 0
        runs = finished_runs(client.redis, gk)
        assert len(runs) <= len([h for h in held if h > position]) + 1
        # exactly the finished records, in runs that neither overlap nor touch
        assert [o for first, last in runs for o in range(first, last + 1)] == sorted(set(range(1, 400)) - held)
        assert all(a[1] + 1 < b[0] for a, b in itertools.pairwise(runs))
    assert finished_runs(client.redis, gk) == [(1, 399)]
    assert client.group_ack(T, N, S, 0, G, records[0]) is True
    assert client.group_describe(T, N, S, G).shards[0].position == 400


def test_a_malformed_top_run_is_refused_unchanged(client: felix_redis.Client) -> None:
    """A ``top`` field that is not ``FIRST-LAST`` (another application wrote it) is
    refused, naming the field, before anything is written."""
    records = all_delivered(client, 4)
    gk = client.group_keys(T, N, S, G)[0]
    assert all(client.group_ack_many(T, N, S, 0, G, records[2:]))
    assert finished_runs(client.redis, gk) == [(2, 3)] and client.redis.hget(gk["group"], "top") == b"2-3"
    client.redis.hset(gk["group"], "top", "2..3")
    before = dump_keyspace(client.redis)
    with pytest.raises(felix_redis.WrongKeyType, match="field top"):
        client.group_ack(T, N, S, 0, G, records[0])
    with pytest.raises(felix_redis.WrongKeyType, match="field top"):
        client.group_poll(T, N, S, 0, G)
    assert dump_keyspace(client.redis) == before


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
