"""Fleets: a record wakes one long-poller, not all of them (issue 23).

Of the long-pollers of a group on a shard one watches (blocks on the log and the wake
stream), the others wait on the group's bell (BZPOPMIN on a zset); a watcher that takes
records rings the bell when nobody watches any more (lua/group_poll.lua). These tests
count the server's script calls per record with many idle pollers, check that a burst
still spreads over the fleet, that a watcher that stops or dies is replaced, and that
nothing is lost on the way.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import felix_redis
import felix_redis.asyncio as faio
from felix_redis import acl
from felix_redis.constants import WATCH_MARGIN_MS

T, N, S, G = "acme", "prod", "jobs", "workers"


def script_calls(raw: redis.Redis) -> int:
    stats = raw.info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("fcall", "evalsha", "eval"))


class Fleet:
    """``k`` threads, each with its own client (a worker process each), long-polling the
    group for one record at a time with ``wait``; ``handle(record)`` runs per record, and
    its ack rides on the thread's next poll."""

    def __init__(self, url: str, k: int, wait: float, handle: Callable[[felix_redis.Record], Any] = lambda r: None,
                 sharded: bool = False):
        self.url, self.wait, self.handle, self.sharded = url, wait, handle, sharded
        self.got: list[tuple[int, float, int]] = []  # (waiter, when, offset)
        self.shards_got: list[tuple[int, int]] = []  # (shard, offset), in the order received
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.clients = [felix_redis.connect(url) for _ in range(k)]
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(k)]
        for t in self.threads:
            t.start()

    def run(self, i: int) -> None:
        c = self.clients[i]
        done: list[felix_redis.Record] = []
        try:
            if self.sharded:  # the README's loop: its acks are queued, to ride on the next poll
                group = c.group_sharded(T, N, S, G)
                while not self.stop.is_set():
                    for r in group.poll(1, wait=self.wait):
                        with self.lock:
                            self.got.append((i, time.monotonic(), r.offset))
                            self.shards_got.append((r.shard, r.offset))
                        self.handle(r)
                        group.ack(r, wait=False)
                group.close()
                return
            while not self.stop.is_set():
                # the acks ride on the next poll, as a Worker's do
                records = c.group_poll(T, N, S, 0, G, max_records=1, wait=self.wait, ack=done)
                for r in records:
                    with self.lock:
                        self.got.append((i, time.monotonic(), r.offset))
                    self.handle(r)
                done = records
        except BaseException as exc:  # reported by close()
            self.errors.append(exc)

    def offsets(self) -> list[int]:
        with self.lock:
            return sorted(o for _, _, o in self.got)

    def wait_for(self, n: int, timeout: float) -> None:
        end = time.monotonic() + timeout
        while len(self.offsets()) < n and time.monotonic() < end:
            time.sleep(0.01)
        assert len(self.offsets()) >= n, (self.offsets(), self.errors)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(self.wait + 5)
            assert not t.is_alive()
        for c in self.clients:
            c.close()
        assert not self.errors, self.errors


@pytest.fixture
def fleet(redis_client: felix_redis.Client, redis_url: str) -> Iterator[Callable[..., Fleet]]:
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, G, visibility_timeout_ms=60_000)
    made: list[Fleet] = []

    def make(k: int, wait: float, handle: Callable[[felix_redis.Record], Any] = lambda r: None,
             sharded: bool = False) -> Fleet:
        made.append(Fleet(redis_url, k, wait, handle, sharded))
        return made[-1]

    yield make
    for f in made:
        f.close()


def settle(raw: redis.Redis, seconds: float) -> None:
    """Waits until the fleet is idle: no script call for ``seconds``."""
    last = script_calls(raw)
    for _ in range(40):
        time.sleep(seconds)
        now = script_calls(raw)
        if now == last:
            return
        last = now
    raise AssertionError("the fleet never went idle")


@pytest.mark.parametrize(("k", "sharded"), [(8, False), (40, False), (8, True), (40, True)])
def test_a_record_wakes_one_of_many_idle_pollers(
        redis_client: felix_redis.Client, raw: redis.Redis, fleet: Callable[..., Fleet], k: int, sharded: bool) -> None:
    """Counted by the server: with k idle pollers (group_poll, or each its own sharded
    group of the 1-shard stream, the README's loop), each record published costs 2
    script calls besides its publish (the watcher's poll that takes it, handing the watch
    to the follower that pops its ring; the taker's next poll, with the ack), whatever k
    is; every record is handed out once."""
    f = fleet(k, wait=6.0, sharded=sharded)
    settle(raw, 0.3)
    before = script_calls(raw)
    for i in range(10):
        redis_client.publish(T, N, S, b"job%d" % i)
        time.sleep(0.1)
    f.wait_for(10, timeout=10)
    settle(raw, 0.3)
    calls = script_calls(raw) - before - 10  # the publishes' own
    assert f.offsets() == list(range(10))
    assert calls <= 2 * 10 + 2, calls  # (2 in slack: a wait that ends inside the window on a slow machine)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_burst_spreads_over_the_fleet(
        redis_client: felix_redis.Client, raw: redis.Redis, fleet: Callable[..., Fleet], sharded: bool) -> None:
    """20 records at once to 10 idle pollers that take 0.5 s each: the bell passes the
    burst along, so the pollers work on it side by side (a burst woken by no one would
    take 20 x 0.5 s on the first taker), and none is handed out twice."""
    f = fleet(10, wait=6.0, handle=lambda r: time.sleep(0.5), sharded=sharded)
    settle(raw, 0.3)
    start = time.monotonic()
    redis_client.publish_batch(T, N, S, [b"b%d" % i for i in range(20)])
    f.wait_for(20, timeout=15)
    assert f.offsets() == list(range(20))
    takers = {w for w, _, _ in f.got}
    assert len(takers) >= 6, takers
    assert max(t for _, t, _ in f.got) - start < 3.0, sorted(t - start for _, t, _ in f.got)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_busy_watcher_hands_the_watch_on(
        redis_client: felix_redis.Client, raw: redis.Redis, fleet: Callable[..., Fleet], sharded: bool) -> None:
    """Two pollers with a long wait: the one that takes the first record stays busy for
    3 s; the second record, published 0.3 s later, goes to the other one at once (the
    taker rang the bell, so the other watches now)."""
    f = fleet(2, wait=8.0, handle=lambda r: time.sleep(3.0) if r.offset == 0 else None, sharded=sharded)
    settle(raw, 0.3)
    redis_client.publish(T, N, S, b"slow")
    f.wait_for(1, timeout=5)
    time.sleep(0.3)
    published = time.monotonic()
    redis_client.publish(T, N, S, b"quick")
    f.wait_for(2, timeout=5)
    (taker_of_0, _, _), (taker_of_1, at, _) = sorted(f.got, key=lambda g: g[2])
    assert taker_of_0 != taker_of_1
    assert at - published < 1.0, at - published


@pytest.mark.parametrize("sharded", [False, True])
def test_a_lone_poller_keeps_its_watch(redis_client: felix_redis.Client, sharded: bool) -> None:
    """A poller alone whose wait ran out polls again within its watch: it keeps the watch
    (it does not wait on the bell for its own watch to lapse), so a record published
    then reaches it at once."""
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, G)
    group = redis_client.group_sharded(T, N, S, G) if sharded else None

    def poll(wait: float) -> list[felix_redis.Record]:
        if group is not None:
            return group.poll(1, wait=wait)
        return redis_client.group_poll(T, N, S, 0, G, wait=wait)

    assert poll(1.5) == []  # the watch, until 1.5 s + WATCH_MARGIN_MS from its call
    threading.Timer(0.2, lambda: redis_client.publish(T, N, S, b"now")).start()
    start = time.monotonic()
    assert [r.payload for r in poll(3.0)] == [b"now"]
    assert time.monotonic() - start < 0.2 + 0.3


@pytest.mark.parametrize("sharded", [False, True])
def test_a_lone_taker_watches_again_without_popping_its_own_ring(
        redis_client: felix_redis.Client, raw: redis.Redis, sharded: bool) -> None:
    """A poller alone takes a record: its poll gives the watch up and rings the bell (it
    cannot know nobody follows). Its next poll hands out nothing and finds the ring still
    on the bell, unpopped: it watches at once (clearing the bell) rather than follow and
    pop its own ring, a round trip more before each next record. The next record reaches
    it at once, with one XREAD and no BZPOPMIN."""
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, G)
    group = redis_client.group_sharded(T, N, S, G) if sharded else None
    bell = f"felix:{{{T}/{N}/{S}/0}}:g:{G}:bell"

    def poll(wait: float, ack: list[Any]) -> list[Any]:
        if group is not None:
            return group.poll(1, wait=wait, ack=ack)
        return redis_client.group_poll(T, N, S, 0, G, wait=wait, ack=ack)

    redis_client.publish(T, N, S, b"first")
    first = poll(2.0, [])
    assert [r.payload for r in first] == [b"first"]
    assert raw.zcard(bell) == 1  # the ring: nobody watches now
    raw.config_resetstat()
    threading.Timer(0.3, lambda: redis_client.publish(T, N, S, b"second")).start()
    second = poll(2.0, first)  # nothing yet: it watches, and wakes on the publish
    assert [r.payload for r in second] == [b"second"]
    stats = raw.info("commandstats")
    assert "cmdstat_bzpopmin" not in stats, stats.get("cmdstat_bzpopmin")
    assert stats["cmdstat_xread"]["calls"] == 1
    if group is not None:
        group.ack_many(second)
        group.close()
    else:
        redis_client.group_ack_many(T, N, S, 0, G, second)
    assert redis_client.group_describe(T, N, S, G).pending == 0


def test_the_watch_after_a_wait_ran_out_lasts_one_more_wait_only_in_an_idle_loop(
        redis_client: felix_redis.Client, raw: redis.Redis) -> None:
    """The poll behind a watcher's block that lasted the rest of its wait takes the watch
    for the margin after that wait, as a poll after the block did; in a loop of idle long
    polls (the next one starts from that poll's reply) for one more wait and the margin,
    so the loop keeps its watch without a poll of its own per wait. A waiter that polls
    one long poll on a group, then others elsewhere, does not hold the group's watch
    through them."""
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, G)
    lead = f"felix:{{{T}/{N}/{S}/0}}:g:{G}"

    def watch_left() -> int:
        seconds, micros = raw.time()
        return int(raw.hget(lead, "lead").split()[1]) - (seconds * 1000 + micros // 1000)

    assert redis_client.group_poll(T, N, S, 0, G, wait=1.0) == []
    # (+1: the poll took the watch for at least 1 ms beyond the margin, and the read may
    # fall in the same ms)
    assert WATCH_MARGIN_MS - 300 <= watch_left() <= WATCH_MARGIN_MS + 1, watch_left()
    assert redis_client.group_poll(T, N, S, 0, G, wait=1.0) == []  # the loop's second: it starts from the look
    assert 1000 + WATCH_MARGIN_MS - 300 <= watch_left() <= 1000 + WATCH_MARGIN_MS, watch_left()
    # the next long poll starts from it: it watches at once (a record reaches it now)
    threading.Timer(0.2, lambda: redis_client.publish(T, N, S, b"now")).start()
    start = time.monotonic()
    assert [r.payload for r in redis_client.group_poll(T, N, S, 0, G, wait=3.0)] == [b"now"]
    assert time.monotonic() - start < 0.2 + 0.3


def test_an_idle_loop_never_lets_its_watch_lapse(redis_client: felix_redis.Client, raw: redis.Redis) -> None:
    """The loop's second long poll starts from the poll behind the first one's block,
    whose watch was taken for the first wait only: before it lapses (a margin after the
    first wait), a poll behind a shorter block keeps it. Sampled through the second and
    third waits, the watch is live and this waiter's all along."""
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, G)
    lead = f"felix:{{{T}/{N}/{S}/0}}:g:{G}"
    assert redis_client.group_poll(T, N, S, 0, G, wait=2.0) == []
    holder = raw.hget(lead, "lead").split()[0]
    samples: list[tuple[bytes, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seconds, micros = raw.time()
            watch = raw.hget(lead, "lead").split()
            samples.append((watch[0], int(watch[1]) - (seconds * 1000 + micros // 1000)))
            time.sleep(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        for _ in range(2):
            assert redis_client.group_poll(T, N, S, 0, G, wait=2.0) == []
    finally:
        stop.set()
        thread.join(5)
    assert len(samples) > 40
    assert all(who == holder and left > 0 for who, left in samples), [s for s in samples if s[1] <= 0][:5]


def test_a_watcher_that_stops_polling_is_replaced(
        redis_client: felix_redis.Client, raw: redis.Redis, redis_url: str) -> None:
    """A poller takes the watch with wait=0.3 and never polls again (a crash, a worker
    stopped without closing). A worker polling with wait=1.5 is a follower while that
    watch lives: a record published then reaches it at the end of its wait (its poll
    looks), and that poll, after the lapse (0.3 s + WATCH_MARGIN_MS), takes the watch
    over: the next record reaches it at once."""
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, G)
    quitter = felix_redis.connect(redis_url)
    assert quitter.group_poll(T, N, S, 0, G, wait=0.3) == []

    def poll() -> list[felix_redis.Record]:
        return redis_client.group_poll(T, N, S, 0, G, wait=1.5)

    _replaced_after_the_lapse(redis_client, raw, poll, {})
    quitter.close()


def _replaced_after_the_lapse(client: felix_redis.Client, raw: redis.Redis, poll: Callable[[], list[Any]],
                              shards: dict[str, int]) -> None:
    """After a watcher took the watch with wait=0.3 and quit: a worker looping ``poll``
    (wait=1.5) gets a first record at the end of its wait at the latest, holds the watch
    after the lapse, and gets a second record at once (``shards``: where each goes)."""
    lead = f"felix:{{{T}/{N}/{S}/0}}:g:{G}"
    quitters = raw.hget(lead, "lead").split()[0]
    got: list[tuple[float, bytes]] = []
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            for r in poll():
                got.append((time.monotonic(), r.payload))

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    time.sleep(0.4)
    first = time.monotonic()
    client.publish(T, N, S, b"first", shard=shards.get("first"))
    while len(got) < 1 and time.monotonic() < first + 5:
        time.sleep(0.01)
    assert [p for _, p in got] == [b"first"] and got[0][0] - first < 1.5 + 0.5
    time.sleep(0.3 + WATCH_MARGIN_MS / 1000 + 1.5)  # the lapse, and one more wait at most
    assert raw.hget(lead, "lead").split()[0] != quitters  # the worker watches now
    second = time.monotonic()
    client.publish(T, N, S, b"second", shard=shards.get("second"))
    while len(got) < 2 and time.monotonic() < second + 5:
        time.sleep(0.01)
    stop.set()
    thread.join(5)
    assert [p for _, p in got] == [b"first", b"second"]
    assert got[1][0] - second < 0.3, got[1][0] - second


def test_a_follower_still_wakes_for_a_nack_due_soon(redis_client: felix_redis.Client, redis_url: str) -> None:
    """A nack with a delay wakes the watcher (the wake stream), which polls when the
    record falls due: the redelivery is not held up by the followers' bell."""
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, G)
    redis_client.publish(T, N, S, b"again")
    (held,) = redis_client.group_poll(T, N, S, 0, G)
    got: list[list[felix_redis.Record]] = []
    clients = [felix_redis.connect(redis_url) for _ in range(4)]
    threads = [threading.Thread(target=lambda c=c: got.append(c.group_poll(T, N, S, 0, G, wait=4.0)), daemon=True)
               for c in clients]
    for t in threads:
        t.start()
    time.sleep(0.5)
    redis_client.group_nack(T, N, S, 0, G, held, delay=0.5)
    start = time.monotonic()
    deadline = start + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got and [r.payload for r in got[0]] == [b"again"]
    assert 0.4 < time.monotonic() - start < 2.0
    redis_client.publish_batch(T, N, S, [b"x", b"y", b"z"])
    for t in threads:
        t.join(5)
    assert sorted(r.payload for rs in got for r in rs) == [b"again", b"x", b"y", b"z"]
    for c in clients:
        c.close()


def test_asyncio_tasks_share_the_watch(
        redis_client: felix_redis.Client, raw: redis.Redis, redis_url: str) -> None:
    """Asyncio: tasks of one client are waiters of their own (one watches, the others
    wait on the bell): a record costs few script calls, and each is handed out once."""
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, G)

    async def main() -> tuple[list[int], int]:
        c = faio.connect(redis_url)
        got: list[int] = []
        stop = asyncio.Event()

        async def worker() -> None:
            while not stop.is_set():
                for r in await c.group_poll(T, N, S, 0, G, max_records=1, wait=2.0):
                    got.append(r.offset)
                    await c.group_ack(T, N, S, 0, G, r)

        tasks = [asyncio.create_task(worker()) for _ in range(20)]
        await asyncio.sleep(0.5)
        before = script_calls(raw)
        for i in range(5):
            redis_client.publish(T, N, S, b"a%d" % i)
            await asyncio.sleep(0.1)
        for _ in range(100):
            if len(got) >= 5:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        calls = script_calls(raw) - before - 5
        stop.set()
        await asyncio.gather(*tasks)
        await c.close()
        return sorted(got), calls

    offsets, calls = asyncio.run(main())
    assert offsets == list(range(5))
    assert calls <= 3 * 5 + 20, calls  # a wait (2 s) may end for all 20 in the window


def test_a_user_without_bzpopmin_still_gets_every_record(
        redis_client: felix_redis.Client, raw: redis.Redis, redis_url: str) -> None:
    """A consumer whose ACL predates the bell (granted without BZPOPMIN) is refused the
    wait on the bell: it watches the log like every waiter did before, and gets the
    records."""
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, G)
    # someone else holds the watch, so this poller is a follower and tries the bell
    raw.hset(f"felix:{{{T}/{N}/{S}/0}}:g:{G}", "lead", f"other {int(time.time() * 1000) + 60_000}")
    # the role's rules as granted before the bell
    rules = [r.replace(" +bzpopmin", "") for r in acl.rules("group.consume", T, N, S, G)]
    assert not any("bzpopmin" in r for r in rules)
    raw.execute_command(*acl.setuser_args("old", rules, reset=True, password="pw"))
    try:
        host, port = raw.connection_pool.connection_kwargs["host"], raw.connection_pool.connection_kwargs["port"]
        old = felix_redis.connect(f"redis://old:pw@{host}:{port}")
        thread = threading.Thread(target=lambda: redis_client.publish(T, N, S, b"job"), daemon=True)
        start = time.monotonic()
        threading.Timer(0.3, thread.start).start()
        records = old.group_poll(T, N, S, 0, G, wait=5.0)
        assert [r.payload for r in records] == [b"job"]
        assert time.monotonic() - start < 2.0
        assert not old.core.bells
        old.close()
    finally:
        raw.execute_command("ACL", "DELUSER", "old")


def test_deleting_the_group_deletes_its_bell(
        redis_client: felix_redis.Client, raw: redis.Redis) -> None:
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, G)
    redis_client.publish(T, N, S, b"job")
    assert len(redis_client.group_poll(T, N, S, 0, G, wait=1.0)) == 1  # rings: nobody watches
    bell = f"felix:{{{T}/{N}/{S}/0}}:g:{G}:bell"
    (ring,) = raw.zrange(bell, 0, -1)  # the ring: 'ID NEXT WSEQ DUEIN', from offset 1 on
    assert ring.split()[1] == b"1"
    redis_client.group_delete(T, N, S, G)
    assert not raw.exists(bell)
    redis_client.group_create(T, N, S, G)
    assert len(redis_client.group_poll(T, N, S, 0, G, wait=1.0)) == 1
    redis_client.stream_delete(T, N, S)
    assert raw.keys(f"felix:{{{T}/{N}/{S}/*") == []


# ------------------------------------------------- the group's watch over several shards


@pytest.fixture
def sharded_fleet(redis_client: felix_redis.Client, redis_url: str) -> Iterator[Callable[..., Fleet]]:
    """Fleets of sharded groups (the README's loop, the Worker) on a stream of 4 shards:
    the group's watch is held on shard 0 and its watcher blocks on every shard."""
    redis_client.stream_create(T, N, S, shards=4)
    redis_client.group_create(T, N, S, G, visibility_timeout_ms=60_000)
    made: list[Fleet] = []

    def make(k: int, wait: float, handle: Callable[[felix_redis.Record], Any] = lambda r: None) -> Fleet:
        made.append(Fleet(redis_url, k, wait, handle, sharded=True))
        return made[-1]

    yield make
    for f in made:
        f.close()


@pytest.mark.parametrize("k", [8, 40])
def test_a_record_on_any_shard_wakes_one_of_many_idle_sharded_pollers(
        redis_client: felix_redis.Client, raw: redis.Redis, sharded_fleet: Callable[..., Fleet], k: int) -> None:
    """Counted by the server: k idle sharded groups on 4 shards, 12 records published to
    the shards in turn. Each costs about 4 script calls besides its publish (at most 5
    here), whatever k is (the watcher's poll of the shard that takes it; its call giving
    the watch up, whose ring hands the watch and its points of every shard to the
    follower that pops it; the taker's next poll, with the ack; its call of the watch
    when idle again), where every idle consumer used to wake and poll (k + 2: 10 and 42
    here); all handed out once."""
    f = sharded_fleet(k, wait=8.0)
    settle(raw, 0.3)
    before = script_calls(raw)
    for i in range(12):
        redis_client.publish(T, N, S, b"job%d" % i, shard=i % 4)
        time.sleep(0.1)
    f.wait_for(12, timeout=10)
    settle(raw, 0.3)
    calls = script_calls(raw) - before - 12  # the publishes' own
    with f.lock:
        got = sorted(f.shards_got)
    assert got == sorted((i % 4, i // 4) for i in range(12))
    assert calls <= 5 * 12 + 4, calls  # (4 in slack: a watch renewed inside the window)


def test_idle_sharded_followers_make_one_poll_and_one_wait_a_wait(
        raw: redis.Redis, sharded_fleet: Callable[..., Fleet]) -> None:
    """Counted by the server: 4 idle sharded groups on 4 shards with wait=0.5. Each
    follower, per wait, calls shard 0's poll (the watch) and waits on the bell; it does
    not look at the other shards (the watcher blocks on them)."""
    sharded_fleet(4, wait=0.5)
    time.sleep(1.5)  # every consumer past its first waits

    def calls() -> dict[str, int]:
        stats = raw.info("commandstats")
        return {c: stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("fcall", "xread", "bzpopmin")}

    before = calls()
    time.sleep(2.0)
    made = {c: n - before[c] for c, n in calls().items()}
    waits = 2.0 / 0.5
    assert made["bzpopmin"] >= 3 * waits - 3, made  # three followers, each waiting on the bell
    # the watcher's blocks only: at most two a wait (one is cut short where it renews
    # its watch, without a look either)
    assert made["xread"] <= 2 * waits + 1, made
    assert made["fcall"] <= 4 * waits + 2, made  # one poll a wait each


def test_a_busy_sharded_watcher_hands_the_watch_on(
        redis_client: felix_redis.Client, raw: redis.Redis, sharded_fleet: Callable[..., Fleet]) -> None:
    """Two sharded groups with a long wait: the watcher takes a record of shard 2 and is
    busy with it for 3 s; a record of shard 3, published 0.3 s later, goes to the other
    one at once: the taker gave the watch up and its ring made the other the watcher,
    blocking on every shard (without it, the other waits on the bell to its wait's end)."""
    f = sharded_fleet(2, wait=8.0, handle=lambda r: time.sleep(3.0) if r.shard == 2 else None)
    settle(raw, 0.3)
    redis_client.publish(T, N, S, b"slow", shard=2)
    f.wait_for(1, timeout=5)
    time.sleep(0.3)
    published = time.monotonic()
    redis_client.publish(T, N, S, b"quick", shard=3)
    f.wait_for(2, timeout=5)
    with f.lock:
        (taker_of_slow, _, _), (taker_of_quick, at, _) = f.got
    assert taker_of_slow != taker_of_quick
    assert at - published < 1.0, at - published


def test_a_sharded_watcher_that_stops_polling_is_replaced(
        redis_client: felix_redis.Client, raw: redis.Redis, redis_url: str) -> None:
    """A sharded group of 4 shards takes the group's watch with wait=0.3 and never polls
    again. Another one polling with wait=1.5 is a follower while that watch lives: a
    record on shard 3 reaches it at the end of its wait; after the lapse its poll takes
    the watch, and the next record, on shard 2, reaches it at once."""
    redis_client.stream_create(T, N, S, shards=4)
    redis_client.group_create(T, N, S, G)
    quitter = felix_redis.connect(redis_url)
    assert quitter.group_sharded(T, N, S, G).poll(1, wait=0.3) == []
    group = redis_client.group_sharded(T, N, S, G)
    _replaced_after_the_lapse(redis_client, raw, lambda: group.poll(1, wait=1.5), {"first": 3, "second": 2})
    quitter.close()


def test_the_ring_of_a_sharded_watcher_carries_its_points_of_every_shard(
        redis_client: felix_redis.Client, raw: redis.Redis) -> None:
    """The call giving the watch up rings with what its caller knows of shards 1-3
    (lua/group_poll.lua, SHARDS); a popper reads the ring's points (plans.read_ring).
    Bad SHARDS, or max_records 0 without '!', are refused before anything is written."""
    from felix_redis.plans import read_ring, read_shards_points
    from tests.support.scripts import run_script

    redis_client.stream_create(T, N, S, shards=4)
    redis_client.group_create(T, N, S, G)
    group = redis_client.group_sharded(T, N, S, G)
    assert group.poll(1, wait=0.2) == []  # the watcher, knowing every shard idle
    redis_client.publish(T, N, S, b"job", shard=2)
    assert [r.payload for r in group.poll(1, wait=1.0)] == [b"job"]
    bell = f"felix:{{{T}/{N}/{S}/0}}:g:{G}:bell"
    (member,) = raw.zrange(bell, 0, -1)
    ring = read_ring([bell.encode(), member, 0])
    assert ring is not None and ring.next_offset == 0
    told = read_shards_points(ring.shards, 3)
    assert told is not None
    ttl, shards = told
    assert ttl > 0
    # shards 1 and 3 known idle where they were; shard 2 filled its ask (it may have
    # more): unknown, the popper asks it at once
    assert [p if p is None else p[0] for p in shards] == [0, None, 0]

    keys = redis_client.core.cache.group_shard_keys(redis_client.core.name(T, N, S), 0, G)[0]
    lead = raw.hget(f"felix:{{{T}/{N}/{S}/0}}:g:{G}", "lead")
    for max_records, call, what in [
        (0, "0 w1 1000 +1000:?,?,?", "max_records"),
        (1, "0 +1000:?", "WAITER"),
        (1, "0 w1 1000 !1000:x", "ARGV[3]"),
        (1, "0 w1 1000 !" + "1" * 16001, "16000"),
    ]:
        with pytest.raises(redis.ResponseError, match=re.escape(what)):
            run_script(redis_client, "group_poll", [*keys, bell], [max_records, "", call])
    assert raw.zrange(bell, 0, -1) == [member] and raw.hget(f"felix:{{{T}/{N}/{S}/0}}:g:{G}", "lead") == lead


# ------------------------------------- found by a review of the watch over several shards


@pytest.mark.parametrize("holder", ["group_poll of shard 0", "forged"])
def test_a_sharded_follower_looks_at_the_other_shards_when_the_watch_watches_shard_0_only(
        redis_client: felix_redis.Client, raw: redis.Redis, redis_url: str, sharded_fleet: Callable[..., Fleet],
        monkeypatch: pytest.MonkeyPatch, holder: str) -> None:
    """The group's watch held by a waiter that watches shard 0 only (a `group_poll` of
    shard 0 mixed into the fleet, or a `lead` field written by hand): a record on shard 2
    reaches a sharded follower within KNOWN_IDLE_S (1 s here) and a wait, where it used
    to wait for as long as that watch was renewed. A record on shard 0 reaches the
    fleet at once."""
    import felix_redis.sharded

    monkeypatch.setattr(felix_redis.sharded, "KNOWN_IDLE_S", 1.0)
    stop = threading.Event()
    lead = f"felix:{{{T}/{N}/{S}/0}}:g:{G}"
    other = felix_redis.connect(redis_url)
    holders: list[threading.Thread] = []
    if holder == "forged":
        raw.hset(lead, "lead", f"forged {int(raw.time()[0]) * 1000 + 600_000}")
    else:
        def shard_0_only() -> None:
            while not stop.is_set():
                for r in other.group_poll(T, N, S, 0, G, max_records=1, wait=2.0):
                    other.group_ack(T, N, S, G, r)

        holders.append(threading.Thread(target=shard_0_only, daemon=True))
        holders[0].start()
        time.sleep(0.3)  # it holds the watch before the fleet comes
    assert raw.hget(lead, "lead").split()[0] not in ("", None)
    f = sharded_fleet(2, wait=0.5)
    time.sleep(1.5)  # both followers past their first waits
    published = time.monotonic()
    redis_client.publish(T, N, S, b"on-2", shard=2)
    end = published + 6.0
    while not f.offsets() and time.monotonic() < end:
        time.sleep(0.02)
    took = time.monotonic() - published
    stop.set()
    for thread in holders:
        thread.join(5)
    other.close()
    with f.lock:
        assert f.shards_got == [(2, 0)], (f.shards_got, took)
    assert took < 1.0 + 0.5 + 1.0, took


def test_a_follower_role_learned_long_ago_is_asked_again(
        redis_client: felix_redis.Client, raw: redis.Redis, redis_url: str) -> None:
    """A sharded consumer's poll ends as a follower; the watcher stops polling while
    the consumer is away (its watch lapses). The consumer's next long poll asks shard 0
    who watches before it waits on the bell: it takes the watch and a record published
    then reaches it at once (it used to wait on the bell to its wait's end: nobody rang)."""
    redis_client.stream_create(T, N, S, shards=4)
    redis_client.group_create(T, N, S, G)
    quitter = felix_redis.connect(redis_url)
    watcher = threading.Thread(target=lambda: quitter.group_sharded(T, N, S, G).poll(1, wait=0.3))
    watcher.start()  # (a waiter of its own: another thread) the watcher, then gone
    watcher.join(5)
    group = redis_client.group_sharded(T, N, S, G)
    for _ in range(10):  # (a poll ends as a follower when its wait's end called the watch)
        assert group.poll(1, wait=0.2) == []
        if group._state.follow:
            break
    assert group._state.follow
    time.sleep(0.3 + WATCH_MARGIN_MS / 1000 + 0.3)  # away; the watch lapses meanwhile
    got: list[tuple[float, int]] = []
    thread = threading.Thread(
        target=lambda: got.extend((time.monotonic(), r.shard) for r in group.poll(1, wait=5.0)), daemon=True)
    thread.start()
    time.sleep(0.3)
    published = time.monotonic()
    redis_client.publish(T, N, S, b"job", shard=1)
    thread.join(6)
    quitter.close()
    assert [shard for _, shard in got] == [1]
    assert got[0][0] - published < 1.0, got[0][0] - published


@pytest.mark.parametrize("bad", ["99999999999999999999 0 -1", "0 99999999999999999999 -1", "-1 0 -1", "0 -1 -1"])
def test_a_forged_ring_does_not_make_the_popper_fail(
        redis_client: felix_redis.Client, raw: redis.Redis, bad: str) -> None:
    """A ring written by hand on the group's bell (`ZADD`, a group.consume power) with
    points Redis would refuse as stream IDs: the follower that pops it does not take it
    (as a ring of another form) and its poll goes on, instead of raising."""
    redis_client.stream_create(T, N, S, shards=4)
    redis_client.group_create(T, N, S, G)
    lead = f"felix:{{{T}/{N}/{S}/0}}:g:{G}"
    raw.hset(lead, "lead", f"forged {int(raw.time()[0]) * 1000 + 600_000}")
    group = redis_client.group_sharded(T, N, S, G)
    assert group.poll(1, wait=0.2) == [] and group._state.follow
    raw.zadd(f"{lead}:bell", {f"1.1 {bad}": 0})
    assert group.poll(1, wait=0.5) == []
    redis_client.publish(T, N, S, b"job", shard=0)
    assert [r.payload for r in group.poll(1, wait=1.0)] == [b"job"]


def _lone_watcher(client: felix_redis.Client, shards: int, max_records: int) -> Any:
    """A sharded group, alone on a new stream of ``shards``, idle until it holds the
    group's watch (its first polls may end while it learns the role)."""
    client.stream_create(T, N, S, shards=shards)
    client.group_create(T, N, S, G)
    group = client.group_sharded(T, N, S, G)
    for _ in range(10):
        assert group.poll(max_records, wait=0.2) == []
        if group._state.watching:
            break
    assert group._state.watching
    return group


def test_a_sharded_watcher_taking_records_of_shard_0_gives_the_watch_up_in_that_call(
        redis_client: felix_redis.Client, raw: redis.Redis) -> None:
    """The watcher of a group over 4 shards takes a record of shard 0: the call of the
    watch that hands it out gives the watch up (and rings), so the poll makes no second
    call of shard 0 to give it up: one script call for the record."""
    group = _lone_watcher(redis_client, shards=4, max_records=1)
    redis_client.publish(T, N, S, b"job", shard=0)
    before = script_calls(raw)
    assert [r.payload for r in group.poll(1, wait=1.0)] == [b"job"]
    assert script_calls(raw) - before == 1
    assert not group._state.watching and raw.zcard(f"felix:{{{T}/{N}/{S}/0}}:g:{G}:bell") == 1  # rung


def test_a_sharded_watcher_that_took_its_watch_back_in_the_round_gives_it_up(
        redis_client: felix_redis.Client, raw: redis.Redis) -> None:
    """A round asks shard 0 twice (a quota beside the lead, then what is still wanted):
    the first call hands records out and gives the watch up, the second hands out none
    and, nobody having popped the ring, takes the watch back. The round ends busy with
    records: it gives the watch up again (it used to keep it, and a record on another
    shard then waited for the watch to lapse)."""
    group = _lone_watcher(redis_client, shards=2, max_records=4)
    state = group._state
    for shard in (0, 0, 1):
        redis_client.publish(T, N, S, b"job", shard=shard)
    points, _due, at = state.idle[0][0]
    state.idle[0][0] = (points, 0.0, at)  # shard 0 due now: asked beside the lead
    state.idle[0].pop(1, None)
    state.cursors[0], state.runs[0] = 1, 2  # shard 1 leads
    assert len(group.poll(4, wait=5.0)) == 3
    from felix_redis.plans import waiter_name

    lead = raw.hget(f"felix:{{{T}/{N}/{S}/0}}:g:{G}", "lead")
    assert not state.watching and (lead is None or lead.split()[0] != waiter_name()), lead


def test_a_sharded_followers_spaced_polls_make_one_poll_and_one_wait_each(
        redis_client: felix_redis.Client, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower of a live watch over 4 shards whose loop does 0.1 s of work between
    polls (longer than a poll's reuse window): each poll still goes to the bell with one
    call of shard 0 at its wait's end, not two calls and a look (its role is asked again
    only once the watch it follows has lapsed)."""
    from felix_redis.plans import Batch, BlockAny, Eval

    redis_client.stream_create(T, N, S, shards=4)
    redis_client.group_create(T, N, S, G)
    stop = threading.Event()
    watcher = felix_redis.connect(redis_url)

    def watch() -> None:
        group = watcher.group_sharded(T, N, S, G)
        while not stop.is_set():
            group.poll(1, wait=2.0)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    time.sleep(0.3)
    follower = redis_client.group_sharded(T, N, S, G)
    for _ in range(3):
        assert follower.poll(1, wait=0.3) == []
    ops: list[str] = []
    real = redis_client._execute

    def spy(op: Any) -> Any:
        ops.append("batch" if type(op) is Batch else "block" if type(op) is BlockAny
                   else "script" if type(op) is Eval else "command")
        return real(op)

    monkeypatch.setattr(redis_client, "_execute", spy)
    for _ in range(5):
        time.sleep(0.1)
        assert follower.poll(1, wait=0.3) == []
    stop.set()
    thread.join(5)
    watcher.close()
    assert follower._state.follow
    assert ops.count("block") == 5 and ops.count("script") <= 6 and "batch" not in ops, ops
