"""A poll that acks: ``group_poll(..., ack=records)`` acks those records first, in the
same script call, exactly as ``group_ack_many`` would, then polls. One round trip for a
worker's acks and its next poll; the outcome must be the same as the two calls."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

import pytest

import felix_redis
from felix_redis import Client, Record
from felix_redis.replies import parse_delivered
from tests.conftest import dump_keyspace
from tests.support.scripts import run_script

T, N, S, G = "acme", "prod", "jobs", "workers"


def make(client: Client, records: int = 0, shards: int = 1, group: str = G, **settings: Any) -> None:
    if group == G:
        client.stream_create(T, N, S, shards=shards)
    client.group_create(T, N, S, group, **settings)
    if records and group == G:
        for shard in range(shards):
            client.publish_batch(T, N, S, [f"s{shard}r{i}" for i in range(records)], shard=shard)


def state(client: Client, shard: int = 0, group: str = G) -> tuple[int, int, int, int, int]:
    s = client.group_describe(T, N, S, group).shards[shard]
    return s.position, s.lag, s.in_flight, s.owed, s.dead


def offs(records: list[Any]) -> list[int]:
    return [r.offset for r in records]


def test_poll_acks_first_then_leases(client: Client) -> None:
    make(client, records=10)
    first = client.group_poll(T, N, S, 0, G, max_records=4)
    assert offs(first) == [0, 1, 2, 3]
    second = client.group_poll(T, N, S, 0, G, max_records=4, ack=first)
    assert offs(second) == [4, 5, 6, 7]
    # the acked records are finished: the position passed them, only the new ones fly
    assert state(client) == (4, 6, 4, 0, 0)
    assert client.group_ack_many(T, N, S, 0, G, first) == [False] * 4
    # offsets, claims and records are all accepted, like group_ack_many
    third = client.group_poll(T, N, S, 0, G, max_records=4, ack=[second[0].offset, second[1].claim, *second[2:]])
    assert offs(third) == [8, 9]
    assert state(client) == (8, 2, 2, 0, 0)
    # an ack with nothing left to poll still acks
    assert client.group_poll(T, N, S, 0, G, ack=third) == []
    assert state(client) == (10, 0, 0, 0, 0)


def test_acked_records_are_not_redelivered(client: Client) -> None:
    make(client, records=3, visibility_timeout_ms=150)
    a = client.group_poll(T, N, S, 0, G, max_records=2)
    assert client.group_poll(T, N, S, 0, G, max_records=1, ack=a[:1])[0].offset == 2
    time.sleep(0.2)
    # record 0 was acked; 1 and 2 lapsed and come back with attempts 2
    again = client.group_poll(T, N, S, 0, G)
    assert sorted((r.offset, r.attempts) for r in again) == [(1, 2), (2, 2)]


def test_same_outcome_as_separate_ack_and_poll(client: Client) -> None:
    """Two groups walk the same stream with the same random settles (acks out of order,
    repeated, of owed and stale records, nacks): one acks through its next poll, the
    other with group_ack_many first. Deliveries and group state must match throughout."""
    make(client, records=60)
    make(client, group="twin")
    rng = random.Random(7)
    held: dict[str, list[Record]] = {G: [], "twin": []}
    for step in range(40):
        want = rng.randint(1, 6)
        picks = sorted(rng.sample(range(len(held[G])), k=rng.randint(0, len(held[G])))) if held[G] else []
        if rng.random() < 0.3 and picks:
            picks.append(picks[0])  # the same record twice in one ack
        nack = rng.random() < 0.2 and len(held[G]) > len(picks)
        out = {}
        for group in (G, "twin"):
            acked = [held[group][i] for i in picks]
            if nack:
                rest = [r for i, r in enumerate(held[group]) if i not in picks]
                client.group_nack(T, N, S, 0, group, rest[0])
            if group == G:
                got = client.group_poll(T, N, S, 0, group, max_records=want, ack=acked)
            else:
                if acked:
                    client.group_ack_many(T, N, S, 0, group, acked)
                got = client.group_poll(T, N, S, 0, group, max_records=want)
            keep = [r for i, r in enumerate(held[group]) if i not in set(picks)]
            if nack:
                keep = keep[1:]
            held[group] = keep + got
            out[group] = [(r.offset, r.attempts, r.payload) for r in got]
        assert out[G] == out["twin"], f"step {step}"
        assert state(client, group=G) == state(client, group="twin"), f"step {step}"
    assert state(client)[0] > 0


def test_poll_with_reclaim_acks_before_reclaiming(client: Client) -> None:
    make(client, records=4)
    mine = client.group_poll_as(T, N, S, 0, G, "w-1", max_records=3)
    assert offs(mine) == [0, 1, 2]
    # a restarted consumer w-1 acks 0 (finished before the restart) and takes back the rest
    back = client.group_poll_as(T, N, S, 0, G, "w-1", reclaim=True, max_records=4, ack=mine[:1])
    assert sorted((r.offset, r.attempts) for r in back) == [(1, 2), (2, 2), (3, 1)]
    assert state(client) == (1, 3, 3, 0, 0)


def test_long_poll_applies_acks_at_once(client: Client) -> None:
    make(client, records=2)
    got = client.group_poll(T, N, S, 0, G, max_records=2)
    started = time.monotonic()
    assert client.group_poll(T, N, S, 0, G, wait=0.3, ack=got) == []
    assert time.monotonic() - started >= 0.25
    assert state(client) == (2, 0, 0, 0, 0)


def test_bad_acks_change_nothing(client: Client, unchanged: Any) -> None:
    make(client, records=5, shards=2)
    got = client.group_poll(T, N, S, 0, G, max_records=2)
    other = client.group_poll(T, N, S, 1, G, max_records=1)
    cases: list[tuple[Any, type[Exception]]] = [
        ([got[0], 3], felix_redis.NotFound),  # 3 was never delivered: nothing acked nor leased
        ([99], felix_redis.NotFound),
        (other, felix_redis.InvalidArgument),  # a record of shard 1 on a shard-0 poll
        (["1:0:1"], felix_redis.InvalidArgument),  # a claim of shard 1
        ([-1], felix_redis.InvalidArgument),
        (["nope"], felix_redis.InvalidArgument),
        ("0", felix_redis.InvalidArgument),  # a string is not a list of records
        ([0] * 10_001, felix_redis.InvalidArgument),
    ]
    for ack, error in cases:
        with unchanged(), pytest.raises(error):
            client.group_poll(T, N, S, 0, G, ack=ack)
    with unchanged(), pytest.raises(felix_redis.InvalidArgument):
        client.group_poll(T, N, S, 0, G, max_records=0, ack=got)


def test_script_checks_ack_offsets_before_writing(redis_client: Client, raw: Any) -> None:
    """The script itself (a client of another version, or redis-cli) refuses bad acks
    with nothing written, and takes non-canonical decimals like group_ack does."""
    make(redis_client, records=3)
    got = redis_client.group_poll(T, N, S, 0, G, max_records=2)
    name = redis_client.core.name(T, N, S)
    keys = [*name.shard_keys(0), *name.group_key_list(0, G)]
    before = dump_keyspace(raw)
    for args, code in ([["16", "", "0", "x"], "FELIX_INVALID"], [["16", "", "0", "2"], "FELIX_NOT_FOUND"],
                       [["16", "", "0", *["0"] * 10_001], "FELIX_INVALID"]):
        with pytest.raises(Exception, match=code):
            run_script(redis_client, "group_poll", keys, args)
        assert dump_keyspace(raw) == before
    reply = run_script(redis_client, "group_poll", keys, ["1", "", "0", "00", "01"])
    assert int(reply[4]) == 1
    assert state(redis_client) == (2, 1, 1, 0, 0)
    assert [r.offset for r in got] == [0, 1]


def test_a_run_of_acks_settles_exactly_as_its_offsets_one_by_one(redis_client: Client, raw: Any) -> None:
    """A poll's acks given as one run 'FIRST-LAST' (what the client sends for a batch
    acked whole) settle exactly as the same offsets given one by one: two groups walk
    the same stream, one acking by runs, the other by offsets, through every case of
    the run's quick path and past it (a whole lease at the position and above it, part
    of a lease, records finished, redelivered or owed in the run, a named consumer's,
    the same run twice); their deliveries and states match at every step."""
    make(redis_client, records=40)
    make(redis_client, group="twin")
    name = redis_client.core.name(T, N, S)

    def poll(want: int, first: int = -1, last: int = -1, consumer: str = "") -> list[list[tuple[int, int]]]:
        out = []
        for group in (G, "twin"):
            keys = [*name.shard_keys(0), *name.group_key_list(0, group)]
            acks = [] if first < 0 else [f"{first}-{last}"] if group == G else [str(o) for o in range(first, last + 1)]
            reply = run_script(redis_client, "group_poll", keys, [str(want), consumer, "0", *acks])
            out.append([(r.offset, r.attempts) for r in parse_delivered(reply, 5, int(reply[4]), 0)])
        assert out[0] == out[1]
        assert state(redis_client) == state(redis_client, group="twin")
        # (and the same attempts kept: those of finished records are dropped)
        assert raw.hgetall(name.group_key_list(0, G)[3]) == raw.hgetall(name.group_key_list(0, "twin")[3])
        return out

    assert poll(8)[0] == [(o, 1) for o in range(8)]
    poll(4, 0, 7)  # a whole lease at the position: the position moves over it (8..11 leased)
    assert state(redis_client)[0] == 8
    poll(4)  # 12..15, a lease of its own
    poll(1, 12, 15)  # a whole lease above the position (8..11 in flight): remembered as done
    assert state(redis_client)[0] == 8
    poll(6, 8, 11)  # the lease at the position: it moves over both runs (17..22 leased)
    assert state(redis_client)[0] == 16
    poll(1, 18, 20)  # part of a lease
    poll(1, 16, 23)  # a run over finished records, lease pieces and a lease of its own
    assert state(redis_client)[:3] == (24, 16, 1)
    for group in (G, "twin"):
        redis_client.group_nack(T, N, S, 0, group, "0:24:1")
    assert poll(2)[0] == [(24, 2), (25, 1)]  # 24 again (attempts 2), then 25
    poll(1, 24, 25)  # a run with a redelivered record (its attempts kept)
    assert state(redis_client)[:3] == (26, 14, 1)
    poll(2)  # 27, 28
    for group in (G, "twin"):
        redis_client.group_nack(T, N, S, 0, group, "0:27:1", delay=60)
    poll(1, 26, 28)  # a run with an owed record in it
    assert state(redis_client)[:4] == (29, 11, 1, 0)
    poll(1, 26, 28)  # the same run again changes nothing
    assert state(redis_client)[:3] == (29, 11, 2)
    for group in (G, "twin"):
        for off in (29, 30):
            redis_client.group_nack(T, N, S, 0, group, f"0:{off}:1")
    assert poll(2)[0] == [(29, 2), (30, 2)]  # one lease of redelivered records
    assert poll(2)[0] == [(31, 1), (32, 1)]
    poll(1, 31, 32)  # a whole lease of first deliveries while the attempts key exists
    assert state(redis_client)[:3] == (29, 11, 3)
    assert raw.hlen(name.group_key_list(0, G)[3]) == 2
    poll(1, 29, 30)  # a whole lease of redelivered records: their attempts go
    assert state(redis_client)[:3] == (33, 7, 2)
    assert raw.hlen(name.group_key_list(0, G)[3]) == 0
    assert poll(4, consumer="w-1")[0] == [(o, 1) for o in range(35, 39)]
    poll(1, 35, 38, consumer="w-1")  # a named consumer's records
    assert state(redis_client)[:3] == (33, 7, 3)
    before = dump_keyspace(raw)
    keys = [*name.shard_keys(0), *name.group_key_list(0, G)]
    with pytest.raises(Exception, match="FELIX_NOT_FOUND record 40 has not been delivered"):
        run_script(redis_client, "group_poll", keys, ["4", "", "0", "39-40"])
    assert dump_keyspace(raw) == before


def test_the_script_refuses_a_bad_run_of_acks_before_writing(redis_client: Client, raw: Any) -> None:
    """A crafted 'FIRST-LAST' ack (redis-cli, another client) that is not a run of at
    most 10000 plainly written offsets is refused with INVALID, nothing written."""
    make(redis_client, records=3)
    redis_client.group_poll(T, N, S, 0, G, max_records=2)
    name = redis_client.core.name(T, N, S)
    keys = [*name.shard_keys(0), *name.group_key_list(0, G)]
    before = dump_keyspace(raw)
    for bad in ["1-0", "1-1", "01-1", "0-01", "0-", "-1", "-0-1", "0-1-2", "0--1", "0-1 ", "0-1e3", "0x1-2",
                "0-10000", "0-9999999999999999", "4503599627370497-4503599627370498"]:
        with pytest.raises(Exception, match="FELIX_INVALID ARGV\\[4\\] must be offsets or one run"):
            run_script(redis_client, "group_poll", keys, ["16", "", "0", bad])
        assert dump_keyspace(raw) == before, bad
    # a run goes alone: beside other offsets its '-' makes it no offset
    with pytest.raises(Exception, match="FELIX_INVALID"):
        run_script(redis_client, "group_poll", keys, ["16", "", "0", "0-1", "2"])
    assert dump_keyspace(raw) == before


def test_a_plain_first_delivery_takes_two_reply_slots_and_the_rest_four(redis_client: Client, raw: Any) -> None:
    """A poll's reply carries a plain record on its first delivery as its entry ID and
    payload only; a record with a key or headers, or delivered again, as entry ID,
    attempts, key and payload. The client reads both shapes mixed in one reply."""
    make(redis_client, visibility_timeout_ms=100)
    redis_client.publish_batch(T, N, S, ["a", "b"], shard=0)
    redis_client.publish(T, N, S, "k", shard=0, key="cart-1")
    redis_client.publish(T, N, S, "h", shard=0, headers={"trace": "t1"})
    redis_client.publish(T, N, S, "c", shard=0)
    name = redis_client.core.name(T, N, S)
    keys = [*name.shard_keys(0), *name.group_key_list(0, G)]
    reply = run_script(redis_client, "group_poll", keys, ["3", "", "0"])
    assert int(reply[4]) == 3
    # two plain records (ID, payload), then the keyed one (ID, attempts, key, payload)
    assert [type(x) for x in reply[5:]] == [bytes, bytes, bytes, bytes, bytes, int, bytes, bytes]
    assert (reply[6], reply[8], reply[10:]) == (b"a", b"b", [1, b"cart-1", b"k"])
    time.sleep(0.15)  # the three lapse: their next delivery is their second
    got = redis_client.group_poll(T, N, S, 0, G, max_records=5)
    assert [(r.offset, r.attempts, r.key, r.payload, r.headers) for r in got] == [
        (0, 2, None, b"a", {}), (1, 2, None, b"b", {}), (2, 2, "cart-1", b"k", {}),
        (3, 1, None, b"h", {"trace": "t1"}), (4, 1, None, b"c", {})]


def test_the_client_sends_a_batch_acked_whole_as_one_run(redis_client: Client, raw: Any) -> None:
    """group_poll(ack=<the previous batch>) sends its offsets as one run, and the
    README's sharded loop does too; offsets out of order or with gaps go one by one.
    (What the script does with either is the same: the test above.)"""
    from felix_redis.checks import poll_ack_args

    assert poll_ack_args([4, 5, 6]) == ["4-6"]
    assert poll_ack_args([4]) == [4]
    assert poll_ack_args([4, 6]) == [4, 6]
    assert poll_ack_args([5, 4]) == [5, 4]
    assert poll_ack_args([4, 4]) == [4, 4]
    assert poll_ack_args([]) == []
    make(redis_client, records=8)
    got = redis_client.group_poll(T, N, S, 0, G, max_records=4)
    with raw.monitor() as monitor:
        redis_client.group_poll(T, N, S, 0, G, max_records=4, ack=got)
        for command in monitor.listen():
            if "fcall" in command["command"].lower() or "evalsha" in command["command"].lower():
                assert command["command"].endswith(" 0-3"), command["command"]
                break
    assert state(redis_client)[:3] == (4, 4, 4)


def test_sharded_poll_acks_each_shard(client: Client) -> None:
    make(client, records=3, shards=4)
    group = client.group_sharded(T, N, S, G)
    items = group.poll(8)
    assert len(items) == 8
    # one record per call: the first pass polls one shard, the acks of the three others
    # travel in the same round trip
    more = group.poll(1, ack=items)
    assert len(more) == 1
    for shard in range(4):
        acked = sum(1 for i in items if i.shard == shard)
        flying = sum(1 for i in more if i.shard == shard)
        assert state(client, shard)[:3] == (acked, 3 - acked, flying)
    rest = group.poll(16, ack=more)
    assert len(rest) == 12 - 8 - 1
    assert group.poll(16, ack=rest) == []
    for shard in range(4):
        assert state(client, shard) == (3, 0, 0, 0, 0)


def test_sharded_poll_with_bad_ack_changes_nothing(client: Client, unchanged: Any) -> None:
    make(client, records=2, shards=2)
    group = client.group_sharded(T, N, S, G)
    with unchanged(), pytest.raises(felix_redis.NotFound, match="shard 7"):
        group.poll(4, ack=["7:0:1"])  # a claim of a shard the stream does not have
    with unchanged(), pytest.raises(felix_redis.InvalidArgument):
        group.poll(4, ack=[-1])
    with unchanged(), pytest.raises(felix_redis.InvalidArgument):
        group.poll(4, ack="0:0:1")


@pytest.mark.usefixtures("first_lead_zero")
def test_sharded_poll_with_undelivered_ack_raises_and_loses_nothing(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """An offset never delivered is only found out by its shard's script, after the
    other shards of the same round trip leased records: the poll hands those out and
    logs the refused ack; with nothing handed out it raises. Nothing is lost. (Acks
    beside the poll go as group_ack_many does, each on its own; acks riding on a shard's
    poll all or none: test_bad_acks_change_nothing.)"""
    make(client, records=3, shards=2, visibility_timeout_ms=200)
    group = client.group_sharded(T, N, S, G)
    items = group.poll(4)  # shard 0 leads and runs dry, shard 1 gives the last one and leads now
    first = [i for i in items if i.shard == 0]
    assert [(i.shard, i.offset) for i in items] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    with caplog.at_level(logging.WARNING, logger="felix_redis"):
        # shard 0's acks go in a call beside the poll of shard 1, which leased records:
        # those are handed out, and the ack never delivered is said in the log
        handed = group.poll(4, ack=[first[0], "0:5:1"])
    assert [(i.shard, i.offset) for i in handed] == [(1, 1), (1, 2)]
    assert "record 0:5 has not been delivered" in caplog.text and "other 1 was settled" in caplog.text
    assert state(client, 0)[:3] == (1, 2, 2)  # shard 0: each ack settled on its own (as ack_many)
    assert state(client, 1)[:3] == (0, 3, 3)  # shard 1 leased its last two records
    # with nothing handed out, the poll raises it
    with pytest.raises(felix_redis.NotDelivered, match=r"record 0:6 has not been delivered"):
        group.poll(4, ack=["0:6:1"])
    time.sleep(0.25)
    again = group.poll(8, ack=first + handed)
    assert sorted((i.shard, i.offset, i.attempts) for i in again) == [(1, 0, 2)]


def test_asyncio_poll_acks(redis_url: str, raw: Any) -> None:
    import felix_redis.asyncio as fa

    async def main() -> None:
        client = fa.connect(redis_url)
        await client.stream_create(T, N, S, shards=2)
        await client.group_create(T, N, S, G)
        for shard in (0, 1):
            await client.publish_batch(T, N, S, [b"a", b"b", b"c"], shard=shard)
        got = await client.group_poll(T, N, S, 0, G, max_records=2)
        nxt = await client.group_poll_as(T, N, S, 0, G, "w", reclaim=False, ack=got)
        assert offs(nxt) == [2]
        group = client.group_sharded(T, N, S, G)
        items = await group.poll(8, ack=nxt)
        assert sorted((i.shard, i.offset) for i in items) == [(1, 0), (1, 1), (1, 2)]
        assert await group.poll(8, ack=items) == []
        info = await client.group_describe(T, N, S, G)
        assert [(s.position, s.in_flight) for s in info.shards] == [(3, 0), (3, 0)]
        await client.close()

    asyncio.run(main())
