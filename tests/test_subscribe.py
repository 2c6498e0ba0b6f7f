"""Subscribers and replay: read a stream in offset order per shard, block for new
records, independent of (and invisible to) consumer groups."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import felix_redis
from felix_redis.protocol import BlockAny

T, N, S, G = "acme", "prod", "jobs", "workers"


@pytest.fixture
def other(backend: tuple[str, Any]) -> Iterator[felix_redis.Client]:
    c = felix_redis.connect(backend[0])
    yield c
    c.close()


def later(fn: Callable[[], Any], after: float) -> threading.Thread:
    def run() -> None:
        time.sleep(after)
        fn()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def publish_n(client: felix_redis.Client, n: int, shard: int | None = 0, start: int = 0) -> None:
    for i in range(start, start + n):
        client.publish(T, N, S, b"r%d" % i, shard=shard)


def take(sub: felix_redis.client.Subscription, n: int, timeout: float = 5.0) -> list[felix_redis.Record]:
    out: list[felix_redis.Record] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += sub.poll(block=0.2)
    return out


def describe(client: felix_redis.Client) -> list[tuple[int, ...]]:
    return [
        (s.shard, s.position, s.tail, s.lag, s.pending, s.owed, s.in_flight, s.dead)
        for s in client.group_describe(T, N, S, G).shards
    ]


# --------------------------------------------------------------------- starts


def test_earliest_reads_everything_in_order(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    publish_n(client, 5)
    sub = client.subscribe(T, N, S, start="earliest", block=0.1)
    records = sub.poll()
    assert [(r.shard, r.offset, r.payload, r.attempts) for r in records] == [
        (0, i, b"r%d" % i, 0) for i in range(5)]
    assert records[0].published_at.tzinfo is not None
    assert sub.positions == {0: 5}
    assert sub.poll(block=0.05) == []


def test_latest_reads_only_new_records(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    publish_n(client, 5)
    sub = client.subscribe(T, N, S, start="latest", block=0.1)
    assert sub.positions == {0: 5}
    assert sub.poll() == []
    publish_n(client, 2, start=5)
    assert [r.offset for r in sub.poll()] == [5, 6]


def test_start_at_an_offset(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    publish_n(client, 5)
    sub = client.subscribe(T, N, S, start=3, block=0.1)
    assert [r.payload for r in sub.poll()] == [b"r3", b"r4"]


def test_start_per_shard_and_shard_subset(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S, shards=3)
    for shard in range(3):
        publish_n(client, 4, shard=shard)
    sub = client.subscribe(T, N, S, start={0: 1, 2: 3}, shards=[0, 2], block=0.1)
    assert sub.positions == {0: 1, 2: 3}
    got = sub.poll()
    assert sorted((r.shard, r.offset) for r in got) == [(0, 1), (0, 2), (0, 3), (2, 3)]
    assert sub.positions == {0: 4, 2: 4}
    # a dict covering every shard without `shards`
    every = client.subscribe(T, N, S, start={0: 3, 1: 3, 2: 3}, block=0.1)
    assert sorted((r.shard, r.offset) for r in every.poll()) == [(0, 3), (1, 3), (2, 3)]


def test_earliest_on_every_shard(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S, shards=4)
    for shard in range(4):
        publish_n(client, shard + 1, shard=shard)
    sub = client.subscribe(T, N, S, block=0.1)
    got = take(sub, 10)
    assert len(got) == 10
    for shard in range(4):
        assert [r.offset for r in got if r.shard == shard] == list(range(shard + 1))


@pytest.mark.parametrize(
    ("start", "shards", "error"),
    [
        ("newest", None, felix_redis.InvalidArgument),
        (-1, None, felix_redis.InvalidArgument),
        (1.5, None, felix_redis.InvalidArgument),
        (True, None, felix_redis.InvalidArgument),
        ({0: 0}, None, felix_redis.InvalidArgument),  # no offset for shard 1
        ({0: -1, 1: 0}, None, felix_redis.InvalidArgument),
        ("earliest", [], felix_redis.InvalidArgument),
        ("earliest", [2], felix_redis.NotFound),
    ],
)
def test_bad_starts_are_refused(client: felix_redis.Client, start: Any, shards: Any, error: type) -> None:
    client.stream_create(T, N, S, shards=2)
    with pytest.raises(error):
        client.subscribe(T, N, S, start=start, shards=shards)


def test_unknown_stream(client: felix_redis.Client) -> None:
    with pytest.raises(felix_redis.NotFound):
        client.subscribe(T, N, "nothing")


# ------------------------------------------------------------------- blocking


def test_iteration_blocks_and_wakes_on_publish(client: felix_redis.Client, other: felix_redis.Client) -> None:
    client.stream_create(T, N, S, shards=2)
    sub = client.subscribe(T, N, S, start="latest", block=4)
    stamp: list[float] = []

    def publish() -> None:
        stamp.append(time.monotonic())
        other.publish(T, N, S, b"news", shard=1)

    thread = later(publish, 0.2)
    start = time.monotonic()
    record = next(iter(sub))
    got = time.monotonic()
    thread.join(5)
    assert (record.shard, record.offset, record.payload) == (1, 0, b"news")
    assert got - start >= 0.15
    assert got - stamp[0] < 0.5


def test_block_elapses(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    sub = client.subscribe(T, N, S, start="latest", block=0.3)
    start = time.monotonic()
    assert sub.poll() == []
    assert 0.25 <= time.monotonic() - start < 2.0


def test_publish_in_the_race_window_is_not_missed(
    client: felix_redis.Client, other: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.stream_create(T, N, S)
    sub = client.subscribe(T, N, S, start="latest")
    real = client._execute
    fired: list[bool] = []

    def racing(op: Any) -> Any:
        if type(op) is BlockAny and not fired:
            other.publish(T, N, S, b"racer")
            fired.append(True)
        return real(op)

    monkeypatch.setattr(client, "_execute", racing)
    start = time.monotonic()
    records = sub.poll(block=4)
    assert fired
    assert [r.payload for r in records] == [b"racer"]
    assert time.monotonic() - start < 1.0


def test_start_beyond_the_tail_waits_for_that_offset(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    publish_n(client, 2)
    sub = client.subscribe(T, N, S, start=4, block=0.2)
    assert sub.poll() == []
    publish_n(client, 3, start=2)  # offsets 2, 3, 4
    assert [r.offset for r in sub.poll()] == [4]


def test_batches_are_bounded(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    client.publish_batch(T, N, S, [b"%d" % i for i in range(25)])
    sub = client.subscribe(T, N, S, batch=10, block=0.1)
    sizes = [len(sub.poll()) for _ in range(3)]
    assert sizes == [10, 10, 5]


def test_close_ends_iteration(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    publish_n(client, 3)
    sub = client.subscribe(T, N, S, block=0.1)
    seen = []
    for record in sub:
        seen.append(record.offset)
        if record.offset == 1:
            sub.close()
    assert seen == [0, 1, 2]  # the batch in hand is finished, then the iterator stops


# ------------------------------------------------------- independent of groups


def test_subscriber_and_group_worker_on_one_stream(client: felix_redis.Client, backend: tuple[str, Any]) -> None:
    client.stream_create(T, N, S, shards=2)
    client.group_create(T, N, S, G)
    total = 120
    sub = client.subscribe(T, N, S, start="earliest", block=0.2)
    acked: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        c = felix_redis.connect(backend[0])
        try:
            group = c.group_sharded(T, N, S, G)
            deadline = time.monotonic() + 15
            while len(acked) < total and time.monotonic() < deadline:
                items = group.poll(16, wait=0.2)
                group.ack_many(items)
                acked.extend((i.shard, i.offset) for i in items)
        except BaseException as exc:
            errors.append(exc)
        finally:
            c.close()

    def producer() -> None:
        c = felix_redis.connect(backend[0])
        try:
            for i in range(total):
                c.publish(T, N, S, b"%d" % i)
        except BaseException as exc:
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=worker, daemon=True), threading.Thread(target=producer, daemon=True)]
    for t in threads:
        t.start()
    seen = take(sub, total, timeout=15)
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert len(seen) == total
    for shard in range(2):
        offsets = [r.offset for r in seen if r.shard == shard]
        assert offsets == list(range(len(offsets)))  # in order, each once, no gaps
    assert sorted(r.payload for r in seen) == sorted(b"%d" % i for i in range(total))
    assert sorted(acked) == sorted((r.shard, r.offset) for r in seen)
    for state in client.group_describe(T, N, S, G).shards:
        assert (state.lag, state.in_flight, state.owed) == (0, 0, 0)


def test_replay_while_a_group_consumes(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G, visibility_timeout_ms=30_000)
    publish_n(client, 50)
    first = client.group_poll(T, N, S, 0, G, max_records=20)
    client.group_ack_many(T, N, S, 0, G, first)
    held = client.group_poll(T, N, S, 0, G, max_records=5)
    client.group_nack(T, N, S, 0, G, held[0], delay=60)
    before = describe(client)
    keys_before = sorted(client.redis.keys("*:g:*"))

    replay = client.subscribe(T, N, S, start=10, block=0.1)
    seen = take(replay, 40)
    assert [r.offset for r in seen] == list(range(10, 50))
    assert [r.payload for r in seen] == [b"r%d" % i for i in range(10, 50)]
    assert replay.poll(block=0.05) == []

    # the group did not notice: same state, its next poll goes on where it was
    assert describe(client) == before
    assert sorted(client.redis.keys("*:g:*")) == keys_before
    assert [r.offset for r in client.group_poll(T, N, S, 0, G, max_records=1)] == [25]
    for r in held[1:]:
        client.group_extend(T, N, S, 0, G, r)  # their claims are still current


def test_two_subscribers_are_independent(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    publish_n(client, 6)
    a = client.subscribe(T, N, S, block=0.1)
    b = client.subscribe(T, N, S, start=4, block=0.1)
    assert [r.offset for r in take(a, 6)] == list(range(6))
    assert [r.offset for r in take(b, 2)] == [4, 5]
    assert a.positions == b.positions == {0: 6}


def test_idle_subscription_with_default_block(redis_client) -> None:
    """Subscription's default block is 5.0 s, redis-py 8's default socket timeout: an idle
    subscriber must get [] after its block, not a socket timeout retried until
    ConnectionFailed (as a long poll of 5 s or more in tests/test_long_poll.py)."""
    redis_client.stream_create(T, N, S)
    sub = redis_client.subscribe(T, N, S, start="latest")  # block=5.0
    start = time.monotonic()
    assert sub.poll() == []
    assert time.monotonic() - start < 7
