"""Multi-shard administrative calls are all-or-nothing for the user.

``stream_create``, ``group_create``, ``group_configure``, ``group_delete`` and
``stream_delete`` write one shard after the other. Here the reply of one shard's
script call is lost after Redis ran it (the connection drops under the client, below
its retry layer): a call that is safe to repeat is sent again and completes at once;
the others raise OutcomeUnknown, and then

- what is listed or described never shows a half-made group as whole: a group made on
  some shards only is not listed, and describing it says it does not exist; a group
  deleted from some shards only is still listed (shard 0, written last, still has it)
  and describing it says it is incomplete and how to finish;
- running the same call again completes it on every shard.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

import felix_redis
import felix_redis.lane as lane_module

T, N, S, G = "acme", "prod", "orders", "workers"
SHARDS = 4


@pytest.fixture
def lose_reply(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, int], list[int]]:
    """``lose_reply(function, n)``: the n-th later script call whose command names
    ``function`` runs on Redis, then its connection drops before the reply is read.
    Returns the list that counts those calls."""

    def arm(script: str, nth: int) -> list[int]:
        real = lane_module._send_read
        seen: list[int] = []

        def send_read(conn: Any, args: Any) -> Any:
            reply = real(conn, args)
            if str(args[0]) in ("FCALL", "EVALSHA") and str(args[1]).endswith(script):
                seen.append(1)
                if len(seen) == nth:
                    conn.disconnect()
                    raise RedisConnectionError("injected: the connection dropped before the reply")
            return reply

        monkeypatch.setattr(lane_module, "_send_read", send_read)
        return seen

    return arm


@pytest.fixture
def c(redis_url: str, raw: redis.Redis) -> Iterator[felix_redis.Client]:
    raw.flushdb()
    client = felix_redis.connect(redis_url)
    client.stream_create(T, N, S, shards=SHARDS)
    yield client
    client.close()


def group_shards(c: felix_redis.Client, raw: redis.Redis, group: str) -> list[int]:
    """The shards whose group hash exists."""
    name = c.core.name(T, N, S)  # laid out as the stream's shard 0 says (spread tags)
    return [shard for shard in range(SHARDS) if raw.exists(name.group_key_list(shard, group)[0])]


def meta_shards(c: felix_redis.Client, raw: redis.Redis, stream: str) -> list[int]:
    """The shards whose meta hash exists."""
    name = c.core.name(T, N, stream)
    return [shard for shard in range(SHARDS) if raw.exists(name.shard_keys(shard)[0])]


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_group_create_cut_short_is_not_listed_and_completes_when_run_again(
    c: felix_redis.Client, raw: redis.Redis, lose_reply: Callable[[str, int], list[int]], nth: int
) -> None:
    lose_reply("group_create", SHARDS + nth)  # the check pass makes SHARDS calls first
    with pytest.raises(felix_redis.OutcomeUnknown, match="may or may not have taken effect"):
        c.group_create(T, N, S, "half")
    made = group_shards(c, raw, "half")
    assert made == list(range(SHARDS - nth, SHARDS))  # the last shards first, shard 0 last
    assert "half" not in c.group_list(T, N, S)
    with pytest.raises(felix_redis.NotFound):
        c.group_describe(T, N, S, "half")
    c.group_create(T, N, S, "half")
    assert group_shards(c, raw, "half") == list(range(SHARDS))
    assert "half" in c.group_list(T, N, S)
    assert len(c.group_describe(T, N, S, "half").shards) == SHARDS
    with pytest.raises(felix_redis.GroupExists):
        c.group_create(T, N, S, "half")


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_group_delete_cut_short_stays_listed_says_incomplete_and_completes_when_run_again(
    c: felix_redis.Client, raw: redis.Redis, lose_reply: Callable[[str, int], list[int]], nth: int
) -> None:
    c.group_create(T, N, S, G)
    c.publish_batch(T, N, S, [b"a", b"b"], shard=SHARDS - 1)
    assert len(c.group_poll(T, N, S, SHARDS - 1, G)) == 2  # some state to delete
    lose_reply("group_delete", SHARDS + nth)
    with pytest.raises(felix_redis.OutcomeUnknown):
        c.group_delete(T, N, S, G)
    assert group_shards(c, raw, G) == list(range(SHARDS - nth))
    assert G in c.group_list(T, N, S)
    with pytest.raises(felix_redis.NotFound, match=r"incomplete.*run group_delete again"):
        c.group_describe(T, N, S, G)
    with pytest.raises(felix_redis.GroupExists):  # not made again over what is left
        c.group_create(T, N, S, G)
    c.group_delete(T, N, S, G)
    assert group_shards(c, raw, G) == []
    assert not raw.keys(f"felix:{{{T}/{N}/{S}/*}}:g:{G}*")
    assert G not in c.group_list(T, N, S)


def test_a_stream_delete_cut_short_completes_when_run_again(
    c: felix_redis.Client, raw: redis.Redis, lose_reply: Callable[[str, int], list[int]]
) -> None:
    c.group_create(T, N, S, G)
    lose_reply("stream_delete", 2)
    with pytest.raises(felix_redis.OutcomeUnknown):
        c.stream_delete(T, N, S)
    # shards 3 and 2 are gone; shard 0, deleted last, still holds the settings
    assert meta_shards(c, raw, S) == [0, 1]
    assert (T, N, S) in c.stream_list(T, N)
    c.stream_delete(T, N, S)
    assert not raw.keys(f"felix:{{{T}/{N}/{S}/*")
    assert (T, N, S) not in c.stream_list(T, N)
    with pytest.raises(felix_redis.NotFound):
        c.stream_delete(T, N, S)


def test_a_stream_delete_that_left_the_registry_behind_is_finished_by_the_next(
    c: felix_redis.Client, raw: redis.Redis
) -> None:
    """Every shard deleted, the registry entry not (the call stopped just before): the
    stream is listed but gone; deleting it again says NotFound and unlists it."""
    name = c.core.name(T, N, S)
    for shard in range(SHARDS):
        raw.delete(*name.info_keys(shard))  # meta, log, groups and conf: the shard is gone
    assert (T, N, S) in c.stream_list(T, N)
    with pytest.raises(felix_redis.NotFound):
        c.stream_delete(T, N, S)
    assert (T, N, S) not in c.stream_list(T, N)


@pytest.mark.parametrize("script", ["stream_create", "group_configure"])
def test_safe_admin_calls_are_sent_again_and_complete_in_the_same_call(
    c: felix_redis.Client, raw: redis.Redis, lose_reply: Callable[[str, int], list[int]], script: str
) -> None:
    c.group_create(T, N, S, G)
    seen = lose_reply(script, SHARDS + 2)
    if script == "stream_create":
        assert c.stream_create(T, N, "fresh", shards=SHARDS) is True
        assert meta_shards(c, raw, "fresh") == list(range(SHARDS))
    else:
        c.group_configure(T, N, S, G, max_attempts=9)
        assert c.group_describe(T, N, S, G).max_attempts == 9
        name = c.core.name(T, N, S)
        assert {int(raw.hget(name.group_key_list(s, G)[0], "max") or 0) for s in range(SHARDS)} == {9}
    assert len(seen) > SHARDS + 2  # the lost call was sent again


def test_felixctl_stream_create_refuses_replication_the_server_cannot_hold(redis_url: str, raw: redis.Redis) -> None:
    """docs/cli.md's first example runs on a standalone Redis; --replication 2 there
    fails (1) naming both numbers and writes nothing; --force creates it with a warning."""
    raw.flushdb()
    env = {**os.environ, "FELIX_REDIS_URL": redis_url}

    def felixctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "felixctl", *args], capture_output=True, text=True,
                              env=env, timeout=60, stdin=subprocess.DEVNULL)

    done = felixctl("stream", "create", "jobs", "--kind", "queue", "--shards", "4")
    assert done.returncode == 0, done.stderr
    refused = felixctl("stream", "create", "payments", "--replication", "2")
    assert refused.returncode == 1
    assert "replication=2 asks for 2 copies" in refused.stderr and "has 1 now" in refused.stderr
    assert "--force" in refused.stderr and refused.stdout == ""
    assert not raw.keys("felix:{default/default/payments/*")
    forced = felixctl("stream", "create", "payments", "--replication", "2", "--force")
    assert forced.returncode == 0, forced.stderr
    assert "felixctl: warning:" in forced.stderr and "created anyway" in forced.stderr
