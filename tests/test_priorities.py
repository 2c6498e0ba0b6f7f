"""Priorities across streams: one group polled over several streams, in strict order or
by weights (``group_sharded(t, ns, [...], group, weights=...)``, the Worker's and
felixctl's lists), against a real Redis and memory://."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import felix_redis
import felix_redis.asyncio as felix_async
from felix_redis import InvalidArgument
from felix_redis.worker import Worker

T, N, G = "acme", "prod", "workers"
STREAMS = ["urgent", "default", "bulk"]
ROOT = Path(__file__).resolve().parent.parent


def make(client: felix_redis.Client, shards: dict[str, int] | None = None, **group: Any) -> None:
    """The three streams (``shards`` each, default 1) and group ``workers`` on each."""
    for name in STREAMS:
        client.stream_create(T, N, name, shards=(shards or {}).get(name, 1))
        client.group_create(T, N, name, G, **group)


def fill(client: felix_redis.Client, counts: dict[str, int]) -> None:
    for name, count in counts.items():
        if count:
            client.publish_batch(T, N, name, [f"{name}-{i}" for i in range(count)])


def dead_letters(client: felix_redis.Client, stream: str) -> list[Any]:
    shards = len(client.group_describe(T, N, stream, G).shards)
    return [d for shard in range(shards) for d in client.group_dead_letters(T, N, stream, shard, G)]


def unfinished(client: felix_redis.Client, stream: str) -> int:
    return sum(s.unfinished for s in client.group_describe(T, N, stream, G).shards)


def test_strict_order_takes_from_a_stream_only_what_the_streams_before_it_could_not_fill(
    client: felix_redis.Client,
) -> None:
    make(client, shards={"default": 3})
    fill(client, {"urgent": 3, "default": 4, "bulk": 10})
    group = client.group_sharded(T, N, STREAMS, G)
    first = group.poll(2)
    assert [(i.stream, i.payload) for i in first] == [("urgent", b"urgent-0"), ("urgent", b"urgent-1")]
    second = group.poll(6, ack=first)
    assert Counter(i.stream for i in second) == {"urgent": 1, "default": 4, "bulk": 1}
    assert [i.stream for i in second] == ["urgent"] + ["default"] * 4 + ["bulk"]  # in priority order
    # the acks rode on the poll, each to its stream
    assert unfinished(client, "urgent") == 1 and unfinished(client, "default") == 4
    assert group.ack_many(second) == 6
    assert [unfinished(client, s) for s in STREAMS] == [0, 0, 9]
    # a record published to a stream before another comes first at the next poll
    client.publish(T, N, "urgent", b"late")
    assert [(i.stream, i.payload) for i in group.poll(2)] == [("urgent", b"late"), ("bulk", b"bulk-1")]
    # acks of a stream the poll does not reach go in its first round trip
    held = group.poll(8)
    assert [i.stream for i in held] == ["bulk"] * 8
    client.publish_batch(T, N, "urgent", [b"a", b"b"])
    assert [i.payload for i in group.poll(2, ack=held)] == [b"a", b"b"]
    assert [unfinished(client, s) for s in STREAMS] == [3, 0, 1]  # late, a, b in flight; bulk-1


def test_weights_share_the_hand_outs_of_busy_streams_and_starve_none(client: felix_redis.Client) -> None:
    make(client)
    fill(client, {"urgent": 400, "default": 400, "bulk": 400})
    group = client.group_sharded(T, N, STREAMS, G, weights=[6, 3, 1])
    served: Counter[str] = Counter()
    runs = []
    items: list[Any] = []
    for _ in range(10):
        run: Counter[str] = Counter()
        for _ in range(10):
            items = group.poll(4, ack=items)
            run.update(i.stream for i in items)
        runs.append(run)
        served.update(run)
    group.ack_many(items)
    assert served == {"urgent": 240, "default": 120, "bulk": 40}
    assert all(run["bulk"] > 0 for run in runs), f"a run of 10 polls left bulk out: {runs}"
    assert sum(unfinished(client, s) for s in STREAMS) == 1200 - 400


def test_a_weighted_poll_fills_from_the_other_streams_when_its_pick_is_empty(client: felix_redis.Client) -> None:
    make(client)
    fill(client, {"bulk": 50})
    group = client.group_sharded(T, N, STREAMS, G, weights=[6, 3, 1])
    for _ in range(5):
        items = group.poll(8)
        assert [i.stream for i in items] == ["bulk"] * 8  # the busy stream gets every poll's worth
        group.ack_many(items)


def test_settles_route_by_the_items_stream(client: felix_redis.Client) -> None:
    make(client, max_attempts=2)
    fill(client, {"urgent": 1, "default": 1, "bulk": 1})
    group = client.group_sharded(T, N, STREAMS, G)
    by_stream = {i.stream: i for i in group.poll(3)}
    assert set(by_stream) == set(STREAMS)
    assert group.ack(by_stream["urgent"]) is True
    assert group.extend(by_stream["default"], 60) > 0
    group.dead_letter(by_stream["bulk"], "broken")
    assert [d.reason for d in dead_letters(client, "bulk")] == ["broken"]
    assert dead_letters(client, "urgent") == [] and dead_letters(client, "default") == []
    assert group.nack(by_stream["default"]) is False
    again = group.poll(3)
    assert [(i.stream, i.attempts) for i in again] == [("default", 2)]
    assert [unfinished(client, s) for s in STREAMS] == [0, 1, 0]


def test_a_group_over_several_streams_refuses_what_names_no_stream_and_changes_nothing(
    client: felix_redis.Client,
) -> None:
    make(client)
    fill(client, {"urgent": 1})
    group = client.group_sharded(T, N, STREAMS, G)
    (item,) = group.poll(1)
    for ref in (item.record, item.claim):
        with pytest.raises(InvalidArgument, match="settles the Items it handed out"):
            group.ack(ref)
        with pytest.raises(InvalidArgument, match="settles the Items it handed out"):
            group.poll(1, ack=[ref])
    other = client.group_sharded(T, N, ["default", "bulk"], G)
    with pytest.raises(InvalidArgument, match="came from stream urgent, which group workers does not poll"):
        other.ack(item)
    assert unfinished(client, "urgent") == 1
    for bad, match in [
        ([], "at least one stream"),
        (["urgent", "urgent"], "names a stream twice"),
        (["urgent", "no such"], "stream name"),
        ("urgent,default", "stream name"),
        ([1], "stream name must be a string"),
    ]:
        with pytest.raises(InvalidArgument, match=match):
            client.group_sharded(T, N, bad, G)  # type: ignore[arg-type]
    for weights, match in [
        ([1, 2], "one weight per stream"),
        ([1, 0, 1], "between 1 and 1000"),
        ([1, 2.5, 1], "must be an integer"),
        ([True, 1, 1], "must be an integer"),
        ("631", "weights must be a list"),
        ({1: 1, 2: 2, 3: 3}, "weights must be a list"),
    ]:
        with pytest.raises(InvalidArgument, match=match):
            client.group_sharded(T, N, STREAMS, G, weights=weights)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="one stream"):
        client.group_sharded(T, N, STREAMS, G, shards=[0])
    assert group.ack(item) is True


def test_a_missing_stream_or_group_is_named(client: felix_redis.Client) -> None:
    make(client)
    client.stream_create(T, N, "nogroup")
    with pytest.raises(felix_redis.NotFound, match="stream acme/prod/gone"):
        client.group_sharded(T, N, ["urgent", "gone"], G).poll(1)
    with pytest.raises(felix_redis.NotFound, match="nogroup"):
        client.group_sharded(T, N, ["urgent", "nogroup"], G).poll(1)


def test_one_long_poll_waits_on_every_stream_and_wakes_on_any(client: felix_redis.Client) -> None:
    make(client, shards={"bulk": 2})
    group = client.group_sharded(T, N, STREAMS, G)
    assert group.poll(4) == []
    result: list[Any] = []
    waiter = threading.Thread(target=lambda: result.append((group.poll(4, wait=8), time.monotonic())), daemon=True)
    waiter.start()
    time.sleep(0.5)
    sent_at = time.monotonic()
    client.publish(T, N, "bulk", b"wake", shard=1)
    waiter.join(timeout=15)
    assert not waiter.is_alive(), "the long poll never returned"
    ((items, got_at),) = result
    assert [(i.stream, i.shard, i.payload) for i in items] == [("bulk", 1, b"wake")]
    assert got_at - sent_at < 4.0, f"the long poll answered {got_at - sent_at:.2f}s after the publish"


def test_a_long_poll_wakes_when_a_delayed_record_of_any_stream_falls_due(client: felix_redis.Client) -> None:
    make(client)
    group = client.group_sharded(T, N, STREAMS, G)
    client.publish(T, N, "default", b"later", delay=0.6)
    started = time.monotonic()
    items = group.poll(4, wait=8)
    waited = time.monotonic() - started
    assert [(i.stream, i.payload) for i in items] == [("default", b"later")]
    assert 0.4 < waited < 4.0


def test_a_single_stream_group_names_its_stream_on_every_item(client: felix_redis.Client) -> None:
    client.stream_create(T, N, "jobs", shards=2)
    client.group_create(T, N, "jobs", G)
    fill(client, {"jobs": 4})
    group = client.group_sharded(T, N, "jobs", G)
    items = group.poll(4)
    assert [i.stream for i in items] == ["jobs"] * 4 and group.streams == ["jobs"] and group.stream == "jobs"
    assert group.ack(items[0].claim) is True  # a claim string still settles on a one-stream group
    assert group.ack_many(items[1:]) == 3


def test_asyncio_group_over_several_streams(redis_client: felix_redis.Client, redis_url: str) -> None:
    make(redis_client)
    fill(redis_client, {"urgent": 1, "bulk": 3})

    async def run() -> None:
        client = felix_async.connect(redis_url)
        try:
            group = client.group_sharded(T, N, STREAMS, G, weights=[1, 1, 1])
            items = await group.poll(4)
            assert Counter(i.stream for i in items) == {"urgent": 1, "bulk": 3}
            assert await group.ack_many(items) == 4
            strict = client.group_sharded(T, N, STREAMS, G)
            poll = asyncio.ensure_future(strict.poll(2, wait=8))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            await client.publish(T, N, "default", b"wake")
            got = await asyncio.wait_for(poll, 15)
            assert [(i.stream, i.payload) for i in got] == [("default", b"wake")]
            assert time.monotonic() - started < 4.0
            await strict.dead_letter(got[0], "x")
            assert [d.reason for d in await client.group_dead_letters(T, N, "default", 0, G)] == ["x"]
        finally:
            await client.close()

    asyncio.run(run())


# ---------------------------------------------------------------------- the Worker


def test_worker_over_several_streams_handles_all_and_keeps_each_groups_max_attempts(
    redis_client: felix_redis.Client,
) -> None:
    client = redis_client
    for name, attempts in zip(STREAMS, [1, 3, 3], strict=True):
        client.stream_create(T, N, name, shards=2)
        client.group_create(T, N, name, G, max_attempts=attempts)
    fill(client, {"urgent": 5, "default": 5, "bulk": 5})
    client.publish(T, N, "urgent", b"fails")
    client.publish(T, N, "default", b"fails")
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    def handle(record: felix_redis.Record) -> None:
        with lock:
            seen.append((record.payload.decode(), record.attempts))
        if record.payload == b"fails":
            raise RuntimeError("no")

    from felix_redis.worker import Backoff

    worker = Worker(client, T, N, STREAMS, G, handle, weights=[3, 2, 1], concurrency=4,
                    backoff=Backoff(0.01, 1, 0.01, 0), handle_signals=False, poll_wait_s=0.5)
    assert worker.streams == STREAMS
    runner = threading.Thread(target=worker.run, daemon=True)
    runner.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (dead_letters(client, "urgent") and dead_letters(client, "default")):
        time.sleep(0.05)
    worker.stop()
    runner.join(timeout=30)
    assert not runner.is_alive()
    assert Counter(p for p, _ in seen if p != "fails") == Counter(f"{s}-{i}" for s in STREAMS for i in range(5))
    # urgent's group allows 1 attempt, default's 3: each failing record ran that often
    assert sorted(a for p, a in seen if p == "fails") == [1, 1, 2, 3]
    assert [d.attempts for d in dead_letters(client, "urgent")] == [1]
    assert [d.attempts for d in dead_letters(client, "default")] == [3]
    assert [unfinished(client, s) for s in STREAMS] == [0, 0, 0]
    assert worker.stats.processed == 15 and worker.stats.dead_lettered == 2


def test_worker_metrics_carry_each_records_stream(redis_client: felix_redis.Client) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from felix_redis.metrics import WorkerMetrics

    make(redis_client)
    fill(redis_client, {"urgent": 2, "bulk": 3})
    registry = prometheus_client.CollectorRegistry()
    metrics = WorkerMetrics(registry=registry)
    Worker(redis_client, T, N, STREAMS, G, lambda record: None, burst=True, handle_signals=False,
           metrics=metrics).run()

    def value(name: str, stream: str) -> float | None:
        return registry.get_sample_value(name, {"tenant": T, "namespace": N, "stream": stream, "group": G})

    assert value("felix_worker_jobs_processed_total", "urgent") == 2
    assert value("felix_worker_jobs_processed_total", "bulk") == 3
    assert value("felix_worker_jobs_processed_total", "default") == 0
    assert value("felix_worker_in_flight", "bulk") == 0


def test_asyncio_worker_over_several_streams(redis_client: felix_redis.Client, redis_url: str) -> None:
    from felix_redis.aioworker import AsyncWorker

    make(redis_client)
    fill(redis_client, {"urgent": 3, "default": 3, "bulk": 3})
    seen: list[str] = []

    async def handle(record: felix_redis.Record) -> None:
        seen.append(record.payload.decode())

    async def run() -> None:
        client = felix_async.connect(redis_url)
        try:
            await AsyncWorker(client, T, N, STREAMS, G, handle, concurrency=4, burst=True,
                              handle_signals=False).run()
        finally:
            await client.close()

    asyncio.run(run())
    assert sorted(seen) == sorted(f"{s}-{i}" for s in STREAMS for i in range(3))
    assert [unfinished(redis_client, s) for s in STREAMS] == [0, 0, 0]


def test_worker_refuses_a_shard_subset_over_several_streams(redis_client: felix_redis.Client) -> None:
    with pytest.raises(InvalidArgument, match="one stream"):
        Worker(redis_client, T, N, STREAMS, G, lambda record: None, shards=[0])
    with pytest.raises(InvalidArgument, match="one weight per stream"):
        Worker(redis_client, T, N, STREAMS, G, lambda record: None, weights=[1])


def felixctl(redis_url: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FELIX_REDIS_URL": redis_url, "PYTHONPATH": f"{cwd}{os.pathsep}{ROOT}"}
    return subprocess.run([sys.executable, "-m", "felixctl", "--tenant", T, "--namespace", N, *args],
                          capture_output=True, text=True, timeout=60, env=env, cwd=cwd, stdin=subprocess.DEVNULL)


def test_felixctl_worker_takes_a_list_of_streams_and_weights(
    redis_client: felix_redis.Client, redis_url: str, tmp_path: Path,
) -> None:
    make(redis_client)
    fill(redis_client, {"urgent": 2, "default": 2, "bulk": 2})
    out = tmp_path / "seen.txt"
    (tmp_path / "prio_jobs.py").write_text(
        "def handle(record):\n"
        f"    with open({str(out)!r}, 'a') as f:\n"
        "        f.write(record.payload.decode() + '\\n')\n")
    done = felixctl(redis_url, "worker", "urgent,default,bulk", G, "prio_jobs:handle", "--weights", "6,3,1",
                    "--burst", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(out.read_text().split()) == sorted(f"{s}-{i}" for s in STREAMS for i in range(2))
    assert "stream=acme/prod/urgent,default,bulk" in done.stderr
    for weights, message in [("6,x,1", "whole numbers"), ("6,3", "one weight per stream")]:
        bad = felixctl(redis_url, "worker", "urgent,default,bulk", G, "prio_jobs:handle", "--weights", weights,
                       "--burst", cwd=tmp_path)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr  # a usage error
    assert [unfinished(redis_client, s) for s in STREAMS] == [0, 0, 0]


# ---------------------------------------------------------------------- found by a review


def test_weighted_runs_count_what_the_lead_handed_out_from_any_of_its_shards(client: felix_redis.Client) -> None:
    """Records on one shard of four (one hot key), polled one at a time: the lead's
    first pass asks one shard; finding it empty must not end the lead's run when its
    second pass hands out from another shard."""
    make(client, shards={name: 4 for name in STREAMS})
    for name in STREAMS:
        client.publish_batch(T, N, name, [f"{name}-{i}".encode() for i in range(150)], shard=3)
    group = client.group_sharded(T, N, STREAMS, G, weights=[6, 3, 1])
    served: Counter[str] = Counter()
    items: list[Any] = []
    for _ in range(200):
        items = group.poll(1, ack=items)
        served.update(i.stream for i in items)
    assert served == {"urgent": 120, "default": 60, "bulk": 20}


def test_a_later_stream_that_fails_does_not_strand_what_earlier_streams_leased(
    client: felix_redis.Client,
) -> None:
    client.stream_create(T, N, "a")
    client.group_create(T, N, "a", G)
    client.stream_create(T, N, "b")  # no group on b
    client.publish_batch(T, N, "a", [b"a0", b"a1"])
    group = client.group_sharded(T, N, ["a", "b"], G)
    items = group.poll(4)  # a's two, then b fails: a's records are handed out, not stranded
    assert [i.payload for i in items] == [b"a0", b"a1"]
    assert group.ack_many(items) == 2
    with pytest.raises(felix_redis.NotFound, match="group"):
        group.poll(4)  # nothing else to hand out: the error is raised


def test_strict_order_reaches_a_due_record_behind_a_long_run_of_delayed_ones(client: felix_redis.Client) -> None:
    client.stream_create(T, N, "urgent")
    client.group_create(T, N, "urgent", G)
    client.stream_create(T, N, "bulk")
    client.group_create(T, N, "bulk", G)
    for _ in range(9):
        client.publish_batch(T, N, "urgent", [b"later"] * 1000, delay=3600)
    client.publish(T, N, "urgent", b"urgent-now")
    client.publish(T, N, "bulk", b"bulk-now")
    group = client.group_sharded(T, N, ["urgent", "bulk"], G)
    assert [(i.stream, i.payload) for i in group.poll(1)] == [("urgent", b"urgent-now")]
    assert [(i.stream, i.payload) for i in group.poll(1)] == [("bulk", b"bulk-now")]
