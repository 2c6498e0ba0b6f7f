"""Recurring schedules (felix_redis/schedules.py, lua/schedule_*.lua, docs/schedules.md):
the cron and period arithmetic at fixed instants (DST, the gap rule), each due time
published once by concurrent tickers, crashed or re-sent ticks, the cost of a tick,
listing, deleting, bad input, ACL, workers and felixctl, on Redis and memory://."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis
from click.testing import CliRunner

import felix_redis
import felix_redis.asyncio as aio
from felix_redis import InvalidArgument, NotFound, PermissionDenied, acl
from felix_redis.aioworker import AsyncWorker
from felix_redis.plans import Batch, Eval
from felix_redis.schedules import (
    cron_latest_ms,
    cron_next_ms,
    cron_times,
    due_and_next,
    schedule_keys,
    tick_plan,
)
from felix_redis.scripts import lua_dir
from felix_redis.worker import Worker
from felixctl.cli import cli

T, N, S = "acme", "prod", "jobs"
UTC = timezone.utc
ZURICH = ZoneInfo("Europe/Zurich")
NEW_YORK = ZoneInfo("America/New_York")


def ms(when: datetime) -> int:
    return int(when.timestamp() * 1000)


def records(c: felix_redis.Client, shards: int = 1) -> list[felix_redis.Record]:
    out = []
    for shard in range(shards):
        out += c.read(T, N, S, shard, 0, 10_000)
    return out


def state(r: Any, c: felix_redis.Client, name: str, shard: int = 0) -> tuple[int, int, int | None, int | None]:
    """V, A, LAST, OFFSET of a schedule, as the schedules hash holds them (docs/schedules.md)."""
    key = schedule_keys(c.core.cache.laid(c.core.name(T, N, S), _spread(c)), shard)[1]
    raw = r.hget(key, f"{name}|s")
    v, a, last, off = (raw.decode() if isinstance(raw, bytes) else raw).split(" ")
    return int(v), int(a), None if last == "-" else int(last), None if off == "-" else int(off)


def _spread(c: felix_redis.Client) -> int:
    info = c.stream_describe(T, N, S)
    return info.shards if info.shards > 1 else 0


# --------------------------------------------------------------------------- cron at fixed instants


def test_a_local_time_the_zone_skips_does_not_fire_zurich() -> None:
    # 2026-03-29: Zurich springs from 02:00 to 03:00; 02:30 does not exist that day
    got = cron_times("30 2 * * *", "Europe/Zurich", datetime(2026, 3, 27, tzinfo=ZURICH),
                     datetime(2026, 3, 31, tzinfo=ZURICH))
    assert [(d.day, d.hour, d.minute) for d in got] == [(27, 2, 30), (28, 2, 30), (30, 2, 30)]
    # the day after the skipped one comes straight after the day before
    before = ms(datetime(2026, 3, 28, 2, 30, tzinfo=ZURICH))
    assert cron_next_ms("30 2 * * *", "Europe/Zurich", before) == ms(datetime(2026, 3, 30, 2, 30, tzinfo=ZURICH))


def test_a_local_time_the_zone_repeats_fires_once_at_its_first_occurrence_zurich() -> None:
    # 2026-10-25: Zurich falls back from 03:00 CEST to 02:00 CET; 02:00-02:59 happen twice
    got = cron_times("*/20 * * * *", "Europe/Zurich", datetime(2026, 10, 25, 1, 30, tzinfo=ZURICH),
                     datetime(2026, 10, 25, 3, 30, tzinfo=ZURICH))
    utc = [d.astimezone(UTC).strftime("%H:%M") for d in got]
    # 02:00, 02:20, 02:40 once each, in CEST (the first pass); then 03:00 CET
    assert utc == ["23:40", "00:00", "00:20", "00:40", "02:00", "02:20"]
    assert len({(d.hour, d.minute) for d in got}) == len(got)


def test_a_daily_time_in_the_repeated_hour_fires_once_new_york() -> None:
    # 2026-11-01: New York falls back at 02:00 EDT to 01:00 EST; 01:30 happens twice
    got = cron_times("30 1 * * *", "America/New_York", datetime(2026, 10, 31, tzinfo=UTC),
                     datetime(2026, 11, 3, tzinfo=UTC))
    assert [d.astimezone(UTC).isoformat() for d in got] == [
        "2026-10-31T05:30:00+00:00", "2026-11-01T05:30:00+00:00", "2026-11-02T06:30:00+00:00"]
    # 2026-03-08: it springs from 02:00 to 03:00; 02:30 is skipped
    spring = cron_times("30 2 * * *", "America/New_York", datetime(2026, 3, 7, tzinfo=UTC),
                        datetime(2026, 3, 10, tzinfo=UTC))
    assert [d.day for d in spring] == [7, 9]


def test_due_and_next_inside_the_repeated_hour() -> None:
    expr, zone = "*/20 * * * *", "Europe/Zurich"
    # now: 02:50 CET, the second pass (00:50 UTC would be the first)
    second_pass = ms(datetime(2026, 10, 25, 1, 50, tzinfo=UTC))
    due, nxt = due_and_next(cron=expr, every_ms=None, timezone=zone, set_ms=0, now_ms=second_pass)
    # the latest due time is 02:40 of the first pass; the next is 03:00 CET (nothing in the second pass)
    assert due == ms(datetime(2026, 10, 25, 0, 40, tzinfo=UTC))
    assert nxt == ms(datetime(2026, 10, 25, 2, 0, tzinfo=UTC))
    first_pass = ms(datetime(2026, 10, 25, 0, 50, tzinfo=UTC))
    assert due_and_next(cron=expr, every_ms=None, timezone=zone, set_ms=0, now_ms=first_pass) == (due, nxt)
    assert cron_latest_ms(expr, zone, ms(datetime(2026, 10, 25, 0, 40, tzinfo=UTC))) == due  # at: included


def test_the_gap_rule_gives_the_latest_missed_due_time_only() -> None:
    set_at = ms(datetime(2026, 6, 1, 12, 0, 0, 500_000, tzinfo=UTC))
    # every 10 s: nothing ticked for 35 s -> one due time, the latest (set + 30 s)
    assert due_and_next(cron=None, every_ms=10_000, timezone="UTC", set_ms=set_at, now_ms=set_at + 35_000) == (
        set_at + 30_000, set_at + 40_000)
    # nothing due before the first period is over; the first due time is set + every
    assert due_and_next(cron=None, every_ms=10_000, timezone="UTC", set_ms=set_at, now_ms=set_at + 9_999) == (
        None, set_at + 10_000)
    # cron every 5 minutes, nothing ticked from 12:01 to 12:33 -> 12:30 only, next 12:35
    due, nxt = due_and_next(cron="*/5 * * * *", every_ms=None, timezone="UTC", set_ms=set_at,
                            now_ms=ms(datetime(2026, 6, 1, 12, 33, 10, tzinfo=UTC)))
    assert (due, nxt) == (ms(datetime(2026, 6, 1, 12, 30, tzinfo=UTC)), ms(datetime(2026, 6, 1, 12, 35, tzinfo=UTC)))
    # a due time at or before the set time never fires: the first is after it
    assert due_and_next(cron="0 12 * * *", every_ms=None, timezone="UTC", set_ms=set_at,
                        now_ms=set_at + 1000)[0] is None


def test_cron_evaluation_is_in_the_schedules_zone() -> None:
    at = ms(datetime(2026, 1, 15, 12, 0, tzinfo=UTC))
    assert cron_next_ms("0 3 * * *", "Europe/Zurich", at) == ms(datetime(2026, 1, 16, 2, 0, tzinfo=UTC))
    assert cron_next_ms("0 3 * * *", "UTC", at) == ms(datetime(2026, 1, 16, 3, 0, tzinfo=UTC))
    assert cron_next_ms("0 3 * * *", "America/New_York", at) == ms(datetime(2026, 1, 16, 8, 0, tzinfo=UTC))


# --------------------------------------------------------------------------- end to end


def test_every_one_second_end_to_end(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    client.schedule_set(T, N, S, "beat", b"tick", every=1, key="k-1", headers={"kind": "beat"})
    assert client.schedule_tick(T, N, S) == []  # nothing fires at once
    time.sleep(1.2)
    published = client.schedule_tick(T, N, S)
    assert published == [felix_redis.Published(0, 0)]
    assert client.schedule_tick(T, N, S) == []  # the same due time: never again
    (rec,) = records(client)
    assert (rec.payload, rec.key, rec.headers) == (b"tick", "k-1", {"kind": "beat"})
    (s,) = client.schedule_list(T, N, S)
    assert s.last_offset == 0 and s.last_at is not None and s.next_at is not None
    assert s.next_at - s.last_at == timedelta(seconds=1)
    # a group created before the schedule fired sees the record, headers and all
    client.group_create(T, N, S, "g")
    time.sleep(1.1)
    client.schedule_tick(T, N, S)
    got = client.group_poll(T, N, S, 0, "g", max_records=10)
    assert [r.payload for r in got] == [b"tick", b"tick"] and got[1].headers == {"kind": "beat"}


def test_schedule_list_fields(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S, shards=3)
    before = datetime.now(UTC)
    client.schedule_set(T, N, S, "nightly", '{"task":"report"}', cron="0 3 * * *", timezone="Europe/Zurich")
    client.schedule_set(T, N, S, "beat", b"x", every=30)
    client.schedule_set(T, N, S, "half", b"y", every=1.5, key="k")
    listed = client.schedule_list(T, N, S)
    assert [s.name for s in listed] == ["beat", "half", "nightly"]
    beat, half, nightly = listed
    assert (nightly.cron, nightly.every, nightly.timezone) == ("0 3 * * *", None, "Europe/Zurich")
    assert (beat.cron, beat.every, beat.timezone) == (None, 30, "UTC")
    assert half.every == 1.5 and half.key == "k" and half.shard == felix_redis.shard_for_key(b"k", 3)
    for s in listed:
        assert (s.last_at, s.last_offset) == (None, None)
        assert s.next_at is not None and s.next_at.tzinfo is not None and s.next_at > before
    assert nightly.next_at.astimezone(ZURICH).hour == 3 and nightly.next_at.astimezone(ZURICH).minute == 0
    assert timedelta(seconds=29) < beat.next_at - before < timedelta(seconds=31)
    assert nightly.payload == b'{"task":"report"}'


def test_set_replaces_a_schedule_of_that_name(client: felix_redis.Client, backend: tuple[str, Any]) -> None:
    client.stream_create(T, N, S, shards=4)
    client.schedule_set(T, N, S, "job", b"one", every=60, key="a")
    client.schedule_set(T, N, S, "job", b"two", cron="*/5 * * * *", key="b")
    (s,) = client.schedule_list(T, N, S)
    assert (s.cron, s.every, s.payload, s.key) == ("*/5 * * * *", None, b"two", "b")
    assert s.shard == felix_redis.shard_for_key(b"b", 4)
    client.schedule_set(T, N, S, "job", b"three", every=2)  # no key: the shard of its name
    (s,) = client.schedule_list(T, N, S)
    assert (s.every, s.key, s.shard) == (2, None, felix_redis.shard_for_key(b"job", 4))


def test_delete(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S, shards=2)
    client.schedule_set(T, N, S, "beat", b"x", every=1)
    client.schedule_set(T, N, S, "keep", b"y", every=1)
    client.schedule_delete(T, N, S, "beat")
    assert [s.name for s in client.schedule_list(T, N, S)] == ["keep"]
    with pytest.raises(NotFound):
        client.schedule_delete(T, N, S, "beat")
    with pytest.raises(NotFound):
        client.schedule_delete(T, N, S, "never-was")
    time.sleep(1.1)
    assert len(client.schedule_tick(T, N, S)) == 1  # keep only
    assert [r.payload for r in records(client, 2)] == [b"y"]


BAD: list[tuple[dict[str, Any], str]] = [
    ({"cron": "0 3 * *"}, "cron"),
    ({"cron": "0 3 * * * *"}, "cron"),
    ({"cron": "61 3 * * *"}, "cron"),
    ({"cron": "0 3 31 2 *"}, "cron"),
    ({"cron": 5}, "cron"),
    ({"cron": "0 3 * * *", "timezone": "Mars/Olympus"}, "timezone"),
    ({"cron": "0 3 * * *", "timezone": "../etc/passwd"}, "timezone"),
    ({"every": 5, "timezone": ""}, "timezone"),
    ({"cron": "0 3 * * *", "every": 60}, "cron"),
    ({}, "cron"),
    ({"every": 0.5}, "every"),
    ({"every": 0}, "every"),
    ({"every": -3}, "every"),
    ({"every": math.nan}, "every"),
    ({"every": math.inf}, "every"),
    ({"every": True}, "every"),
    ({"every": "30"}, "every"),
    ({"every": 10**9}, "every"),
    ({"every": 5, "headers": {"bad name": "x"}}, "header"),
    ({"every": 5, "headers": {"ok": 5}}, "header"),
    ({"every": 5, "headers": ["x"]}, "headers"),
    ({"every": 5, "key": ""}, "key"),
]


@pytest.mark.parametrize(("kwargs", "word"), BAD, ids=[f"{i}-{w}" for i, (_, w) in enumerate(BAD)])
def test_bad_input_is_refused_and_nothing_written(client: felix_redis.Client, unchanged: Any,
                                                   kwargs: dict[str, Any], word: str) -> None:
    client.stream_create(T, N, S)
    with unchanged(), pytest.raises(InvalidArgument, match=word):
        client.schedule_set(T, N, S, "job", b"x", **kwargs)


def test_bad_name_payload_and_unknown_stream(client: felix_redis.Client, unchanged: Any) -> None:
    client.stream_create(T, N, S, max_payload=10)
    with unchanged():
        for name in ("", "a b", "a:b", "a|b", "x" * 65, "-lead", None):
            with pytest.raises(InvalidArgument, match="schedule"):
                client.schedule_set(T, N, S, name, b"x", every=5)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="payload"):
            client.schedule_set(T, N, S, "job", b"x" * 11, every=5)
        with pytest.raises(InvalidArgument, match="payload"):
            client.schedule_set(T, N, S, "job", 5, every=5)  # type: ignore[arg-type]
        with pytest.raises(NotFound):
            client.schedule_set(T, N, "nope", "job", b"x", every=5)
        with pytest.raises(NotFound):
            client.schedule_tick(T, N, "nope")
        with pytest.raises(InvalidArgument):
            client.schedule_delete(T, N, S, "a:b")


# --------------------------------------------------------------------------- exactly once


def _published_count_matches_last_due(r: Any, c: felix_redis.Client, names: list[str], shards: int) -> None:
    """Tickers that kept ticking (no gap) published every due time from the first to the
    last they recorded, once each: per schedule (LAST - A) / period records."""
    per_name: dict[str, int] = {}
    info = {s.name: s for s in c.schedule_list(T, N, S)}
    for rec in records(c, shards):
        per_name[rec.payload.decode()] = per_name.get(rec.payload.decode(), 0) + 1
    for name in names:
        _, a, last, _ = state(r, c, name, info[name].shard)
        assert last is not None, name
        assert (last - a) % 1000 == 0
        assert per_name[name] == (last - a) // 1000, (name, per_name[name], last - a)


def test_concurrent_threads_publish_each_due_time_once(redis_client: felix_redis.Client, raw: redis.Redis,
                                                       redis_url: str) -> None:
    c = redis_client
    c.stream_create(T, N, S, shards=2)
    names = [f"s{i}" for i in range(6)]
    for name in names:
        c.schedule_set(T, N, S, name, name.encode(), every=1)
    stop = time.monotonic() + 4.5
    clients = [felix_redis.connect(redis_url) for _ in range(8)]
    errors: list[BaseException] = []

    def ticker(cl: felix_redis.Client) -> None:
        try:
            while time.monotonic() < stop:
                cl.schedule_tick(T, N, S)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=ticker, args=(cl,)) for cl in clients]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for cl in clients:
        cl.close()
    assert not errors
    _published_count_matches_last_due(raw, c, names, 2)
    assert len(records(c, 2)) >= 6 * 3


TICKER = """
import os, sys, felix_redis
c = felix_redis.connect(sys.argv[1])
c.schedule_tick("acme", "prod", "jobs")
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):
    c.schedule_tick("acme", "prod", "jobs")
"""


def test_concurrent_processes_publish_each_due_time_once(redis_client: felix_redis.Client, raw: redis.Redis,
                                                         redis_url: str, tmp_path: Path) -> None:
    c = redis_client
    c.stream_create(T, N, S, shards=3)
    names = [f"p{i}" for i in range(5)]
    stop = tmp_path / "stop"
    procs = [subprocess.Popen([sys.executable, "-c", TICKER, redis_url, str(stop)], stdout=subprocess.PIPE)
             for _ in range(5)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        for name in names:
            c.schedule_set(T, N, S, name, name.encode(), every=1)
        time.sleep(4.5)
    finally:
        stop.touch()
        codes = [p.wait(60) for p in procs]
    assert codes == [0] * 5
    _published_count_matches_last_due(raw, c, names, 3)


def _phases(c: felix_redis.Client) -> tuple[Any, Batch]:
    """A tick plan run up to its second step: (the plan, the schedule_fire Batch it asks to send)."""
    plan = tick_plan(c.core, T, N, S)
    op = next(plan)
    while not (isinstance(op, Batch) and op.ops[0].script == "schedule_fire"):
        op = plan.send(c._execute(op))
    return plan, op


def test_a_crash_between_the_steps_and_a_resent_second_step_publish_once(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    client.schedule_set(T, N, S, "beat", b"x", every=1)
    time.sleep(1.1)
    plan, fire = _phases(client)
    plan.close()  # the ticker crashed before its second step
    assert len(client.schedule_tick(T, N, S)) == 1  # another ticker publishes the due time
    assert [r < 0 for r in client._execute(fire)[0]] == [True]  # the crashed one's step, sent late: nothing
    # a second step sent twice (its reply lost): one record
    time.sleep(1.0)
    plan, fire = _phases(client)
    first = client._execute(fire)
    again = client._execute(fire)
    assert first[0][0] == 1 and again[0] == [-1]
    assert len(records(client)) == 2


def test_a_tick_computed_before_a_replace_or_delete_publishes_nothing(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    client.schedule_set(T, N, S, "beat", b"old", every=1)
    time.sleep(1.1)
    _, fire = _phases(client)
    client.schedule_set(T, N, S, "beat", b"new", every=1)
    assert client._execute(fire)[0] == [-2]
    client.schedule_delete(T, N, S, "beat")
    assert client._execute(fire)[0] == [-2]
    assert records(client) == []


def test_after_a_gap_one_record_for_the_latest_missed_due_time(client: felix_redis.Client,
                                                                 backend: tuple[str, Any]) -> None:
    client.stream_create(T, N, S)
    client.schedule_set(T, N, S, "beat", b"x", every=1)
    time.sleep(3.6)  # due times at +1, +2 and +3 s pass with no tick
    assert len(client.schedule_tick(T, N, S)) == 1
    _, a, last, _ = state(backend[1], client, "beat")
    assert last is not None and last - a == 3000
    assert len(records(client)) == 1


def test_a_tick_costs_two_script_calls_per_shard_for_1000_schedules(redis_client: felix_redis.Client,
                                                                     raw: redis.Redis) -> None:
    c = redis_client
    shards = 2
    c.stream_create(T, N, S, shards=shards)
    # every 4 s, not 1: the second tick below must come before any schedule's next due
    # time, though making 1,000 schedules may take a few seconds on a loaded machine
    for i in range(1000):
        c.schedule_set(T, N, S, f"s{i}", b"x", every=4)
    time.sleep(4.2)
    raw.config_resetstat()
    published = c.schedule_tick(T, N, S)
    stats = raw.info("commandstats")
    calls = sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_fcall", "cmdstat_evalsha", "cmdstat_eval"))
    assert len(published) == 1000
    assert calls <= 2 * shards, stats
    raw.config_resetstat()
    assert c.schedule_tick(T, N, S) == []
    stats = raw.info("commandstats")
    assert sum(v["calls"] for k, v in stats.items() if k == "cmdstat_fcall") <= shards


# --------------------------------------------------------------------------- asyncio


def test_asyncio(redis_client: felix_redis.Client, redis_url: str) -> None:
    redis_client.stream_create(T, N, S)

    async def main() -> None:
        async with aio.connect(redis_url) as c:
            await c.schedule_set(T, N, S, "beat", b"a", every=1, headers={"h": "1"})
            assert await c.schedule_tick(T, N, S) == []
            await asyncio.sleep(1.1)
            assert await c.schedule_tick(T, N, S) == [felix_redis.Published(0, 0)]
            (s,) = await c.schedule_list(T, N, S)
            assert (s.name, s.every, s.last_offset) == ("beat", 1, 0)
            await c.schedule_delete(T, N, S, "beat")
            with pytest.raises(NotFound):
                await c.schedule_delete(T, N, S, "beat")
            with pytest.raises(InvalidArgument, match="timezone"):
                await c.schedule_set(T, N, S, "x", b"a", cron="* * * * *", timezone="No/Where")

    asyncio.run(main())
    assert [r.headers for r in records(redis_client)] == [{"h": "1"}]


# --------------------------------------------------------------------------- workers


def test_a_worker_ticks_the_schedules_of_its_stream(redis_client: felix_redis.Client) -> None:
    c = redis_client
    c.stream_create(T, N, S)
    c.group_create(T, N, S, "workers")
    c.schedule_set(T, N, S, "beat", b"scheduled", every=1)
    seen: list[bytes] = []
    w = Worker(c, T, N, S, "workers", lambda r: seen.append(r.payload), poll_wait_s=0.2, handle_signals=False)
    th = threading.Thread(target=w.run)
    th.start()
    deadline = time.monotonic() + 10
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    w.stop()
    th.join(10)
    assert not th.is_alive()
    assert seen[:2] == [b"scheduled", b"scheduled"]


def test_an_async_worker_ticks_the_schedules_of_its_stream(redis_client: felix_redis.Client,
                                                           redis_url: str) -> None:
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, "workers")
    redis_client.schedule_set(T, N, S, "beat", b"scheduled", every=1)
    seen: list[bytes] = []

    async def handle(r: felix_redis.Record) -> None:
        seen.append(r.payload)

    async def main() -> None:
        async with aio.connect(redis_url) as c:
            w = AsyncWorker(c, T, N, S, "workers", handle, poll_wait_s=0.2, handle_signals=False)
            task = asyncio.create_task(w.run())
            deadline = time.monotonic() + 10
            while len(seen) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            w.stop()
            await asyncio.wait_for(task, 10)

    asyncio.run(main())
    assert seen[:2] == [b"scheduled", b"scheduled"]


# --------------------------------------------------------------------------- ACL


PW = "pw-sched-1"


@pytest.fixture
def make_user(raw: redis.Redis, redis_url: str) -> Iterator[Callable[..., felix_redis.Client]]:
    """A client connected as a new Redis user holding one role on acme/prod/jobs
    (docs/security.md: felix_redis.acl.rules, granted with ACL SETUSER)."""
    made: list[tuple[str, felix_redis.Client]] = []

    def make(role: str, group: str | None = None) -> felix_redis.Client:
        user = f"felixsched{os.getpid()}x{len(made)}"
        acl.grant(raw, acl.setuser_args(user, acl.rules(role, T, N, S, group), password=PW))
        c = felix_redis.connect(redis_url.replace("redis://", f"redis://{user}:{PW}@", 1))
        made.append((user, c))
        return c

    yield make
    for user, c in made:
        c.close()
        raw.execute_command("ACL", "DELUSER", user)


def test_acl_publish_and_admin_roles_may_schedule_others_may_not(redis_client: felix_redis.Client,
                                                                 raw: redis.Redis, make_user: Any) -> None:
    from tests.conftest import dump_keyspace

    redis_client.stream_create(T, N, S, shards=2)
    redis_client.group_create(T, N, S, "workers")
    redis_client.schedule_set(T, N, S, "existing", b"e", every=1)
    publisher = make_user("stream.publish")
    publisher.schedule_set(T, N, S, "beat", b"x", every=1, key="k", headers={"a": "b"})
    admin = make_user("stream.admin")
    admin.schedule_set(T, N, S, "other", b"y", cron="0 3 * * *", timezone="Europe/Zurich")
    assert [s.name for s in publisher.schedule_list(T, N, S)] == ["beat", "existing", "other"]
    time.sleep(1.1)
    assert len(publisher.schedule_tick(T, N, S)) == 2
    consumer = make_user("group.consume", "workers")
    manager = make_user("group.manage", "workers")
    before = dump_keyspace(raw)
    for user in (consumer, manager):
        for call in (lambda u: u.schedule_set(T, N, S, "nope", b"z", every=1),
                     lambda u: u.schedule_tick(T, N, S),
                     lambda u: u.schedule_delete(T, N, S, "beat"),
                     lambda u: u.schedule_list(T, N, S)):
            with pytest.raises(PermissionDenied):
                call(user)
    assert dump_keyspace(raw) == before
    admin.schedule_delete(T, N, S, "beat")
    publisher.schedule_delete(T, N, S, "other")
    assert [s.name for s in publisher.schedule_list(T, N, S)] == ["existing"]


def test_a_worker_whose_user_may_not_tick_still_works(redis_client: felix_redis.Client, make_user: Any,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, "workers")
    redis_client.publish(T, N, S, b"plain")
    consumer = make_user("group.consume", "workers")
    seen: list[bytes] = []
    w = Worker(consumer, T, N, S, "workers", lambda r: seen.append(r.payload), poll_wait_s=0.2,
               handle_signals=False, burst=True)
    w.run()
    assert seen == [b"plain"]
    assert "not ticking the schedules" in caplog.text
    # refused by the script's role check, not by ACL before it ran: the client keeps FCALL
    assert consumer._runner.functions


# --------------------------------------------------------------------------- felixctl


def test_cli_set_list_delete(backend: tuple[str, Any]) -> None:
    url = backend[0]
    runner = CliRunner()

    def run(*args: str, input: str | None = None) -> Any:
        result = runner.invoke(cli, ["--redis-url", url, "--tenant", T, "--namespace", N, *args], input=input)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return result

    assert run("stream", "create", "jobs").exit_code == 0
    out = run("schedule", "set", "jobs", "nightly", "--cron", "0 3 * * *", "--tz", "Europe/Zurich", '{"a":1}')
    assert out.exit_code == 0 and "schedule nightly set on acme/prod/jobs; next at" in out.stdout
    assert run("schedule", "set", "jobs", "beat", "--every", "30s", "--key", "k", "--header", "x=y",
               "--header", "z=w", "ping").exit_code == 0
    assert run("schedule", "set", "jobs", "fromstdin", "--every", "2", "-", input="payload\n").exit_code == 0
    text = run("schedule", "list", "jobs").stdout
    assert text.splitlines()[0].split() == ["NAME", "WHEN", "NEXT", "LAST", "LAST", "RECORD", "KEY"]
    assert re.search(r"^nightly\s+0 3 \* \* \* \(Europe/Zurich\)\s+\S+\s+-\s+-\s+-$", text, re.M)
    assert re.search(r"^beat\s+every 30s\s+\S+\s+-\s+-\s+k$", text, re.M)
    doc = json.loads(run("schedule", "list", "jobs", "-o", "json").stdout)
    by_name = {d["name"]: d for d in doc}
    assert by_name["beat"]["headers"] == {"x": "y", "z": "w"} and by_name["beat"]["every"] == 30
    assert by_name["fromstdin"]["payload"] == "payload"
    assert by_name["nightly"]["cron"] == "0 3 * * *" and by_name["nightly"]["last_at"] is None
    assert run("schedule", "delete", "jobs", "beat").exit_code == 0
    missing = run("schedule", "delete", "jobs", "beat")
    assert missing.exit_code == 1 and "no schedule beat" in missing.stderr
    bad = run("schedule", "set", "jobs", "x", "--cron", "0 3 * *", "p")
    assert bad.exit_code == 1 and "felixctl: error: cron" in bad.stderr
    assert run("schedule", "set", "jobs", "x", "p").exit_code == 2  # neither --cron nor --every
    assert run("schedule", "set", "jobs", "x", "--every", "soon", "p").exit_code == 2


def _scheduler(redis_url: str, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "felixctl", "--redis-url", redis_url, "--tenant", T, "--namespace", N,
         "scheduler", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        cwd=str(Path(lua_dir()).parent))


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_cli_scheduler_publishes_and_stops_on_a_signal(redis_client: felix_redis.Client, redis_url: str,
                                                        sig: int, code: int) -> None:
    redis_client.stream_create(T, N, S, shards=2)
    redis_client.schedule_set(T, N, S, "beat", b"x", every=1)
    proc = _scheduler(redis_url)  # every stream this (default) user may list
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()  # the first record it published
        assert re.fullmatch(r"acme/prod/jobs\t\d:\d+\n", line), line
        proc.send_signal(sig)
        assert proc.wait(15) == code
    finally:
        proc.kill()
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    assert "Traceback" not in stderr
    assert len(records(redis_client, 2)) >= 1


def test_cli_scheduler_with_stream_options(redis_client: felix_redis.Client, redis_url: str) -> None:
    redis_client.stream_create(T, N, S)
    redis_client.stream_create(T, N, "other")
    redis_client.schedule_set(T, N, "other", "beat", b"o", every=1)
    redis_client.schedule_set(T, N, S, "beat", b"j", every=1)
    proc = _scheduler(redis_url, "--stream", "other")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().decode().startswith("acme/prod/other\t0:")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        proc.kill()
    assert records(redis_client) == []  # jobs was not ticked


# --------------------------------------------------------------------------- the scripts' headers


SCRIPTS = ["schedule_set", "schedule_delete", "schedule_due", "schedule_fire"]
KEY_LINE = re.compile(r"^--\s*KEYS\[(\d+)\]\s+(\w+)", re.M)


def _header(name: str) -> str:
    lines = []
    for line in (lua_dir() / f"{name}.lua").read_text().splitlines():
        if not line.startswith("--") or line.startswith("--- @include"):
            break
        lines.append(line)
    return "\n".join(lines)


def test_script_headers_name_the_keys_the_plans_pass(client: felix_redis.Client) -> None:
    seen: dict[str, list[Eval]] = {}
    original = client._execute

    def record(op: Any) -> Any:
        for e in op.ops if isinstance(op, Batch) else [op]:
            if isinstance(e, Eval):
                seen.setdefault(e.script, []).append(e)
        return original(op)

    client._execute = record  # type: ignore[method-assign]
    client.stream_create(T, N, S, shards=2)
    client.schedule_set(T, N, S, "c", b"x", cron="* * * * *")
    client.schedule_set(T, N, S, "e", b"x", every=1)
    client.schedule_list(T, N, S)
    time.sleep(1.1)
    client.schedule_tick(T, N, S)
    client.schedule_delete(T, N, S, "e")
    assert set(SCRIPTS) <= set(seen)
    for name in SCRIPTS:
        text = _header(name)
        assert text.startswith(f"-- {name}: ")
        assert re.search(r"^-- Returns: \S", text, re.M) and re.search(r"^-- Errors: \S", text, re.M)
        documented = [role for _, role in KEY_LINE.findall(text)]
        for op in seen[name]:
            roles = [k.rsplit(":", 1)[1] for k in op.keys]
            assert roles == documented, (name, roles, documented)


def test_a_tick_trims_a_stream_with_retention(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S, retention_max_len=1, kind="stream")
    for i in range(20):
        client.schedule_set(T, N, S, f"s{i}", b"x", every=1)
    time.sleep(1.1)
    assert len(client.schedule_tick(T, N, S)) == 20
    info = client.stream_describe(T, N, S)
    assert info.tails == [20] and info.firsts[0] >= 18


def test_stream_delete_deletes_the_schedules(redis_client: felix_redis.Client, raw: redis.Redis) -> None:
    """A stream deleted and made again under the same name has no schedules of the old
    one: stream_delete deletes each shard's sched and schedules keys."""
    redis_client.stream_create(T, N, S, shards=2)
    redis_client.schedule_set(T, N, S, "a", b"x", every=60)
    redis_client.schedule_set(T, N, S, "b", b"y", every=60, key="k")
    assert raw.keys("*:sched*")
    redis_client.stream_delete(T, N, S)
    assert raw.keys("*:sched*") == []
    redis_client.stream_create(T, N, S, shards=2)
    assert redis_client.schedule_list(T, N, S) == []
