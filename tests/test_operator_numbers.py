"""Issue 25, what an operator meets: honest numbers (unfinished beside lag, trimmed shown),
per-claim outcomes of an ack, claims parsed strictly, and errors and help texts that say
what is true. The CLI items run felixctl as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

import felix_redis
from felix_redis import InvalidArgument, NotFound, StaleClaim, parse_claim
from felix_redis.metrics import GroupCollector

T, N, S, G = "acme", "prod", "jobs", "workers"
DOCS = Path(__file__).resolve().parent.parent / "docs"


def felixctl(redis_url: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FELIX_")}
    return subprocess.run(
        [sys.executable, "-m", "felixctl", "--redis-url", redis_url, "--tenant", T, "--namespace", N, *args],
        capture_output=True, timeout=timeout, env=env, text=True,
    )


def held_back(client: felix_redis.Client) -> None:
    """10 records on one shard: 0 in flight, 1 and 2 acked, 3 owed, 4..9 pending:
    lag 10 (the acked 1 and 2 count), unfinished 8."""
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G)
    for i in range(10):
        client.publish(T, N, S, f"r{i}")
    records = client.group_poll(T, N, S, 0, G, max_records=4)
    assert [r.offset for r in records] == [0, 1, 2, 3]
    assert client.group_ack_many(T, N, S, 0, G, records[1:3]) == [True, True]
    client.group_nack(T, N, S, 0, G, records[3], delay=300)


# -- 1. unfinished beside lag


def test_unfinished_is_pending_owed_and_in_flight_where_lag_is_tail_minus_position(
        client: felix_redis.Client) -> None:
    held_back(client)
    info = client.group_describe(T, N, S, G)
    [shard] = info.shards
    assert (shard.lag, shard.pending, shard.owed, shard.in_flight) == (10, 6, 1, 1)
    assert shard.unfinished == 8 and info.unfinished == 8


def test_unfinished_in_json_text_and_metrics(raw: redis.Redis, redis_url: str) -> None:
    client = felix_redis.connect(redis_url)
    try:
        held_back(client)
        doc = json.loads(felixctl(redis_url, "group", "describe", S, G, "-o", "json").stdout)
        assert (doc["unfinished"], doc["lag"]) == (8, 10)
        assert doc["shards"][0]["unfinished"] == 8
        lines = felixctl(redis_url, "group", "describe", S, G).stdout.splitlines()
        header, row = lines[1].split(), lines[2].split()
        assert dict(zip(header, row, strict=False))["UNFINISHED"] == "8"
        families = {f.name: f for f in GroupCollector(client).collect()}
        [sample] = families["felix_group_unfinished"].samples
        assert sample.value == 8
        # lag is no longer described as "everything not finished"
        assert "not finished yet" not in families["felix_group_lag"].documentation
        assert "tail - position" in families["felix_group_lag"].documentation.lower()
    finally:
        client.close()


def test_docs_describe_lag_as_tail_minus_position_and_alert_on_unfinished() -> None:
    cli, concepts = (DOCS / "cli.md").read_text(), (DOCS / "concepts.md").read_text()
    operations, worker = (DOCS / "operations.md").read_text(), (DOCS / "worker.md").read_text()
    assert "everything unfinished, in flight included" not in cli
    assert "everything not finished, in flight included" not in concepts
    assert "records not finished (tail - position)" not in worker
    assert "UNFINISHED" in cli and "**unfinished**" in concepts and "felix_group_unfinished" in worker
    alerting = operations[operations.index("## What to alert on"):operations.index("## Where the data lives")]
    assert "`unfinished`" in alerting and "`oldest_unfinished_age_ms`" in alerting
    assert "| `lag` | records not finished" not in alerting


# -- 2. each claim of an ack on its own


def test_ack_many_settles_the_others_when_one_was_never_delivered(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G)
    for i in range(5):
        client.publish(T, N, S, f"r{i}")
    records = client.group_poll(T, N, S, 0, G, max_records=4)
    client.group_ack(T, N, S, 0, G, records[0])
    with pytest.raises(NotFound, match="record 50 has not been delivered") as raised:
        client.group_ack_many(T, N, S, 0, G, [records[3], 50, records[0], records[1]])
    assert getattr(raised.value, "outcomes", None) == [True, None, False, True]
    assert getattr(raised.value, "records", None) == ["0:50"]
    [shard] = client.group_describe(T, N, S, G).shards
    assert (shard.position, shard.in_flight) == (2, 1), "0, 1 and 3 are finished; 2 still held"
    # one never delivered on its own: NotFound, as before
    with pytest.raises(NotFound, match="not been delivered"):
        client.group_ack(T, N, S, 0, G, 4)


def test_sharded_ack_many_settles_the_others(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S, shards=2)
    client.group_create(T, N, S, G)
    for i in range(4):
        client.publish(T, N, S, f"r{i}", shard=i % 2)
    group = client.group_sharded(T, N, S, G)
    items = group.poll(4)
    assert len(items) == 4
    with pytest.raises(NotFound, match="0:9") as raised:
        group.ack_many([*items, "0:9:1"])
    assert getattr(raised.value, "records", None) == ["0:9"]
    info = client.group_describe(T, N, S, G)
    assert (info.in_flight, info.unfinished, [s.position for s in info.shards]) == (0, 0, [2, 2])


def test_a_polls_acks_still_go_all_together(client: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    """A poll has no place to report an ack's outcome: a never-delivered one fails the
    poll before anything is written (docs/concepts.md)."""
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G)
    client.publish(T, N, S, "a")
    client.publish(T, N, S, "b")
    [first] = client.group_poll(T, N, S, 0, G, max_records=1)
    with unchanged(), pytest.raises(NotFound, match="not been delivered"):
        client.group_poll(T, N, S, 0, G, ack=[first, 1])


def test_felixctl_ack_reports_each_claim(raw: redis.Redis, redis_url: str) -> None:
    client = felix_redis.connect(redis_url)
    try:
        client.stream_create(T, N, "q", shards=2)
        client.group_create(T, N, "q", "wk")
        for i in range(8):
            client.publish(T, N, "q", f"r{i}", shard=i % 2)
        client.group_poll(T, N, "q", 0, "wk", max_records=4)
        client.group_poll(T, N, "q", 1, "wk", max_records=4)
        result = felixctl(redis_url, "group", "ack", "q", "wk", "0:3:1", "0:50:1", "1:2:1")
        assert result.returncode == 1, result
        assert result.stdout.splitlines() == ["acked 0:3:1", "acked 1:2:1"]
        [line] = result.stderr.splitlines()
        assert line.startswith("felixctl: error: 1 of 3 failed: 0:50:1: ") and "not been delivered" in line
        shards = client.group_describe(T, N, "q", "wk").shards
        assert [s.in_flight for s in shards] == [3, 3], "0:3 and 1:2 were acked"
        # malformed claims and a shard the stream lacks: reported, the others acked all the same
        result = felixctl(redis_url, "group", "ack", "q", "wk", "bogus", "0:2:1", "0:01:1", "7:1:1", "1:1:1")
        assert result.returncode == 1, result
        assert result.stdout.splitlines() == ["acked 0:2:1", "acked 1:1:1"]
        [line] = result.stderr.splitlines()
        assert line.startswith("felixctl: error: 3 of 5 failed: ")
        assert "bogus: " in line and "0:01:1: " in line and "shard 7 does not exist" in line
        shards = client.group_describe(T, N, "q", "wk").shards
        assert [s.in_flight for s in shards] == [2, 2], "0:2 and 1:1 were acked too"
    finally:
        client.close()


# -- 3. the docs say what an older claim does


def test_docs_say_an_older_claim_of_an_unfinished_record_is_acked(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G, visibility_timeout_ms=1000)
    client.publish(T, N, S, "a")
    [first] = client.group_poll(T, N, S, 0, G)
    client.group_nack(T, N, S, 0, G, first)
    [again] = client.group_poll(T, N, S, 0, G)
    assert again.attempts == 2
    with pytest.raises(StaleClaim):
        client.group_nack(T, N, S, 0, G, first)
    assert client.group_ack(T, N, S, 0, G, first) is True  # the older claim finishes it
    cli = " ".join((DOCS / "cli.md").read_text().split())
    assert "A claim whose lease lapsed or that was delivered again since is stale: 1" not in cli
    assert "an older claim of a record still unfinished (owed, or in flight under a newer lease) finishes it" in cli
    # ack settles each claim on its own, a malformed one too: it is not among the commands refused whole
    assert "Commands that take several claims (`ack`," not in cli
    assert "`ack` settles each claim on its own" in cli


# -- 4. a refused redrive prints no count


def test_refused_redrive_prints_nothing_on_stdout(raw: redis.Redis, redis_url: str) -> None:
    from felix_redis import acl

    admin = felix_redis.connect(redis_url)
    user, password = f"felixop{os.getpid()}", "pw-op-25"
    try:
        admin.stream_create(T, N, S)
        admin.group_create(T, N, S, G)
        admin.publish(T, N, S, "x")
        [record] = admin.group_poll(T, N, S, 0, G)
        admin.group_dead_letter(T, N, S, 0, G, record)
        acl.grant(raw, acl.setuser_args(user, acl.rules("group.consume", T, N, S, G), password=password))
        as_user = redis_url.replace("redis://", f"redis://{user}:{password}@", 1)
        result = felixctl(as_user, "group", "redrive", S, G, "0:0")
        assert result.returncode == 1, result
        assert result.stdout == ""
        assert result.stderr.startswith("felixctl: error: ") and len(result.stderr.splitlines()) == 1
        assert len(admin.group_dead_letters(T, N, S, 0, G)) == 1
    finally:
        admin.close()
        raw.execute_command("ACL", "DELUSER", user)


# -- 5. claims in their canonical form only

LENIENT = ["0:1:1 ", " 0:1:1", "0:1:1\n", "\t0:1:1", "+0:1:1", "0:+1:1", "0:1:+1", "0:1_0:1", "0:1:1_0",
           "00:1:1", "0:01:1", "0:1:01", "0:00:1", "0 :1:1", "0: 1:1", "-0:1:1", "0:1:1:", "0:\u0661:1"]


@pytest.mark.parametrize("text", LENIENT)
def test_parse_claim_takes_only_the_canonical_form(text: str) -> None:
    with pytest.raises(InvalidArgument, match="malformed claim"):
        parse_claim(text)
    with pytest.raises(InvalidArgument, match="malformed claim"):
        parse_claim(text, attempts_required=False)


def test_canonical_claims_parse() -> None:
    assert parse_claim("0:0:1") == felix_redis.Claim(0, 0, 1)
    assert parse_claim("10:20:3") == felix_redis.Claim(10, 20, 3)
    assert parse_claim("3:0", attempts_required=False) == felix_redis.Claim(3, 0, None)


def test_every_settle_refuses_a_lenient_claim_before_writing(
        client: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G)
    for i in range(12):
        client.publish(T, N, S, f"r{i}")
    client.group_poll(T, N, S, 0, G, max_records=12)
    with unchanged():
        for text in ("0:1:1 ", "0:1_0:1", "0:01:1", "+0:1:1"):
            for op in (client.group_ack, client.group_nack, client.group_extend, client.group_dead_letter):
                with pytest.raises(InvalidArgument, match="malformed claim"):
                    op(T, N, S, 0, G, text)
            with pytest.raises(InvalidArgument, match="malformed claim"):
                client.group_ack_many(T, N, S, 0, G, [text])  # nothing readable: nothing written
            with pytest.raises(InvalidArgument, match="malformed claim"):
                client.group_sharded(T, N, S, G).ack_many(["0:2:1", text])


def test_ack_many_reports_a_malformed_claim_and_settles_the_others(client: felix_redis.Client) -> None:
    """CONTRACT, 'Describe: the unfinished backlog': group_ack_many settles each claim on
    its own; a bad one (never delivered, malformed) is reported and does not stop the others."""
    client.stream_create(T, N, S, shards=2)
    client.group_create(T, N, S, G)
    for i in range(6):
        client.publish(T, N, S, f"r{i}", shard=0)
    records = client.group_poll(T, N, S, 0, G, max_records=5)
    refs = [records[0], "0:1:1 ", "0:1_0:1", 40, "1:0:1", records[2].claim, "junk"]
    with pytest.raises(felix_redis.MalformedClaims, match="malformed claim") as raised:
        client.group_ack_many(T, N, S, 0, G, refs)
    assert raised.value.outcomes == [True, None, None, None, None, True, None]
    assert raised.value.records == ["0:1:1 ", "0:1_0:1", "1:0:1", "junk"]
    assert "record(s) 40 not delivered" in str(raised.value)
    [shard0, _shard1] = client.group_describe(T, N, S, G).shards
    assert (shard0.position, shard0.in_flight) == (1, 3), "0 and 2 acked; 1, 3 and 4 still held"


def test_felixctl_refuses_a_padded_claim(raw: redis.Redis, redis_url: str) -> None:
    client = felix_redis.connect(redis_url)
    try:
        client.stream_create(T, N, S)
        client.group_create(T, N, S, G)
        client.publish(T, N, S, "a")
        client.group_poll(T, N, S, 0, G)
        result = felixctl(redis_url, "group", "ack", S, G, "0:00:1")
        assert result.returncode == 1 and "malformed claim" in result.stderr, result
        assert client.group_describe(T, N, S, G).in_flight == 1
    finally:
        client.close()


# -- 6. trimmed in the text table


def test_describe_text_shows_trimmed_when_not_zero(raw: redis.Redis, redis_url: str) -> None:
    client = felix_redis.connect(redis_url)
    try:
        client.stream_create(T, N, "log", kind="stream", retention_max_len=10)
        client.group_create(T, N, "log", G)
        client.stream_create(T, N, "kept")
        client.group_create(T, N, "kept", G)
        for i in range(50):
            client.publish(T, N, "log", f"r{i}")
        client.stream_trim(T, N, "log")
        lines = felixctl(redis_url, "group", "describe", "log", G).stdout.splitlines()
        row = dict(zip(lines[1].split(), lines[2].split(), strict=True))
        assert row["TRIMMED"] == "40"
        doc = json.loads(felixctl(redis_url, "group", "describe", "log", G, "-o", "json").stdout)
        assert doc["trimmed"] == 40
        assert "TRIMMED" not in felixctl(redis_url, "group", "describe", "kept", G).stdout
        families = {f.name: f for f in GroupCollector(client).collect()}
        trimmed = {s.labels["stream"]: s.value for s in families["felix_group_trimmed"].samples}
        assert trimmed == {"log": 40, "kept": 0}
    finally:
        client.close()


# -- errors that name the fix


def test_an_oversize_single_publish_has_no_index(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S, max_payload=10)
    with pytest.raises(InvalidArgument) as one:
        client.publish(T, N, S, b"x" * 11)
    assert "the payload is 11 bytes" in str(one.value) and "payload 0" not in str(one.value)
    with pytest.raises(InvalidArgument, match="payload 1 is 11 bytes"):
        client.publish_batch(T, N, S, [b"ok", b"x" * 11])


def test_nack_of_attempts_from_the_future_says_no_delivery_matches(
        client: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G)
    for i in range(4):
        client.publish(T, N, S, f"r{i}")
    client.group_poll(T, N, S, 0, G, max_records=4)
    with unchanged(), pytest.raises(StaleClaim) as raised:
        client.group_nack(T, N, S, 0, G, "0:3:7")
    message = str(raised.value)
    assert "does not match any delivery" in message and "delivered again" not in message


def test_the_cli_says_the_same_for_an_oversize_single_publish_and_a_nack_from_the_future(
        redis_url: str, raw: redis.Redis) -> None:
    assert felixctl(redis_url, "stream", "create", S, "--max-payload", "10").returncode == 0
    big = felixctl(redis_url, "pub", S, "x" * 11)
    assert big.returncode != 0 and "the payload is 11 bytes" in big.stderr and "payload 0" not in big.stderr
    assert felixctl(redis_url, "group", "create", S, G).returncode == 0
    assert felixctl(redis_url, "pub", S, "r").returncode == 0
    assert felixctl(redis_url, "group", "poll", S, G).returncode == 0
    future = felixctl(redis_url, "group", "nack", S, G, "0:0:7")
    assert future.returncode != 0 and "does not match any delivery" in future.stderr, future.stderr


# -- CLI help and options


def test_group_keys_help_example_names_one_shard(redis_url: str) -> None:
    text = felixctl(redis_url, "group", "keys", "--help").stdout
    [example] = [line for line in text.splitlines() if "XLEN" in line]
    assert "--shard 0" in example


def test_group_configure_help_shows_no_defaults(redis_url: str) -> None:
    text = " ".join(felixctl(redis_url, "group", "configure", "--help").stdout.split())
    assert "30000" not in text and "or 5" not in text
    assert "unchanged when not given" in text
    create = " ".join(felixctl(redis_url, "group", "create", "--help").stdout.split())
    assert "or 30000" in create  # create does apply the defaults


def test_describe_count_without_watch_is_refused(raw: redis.Redis, redis_url: str) -> None:
    result = felixctl(redis_url, "group", "describe", S, G, "--count", "3")
    assert result.returncode == 2 and "--count" in result.stderr and "--watch" in result.stderr, result


def test_describe_watch_exits_130_on_ctrl_c(raw: redis.Redis, redis_url: str) -> None:
    client = felix_redis.connect(redis_url)
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G)
    client.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FELIX_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "felixctl", "--redis-url", redis_url, "--tenant", T, "--namespace", N,
         "group", "describe", S, G, "--watch", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 20
        while "OLDEST-UNFINISHED" not in proc.stdout.readline():
            assert time.monotonic() < deadline and proc.poll() is None, "no table drawn"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
