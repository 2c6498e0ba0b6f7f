"""The guarantees of CONTRACT.md, one section each (1-9; 10 needs replicas, see the
topology tests)."""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.exceptions import ResponseError

import felix_redis
from felix_redis import Client, Published, Record
from felix_redis.errors import from_response
from felix_redis.protocol import Eval
from felix_redis.testing.server import RedisServer, redis_server_binary
from tests.conftest import finished_runs, lease_expiry
from tests.support import clocks
from tests.support.scripts import run_script

T, N, S, G = "acme", "prod", "jobs", "workers"
BASE0 = "felix:{acme/prod/jobs/0}"
GROUP0 = f"{BASE0}:g:{G}"

needs_redis = pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")


def server_ms(r: Any) -> int:
    sec, usec = r.time()
    return int(sec) * 1000 + int(usec) // 1000


def make(client: Client, records: int = 0, shards: int = 1, **group: Any) -> None:
    client.stream_create(T, N, S, shards=shards)
    client.group_create(T, N, S, G, **group)
    if records:
        client.publish_batch(T, N, S, [f"r{i}" for i in range(records)], shard=0)


def poll(client: Client, max_records: int = 16, shard: int = 0) -> list[Record]:
    return client.group_poll(T, N, S, shard, G, max_records=max_records)


def seen(records: list[Record]) -> list[tuple[int, int]]:
    return [(r.offset, r.attempts) for r in records]


def state(client: Client, shard: int = 0) -> felix_redis.ShardState:
    return client.group_describe(T, N, S, G).shards[shard]


def drain(client: Client, shard: int = 0, limit_s: float = 5.0) -> list[Record]:
    """Polls and acks until the shard has nothing unfinished; returns what it got."""
    got: list[Record] = []
    deadline = time.monotonic() + limit_s
    while state(client, shard).lag:
        assert time.monotonic() < deadline, "records never came back"
        records = poll(client, shard=shard)
        if not records:
            time.sleep(0.02)
            continue
        got += records
        client.group_ack_many(T, N, S, shard, G, records)
    return got


# ------------------------------------------------------------------- 1. at-least-once


def test_1_every_record_ends_acked_or_dead_lettered(client: Client) -> None:
    rng = random.Random(1)
    make(client, shards=2, max_attempts=4)
    published = {(p.shard, p.offset) for p in (client.publish(T, N, S, f"{i}") for i in range(150))}
    acked: set[tuple[int, int]] = set()
    dead: set[tuple[int, int]] = set()
    for _ in range(2000):
        batch: list[Record] = []
        for shard in (0, 1):
            batch += poll(client, rng.randint(1, 9), shard)
        if not batch:
            break
        for r in batch:
            roll = rng.random()
            if roll < 0.55:
                assert client.group_ack(T, N, S, r.shard, G, r) is True
                acked.add((r.shard, r.offset))
            elif roll < 0.6:
                client.group_dead_letter(T, N, S, r.shard, G, r, reason="on purpose")
                dead.add((r.shard, r.offset))
            elif client.group_nack(T, N, S, r.shard, G, r):
                dead.add((r.shard, r.offset))
    listed = {(d.shard, d.offset) for shard in (0, 1) for d in client.group_dead_letters(T, N, S, shard, G)}
    assert listed == dead
    assert not acked & dead
    assert acked | dead == published
    for s in client.group_describe(T, N, S, G).shards:
        assert (s.lag, s.owed, s.in_flight, s.pending) == (0, 0, 0, 0)
        assert s.position == s.tail


def test_1_records_of_a_crashed_client_come_back(client: Client, backend: tuple[str, Any]) -> None:
    vt_s = 1.5  # room for the checks below while the leases hold, on a loaded machine too
    make(client, records=6, visibility_timeout_ms=int(vt_s * 1000))
    crashed = felix_redis.connect(backend[0])
    leased_at = time.monotonic()
    lost = crashed.group_poll(T, N, S, 0, G, max_records=3)
    assert [r.offset for r in lost] == [0, 1, 2]
    crashed.close()  # vanishes without settling anything
    del crashed
    others = poll(client)
    assert seen(others) == [(3, 1), (4, 1), (5, 1)]
    client.group_ack_many(T, N, S, 0, G, others)
    if time.monotonic() - leased_at < vt_s * 0.9:
        assert poll(client) == []  # the crashed client's leases still hold
    back: list[Record] = []
    deadline = time.monotonic() + vt_s + 10
    while not back and time.monotonic() < deadline:
        back = poll(client)
        time.sleep(0.05)
    assert time.monotonic() - leased_at >= vt_s, "came back before the leases lapsed"
    assert seen(back) == [(0, 2), (1, 2), (2, 2)]
    assert [r.payload for r in back] == [b"r0", b"r1", b"r2"]
    client.group_ack_many(T, N, S, 0, G, back)
    assert state(client).lag == 0


@needs_redis
def test_1_state_survives_a_redis_restart_and_unfinished_records_come_back() -> None:
    """SIGKILL and restart (AOF, fsync always) under the same client and producer
    objects, on the same URL: the state is back and unfinished records come back."""
    extra = ["--appendonly", "yes", "--appendfsync", "always"]
    with RedisServer(persistence=True, extra=extra) as server:
        c = felix_redis.connect(server.url)
        try:
            make(c, records=20, visibility_timeout_ms=300, max_attempts=5)
            producer = c.idempotent_producer()
            assert producer.publish(T, N, S, b"idem", shard=0) == Published(0, 20)
            records = poll(c, 10)
            c.group_ack_many(T, N, S, 0, G, records[:5])
            c.group_nack(T, N, S, 0, G, records[5])
            c.group_dead_letter(T, N, S, 0, G, records[6], reason="bad")
            before = state(c)

            server.restart(hard=True)  # SIGKILL: only what reached the AOF survives

            # the same client, whose connections died with the server
            after = state(c)
            assert (after.position, after.tail, after.dead) == (before.position, before.tail, before.dead) == (5, 21, 1)
            assert after.owed + after.in_flight == 4
            # The idempotent producer's last sequence survived too: a re-send lands once,
            # and the same producer's next publish is a new record.
            reply = run_script(c, "publish", [f"{BASE0}:meta", f"{BASE0}:log", f"{BASE0}:conf"],
                                 ["", producer._state.producer_id, 1, 3_600_000, "", "", "", b"idem"])
            assert reply[:2] == [20, 1] and reply[3] == 1
            assert producer.publish(T, N, S, b"after", shard=0) == Published(0, 21)
            time.sleep(0.35)  # the leases granted before the restart lapse
            got = drain(c)
            assert sorted(seen(got)[:4]) == [(5, 2), (7, 2), (8, 2), (9, 2)]  # redeliveries first
            assert seen(got)[4:] == [(off, 1) for off in range(10, 22)]
            assert [d.offset for d in c.group_dead_letters(T, N, S, 0, G)] == [6]
            assert state(c).position == 22
        finally:
            c.close()


# ---------------------------------------------------------------------- 2. one holder


def test_2_a_held_record_goes_to_no_other_poller(client: Client, backend: tuple[str, Any]) -> None:
    make(client, records=10)
    other = felix_redis.connect(backend[0])
    try:
        a = poll(client, 4)
        b = other.group_poll(T, N, S, 0, G, max_records=4)
        c = poll(client, 4)
        assert [r.offset for r in a + b + c] == list(range(10))
        assert other.group_poll(T, N, S, 0, G) == [] and poll(client) == []
        other.group_nack(T, N, S, 0, G, b[0])
        assert seen(poll(client)) == [(b[0].offset, 2)]
    finally:
        other.close()


def test_2_another_poll_does_not_end_a_valid_lease(client: Client, backend: tuple[str, Any]) -> None:
    make(client, records=1, visibility_timeout_ms=800)
    (r,) = poll(client)
    other = felix_redis.connect(backend[0])
    try:
        assert other.group_poll(T, N, S, 0, G) == []
        s = state(client)
        assert (s.in_flight, s.owed) == (1, 0)
        client.group_extend(T, N, S, 0, G, r, by=0.8)  # still the holder
        assert other.group_poll(T, N, S, 0, G) == []
        client.group_nack(T, N, S, 0, G, r)
        assert seen(other.group_poll(T, N, S, 0, G)) == [(0, 2)]
    finally:
        other.close()


@needs_redis
def test_2_concurrent_pollers_never_share_a_valid_lease(redis_client: Client, redis_url: str) -> None:
    total = 400
    make(redis_client, records=total, visibility_timeout_ms=30_000, max_attempts=100)
    deliveries: list[tuple[int, int, str, float]] = []  # offset, attempts, worker, poll returned
    handed_back: dict[tuple[int, int], float] = {}  # (offset, attempts) -> nack call started
    acked: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(name: str, seed: int) -> None:
        rng = random.Random(seed)
        c = felix_redis.connect(redis_url)
        try:
            idle = 0
            while idle < 5:
                records = c.group_poll(T, N, S, 0, G, max_records=rng.randint(1, 8))
                now = time.monotonic()
                if not records:
                    idle += 1
                    time.sleep(0.005)
                    continue
                idle = 0
                with lock:
                    deliveries.extend((r.offset, r.attempts, name, now) for r in records)
                for r in records:
                    if rng.random() < 0.25 and r.attempts < 4:
                        with lock:
                            handed_back[(r.offset, r.attempts)] = time.monotonic()
                        c.group_nack(T, N, S, 0, G, r)
                    else:
                        assert c.group_ack(T, N, S, 0, G, r) is True
                        with lock:
                            acked.append(r.offset)
        except BaseException as exc:
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=work, args=(f"w{i}", i), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a poller hung"
    assert not errors, errors
    claims = [(off, att) for off, att, _, _ in deliveries]
    assert len(claims) == len(set(claims)), "one claim handed out twice"
    assert sorted(acked) == list(range(total)), "a record acked twice or never"
    by_offset: dict[int, list[tuple[int, str, float]]] = defaultdict(list)
    for off, att, name, at in deliveries:
        by_offset[off].append((att, name, at))
    assert len({name for _, _, name, _ in deliveries}) == 3
    for off, ds in by_offset.items():
        ds.sort()
        assert [att for att, _, _ in ds] == list(range(1, len(ds) + 1))
        for (att, _, _), (_, _, got_again) in itertools.pairwise(ds):
            # Redelivered only after the holder handed it back (the lease never lapses).
            assert handed_back[(off, att)] < got_again
    assert state(redis_client).lag == 0


# ------------------------------------------------------------------------ 3. attempts


def test_3_nack_lapse_and_reclaim_each_add_one_attempt(client: Client) -> None:
    make(client, records=1, visibility_timeout_ms=200, max_attempts=10)
    (r,) = client.group_poll_as(T, N, S, 0, G, consumer="w1")
    assert r.attempts == 1 and r.claim == "0:0:1"
    client.group_nack(T, N, S, 0, G, r)
    (r,) = client.group_poll_as(T, N, S, 0, G, consumer="w1", reclaim=False)
    assert r.attempts == 2
    time.sleep(0.25)  # lapse
    (r,) = client.group_poll_as(T, N, S, 0, G, consumer="w1", reclaim=False)
    assert r.attempts == 3
    (r,) = client.group_poll_as(T, N, S, 0, G, consumer="w1", reclaim=True)  # lease still valid
    assert r.attempts == 4 and r.claim == "0:0:4"
    client.group_nack(T, N, S, 0, G, r)
    (r,) = poll(client)
    assert r.attempts == 5


def test_3_reclaim_returns_only_my_in_flight_records_at_once(client: Client) -> None:
    make(client, records=5, visibility_timeout_ms=60_000)
    mine = client.group_poll_as(T, N, S, 0, G, consumer="w1", max_records=2)
    theirs = client.group_poll_as(T, N, S, 0, G, consumer="w2", max_records=2)
    anonymous = poll(client, 1)
    assert [r.offset for r in mine + theirs + anonymous] == [0, 1, 2, 3, 4]
    # Reclaim: w1's own records at once with attempts + 1, nothing of w2 or of anyone else.
    back = client.group_poll_as(T, N, S, 0, G, consumer="w1", reclaim=True)
    assert seen(back) == [(0, 2), (1, 2)]
    with pytest.raises(felix_redis.StaleClaim):
        client.group_nack(T, N, S, 0, G, mine[0])  # the old claim is stale
    assert client.group_poll_as(T, N, S, 0, G, consumer="w3", reclaim=True) == []
    # w2's claims are untouched.
    for r in theirs:
        client.group_extend(T, N, S, 0, G, r)
    client.group_extend(T, N, S, 0, G, anonymous[0])
    again = client.group_poll_as(T, N, S, 0, G, consumer="w2", reclaim=True)
    assert seen(again) == [(2, 2), (3, 2)]
    s = state(client)
    assert (s.in_flight, s.owed, s.pending) == (5, 0, 0)


def test_3_reclaim_after_a_lapse_or_nack_takes_nothing_twice(client: Client) -> None:
    make(client, records=2, visibility_timeout_ms=200)
    a, _b = client.group_poll_as(T, N, S, 0, G, consumer="w1")
    client.group_nack(T, N, S, 0, G, a, delay=60)
    time.sleep(0.25)  # b lapses
    got = client.group_poll_as(T, N, S, 0, G, consumer="w1", reclaim=True)
    assert seen(got) == [(1, 2)]  # a waits for its delay
    assert client.group_poll_as(T, N, S, 0, G, consumer="w1", reclaim=False) == []


# ----------------------------------------------------------------- 4. bounded retries


def test_4_poison_record_is_delivered_max_attempts_times_then_dead(client: Client) -> None:
    make(client, records=4, max_attempts=3)
    deliveries: list[tuple[int, int]] = []
    for _ in range(20):
        records = poll(client, 1)
        if not records:
            break
        (r,) = records
        deliveries.append((r.offset, r.attempts))
        if r.offset == 1:
            became_dead = client.group_nack(T, N, S, 0, G, r)
            assert became_dead is (r.attempts == 3)
        else:
            client.group_ack(T, N, S, 0, G, r)
    assert [d for d in deliveries if d[0] == 1] == [(1, 1), (1, 2), (1, 3)]
    assert {d[0] for d in deliveries} == {0, 1, 2, 3}
    (dl,) = client.group_dead_letters(T, N, S, 0, G)
    assert (dl.offset, dl.attempts, dl.reason) == (1, 3, "max_attempts reached: nacked")
    s = state(client)
    assert (s.position, s.lag, s.dead) == (4, 0, 1)


def test_4_lapsing_record_is_dead_after_max_attempts(client: Client) -> None:
    make(client, records=2, visibility_timeout_ms=150, max_attempts=2)
    (r,) = poll(client, 1)
    assert seen([r]) == [(0, 1)]
    time.sleep(0.2)
    (r,) = poll(client, 1)
    assert seen([r]) == [(0, 2)]
    time.sleep(0.2)
    (r,) = poll(client, 1)  # the second lapse makes 0 a dead letter; 1 is next
    assert seen([r]) == [(1, 1)]
    client.group_ack(T, N, S, 0, G, r)
    (dl,) = client.group_dead_letters(T, N, S, 0, G)
    assert (dl.offset, dl.attempts, dl.reason) == (0, 2, "max_attempts reached: lease lapsed")
    assert poll(client) == []
    assert state(client).position == 2


def test_4_reclaimed_record_is_dead_after_max_attempts(client: Client) -> None:
    make(client, records=1, max_attempts=2)
    client.group_poll_as(T, N, S, 0, G, consumer="w1")
    (r,) = client.group_poll_as(T, N, S, 0, G, consumer="w1", reclaim=True)
    assert r.attempts == 2
    assert client.group_poll_as(T, N, S, 0, G, consumer="w1", reclaim=True) == []
    assert [(d.offset, d.attempts, d.reason) for d in client.group_dead_letters(T, N, S, 0, G)] == [
        (0, 2, "max_attempts reached: reclaimed by w1")]


def test_4_lowering_max_attempts_applies_to_owed_records(client: Client) -> None:
    make(client, records=2, max_attempts=5)
    (r, _) = poll(client)
    client.group_nack(T, N, S, 0, G, r)
    (r,) = poll(client, 1)
    client.group_nack(T, N, S, 0, G, r)  # owed after 2 deliveries
    client.group_configure(T, N, S, G, max_attempts=2)
    assert poll(client) == []  # not delivered a third time
    assert [(d.offset, d.attempts, d.reason) for d in client.group_dead_letters(T, N, S, 0, G)] == [
        (0, 2, "max_attempts reached")]
    assert state(client).owed == 0


def test_4_redrive_makes_a_dead_letter_owed_with_attempts_from_one(client: Client) -> None:
    make(client, records=3, max_attempts=2)
    r0, r1, r2 = poll(client)
    client.group_dead_letter(T, N, S, 0, G, r1, reason="bug")
    client.group_ack_many(T, N, S, 0, G, [r0, r2])
    assert state(client).position == 3
    assert client.group_redrive(T, N, S, 0, G, [1]) == 1
    assert client.group_dead_letters(T, N, S, 0, G) == []
    s = state(client)
    assert (s.position, s.lag, s.owed, s.dead) == (1, 2, 1, 0)
    (r,) = poll(client)
    assert seen([r]) == [(1, 1)] and r.payload == b"r1"
    client.group_nack(T, N, S, 0, G, r)
    (r,) = poll(client)
    assert r.attempts == 2
    assert client.group_nack(T, N, S, 0, G, r) is True  # the bound applies again
    assert [(d.offset, d.attempts) for d in client.group_dead_letters(T, N, S, 0, G)] == [(1, 2)]
    assert state(client).position == 3
    # Redrive of everything; then the record is finished by an ack.
    assert client.group_redrive(T, N, S, 0, G) == 1
    (r,) = poll(client)
    assert seen([r]) == [(1, 1)]
    client.group_ack(T, N, S, 0, G, r)
    s = state(client)
    assert (s.position, s.lag, s.dead) == (3, 0, 0)


def test_4_discard_removes_dead_letter_and_position_stays(client: Client, unchanged: Any) -> None:
    make(client, records=4)
    records = poll(client)
    client.group_dead_letter(T, N, S, 0, G, records[0], reason="a")
    client.group_dead_letter(T, N, S, 0, G, records[2], reason="b")
    client.group_ack_many(T, N, S, 0, G, [records[1], records[3]])
    assert state(client).position == 4
    with unchanged(), pytest.raises(felix_redis.NotFound):
        client.group_discard(T, N, S, 0, G, [0, 1])  # 1 is not a dead letter: nothing happens
    assert client.group_discard(T, N, S, 0, G, [2]) == 1
    assert [d.offset for d in client.group_dead_letters(T, N, S, 0, G)] == [0]
    assert client.group_discard(T, N, S, 0, G) == 1
    assert client.group_dead_letters(T, N, S, 0, G) == []
    s = state(client)
    assert (s.position, s.lag, s.dead, s.owed) == (4, 0, 0, 0)
    assert poll(client) == []
    assert client.read(T, N, S, 0, 0)[0].payload == b"r0"  # the record stays in the log
    with pytest.raises(felix_redis.NotFound):
        client.group_redrive(T, N, S, 0, G, [0])


# --------------------------------------------------------------------------- 5. order


def test_5_due_redeliveries_first_then_new_records_in_offset_order(client: Client) -> None:
    make(client, records=8)
    r = poll(client, 3)
    assert [x.offset for x in r] == [0, 1, 2]
    client.group_nack(T, N, S, 0, G, r[2])
    client.group_nack(T, N, S, 0, G, r[0])
    got = poll(client, 10)
    assert sorted(seen(got[:2])) == [(0, 2), (2, 2)]
    assert seen(got[2:]) == [(off, 1) for off in range(3, 8)]
    # With room for one, a due redelivery still comes before a new record.
    client.publish(T, N, S, b"r8")
    client.group_nack(T, N, S, 0, G, got[-1])
    assert seen(poll(client, 1)) == [(7, 2)]
    assert seen(poll(client, 1)) == [(8, 1)]


def test_5_delayed_nack_waits_for_its_delay_on_server_time(client: Client) -> None:
    make(client, records=2)
    a, _b = poll(client)
    before = server_ms(client.redis)
    client.group_nack(T, N, S, 0, G, a, delay=0.3)
    after = server_ms(client.redis)
    due = client.redis.zscore(f"{GROUP0}:owed", "0")
    assert before + 300 <= due <= after + 300
    assert poll(client) == []
    deadline = time.monotonic() + 3
    while True:
        ahead = server_ms(client.redis)
        got = poll(client)
        behind = server_ms(client.redis)
        if got:
            assert seen(got) == [(0, 2)]
            assert behind >= before + 300
            break
        assert ahead < after + 300 + 50, "not redelivered once due"
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_5_a_due_redelivery_brings_no_record_whose_delay_runs(client: Client) -> None:
    make(client, records=3)
    a, b, c = poll(client)
    client.group_nack(T, N, S, 0, G, a, delay=60)
    client.group_nack(T, N, S, 0, G, b)
    client.group_nack(T, N, S, 0, G, c, delay=60)
    assert seen(poll(client)) == [(1, 2)], "only the record nacked without a delay is due"
    s = state(client)
    assert (s.owed, s.in_flight) == (2, 1)


# ------------------------------------------------------------------------ 6. position


def test_6_position_stops_at_the_first_unfinished_record(client: Client) -> None:
    make(client, records=6)
    records = poll(client)
    for i in (1, 2, 4):
        client.group_ack(T, N, S, 0, G, records[i])
    assert state(client).position == 0
    client.group_nack(T, N, S, 0, G, records[0])
    assert state(client).position == 0
    (again,) = poll(client, 1)
    client.group_ack(T, N, S, 0, G, again)
    s = state(client)
    assert (s.position, s.lag) == (3, 3)  # jumped over the finished run 1, 2
    client.group_dead_letter(T, N, S, 0, G, records[3])
    assert state(client).position == 5  # 3 dead, 4 acked
    client.group_ack(T, N, S, 0, G, records[5])
    s = state(client)
    assert (s.position, s.lag) == (6, 0)


def test_6_redriven_dead_letter_below_the_position_pulls_it_back(client: Client) -> None:
    make(client, records=6)
    records = poll(client)
    client.group_dead_letter(T, N, S, 0, G, records[2])
    client.group_dead_letter(T, N, S, 0, G, records[4])
    client.group_ack_many(T, N, S, 0, G, [r for r in records if r.offset not in (2, 4)])
    assert state(client).position == 6
    client.group_redrive(T, N, S, 0, G, [4])
    assert (state(client).position, state(client).lag) == (4, 2)
    client.group_redrive(T, N, S, 0, G, [2])
    s = state(client)
    assert (s.position, s.lag, s.owed) == (2, 4, 2)
    got = poll(client)
    assert sorted(seen(got)) == [(2, 1), (4, 1)]
    client.group_ack(T, N, S, 0, G, 2)
    assert state(client).position == 4
    client.group_ack(T, N, S, 0, G, 4)
    s = state(client)
    assert (s.position, s.lag) == (6, 0)


def test_6_position_is_stored_with_the_group(client: Client) -> None:
    make(client, records=4)
    records = poll(client)
    client.group_ack_many(T, N, S, 0, G, [records[0], records[1], records[3]])
    assert int(client.redis.hget(GROUP0, "pos")) == 2
    # record 3 finished above it: the top run of finished records (docs/keys.md)
    assert finished_runs(client.redis, {"done": f"{GROUP0}:done", "group": GROUP0}) == [(3, 3)]


# --------------------------------------------------------------- 7. idempotent producer


def test_7_resend_after_a_lost_reply_lands_once(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    client.stream_create(T, N, S)
    producer = client.idempotent_producer()
    assert producer.id is not None
    original = client._execute
    lost: list[Eval] = []

    def reply_lost_once(op: Any) -> Any:
        result = original(op)
        if isinstance(op, Eval) and op.script == "publish" and not lost:
            lost.append(op)
            raise felix_redis.ConnectionFailed("the reply was lost")
        return result

    monkeypatch.setattr(client, "_execute", reply_lost_once)
    assert producer.publish_batch(T, N, S, [b"a", b"b"]) == [Published(0, 0), Published(0, 1)]
    assert len(lost) == 1
    assert [r.payload for r in client.read(T, N, S, 0, 0)] == [b"a", b"b"]
    assert producer.publish(T, N, S, b"c") == Published(0, 2)
    # The client's own publish (an implicit producer per thread) behaves the same.
    lost.clear()
    assert client.publish(T, N, S, b"d") == Published(0, 3)
    assert len(lost) == 1
    assert [r.payload for r in client.read(T, N, S, 0, 0)] == [b"a", b"b", b"c", b"d"]


def test_7_two_lost_replies_raise_and_the_next_publish_still_lands(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.stream_create(T, N, S)
    producer = client.idempotent_producer()
    original = client._execute
    failing = [True]

    def reply_lost(op: Any) -> Any:
        result = original(op)
        if isinstance(op, Eval) and op.script == "publish" and failing[0]:
            raise felix_redis.ConnectionFailed("the reply was lost")
        return result

    monkeypatch.setattr(client, "_execute", reply_lost)
    with pytest.raises(felix_redis.ConnectionFailed):
        producer.publish(T, N, S, b"a")
    failing[0] = False
    assert producer.publish(T, N, S, b"b") == Published(0, 1)
    assert [r.payload for r in client.read(T, N, S, 0, 0)] == [b"a", b"b"]


def test_7_raw_resend_gap_and_older_sequence(client: Client, unchanged: Any) -> None:
    client.stream_create(T, N, S)
    producer = client.idempotent_producer()
    assert producer.publish_batch(T, N, S, [b"a", b"b"], shard=0) == [Published(0, 0), Published(0, 1)]
    keys = [f"{BASE0}:meta", f"{BASE0}:log", f"{BASE0}:conf"]

    def send(seq: int, *payloads: bytes) -> list[Any]:
        return run_script(client, "publish", keys,
                          ["", producer._state.producer_id, seq, 3_600_000, "", "", "", *payloads])

    def refused(seq: int, *payloads: bytes) -> felix_redis.FelixError | None:
        with pytest.raises(ResponseError) as info:
            send(seq, *payloads)
        return from_response(str(info.value))

    with unchanged():
        first, count, _ms, duplicate, _kept = send(1, b"a", b"b")
    assert (first, count, duplicate) == (0, 2, 1)
    with unchanged():
        assert isinstance(refused(3, b"x"), felix_redis.SequenceError)  # gap
        assert isinstance(refused(1, b"a"), felix_redis.SequenceError)  # same sequence, other count
        assert isinstance(refused(0, b"x"), felix_redis.InvalidArgument)
    assert send(2, b"c")[:2] == [2, 1]
    with unchanged():
        assert isinstance(refused(1, b"a", b"b"), felix_redis.SequenceError)  # older
        assert send(2, b"c")[:2] == [2, 1]
    assert [r.payload for r in client.read(T, N, S, 0, 0)] == [b"a", b"b", b"c"]


def test_7_sequence_error_is_mapped_by_the_client(client: Client) -> None:
    client.stream_create(T, N, S)
    producer = client.idempotent_producer()
    producer.publish(T, N, S, b"a", shard=0)
    keys = [f"{BASE0}:meta", f"{BASE0}:log", f"{BASE0}:conf"]
    with pytest.raises(felix_redis.SequenceError):
        client._execute(Eval("publish", keys, ["", producer._state.producer_id, 5, 3_600_000, "", "", "", b"x"],
                             "test"))
    assert client.stream_describe(T, N, S).tails == [1]


def test_7_producers_are_independent(client: Client) -> None:
    client.stream_create(T, N, S, shards=2)
    p1, p2 = client.idempotent_producer(), client.idempotent_producer()
    assert p1.id != p2.id
    a = p1.publish_keyed(T, N, S, "order-42", b"x")
    b = p2.publish_keyed(T, N, S, "order-42", b"x")
    assert a.shard == b.shard == felix_redis.shard_for_key(b"order-42", 2)
    assert (a.offset, b.offset) == (0, 1)


# ----------------------------------------------------------------- 8. server time


@pytest.fixture(scope="module")
def shifted() -> Iterator[RedisServer]:
    """A private server whose clock runs 3 days behind the machine's (and the client's)."""
    try:
        server = clocks.start_shifted_server("-3d")
    except LookupError as why:
        if os.environ.get("CI") and clocks.missing_faketime():
            pytest.fail(f"{why}: .ci/run installs it")
        pytest.skip(str(why))
    try:
        yield server
    finally:
        server.stop()


def test_8_leases_delays_and_publish_times_come_from_the_server_clock(shifted: RedisServer) -> None:
    """The server's clock is 3 days behind the client's: every time a script stores
    (lease expiry, extend, nack delay, publish time) is the server's."""
    client = felix_redis.connect(shifted.url)
    try:
        raw = client.redis
        raw.flushall()
        skew = clocks.wall_ms() - server_ms(raw)
        assert 3 * clocks.DAY_MS - 3_600_000 < skew < 3 * clocks.DAY_MS + 3_600_000, f"the shift is {skew} ms"
        make(client, records=2, visibility_timeout_ms=5000)
        before = server_ms(raw)
        a, b = poll(client)
        after = server_ms(raw)
        keys = {"held": f"{GROUP0}:held", "lease": f"{GROUP0}:lease"}
        for off in (0, 1):
            expiry = lease_expiry(raw, keys, off)
            assert expiry is not None and before + 5000 <= expiry <= after + 5000
        assert all(before - 60_000 <= r.published_ms <= after for r in (a, b))
        before = server_ms(raw)
        expiry = client.group_extend(T, N, S, 0, G, a, by=100)
        after = server_ms(raw)
        assert before + 100_000 <= expiry <= after + 100_000
        assert lease_expiry(raw, keys, 0) == expiry
        before = server_ms(raw)
        client.group_nack(T, N, S, 0, G, b, delay=7)
        after = server_ms(raw)
        assert before + 7000 <= raw.zscore(f"{GROUP0}:owed", "1") <= after + 7000
        assert poll(client) == [], "the nacked record waits for its delay on the server's clock"
        before = server_ms(raw)
        published = client.publish(T, N, S, b"now")
        after = server_ms(raw)
        (record,) = client.read(T, N, S, 0, published.offset)
        assert before <= record.published_ms <= after
        assert abs(record.published_at.timestamp() * 1000 - record.published_ms) < 1
    finally:
        client.close()


@pytest.mark.parametrize("offset", ["+400d", "-400d"])
def test_8_a_client_clock_days_off_changes_nothing(redis_client: Client, redis_url: str, offset: str) -> None:
    """A client whose clock is 400 days off (a process under libfaketime) publishes,
    polls, extends and nacks: every time it gets back is the server's, a lease it holds
    does not lapse for it, and a delayed nack is not due early."""
    if clocks.missing_faketime():
        if os.environ.get("CI"):
            pytest.fail(f"{clocks.missing_faketime()}: .ci/run installs it")
        pytest.skip(str(clocks.missing_faketime()))
    before = server_ms(redis_client.redis)
    got = clocks.run_shifted_client(redis_url, offset)
    after = server_ms(redis_client.redis)
    skew = got["client_ms_before"] - before
    assert abs(skew) > 399 * clocks.DAY_MS, f"the client's clock is only {skew} ms off"
    assert before <= got["published_ms"] <= after
    assert before <= got["published_at"] <= after + 1
    assert before + 2000 <= got["extended_to"] <= after + 2000
    assert got["poll_while_held"] == 0 and got["poll_while_delayed"] == 0


# ----------------------------------------------------------------- 9. bad input


BAD_NAMES = ["a{b", "a}b", "a:b", "a b", "", "x" * 65, "é", "a/b", "a|b", "_x", "-x", "a\nb"]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_9_bad_names_are_refused(stream: Client, unchanged: Any, bad: str) -> None:
    c = stream
    calls: list[Callable[[], Any]] = [
        lambda: c.stream_create(bad, N, S),
        lambda: c.stream_create(T, bad, S),
        lambda: c.stream_create(T, N, bad),
        lambda: c.stream_describe(T, N, bad),
        lambda: c.stream_list(bad),
        lambda: c.publish(T, bad, S, b"x"),
        lambda: c.group_create(T, N, S, bad),
        lambda: c.group_poll(T, N, S, 0, bad),
        lambda: c.group_poll_as(T, N, S, 0, G, consumer=bad),
        lambda: c.group_ack(bad, N, S, 0, G, 0),
        lambda: c.group_describe(T, N, S, bad),
        lambda: c.group_delete(T, N, S, bad),
    ]
    for call in calls:
        with unchanged(), pytest.raises(felix_redis.InvalidArgument):
            call()


def test_9_longest_name_is_accepted(client: Client) -> None:
    name = "x" * 64
    client.stream_create(name, name, name)
    client.group_create(name, name, name, name)
    client.publish(name, name, name, b"x")
    assert len(client.group_poll_as(name, name, name, 0, name, consumer=name)) == 1


def bad_calls(c: Client, r: Record) -> list[tuple[str, Callable[[], Any], type[Exception]]]:
    nf, inv = felix_redis.NotFound, felix_redis.InvalidArgument
    return [
        # unknown stream, group, shard
        ("publish unknown stream", lambda: c.publish(T, N, "nope", b"x"), nf),
        ("publish unknown shard", lambda: c.publish(T, N, S, b"x", shard=1), nf),
        ("group_create unknown stream", lambda: c.group_create(T, N, "nope", G), nf),
        ("poll unknown stream", lambda: c.group_poll(T, N, "nope", 0, G), nf),
        ("poll unknown group", lambda: c.group_poll(T, N, S, 0, "nope"), nf),
        ("poll unknown shard", lambda: c.group_poll(T, N, S, 3, G), nf),
        ("ack unknown group", lambda: c.group_ack(T, N, S, 0, "nope", 0), nf),
        ("nack unknown group", lambda: c.group_nack(T, N, S, 0, "nope", r), nf),
        ("extend unknown group", lambda: c.group_extend(T, N, S, 0, "nope", r), nf),
        ("dead_letter unknown group", lambda: c.group_dead_letter(T, N, S, 0, "nope", r), nf),
        ("dead_letters unknown group", lambda: c.group_dead_letters(T, N, S, 0, "nope"), nf),
        ("redrive unknown group", lambda: c.group_redrive(T, N, S, 0, "nope"), nf),
        ("discard unknown group", lambda: c.group_discard(T, N, S, 0, "nope"), nf),
        ("describe unknown group", lambda: c.group_describe(T, N, S, "nope"), nf),
        ("describe unknown stream", lambda: c.group_describe(T, N, "nope", G), nf),
        ("configure unknown group", lambda: c.group_configure(T, N, S, "nope", max_attempts=2), nf),
        ("delete unknown group", lambda: c.group_delete(T, N, S, "nope"), nf),
        ("delete unknown stream", lambda: c.stream_delete(T, N, "nope"), nf),
        ("ack unknown offset", lambda: c.group_ack(T, N, S, 0, G, 5), nf),
        ("redrive not dead", lambda: c.group_redrive(T, N, S, 0, G, [0]), nf),
        ("discard not dead", lambda: c.group_discard(T, N, S, 0, G, [0]), nf),
        # malformed claims
        ("nack claim without attempts", lambda: c.group_nack(T, N, S, 0, G, "0:0"), inv),
        ("nack claim garbage", lambda: c.group_nack(T, N, S, 0, G, "a:b:c"), inv),
        ("nack claim attempts 0", lambda: c.group_nack(T, N, S, 0, G, "0:0:0"), inv),
        ("nack claim negative", lambda: c.group_nack(T, N, S, 0, G, "0:-1:1"), inv),
        ("nack claim extra part", lambda: c.group_nack(T, N, S, 0, G, "0:0:1:1"), inv),
        ("nack claim other shard", lambda: c.group_nack(T, N, S, 0, G, "1:0:1"), inv),
        ("nack bare offset", lambda: c.group_nack(T, N, S, 0, G, 0), inv),  # type: ignore[arg-type]
        ("extend claim empty", lambda: c.group_extend(T, N, S, 0, G, ""), inv),
        ("dead_letter claim", lambda: c.group_dead_letter(T, N, S, 0, G, "0:x:1"), inv),
        ("ack claim garbage", lambda: c.group_ack(T, N, S, 0, G, "zero"), inv),
        ("ack negative offset", lambda: c.group_ack(T, N, S, 0, G, -1), inv),
        ("ack bool", lambda: c.group_ack(T, N, S, 0, G, True), inv),
        ("redrive garbage", lambda: c.group_redrive(T, N, S, 0, G, ["x"]), inv),
        # numbers
        ("nack negative delay", lambda: c.group_nack(T, N, S, 0, G, r, delay=-1), inv),
        ("nack tiny negative delay", lambda: c.group_nack(T, N, S, 0, G, r, delay=-0.001), inv),
        ("nack NaN delay", lambda: c.group_nack(T, N, S, 0, G, r, delay=float("nan")), inv),
        ("nack huge delay", lambda: c.group_nack(T, N, S, 0, G, r, delay=1e300), inv),
        ("nack infinite delay", lambda: c.group_nack(T, N, S, 0, G, r, delay=float("inf")), inv),
        ("extend infinite", lambda: c.group_extend(T, N, S, 0, G, r, by=float("inf")), inv),
        ("poll infinite wait", lambda: c.group_poll(T, N, S, 0, G, wait=float("inf")), inv),
        ("nack str delay", lambda: c.group_nack(T, N, S, 0, G, r, delay="1"), inv),  # type: ignore[arg-type]
        ("extend negative", lambda: c.group_extend(T, N, S, 0, G, r, by=-1), inv),
        ("extend zero", lambda: c.group_extend(T, N, S, 0, G, r, by=0), inv),
        ("poll max 0", lambda: c.group_poll(T, N, S, 0, G, max_records=0), inv),
        ("poll max huge", lambda: c.group_poll(T, N, S, 0, G, max_records=10_001), inv),
        ("poll negative wait", lambda: c.group_poll(T, N, S, 0, G, wait=-1), inv),
        ("poll negative shard", lambda: c.group_poll(T, N, S, -1, G), inv),
        ("poll reclaim without consumer", lambda: c._drive(c.core.group_poll(T, N, S, 0, G, reclaim=True)), inv),
        ("publish negative shard", lambda: c.publish(T, N, S, b"x", shard=-1), inv),
        ("publish bad payload", lambda: c.publish(T, N, S, 42), inv),  # type: ignore[arg-type]
        ("publish empty key", lambda: c.publish_keyed(T, N, S, "", b"x"), inv),
        ("publish long key", lambda: c.publish_keyed(T, N, S, "k" * 1025, b"x"), inv),
        ("publish oversize", lambda: c.publish(T, N, S, b"x" * (1024 * 1024 + 1)), inv),
        ("stream_create kind", lambda: c.stream_create(T, N, "new", kind="topic"), inv),
        ("stream_create shards 0", lambda: c.stream_create(T, N, "new", shards=0), inv),
        ("stream_create consistency", lambda: c.stream_create(T, N, "new", consistency="some"), inv),
        ("stream_create max_payload", lambda: c.stream_create(T, N, "new", max_payload=0), inv),
        ("group_create vt 0", lambda: c.group_create(T, N, S, "new", visibility_timeout_ms=0), inv),
        ("group_create attempts 0", lambda: c.group_create(T, N, S, "new", max_attempts=0), inv),
    ]


BAD_CALLS = [what for what, _, _ in bad_calls(None, None)]  # type: ignore[arg-type]


@pytest.mark.parametrize("what", BAD_CALLS)
def test_9_bad_input_is_refused_before_anything_is_written(stream: Client, unchanged: Any, what: str) -> None:
    stream.publish_batch(T, N, S, [b"a", b"b"])
    (r,) = poll(stream, 1)
    ((call, exc),) = [(call, exc) for name, call, exc in bad_calls(stream, r) if name == what]
    with unchanged(), pytest.raises(exc):
        call()


@pytest.mark.parametrize(
    "plant",
    ["lease", "owed", "attempts", "done", "redo", "dead", "owner", "byowner", "wake", "held", "group"],
)
def test_9_wrong_key_type_is_refused(stream: Client, unchanged: Any, plant: str) -> None:
    c = stream
    c.publish_batch(T, N, S, [b"a", b"b"])
    (r,) = c.group_poll_as(T, N, S, 0, G, consumer="w1", max_records=1)
    key = GROUP0 if plant == "group" else f"{GROUP0}:{plant}"
    c.redis.delete(key)
    c.redis.set(key, "x") if plant != "group" else c.redis.rpush(key, "x")
    calls: list[Callable[[], Any]] = [
        lambda: poll(c),
        lambda: c.group_poll_as(T, N, S, 0, G, consumer="w1", reclaim=True),
        lambda: c.group_ack(T, N, S, 0, G, r),
        lambda: c.group_nack(T, N, S, 0, G, r),
        lambda: c.group_extend(T, N, S, 0, G, r),
        lambda: c.group_dead_letter(T, N, S, 0, G, r),
        lambda: c.group_dead_letters(T, N, S, 0, G),
        lambda: c.group_redrive(T, N, S, 0, G),
        lambda: c.group_discard(T, N, S, 0, G),
        lambda: c.group_describe(T, N, S, G),
        lambda: c.group_configure(T, N, S, G, max_attempts=3),
        lambda: c.group_delete(T, N, S, G),
    ]
    for call in calls:
        with unchanged(), pytest.raises(felix_redis.WrongKeyType):
            call()


def test_9_wrong_key_type_of_stream_keys(client: Client, unchanged: Any) -> None:
    client.redis.set(f"{BASE0}:log", "x")
    with unchanged(), pytest.raises(felix_redis.WrongKeyType):
        client.stream_create(T, N, S)
    client.redis.delete(f"{BASE0}:log")
    client.stream_create(T, N, S)
    client.redis.delete(f"{BASE0}:log")
    client.redis.set(f"{BASE0}:log", "x")
    with unchanged(), pytest.raises(felix_redis.WrongKeyType):
        client.publish(T, N, S, b"x")
    with unchanged(), pytest.raises(felix_redis.WrongKeyType):
        client.group_create(T, N, S, G)
    with unchanged(), pytest.raises(felix_redis.WrongKeyType):
        client.read(T, N, S, 0, 0)


def test_9_errors_are_felix_errors_with_context(stream: Client) -> None:
    with pytest.raises(felix_redis.NotFound) as info:
        stream.group_poll(T, N, S, 0, "nope")
    assert isinstance(info.value, felix_redis.FelixError)
    assert "nope" in str(info.value) and "acme/prod/jobs" in str(info.value)
    with pytest.raises(ValueError):  # InvalidArgument is a ValueError
        stream.group_nack(T, N, S, 0, G, "0:0")
    assert not isinstance(info.value, redis.RedisError)
