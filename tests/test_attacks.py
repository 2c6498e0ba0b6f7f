"""The attack suite of issue 19: real ACL users made the documented way (``felixctl acl
grant ... --apply``) on a private redis-server whose default user has a password, attacking
with raw redis-py commands and with FCALLs of the library's functions carrying forged
KEYS and ARGV. Each test asserts that the harm is absent: the records are still there and
get delivered, the other group is still listed and keeps its unread records, the
victim producer's record is appended. docs/security.md, "Roles and tenants", lists what
each role can still do with raw commands; the tests of those rows show the remaining
power to be exactly the documented one."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

import felix_redis
from felix_redis.testing.server import RedisServer
from tests.attackers import (
    ADMIN_PW,
    User,
    Users,
    fcall,
    felixctl,
    last_call,
    log_entries,
    payload_at,
    recording,
    shard0,
    url_of,
)
from tests.conftest import dump_keyspace

S = ("acme", "prod", "jobs")
K = shard0()
ROLES = [("group.consume", "workers"), ("group.manage", "workers"), ("stream.publish", None), ("stream.admin", None)]
FIRST_SIX = [f"r{i}".encode() for i in range(6)]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A private redis-server with a password on the default user; a script running over
    100 ms makes every other client's command answer BUSY (so a stall shows at once)."""
    with RedisServer(extra=["--requirepass", ADMIN_PW, "--busy-reply-threshold", "100"]) as s:
        yield s


@pytest.fixture
def admin_raw(server: RedisServer) -> Iterator[redis.Redis]:
    """The default user, raw; the server flushed."""
    r = redis.Redis.from_url(url_of(server.port))
    r.flushall()
    yield r
    r.close()


@pytest.fixture
def users(server: RedisServer, admin_raw: redis.Redis) -> Iterator[Users]:
    made = Users(url_of(server.port), server.port, admin_raw)
    yield made
    made.close()


@pytest.fixture
def admin(server: RedisServer, admin_raw: redis.Redis) -> Iterator[felix_redis.Client]:
    """The default user's client: queue acme/prod/jobs (1 shard, safe retention of 2
    records), groups workers and other, 6 records r0..r5 that neither group has read."""
    c = felix_redis.connect(url_of(server.port))
    c.stream_create(*S, retention_max_len=2)
    c.group_create(*S, "workers")
    c.group_create(*S, "other")
    for payload in FIRST_SIX:
        c.publish(*S, payload, shard=0)
    yield c
    c.close()


def drain(client: felix_redis.Client, group: str) -> list[bytes]:
    """Every record the group hands out now (shard 0), in order."""
    return [r.payload for r in client.group_poll(*S, 0, group, max_records=1000)]


def finish(client: felix_redis.Client, group: str) -> None:
    """The group polls and acks everything there is."""
    records = client.group_poll(*S, 0, group, max_records=1000)
    if records:
        client.group_ack_many(*S, 0, group, records)


def producer_fields(raw: redis.Redis) -> dict[bytes, bytes]:
    return {k: v for k, v in raw.hgetall(K["meta"]).items() if k.startswith(b"producer:")}


# -- 1. no role loads or runs code of its own -----------------------------------------

LOOP = "redis.call('SET', KEYS[1], '1') local x = 0 for i = 1, tonumber(ARGV[1]) do x = x + 1 end return x"


@pytest.mark.parametrize(("role", "group"), ROLES)
def test_no_role_may_load_or_run_code_of_its_own(admin: felix_redis.Client, users: Users, admin_raw: redis.Redis,
                                                 role: str, group: str | None) -> None:
    """SCRIPT LOAD, EVALSHA (even of a script the admin loaded), EVAL, FUNCTION LOAD,
    FUNCTION DELETE/FLUSH: refused for every role; the library stays the only one."""
    u = users.make(role, group)
    own = f"{K['base']}:g:workers:mine" if group else K["meta"]
    sha = admin_raw.script_load("return 1")
    libraries = [x[1] for x in admin_raw.function_list()]
    assert libraries == [felix_redis.scripts.library().name.encode()]
    before = dump_keyspace(admin_raw)
    for attack in (
        lambda: u.raw.script_load("return redis.call('SET', KEYS[1], 'x')"),
        lambda: u.raw.evalsha(sha, 0),
        lambda: u.raw.eval("return redis.call('SET', KEYS[1], 'x')", 1, own),
        lambda: u.raw.function_load("#!lua name=evil\nredis.register_function('evil', function() return 1 end)"),
        lambda: u.raw.function_load(f"#!lua name={libraries[0].decode()}\n"
                                    "redis.register_function('evil', function() return 1 end)", replace=True),
        lambda: u.raw.function_delete(libraries[0].decode()),
        lambda: u.raw.function_flush(),
        lambda: u.raw.script_flush(),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attack()
    assert [x[1] for x in admin_raw.function_list()] == libraries
    assert dump_keyspace(admin_raw) == before


def test_a_consumer_cannot_stall_the_server(admin: felix_redis.Client, users: Users, admin_raw: redis.Redis,
                                           server: RedisServer) -> None:
    """A consumer tries to run a script that writes one key of its own group (so SCRIPT
    KILL could not end it) and then loops: by SCRIPT LOAD + EVALSHA, by EVAL, by FUNCTION
    LOAD + FCALL. Each is refused, no other client ever gets BUSY, nothing is written."""
    u = users.make("group.consume", "workers")
    key = f"{K['base']}:g:workers:stall"
    loops = 100_000_000  # about a second of Lua: bounded even where the attack runs
    outcomes: list[str] = []

    def attack() -> None:
        for step in (
            lambda: u.raw.evalsha(u.raw.script_load(LOOP), 1, key, loops),
            lambda: u.raw.eval(LOOP, 1, key, loops),
            lambda: (u.raw.function_load("#!lua name=stall\nredis.register_function('stall', function(k, a) "
                                         + LOOP.replace("KEYS", "k").replace("ARGV", "a") + " end)"),
                     u.raw.fcall("stall", 1, key, loops)),
        ):
            try:
                step()
                outcomes.append("ran")
            except redis.exceptions.NoPermissionError:
                outcomes.append("refused")

    probe = redis.Redis.from_url(url_of(server.port), socket_timeout=10)
    busy: list[str] = []
    thread = threading.Thread(target=attack, daemon=True)
    thread.start()
    for i in range(200):
        try:
            probe.ping()
        except redis.ResponseError as exc:
            busy.append(str(exc))
        if not thread.is_alive() and i >= 10:
            break
        time.sleep(0.02)
    thread.join(30)
    probe.close()
    assert busy == []
    assert outcomes == ["refused", "refused", "refused"]
    assert not admin_raw.exists(key)
    assert drain(admin, "workers") == FIRST_SIX


def test_install_then_roles_call_the_library_and_without_it_get_not_installed(
        admin: felix_redis.Client, users: Users, admin_raw: redis.Redis, server: RedisServer) -> None:
    """Without the library a role's client gets NotInstalled (naming `felixctl install`),
    felixctl one error line saying so, and nothing runs by any other way; after the
    admin's `felixctl install` the same client objects poll, ack and publish."""
    consumer = users.make("group.consume", "workers")
    publisher = users.make("stream.publish")
    admin_raw.function_flush()
    before = dump_keyspace(admin_raw)
    with pytest.raises(felix_redis.NotInstalled, match="felixctl install"):
        consumer.client.group_poll(*S, 0, "workers")
    with pytest.raises(felix_redis.NotInstalled, match="felixctl install"):
        publisher.client.publish(*S, b"x", shard=0)
    denied = felixctl("--redis-url", consumer.url, "--tenant", "acme", "--namespace", "prod",
                      "group", "describe", "jobs", "workers")
    assert denied.exit_code == 1, denied.output
    (line,) = denied.stderr.strip().splitlines()
    assert line.startswith("felixctl: error:") and "felixctl install" in line
    assert not admin_raw.function_list()
    assert dump_keyspace(admin_raw) == before

    installed = felixctl("--redis-url", url_of(server.port), "install")
    assert installed.exit_code == 0, installed.output
    name = felix_redis.scripts.library().name
    assert installed.stdout.strip() == name
    assert [x[1] for x in admin_raw.function_list()] == [name.encode()]
    records = consumer.client.group_poll(*S, 0, "workers", max_records=2)
    assert [r.payload for r in records] == FIRST_SIX[:2]
    assert consumer.client.group_ack(*S, 0, "workers", records[0]) is True
    assert publisher.client.publish(*S, b"after", shard=0).offset == 6
    assert publisher.client.idempotent_producer().publish(*S, b"after2", shard=0).offset == 7
    assert drain(admin, "other") == [*FIRST_SIX, b"after", b"after2"]


def test_grant_apply_installs_the_library(admin: felix_redis.Client, users: Users, admin_raw: redis.Redis) -> None:
    admin_raw.function_flush()
    u = users.make("group.consume", "workers")
    assert [x[1] for x in admin_raw.function_list()] == [felix_redis.scripts.library().name.encode()]
    assert drain(u.client, "workers") == FIRST_SIX


# -- 2. a publisher cannot destroy the stream ------------------------------------------

def test_a_publisher_cannot_delete_the_stream_or_write_its_settings(
        admin: felix_redis.Client, users: Users, admin_raw: redis.Redis) -> None:
    p = users.make("stream.publish")
    before = dump_keyspace(admin_raw)
    for command in (
        ("DEL", K["meta"]), ("DEL", K["log"]), ("DEL", K["groups"]), ("DEL", K["meta"], K["log"]),
        ("UNLINK", K["meta"], K["log"]), ("DEL", K["conf"]),
        ("HSET", K["conf"], "max_len", "1"), ("HSET", K["conf"], "mode", "bounded"),
        ("HSET", K["conf"], "max_payload", "1"), ("HDEL", K["conf"], "max_payload"),
        ("HSET", K["conf"], "kind", "stream"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            p.raw.execute_command(*command)
    assert dump_keyspace(admin_raw) == before
    settings = admin_raw.hgetall(K["conf"])
    assert settings and int(settings[b"max_len"]) == 2  # the settings live in conf
    assert admin.stream_describe(*S).tails == [6]
    assert drain(admin, "workers") == FIRST_SIX


def test_meta_fields_deleted_or_garbled_by_a_publisher_break_nothing(
        admin: felix_redis.Client, users: Users, admin_raw: redis.Redis) -> None:
    """meta stays writable by publishers (HSET/HDEL): deleting or garbling its tail and
    first fields does not stop publishes, polls or describes, nor lose a record."""
    p = users.make("stream.publish")
    expected = list(FIRST_SIX)
    for n, forge in enumerate((
        lambda: p.raw.hdel(K["meta"], "tail"),
        lambda: p.raw.hset(K["meta"], "tail", "x"),
        lambda: p.raw.hset(K["meta"], "tail", "-5"),
        lambda: p.raw.hdel(K["meta"], "first"),
        lambda: p.raw.hset(K["meta"], "first", "x"),
        lambda: p.raw.hdel(K["meta"], *p.raw.hgetall(K["meta"])),
    )):
        forge()
        payload = f"after{n}".encode()
        assert p.client.publish(*S, payload, shard=0).offset == len(expected), n
        expected.append(payload)
        assert admin.stream_describe(*S).tails == [len(expected)], n
        assert admin.group_describe(*S, "other").shards[0].trimmed == 0, n
    assert drain(admin, "workers") == expected
    assert drain(admin, "other") == expected


def test_a_first_written_by_a_publisher_skips_nothing(admin: felix_redis.Client, users: Users,
                                                      admin_raw: redis.Redis) -> None:
    """HSET meta first 6 (nothing was trimmed): a group made from the earliest record
    still gets all 6, the others count nothing trimmed, and a trim cuts nothing unread."""
    p = users.make("stream.publish")
    p.raw.hset(K["meta"], "first", "6")
    admin.group_create(*S, "late", start="earliest")
    assert drain(admin, "late") == FIRST_SIX
    assert admin.group_describe(*S, "workers").shards[0].trimmed == 0
    assert admin.stream_trim(*S) == 0
    assert drain(admin, "workers") == FIRST_SIX


def test_settings_written_into_meta_change_nothing(admin: felix_redis.Client, users: Users,
                                                   admin_raw: redis.Redis) -> None:
    """HSET meta max_payload 1 / mode bounded max_len 1 (allowed: meta holds the tail):
    publishes still take normal payloads, and no unread record is trimmed by them."""
    p = users.make("stream.publish")
    info = admin.stream_describe(*S)
    p.raw.hset(K["meta"], mapping={"max_payload": "1", "mode": "bounded", "max_len": "1", "kind": "stream"})
    big = b"x" * 100
    assert p.client.publish(*S, big, shard=0).offset == 6
    assert p.client.idempotent_producer().publish(*S, big, shard=0).offset == 7
    assert [x.offset for x in p.client.publish_batch(*S, [big, big], shard=0)] == [8, 9]
    assert p.client.stream_trim(*S) == 0
    fresh = felix_redis.connect(p.url)
    try:
        assert fresh.publish(*S, big, shard=0).offset == 10
    finally:
        fresh.close()
    after = admin.stream_describe(*S)
    assert (after.max_payload, after.retention_max_len, after.retention_mode, after.kind) == (
        info.max_payload, 2, "safe", "queue")
    assert [o for o, _ in log_entries(admin_raw, K["log"])] == list(range(11))
    assert drain(admin, "workers") == [*FIRST_SIX, *[big] * 5]
    assert drain(admin, "other") == [*FIRST_SIX, *[big] * 5]


def test_a_tail_written_below_the_log_heals(admin: felix_redis.Client, users: Users, admin_raw: redis.Redis) -> None:
    """HSET meta tail 0: the next publishes still succeed, at the right next offsets."""
    p = users.make("stream.publish")
    p.raw.hset(K["meta"], "tail", "0")
    assert p.client.publish(*S, b"a", shard=0).offset == 6
    p.raw.hset(K["meta"], "tail", "3")
    assert p.client.idempotent_producer().publish(*S, b"b", shard=0).offset == 7
    p.raw.hset(K["meta"], "tail", "0")
    assert [x.offset for x in p.client.publish_batch(*S, [b"c", b"d"], shard=0)] == [8, 9]
    assert log_entries(admin_raw, K["log"]) == [*enumerate(FIRST_SIX), (6, b"a"), (7, b"b"), (8, b"c"), (9, b"d")]
    assert drain(admin, "workers") == [*FIRST_SIX, b"a", b"b", b"c", b"d"]
    assert admin.group_describe(*S, "workers").shards[0].trimmed == 0


def test_a_tail_written_above_the_log_skips_offsets_and_loses_nothing(
        admin: felix_redis.Client, users: Users, admin_raw: redis.Redis) -> None:
    """HSET meta tail 1000000 is the documented remaining power (docs/security.md): the
    same as XADD with a higher ID, which a publisher holds anyway. Offsets skip: until
    the next publish polls skip nothing (the log's own tail caps them); then the next
    record takes offset 1000000, the groups count the skipped offsets as trimmed and
    deliver every record that exists."""
    p = users.make("stream.publish")
    p.raw.hset(K["meta"], "tail", "1000000")
    assert drain(admin, "other") == FIRST_SIX
    assert admin.group_describe(*S, "other").shards[0].trimmed == 0  # nothing counted yet
    assert p.client.publish(*S, b"a", shard=0).offset == 1000000
    records = admin.group_poll(*S, 0, "workers", max_records=1000)
    assert [(r.offset, r.payload) for r in records] == [*enumerate(FIRST_SIX), (1000000, b"a")]
    admin.group_ack_many(*S, 0, "workers", records)
    assert drain(admin, "other") == [b"a"]
    described = admin.group_describe(*S, "workers").shards[0]
    assert (described.tail, described.trimmed, described.position) == (1000001, 1000000 - 6, 1000001)
    assert admin.group_describe(*S, "other").shards[0].trimmed == 1000000 - 6


def test_xadd_maxlen_0_is_the_documented_remaining_power(admin: felix_redis.Client, users: Users,
                                                         admin_raw: redis.Redis) -> None:
    """A publisher may XADD, so it may XADD ... MAXLEN 0 (ACL cannot restrict arguments):
    the records go, the groups count them trimmed, and nothing else breaks."""
    p = users.make("stream.publish")
    p.raw.execute_command("XADD", K["log"], "MAXLEN", "0", "6-1", "p", "evil")
    assert admin_raw.xlen(K["log"]) == 0
    assert drain(admin, "workers") == []
    published = p.client.publish(*S, b"after", shard=0)
    records = admin.group_poll(*S, 0, "workers", max_records=10)
    assert [(r.offset, r.payload) for r in records] == [(published.offset, b"after")]
    admin.group_ack(*S, 0, "workers", records[0])
    shard = admin.group_describe(*S, "workers").shards[0]
    assert shard.trimmed == published.offset and published.offset in (6, 7)
    assert int(admin_raw.hget(f"{K['base']}:g:workers", "trimmed") or 0) == published.offset
    assert shard.position == published.offset + 1
    assert [(r.offset, r.payload) for r in admin.group_poll(*S, 0, "other", max_records=10)] == [
        (published.offset, b"after")]


def test_a_raw_xadd_of_a_malformed_entry_stops_no_group(admin: felix_redis.Client, users: Users,
                                                       admin_raw: redis.Redis) -> None:
    """A publisher may XADD raw entries (ACL cannot restrict the arguments): one without
    a payload field, or with an ID of another form, is delivered or counted, and stops
    neither the groups nor later publishes."""
    p = users.make("stream.publish")
    p.raw.execute_command("XADD", K["log"], "6-1", "x", "y")
    p.raw.execute_command("XADD", K["log"], "7-1", "p", "raw", "k", "")
    published = p.client.publish(*S, b"after", shard=0)
    assert published.offset >= 8
    delivered = drain(admin, "workers")
    assert delivered[:6] == FIRST_SIX and delivered[-1] == b"after"
    records = admin.group_poll(*S, 0, "other", max_records=100)
    assert [r.payload for r in records][:6] == FIRST_SIX
    assert admin.group_ack_many(*S, 0, "other", records) == [True] * len(records)


# -- 3. every script checks the keys it is handed --------------------------------------

@pytest.mark.parametrize("role", ["stream.publish", "stream.admin"])
def test_stream_trim_refuses_made_up_group_keys(admin: felix_redis.Client, users: Users, admin_raw: redis.Redis,
                                                role: str) -> None:
    """stream_trim with the real group names in ARGV but keys of made-up groups (or of
    the group that read everything in place of the one that read nothing): refused,
    nothing trimmed, both groups still get every record."""
    u = users.make(role)
    finish(admin, "workers")  # workers read everything; other nothing
    with recording(u.client) as calls:
        assert u.client.stream_trim(*S) == 0
    real = last_call(calls, "stream_trim")
    assert any(":g:other" in k for k in real.keys)
    before = dump_keyspace(admin_raw)
    for forged in (real.replace(":g:workers", ":g:fake1").replace(":g:other", ":g:fake2"),
                   real.replace(":g:other", ":g:workers"),
                   real.replace(":g:other", ":g:fake2")):
        with pytest.raises(redis.ResponseError, match="FELIX_INVALID"):
            fcall(u.raw, forged)
    assert dump_keyspace(admin_raw) == before
    assert drain(admin, "other") == FIRST_SIX


def test_publish_and_trim_refuse_the_settings_of_another_stream(admin: felix_redis.Client, users: Users,
                                                                admin_raw: redis.Redis) -> None:
    """A publisher of jobs and of loose (bounded retention of 1, large payloads) hands
    jobs' publish and trim loose's conf key: refused, nothing written or trimmed."""
    admin.stream_create("acme", "prod", "loose", retention_max_len=1, retention_mode="bounded",
                        max_payload=1_000_000)
    p = users.make("stream.publish")
    users.make("stream.publish", stream="loose", name=p.name)
    with recording(p.client) as calls:
        p.client.publish_batch(*S, [b"ok"], shard=0)
        p.client.stream_trim(*S)
    loose = shard0(stream="loose")["conf"]
    before = dump_keyspace(admin_raw)
    for script in ("publish", "stream_trim"):
        real = last_call(calls, script)
        assert K["conf"] in real.keys
        forged = real.forged(keys=[loose if k == K["conf"] else k for k in real.keys])
        if script == "publish":
            forged = forged.forged(args=[*forged.args[:4], b"x" * 200_000])
        with pytest.raises(redis.ResponseError, match="FELIX_INVALID"):
            fcall(p.raw, forged)
    assert dump_keyspace(admin_raw) == before
    assert drain(admin, "workers") == [*FIRST_SIX, b"ok"]


def scratch_calls(admin: felix_redis.Client, op: str) -> list[Any]:
    """The calls the default user's client makes for ``op`` on a copy of acme/prod/jobs
    (acme/prod/scratch, same groups), to replay on jobs with forged parts."""
    admin.stream_create("acme", "prod", "scratch", retention_max_len=2)
    admin.group_create("acme", "prod", "scratch", "workers")
    admin.group_create("acme", "prod", "scratch", "other")
    with recording(admin) as calls:
        if op == "stream_delete":
            admin.stream_delete("acme", "prod", "scratch")
        elif op == "group_delete":
            admin.group_delete("acme", "prod", "scratch", "workers")
        else:
            admin.group_delete("acme", "prod", "scratch", "workers")
            calls.clear()
            admin.group_create("acme", "prod", "scratch", "workers")
    return [c.replace("/scratch/", "/jobs/").replace("acme/prod/scratch", "acme/prod/jobs") for c in calls]


def test_stream_delete_refuses_keys_of_another_group(admin: felix_redis.Client, users: Users,
                                                     admin_raw: redis.Redis) -> None:
    """stream_delete naming workers and other in ARGV but handing over other's keys (or a
    made-up group's) in place of workers': refused, nothing deleted (no group's keys
    would be left behind)."""
    u = users.make("stream.admin")
    real = last_call(scratch_calls(admin, "stream_delete"), "stream_delete")
    assert any(":g:workers" in k for k in real.keys)
    before = dump_keyspace(admin_raw)
    for forged in (real.replace(":g:workers", ":g:other"), real.replace(":g:workers", ":g:fake")):
        with pytest.raises(redis.ResponseError, match="FELIX_INVALID"):
            fcall(u.raw, forged)
    assert dump_keyspace(admin_raw) == before
    assert admin.stream_describe(*S).groups == ["other", "workers"]


def test_group_create_with_one_groups_keys_cannot_name_another(admin: felix_redis.Client, users: Users,
                                                                admin_raw: redis.Redis) -> None:
    """A manager of workers calls group_create with workers' keys and ARGV naming 'evil':
    refused, or it makes workers; 'evil' is never listed."""
    m = users.make("group.manage", "workers")
    real = last_call(scratch_calls(admin, "group_create"), "group_create")
    m.client.group_delete(*S, "workers")
    try:
        fcall(m.raw, real.forged(args=["evil", *real.args[1:]]))
    except redis.ResponseError as exc:
        assert "FELIX_INVALID" in str(exc) or "FELIX_NOPERM" in str(exc)
    assert {g.decode() for g in admin_raw.smembers(K["groups"])} <= {"workers", "other"}
    assert "evil" not in admin.stream_describe(*S).groups
    assert not admin_raw.exists(f"{K['base']}:g:evil")


def test_a_manager_of_one_group_cannot_remove_another(admin: felix_redis.Client, users: Users,
                                                      admin_raw: redis.Redis) -> None:
    """A manager of workers: group_delete with workers' keys and ARGV naming other
    (refused, or deletes workers only), raw SREM of other (NOPERM). other stays listed
    and keeps its unread records through retention; stream_delete leaves nothing behind
    and the stream can be made again."""
    m = users.make("group.manage", "workers")
    real = last_call(scratch_calls(admin, "group_delete"), "group_delete", arg2="0")
    try:
        fcall(m.raw, real.forged(args=["other", *real.args[1:]]))
    except redis.ResponseError as exc:
        assert "FELIX_INVALID" in str(exc) or "FELIX_NOPERM" in str(exc)
    assert admin_raw.sismember(K["groups"], "other")
    assert "other" in admin.stream_describe(*S).groups
    with pytest.raises(redis.exceptions.NoPermissionError):
        m.raw.srem(K["groups"], "other")
    assert admin_raw.sismember(K["groups"], "other")
    if "workers" in admin.stream_describe(*S).groups:
        finish(admin, "workers")
    for i in range(6, 10):
        admin.publish(*S, f"r{i}".encode(), shard=0)
    admin.stream_trim(*S)
    assert drain(admin, "other") == [f"r{i}".encode() for i in range(10)]
    admin.stream_delete(*S)
    assert admin_raw.keys("felix:{acme/prod/jobs/*") == []
    admin.stream_create(*S)
    admin.group_create(*S, "other")
    admin.group_create(*S, "workers")
    assert admin.stream_describe(*S).groups == ["other", "workers"]


def test_a_bogus_name_in_the_group_set_is_ignored(admin: felix_redis.Client, users: Users,
                                                  admin_raw: redis.Redis) -> None:
    """A manager may SADD to the group set (documented remaining power): a listed name
    without a group is not shown, retention still trims, stream_delete still deletes
    and the stream can be made again."""
    m = users.make("group.manage", "workers")
    assert m.raw.sadd(K["groups"], "bogus") == 1
    assert admin.stream_describe(*S).groups == ["other", "workers"]
    assert admin.group_list(*S) == ["other", "workers"]
    finish(admin, "workers")
    finish(admin, "other")
    assert admin.stream_trim(*S) == 4
    assert [o for o, _ in log_entries(admin_raw, K["log"])] == [4, 5]
    admin.publish(*S, b"r6", shard=0)
    assert drain(admin, "workers") == [b"r6"]
    admin.stream_delete(*S)
    assert admin_raw.keys("felix:{acme/prod/jobs/*") == []
    admin.stream_create(*S)
    admin.group_create(*S, "workers")
    assert admin.stream_describe(*S).groups == ["workers"]


# -- 5. idempotent producers are unforgeable -------------------------------------------

def _victim(u: User, kind: str) -> Any:
    """A function publishing one payload to shard 0 as the victim producer."""
    if kind == "producer":
        producer = u.client.idempotent_producer()
        return lambda payload: producer.publish(*S, payload, shard=0)
    return lambda payload: u.client.publish(*S, payload, shard=0)


def _appended(admin_raw: redis.Redis, published: felix_redis.Published, payload: bytes) -> None:
    assert payload_at(admin_raw, K["log"], published.offset) == payload, (
        f"publish of {payload!r} answered offset {published.offset}, which holds "
        f"{payload_at(admin_raw, K['log'], published.offset)!r}")


@pytest.mark.parametrize("kind", ["producer", "pooled"])
def test_a_publisher_cannot_call_publish_as_another_producer(admin: felix_redis.Client, users: Users,
                                                             admin_raw: redis.Redis, kind: str) -> None:
    """Publisher B reads meta (the producers' digest fields) and calls publish with the
    digest (or the field, or anything else) as the producer id and the victim's next
    sequence: the victim's next publish still appends its record."""
    a, b = users.make("stream.publish"), users.make("stream.publish")
    victim = _victim(a, kind)
    known = set(producer_fields(admin_raw))
    _appended(admin_raw, victim(b"A1"), b"A1")
    fields = {k: v for k, v in producer_fields(b.raw).items() if k not in known}
    assert fields  # B reads them
    with recording(b.client) as calls:
        b.client.idempotent_producer().publish(*S, b"B-record", shard=0)
    real = last_call(calls, "publish")
    for field, state in fields.items():
        digest = field.split(b":", 1)[1].decode()
        seq = int(state.split()[0])
        for pid in (digest, field.decode(), digest[:20], digest + digest, str(int(digest[:12], 16))):
            forged = real.forged(args=[real.args[0], pid, str(seq + 1), real.args[3], b"EVIL"])
            with contextlib.suppress(redis.ResponseError):
                fcall(b.raw, forged)
    _appended(admin_raw, victim(b"A2"), b"A2")
    _appended(admin_raw, victim(b"A3"), b"A3")
    mine = [p for _, p in log_entries(admin_raw, K["log"]) if p.startswith(b"A")]
    assert mine == [b"A1", b"A2", b"A3"]


@pytest.mark.parametrize("kind", ["producer", "pooled"])
def test_a_forged_producer_state_does_not_drop_the_victims_next_publish(
        admin: felix_redis.Client, users: Users, admin_raw: redis.Redis, kind: str) -> None:
    """Publisher B overwrites the victim's state in meta (HSET producer:<digest>) with the
    victim's next sequence (no MAC, a made-up MAC, the old MAC), deletes it, or puts back
    an older state: the victim's next publish appends its record every time (or, for the
    replayed state, is refused loudly), never answers an offset without appending."""
    a, b = users.make("stream.publish"), users.make("stream.publish")
    victim = _victim(a, kind)
    known = set(producer_fields(admin_raw))
    _appended(admin_raw, victim(b"A0"), b"A0")
    (field,) = [k for k in producer_fields(b.raw) if k not in known]

    def forgeries() -> Iterator[str | None]:
        for make in ("plain", "zero-mac", "old-mac"):
            state = b.raw.hget(K["meta"], field).decode().split()
            seq, first, _count, ms, idle = state[:5]
            five = f"{int(seq) + 1} {first} 1 {ms} {idle}"
            yield {"plain": five, "zero-mac": f"{five} {'0' * 16}",
                   "old-mac": f"{five} {state[5] if len(state) > 5 else ''}".strip()}[make]
        yield None  # HDEL

    for n, forged in enumerate(forgeries(), 1):
        if forged is None:
            b.raw.hdel(K["meta"], field)
        else:
            b.raw.hset(K["meta"], field, forged)
        payload = f"A{n}".encode()
        _appended(admin_raw, victim(payload), payload)
    saved = b.raw.hget(K["meta"], field)
    _appended(admin_raw, victim(b"A5"), b"A5")
    assert saved is not None
    b.raw.hset(K["meta"], field, saved)  # a valid state of the victim's, replayed
    expected = [f"A{i}".encode() for i in range(6)]
    try:  # the replayed state is the victim's own: a refusal (loud) is the most it may cause
        _appended(admin_raw, victim(b"A6"), b"A6")
        expected.append(b"A6")
    except felix_redis.SequenceError:
        pass
    _appended(admin_raw, victim(b"A7"), b"A7")
    mine = [p for _, p in log_entries(admin_raw, K["log"]) if p.startswith(b"A")]
    assert mine == [*expected, b"A7"]


# -- 6. the record key limit is the script's ------------------------------------------

def test_a_raw_publish_with_an_oversize_key_is_refused(admin: felix_redis.Client, users: Users,
                                                       admin_raw: redis.Redis) -> None:
    p = users.make("stream.publish")
    with recording(p.client) as calls:
        p.client.publish_keyed(*S, "k" * 1024, b"keyed")  # 1,024 bytes: the limit itself
    real = last_call(calls, "publish")
    before = dump_keyspace(admin_raw)
    for key in ("x" * 2000, "x" * 1025, "é" * 513):
        with pytest.raises(redis.ResponseError, match="FELIX_INVALID"):
            fcall(p.raw, real.forged(args=[key, "", "0", real.args[3], b"long"]))
    assert dump_keyspace(admin_raw) == before


# -- 7. tenants --------------------------------------------------------------------------

def test_a_tenant_admin_sees_only_its_own_tenant(admin: felix_redis.Client, users: Users,
                                                 admin_raw: redis.Redis) -> None:
    """stream.admin of acme lists only acme's streams, may not SCAN, INFO nor touch
    beta's registry; every tenant has its own registry key; the operator (default user)
    lists every tenant's streams."""
    admin.stream_create("beta", "prod", "jobs")
    admin.stream_create("beta", "prod", "secret")
    u = users.make("stream.admin")
    assert u.client.stream_list("acme") == [("acme", "prod", "jobs")]
    with pytest.raises(felix_redis.PermissionDenied):
        u.client.stream_list()  # every tenant: the operator's listing (felix:tenants)
    assert u.client.stream_list("acme") == [("acme", "prod", "jobs")]
    for command in (("SCAN", "0"), ("SCAN", "0", "MATCH", "felix:{beta/*"), ("INFO",), ("INFO", "keyspace"),
                    ("KEYS", "*"), ("ZRANGE", "felix:streams:beta", "0", "-1"),
                    ("ZREM", "felix:streams:beta", "prod/jobs", "beta/prod/jobs"),
                    ("ZREM", "felix:streams", "beta/prod/jobs"), ("ZRANGE", "felix:streams", "0", "-1")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            u.raw.execute_command(*command)
    assert admin_raw.type("felix:streams:acme") == b"zset"
    assert admin_raw.type("felix:streams:beta") == b"zset"
    assert sorted(admin.stream_list()) == [("acme", "prod", "jobs"), ("beta", "prod", "jobs"),
                                           ("beta", "prod", "secret")]
    assert admin.stream_list("beta") == [("beta", "prod", "jobs"), ("beta", "prod", "secret")]


def test_producers_need_no_key_shared_by_tenants(admin: felix_redis.Client, users: Users,
                                                 admin_raw: redis.Redis) -> None:
    p = users.make("stream.publish")
    p.client.publish(*S, b"a", shard=0)
    p.client.idempotent_producer().publish(*S, b"b", shard=0)
    assert not admin_raw.exists("felix:producer-ids")
    with pytest.raises(redis.exceptions.NoPermissionError):
        p.raw.incr("felix:producer-ids")
    rules = " ".join(x.decode() if isinstance(x, bytes) else str(x)
                     for x in admin_raw.execute_command("ACL", "GETUSER", p.name))
    assert "producer-ids" not in rules and "felix:streams" not in rules
