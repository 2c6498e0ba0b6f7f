"""Retention: per-stream limits by length and age, 'safe' for queues by default (never
trims what a group has not finished), 'bounded' on request (trims, and every group counts
what it lost), and a clear error when a trimmed dead letter is redriven."""

from __future__ import annotations

import time

import pytest
from click.testing import CliRunner

import felix_redis
from felixctl.cli import cli as felixctl

T, N = "acme", "prod"


def publish(client: felix_redis.Client, stream: str, count: int, shard: int = 0) -> None:
    for start in range(0, count, 100):
        client.publish_batch(T, N, stream, [f"r{i}".encode() for i in range(start, min(count, start + 100))],
                             shard=shard)


def firsts(client: felix_redis.Client, stream: str) -> list[int]:
    return client.stream_describe(T, N, stream).firsts


def drain(client: felix_redis.Client, stream: str, group: str, upto: int, shard: int = 0) -> list[int]:
    """Polls and acks records until offset ``upto`` (exclusive) is handed out."""
    seen: list[int] = []
    while not seen or seen[-1] < upto - 1:
        records = client.group_poll(T, N, stream, shard, group, max_records=min(100, upto - len(seen)))
        assert records, "ran out of records"
        client.group_ack_many(T, N, stream, shard, group, records)
        seen += [r.offset for r in records]
    return seen


def test_safe_queue_never_trims_what_a_group_has_not_finished(client: felix_redis.Client) -> None:
    client.stream_create(T, N, "q", retention_max_len=50)
    client.group_create(T, N, "q", "fast")
    client.group_create(T, N, "q", "slow")
    publish(client, "q", 200)
    assert client.stream_trim(T, N, "q") == 0, "no group has finished anything"
    drain(client, "q", "fast", 200)
    drain(client, "q", "slow", 120)
    client.stream_trim(T, N, "q")
    assert firsts(client, "q") == [120], "the slow group's position holds the cut"
    drain(client, "q", "slow", 200)
    client.stream_trim(T, N, "q")
    assert firsts(client, "q") == [150], "then the length limit decides"
    for group in ("fast", "slow"):
        shard = client.group_describe(T, N, "q", group).shards[0]
        assert (shard.trimmed, shard.position, shard.lag) == (0, 200, 0)


def test_a_deleted_group_holds_nothing_back(client: felix_redis.Client) -> None:
    """group_delete leaves the name in the shard's groups set (a group manager may not
    SREM); a name without its group hash counts as no group, also for retention."""
    client.stream_create(T, N, "q", retention_max_len=50)
    client.group_create(T, N, "q", "fast")
    client.group_create(T, N, "q", "gone")
    publish(client, "q", 200)
    drain(client, "q", "fast", 200)
    client.stream_trim(T, N, "q")
    assert firsts(client, "q") == [0], "the other group has not finished anything"
    client.group_delete(T, N, "q", "gone")
    assert b"gone" in client.redis.smembers(client.core.name(T, N, "q").groups_key(0))
    client.stream_trim(T, N, "q")
    assert firsts(client, "q") == [150], "the length limit decides"
    assert client.stream_describe(T, N, "q").groups == ["fast"]


def test_unfinished_record_holds_the_cut_and_is_delivered_later(client: felix_redis.Client) -> None:
    client.stream_create(T, N, "q", retention_max_len=10)
    client.group_create(T, N, "q", "g")
    publish(client, "q", 30)
    first, *rest = client.group_poll(T, N, "q", 0, "g", max_records=30)
    client.group_ack_many(T, N, "q", 0, "g", rest)
    client.group_nack(T, N, "q", 0, "g", first)
    publish(client, "q", 100)  # publishing trims too
    assert firsts(client, "q") == [0], "offset 0 is owed, so nothing may go"
    (again,) = client.group_poll(T, N, "q", 0, "g", max_records=1)
    assert (again.offset, again.attempts, again.payload) == (0, 2, b"r0")


def test_publishing_applies_retention_as_the_log_grows(client: felix_redis.Client) -> None:
    client.stream_create(T, N, "q", retention_max_len=100)
    client.group_create(T, N, "q", "g")
    publish(client, "q", 100)
    drain(client, "q", "g", 100)
    publish(client, "q", 300)
    info = client.stream_describe(T, N, "q")
    assert info.firsts[0] == 100, "the finished records were trimmed while publishing, no others"
    drain(client, "q", "g", 400)
    client.publish(T, N, "q", b"one more")
    info = client.stream_describe(T, N, "q")
    assert info.tails[0] - info.firsts[0] <= 100 + 10 + 1, "at most the limit plus its slack"


def test_stream_without_groups_trims_to_the_limit(client: felix_redis.Client) -> None:
    client.stream_create(T, N, "q", retention_max_len=25, shards=2)
    publish(client, "q", 60, shard=0)
    publish(client, "q", 10, shard=1)
    client.stream_trim(T, N, "q")  # publishing already trimmed most of it
    assert firsts(client, "q") == [35, 0]
    assert client.stream_trim(T, N, "q") == 0, "trimming again changes nothing"
    records = client.read(T, N, "q", 0, 0, 100)
    assert [r.offset for r in records] == list(range(35, 60)), "reads start at the first record kept"


def test_bounded_mode_counts_every_record_a_group_lost(client: felix_redis.Client) -> None:
    client.stream_create(T, N, "b", retention_max_len=20, retention_mode="bounded")
    client.group_create(T, N, "b", "g")
    publish(client, "b", 10)
    held = client.group_poll(T, N, "b", 0, "g", max_records=3)  # offsets 0-2 in flight
    owed = held[1]
    client.group_nack(T, N, "b", 0, "g", owed)  # offset 1 owed
    publish(client, "b", 90)
    client.stream_trim(T, N, "b")
    assert firsts(client, "b") == [80]
    before = client.group_describe(T, N, "b", "g").shards[0]
    assert before.trimmed == 80 - 3, "never-delivered records the group lost are counted at once"
    assert client.group_ack(T, N, "b", 0, "g", held[0]), "an ack needs no record"
    records = client.group_poll(T, N, "b", 0, "g", max_records=100)
    assert [r.offset for r in records] == list(range(80, 100)), "the owed record went with the log"
    client.group_ack_many(T, N, "b", 0, "g", [*records, held[2]])
    after = client.group_describe(T, N, "b", "g").shards[0]
    assert after.trimmed == 80 - 3 + 1, "the owed offset 1 counts as lost too"
    assert (after.position, after.lag, after.owed, after.in_flight) == (100, 0, 0, 0)


def test_kind_stream_trims_whatever_the_groups_hold(client: felix_redis.Client) -> None:
    client.stream_create(T, N, "log", kind="stream", retention_max_len=10)
    client.group_create(T, N, "log", "g")
    publish(client, "log", 50)
    client.stream_trim(T, N, "log")
    assert firsts(client, "log") == [40]
    assert client.group_describe(T, N, "log", "g").shards[0].trimmed == 40


def test_age_limit(client: felix_redis.Client) -> None:
    client.stream_create(T, N, "q", retention_max_age=1)
    publish(client, "q", 30)
    assert client.stream_trim(T, N, "q") == 0, "nothing is a second old yet"
    time.sleep(1.1)
    publish(client, "q", 5)
    client.stream_trim(T, N, "q")
    assert firsts(client, "q") == [30], "only the records older than a second went"


def test_redriving_a_trimmed_dead_letter_is_a_clear_error(client: felix_redis.Client) -> None:
    client.stream_create(T, N, "b", retention_max_len=5, retention_mode="bounded")
    client.group_create(T, N, "b", "g")
    publish(client, "b", 2)
    poison, fine = client.group_poll(T, N, "b", 0, "g", max_records=2)
    client.group_dead_letter(T, N, "b", 0, "g", poison, reason="bad")
    client.group_ack(T, N, "b", 0, "g", fine)
    publish(client, "b", 20)
    client.stream_trim(T, N, "b")
    with pytest.raises(felix_redis.NotFound, match="trimmed"):
        client.group_redrive(T, N, "b", 0, "g", [0])
    assert client.group_redrive(T, N, "b", 0, "g") == 0, "redrive of all leaves trimmed ones in place"
    assert [d.offset for d in client.group_dead_letters(T, N, "b", 0, "g")] == [0]
    assert client.group_discard(T, N, "b", 0, "g", [0]) == 1


def test_safe_queue_after_soak_keeps_no_group_state(client: felix_redis.Client, backend: tuple[str, object]) -> None:
    client.stream_create(T, N, "q", retention_max_len=100)
    client.group_create(T, N, "q", "g")
    for _ in range(10):
        publish(client, "q", 200)
        records = client.group_poll(T, N, "q", 0, "g", max_records=200)
        client.group_ack_many(T, N, "q", 0, "g", records)
    client.stream_trim(T, N, "q")
    raw = backend[1]
    keys = client.group_keys(T, N, "q", "g")[0]
    for role in ("lease", "owed", "attempts", "done", "redo", "dead", "owner", "byowner", "held"):
        assert not raw.exists(keys[role]), f"{role} left behind"
    assert raw.xlen(keys["log"]) == 100


def test_retention_settings_are_validated_and_shown(client: felix_redis.Client) -> None:
    with pytest.raises(felix_redis.InvalidArgument, match="retention_mode"):
        client.stream_create(T, N, "x", retention_mode="sometimes")
    client.stream_create(T, N, "x", retention_max_len=5, retention_mode="bounded")
    info = client.stream_describe(T, N, "x")
    assert (info.retention_max_len, info.retention_mode) == (5, "bounded")
    with pytest.raises(felix_redis.StreamExists):
        client.stream_create(T, N, "x", retention_max_len=5)


def test_cli_stream_trim(backend: tuple[str, object], client: felix_redis.Client) -> None:
    client.stream_create(T, N, "q", retention_max_len=5)
    client.group_create(T, N, "q", "g")
    publish(client, "q", 20)  # the group holds everything: nothing trimmed yet
    drain(client, "q", "g", 20)
    runner = CliRunner()
    args = ["--redis-url", backend[0], "--tenant", T, "--namespace", N]
    result = runner.invoke(felixctl, [*args, "stream", "trim", "q"])
    assert result.exit_code == 0, result.output
    assert "15 records trimmed" in result.output
    result = runner.invoke(felixctl, [*args, "stream", "describe", "q"])
    assert "bounded" not in result.output and "(safe)" in result.output


# ------------------------------------- retention against records that are unfinished again

#: What makes a record unfinished (again) while everything around it is finished: the
#: record is offset 5 of 30, and every other record is acked.
CAUSES = ["nack", "lapse", "reclaim", "redrive below the position", "redrive above the position"]
#: The attempts of the record's next delivery, by cause.
NEXT_ATTEMPTS = {"nack": 2, "lapse": 2, "reclaim": 2, "redrive below the position": 1,
                 "redrive above the position": 1}


def unfinish_offset_5(client: felix_redis.Client, stream: str, cause: str) -> None:
    """30 records r0..r29; all but r5 finished; r5 unfinished because of ``cause``."""
    client.group_create(T, N, stream, "g", visibility_timeout_ms=60_000)
    publish(client, stream, 30)
    poll = lambda n: client.group_poll(T, N, stream, 0, "g", max_records=n)  # noqa: E731
    ack = lambda records: client.group_ack_many(T, N, stream, 0, "g", records)  # noqa: E731
    if cause in ("lapse", "reclaim"):
        ack(poll(5))
        if cause == "lapse":
            (r5,) = poll(1)
        else:
            (r5,) = client.group_poll_as(T, N, stream, 0, "g", consumer="w1", max_records=1)
        ack(poll(24))
        assert r5.offset == 5
        if cause == "lapse":
            # the lease runs out 0.2 s from now, once everything else is finished (the
            # next poll notices)
            client.group_extend(T, N, stream, 0, "g", r5, by=0.2)
            time.sleep(0.3)
    elif cause == "nack":
        records = poll(30)
        client.group_nack(T, N, stream, 0, "g", records[5])
        ack(records[:5] + records[6:])
    elif cause == "redrive below the position":
        records = poll(30)
        client.group_dead_letter(T, N, stream, 0, "g", records[5], reason="poison")
        ack(records[:5] + records[6:])
        assert client.group_describe(T, N, stream, "g").shards[0].position == 30
        assert client.group_redrive(T, N, stream, 0, "g", [5]) == 1
    elif cause == "redrive above the position":
        (r0,) = poll(1)
        records = poll(29)
        client.group_dead_letter(T, N, stream, 0, "g", records[4], reason="poison")
        ack(records[:4] + records[5:])
        assert client.group_redrive(T, N, stream, 0, "g", [5]) == 1  # above the position 0
        ack([r0])
    else:
        raise AssertionError(cause)
    assert client.group_describe(T, N, stream, "g").shards[0].position == 5


def check_offset_5_survives(client: felix_redis.Client, stream: str, cause: str) -> None:
    """Retention trimmed up to offset 5 and no further; r5 is delivered next, then the rest."""
    client.stream_trim(T, N, stream)
    assert firsts(client, stream) == [5], f"{cause}: the cut must stop at the unfinished offset 5"
    if cause == "reclaim":
        got = client.group_poll_as(T, N, stream, 0, "g", consumer="w1", reclaim=True, max_records=1)
    else:
        got = client.group_poll(T, N, stream, 0, "g", max_records=1)
    assert [(r.offset, r.attempts, r.payload) for r in got] == [(5, NEXT_ATTEMPTS[cause], b"r5")], cause
    client.group_ack(T, N, stream, 0, "g", got[0])
    rest = client.group_poll(T, N, stream, 0, "g", max_records=100)
    assert [r.offset for r in rest] == list(range(30, client.stream_describe(T, N, stream).tails[0])), cause
    client.group_ack_many(T, N, stream, 0, "g", rest)
    shard = client.group_describe(T, N, stream, "g").shards[0]
    assert (shard.trimmed, shard.lag, shard.owed, shard.in_flight) == (0, 0, 0, 0), cause


@pytest.mark.parametrize("cause", CAUSES)
def test_a_record_unfinished_again_survives_the_length_limit(client: felix_redis.Client, cause: str) -> None:
    """Trimming by length, by publishing past the limit and by stream_trim, stops at a
    record a nack, a lapse, a reclaim or a redrive (below or above the position) made
    unfinished again; the record is delivered."""
    client.stream_create(T, N, "q", retention_max_len=10)
    unfinish_offset_5(client, "q", cause)
    publish(client, "q", 20)  # past the limit and its slack: publishing trims
    assert firsts(client, "q") == [5], f"{cause}: publishing trimmed past the unfinished offset 5"
    check_offset_5_survives(client, "q", cause)


def test_records_unfinished_again_survive_the_age_limit(client: felix_redis.Client) -> None:
    """As above with an age limit: every record is older than the limit when trimmed."""
    streams = {cause: f"age-{i}" for i, cause in enumerate(CAUSES)}
    for cause, stream in streams.items():
        client.stream_create(T, N, stream, retention_max_age=1)
        unfinish_offset_5(client, stream, cause)
    time.sleep(1.1)  # every record is past the age limit
    for cause, stream in streams.items():
        publish(client, stream, 5)  # publishing trims by age
        assert firsts(client, stream) == [5], f"{cause}: publishing trimmed past the unfinished offset 5"
        check_offset_5_survives(client, stream, cause)
