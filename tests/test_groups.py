"""Consumer groups: create/configure/delete/list, ack/nack/extend/dead-letter semantics,
group_describe, and that finished records leave no per-record state behind."""

from __future__ import annotations

import time
from typing import Any

import pytest

import felix_redis
from felix_redis import Client, Record
from felix_redis.keys import GROUP_ROLES
from tests.conftest import lease_expiry

T, N, S, G = "acme", "prod", "jobs", "workers"
GROUP0 = "felix:{acme/prod/jobs/0}:g:workers"


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


def offs(records: list[Record]) -> list[int]:
    return [r.offset for r in records]


def state(client: Client, shard: int = 0) -> felix_redis.ShardState:
    return client.group_describe(T, N, S, G).shards[shard]


# ------------------------------------------------------------------ create / configure


def test_create_earliest_latest_and_offset(client: Client) -> None:
    client.stream_create(T, N, S)
    client.publish_batch(T, N, S, [f"r{i}" for i in range(5)])
    client.group_create(T, N, S, "early")  # earliest is the default
    client.group_create(T, N, S, "late", start="latest")
    client.group_create(T, N, S, "mid", start=3)
    client.group_create(T, N, S, "tail", start=5)
    client.publish(T, N, S, "r5")
    assert offs(client.group_poll(T, N, S, 0, "early")) == [0, 1, 2, 3, 4, 5]
    assert offs(client.group_poll(T, N, S, 0, "late")) == [5]
    assert offs(client.group_poll(T, N, S, 0, "mid")) == [3, 4, 5]
    assert offs(client.group_poll(T, N, S, 0, "tail")) == [5]
    info = client.group_describe(T, N, S, "mid").shards[0]
    assert (info.position, info.tail, info.lag, info.pending) == (3, 6, 3, 0)


def test_create_start_beyond_tail_is_refused(client: Client, unchanged: Any) -> None:
    client.stream_create(T, N, S)
    client.publish(T, N, S, b"x")
    with unchanged(), pytest.raises(felix_redis.InvalidArgument):
        client.group_create(T, N, S, G, start=2)
    for bad in ("oldest", -1, 1.5, None):
        with unchanged(), pytest.raises(felix_redis.InvalidArgument):
            client.group_create(T, N, S, G, start=bad)  # type: ignore[arg-type]


def test_create_on_every_shard_and_group_exists(client: Client, unchanged: Any) -> None:
    make(client, shards=3)
    for shard in range(3):
        client.publish(T, N, S, f"s{shard}", shard=shard)
        assert offs(poll(client, shard=shard)) == [0]
    with unchanged(), pytest.raises(felix_redis.GroupExists):
        client.group_create(T, N, S, G)
    with unchanged(), pytest.raises(felix_redis.GroupExists):
        client.group_create(T, N, S, G, start="latest", visibility_timeout_ms=5, max_attempts=9)


def test_create_stores_settings_and_configure_changes_them(client: Client) -> None:
    make(client, records=2, visibility_timeout_ms=1234, max_attempts=7)
    info = client.group_describe(T, N, S, G)
    assert (info.visibility_timeout_ms, info.max_attempts) == (1234, 7)
    client.group_configure(T, N, S, G, visibility_timeout_ms=60_000)
    info = client.group_describe(T, N, S, G)
    assert (info.visibility_timeout_ms, info.max_attempts) == (60_000, 7)
    client.group_configure(T, N, S, G, max_attempts=2)
    info = client.group_describe(T, N, S, G)
    assert (info.visibility_timeout_ms, info.max_attempts) == (60_000, 2)
    # The new timeout applies to new leases, the new bound to the next failure.
    before = server_ms(client.redis)
    (r,) = poll(client, 1)
    after = server_ms(client.redis)
    expiry = lease_expiry(client.redis, {"held": GROUP0 + ":held", "lease": GROUP0 + ":lease"}, 0)
    assert before + 60_000 <= expiry <= after + 60_000
    client.group_nack(T, N, S, 0, G, r)
    (r,) = poll(client, 1)
    assert r.attempts == 2
    assert client.group_nack(T, N, S, 0, G, r) is True  # dead: max_attempts is 2 now


def test_create_uses_environment_defaults(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    client.stream_create(T, N, S)
    client.group_create(T, N, S, "default")
    info = client.group_describe(T, N, S, "default")
    assert (info.visibility_timeout_ms, info.max_attempts) == (30_000, 5)
    monkeypatch.setenv("FELIX_GROUP_VISIBILITY_TIMEOUT_MS", "4500")
    monkeypatch.setenv("FELIX_GROUP_MAX_ATTEMPTS", "3")
    client.group_create(T, N, S, "env")
    info = client.group_describe(T, N, S, "env")
    assert (info.visibility_timeout_ms, info.max_attempts) == (4500, 3)


def test_configure_refuses_bad_values(client: Client, unchanged: Any) -> None:
    make(client)
    for bad in ({"visibility_timeout_ms": 0}, {"max_attempts": 0}, {"visibility_timeout_ms": -5},
                {"max_attempts": "3"}):
        with unchanged(), pytest.raises(felix_redis.InvalidArgument):
            client.group_configure(T, N, S, G, **bad)
    with unchanged(), pytest.raises(felix_redis.NotFound):
        client.group_configure(T, N, S, "nope", max_attempts=3)


def test_list_and_delete(client: Client) -> None:
    make(client, records=3, shards=2)
    client.group_create(T, N, S, "audit")
    assert client.group_list(T, N, S) == ["audit", G]
    client.group_poll_as(T, N, S, 0, G, consumer="w1")
    client.group_delete(T, N, S, G)
    assert client.group_list(T, N, S) == ["audit"]
    assert client.redis.keys(f"*:g:{G}*") == []
    # the name may stay in the shards' groups sets (a group manager cannot SREM): a name
    # without its group hash counts as no group
    assert client.stream_describe(T, N, S).groups == ["audit"]
    with pytest.raises(felix_redis.NotFound):
        poll(client)
    with pytest.raises(felix_redis.NotFound):
        client.group_delete(T, N, S, G)
    # The records stay; a new group of the same name starts from scratch.
    client.group_create(T, N, S, G)
    r = poll(client)
    assert offs(r) == [0, 1, 2] and all(x.attempts == 1 for x in r)
    assert offs(client.group_poll(T, N, S, 0, "audit")) == [0, 1, 2]


# ----------------------------------------------------------------------------- ack


def test_ack_finished_record_is_a_noop(client: Client, unchanged: Any) -> None:
    make(client, records=2)
    a, _b = poll(client)
    assert client.group_ack(T, N, S, 0, G, a) is True
    with unchanged():
        assert client.group_ack(T, N, S, 0, G, a) is False
        assert client.group_ack(T, N, S, 0, G, 0) is False
        assert client.group_ack(T, N, S, 0, G, "0:0:1") is False


def test_ack_accepts_record_claim_and_offset(client: Client) -> None:
    make(client, records=3)
    a, b, c = poll(client)
    assert client.group_ack(T, N, S, 0, G, a) is True
    assert client.group_ack(T, N, S, 0, G, b.claim) is True
    assert client.group_ack(T, N, S, 0, G, c.offset) is True
    assert client.group_ack_many(T, N, S, 0, G, [0, 1, 2]) == [False, False, False]
    assert state(client).position == 3


def test_ack_stale_claim_of_unfinished_record_finishes_it(client: Client) -> None:
    make(client, records=2)
    first, other = poll(client)
    client.group_nack(T, N, S, 0, G, first)
    # Owed (not in flight): an old claim still finishes it.
    assert client.group_ack(T, N, S, 0, G, first.claim) is True
    assert poll(client) == []
    # In flight under a newer lease: the old claim finishes it too.
    client.group_nack(T, N, S, 0, G, other)
    (again,) = poll(client)
    assert again.attempts == 2
    assert client.group_ack(T, N, S, 0, G, other.claim) is True
    with pytest.raises(felix_redis.StaleClaim):
        client.group_nack(T, N, S, 0, G, again)
    s = state(client)
    assert (s.position, s.lag, s.owed, s.in_flight) == (2, 0, 0, 0)


def test_ack_lapsed_record_finishes_it(client: Client) -> None:
    make(client, records=1, visibility_timeout_ms=200)
    (r,) = poll(client)
    time.sleep(0.25)
    assert state(client).owed == 1
    assert client.group_ack(T, N, S, 0, G, r) is True
    assert poll(client) == []
    assert state(client).lag == 0


def test_ack_never_delivered_offset_is_not_found(client: Client, unchanged: Any) -> None:
    make(client, records=3)
    poll(client, 1)
    for off in (1, 2, 3, 99):
        with unchanged(), pytest.raises(felix_redis.NotFound):
            client.group_ack(T, N, S, 0, G, off)
    # A batch with one offset never delivered still acks the others (issue 25: each claim
    # on its own), and says which one was not delivered.
    with pytest.raises(felix_redis.NotFound, match=r"record 2 has not been delivered.*the other 1 was settled") as e:
        client.group_ack_many(T, N, S, 0, G, [0, 2])
    assert getattr(e.value, "outcomes", None) == [True, None]
    assert client.group_describe(T, N, S, G).shards[0].position == 1


# ------------------------------------------------------ nack / extend / dead_letter stale


SETTLE = ["nack", "extend", "dead_letter"]


def settle(client: Client, how: str, ref: Record | str) -> Any:
    if how == "nack":
        return client.group_nack(T, N, S, 0, G, ref)
    if how == "extend":
        return client.group_extend(T, N, S, 0, G, ref)
    return client.group_dead_letter(T, N, S, 0, G, ref, reason="x")


@pytest.mark.parametrize("how", SETTLE)
def test_settle_with_lapsed_lease_is_stale(client: Client, unchanged: Any, how: str) -> None:
    make(client, records=1, visibility_timeout_ms=200)
    (r,) = poll(client)
    time.sleep(0.25)
    with unchanged(), pytest.raises(felix_redis.StaleClaim, match="lapsed"):
        settle(client, how, r)


@pytest.mark.parametrize("how", SETTLE)
def test_settle_with_older_attempts_is_stale(client: Client, unchanged: Any, how: str) -> None:
    make(client, records=1)
    (r,) = poll(client)
    client.group_nack(T, N, S, 0, G, r)
    (again,) = poll(client)
    assert again.attempts == 2
    # the message names the record and the claim's attempts, never as 'OFFSET:ATTEMPTS'
    # (which would read like a SHARD:OFFSET)
    with unchanged(), pytest.raises(felix_redis.StaleClaim, match=r"record 0 with attempts 1 is stale.*attempts now 2"):
        settle(client, how, r)
    with unchanged(), pytest.raises(felix_redis.StaleClaim):
        settle(client, how, "0:0:3")
    settle(client, how, again)  # the current claim works


@pytest.mark.parametrize("how", SETTLE)
def test_settle_finished_or_owed_record_is_stale(client: Client, unchanged: Any, how: str) -> None:
    make(client, records=2)
    a, b = poll(client)
    client.group_ack(T, N, S, 0, G, a)
    client.group_nack(T, N, S, 0, G, b, delay=60)
    for ref in (a, b):
        with unchanged(), pytest.raises(felix_redis.StaleClaim):
            settle(client, how, ref)


@pytest.mark.parametrize("how", SETTLE)
def test_settle_undelivered_record(client: Client, unchanged: Any, how: str) -> None:
    make(client, records=2)
    with unchanged(), pytest.raises(felix_redis.StaleClaim):
        settle(client, how, "0:1:1")
    with unchanged(), pytest.raises(felix_redis.NotFound):
        settle(client, how, "0:7:1")


def test_extend_keeps_record_from_lapsing(client: Client) -> None:
    make(client, records=1, visibility_timeout_ms=300)
    (r,) = poll(client)
    before = server_ms(client.redis)
    expiry = client.group_extend(T, N, S, 0, G, r, by=2.0)
    after = server_ms(client.redis)
    assert before + 2000 <= expiry <= after + 2000
    time.sleep(0.4)  # past the visibility timeout
    assert poll(client) == []
    s = state(client)
    assert (s.in_flight, s.owed) == (1, 0)
    client.group_nack(T, N, S, 0, G, r)  # the claim is still current
    (again,) = poll(client)
    assert again.attempts == 2


def test_extend_default_is_visibility_timeout(client: Client) -> None:
    make(client, records=1, visibility_timeout_ms=300)
    (r,) = poll(client)
    time.sleep(0.2)
    before = server_ms(client.redis)
    expiry = client.group_extend(T, N, S, 0, G, r)
    after = server_ms(client.redis)
    assert before + 300 <= expiry <= after + 300
    time.sleep(0.2)  # 400 ms after the poll, 200 ms after the extend
    assert poll(client) == []
    time.sleep(max(0.0, (expiry - server_ms(client.redis)) / 1000) + 0.02)
    (again,) = poll(client)
    assert again.attempts == 2


def test_extend_shorter_lease(client: Client) -> None:
    make(client, records=1, visibility_timeout_ms=60_000)
    (r,) = poll(client)
    client.group_extend(T, N, S, 0, G, r, by=0.1)
    time.sleep(0.15)
    (again,) = poll(client)
    assert (again.offset, again.attempts) == (0, 2)


def test_dead_letter_on_request(client: Client) -> None:
    make(client, records=3)
    a, b, _c = poll(client)
    before = server_ms(client.redis)
    client.group_dead_letter(T, N, S, 0, G, b, reason="bad card ✗")
    after = server_ms(client.redis)
    (dl,) = client.group_dead_letters(T, N, S, 0, G)
    assert (dl.shard, dl.offset, dl.attempts, dl.reason) == (0, 1, 1, "bad card ✗")
    assert before <= dl.dead_ms <= after
    assert dl.claim == "0:1"
    client.group_ack(T, N, S, 0, G, a)
    assert state(client).position == 2  # the dead letter is finished: position passes it
    # The record stays in the log.
    assert client.read(T, N, S, 0, 1, 1)[0].payload == b"r1"


def test_reason_too_long(client: Client, unchanged: Any) -> None:
    make(client, records=1)
    (r,) = poll(client)
    with unchanged(), pytest.raises(felix_redis.InvalidArgument):
        client.group_dead_letter(T, N, S, 0, G, r, reason="x" * 4097)


# --------------------------------------------------------------------------- describe


def test_describe_scripted_scenario(client: Client) -> None:
    make(client, visibility_timeout_ms=300, max_attempts=3)
    s = state(client)
    assert (s.position, s.tail, s.lag, s.pending, s.owed, s.in_flight, s.dead) == (0, 0, 0, 0, 0, 0, 0)
    assert s.oldest_unfinished_age_ms is None

    client.publish_batch(T, N, S, [f"r{i}" for i in range(6)])
    published_ms = client.read(T, N, S, 0, 0, 1)[0].published_ms
    s = state(client)
    assert (s.position, s.tail, s.lag, s.pending, s.owed, s.in_flight) == (0, 6, 6, 6, 0, 0)

    r0, r1, r2, r3 = client.group_poll_as(T, N, S, 0, G, consumer="w1", max_records=4)
    client.group_ack(T, N, S, 0, G, r1)
    client.group_nack(T, N, S, 0, G, r2)
    client.group_dead_letter(T, N, S, 0, G, r3, reason="nope")
    before = server_ms(client.redis)
    s = state(client)
    after = server_ms(client.redis)
    assert (s.shard, s.position, s.tail, s.lag, s.pending) == (0, 0, 6, 6, 2)
    assert (s.owed, s.in_flight, s.dead) == (1, 1, 1)
    assert s.oldest_unfinished_age_ms is not None
    assert before - published_ms <= s.oldest_unfinished_age_ms <= after - published_ms

    client.group_ack(T, N, S, 0, G, r0)
    s = state(client)
    assert (s.position, s.lag, s.pending, s.owed, s.in_flight, s.dead) == (2, 4, 2, 1, 0, 1)

    taken = client.group_poll_as(T, N, S, 0, G, consumer="w2")
    assert [(r.offset, r.attempts) for r in taken] == [(2, 2), (4, 1), (5, 1)]
    s = state(client)
    assert (s.pending, s.owed, s.in_flight) == (0, 0, 3)
    time.sleep(0.35)  # every lease lapses: owed, not in flight
    s = state(client)
    assert (s.position, s.lag, s.pending, s.owed, s.in_flight) == (2, 4, 0, 3, 0)

    again = poll(client)
    assert sorted((r.offset, r.attempts) for r in again) == [(2, 3), (4, 2), (5, 2)]
    client.group_ack_many(T, N, S, 0, G, again)
    s = state(client)
    assert (s.position, s.tail, s.lag, s.pending, s.owed, s.in_flight, s.dead) == (6, 6, 0, 0, 0, 0, 1)
    assert s.oldest_unfinished_age_ms is None

    info = client.group_describe(T, N, S, G)
    assert (info.lag, info.owed, info.in_flight, info.dead) == (0, 0, 0, 1)


def test_describe_sums_over_shards(client: Client) -> None:
    make(client, shards=3)
    for shard in range(3):
        client.publish_batch(T, N, S, [b"x"] * (shard + 1), shard=shard)
    poll(client, 1, shard=2)
    info = client.group_describe(T, N, S, G)
    assert [s.shard for s in info.shards] == [0, 1, 2]
    assert [s.tail for s in info.shards] == [1, 2, 3]
    assert (info.lag, info.pending, info.in_flight) == (6, 5, 1)


def test_finished_records_leave_no_per_record_state(client: Client) -> None:
    make(client, records=12, visibility_timeout_ms=200, max_attempts=2)
    r = client.group_poll_as(T, N, S, 0, G, consumer="w1", max_records=4)  # 0..3
    client.group_nack(T, N, S, 0, G, r[0])
    client.group_dead_letter(T, N, S, 0, G, r[1])
    client.group_ack(T, N, S, 0, G, r[3])
    client.group_poll_as(T, N, S, 0, G, consumer="w2", max_records=4)  # 0 again, 4, 5, 6
    time.sleep(0.25)  # 2 and the second poll lapse
    client.group_poll_as(T, N, S, 0, G, consumer="w1", reclaim=True, max_records=1)
    client.group_redrive(T, N, S, 0, G)
    for _ in range(20):
        records = client.group_poll_as(T, N, S, 0, G, consumer="w3", max_records=5)
        if not records:
            if state(client).lag == 0:
                break
            time.sleep(0.05)
        client.group_ack_many(T, N, S, 0, G, records)
    client.group_discard(T, N, S, 0, G)
    s = state(client)
    assert (s.position, s.lag, s.owed, s.in_flight, s.dead) == (12, 0, 0, 0, 0)
    for role in GROUP_ROLES[1:]:
        if role == "wake":
            continue
        key = f"{GROUP0}:{role}"
        assert client.redis.exists(key) == 0, f"{role} left behind: {client.redis.type(key)}"
    group = client.redis.hgetall(GROUP0)
    assert int(group[b"pos"]) == 12 and int(group[b"next"]) == 12
