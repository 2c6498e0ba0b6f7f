"""The client's reads for operators and the dashboard: stream_overview, has_role,
group_consumers, group_dead_letters_all, read_at; and the describes that pipeline their
shards (a constant number of round trips whatever the shard count)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import felix_redis
from felix_redis import InvalidArgument, NotFound
from felix_redis.models import GroupInfo

T, N, S, G = "acme", "prod", "jobs", "workers"
A = (T, N, S)


@pytest.fixture
def filled(client: felix_redis.Client) -> felix_redis.Client:
    client.stream_create(*A, shards=4)
    client.group_create(*A, G)
    client.group_create(*A, "audit")
    for i in range(12):
        client.publish(*A, f"r{i}".encode(), shard=i % 4)
    got = client.group_poll(*A, 1, G, max_records=3)
    client.group_dead_letter(*A, 1, G, got[0].claim, reason="bad")
    return client


class Counted:
    """Counts the round trips a sync client sends (one per op its driver runs; a
    pipelined Batch is one)."""

    def __init__(self, client: felix_redis.Client) -> None:
        self.client, self.count = client, 0

    def __enter__(self) -> Counted:
        original = self.client._execute_once

        def counted(op: Any) -> Any:
            self.count += 1
            return original(op)
        self.client._execute_once = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.client._execute_once


def test_stream_overview_is_describe_and_every_group(filled: felix_redis.Client) -> None:
    info, groups = filled.stream_overview(*A)
    assert info == filled.stream_describe(*A)
    assert list(groups) == ["audit", G]
    for name, got in groups.items():
        assert isinstance(got, GroupInfo)
        want = filled.group_describe(*A, name)
        assert [(s.lag, s.pending, s.in_flight, s.dead) for s in got.shards] == \
            [(s.lag, s.pending, s.in_flight, s.dead) for s in want.shards]
    assert groups[G].dead == 1 and groups[G].in_flight == 2 and groups["audit"].pending == 12
    with pytest.raises(NotFound):
        filled.stream_overview(T, N, "nope")


@pytest.mark.parametrize("shards", [1, 4, 16])
def test_describes_take_the_same_round_trips_whatever_the_shard_count(
    client: felix_redis.Client, shards: int
) -> None:
    client.stream_create(*A, shards=shards)
    client.group_create(*A, G)
    client.group_create(*A, "audit")
    client.stream_describe(*A)  # the settings cache is warm, as in a running dashboard
    client.group_describe(*A, G)
    calls = {}
    for name, read in (("stream_describe", lambda: client.stream_describe(*A)),
                       ("group_describe", lambda: client.group_describe(*A, G)),
                       ("stream_overview", lambda: client.stream_overview(*A)),
                       ("group_consumers", lambda: client.group_consumers(*A, G)),
                       ("group_dead_letters_all", lambda: client.group_dead_letters_all(*A, G)),
                       ("read_at", lambda: client.read_at(*A, [(s, 0) for s in range(shards)]))):
        with Counted(client) as counted:
            read()
        calls[name] = counted.count
    assert calls == {"stream_describe": min(shards, 2), "group_describe": 1, "stream_overview": 2,
                     "group_consumers": 1, "group_dead_letters_all": 1, "read_at": 1}


def test_group_consumers_lists_named_leases(filled: felix_redis.Client) -> None:
    assert filled.group_consumers(*A, G) == {}
    filled.group_poll_as(*A, 0, G, "alice", max_records=2)
    filled.group_poll_as(*A, 2, G, "bob", max_records=1)
    filled.group_poll_as(*A, 3, G, "alice", max_records=1)
    assert filled.group_consumers(*A, G) == {"alice": ["0:0", "0:1", "3:0"], "bob": ["2:0"]}
    filled.group_ack(*A, 0, G, "0:0")
    assert filled.group_consumers(*A, G)["alice"] == ["0:1", "3:0"]
    with pytest.raises(NotFound):
        filled.group_consumers(T, N, "nope", G)
    with pytest.raises(NotFound, match="group nope"):
        filled.group_consumers(*A, "nope")


def test_dead_letters_all_and_read_at(filled: felix_redis.Client) -> None:
    got = filled.group_poll(*A, 2, G, max_records=1)
    filled.group_dead_letter(*A, 2, G, got[0].claim, reason="worse")
    letters = filled.group_dead_letters_all(*A, G)
    assert [(d.shard, d.offset, d.reason) for d in letters] == [(1, 0, "bad"), (2, 0, "worse")]
    assert letters == [*filled.group_dead_letters(*A, 1, G), *filled.group_dead_letters(*A, 2, G)]
    records = filled.read_at(*A, [(1, 0), (2, 0), (3, 2), (3, 99)])
    assert [r.payload if r else None for r in records] == [b"r1", b"r2", b"r11", None]
    with pytest.raises(NotFound, match="shard 9"):
        filled.read_at(*A, [(9, 0)])
    with pytest.raises(InvalidArgument, match="offset"):
        filled.read_at(*A, [(0, -1)])


def test_has_role_without_acl(filled: felix_redis.Client) -> None:
    assert filled.has_role(*A, "group.manage", G)
    assert filled.has_role(*A, "stream.admin")
    with pytest.raises(InvalidArgument, match="unknown role"):
        filled.has_role(*A, "root")
    with pytest.raises(InvalidArgument, match="name the group"):
        filled.has_role(*A, "group.consume")
    with pytest.raises(InvalidArgument, match="whole stream"):
        filled.has_role(*A, "stream.publish", G)
    with pytest.raises(NotFound):
        filled.has_role(T, N, "nope", "stream.admin")


@pytest.fixture
def acl_users(raw: Any, redis_url: str) -> Iterator[dict[str, felix_redis.Client]]:
    from felix_redis import acl

    admin = felix_redis.connect(redis_url)
    admin.stream_create(*A, shards=2)
    admin.group_create(*A, G)
    made = {}
    for role in ("group.consume", "group.manage"):
        user = f"overview-{role.replace('.', '-')}"
        acl.grant(raw, acl.setuser_args(user, acl.rules(role, T, N, S, G), password="pw-overview"))
        made[role] = felix_redis.connect(redis_url.replace("redis://", f"redis://{user}:pw-overview@", 1))
    yield made
    for role, c in made.items():
        c.close()
        raw.execute_command("ACL", "DELUSER", f"overview-{role.replace('.', '-')}")
    admin.close()


def test_has_role_asks_redis_acl(acl_users: dict[str, felix_redis.Client]) -> None:
    consumer, manager = acl_users["group.consume"], acl_users["group.manage"]
    assert consumer.has_role(*A, "group.consume", G)
    assert not consumer.has_role(*A, "group.manage", G)
    assert not consumer.has_role(*A, "group.consume", "other")
    assert manager.has_role(*A, "group.manage", G)
    assert not manager.has_role(*A, "stream.admin")
    # what has_role says is what the scripts enforce
    with pytest.raises(felix_redis.PermissionDenied):
        consumer.group_redrive(*A, 0, G, None)
    assert manager.group_redrive(*A, 0, G, None) == 0


def test_a_refusal_does_not_turn_the_client_away_from_fcall(
    acl_users: dict[str, felix_redis.Client], redis_url: str,
) -> None:
    """A role's refusal (the script's role check, or ACL refusing a key) says nothing
    about FCALL: the same client goes on working. (It used to switch to EVALSHA for good
    on any NOPERM, which a role user may not run: every later call was refused.)"""
    admin = felix_redis.connect(redis_url)
    admin.group_create(*A, "other")
    admin.stream_create(T, N, "secret")
    admin.publish(*A, b"one", shard=0)
    consumer = acl_users["group.consume"]
    for refused in (lambda: consumer.group_redrive(*A, 0, G, None),        # the script's role check
                    lambda: consumer.group_describe(*A, "other"),           # another group's keys
                    lambda: consumer.stream_describe(T, N, "secret")):      # another stream's keys
        with pytest.raises(felix_redis.PermissionDenied):
            refused()
        assert consumer._runner.functions
        assert consumer.group_describe(*A, G).pending == 1
    assert [r.payload for r in consumer.group_poll(*A, 0, G)] == [b"one"]
    admin.close()
