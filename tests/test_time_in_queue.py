"""Time in the queue (CONTRACT, "Added 2026-12-01"): delayed delivery (delay,
deliver_at), expiry (expires_in), headers, the scheduled/unfinished numbers of
group_describe and the per-group rate limit.

A delayed record takes its offset at once and subscribers see it at once, but no
group hands it out before its due time (server clock), a group created later
included; it counts as ``scheduled`` and holds the position. An expired record is
never handed out: the group dead-letters it (reason ``expired``) when it meets it.
A rate limit caps the hand-outs per window and shard, whoever polls; a long poll
waits for the window (or for the first due record) in Redis, not in a loop.

Runs on the real Redis (``--server-binary valkey`` too) and, where the ``client``
fixture is used, on memory://. Waits are short and bounded: a "due" moment is
waited for on the server's clock (``wait_server``), never by a long sleep.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis

import felix_redis
import felix_redis.asyncio as fa
from felix_redis import InvalidArgument, NotFound
from felix_redis.errors import from_response
from felix_redis.protocol import Eval, Sleep
from tests.conftest import dump_keyspace
from tests.support.scripts import run_script

T, N, S, G = "acme", "prod", "jobs", "workers"
DAY = 86400.0
MAX_AHEAD = 366 * DAY


# ------------------------------------------------------------------ helpers


def server_ms(r: Any) -> int:
    """The server's clock (TIME) in ms: what the scripts compare due times with."""
    sec, usec = r.time()
    return int(sec) * 1000 + int(usec) // 1000


def wait_server(r: Any, at_ms: int, *, limit: float = 10.0) -> None:
    """Sleeps until the server's clock reaches ``at_ms`` (bounded)."""
    deadline = time.monotonic() + limit
    while (now := server_ms(r)) < at_ms:
        assert time.monotonic() < deadline, f"server clock stuck at {now}, waiting for {at_ms}"
        time.sleep(min(0.05, (at_ms - now) / 1000 + 0.002))


def setup(client: felix_redis.Client, shards: int = 1, **group: Any) -> None:
    client.stream_create(T, N, S, shards=shards)
    client.group_create(T, N, S, G, **group)


def poll(
    client: felix_redis.Client, group: str = G, shard: int = 0, n: int = 100, **kw: Any
) -> list[felix_redis.Record]:
    return client.group_poll(T, N, S, shard, group, max_records=n, **kw)


def state(client: felix_redis.Client, group: str = G, shard: int = 0) -> felix_redis.ShardState:
    return client.group_describe(T, N, S, group).shards[shard]


def dead(client: felix_redis.Client, group: str = G, shard: int = 0) -> list[tuple[int, int, str]]:
    return [(d.offset, d.attempts, d.reason) for d in client.group_dead_letters(T, N, S, shard, group)]


def due_index(raw: Any, key: str) -> list[tuple[int, int]]:
    """The shard's due index read as docs/keys.md describes it: (offset, due ms) of every
    record it holds, sorted. A chunk member 'v2:K:FIRST:COUNT:LAST:ENTRIES' scored by its
    bucket's start; ENTRIES one after the other, each 'G.DD' or 'G+L.DD': the record(s)
    from G past the one after the previous entry's last (the first entry: G past FIRST;
    G left out when 0), L of them (1 when left out), due at score + DD (two digits);
    COUNT is how many records the entries hold and LAST the last of them. A member of the
    format before v2, 'K:FIRST:COUNT:ENTRIES', has entries 'D.DD' or 'D+L.DD' counted from
    FIRST, joined by ';'."""
    out: list[tuple[int, int]] = []
    for member, score in raw.zrange(key, 0, -1, withscores=True):
        text = member.decode()
        got: list[tuple[int, int]] = []
        if not text.startswith("v2:"):
            _k, first, count, old_entries = text.split(":", 3)
            for entry in old_entries.split(";"):
                head, dd = entry.split(".")
                d, _, n = head.partition("+")
                got += [(int(first) + int(d) + i, int(score) + int(dd)) for i in range(int(n or 1))]
            assert len(got) == int(count), (member, got)
            out += got
            continue
        _v, _k, first, count, last, entries = text.split(":", 5)
        at = int(first)
        for gap, n, dd in re.findall(r"(\d*)(?:\+(\d+))?\.(\d\d)", entries):
            start = at + int(gap or 0)
            got += [(start + i, int(score) + int(dd)) for i in range(int(n or 1))]
            at = start + int(n or 1)
        assert "".join(f"{g}{'+' + n if n else ''}.{d}" for g, n, d in
                       re.findall(r"(\d*)(?:\+(\d+))?\.(\d\d)", entries)) == entries, member
        assert len(got) == int(count) and got[-1][0] == int(last), (member, got)
        out += got
    return sorted(out)


def count_evals(client: Any, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every script call (Eval op) the client makes from now on (sync or asyncio)."""
    ops: list[Any] = []
    real = client._execute
    if asyncio.iscoroutinefunction(real):
        async def aspy(op: Any) -> Any:
            ops.append(op)
            return await real(op)
        monkeypatch.setattr(client, "_execute", aspy)
    else:
        def spy(op: Any) -> Any:
            ops.append(op)
            return real(op)
        monkeypatch.setattr(client, "_execute", spy)
    return ops


def script_calls(raw: redis.Redis) -> int:
    """Script calls the server ran since the last CONFIG RESETSTAT (INFO commandstats)."""
    stats = raw.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items()
               if k in ("cmdstat_fcall", "cmdstat_fcall_ro", "cmdstat_evalsha", "cmdstat_eval", "cmdstat_evalsha_ro"))


@pytest.fixture
def other(backend: tuple[str, Any]) -> Iterator[felix_redis.Client]:
    """A second client on the same backend (another worker process)."""
    c = felix_redis.connect(backend[0])
    yield c
    c.close()


# ------------------------------------------------- delayed delivery: basics


def test_delayed_record_takes_its_offset_at_once_and_no_group_hands_it_out_before_due(
    client: felix_redis.Client,
) -> None:
    setup(client)
    r = client.redis
    assert client.publish(T, N, S, b"a").offset == 0
    b = client.publish(T, N, S, b"b", delay=0.6)
    assert (b.shard, b.offset) == (0, 1)  # its offset is final at once
    assert client.publish(T, N, S, b"c").offset == 2
    assert client.stream_describe(T, N, S).tails[0] == 3

    # subscribers and replay see it at once, with its due time
    replay = client.read(T, N, S, 0, 0)
    assert [x.payload for x in replay] == [b"a", b"b", b"c"]
    delayed = replay[1]
    assert delayed.deliver_ms is not None and delayed.deliver_ms == delayed.published_ms + 600
    assert delayed.deliver_at == datetime.fromtimestamp(delayed.deliver_ms / 1000, tz=timezone.utc)
    assert delayed.deliver_at.tzinfo is not None
    assert replay[0].deliver_at is None and replay[2].deliver_at is None
    sub = client.subscribe(T, N, S, block=0.1)
    assert [x.payload for x in sub.poll(0)] == [b"a", b"b", b"c"]

    # not yet due: scheduled, neither pending nor owed; unfinished and lag count it
    s = state(client)
    assert (s.pending, s.owed, s.in_flight, s.scheduled, s.unfinished, s.lag) == (2, 0, 0, 1, 3, 3)

    got = poll(client)
    assert [x.payload for x in got] == [b"a", b"c"]
    assert server_ms(r) < delayed.deliver_ms, "the test machine is too slow for this test"
    client.group_ack_many(T, N, S, 0, G, got)
    s = state(client)
    # it holds the position; the age ignores it while it is not due
    assert (s.position, s.lag, s.unfinished, s.scheduled, s.pending, s.owed, s.in_flight) == (1, 2, 1, 1, 0, 0, 0)
    assert s.oldest_unfinished_age_ms is None
    assert poll(client) == []
    assert server_ms(r) < delayed.deliver_ms

    wait_server(r, delayed.deliver_ms)
    s = state(client)
    assert s.scheduled == 0 and s.unfinished == 1 and s.pending + s.owed == 1
    assert s.oldest_unfinished_age_ms is not None
    got = poll(client)
    assert [(x.offset, x.attempts, x.payload) for x in got] == [(1, 1, b"b")]
    assert got[0].deliver_ms == delayed.deliver_ms
    assert client.group_ack(T, N, S, 0, G, got[0]) is True
    s = state(client)
    assert (s.position, s.unfinished, s.lag, s.scheduled) == (3, 0, 0, 0)
    assert poll(client) == []


def test_a_delayed_record_not_yet_handed_out_cannot_be_acked(client: felix_redis.Client) -> None:
    setup(client)
    client.publish(T, N, S, b"later", delay=30)
    client.publish(T, N, S, b"now")
    got = poll(client)
    assert [x.offset for x in got] == [1]
    with pytest.raises(NotFound):
        client.group_ack(T, N, S, 0, G, 0)
    with pytest.raises(felix_redis.NotDelivered) as info:
        client.group_ack_many(T, N, S, 0, G, [0, 1])
    assert info.value.outcomes == [None, True]
    s = state(client)
    assert (s.position, s.scheduled, s.unfinished, s.dead) == (0, 1, 1, 0)
    assert poll(client) == []


def test_deliver_at_is_a_moment_in_any_zone_and_a_past_one_is_at_once(client: felix_redis.Client) -> None:
    setup(client)
    r = client.redis
    zone = timezone(timedelta(hours=5, minutes=30))
    due = server_ms(r) + 700
    # a whole ms (exact, no float on the way): the due time is exactly that moment
    at = (datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(milliseconds=due)).astimezone(zone)
    p = client.publish(T, N, S, b"at", deliver_at=at)
    past = client.publish(T, N, S, b"past", deliver_at=datetime(2020, 1, 1, tzinfo=timezone.utc))
    rec = client.read(T, N, S, 0, p.offset, 1)[0]
    assert rec.published_ms < due
    assert rec.deliver_ms == due
    assert rec.deliver_at == at  # the same moment (compared across zones)
    assert client.read(T, N, S, 0, past.offset, 1)[0].deliver_at is None
    assert [x.payload for x in poll(client)] == [b"past"]
    assert state(client).scheduled == 1
    wait_server(r, due)
    assert [x.payload for x in poll(client)] == [b"at"]


def test_publish_batch_and_publish_keyed_apply_delay_and_headers_to_every_record(client: felix_redis.Client) -> None:
    setup(client, shards=2)
    r = client.redis
    batch = client.publish_batch(T, N, S, [b"x", b"y", b"z"], shard=1, delay=0.5, headers={"trace": "t-1"})
    assert [(p.shard, p.offset) for p in batch] == [(1, 0), (1, 1), (1, 2)]
    keyed = client.publish_keyed(T, N, S, "order-7", b"k", delay=0.5, expires_in=60)
    records = client.read(T, N, S, 1, 0)
    dues = {x.deliver_ms for x in records[:3]}
    assert len(dues) == 1 and None not in dues  # the whole batch shares one due time
    assert all(x.headers == {"trace": "t-1"} and x.expires_at is None for x in records[:3])
    krec = client.read(T, N, S, keyed.shard, keyed.offset, 1)[0]
    assert krec.key == "order-7" and krec.deliver_ms is not None and krec.expires_ms is not None
    assert krec.expires_ms - krec.published_ms == 60_000
    group = client.group_sharded(T, N, S, G)
    assert group.poll(10) == []
    info = client.group_describe(T, N, S, G)
    assert info.scheduled == 4 and info.unfinished == 4 and info.pending == 0
    wait_server(r, max(dues.pop(), krec.deliver_ms))
    items = []
    for _ in range(3):
        items += group.poll(10)
    assert sorted((i.shard, i.offset) for i in items) == sorted(
        [(1, 0), (1, 1), (1, 2), (keyed.shard, keyed.offset)])
    assert all(i.attempts == 1 for i in items)
    by_payload = {i.payload: i for i in items}
    assert by_payload[b"y"].headers == {"trace": "t-1"}
    assert by_payload[b"k"].key == "order-7" and by_payload[b"k"].headers == {}
    group.ack_many(items)
    assert client.group_describe(T, N, S, G).unfinished == 0


def test_a_group_created_after_the_delayed_publish_honours_it(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    r = client.redis
    client.publish(T, N, S, b"plain")
    p = client.publish(T, N, S, b"delayed", delay=0.6)
    client.publish(T, N, S, b"plain2")
    due = client.read(T, N, S, 0, p.offset, 1)[0].deliver_ms
    assert due is not None
    client.group_create(T, N, S, "late", start="earliest")
    client.group_create(T, N, S, "tail", start="latest")
    client.group_create(T, N, S, "from1", start=1)
    assert [x.payload for x in poll(client, "late")] == [b"plain", b"plain2"]
    assert [x.payload for x in poll(client, "from1")] == [b"plain2"]
    assert poll(client, "tail") == []
    assert state(client, "late").scheduled == 1
    assert state(client, "from1").scheduled == 1
    s = state(client, "tail")  # it starts after the delayed record: not its own
    assert (s.scheduled, s.unfinished, s.pending) == (0, 0, 0)
    assert server_ms(r) < due
    wait_server(r, due)
    assert [x.payload for x in poll(client, "late")] == [b"delayed"]
    assert [x.payload for x in poll(client, "from1")] == [b"delayed"]
    assert poll(client, "tail") == []
    # a group created once it is due hands it out at once
    client.group_create(T, N, S, "later-still", start="earliest")
    assert [x.payload for x in poll(client, "later-still")] == [b"plain", b"delayed", b"plain2"]


def test_a_long_poll_returns_when_the_first_record_falls_due(
    client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup(client)
    r = client.redis
    client.publish(T, N, S, b"second", delay=1.2)
    p = client.publish(T, N, S, b"first", delay=0.6)
    due = client.read(T, N, S, 0, p.offset, 1)[0].deliver_ms
    assert due is not None
    ops = count_evals(client, monkeypatch)
    start = time.monotonic()
    got = poll(client, wait=5.0)
    elapsed = time.monotonic() - start
    after = server_ms(r)
    assert [x.payload for x in got] == [b"first"]
    assert after >= due
    assert 0.4 < elapsed < 2.5, elapsed  # returns at the due time, not after the wait
    polls = [op for op in ops if type(op) is Eval and op.script == "group_poll"]
    assert len(polls) <= 4, f"{len(polls)} poll scripts in one long poll: a client-side loop"


def _plain_behind_delayed(client: felix_redis.Client) -> None:
    """10,000 records due in a minute (one batch), then a plain record, due at once."""
    setup(client)
    client.publish_batch(T, N, S, [b"d%d" % i for i in range(10_000)], delay=60)
    assert client.publish(T, N, S, b"plain").offset == 10_000


def test_a_poll_filled_by_one_due_time_leaves_the_next_one_whole(client: felix_redis.Client) -> None:
    """Two delayed records, the later offset due first, both passed over; once both are
    due, polls of one record hand out each exactly once, in due order. (A poll filled
    exactly by the first due time used to leave the cursor inside the second one's below
    its first offset, at -1 for offset 0, which did not read back: the group forgot its
    cursor and handed the first-due record out again and again, the other never.)"""
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G)
    client.publish(T, N, S, b"later", delay=0.6)  # offset 0
    client.publish(T, N, S, b"sooner", delay=0.3)  # offset 1
    assert client.group_poll(T, N, S, 0, G, max_records=1) == []  # passes over both
    time.sleep(0.8)
    got = []
    for _ in range(4):
        for r in client.group_poll(T, N, S, 0, G, max_records=1):
            got.append((r.offset, r.attempts))
            client.group_ack(T, N, S, 0, G, r)
    assert got == [(1, 1), (0, 1)]
    state = client.group_describe(T, N, S, G).shards[0]
    assert state.position == state.tail == 2


def test_a_poll_hands_out_a_due_record_behind_a_long_run_of_delayed_ones(redis_client: felix_redis.Client) -> None:
    """Order of hand-out: the due record is the next one the group can hand out, so a
    poll (without wait) hands it out, however many not-yet-due records are before it."""
    _plain_behind_delayed(redis_client)
    assert [x.payload for x in poll(redis_client, n=16)] == [b"plain"]


def test_a_long_poll_hands_out_a_due_record_behind_a_long_run_of_delayed_ones_at_once(
    redis_client: felix_redis.Client,
) -> None:
    """A long poll returns as soon as a record is due: here at once, not after blocking
    between bounded scans of the not-yet-due records."""
    _plain_behind_delayed(redis_client)
    t0 = time.monotonic()
    got = poll(redis_client, n=16, wait=10.0)
    elapsed = time.monotonic() - t0
    assert [x.payload for x in got] == [b"plain"]
    assert elapsed < 0.5, f"a record due at once took {elapsed:.2f} s to be handed out"


def test_expired_record_is_dead_lettered_when_first_met_and_the_position_moves_on(client: felix_redis.Client) -> None:
    setup(client)
    r = client.redis
    p = client.publish(T, N, S, b"short-lived", expires_in=0.3, headers={"h": "v"})
    client.publish(T, N, S, b"plain")
    rec = client.read(T, N, S, 0, p.offset, 1)[0]
    assert rec.expires_ms == rec.published_ms + 300
    assert rec.expires_at == datetime.fromtimestamp(rec.expires_ms / 1000, tz=timezone.utc)
    wait_server(r, rec.expires_ms + 1)
    got = poll(client)
    assert [x.payload for x in got] == [b"plain"]
    assert dead(client) == [(0, 0, "expired")]
    client.group_ack(T, N, S, 0, G, got[0])
    s = state(client)
    assert (s.position, s.unfinished, s.dead, s.lag) == (2, 0, 1, 0)
    assert poll(client) == []


def test_a_delayed_record_that_expires_before_it_is_due_is_never_handed_out(client: felix_redis.Client) -> None:
    setup(client)
    r = client.redis
    p = client.publish(T, N, S, b"too-late", delay=0.5, expires_in=0.2)
    rec = client.read(T, N, S, 0, p.offset, 1)[0]
    assert rec.deliver_ms is not None and rec.expires_ms is not None
    assert poll(client) == []
    wait_server(r, rec.deliver_ms + 1)
    assert poll(client) == []
    assert dead(client) == [(0, 0, "expired")]
    s = state(client)
    assert (s.position, s.unfinished, s.scheduled) == (1, 0, 0)


def test_a_record_nacked_then_expired_is_dead_lettered_not_redelivered(client: felix_redis.Client) -> None:
    setup(client)
    r = client.redis
    client.publish(T, N, S, b"job", expires_in=0.5)
    client.publish(T, N, S, b"after")
    first = poll(client, n=1)
    assert [(x.offset, x.attempts) for x in first] == [(0, 1)]
    expires = first[0].expires_ms
    assert expires is not None
    # before its expiry it is redelivered as usual
    client.group_nack(T, N, S, 0, G, first[0])
    again = poll(client, n=1)
    assert [(x.offset, x.attempts) for x in again] == [(0, 2)]
    assert server_ms(r) < expires
    client.group_nack(T, N, S, 0, G, again[0], delay=0.6)  # due after its expiry
    # the nack's due time comes after the expiry: never handed out again
    got = poll(client, n=10, wait=1.0)
    assert [x.payload for x in got] == [b"after"]
    deadline = time.monotonic() + 3
    while not dead(client) and time.monotonic() < deadline:
        assert all(x.offset != 0 for x in poll(client, n=10, wait=0.3))
    assert dead(client) == [(0, 2, "expired")]
    client.group_ack(T, N, S, 0, G, got[0])
    s = state(client)
    assert (s.position, s.unfinished, s.owed, s.in_flight) == (2, 0, 0, 0)


def test_a_record_whose_lease_lapsed_after_its_expiry_is_dead_lettered(client: felix_redis.Client) -> None:
    setup(client, visibility_timeout_ms=300)
    r = client.redis
    client.publish(T, N, S, b"job", expires_in=0.5)
    got = poll(client)
    assert [(x.offset, x.attempts) for x in got] == [(0, 1)]
    expires = got[0].expires_ms
    assert expires is not None
    wait_server(r, expires + 1)
    assert poll(client) == []
    assert dead(client) == [(0, 1, "expired")]
    s = state(client)
    assert (s.position, s.unfinished, s.owed) == (1, 0, 0)


def test_a_lapse_before_the_expiry_is_redelivered(client: felix_redis.Client) -> None:
    setup(client, visibility_timeout_ms=200)
    r = client.redis
    client.publish(T, N, S, b"job", expires_in=30)
    first = poll(client)
    wait_server(r, server_ms(r) + 250)
    again = poll(client)
    assert [(x.offset, x.attempts) for x in again] == [(0, 2)]
    assert dead(client) == []
    assert first[0].expires_ms == again[0].expires_ms


def test_an_ack_of_a_record_in_flight_past_its_expiry_counts(client: felix_redis.Client) -> None:
    setup(client)
    r = client.redis
    client.publish(T, N, S, b"job", expires_in=0.2)
    got = poll(client)
    assert len(got) == 1
    wait_server(r, got[0].expires_ms + 1)
    assert client.group_ack(T, N, S, 0, G, got[0]) is True
    s = state(client)
    assert (s.position, s.dead, s.unfinished, s.in_flight) == (1, 0, 0, 0)
    assert dead(client) == []


# --------------------------------------------------------------- headers


def test_headers_come_back_on_every_record(client: felix_redis.Client) -> None:
    setup(client)
    headers = {"trace-id": "abc.123", "Content_Type": "application/json", "emoji": "\u00e9t\u00e9 \U0001f600",
               "empty": "", "quote": 'say "hi"\n\\'}
    p = client.publish(T, N, S, b"with", headers=headers)
    q = client.publish(T, N, S, b"without")
    client.publish(T, N, S, b"empty-dict", headers={})
    polled = poll(client)
    assert [x.payload for x in polled] == [b"with", b"without", b"empty-dict"]
    assert polled[0].headers == headers
    assert polled[1].headers == {} and polled[2].headers == {}
    assert polled[1].deliver_at is None and polled[1].expires_at is None
    assert polled[0].deliver_at is None and polled[0].expires_at is None
    h = polled[0].headers
    h["changed"] = "x"  # a copy: the record's own stay as they were
    assert polled[0].headers == headers
    read = client.read(T, N, S, 0, 0)
    assert read[p.offset].headers == headers and read[q.offset].headers == {}
    sub = client.subscribe(T, N, S, block=0.1)
    assert [x.headers for x in sub.poll(0)] == [headers, {}, {}]
    # a redelivery carries them too
    client.group_nack(T, N, S, 0, G, polled[0])
    again = poll(client)
    assert again[0].attempts == 2 and again[0].headers == headers


def test_headers_at_their_limits_are_taken(client: felix_redis.Client) -> None:
    setup(client)
    long_name = {"n" * 128: "v"}
    many = {f"h{i}": "v" for i in range(64)}
    full = {"a": "x" * (16384 - 1)}  # 16 KiB of names and values, exactly
    wide = {"u": "\u00e9" * ((16384 - 1) // 2)}  # counted in UTF-8 bytes
    for headers in (long_name, many, full, wide):
        p = client.publish(T, N, S, b"p", headers=headers)
        assert client.read(T, N, S, 0, p.offset, 1)[0].headers == headers
    got = poll(client)
    assert [x.headers for x in got] == [long_name, many, full, wide]


def test_headers_of_control_characters_within_16_kib_are_taken(client: felix_redis.Client) -> None:
    """The limit is 16 KiB of names and values, however JSON escapes them."""
    setup(client)
    headers = {"ctl": "\x01" * 12000}
    p = client.publish(T, N, S, b"p", headers=headers)
    assert client.read(T, N, S, 0, p.offset, 1)[0].headers == headers
    assert poll(client)[0].headers == headers


BAD_HEADERS: list[Any] = [
    {"": "v"},
    {"n" * 129: "v"},
    {"with space": "v"},
    {"colon:name": "v"},
    {"caf\u00e9": "v"},
    {"new\nline": "v"},
    {f"h{i}": "v" for i in range(65)},
    {"a": "x" * 16384},
    {"u": "\u00e9" * 8192},
    {"n": 1},
    {"n": None},
    {"n": b"bytes"},
    {1: "v"},
    {"bad": "\ud800"},
    "name=value",
    [("a", "b")],
]


def refused(call: Callable[[], Any], named: str, case: object) -> None:
    """``call`` raises InvalidArgument naming ``named``."""
    try:
        call()
    except InvalidArgument as exc:
        assert named in str(exc), f"{case!r}: the error does not name {named}: {exc}"
    else:
        raise AssertionError(f"{case!r} was taken")


def test_bad_headers_are_refused_before_any_write(client: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    setup(client)
    producer = client.idempotent_producer()
    with unchanged():
        for headers in BAD_HEADERS:
            for call in (
                lambda h=headers: client.publish(T, N, S, b"p", headers=h),
                lambda h=headers: client.publish(T, N, S, b"p", delay=1, headers=h),
                lambda h=headers: client.publish_keyed(T, N, S, "k", b"p", headers=h),
                lambda h=headers: client.publish_batch(T, N, S, [b"p", b"q"], headers=h),
                lambda h=headers: producer.publish(T, N, S, b"p", headers=h),
                lambda h=headers: producer.publish_batch(T, N, S, [b"p"], headers=h),
            ):
                refused(call, "header", headers if len(str(headers)) < 80 else str(headers)[:80])


# ----------------------------------------------------- bad timing arguments


def _naive() -> datetime:
    return datetime.now() + timedelta(seconds=10)


BAD_TIMING: list[tuple[dict[str, Any], str]] = [
    ({"delay": -1}, "delay"),
    ({"delay": -0.001}, "delay"),
    ({"delay": float("nan")}, "delay"),
    ({"delay": float("inf")}, "delay"),
    ({"delay": MAX_AHEAD + 1}, "delay"),
    ({"delay": 1e300}, "delay"),
    ({"delay": "5"}, "delay"),
    ({"delay": True}, "delay"),
    ({"expires_in": 0}, "expires_in"),
    ({"expires_in": -5}, "expires_in"),
    ({"expires_in": float("nan")}, "expires_in"),
    ({"expires_in": float("-inf")}, "expires_in"),
    ({"expires_in": MAX_AHEAD + 1}, "expires_in"),
    ({"expires_in": "10"}, "expires_in"),
    ({"deliver_at": "naive"}, "deliver_at"),
    ({"deliver_at": "2026-12-24T18:00:00Z"}, "deliver_at"),
    ({"deliver_at": 1234567890}, "deliver_at"),
    ({"deliver_at": "far"}, "deliver_at"),
    ({"deliver_at": "far-server"}, "deliver_at"),
    ({"delay": 1, "deliver_at": "soon"}, "deliver_at"),
    ({"delay": 0, "deliver_at": "soon"}, "deliver_at"),
]


def _timing(kw: dict[str, Any]) -> dict[str, Any]:
    out = dict(kw)
    now = datetime.now(timezone.utc)
    value = out.get("deliver_at")
    if value == "naive":
        out["deliver_at"] = _naive()
    elif value == "far":
        out["deliver_at"] = now + timedelta(days=400)
    elif value == "far-server":  # past 366 days by an hour: the server's check
        out["deliver_at"] = now + timedelta(days=366, hours=1)
    elif value == "soon":
        out["deliver_at"] = now + timedelta(seconds=10)
    return out


def test_bad_delay_expiry_or_deliver_at_is_refused_before_any_write(
    client: felix_redis.Client, unchanged: Callable[[], Any]
) -> None:
    setup(client)
    producer = client.idempotent_producer()
    with unchanged():
        for kw, named in BAD_TIMING:
            args = _timing(kw)
            for call in (
                lambda a=args: client.publish(T, N, S, b"p", **a),
                lambda a=args: client.publish(T, N, S, b"p", shard=0, headers={"a": "b"}, **a),
                lambda a=args: client.publish_keyed(T, N, S, "k", b"p", **a),
                lambda a=args: client.publish_batch(T, N, S, [b"p", b"q"], **a),
                lambda a=args: producer.publish(T, N, S, b"p", **a),
                lambda a=args: producer.publish_keyed(T, N, S, "k", b"p", **a),
                lambda a=args: producer.publish_batch(T, N, S, [b"p"], **a),
            ):
                refused(call, named, kw)


def test_the_limits_themselves_are_taken(client: felix_redis.Client) -> None:
    setup(client)
    a = client.publish(T, N, S, b"366 days", delay=MAX_AHEAD)
    b = client.publish(T, N, S, b"expires in 366 days", expires_in=MAX_AHEAD)
    c = client.publish(T, N, S, b"zero delay", delay=0)
    d = client.publish(T, N, S, b"a tiny expiry", expires_in=0.0001)
    e = client.publish(T, N, S, b"at", deliver_at=datetime.now(timezone.utc) + timedelta(days=365))
    recs = {x.offset: x for x in client.read(T, N, S, 0, 0)}
    assert recs[a.offset].deliver_ms == recs[a.offset].published_ms + int(MAX_AHEAD * 1000)
    assert recs[b.offset].expires_ms == recs[b.offset].published_ms + int(MAX_AHEAD * 1000)
    assert recs[c.offset].deliver_at is None
    assert recs[d.offset].expires_ms is not None and recs[d.offset].expires_ms > recs[d.offset].published_ms
    assert recs[e.offset].deliver_at is not None
    s = state(client)
    assert s.scheduled == 2


def test_crafted_raw_publish_calls_with_bad_timing_or_headers_are_refused(redis_client: felix_redis.Client) -> None:
    """The script's own checks, past every client-side one (a raw FCALL/EVALSHA)."""
    client = redis_client
    setup(client)
    name = client.core.name(T, N, S)
    keys = name.publish_keys(0)
    due_keys = [*keys, name.due_key(0)]

    def run(deliver: str, expires: str, headers: str, *, with_due: bool | None = None) -> Any:
        ks = due_keys if (with_due if with_due is not None else deliver != "") else keys
        return run_script(client, "publish", ks, [b"", b"", 0, 3_600_000, deliver, expires, headers, b"payload"])

    # the shape the client sends is taken
    run("+100", "5000", json.dumps({"a": "b"}))
    before = dump_keyspace(client.redis)
    far = server_ms(client.redis) + int(MAX_AHEAD * 1000) + 3_600_000
    cases: list[tuple[str, str, str, str]] = [
        ("-5", "", "", "deliver"),
        ("5", "", "", "deliver"),
        ("+", "", "", "deliver"),
        ("+1.5", "", "", "deliver"),
        ("+1e3", "", "", "deliver"),
        ("+31622400001", "", "", "delay"),
        ("+9999999999999999", "", "", "deliver"),
        (f"@{far}", "", "", "deliver_at"),
        ("", "0", "", "expires_in"),
        ("", "-1", "", "expires_in"),
        ("", "31622400001", "", "expires_in"),
        ("", "1.5", "", "expires_in"),
        ("", "abc", "", "expires_in"),
        ("", "", "{}", "header"),
        ("", "", "[]", "header"),
        ("", "", "not json", "header"),
        ("", "", '{"a": "b"', "header"),
        ("", "", '{"a": "b"}}', "header"),
        ("", "", '{"a": 1}', "header"),
        ("", "", '{"a": null}', "header"),
        ("", "", '{"a": {"b": "c"}}', "header"),
        ("", "", '{"a": ["b"]}', "header"),
        ("", "", '{"a": true}', "header"),
        ("", "", '{"bad name": "v"}', "header"),
        ("", "", '{"": "v"}', "header"),
        ("", "", json.dumps({"n" * 129: "v"}), "header"),
        ("", "", json.dumps({"caf\u00e9": "v"}), "header"),
        ("", "", json.dumps({f"h{i}": "v" for i in range(65)}), "header"),
        ("", "", json.dumps({"a": "x" * 16384}), "header"),
        ("", "", json.dumps({"a": "x" * 70000}), "header"),
    ]
    for deliver, expires, headers, named in cases:
        with pytest.raises(redis.ResponseError) as info:
            run(deliver, expires, headers)
        err = from_response(str(info.value))
        assert isinstance(err, InvalidArgument), (deliver, expires, headers, str(info.value))
        assert named in str(err), (named, str(err))
    # the due index is required with a delivery time, and only the shard's own
    with pytest.raises(redis.ResponseError, match="FELIX_INVALID"):
        run("+100", "", "", with_due=False)
    with pytest.raises(redis.ResponseError, match="FELIX_INVALID"):
        run_script(client, "publish", [*keys, keys[0] + "x"], [b"", b"", 0, 3_600_000, "+100", "", "", b"p"])
    with pytest.raises(redis.ResponseError, match="FELIX_INVALID"):
        run_script(client, "publish", [*keys, name.due_key(0)], [b"", b"", 0, 3_600_000, "", "", "", b"p"])
    assert dump_keyspace(client.redis) == before


# --------------------------------------------------- idempotent producer


def test_a_resent_idempotent_publish_keeps_the_first_due_time(
    client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reply of the first send is lost; the re-send comes 0.4 s later and must not
    move the due time (nor append, nor add a second due entry)."""
    setup(client)
    r = client.redis
    producer = client.idempotent_producer()
    real = client._execute
    ops: list[Any] = []
    left = [1]

    def lossy(op: Any) -> Any:
        ops.append(op)
        if type(op) is Eval and op.script == "publish" and left[0] > 0:
            left[0] -= 1
            real(op)
            time.sleep(0.4)
            raise felix_redis.ConnectionFailed("simulated: connection reset before the reply")
        return real(op)

    monkeypatch.setattr(client, "_execute", lossy)
    p = producer.publish(T, N, S, b"once", delay=0.8, headers={"k": "v"})
    assert p.offset == 0
    assert sum(type(op) is Eval and op.script == "publish" for op in ops) == 2  # one re-send
    assert any(type(op) is Sleep for op in ops)
    monkeypatch.setattr(client, "_execute", real)
    assert client.stream_describe(T, N, S).tails[0] == 1
    rec = client.read(T, N, S, 0, 0)
    assert len(rec) == 1
    assert rec[0].deliver_ms == rec[0].published_ms + 800  # from the first send
    assert due_index(r, client.core.name(T, N, S).due_key(0)) == [(0, rec[0].published_ms + 800)]
    assert poll(client) == []
    wait_server(r, rec[0].published_ms + 800)
    got = poll(client)
    assert [(x.offset, x.payload, x.headers) for x in got] == [(0, b"once", {"k": "v"})]
    # the producer goes on normally, delayed or not
    assert producer.publish(T, N, S, b"next", delay=0.01).offset == 1
    batch = producer.publish_batch(T, N, S, [b"b1", b"b2"], expires_in=60, headers={"x": "y"})
    assert [b.offset for b in batch] == [2, 3]
    assert [x.headers for x in client.read(T, N, S, 0, 2)] == [{"x": "y"}, {"x": "y"}]


def test_a_resent_idempotent_batch_keeps_the_first_due_time(
    client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup(client)
    producer = client.idempotent_producer()
    real = client._execute
    left = [1]

    def lossy(op: Any) -> Any:
        if type(op) is Eval and op.script == "publish" and left[0] > 0:
            left[0] -= 1
            real(op)
            time.sleep(0.3)
            raise felix_redis.ConnectionFailed("simulated: connection reset before the reply")
        return real(op)

    monkeypatch.setattr(client, "_execute", lossy)
    batch = producer.publish_batch(T, N, S, [b"a", b"b", b"c"], delay=5)
    monkeypatch.setattr(client, "_execute", real)
    assert [b.offset for b in batch] == [0, 1, 2]
    recs = client.read(T, N, S, 0, 0)
    assert len(recs) == 3
    assert {x.deliver_ms - x.published_ms for x in recs} == {5000}
    assert len(due_index(client.redis, client.core.name(T, N, S).due_key(0))) == 3
    assert state(client).scheduled == 3


# ------------------------------------------------------------- rate limit


def test_rate_limit_caps_hand_outs_per_window_and_describe_shows_it(client: felix_redis.Client) -> None:
    setup(client, rate_limit=(3, 0.5))
    r = client.redis
    assert client.group_describe(T, N, S, G).rate_limit == (3, 0.5)
    assert state(client).rate_limit == (3, 0.5)
    client.publish_batch(T, N, S, [b"%d" % i for i in range(10)])
    start = server_ms(r)
    first = poll(client, n=10)
    assert [x.offset for x in first] == [0, 1, 2]
    assert poll(client, n=10) == []  # the window is spent
    client.group_nack(T, N, S, 0, G, first[0])  # a redelivery counts too
    assert poll(client, n=10) == []
    wait_server(r, start + 500)
    nxt = poll(client, n=10)
    assert len(nxt) == 3
    assert nxt[0].offset == 0 and nxt[0].attempts == 2  # the redelivery first
    assert [x.offset for x in nxt[1:]] == [3, 4]
    # a poll asking for less takes less, the rest of the window stays
    wait_server(r, server_ms(r) + 520)
    assert len(poll(client, n=1)) == 1
    assert len(poll(client, n=10)) == 2
    assert poll(client, n=10) == []


def test_rate_limit_holds_whoever_polls(backend: tuple[str, Any], client: felix_redis.Client) -> None:
    """Two clients polling together in one window get ``count`` records between them."""
    setup(client, rate_limit=(4, 1.5))
    client.publish_batch(T, N, S, [b"%d" % i for i in range(40)])
    clients = [felix_redis.connect(backend[0]) for _ in range(2)]
    got: list[list[felix_redis.Record]] = [[], []]
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(5)
            end = time.monotonic() + 0.6
            while time.monotonic() < end:
                got[i] += clients[i].group_poll(T, N, S, 0, G, max_records=3)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for c in clients:
        c.close()
    assert not errors, errors
    offsets = sorted(x.offset for x in got[0] + got[1])
    assert offsets == [0, 1, 2, 3], offsets


def test_a_long_poll_waits_for_the_window_without_spinning(
    redis_client: felix_redis.Client, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = redis_client
    setup(client, rate_limit=(2, 0.8))
    client.publish_batch(T, N, S, [b"%d" % i for i in range(6)])
    start = server_ms(raw)
    assert len(poll(client, n=10)) == 2
    ops = count_evals(client, monkeypatch)
    raw.config_resetstat()
    t0 = time.monotonic()
    got = poll(client, n=10, wait=5.0)
    elapsed = time.monotonic() - t0
    calls = script_calls(raw)
    assert [x.offset for x in got] == [2, 3]
    assert server_ms(raw) >= start + 800
    assert 0.4 < elapsed < 3.0, elapsed
    polls = [op for op in ops if type(op) is Eval and op.script == "group_poll"]
    assert len(polls) <= 4, f"{len(polls)} poll scripts while waiting for the window"
    assert calls <= 4, f"the server ran {calls} scripts while one long poll waited for the window"


def test_group_configure_sets_keeps_and_removes_the_rate_limit(client: felix_redis.Client) -> None:
    setup(client)
    assert client.group_describe(T, N, S, G).rate_limit is None
    client.group_configure(T, N, S, G, rate_limit=(2, 60))
    assert client.group_describe(T, N, S, G).rate_limit == (2, 60.0)
    client.group_configure(T, N, S, G, visibility_timeout_ms=5000)  # leaving it out keeps it
    info = client.group_describe(T, N, S, G)
    assert info.rate_limit == (2, 60.0) and info.visibility_timeout_ms == 5000
    client.publish_batch(T, N, S, [b"%d" % i for i in range(5)])
    assert len(poll(client, n=5)) == 2
    assert poll(client, n=5) == []
    client.group_configure(T, N, S, G, rate_limit=None)
    assert client.group_describe(T, N, S, G).rate_limit is None
    assert len(poll(client, n=5)) == 3
    client.group_configure(T, N, S, G, rate_limit=(1, 60))
    client.publish_batch(T, N, S, [b"x", b"y"])
    assert len(poll(client, n=5)) == 1
    client.group_configure(T, N, S, G, rate_limit=(0, 0))
    assert client.group_describe(T, N, S, G).rate_limit is None
    assert len(poll(client, n=5)) == 1


BAD_RATES: list[Any] = [
    (0, 1), (-1, 1), (1, 0), (1, -1), (1, float("nan")), (1, float("inf")), (1.5, 1), ("1", 1),
    (True, 1), (1, True), (1, "1"), (1,), (1, 2, 3), "100/1s", 5, (1, 86401), (1_000_001, 1), (0, 1.0),
    (1, 0.0001),
]


def test_bad_rate_limits_are_refused_before_any_write(client: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    client.stream_create(T, N, S, shards=2)
    client.group_create(T, N, S, "existing", rate_limit=(5, 1))
    with unchanged():
        for rate in BAD_RATES:
            refused(lambda r=rate: client.group_create(T, N, S, G, rate_limit=r), "rate_limit", rate)
            refused(lambda r=rate: client.group_configure(T, N, S, "existing", rate_limit=r), "rate_limit", rate)
            refused(lambda r=rate: client.group_configure(T, N, S, "existing", visibility_timeout_ms=1000,
                                                          rate_limit=r), "rate_limit", rate)
    assert client.group_describe(T, N, S, "existing").rate_limit == (5, 1.0)


# --------------------------------------------------------- sharded streams


def test_sharded_group_holds_delayed_records_on_every_shard_and_wakes_when_one_is_due(
    client: felix_redis.Client,
) -> None:
    setup(client, shards=2)
    r = client.redis
    client.publish(T, N, S, b"late0", shard=0, delay=1.0, headers={"s": "0"})
    client.publish(T, N, S, b"soon1", shard=1, delay=0.5, headers={"s": "1"})
    client.publish(T, N, S, b"plain0", shard=0)
    client.publish(T, N, S, b"plain1", shard=1)
    client.publish(T, N, S, b"gone1", shard=1, expires_in=0.2)
    recs = {x.payload: x for sh in (0, 1) for x in client.read(T, N, S, sh, 0)}
    wait_server(r, recs[b"gone1"].expires_ms + 1)
    group = client.group_sharded(T, N, S, G)
    items = group.poll(10)
    assert sorted(i.payload for i in items) == [b"plain0", b"plain1"]
    group.ack_many(items)
    info = client.group_describe(T, N, S, G)
    assert [s.scheduled for s in info.shards] == [1, 1]
    assert info.scheduled == 2 and info.unfinished >= 2
    assert info.oldest_unfinished_age_ms is None  # nothing unfinished is due
    t0 = time.monotonic()
    woke = group.poll(10, wait=5.0)
    elapsed = time.monotonic() - t0
    assert [i.payload for i in woke] == [b"soon1"], woke
    assert woke[0].headers == {"s": "1"} and woke[0].deliver_at == recs[b"soon1"].deliver_at
    assert server_ms(r) >= recs[b"soon1"].deliver_ms
    assert elapsed < 2.5, elapsed  # at the first due time, not after the wait
    assert (1, 2, 0, "expired") in [(d.shard, d.offset, d.attempts, d.reason)
                                    for d in client.group_dead_letters(T, N, S, 1, G)]
    group.ack(woke[0])
    later = group.poll(10, wait=5.0)
    assert [i.payload for i in later] == [b"late0"]
    assert server_ms(r) >= recs[b"late0"].deliver_ms
    group.ack(later[0])
    info = client.group_describe(T, N, S, G)
    assert (info.unfinished, info.scheduled, info.lag) == (0, 0, 0)
    assert [s.position for s in info.shards] == [2, 3]


def test_the_rate_limit_is_per_shard(client: felix_redis.Client) -> None:
    setup(client, shards=2, rate_limit=(2, 60))
    for shard in (0, 1):
        client.publish_batch(T, N, S, [b"a", b"b", b"c", b"d"], shard=shard)
    group = client.group_sharded(T, N, S, G)
    items = group.poll(16) + group.poll(16)
    assert sorted((i.shard, i.offset) for i in items) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [s.rate_limit for s in client.group_describe(T, N, S, G).shards] == [(2, 60.0), (2, 60.0)]


# ----------------------------------------------------------------- asyncio


def test_asyncio_delay_expiry_headers_producer_and_rate_limit(redis_url: str, raw: redis.Redis) -> None:
    async def main() -> None:
        c = fa.connect(redis_url)
        try:
            await c.stream_create(T, N, S, shards=2)
            await c.group_create(T, N, S, G)
            await c.group_create(T, N, S, "limited", rate_limit=(1, 0.5))
            p = await c.publish(T, N, S, b"delayed", shard=0, delay=0.6, headers={"a": "1"})
            await c.publish_keyed(T, N, S, "k", b"keyed", expires_in=60, headers={"b": "2"})
            at = datetime.now(timezone.utc) + timedelta(seconds=0.6)
            await c.publish_batch(T, N, S, [b"b1", b"b2"], shard=1, deliver_at=at)
            producer = await c.idempotent_producer()
            await producer.publish(T, N, S, b"prod", shard=0, delay=0.6)
            await producer.publish_batch(T, N, S, [b"pb"], shard=1, headers={"c": "3"})
            with pytest.raises(InvalidArgument, match="deliver_at"):
                await c.publish(T, N, S, b"x", deliver_at=datetime.now() + timedelta(seconds=5))
            with pytest.raises(InvalidArgument, match="delay"):
                await c.publish(T, N, S, b"x", delay=-1)
            with pytest.raises(InvalidArgument, match="header"):
                await producer.publish(T, N, S, b"x", headers={"bad name": "v"})
            with pytest.raises(InvalidArgument, match="rate_limit"):
                await c.group_configure(T, N, S, G, rate_limit=(1, 0))

            rec = (await c.read(T, N, S, 0, p.offset, 1))[0]
            assert rec.headers == {"a": "1"} and rec.deliver_ms is not None
            info = await c.group_describe(T, N, S, G)
            assert info.scheduled == 4
            assert (await c.group_describe(T, N, S, "limited")).rate_limit == (1, 0.5)

            group = c.group_sharded(T, N, S, G)
            first = await group.poll(16)
            assert sorted(i.payload for i in first) == [b"keyed", b"pb"]
            assert {i.payload: i.headers for i in first} == {b"keyed": {"b": "2"}, b"pb": {"c": "3"}}
            await group.ack_many(first)
            t0 = time.monotonic()
            woke: list[Any] = []
            while len(woke) < 4 and time.monotonic() - t0 < 5:
                woke += await group.poll(16, wait=3.0)
            assert server_ms(raw) >= rec.deliver_ms
            assert sorted(i.payload for i in woke) == [b"b1", b"b2", b"delayed", b"prod"]
            assert 0.3 < time.monotonic() - t0 < 2.5
            await group.ack_many(woke)
            assert (await c.group_describe(T, N, S, G)).unfinished == 0

            # the rate-limited group: one hand-out per shard and window
            got = await c.group_poll(T, N, S, 1, "limited", max_records=10)
            assert len(got) == 1
            assert await c.group_poll(T, N, S, 1, "limited", max_records=10) == []
            t0 = time.monotonic()
            nxt = await c.group_poll(T, N, S, 1, "limited", max_records=10, wait=3.0)
            assert len(nxt) == 1 and 0.2 < time.monotonic() - t0 < 2.5
        finally:
            await c.close()

    asyncio.run(main())


def test_asyncio_long_poll_for_a_delayed_record_makes_few_script_calls(
    redis_url: str, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        c = fa.connect(redis_url)
        try:
            await c.stream_create(T, N, S)
            await c.group_create(T, N, S, G)
            await c.publish(T, N, S, b"d", delay=0.7)
            ops = count_evals(c, monkeypatch)
            t0 = time.monotonic()
            got = await c.group_poll(T, N, S, 0, G, max_records=5, wait=5.0)
            elapsed = time.monotonic() - t0
            assert [x.payload for x in got] == [b"d"]
            assert 0.5 < elapsed < 3.0, elapsed
            polls = [op for op in ops if type(op) is Eval and op.script == "group_poll"]
            assert len(polls) <= 4, len(polls)
        finally:
            await c.close()

    asyncio.run(main())


# ----------------------------------------------------------------- memory://


def test_memory_backend_delay_expiry_and_headers() -> None:
    c = felix_redis.connect(f"memory://time-in-queue-{os.getpid()}")
    try:
        setup(c)
        r = c.redis
        c.publish(T, N, S, b"delayed", delay=0.4, headers={"x": "1"})
        c.publish(T, N, S, b"expiring", expires_in=0.2)
        c.publish(T, N, S, b"plain", headers={"y": "2"})
        got = poll(c)
        assert [(x.payload, x.headers) for x in got] == [(b"expiring", {}), (b"plain", {"y": "2"})]
        assert got[0].expires_at is not None
        assert state(c).scheduled == 1
        c.group_nack(T, N, S, 0, G, got[0], delay=0.3)  # due after its expiry
        c.group_ack(T, N, S, 0, G, got[1])
        due = c.read(T, N, S, 0, 0, 1)[0].deliver_ms
        assert due is not None
        got = poll(c, wait=3.0)
        assert server_ms(r) >= due
        assert [(x.payload, x.headers) for x in got] == [(b"delayed", {"x": "1"})]
        c.group_ack(T, N, S, 0, G, got[0])
        deadline = time.monotonic() + 3
        while not dead(c) and time.monotonic() < deadline:
            assert poll(c, wait=0.2) == []
        assert dead(c) == [(1, 1, "expired")]
        s = state(c)
        assert (s.position, s.unfinished) == (3, 0)
    finally:
        c.close()


# --------------------------------------------------------------- felixctl


def felixctl(url: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FELIX_") or k == "FELIX_TEST_SERVER"}
    return subprocess.run([sys.executable, "-m", "felixctl", "--redis-url", url, *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (result.stdout, result.stderr)
    return result.stdout


def test_felixctl_pub_with_delay_at_expiry_headers_and_group_rate_limit(redis_url: str, raw: redis.Redis) -> None:
    url = redis_url
    c = felix_redis.connect(url)
    c.stream_create("default", "default", "jobs")
    ok(felixctl(url, "group", "create", "jobs", "workers", "--rate-limit", "100/1s"))
    assert ok(felixctl(url, "pub", "jobs", "one", "--header", "trace=abc", "--header", "k=v=w",
                       "--expires-in", "10m")).strip() == "0:0"
    assert ok(felixctl(url, "pub", "jobs", "two", "--delay", "30s")).strip() == "0:1"
    at = (datetime.now(timezone.utc) + timedelta(days=1)).replace(microsecond=0)
    assert ok(felixctl(url, "pub", "jobs", "three", "--at", at.strftime("%Y-%m-%dT%H:%M:%SZ"))).strip() == "0:2"
    bad = felixctl(url, "pub", "jobs", "x", "--header", "bad name=v")
    assert bad.returncode != 0 and "header" in bad.stderr

    polled = json.loads(ok(felixctl(url, "group", "poll", "jobs", "workers", "--max", "10", "-o", "json")))
    assert [d["payload"] for d in polled] == ["one"]  # two and three are not due
    one = polled[0]
    assert one["claim"] == "0:0:1"
    assert one["headers"] == {"trace": "abc", "k": "v=w"}
    assert one["deliver_at"] is None
    expires = datetime.fromisoformat(one["expires_at"])
    published = datetime.fromisoformat(one["published_at"])
    assert expires - published == timedelta(minutes=10)

    subbed = json.loads(ok(felixctl(url, "sub", "jobs", "-o", "json")))
    assert [d["offset"] for d in subbed] == [0, 1, 2]
    assert all({"deliver_at", "expires_at", "headers"} <= set(d) for d in subbed)
    assert subbed[0]["headers"] == {"trace": "abc", "k": "v=w"}
    assert subbed[1]["headers"] == {} and subbed[1]["expires_at"] is None
    two_due = datetime.fromisoformat(subbed[1]["deliver_at"])
    assert two_due - datetime.fromisoformat(subbed[1]["published_at"]) == timedelta(seconds=30)
    assert datetime.fromisoformat(subbed[2]["deliver_at"]) == at

    described = json.loads(ok(felixctl(url, "group", "describe", "jobs", "workers", "-o", "json")))
    assert described["rate_limit"] == {"count": 100, "per_seconds": 1.0}
    assert described["scheduled"] == 2 and described["unfinished"] == 3
    assert described["shards"][0]["scheduled"] == 2 and described["shards"][0]["rate_limit"] in ([100, 1.0], (100, 1.0))

    out = ok(felixctl(url, "group", "configure", "jobs", "workers", "--rate-limit", "5/250ms"))
    assert "rate limit" in out
    try:
        assert c.group_describe("default", "default", "jobs", "workers").rate_limit == (5, 0.25)
        ok(felixctl(url, "group", "configure", "jobs", "workers", "--rate-limit", "none"))
        assert c.group_describe("default", "default", "jobs", "workers").rate_limit is None
    finally:
        c.close()


# ---------------------------------------------------- many records, one load


def test_three_thousand_delayed_records_with_plain_ones_are_each_delivered_once_and_never_early(
    redis_client: felix_redis.Client, redis_url: str, raw: redis.Redis
) -> None:
    client = redis_client
    setup(client, shards=2)
    rng = random.Random(20261201)
    expected_delay: dict[bytes, int] = {}  # payload -> delay ms (0: plain)
    ops: list[tuple[str, Any]] = []
    n = 0
    # 2,000 delayed in batches of 50, 1,000 delayed one by one, 400 plain between them
    for _ in range(40):
        ops.append(("batch", [f"d{n + i}".encode() for i in range(50)]))
        n += 50
    for _ in range(1000):
        ops.append(("one", f"d{n}".encode()))
        n += 1
    for i in range(20):
        ops.append(("plain-batch", [f"p{i}-{j}".encode() for j in range(10)]))
    for i in range(200):
        ops.append(("plain", f"q{i}".encode()))
    rng.shuffle(ops)
    pub = felix_redis.connect(redis_url)
    try:
        for kind, what in ops:
            if kind == "batch":
                ms = rng.randint(100, 3000)
                pub.publish_batch(T, N, S, what, shard=rng.randint(0, 1), delay=ms / 1000)
                expected_delay.update(dict.fromkeys(what, ms))
            elif kind == "one":
                ms = rng.randint(100, 3000)
                pub.publish(T, N, S, what, delay=ms / 1000, headers={"n": what.decode()})
                expected_delay[what] = ms
            elif kind == "plain-batch":
                pub.publish_batch(T, N, S, what)
                expected_delay.update(dict.fromkeys(what, 0))
            else:
                pub.publish(T, N, S, what)
                expected_delay[what] = 0
    finally:
        pub.close()
    total = len(expected_delay)
    assert total == 3400 and sum(1 for v in expected_delay.values() if v) == 3000

    deliveries: list[tuple[Any, int]] = []  # (item, server ms after the poll returned)
    lock = threading.Lock()
    errors: list[BaseException] = []
    stop = time.monotonic() + 15

    def work() -> None:
        c = felix_redis.connect(redis_url)
        r = redis.Redis.from_url(redis_url)
        try:
            group = c.group_sharded(T, N, S, G)
            done: list[Any] = []
            while time.monotonic() < stop:
                with lock:
                    if len(deliveries) >= total:
                        break
                items = group.poll(64, wait=0.5, ack=done)
                after = server_ms(r)
                with lock:
                    deliveries.extend((i, after) for i in items)
                done = items
            if done:
                group.ack_many(done)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            c.close()
            r.close()

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    seen = [(i.shard, i.offset) for i, _ in deliveries]
    dups = sorted(k for k, c in Counter(seen).items() if c > 1)
    assert not dups, [(i.claim, i.deliver_ms, at) for i, at in deliveries if (i.shard, i.offset) in set(dups[:3])]
    assert sorted(i.payload for i, _ in deliveries) == sorted(expected_delay)
    early, late = [], []
    for item, after in deliveries:
        ms = expected_delay[item.payload]
        assert item.attempts == 1
        if ms == 0:
            assert item.deliver_at is None
            continue
        due = item.record.deliver_ms
        assert due is not None
        assert abs(due - (item.record.published_ms + ms)) <= 1, (item, ms)
        if due > after:
            early.append((item.claim, due - after))
        late.append(after - due)
        if item.payload.startswith(b"d") and item.headers:
            assert item.headers == {"n": item.payload.decode()}
    assert not early, f"handed out before due: {early[:10]}"
    assert max(late) < 1500, f"handed out {max(late)} ms after due"
    info = client.group_describe(T, N, S, G)
    assert (info.unfinished, info.scheduled, info.pending, info.owed, info.in_flight, info.dead, info.lag) == (
        0, 0, 0, 0, 0, 0, 0)


# ------------------------------------------------------------------ the due index


def test_the_due_index_is_pruned_of_what_every_group_passed_and_deleted_with_the_stream(
    redis_client: felix_redis.Client, raw: redis.Redis
) -> None:
    """stream_trim removes the due index's entries every group has passed (their due
    cursors), never one a group still has to hand out; stream_delete deletes the index.
    (The index keeps due times in buckets of 100 ms and prunes whole buckets: an entry
    goes once every cursor is past the end of its bucket.)"""
    client = redis_client
    setup(client)
    client.group_create(T, N, S, "idle")
    due_key = client.core.name(T, N, S).due_key(0)
    published = client.publish_batch(T, N, S, [b"a", b"b"], delay=0.3)
    assert len(due_index(raw, due_key)) == 2
    due = due_index(raw, due_key)[0][1]
    wait_server(raw, due - due % 100 + 100)
    got = poll(client)
    assert sorted(r.payload for r in got) == [b"a", b"b"]
    client.group_ack_many(T, N, S, 0, G, got)
    # "idle" never polled: its due cursor holds the entries
    client.stream_trim(T, N, S)
    assert len(due_index(raw, due_key)) == 2
    assert sorted(r.offset for r in poll(client, "idle")) == [p.offset for p in published]
    client.stream_trim(T, N, S)
    assert len(due_index(raw, due_key)) == 0
    client.publish(T, N, S, b"later", delay=60)
    assert len(due_index(raw, due_key)) == 1
    client.stream_trim(T, N, S)
    assert len(due_index(raw, due_key)) == 1  # not due: kept
    client.stream_delete(T, N, S)
    assert raw.exists(due_key) == 0


def test_a_group_made_before_any_delayed_record_neither_skips_nor_repeats_them(client: felix_redis.Client) -> None:
    """A group created before the first delayed publish keeps no due cursor: its first
    poll after one sets it before scanning, so the record comes once, when due."""
    setup(client)
    client.publish(T, N, S, b"plain")
    assert [r.payload for r in poll(client)] == [b"plain"]
    client.publish(T, N, S, b"later", delay=0.3)
    client.publish(T, N, S, b"now")
    assert [r.payload for r in poll(client)] == [b"now"]
    time.sleep(0.4)
    assert [r.payload for r in poll(client)] == [b"later"]
    assert poll(client) == []


# ------------------------------------------------------------------ a due time shared by many records


def _group_key(client: felix_redis.Client, group: str = G) -> str:
    return client.core.name(T, N, S).group_key_list(0, group)[0]


def _passed_over(client: felix_redis.Client, raw: redis.Redis, count: int) -> None:
    """The group's scan goes by the delayed records (none is due yet)."""
    assert poll(client, n=1000) == []
    st = state(client)
    assert (st.scheduled, st.pending) == (count, 0), st


def test_records_handed_out_from_the_due_index_carry_their_own_due_time_key_and_headers(
    redis_client: felix_redis.Client, raw: redis.Redis
) -> None:
    """Delayed records the group passed over (published one by one at different due
    times, as a batch sharing one, with a key, with headers, with an expiry far off) are
    handed out from the due index once due, each with the due time, key and headers the
    log holds for it (a replay of the same offsets), whichever form the poll's reply
    gives it."""
    client = redis_client
    setup(client)
    for i in range(5):
        client.publish(T, N, S, b"one%d" % i, delay=0.3 + 0.03 * i)
    client.publish_batch(T, N, S, [b"b%d" % i for i in range(20)], delay=0.35)
    client.publish(T, N, S, b"keyed", key="k-1", delay=0.31)
    client.publish(T, N, S, b"headed", headers={"h": "v"}, delay=0.32)
    client.publish(T, N, S, b"expiring", delay=0.33, expires_in=3600)
    _passed_over(client, raw, 28)
    wait_server(raw, server_ms(raw) + 500)
    got: list[felix_redis.Record] = []
    for _ in range(10):
        got += poll(client, n=7)
    assert sorted(r.offset for r in got) == list(range(28))
    logged = {r.offset: r for r in client.read(T, N, S, 0, 0, 28)}
    for r in got:
        want = logged[r.offset]
        assert r.deliver_ms is not None
        assert (r.payload, r.deliver_ms, r.key, r.headers, r.expires_ms, r.attempts) == (
            want.payload, want.deliver_ms, want.key, want.headers, want.expires_ms, 1), r.offset
    assert [r.deliver_ms for r in got] == sorted(r.deliver_ms for r in got if r.deliver_ms is not None)


def test_a_batch_sharing_a_due_time_comes_in_offset_order_once_over_many_polls(
    redis_client: felix_redis.Client, raw: redis.Redis
) -> None:
    """600 records of one batch fall due at the same moment after the group passed
    over them; polls of 16 hand them out by offset, each once, first deliveries. Between
    polls the group's due cursor stands inside that due time (its dly field carries the
    last offset handed out as a fourth number), an ack of one not handed out yet answers "never delivered",
    and describe counts the rest as pending."""
    client = redis_client
    setup(client)
    client.publish(T, N, S, b"before")
    published = client.publish_batch(T, N, S, [b"b%d" % i for i in range(600)], delay=0.4)
    offsets = [p.offset for p in published]
    before = poll(client)
    assert [r.payload for r in before] == [b"before"]
    client.group_ack_many(T, N, S, 0, G, before)
    _passed_over(client, raw, 600)
    wait_server(raw, server_ms(raw) + 450)
    seen: list[int] = []
    polls = 0
    while len(seen) < 600:
        polls += 1
        assert polls <= 40
        got = poll(client, n=16)
        assert [r.attempts for r in got] == [1] * len(got)
        assert len(got) == min(16, 600 - len(seen))
        seen += [r.offset for r in got]
        if polls == 3:
            dly = raw.hget(_group_key(client), "dly").split()
            assert len(dly) == 4 and int(dly[3]) == seen[-1], dly
            with pytest.raises(NotFound, match="not been delivered"):
                client.group_ack(T, N, S, 0, G, offsets[-1])
            st = state(client)
            assert (st.pending, st.in_flight, st.scheduled, st.unfinished) == (600 - 48, 16, 0, 600 - 32), st
        client.group_ack_many(T, N, S, 0, G, got)
    assert seen == offsets
    assert poll(client) == []
    assert raw.hget(_group_key(client), "dly").split()[3:] == []
    st = state(client)
    assert (st.unfinished, st.pending, st.owed, st.in_flight, st.position) == (0, 0, 0, 0, 601), st


def test_records_sharing_a_due_time_but_not_neighbours_are_each_handed_out_once(
    redis_client: felix_redis.Client, raw: redis.Redis
) -> None:
    """Two batches and single records published for the same moment (deliver_at), with
    plain records between them: the due time's records are not neighbours in the log.
    Each comes once, when due, whatever the poll size; the plain ones at once."""
    client = redis_client
    setup(client)
    at_ms = server_ms(raw) + 600
    at = datetime.fromtimestamp(at_ms / 1000, timezone.utc)
    timed: list[int] = []
    plain: list[int] = []
    timed += [p.offset for p in client.publish_batch(T, N, S, [b"a%d" % i for i in range(40)], deliver_at=at)]
    plain.append(client.publish(T, N, S, b"x").offset)
    timed += [p.offset for p in client.publish_batch(T, N, S, [b"b%d" % i for i in range(40)], deliver_at=at)]
    for i in range(10):
        timed.append(client.publish(T, N, S, b"c%d" % i, deliver_at=at).offset)
        plain.append(client.publish(T, N, S, b"y%d" % i).offset)
    held = due_index(raw, client.core.name(T, N, S).due_key(0))
    assert held == [(o, at_ms) for o in sorted(timed)] and len(timed) == 90
    first = poll(client, n=1000)
    assert sorted(r.offset for r in first) == plain
    client.group_ack_many(T, N, S, 0, G, first)
    wait_server(raw, at_ms + 20)
    seen: list[int] = []
    for n in [16, 3, 30, 1, 16, 16, 16, 16, 16]:
        got = poll(client, n=n)
        assert all(r.deliver_ms == at_ms and r.attempts == 1 for r in got)
        seen += [r.offset for r in got]
        client.group_ack_many(T, N, S, 0, G, got)
    assert sorted(seen) == sorted(timed) and len(seen) == len(set(seen))
    assert poll(client) == []
    assert state(client).unfinished == 0


def test_a_due_time_the_scan_stopped_inside_is_handed_out_once(
    redis_client: felix_redis.Client, raw: redis.Redis
) -> None:
    """A batch of 5,000 records due at one moment, of which one poll's bounded scan
    passed over only the first 4,100: once due, the passed ones come from the due index
    and the rest from the scan, each once and in offset order."""
    client = redis_client
    setup(client)
    published = client.publish_batch(T, N, S, [b"d%d" % i for i in range(5000)], delay=0.8)
    name = client.core.name(T, N, S)
    keys = [*name.shard_keys(0), *name.group_key_list(0, G), name.due_key(0)]
    reply = run_script(client, "group_poll", keys, ["1", "", "0"])
    assert reply[4] == 0 and int(reply[1]) <= int(reply[0])  # nothing handed out; "poll again"
    nxt = int(raw.hget(_group_key(client), "next"))
    assert 0 < nxt < 5000, nxt
    wait_server(raw, server_ms(raw) + 850)
    seen: list[int] = []
    for _ in range(40):
        got = poll(client, n=200)
        if not got:
            break
        seen += [r.offset for r in got]
        client.group_ack_many(T, N, S, 0, G, got)
    assert seen == [p.offset for p in published]
    assert state(client).unfinished == 0


def test_trimming_keeps_the_due_time_a_group_stands_inside(
    redis_client: felix_redis.Client, raw: redis.Redis
) -> None:
    """stream_trim prunes the due index up to every group's due cursor, but not the due
    time a group is inside of: its records not handed out yet still come. (The due time
    is the last ms of its 100 ms bucket: a cursor there has passed the whole bucket but
    for the records above its last offset.)"""
    client = redis_client
    setup(client)
    at_ms = server_ms(raw) + 400
    at_ms += 99 - at_ms % 100
    at = datetime.fromtimestamp(at_ms / 1000, timezone.utc)
    published = client.publish_batch(T, N, S, [b"d%d" % i for i in range(100)], deliver_at=at)
    _passed_over(client, raw, 100)
    wait_server(raw, at_ms + 1)
    got = poll(client, n=10)
    client.group_ack_many(T, N, S, 0, G, got)
    client.stream_trim(T, N, S)
    assert len(due_index(raw, name_due := client.core.name(T, N, S).due_key(0))) == 100
    rest: list[int] = []
    while batch := poll(client, n=30):
        rest += [r.offset for r in batch]
        client.group_ack_many(T, N, S, 0, G, batch)
    assert [r.offset for r in got] + rest == [p.offset for p in published]
    client.stream_trim(T, N, S)
    assert due_index(raw, name_due) == []


def test_a_rate_limit_and_named_consumers_hold_inside_a_shared_due_time(
    redis_client: felix_redis.Client, raw: redis.Redis
) -> None:
    """Handed out from the due index, records still count against the rate limit and
    are held by the consumer that polled them (reclaim gives them back)."""
    client = redis_client
    setup(client, rate_limit=(5, 60.0))
    client.publish_batch(T, N, S, [b"d%d" % i for i in range(50)], delay=0.3)
    assert poll(client, n=100) == []
    wait_server(raw, server_ms(raw) + 350)
    got = client.group_poll_as(T, N, S, 0, G, "c1", max_records=16)
    assert len(got) == 5
    assert client.group_poll_as(T, N, S, 0, G, "c2", max_records=16) == []
    owner = client.core.name(T, N, S).group_key_list(0, G)[7]
    assert owner.endswith(":owner")
    assert raw.hgetall(owner) == {str(r.offset).encode(): b"c1" for r in got}
    # c1 gives them back: owed at once, and the window is spent, so they wait for it
    assert client.group_poll_as(T, N, S, 0, G, "c1", max_records=16, reclaim=True) == []
    st = state(client)
    assert (st.owed, st.in_flight, st.pending) == (5, 0, 45), st


def test_a_delayed_record_keeps_its_delay_in_the_log_and_the_due_index_reads_as_documented(
    redis_client: felix_redis.Client, raw: redis.Redis
) -> None:
    """docs/keys.md, byte for byte: the log's d field is the delay (the due time less the
    publish time, the entry ID's second part), and replay, describe and the group read the
    due time it gives; the due index's chunk is the documented example: records published
    one after the other cost '.DD' each, the gap before a batch is written once."""
    client = redis_client
    setup(client)
    name = client.core.name(T, N, S)
    log_key, due_key = name.shard_keys(0)[1], name.due_key(0)
    bucket = server_ms(raw) + 1500
    bucket -= bucket % 100
    at = [datetime.fromtimestamp(ms / 1000, timezone.utc) for ms in (bucket + 42, bucket + 57, bucket + 99)]
    client.publish(T, N, S, b"a", deliver_at=at[0])
    client.publish(T, N, S, b"b", deliver_at=at[1])
    client.publish_batch(T, N, S, [b"p0", b"p1", b"p2"])
    client.publish_batch(T, N, S, [b"c%d" % i for i in range(100)], deliver_at=at[2])
    assert raw.zrange(due_key, 0, -1, withscores=True) == [(b"v2:000000:0:102:104:.42.573+100.99", float(bucket))]
    assert due_index(raw, due_key) == [(0, bucket + 42), (1, bucket + 57)] + [(o, bucket + 99) for o in range(5, 105)]
    entries = raw.xrange(log_key, "0", "+")
    wanted = {0: bucket + 42, 1: bucket + 57, **{o: bucket + 99 for o in range(5, 105)}}
    replay = {r.offset: r.deliver_ms for r in client.read(T, N, S, 0, 0, 105)}
    for entry_id, fields in entries:
        offset, published = (int(x) for x in entry_id.decode().split("-"))
        if offset in wanted:
            assert fields[b"d"] == str(wanted[offset] - published).encode(), (offset, fields)
            assert 1000 < int(fields[b"d"]) <= 1600
        else:
            assert b"d" not in fields
        assert replay[offset] == wanted.get(offset)
    client.publish(T, N, S, b"later", delay=5)
    last_id, last = raw.xrevrange(log_key, "+", "-", count=1)[0]
    assert last[b"d"] == b"5000"
    assert client.read(T, N, S, 0, 105, 1)[0].deliver_ms == int(last_id.decode().split("-")[1]) + 5000
    assert [r.offset for r in poll(client, n=200)] == [2, 3, 4]
    assert client.group_describe(T, N, S, G).shards[0].scheduled == 103
    wait_server(raw, bucket + 100)
    got = poll(client, n=200)
    assert [(r.offset, r.deliver_ms) for r in got] == sorted(wanted.items())


def test_delayed_records_in_the_format_before_the_delay_was_stored_are_held_and_handed_out_once(
    redis_client: felix_redis.Client, raw: redis.Redis
) -> None:
    """Records a client before this format published (a d field holding the due time, a
    due index chunk 'K:FIRST:COUNT:ENTRIES'), written here as that client wrote them: the
    group holds them until their due times and hands each out once, with its due time; a
    delayed publish into the same bucket starts a chunk of its own beside the old one."""
    client = redis_client
    setup(client)
    name = client.core.name(T, N, S)
    meta_key, log_key = name.shard_keys(0)[0], name.shard_keys(0)[1]
    due_key = name.due_key(0)
    bucket = server_ms(raw) + 1500
    bucket -= bucket % 100
    now = server_ms(raw)
    raw.xadd(log_key, {"p": b"old-a", "d": str(bucket + 42)}, id=f"0-{now}")
    raw.xadd(log_key, {"p": b"old-b", "d": str(bucket + 7)}, id=f"1-{now}")
    raw.hset(meta_key, mapping={"tail": 2, "tlast": 1, "dmax": bucket + 42})
    raw.zadd(due_key, {"000000:0:2:0.42;1.7": bucket})  # (DD of one digit, as those clients wrote it)
    at = datetime.fromtimestamp((bucket + 70) / 1000, timezone.utc)
    assert client.publish(T, N, S, b"new", deliver_at=at).offset == 2
    assert raw.zrange(due_key, 0, -1) == [b"000000:0:2:0.42;1.7", b"v2:000001:2:1:2:.70"]
    assert due_index(raw, due_key) == [(0, bucket + 42), (1, bucket + 7), (2, bucket + 70)]
    assert [r.deliver_ms for r in client.read(T, N, S, 0, 0, 3)] == [bucket + 42, bucket + 7, bucket + 70]
    assert poll(client, n=10) == []
    assert client.group_describe(T, N, S, G).shards[0].scheduled == 3
    wait_server(raw, bucket + 100)
    got = poll(client, n=10)
    assert [(r.offset, r.payload, r.deliver_ms) for r in got] == [
        (1, b"old-b", bucket + 7), (0, b"old-a", bucket + 42), (2, b"new", bucket + 70)]
    client.group_ack_many(T, N, S, 0, G, got)
    assert poll(client, n=10) == []


def test_the_due_index_keeps_records_in_small_chunks_a_batch_in_one_entry(
    redis_client: felix_redis.Client, raw: redis.Redis
) -> None:
    """docs/keys.md's due index: a delayed batch is one entry; single records due in the
    same 100 ms bucket share chunks of at most 480 bytes; every record is there with its
    due time, and a group hands them all out once due."""
    client = redis_client
    setup(client)
    due_key = client.core.name(T, N, S).due_key(0)
    at_ms = server_ms(raw) + 700
    at_ms -= at_ms % 100  # the start of a bucket: all below are in it
    at = datetime.fromtimestamp(at_ms / 1000, timezone.utc)
    batch = client.publish_batch(T, N, S, [b"b%d" % i for i in range(1000)], deliver_at=at)
    members = raw.zrange(due_key, 0, -1)
    assert len(members) == 1 and members[0].decode().split(":", 5)[5] == "+1000.00", members
    later = datetime.fromtimestamp((at_ms + 50) / 1000, timezone.utc)
    singles = [client.publish(T, N, S, b"s%d" % i, deliver_at=later).offset for i in range(300)]
    members = raw.zrange(due_key, 0, -1, withscores=True)
    assert {int(sc) for _, sc in members} == {at_ms}
    assert all(len(m) <= 480 for m, _ in members)
    assert len(members) <= 1 + 300 * 12 // 440 + 1, len(members)
    assert due_index(raw, due_key) == sorted([(p.offset, at_ms) for p in batch] + [(o, at_ms + 50) for o in singles])
    assert poll(client, n=1000) == []
    wait_server(raw, at_ms + 60)
    got: list[int] = []
    while batch_ := poll(client, n=500):
        got += [r.offset for r in batch_]
        client.group_ack_many(T, N, S, 0, G, batch_)
    assert got == [p.offset for p in batch] + singles


def test_records_expired_inside_a_shared_due_time_do_not_let_the_scan_hand_out_the_rest_twice(
    redis_client: felix_redis.Client, raw: redis.Redis
) -> None:
    """4,300 records due at one moment but expired by then, and 200 more due at the same
    moment, some of which the group's scan had not reached: while the due index hands out (here:
    dead-letters) the expired ones poll by poll, the polls' scans meet the others and
    must leave them to the due index, so each comes once."""
    client = redis_client
    setup(client)
    at_ms = server_ms(raw) + 1500
    at = datetime.fromtimestamp(at_ms / 1000, timezone.utc)
    client.publish_batch(T, N, S, [b"a%d" % i for i in range(4300)], deliver_at=at, expires_in=0.5)
    later = client.publish_batch(T, N, S, [b"b%d" % i for i in range(200)], deliver_at=at)
    name = client.core.name(T, N, S)
    keys = [*name.shard_keys(0), *name.group_key_list(0, G), name.due_key(0)]
    # one poll's bounded scan (4 x 1 + 4,096 records, in pages) stops inside the 200
    assert run_script(client, "group_poll", keys, ["1", "", "0"])[4] == 0
    assert 4300 < int(raw.hget(_group_key(client), "next")) < 4500
    wait_server(raw, at_ms + 20)
    seen: list[int] = []
    for _ in range(600):
        got = poll(client, n=16)
        seen += [r.offset for r in got]
        client.group_ack_many(T, N, S, 0, G, got)
        if len(seen) >= 200 and state(client).unfinished == 0:
            break
    assert sorted(seen) == [p.offset for p in later] and len(seen) == len(set(seen))
    assert len(dead(client)) == 4300 and {reason for _, _, reason in dead(client)} == {"expired"}


def test_a_poll_hands_out_redeliveries_and_due_delayed_records_together_up_to_max_records(
    redis_client: felix_redis.Client, raw: redis.Redis
) -> None:
    """Due redeliveries come first, then delayed records come due, and the two together
    are at most max_records."""
    client = redis_client
    setup(client)
    for i in range(3):
        client.publish(T, N, S, b"r%d" % i)
    first = poll(client, n=3)
    client.publish_batch(T, N, S, [b"d%d" % i for i in range(10)], delay=0.3)
    assert poll(client) == []  # the scan passes over the delayed ones
    for record in first:
        client.group_nack(T, N, S, 0, G, record)
    due = due_index(raw, client.core.name(T, N, S).due_key(0))[0][1]
    wait_server(raw, due + 5)
    got = poll(client, n=5)
    assert [r.payload for r in got] == [b"r0", b"r1", b"r2", b"d0", b"d1"]
    assert [r.attempts for r in got] == [2, 2, 2, 1, 1]


def test_a_member_off_a_bucket_start_in_the_due_index_hides_no_bucket(
    redis_client: felix_redis.Client, raw: redis.Redis
) -> None:
    """A member written by hand at a score that is no bucket's start (an offset scored by
    its due time, say) just before a bucket of delayed records: the group still hands
    them all out once due, and describe counts them until then."""
    client = redis_client
    setup(client)
    at_ms = server_ms(raw) + 800
    at_ms -= at_ms % 100
    first = datetime.fromtimestamp((at_ms + 10) / 1000, timezone.utc)
    second = datetime.fromtimestamp((at_ms + 60) / 1000, timezone.utc)
    offsets = [p.offset for p in client.publish_batch(T, N, S, [b"a", b"b", b"c"], deliver_at=first)]
    offsets.append(client.publish(T, N, S, b"d", deliver_at=second).offset)
    assert poll(client) == []
    raw.zadd(client.core.name(T, N, S).due_key(0), {"77": at_ms - 50})
    assert state(client).scheduled == 4
    wait_server(raw, at_ms + 200)
    got = poll(client)
    assert [r.offset for r in got] == offsets


def test_a_spent_rate_window_names_its_end_while_passed_over_records_are_due(
    redis_client: felix_redis.Client, raw: redis.Redis
) -> None:
    """Delayed records the group passed over come due while the rate limit's window is
    spent: the poll hands out nothing and says when to come back, the window's end (a
    long poll waits for it, not for its whole wait)."""
    client = redis_client
    setup(client, rate_limit=(2, 2.0))
    client.publish_batch(T, N, S, [b"d1", b"d2", b"d3"], delay=0.4)
    assert poll(client) == []
    client.publish_batch(T, N, S, [b"p1", b"p2"])
    plain = poll(client)
    assert [r.payload for r in plain] == [b"p1", b"p2"]
    client.group_ack_many(T, N, S, 0, G, plain)
    due = due_index(raw, client.core.name(T, N, S).due_key(0))[0][1]
    wait_server(raw, due + 20)
    name = client.core.name(T, N, S)
    keys = [*name.shard_keys(0), *name.group_key_list(0, G), name.due_key(0)]
    reply = run_script(client, "group_poll", keys, ["16", "", "0"])
    window_end = int(raw.hget(_group_key(client), "rate").split()[2]) + 2000
    assert (reply[4], int(reply[1])) == (0, window_end)
    t0 = time.monotonic()
    got = poll(client, n=16, wait=6.0)
    assert [r.payload for r in got] == [b"d1", b"d2"]
    assert time.monotonic() - t0 < 4.0
