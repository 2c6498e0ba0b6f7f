"""Long polling (group_poll with wait) and reclaim (group_poll_as with reclaim=True).

A long poll blocks in Redis (XREAD BLOCK on the shard's log and the group's wake
stream), never in a client sleep loop; it wakes on a publish, a nack, a lapse or a
redrive, and never misses a wake-up that happens between its empty poll and its block.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import felix_redis
from felix_redis.protocol import BlockAny, Eval

T, N, S, G = "acme", "prod", "jobs", "workers"


@pytest.fixture
def other(backend: tuple[str, Any]) -> Iterator[felix_redis.Client]:
    """A second client on the same backend (another worker, another process)."""
    c = felix_redis.connect(backend[0])
    yield c
    c.close()


def setup(client: felix_redis.Client, **group: Any) -> None:
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G, **group)


def in_thread(fn: Callable[[], Any], after: float) -> threading.Thread:
    """Runs ``fn`` in a thread after ``after`` seconds; re-raises its error on join."""
    errors: list[BaseException] = []

    def run() -> None:
        time.sleep(after)
        try:
            fn()
        except BaseException as exc:  # surfaced by join()
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    original_join = thread.join

    def join(timeout: float | None = 10) -> None:
        original_join(timeout)
        assert not thread.is_alive(), "helper thread hung"
        if errors:
            raise errors[0]

    thread.join = join  # type: ignore[method-assign]
    thread.start()
    return thread


def count_ops(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch,
              times: list[float] | None = None) -> list[Any]:
    """Records every op the client executes (and in ``times``, when each started)."""
    ops: list[Any] = []
    real = client._execute

    def spy(op: Any) -> Any:
        ops.append(op)
        if times is not None:
            times.append(time.monotonic())
        return real(op)

    monkeypatch.setattr(client, "_execute", spy)
    return ops


def before_first_block(
    client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch, action: Callable[[], Any]
) -> list[float]:
    """Runs ``action`` right before the client's first BlockAny: the race window between
    an empty poll and its block. Returns [time of the action] once it ran."""
    real = client._execute
    fired: list[float] = []

    def racing(op: Any) -> Any:
        if type(op) is BlockAny and not fired:
            action()
            fired.append(time.monotonic())
        return real(op)

    monkeypatch.setattr(client, "_execute", racing)
    return fired


# --------------------------------------------------------------------------- basics


def test_no_wait_returns_at_once(client: felix_redis.Client) -> None:
    setup(client)
    for wait in (None, 0, 0.0):
        start = time.monotonic()
        assert client.group_poll(T, N, S, 0, G, wait=wait) == []
        assert time.monotonic() - start < 0.5


def test_wait_elapses_returns_empty_after_wait(client: felix_redis.Client) -> None:
    setup(client)
    start = time.monotonic()
    assert client.group_poll(T, N, S, 0, G, wait=0.4) == []
    elapsed = time.monotonic() - start
    assert 0.35 <= elapsed < 2.0


def test_wait_returns_at_once_when_records_are_due(client: felix_redis.Client) -> None:
    setup(client)
    client.publish(T, N, S, b"a")
    start = time.monotonic()
    records = client.group_poll(T, N, S, 0, G, wait=4)
    assert [r.payload for r in records] == [b"a"]
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("wait", [-1, -0.001, float("nan"), "1", True])
def test_bad_wait_is_refused(client: felix_redis.Client, wait: Any) -> None:
    setup(client)
    with pytest.raises(felix_redis.InvalidArgument):
        client.group_poll(T, N, S, 0, G, wait=wait)


def test_publish_wakes_long_poller(client: felix_redis.Client, other: felix_redis.Client) -> None:
    setup(client)
    published: list[float] = []

    def publish() -> None:
        published.append(time.monotonic())
        other.publish(T, N, S, b"hello")

    thread = in_thread(publish, 0.2)
    records = client.group_poll(T, N, S, 0, G, wait=4)
    got = time.monotonic()
    thread.join()
    assert [(r.offset, r.attempts, r.payload) for r in records] == [(0, 1, b"hello")]
    assert got - published[0] < 1.0


def test_publish_to_delivery_within_50ms(redis_client: felix_redis.Client, redis_url: str) -> None:
    """The issue's bound: a long-polling worker sees a new record within 50 ms of its
    publish (median of several trials; publisher in another thread, own Client)."""
    setup(redis_client)
    publisher = felix_redis.connect(redis_url)
    publisher.publish(T, N, S, b"warm-up")  # scripts loaded, settings cached, connections open
    assert len(redis_client.group_poll(T, N, S, 0, G)) == 1
    latencies, round_trips = [], []
    try:
        for trial in range(7):
            started = time.monotonic()
            redis_client.group_describe(T, N, S, G)  # one round trip, on this machine, now
            round_trips.append(time.monotonic() - started)
            published: list[float] = []

            def publish(payload: bytes = b"trial-%d" % trial, stamps: list[float] = published) -> None:
                stamps.append(time.monotonic())
                publisher.publish(T, N, S, payload)

            thread = in_thread(publish, 0.1)
            records = redis_client.group_poll(T, N, S, 0, G, wait=3)
            got = time.monotonic()
            thread.join()
            assert [r.payload for r in records] == [b"trial-%d" % trial]
            latencies.append(got - published[0])
            redis_client.group_ack(T, N, S, 0, G, records[0])
    finally:
        publisher.close()
    # a wake-up costs about three round trips (the publish, the wake of the block, the
    # poll) and a thread switch: within 50 ms, or 8 round trips when a loaded machine
    # makes one slower; a poll loop (sleeping between polls) would take far longer
    bound = max(0.050, 8 * statistics.median(round_trips))
    assert statistics.median(latencies) < bound, (latencies, round_trips)
    assert max(latencies) < 1.0, latencies


# ------------------------------------------------------------- the race window


def test_publish_between_empty_poll_and_block_is_not_missed(
    client: felix_redis.Client, other: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup(client)
    fired = before_first_block(client, monkeypatch, lambda: other.publish(T, N, S, b"racer"))
    start = time.monotonic()
    records = client.group_poll(T, N, S, 0, G, wait=4)
    elapsed = time.monotonic() - start
    assert fired, "the poll never blocked"
    assert [r.payload for r in records] == [b"racer"]
    assert elapsed < 1.0, f"woke after {elapsed:.2f}s: the publish in the window was missed"


def test_nack_between_empty_poll_and_block_is_not_missed(
    client: felix_redis.Client, other: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup(client)
    client.publish(T, N, S, b"job")
    (held,) = other.group_poll(T, N, S, 0, G)
    fired = before_first_block(client, monkeypatch, lambda: other.group_nack(T, N, S, 0, G, held))
    start = time.monotonic()
    records = client.group_poll(T, N, S, 0, G, wait=4)
    assert fired
    assert [(r.offset, r.attempts) for r in records] == [(0, 2)]
    assert time.monotonic() - start < 1.0


def test_redrive_between_empty_poll_and_block_is_not_missed(
    client: felix_redis.Client, other: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup(client)
    client.publish(T, N, S, b"job")
    (held,) = other.group_poll(T, N, S, 0, G)
    other.group_dead_letter(T, N, S, 0, G, held, reason="poison")
    fired = before_first_block(client, monkeypatch, lambda: other.group_redrive(T, N, S, 0, G))
    start = time.monotonic()
    records = client.group_poll(T, N, S, 0, G, wait=4)
    assert fired
    assert [(r.offset, r.attempts) for r in records] == [(0, 1)]  # attempts start over
    assert time.monotonic() - start < 1.0


# ------------------------------------------------------------ no busy polling


def test_idle_long_poll_makes_constant_number_of_calls(
    client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup(client)
    client.group_poll(T, N, S, 0, G)  # settings cached
    times: list[float] = []
    ops = count_ops(client, monkeypatch, times)
    start = time.monotonic()
    assert client.group_poll(T, N, S, 0, G, wait=2) == []
    assert time.monotonic() - start >= 1.9
    polls = [op for op in ops if type(op) is Eval]
    blocks = [op for op in ops if type(op) is BlockAny]
    assert 1 <= len(blocks) <= 2, ops
    assert len(polls) <= 3, [op.script for op in polls]
    # the first block asks for all the wait that was left when it started (a slow first
    # poll on a loaded machine leaves less, never a short block in a loop)
    blocked_at = times[ops.index(blocks[0])]
    assert blocks[0].block_ms >= 2000 - (blocked_at - start) * 1000 - 20, (blocks[0].block_ms, blocked_at - start)


def test_idle_long_poll_commandstats(redis_client: felix_redis.Client, raw: redis.Redis) -> None:
    """Counted by the server: a loop of idle long polls is one poll and one block per
    wait. The poll that runs behind each block (in the same write, so that a wake-up
    costs one round trip) is the next call's first poll. (The loop's second wait makes a
    poll and a block more, once: the first poll behind a block took the watch for its own
    wait only, and is renewed before it lapses.)"""
    setup(redis_client)
    redis_client.group_poll(T, N, S, 0, G)  # scripts loaded, settings cached
    for _ in range(2):
        assert redis_client.group_poll(T, N, S, 0, G, wait=1) == []
    raw.config_resetstat()
    start = time.monotonic()
    for _ in range(3):
        assert redis_client.group_poll(T, N, S, 0, G, wait=1) == []
    assert time.monotonic() - start >= 2.9
    stats = raw.info("commandstats")
    scripts = sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("fcall", "evalsha", "eval"))
    xreads = stats.get("cmdstat_xread", {}).get("calls", 0)
    assert (scripts, xreads) == (3, 3), {k: v for k, v in stats.items() if k != "cmdstat_config"}


@pytest.mark.parametrize("reclaim", [False, True])
def test_a_long_poll_that_cannot_start_from_the_last_one_sends_no_poll_behind_its_block(
    redis_client: felix_redis.Client, raw: redis.Redis, reclaim: bool
) -> None:
    """A waiter whose next long poll would not start from the poll behind its block (one
    that reclaims, as group_poll_as does by default, or a user without the bell) sends no
    poll there: its idle waits stay one poll and one block each."""
    setup(redis_client)
    if not reclaim:
        redis_client.core.bells = False  # as for a user whose ACL lacks BZPOPMIN
    redis_client.group_poll(T, N, S, 0, G)  # scripts loaded, settings cached
    raw.config_resetstat()
    for _ in range(3):
        assert redis_client.group_poll_as(T, N, S, 0, G, consumer="c1", wait=0.5, reclaim=reclaim) == []
    stats = raw.info("commandstats")
    scripts = sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("fcall", "evalsha", "eval"))
    assert (scripts, stats.get("cmdstat_xread", {}).get("calls", 0)) == (3, 3), stats


def test_records_the_poll_behind_a_refused_block_took_reach_the_caller(
    redis_client: felix_redis.Client, raw: redis.Redis, redis_url: str
) -> None:
    """A user refused XREAD (an ACL made without it): its block fails, but the poll
    behind it ran. What that poll handed out reaches the caller (not left to its lease);
    the refusal is raised by the next block."""
    from felix_redis import acl

    setup(redis_client, visibility_timeout_ms=30_000)
    acl.grant(raw, acl.setuser_args("noxread", [*acl.rules("group.consume", T, N, S, G), "-xread"], password="pw"))
    user = felix_redis.connect(redis_url.replace("redis://", "redis://noxread:pw@"))
    try:
        user.group_poll(T, N, S, 0, G)  # scripts loaded, settings cached
        real = user._execute

        def publish_first(op: Any) -> Any:
            if type(op) is BlockAny and op.bell is None:
                redis_client.publish(T, N, S, b"job")  # lands between the empty poll and the block
            return real(op)

        user._execute = publish_first  # type: ignore[method-assign]
        records = user.group_poll(T, N, S, 0, G, wait=2)
        assert [r.payload for r in records] == [b"job"]
        user._execute = real  # type: ignore[method-assign]
        with pytest.raises(felix_redis.PermissionDenied):
            user.group_poll(T, N, S, 0, G, wait=0.5, ack=records)
    finally:
        user.close()
    assert redis_client.group_describe(T, N, S, G).pending == 0


def test_a_wake_up_and_the_poll_that_takes_the_record_are_one_round_trip(
    redis_client: felix_redis.Client, redis_url: str, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long poller blocked on the log gets a record published meanwhile from the poll
    that went behind its block in the same write: after the block, no call of its own
    (the driver answers the block with that poll's reply)."""
    setup(redis_client)
    redis_client.group_poll(T, N, S, 0, G)  # scripts loaded, settings cached
    answers: list[Any] = []
    real = redis_client._execute

    def spy(op: Any) -> Any:
        answer = real(op)
        answers.append((op, answer))
        return answer

    monkeypatch.setattr(redis_client, "_execute", spy)
    publisher = felix_redis.connect(redis_url)
    thread = in_thread(lambda: publisher.publish(T, N, S, b"job"), 0.3)
    try:
        records = redis_client.group_poll(T, N, S, 0, G, wait=5)
        thread.join()
    finally:
        publisher.close()
    assert [r.payload for r in records] == [b"job"]
    kinds = [type(op).__name__ for op, _ in answers]
    assert kinds == ["Eval", "BlockAny"], kinds
    block, answer = answers[1]
    assert block.then is not None and block.then.script == "group_poll"
    assert type(answer).__name__ == "Took" and answer.moved, answer
    # and the record is leased to this poll as any other: its ack settles it
    assert redis_client.group_ack(T, N, S, 0, G, records[0]) is True
    assert redis_client.group_describe(T, N, S, G).pending == 0


def test_a_poll_behind_the_block_that_finds_no_library_is_sent_again(
    redis_client: felix_redis.Client, redis_url: str, raw: redis.Redis
) -> None:
    """The server lost the function library while the poller was blocked (FUNCTION
    FLUSH, a failover to a server without it) and a record lands (written here as a
    publish writes it, with no script, so nothing loads the library first): the poll
    behind the block fails, the plan sends it again as any call (the library loaded),
    and the record is still handed out at once."""
    setup(redis_client)
    redis_client.publish(T, N, S, b"first")
    (first,) = redis_client.group_poll(T, N, S, 0, G)
    log = f"felix:{{{T}/{N}/{S}/0}}:log"
    ((entry_id, fields),) = raw.xrange(log)
    assert entry_id.startswith(b"0-")

    def flush_and_append() -> None:
        raw.function_flush()
        pipe = raw.pipeline(transaction=True)
        pipe.hset(f"felix:{{{T}/{N}/{S}/0}}:meta", "tail", 2)
        pipe.xadd(log, {k: (b"second" if v == b"first" else v) for k, v in fields.items()}, id="1-1")
        pipe.execute()

    thread = in_thread(flush_and_append, 0.3)
    start = time.monotonic()
    records = redis_client.group_poll(T, N, S, 0, G, wait=5, ack=[first])
    thread.join()
    assert [(r.offset, r.payload) for r in records] == [(1, b"second")]
    assert time.monotonic() - start < 2.0
    assert raw.function_list()  # loaded again by the poll


def test_idle_long_poll_with_lease_in_flight_wakes_only_at_its_lapse(
    client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease held elsewhere bounds the block by its expiry, no shorter."""
    setup(client, visibility_timeout_ms=30_000)
    client.publish(T, N, S, b"held")
    assert len(client.group_poll(T, N, S, 0, G)) == 1
    ops = count_ops(client, monkeypatch)
    assert client.group_poll(T, N, S, 0, G, wait=1) == []
    assert sum(type(op) is BlockAny for op in ops) <= 2, ops


# -------------------------------------------------------- what wakes a poller


def test_nack_by_another_client_wakes_long_poller(
    client: felix_redis.Client, other: felix_redis.Client
) -> None:
    setup(client)
    client.publish(T, N, S, b"job")
    (held,) = other.group_poll(T, N, S, 0, G)
    thread = in_thread(lambda: other.group_nack(T, N, S, 0, G, held, delay=0), 0.2)
    start = time.monotonic()
    records = client.group_poll(T, N, S, 0, G, wait=4)
    elapsed = time.monotonic() - start
    thread.join()
    assert [(r.offset, r.attempts, r.payload) for r in records] == [(0, 2, b"job")]
    assert 0.15 <= elapsed < 1.5


def test_delayed_nack_is_delivered_when_due(client: felix_redis.Client, other: felix_redis.Client) -> None:
    setup(client)
    client.publish(T, N, S, b"job")
    (held,) = other.group_poll(T, N, S, 0, G)
    start = time.monotonic()
    other.group_nack(T, N, S, 0, G, held, delay=0.3)
    records = client.group_poll(T, N, S, 0, G, wait=4)
    elapsed = time.monotonic() - start
    assert [(r.offset, r.attempts) for r in records] == [(0, 2)]
    assert 0.25 <= elapsed < 1.5


def test_delayed_nack_made_while_blocking_is_delivered_when_due(
    client: felix_redis.Client, other: felix_redis.Client
) -> None:
    """The nack wakes the poller, which then re-blocks until the delay is over."""
    setup(client)
    client.publish(T, N, S, b"job")
    (held,) = other.group_poll(T, N, S, 0, G)
    thread = in_thread(lambda: other.group_nack(T, N, S, 0, G, held, delay=0.3), 0.1)
    start = time.monotonic()
    records = client.group_poll(T, N, S, 0, G, wait=4)
    elapsed = time.monotonic() - start
    thread.join()
    assert [(r.offset, r.attempts) for r in records] == [(0, 2)]
    assert 0.35 <= elapsed < 1.5


def test_lapse_wakes_long_poller_at_lapse_time(client: felix_redis.Client, other: felix_redis.Client) -> None:
    setup(client, visibility_timeout_ms=300)
    client.publish(T, N, S, b"job")
    (held,) = other.group_poll(T, N, S, 0, G)
    start = time.monotonic()
    records = client.group_poll(T, N, S, 0, G, wait=4)
    elapsed = time.monotonic() - start
    assert [(r.offset, r.attempts) for r in records] == [(0, 2)]
    assert 0.2 <= elapsed < 1.5, f"delivered after {elapsed:.2f}s, the lease was 0.3s"
    with pytest.raises(felix_redis.StaleClaim):
        other.group_nack(T, N, S, 0, G, held)  # the lapsed claim is stale


def test_extend_shorter_lease_wakes_long_poller(client: felix_redis.Client, other: felix_redis.Client) -> None:
    """A poller blocked until a long lease's expiry re-plans when the lease is shortened."""
    setup(client, visibility_timeout_ms=30_000)
    client.publish(T, N, S, b"job")
    (held,) = other.group_poll(T, N, S, 0, G)
    thread = in_thread(lambda: other.group_extend(T, N, S, 0, G, held, by=0.2), 0.1)
    start = time.monotonic()
    records = client.group_poll(T, N, S, 0, G, wait=4)
    elapsed = time.monotonic() - start
    thread.join()
    assert [(r.offset, r.attempts) for r in records] == [(0, 2)]
    assert 0.2 <= elapsed < 1.5


def test_redrive_wakes_long_poller(client: felix_redis.Client, other: felix_redis.Client) -> None:
    setup(client, max_attempts=1)
    client.publish(T, N, S, b"job")
    (held,) = other.group_poll(T, N, S, 0, G)
    assert other.group_nack(T, N, S, 0, G, held) is True  # max_attempts 1: a dead letter
    assert [d.offset for d in other.group_dead_letters(T, N, S, 0, G)] == [0]
    thread = in_thread(lambda: other.group_redrive(T, N, S, 0, G, [0]), 0.2)
    start = time.monotonic()
    records = client.group_poll(T, N, S, 0, G, wait=4)
    elapsed = time.monotonic() - start
    thread.join()
    assert [(r.offset, r.attempts) for r in records] == [(0, 1)]
    assert 0.15 <= elapsed < 1.5


def test_many_long_pollers_share_the_work(client: felix_redis.Client, backend: tuple[str, Any]) -> None:
    """Four blocked workers, eight records: each record goes to exactly one of them."""
    setup(client)
    got: list[int] = []
    lock = threading.Lock()
    deadline = time.monotonic() + 5

    def worker() -> None:
        c = felix_redis.connect(backend[0])
        try:
            while time.monotonic() < deadline:
                with lock:
                    if len(got) >= 8:
                        return
                for r in c.group_poll(T, N, S, 0, G, max_records=1, wait=0.3):
                    c.group_ack(T, N, S, 0, G, r)
                    with lock:
                        got.append(r.offset)
        finally:
            c.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    for i in range(8):
        client.publish(T, N, S, b"%d" % i)
    for t in threads:
        t.join(10)
    assert sorted(got) == list(range(8))
    shard = client.group_describe(T, N, S, G).shards[0]
    assert (shard.position, shard.lag, shard.in_flight) == (8, 0, 0)


# ---------------------------------------------------------------------- reclaim


def test_reclaim_returns_own_records_at_once_never_someone_elses(client: felix_redis.Client) -> None:
    setup(client, visibility_timeout_ms=30_000)
    for i in range(5):
        client.publish(T, N, S, b"job-%d" % i)
    mine = client.group_poll_as(T, N, S, 0, G, consumer="w-7", max_records=3)
    theirs = client.group_poll_as(T, N, S, 0, G, consumer="w-8", max_records=2)
    assert [r.offset for r in mine] == [0, 1, 2]
    assert [r.offset for r in theirs] == [3, 4]

    # w-7 restarts under the same name: its in-flight records come back now, attempts + 1
    start = time.monotonic()
    back = client.group_poll_as(T, N, S, 0, G, consumer="w-7", reclaim=True)
    assert time.monotonic() - start < 1.0
    assert sorted((r.offset, r.attempts, r.payload) for r in back) == [
        (0, 2, b"job-0"), (1, 2, b"job-1"), (2, 2, b"job-2")]

    # w-8's records stay leased to w-8: its claims are still current
    assert client.group_poll_as(T, N, S, 0, G, consumer="w-8", reclaim=False) == []
    assert client.group_poll(T, N, S, 0, G) == []
    for r in theirs:
        client.group_extend(T, N, S, 0, G, r)
    # w-7's old claims are stale; the reclaimed ones are current
    with pytest.raises(felix_redis.StaleClaim):
        client.group_nack(T, N, S, 0, G, mine[0])
    for r in back:
        assert client.group_ack(T, N, S, 0, G, r) is True
    for r in theirs:
        assert client.group_ack(T, N, S, 0, G, r) is True
    shard = client.group_describe(T, N, S, G).shards[0]
    assert (shard.position, shard.in_flight, shard.owed) == (5, 0, 0)


def test_reclaim_false_does_not_take_back(client: felix_redis.Client) -> None:
    setup(client, visibility_timeout_ms=30_000)
    client.publish(T, N, S, b"a")
    (held,) = client.group_poll_as(T, N, S, 0, G, consumer="w-7")
    assert client.group_poll_as(T, N, S, 0, G, consumer="w-7", reclaim=False) == []
    client.group_ack(T, N, S, 0, G, held)


def test_reclaim_by_another_name_takes_nothing(client: felix_redis.Client) -> None:
    setup(client, visibility_timeout_ms=30_000)
    client.publish(T, N, S, b"a")
    client.group_poll_as(T, N, S, 0, G, consumer="w-7")
    assert client.group_poll_as(T, N, S, 0, G, consumer="w-70", reclaim=True) == []
    assert client.group_poll_as(T, N, S, 0, G, consumer="w", reclaim=True) == []
    assert [r.attempts for r in client.group_poll_as(T, N, S, 0, G, consumer="w-7", reclaim=True)] == [2]


def test_reclaim_forgets_acked_and_nacked_records(client: felix_redis.Client) -> None:
    setup(client, visibility_timeout_ms=30_000)
    for i in range(3):
        client.publish(T, N, S, b"%d" % i)
    a, b, c = client.group_poll_as(T, N, S, 0, G, consumer="w-7")
    client.group_ack(T, N, S, 0, G, a)
    client.group_nack(T, N, S, 0, G, b, delay=60)
    back = client.group_poll_as(T, N, S, 0, G, consumer="w-7", reclaim=True)
    assert [(r.offset, r.attempts) for r in back] == [(c.offset, 2)]
    shard = client.group_describe(T, N, S, G).shards[0]
    assert (shard.in_flight, shard.owed) == (1, 1)


def test_reclaim_at_max_attempts_makes_a_dead_letter(client: felix_redis.Client) -> None:
    setup(client, visibility_timeout_ms=30_000, max_attempts=2)
    client.publish(T, N, S, b"a")
    client.group_poll_as(T, N, S, 0, G, consumer="w-7")
    (second,) = client.group_poll_as(T, N, S, 0, G, consumer="w-7", reclaim=True)
    assert second.attempts == 2
    assert client.group_poll_as(T, N, S, 0, G, consumer="w-7", reclaim=True) == []
    (dead,) = client.group_dead_letters(T, N, S, 0, G)
    assert (dead.offset, dead.attempts) == (0, 2)
    assert client.group_describe(T, N, S, G).shards[0].position == 1


def test_reclaim_then_long_poll_for_new_records(client: felix_redis.Client, other: felix_redis.Client) -> None:
    """Reclaim happens once, up front; an empty reclaim then long-polls like any poll."""
    setup(client, visibility_timeout_ms=30_000)
    thread = in_thread(lambda: other.publish(T, N, S, b"new"), 0.2)
    records = client.group_poll_as(T, N, S, 0, G, consumer="w-7", reclaim=True, wait=4)
    thread.join()
    assert [(r.payload, r.attempts) for r in records] == [(b"new", 1)]
    # a reclaim with records to take back returns them without waiting
    start = time.monotonic()
    back = client.group_poll_as(T, N, S, 0, G, consumer="w-7", reclaim=True, wait=4)
    assert [(r.payload, r.attempts) for r in back] == [(b"new", 2)]
    assert time.monotonic() - start < 1.0


def test_consumer_name_is_checked(client: felix_redis.Client) -> None:
    setup(client)
    for bad in ("", "w 7", "w|7", "w:7", "{w}"):
        with pytest.raises(felix_redis.InvalidArgument):
            client.group_poll_as(T, N, S, 0, G, consumer=bad)


# Waits longer than the socket timeout (redis-py 8's default is 5 s).

def test_idle_long_poll_longer_than_5_seconds(redis_client) -> None:
    """redis-py 8 defaults socket_timeout to 5 s; an XREAD BLOCK of ~5 s or
    more times out on the socket, the retry layer repeats the same BlockAny until retry_for
    is spent, and the poll raises ConnectionFailed after ~40 s instead of [] after `wait`."""
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, G)
    start = time.monotonic()
    assert redis_client.group_poll(T, N, S, 0, G, wait=6) == []
    assert time.monotonic() - start < 8


def test_async_idle_long_poll_longer_than_5_seconds(redis_client, redis_url) -> None:
    """The same, asyncio."""
    import asyncio

    import felix_redis.asyncio as fa

    async def main() -> None:
        c = fa.connect(redis_url)
        await c.stream_create(T, N, S)
        await c.group_create(T, N, S, G)
        start = time.monotonic()
        try:
            assert await c.group_poll(T, N, S, 0, G, wait=6) == []
        finally:
            await c.close()
        assert time.monotonic() - start < 8

    asyncio.run(main())


def test_long_poll_longer_than_socket_timeout(redis_url, raw) -> None:
    """wait longer than the URL's socket_timeout fails too."""
    sep = "&" if "?" in redis_url else "?"
    client = felix_redis.connect(f"{redis_url}{sep}socket_timeout=0.5")
    try:
        client.stream_create(T, N, S)
        client.group_create(T, N, S, G)
        start = time.monotonic()
        assert client.group_poll(T, N, S, 0, G, wait=1.5) == []
        assert time.monotonic() - start < 3
    finally:
        client.close()


def test_reclaim_wakes_other_long_pollers_for_what_it_left_owed(client, backend) -> None:
    """Reclaim makes the consumer's in-flight records owed now, but does not
    wake the group's long-pollers; what the reclaiming poll did not take waits until
    another poller's block ends (up to its whole wait)."""
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G, visibility_timeout_ms=30_000)
    for i in range(3):
        client.publish(T, N, S, b"%d" % i)
    assert len(client.group_poll_as(T, N, S, 0, G, consumer="w-7", max_records=3)) == 3
    other = felix_redis.connect(backend[0])
    got: list = []

    def long_poll() -> None:
        got.extend(other.group_poll(T, N, S, 0, G, max_records=10, wait=4))
        got.append(time.monotonic())

    thread = threading.Thread(target=long_poll, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)
        start = time.monotonic()
        (back,) = client.group_poll_as(T, N, S, 0, G, consumer="w-7", reclaim=True, max_records=1)
        thread.join(10)
        assert not thread.is_alive(), "the long poll never returned"
    finally:
        other.close()
    records, woke = got[:-1], got[-1]
    assert sorted(r.offset for r in records) == sorted({0, 1, 2} - {back.offset})
    assert woke - start < 1.0, f"the other poller woke after {woke - start:.2f}s"
