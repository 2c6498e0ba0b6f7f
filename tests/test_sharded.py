"""Sharded groups: one group polled fairly across every shard of a stream, with settles
routed to the item's shard and long polls that block on all shards at once."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import felix_redis
from felix_redis.constants import LEAD_RUN
from felix_redis.keys import GROUP_ROLES
from felix_redis.protocol import Batch, BlockAny, Cmd, Eval
from felix_redis.testing.server import RedisServer

T, N, S, G = "acme", "prod", "jobs", "workers"


@pytest.fixture
def other(backend: tuple[str, Any]) -> Iterator[felix_redis.Client]:
    c = felix_redis.connect(backend[0])
    yield c
    c.close()


def setup(client: felix_redis.Client, shards: int = 4, fill: dict[int, int] | None = None, **group: Any) -> None:
    client.stream_create(T, N, S, shards=shards)
    client.group_create(T, N, S, G, **group)
    for shard, count in (fill or {}).items():
        for start in range(0, count, 1000):
            client.publish_batch(
                T, N, S, [b"%d-%d" % (shard, i) for i in range(start, min(count, start + 1000))], shard=shard)


def spy(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    ops: list[Any] = []
    real = client._execute

    def run(op: Any) -> Any:
        ops.append(op)
        return real(op)

    monkeypatch.setattr(client, "_execute", run)
    return ops


def later(fn: Callable[[], Any], after: float) -> threading.Thread:
    def run() -> None:
        time.sleep(after)
        fn()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------------- fairness


@pytest.mark.usefixtures("first_lead_zero")
def test_a_poll_takes_its_batch_from_one_lead_shard_in_turn(client: felix_redis.Client) -> None:
    """With every shard busy one shard leads: it gives the whole batch (one script call)
    for LEAD_RUN polls in a row, then the next shard does."""
    setup(client, fill={0: 100, 1: 100, 2: 100, 3: 100})
    group = client.group_sharded(T, N, S, G)
    polls = [group.poll(8) for _ in range(4 * LEAD_RUN)]
    assert [{i.shard for i in items} for items in polls] == [{shard} for shard in range(4) for _ in range(LEAD_RUN)]
    for items in polls[:LEAD_RUN]:
        for item in items:
            assert item.attempts == 1
            assert item.payload == b"%d-%d" % (item.shard, item.offset)
            assert item.claim == f"{item.shard}:{item.offset}:1"
    # offset order within each shard
    assert [i.offset for items in polls[:LEAD_RUN] for i in items] == list(range(8 * LEAD_RUN))


@pytest.mark.usefixtures("first_lead_zero")
def test_poll_fills_up_from_shards_that_have_more(client: felix_redis.Client) -> None:
    setup(client, fill={0: 3, 1: 1, 3: 100})
    group = client.group_sharded(T, N, S, G)
    items = group.poll(16)
    assert len(items) == 16
    # the lead (0) ran dry, so did the next (1); 3 gave the rest
    assert Counter(i.shard for i in items) == {0: 3, 1: 1, 3: 12}
    assert len({(i.shard, i.offset) for i in items}) == 16


@pytest.mark.usefixtures("first_lead_zero")
def test_hot_shard_does_not_starve_the_others(client: felix_redis.Client) -> None:
    setup(client, fill={0: 1000, 1: 10, 2: 10, 3: 10})
    group = client.group_sharded(T, N, S, G)
    drained_at: dict[int, int] = {}
    seen: Counter[int] = Counter()
    for n in range(1, 21):
        items = group.poll(16)
        assert len(items) == 16
        seen.update(i.shard for i in items)
        for shard in (1, 2, 3):
            if seen[shard] == 10 and shard not in drained_at:
                drained_at[shard] = n
        group.ack_many(items)
    assert set(drained_at) == {1, 2, 3}, seen
    # the hot shard leads its run, then the others drain in the polls right after it
    assert max(drained_at.values()) <= LEAD_RUN + 3, drained_at
    # and the hot shard got everything else
    assert seen[0] == 20 * 16 - 30


def test_with_every_shard_busy_each_leads_in_turn(client: felix_redis.Client) -> None:
    """64 shards, all busy: over 64 * LEAD_RUN polls each shard hands out the same
    number of records, and none waits more than LEAD_RUN * 63 polls for its turn."""
    setup(client, shards=64, fill={shard: 4 * LEAD_RUN for shard in range(64)})
    group = client.group_sharded(T, N, S, G)
    seen: Counter[int] = Counter()
    last: dict[int, int] = {}
    waits = []
    for n in range(64 * LEAD_RUN):
        items = group.poll(4, ack=[])
        assert len(items) == 4
        for shard in {i.shard for i in items}:
            waits.append(n - last.get(shard, n))
            last[shard] = n
        seen.update(i.shard for i in items)
        group.ack_many(items)
    assert seen == {shard: 4 * LEAD_RUN for shard in range(64)}
    assert max(waits) <= LEAD_RUN * 63


def test_the_consumers_of_a_fleet_do_not_all_lead_on_the_same_shard(client: felix_redis.Client) -> None:
    """Each sharded group (a consumer of a fleet, started with the others) draws the
    shard its first run leads on: 24 of them, each taking one record, do not all take it
    from the same shard (all alike by chance: 4 x (1/4)^24), and each goes on from its
    own first shard in turn."""
    setup(client, fill={0: 100, 1: 100, 2: 100, 3: 100})
    groups = [client.group_sharded(T, N, S, G) for _ in range(24)]
    firsts = [group.poll(1)[0].shard for group in groups]
    assert len(set(firsts)) > 1, firsts
    for group, first in zip(groups[:4], firsts, strict=False):
        shards = [first] + [group.poll(1)[0].shard for _ in range(2 * LEAD_RUN - 1)]
        assert shards == [first] * LEAD_RUN + [(first + 1) % 4] * LEAD_RUN, shards


@pytest.mark.usefixtures("first_lead_zero")
def test_small_polls_rotate_over_shards(client: felix_redis.Client) -> None:
    setup(client, fill={0: 10, 1: 10, 2: 10, 3: 10})
    group = client.group_sharded(T, N, S, G)
    shards = [group.poll(1)[0].shard for _ in range(4 * LEAD_RUN)]
    assert shards == [shard for shard in range(4) for _ in range(LEAD_RUN)], shards


def test_poll_skips_empty_shards(client: felix_redis.Client) -> None:
    setup(client, fill={2: 3})
    group = client.group_sharded(T, N, S, G)
    for _ in range(3):
        (item,) = group.poll(1)
        assert item.shard == 2
        group.ack(item)
    assert group.poll(4) == []


def test_redeliveries_come_first_on_their_shard(client: felix_redis.Client) -> None:
    setup(client, shards=2, fill={0: 5, 1: 5})
    group = client.group_sharded(T, N, S, G)
    items = group.poll(4)
    for item in items:
        assert group.nack(item) is False
    again = group.poll(4)
    assert sorted((i.shard, i.offset, i.attempts) for i in again) == sorted(
        (i.shard, i.offset, 2) for i in items)


# ------------------------------------------------------------------- routing


def test_settles_are_routed_to_the_items_shard(client: felix_redis.Client) -> None:
    setup(client, fill={0: 2, 1: 2, 2: 2, 3: 2}, visibility_timeout_ms=30_000)
    group = client.group_sharded(T, N, S, G)
    items = {(i.shard, i.offset): i for i in group.poll(8)}
    assert len(items) == 8

    assert group.ack(items[1, 0]) is True
    assert group.ack(items[1, 0]) is False  # already finished
    assert group.nack(items[2, 0]) is False
    assert group.nack_after(items[3, 1], 60) is False
    expiry = group.extend(items[0, 1], by=120)
    group.dead_letter(items[3, 0], reason="bad card")

    shards = client.group_describe(T, N, S, G).shards
    assert [s.position for s in shards] == [0, 1, 0, 1]
    assert [s.in_flight for s in shards] == [2, 1, 1, 0]
    assert [s.owed for s in shards] == [0, 0, 1, 1]
    assert [s.dead for s in shards] == [0, 0, 0, 1]
    (dead,) = client.group_dead_letters(T, N, S, 3, G)
    assert (dead.offset, dead.attempts, dead.reason) == (0, 1, "bad card")
    assert client.group_dead_letters(T, N, S, 0, G) == []

    # the extended lease is 120 s from now, by the server's clock
    server_ms = client.redis.time()
    now_ms = server_ms[0] * 1000 + server_ms[1] // 1000
    assert 119_000 < expiry - now_ms <= 120_000

    # only the nack with no delay is due: it comes back on shard 2, attempts 2
    (redelivered,) = group.poll(8)
    assert (redelivered.shard, redelivered.offset, redelivered.attempts) == (2, 0, 2)


def test_settles_accept_records_and_stale_claims_fail(client: felix_redis.Client) -> None:
    setup(client, fill={1: 1})
    group = client.group_sharded(T, N, S, G)
    (item,) = group.poll(4)
    assert group.nack(item.record) is False
    with pytest.raises(felix_redis.StaleClaim):
        group.nack(item)
    (again,) = group.poll(4)
    assert again.attempts == 2
    assert group.ack(again.record) is True


def test_ack_many_batches_per_shard(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    setup(client, fill={0: 10, 1: 10, 2: 10, 3: 10})
    group = client.group_sharded(T, N, S, G)
    items = group.poll(16) + group.poll(16) + group.poll(8)
    assert len(items) == 40 and {i.shard for i in items} == {0, 1, 2, 3}
    ops = spy(client, monkeypatch)
    assert group.ack_many(items) == 40
    assert len(ops) == 1 and type(ops[0]) is Batch, "one round trip for all shards"
    acks = [op for op in ops[0].ops if type(op) is Eval and op.script == "group_ack"]
    assert len(acks) == 4, [op.script for op in ops[0].ops]
    assert sorted(len(op.args) for op in acks) == [10, 10, 10, 10]
    assert group.ack_many(items) == 0  # finished already
    assert group.ack_many([]) == 0
    info = client.group_describe(T, N, S, G)
    assert [s.position for s in info.shards] == [10, 10, 10, 10]
    assert [s.in_flight for s in info.shards] == [0, 0, 0, 0]


def test_bad_poll_arguments_are_refused(client: felix_redis.Client) -> None:
    setup(client, shards=2, fill={0: 1})
    group = client.group_sharded(T, N, S, G)
    for bad in (0, -1, 10_001, True, "4"):
        with pytest.raises(felix_redis.InvalidArgument):
            group.poll(bad)  # type: ignore[arg-type]
    with pytest.raises(felix_redis.InvalidArgument):
        group.poll(4, wait=-1)
    with pytest.raises(felix_redis.NotFound):
        client.group_sharded(T, N, S, "nobody").poll(4)
    with pytest.raises(felix_redis.InvalidArgument):
        client.group_sharded(T, N, S, G, consumer="bad name").poll(4)


# ----------------------------------------------------------------- long polls


def test_long_poll_wakes_on_publish_to_any_shard(client: felix_redis.Client, other: felix_redis.Client) -> None:
    setup(client)
    group = client.group_sharded(T, N, S, G)
    stamp: list[float] = []

    def publish() -> None:
        stamp.append(time.monotonic())
        other.publish(T, N, S, b"to-3", shard=3)

    thread = later(publish, 0.2)
    items = group.poll(8, wait=2)
    got = time.monotonic()
    thread.join(5)
    assert [(i.shard, i.offset, i.payload) for i in items] == [(3, 0, b"to-3")]
    assert got - stamp[0] < 0.5


def test_long_poll_blocks_once_on_all_shards(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    setup(client)
    group = client.group_sharded(T, N, S, G)
    group.poll(4)  # settings cached
    ops = spy(client, monkeypatch)
    start = time.monotonic()
    assert group.poll(4, wait=1) == []
    assert time.monotonic() - start >= 0.9
    blocks = [op for op in ops if type(op) is BlockAny]
    assert 1 <= len(blocks) <= 2
    keys = {key for key, _ in blocks[0].streams}
    name = client.core.name(T, N, S)
    for shard in range(4):
        assert name.shard_keys(shard)[1] in keys  # every shard's log
        assert name.group_key_list(shard, G)[GROUP_ROLES.index("wake")] in keys  # every shard's wake stream
    assert len([op for op in ops if type(op) is Eval]) <= 4 * (len(blocks) + 1)


def test_long_poll_publish_in_the_race_window(
    client: felix_redis.Client, other: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup(client)
    group = client.group_sharded(T, N, S, G)
    real = client._execute
    fired: list[bool] = []

    def racing(op: Any) -> Any:
        if type(op) is BlockAny and not fired:
            other.publish(T, N, S, b"racer", shard=2)
            fired.append(True)
        return real(op)

    monkeypatch.setattr(client, "_execute", racing)
    start = time.monotonic()
    items = group.poll(8, wait=4)
    assert fired
    assert [(i.shard, i.payload) for i in items] == [(2, b"racer")]
    assert time.monotonic() - start < 1.0


def test_long_poll_wakes_on_nack_on_any_shard(client: felix_redis.Client, other: felix_redis.Client) -> None:
    setup(client, fill={1: 1})
    (item,) = other.group_sharded(T, N, S, G).poll(4)
    group = client.group_sharded(T, N, S, G)
    thread = later(lambda: other.group_nack(T, N, S, 1, G, item.record), 0.2)
    start = time.monotonic()
    items = group.poll(4, wait=4)
    thread.join(5)
    assert [(i.shard, i.offset, i.attempts) for i in items] == [(1, 0, 2)]
    assert time.monotonic() - start < 1.5


def test_long_poll_wakes_at_a_lapse_on_any_shard(client: felix_redis.Client, other: felix_redis.Client) -> None:
    setup(client, fill={2: 1}, visibility_timeout_ms=300)
    other.group_sharded(T, N, S, G).poll(4)
    group = client.group_sharded(T, N, S, G)
    start = time.monotonic()
    items = group.poll(4, wait=4)
    elapsed = time.monotonic() - start
    assert [(i.shard, i.offset, i.attempts) for i in items] == [(2, 0, 2)]
    assert 0.2 <= elapsed < 1.5


# ------------------------------------------------------------ many shards (64)


def calls(op: Any) -> list[Any]:
    """The calls of one round trip: a Batch's, or the one call sent as itself."""
    return list(op.ops) if type(op) is Batch else [op]


def script_calls(ops: list[Any]) -> int:
    return sum(type(e) is Eval for op in ops for e in calls(op))


def test_one_busy_shard_among_64_costs_one_script_call_per_poll(
    client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup(client, shards=64, fill={37: 400})
    group = client.group_sharded(T, N, S, G)
    batch: list[Any] = []
    for _ in range(8):  # the first polls learn which shards are idle
        batch = group.poll(16, ack=batch)
    ops = spy(client, monkeypatch)
    for _ in range(12):
        batch = group.poll(16, ack=batch)
        assert len(batch) == 16 and {i.shard for i in batch} == {37}
    assert script_calls(ops) == 12  # the busy shard's poll, its acks riding on it
    assert len(ops) == 12  # one round trip each (the idle shards' looks ride along)
    assert sum(type(e) is Cmd for op in ops for e in calls(op)) <= 12 // LEAD_RUN + 1


def test_an_idle_group_of_64_shards_costs_one_read_per_wait(
    client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup(client, shards=64)
    group = client.group_sharded(T, N, S, G)
    assert group.poll(16) == []  # learns every shard idle
    ops = spy(client, monkeypatch)
    assert group.poll(16) == []
    assert [type(op) for op in ops] == [Cmd]  # one look (a plain XREAD), no script
    ops.clear()
    for _ in range(3):
        assert group.poll(16, wait=0.2) == []
    # the long polls block on the 64 shards' wake points; the only script calls are the
    # group's watch, on shard 0 (taken by the first wait, renewed before it lapses):
    # at most one a wait, whatever the shard count
    evals = [e for op in ops for e in calls(op) if type(e) is Eval]
    assert 1 <= len(evals) <= 3, ops
    assert {e.keys[0] for e in evals} == {client.core.name(T, N, S).shard_keys(0)[0]}
    assert sum(type(op) is BlockAny for op in ops) >= 3 and len(ops) <= 9, ops


def test_a_record_published_to_one_of_64_idle_shards_wakes_the_long_poll(
    client: felix_redis.Client, other: felix_redis.Client
) -> None:
    setup(client, shards=64)
    group = client.group_sharded(T, N, S, G)
    assert group.poll(16) == []
    thread = later(lambda: other.publish(T, N, S, b"late", shard=51), 0.2)
    start = time.monotonic()
    items = group.poll(16, wait=3)
    thread.join(5)
    assert [(i.shard, i.payload) for i in items] == [(51, b"late")]
    assert time.monotonic() - start < 1.0
    # and a record that lands while the poller is busy elsewhere is found by a look
    client.publish_batch(T, N, S, [b"busy"] * 200, shard=3)
    other.publish(T, N, S, b"quiet", shard=60)
    seen = [i.payload for _ in range(16) for i in group.poll(16)]
    assert b"quiet" in seen and seen.count(b"busy") == 200


@pytest.mark.usefixtures("first_lead_zero")
def test_a_record_on_a_quiet_shard_does_not_wait_for_the_busy_ones_runs(client: felix_redis.Client) -> None:
    """63 busy shards, one quiet: what lands on the quiet one is found by the next look
    (at most LEAD_RUN polls away) and asked for beside the lead the poll after, not
    when the quiet shard's turn to lead comes round (63 runs later)."""
    setup(client, shards=64, fill={shard: 300 for shard in range(1, 64)})
    group = client.group_sharded(T, N, S, G)
    batch: list[Any] = []
    for _ in range(8):
        batch = group.poll(16, ack=batch)
    client.publish(T, N, S, b"quiet", shard=0)
    polls = 0
    while polls < 3 * LEAD_RUN and not any(i.shard == 0 for i in batch):
        batch = group.poll(16, ack=batch)
        polls += 1
    assert [i.payload for i in batch if i.shard == 0] == [b"quiet"]
    assert polls <= LEAD_RUN + 1, polls
    assert len(batch) == 16


def test_records_falling_due_on_a_shard_nobody_polled_for_a_while(client: felix_redis.Client) -> None:
    setup(client, shards=64)
    client.publish(T, N, S, b"later", shard=50, delay=1.0)
    due = time.monotonic() + 1.0
    group = client.group_sharded(T, N, S, G)
    assert group.poll(16) == []  # shard 50 said when its record falls due
    for _ in range(3):
        assert group.poll(16, wait=0.1) == []
    items = group.poll(16, wait=5)
    got = time.monotonic()
    assert [(i.shard, i.payload) for i in items] == [(50, b"later")]
    assert due - 0.05 <= got < due + 0.5


def test_a_lease_lapsing_on_an_idle_shard_of_64(client: felix_redis.Client, other: felix_redis.Client) -> None:
    setup(client, shards=64, fill={20: 1}, visibility_timeout_ms=400)
    (taken,) = other.group_sharded(T, N, S, G).poll(4)
    lapse = time.monotonic() + 0.4
    group = client.group_sharded(T, N, S, G)
    assert group.poll(16) == []  # shard 20 said when its lease lapses
    assert group.poll(16, wait=0.1) == []
    items = group.poll(16, wait=5)
    got = time.monotonic()
    assert [(i.shard, i.offset, i.attempts) for i in items] == [(20, taken.offset, 2)]
    assert lapse - 0.05 <= got < lapse + 0.5


def test_a_nack_on_an_idle_shard_wakes_a_poller_busy_elsewhere(
    client: felix_redis.Client, other: felix_redis.Client
) -> None:
    setup(client, shards=64, fill={9: 1})
    (item,) = other.group_sharded(T, N, S, G).poll(4)
    group = client.group_sharded(T, N, S, G)
    assert group.poll(16) == []
    client.publish_batch(T, N, S, [b"busy"] * 200, shard=3)
    other.group_nack(T, N, S, 9, G, item.record)
    again = [i for _ in range(16) for i in group.poll(16) if i.shard == 9]
    assert [(i.offset, i.attempts) for i in again] == [(item.offset, 2)]


def test_removing_a_rate_limit_wakes_a_poller_waiting_for_its_window(
    client: felix_redis.Client, other: felix_redis.Client
) -> None:
    setup(client, shards=4, fill={2: 3}, rate_limit=(1, 60.0))
    group = client.group_sharded(T, N, S, G)
    assert len(group.poll(16)) == 1  # the window allows one; the next ends in a minute
    assert group.poll(16) == []
    thread = later(lambda: other.group_configure(T, N, S, G, rate_limit=None), 0.3)
    start = time.monotonic()
    items = group.poll(16, wait=5)
    thread.join(5)
    assert [(i.shard, i.offset) for i in items] == [(2, 1), (2, 2)]
    assert time.monotonic() - start < 1.5


def drained_and_known_idle(client: felix_redis.Client, group: Any, records: int) -> None:
    """Publishes ``records`` round-robin, drains and acks them with ``group``, and makes
    it learn every shard idle."""
    client.publish_batch(T, N, S, [b"r%d" % i for i in range(records)]) if records else None
    batch: list[Any] = []
    while batch := group.poll(16, ack=batch):
        pass
    assert group.poll(16) == []


def test_a_group_made_again_is_seen_at_once(client: felix_redis.Client) -> None:
    """Deleting a group and making it again leaves no new entry in the logs: the new
    group's first wake-up (its wake sequence starts above the old one's) tells a
    consumer that knew the shards idle to look again."""
    setup(client, shards=4)
    for i in range(8):
        client.publish(T, N, S, b"r%d" % i, shard=i % 4)
    group = client.group_sharded(T, N, S, G)
    drained_and_known_idle(client, group, 0)
    client.group_delete(T, N, S, G)
    client.group_create(T, N, S, G, start="earliest")
    assert len(group.poll(16)) == 8  # at once, not after the 30 s re-ask
    client.group_delete(T, N, S, G)
    client.group_create(T, N, S, G, start="earliest")
    start = time.monotonic()
    assert len(group.poll(16, wait=5)) == 8
    assert time.monotonic() - start < 1.0


def test_a_stream_made_again_is_seen_at_once(client: felix_redis.Client) -> None:
    setup(client, shards=2)
    group = client.group_sharded(T, N, S, G)
    drained_and_known_idle(client, group, 40)  # the old logs' tails are at 20
    client.stream_delete(T, N, S)
    setup(client, shards=2)
    for shard in (0, 1):
        client.publish(T, N, S, b"new", shard=shard)  # offset 0: below the old tails
    start = time.monotonic()
    got = group.poll(16, wait=5)
    got += group.poll(16, wait=0.5) if len(got) < 2 else []
    assert sorted((i.shard, i.offset, i.payload) for i in got) == [(0, 0, b"new"), (1, 0, b"new")]
    assert time.monotonic() - start < 1.5


def test_a_restart_that_rolls_back_makes_the_group_forget_what_it_knew() -> None:
    """The same client through a Redis restart from an older snapshot: the logs are back
    below the points the group knew them idle at. The client met the lost connection
    (and retried through it), so the group asks every shard again."""
    with RedisServer(persistence=True, extra=["--save", "", "--appendonly", "no"]) as server:
        client = felix_redis.connect(server.url, retry_for=10.0)
        try:
            setup(client, shards=2, fill={0: 5, 1: 5})
            client.redis.execute_command("SAVE")  # the snapshot: 10 records not yet handed out
            group = client.group_sharded(T, N, S, G)
            drained_and_known_idle(client, group, 20)
            server.restart(hard=True)
            for shard in (0, 1):
                client.publish(T, N, S, b"after", shard=shard)
            got = group.poll(100)
            got += group.poll(100) if len(got) < 12 else []
            assert len(got) == 12 and sum(i.payload == b"after" for i in got) == 2
        finally:
            client.close()


def test_clients_over_one_redis_client_share_one_connect_watch(redis_url: str) -> None:
    """Client(raw) watches raw's pool for reconnects: once per pool however many clients
    are made over it (each made and dropped), and the connections it had already too."""
    import gc

    import redis

    raw = redis.Redis.from_url(redis_url)
    try:
        raw.ping()  # a connection made before any client
        kept = felix_redis.Client(raw)
        for _ in range(1500):
            felix_redis.Client(raw)
        gc.collect()
        assert raw.ping()  # (a wrapper per client nested 1500 deep: RecursionError)
        before = kept.core.epoch
        killer = redis.Redis.from_url(redis_url)
        killer.client_kill_filter(_type="normal", skipme=True)
        killer.close()
        assert raw.ping()  # the connection made before the client connects again
        assert kept.core.epoch > before
    finally:
        raw.close()


def test_long_poll_elapses(client: felix_redis.Client) -> None:
    setup(client)
    start = time.monotonic()
    assert client.group_sharded(T, N, S, G).poll(4, wait=0.3) == []
    assert 0.25 <= time.monotonic() - start < 2.0


# -------------------------------------------------------------- named consumers


def test_sharded_consumer_reclaims_its_records_on_every_shard(client: felix_redis.Client) -> None:
    setup(client, fill={0: 2, 1: 2, 2: 2, 3: 2}, visibility_timeout_ms=30_000)
    first = client.group_sharded(T, N, S, G, consumer="w-7")
    mine = first.poll(4)
    theirs = client.group_sharded(T, N, S, G, consumer="w-8").poll(4)
    assert len(mine) == len(theirs) == 4
    # w-7 restarts: its first poll takes back its own records, attempts + 1
    restarted = client.group_sharded(T, N, S, G, consumer="w-7")
    back = restarted.poll(16)
    assert sorted((i.shard, i.offset, i.attempts) for i in back) == sorted(
        (i.shard, i.offset, 2) for i in mine)
    # only once: later polls do not reclaim what it now holds
    assert restarted.poll(16) == []
    for item in theirs:
        assert client.group_sharded(T, N, S, G).ack(item) is True


def test_item_and_dead_letter_carry_the_contract_fields(client: felix_redis.Client) -> None:
    """An Item has its record's published_at; a DeadLetter's time is when it died (both
    the server's clock, timezone-aware); Published unpacks as (shard, offset)."""
    setup(client, shards=2)
    shard, offset = client.publish(T, N, S, b"x", shard=1)
    assert (shard, offset) == (1, 0)
    group = client.group_sharded(T, N, S, G)
    (item,) = group.poll(4)
    assert item.published_at == item.record.published_at and item.published_at.tzinfo is not None
    group.dead_letter(item, "bad card")
    (letter,) = client.group_dead_letters(T, N, S, 1, G)
    assert letter.time == letter.dead_at and letter.time.tzinfo is not None
    assert letter.time >= item.published_at


def test_sharded_settle_with_claim_string_is_routed_or_refused(client: felix_redis.Client) -> None:
    """ShardedGroup.ack/nack/extend/dead_letter with a claim string leak AttributeError."""
    client.stream_create(T, N, S, shards=4)
    client.group_create(T, N, S, G)
    client.publish(T, N, S, b"x", shard=2)
    group = client.group_sharded(T, N, S, G)
    (item,) = group.poll(4)
    with pytest.raises(felix_redis.InvalidArgument):
        group.ack("not a claim")  # type: ignore[arg-type]
    # a claim string names its shard: it can be routed like an Item
    assert group.nack(item.claim) is False  # type: ignore[arg-type]


def test_sharded_batches_reload_scripts_after_script_flush(redis_client: felix_redis.Client, raw) -> None:
    """A batch's calls answered NOSCRIPT did not run: the scripts are loaded and only
    those calls are sent again (a restarted or newly promoted server has none)."""
    redis_client.stream_create(T, N, S, shards=3)
    redis_client.group_create(T, N, S, G)
    for shard in range(3):
        redis_client.publish_batch(T, N, S, [b"a", b"b"], shard=shard)
    group = redis_client.group_sharded(T, N, S, G)
    raw.script_flush()
    items = group.poll(6)
    assert sorted(i.claim for i in items) == sorted(f"{s}:{o}:1" for s in range(3) for o in range(2))
    raw.script_flush()
    assert group.ack_many(items) == 6
    assert redis_client.group_describe(T, N, S, G).lag == 0
