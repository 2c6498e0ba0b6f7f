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
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

import felix_redis
from felix_redis.testing.server import RedisServer
from tests.conftest import dump_keyspace
from tests.support.attackers import (
    ADMIN_PW,
    User,
    Users,
    fcall,
    felixctl,
    group_key,
    keys_without,
    last_call,
    library_loaded,
    log_entries,
    payload_at,
    recording,
    shard0,
    url_of,
)

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


# row: every role | load or run Lua of its own | closed
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


# row: every role | load or run Lua of its own | closed (the stall it would allow)
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

# row: stream.publish | DEL the stream's keys; change the settings | closed
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


# row: stream.publish | write meta by hand (tail, first) | remains, healed
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


# row: stream.publish | write meta by hand (first) | remains, healed
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


# row: stream.publish | change the settings | closed (settings in meta are ignored)
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


# row: stream.publish | write meta by hand (a too low tail) | remains, healed
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


# row: stream.publish | write meta by hand (a tail above the log) | remains
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


# row: stream.publish | remove records from the log (XADD ... MAXLEN) | remains
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
    assert shard.trimmed == published.offset == 6  # the raw entry went with the MAXLEN 0 it came with
    assert int(admin_raw.hget(f"{K['base']}:g:workers", "trimmed") or 0) == published.offset
    assert shard.position == published.offset + 1
    assert [(r.offset, r.payload) for r in admin.group_poll(*S, 0, "other", max_records=10)] == [
        (published.offset, b"after")]


# row: stream.publish | append around the library (XADD with an explicit ID) | remains
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


# row: stream.publish | change the settings | closed (another stream's conf)
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
            forged = forged.forged(args=[*forged.args[:7], b"x" * 200_000])
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


# row: group.manage | create another group through the scripts with forged arguments | closed
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


# row: group.manage | remove another group from the set (SREM), or delete it with forged arguments | closed
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


# row: group.manage | SADD a name to the shard's groups set | remains
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


# row: stream.publish | act as another idempotent producer through the scripts | closed
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
            forged = real.forged(args=[real.args[0], pid, str(seq + 1), real.args[3], b"", b"", b"", b"EVIL"])
            with contextlib.suppress(redis.ResponseError):
                fcall(b.raw, forged)
    _appended(admin_raw, victim(b"A2"), b"A2")
    _appended(admin_raw, victim(b"A3"), b"A3")
    mine = [p for _, p in log_entries(admin_raw, K["log"]) if p.startswith(b"A")]
    assert mine == [b"A1", b"A2", b"A3"]


# row: stream.publish | write meta by hand (producer states) | remains, healed
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
            fcall(p.raw, real.forged(args=[key, "", "0", real.args[3], b"", b"", b"", b"long"]))
    assert dump_keyspace(admin_raw) == before


# -- 7. tenants --------------------------------------------------------------------------

# row: stream.admin | list or change other tenants' streams; SCAN, INFO | closed
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


# row: stream.publish | INCR a counter shared by all tenants | closed
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


# -- 8. the rest of docs/security.md's table, row by row --------------------------------

BETA = shard0("beta")
OTHERAPP = """#!lua name=otherapp
redis.register_function('otherapp_hello', function() return 'hello' end)
redis.register_function('otherapp_hlen', function(keys, args) return redis.call('HLEN', args[1]) end)
"""
#: One write operation of each role on acme/prod/jobs (its script, and a call of it), to
#: record and replay on beta's keys.
OWN_OP: dict[str, tuple[str, Any]] = {
    "group.consume": ("group_poll", lambda c: c.group_poll(*S, 0, "workers", max_records=1)),
    "group.manage": ("group_redrive", lambda c: c.group_redrive(*S, 0, "workers")),
    "stream.publish": ("publish", lambda c: c.publish(*S, b"mine", shard=0)),
    "stream.admin": ("stream_trim", lambda c: c.stream_trim(*S)),
}


def described(admin: felix_redis.Client, group: str) -> Any:
    """``group_describe`` of a group but for the age of its oldest record (a clock)."""
    info = admin.group_describe(*S, group)
    return dataclasses.replace(info, shards=[dataclasses.replace(s, oldest_unfinished_age_ms=None)
                                             for s in info.shards])


def beta_jobs(admin: felix_redis.Client) -> None:
    """Tenant beta's prod/jobs with groups workers and other and one record."""
    admin.stream_create("beta", "prod", "jobs")
    admin.group_create("beta", "prod", "jobs", "workers")
    admin.group_create("beta", "prod", "jobs", "other")
    admin.publish("beta", "prod", "jobs", b"beta-secret", shard=0)


# row: every role | FCALL any function loaded on the server | remains
@pytest.mark.parametrize(("role", "group"), ROLES)
def test_every_role_may_fcall_any_function_but_not_outside_its_keys(
        admin: felix_redis.Client, users: Users, admin_raw: redis.Redis, role: str, group: str | None) -> None:
    """Another application's library (otherapp) is callable by every role, and its
    function reads a key the role may read; the same function on beta's meta, and the
    role's own felix-redis call replayed with beta's keys, are refused by Redis."""
    beta_jobs(admin)
    u = users.make(role, group)
    script, op = OWN_OP[role]
    with recording(u.client) as calls:
        op(u.client)
    own = last_call(calls, script)
    before = dump_keyspace(admin_raw)
    with library_loaded(admin_raw, OTHERAPP):
        assert u.raw.fcall("otherapp_hello", 0) == b"hello"
        assert u.raw.fcall("otherapp_hlen", 0, K["meta"]) > 0
        with pytest.raises(redis.ResponseError, match=r"(?i)noperm|no permissions|can't access"):
            u.raw.fcall("otherapp_hlen", 0, BETA["meta"])
    with pytest.raises(redis.exceptions.NoPermissionError):
        fcall(u.raw, own.replace("acme/", "beta/"))
    assert dump_keyspace(admin_raw) == before


# row: every role | read the stream's records, offsets, settings, group names | remains, by design
@pytest.mark.parametrize(("role", "group"), ROLES)
def test_every_role_reads_the_log_meta_conf_and_group_names(
        admin: felix_redis.Client, users: Users, admin_raw: redis.Redis, role: str, group: str | None) -> None:
    """XRANGE of the log, HGETALL of meta and conf, SMEMBERS of groups: the same as the
    default user sees. Another tenant's keys are refused, and so, to a group role,
    another group's."""
    beta_jobs(admin)
    u = users.make(role, group)
    assert log_entries(u.raw, K["log"]) == list(enumerate(FIRST_SIX))
    for key in (K["meta"], K["conf"]):
        assert u.raw.hgetall(key) == admin_raw.hgetall(key)
    assert u.raw.smembers(K["groups"]) == {b"workers", b"other"}
    refused = [("XRANGE", BETA["log"], "-", "+"), ("HGETALL", BETA["meta"]), ("HGETALL", BETA["conf"]),
               ("SMEMBERS", BETA["groups"]), ("HGETALL", group_key("workers", tenant="beta"))]
    if group is not None:
        refused += [("HGETALL", group_key("other")), ("HGETALL", group_key("other", "dead")),
                    ("ZRANGE", group_key("other", "owed"), "0", "-1")]
    for command in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            u.raw.execute_command(*command)


# row: every role | XREAD BLOCK on keys it may read | remains
@pytest.mark.parametrize(("role", "group"), ROLES)
def test_every_role_may_block_on_the_log_but_not_on_another_tenants(
        admin: felix_redis.Client, users: Users, role: str, group: str | None) -> None:
    beta_jobs(admin)
    u = users.make(role, group)
    started = time.monotonic()
    assert not u.raw.xread({K["log"]: "$"}, block=50)
    assert time.monotonic() - started >= 0.04
    [[_, entries]] = u.raw.xread({K["log"]: "0"}, count=1, block=50)
    assert entries[0][1][b"p"] == b"r0"
    with pytest.raises(redis.exceptions.NoPermissionError):
        u.raw.xread({BETA["log"]: "$"}, block=50)


#: role -> a 1 MB write on a key the role may write, and the same on a key it may not.
FILL = {
    "group.consume": (("HSET", group_key("workers"), "junk"), ("HSET", group_key("other"), "junk")),
    "group.manage": (("HSET", group_key("workers", "dead"), "junk"), ("HSET", group_key("other", "dead"), "junk")),
    "stream.publish": (("XADD", K["log"], "6-1", "p"), ("XADD", BETA["log"], "6-1", "p")),
    "stream.admin": (("HSET", f"{K['base']}:junk", "f"), ("HSET", f"{BETA['base']}:junk", "f")),
}


# row: every role | fill memory through the keys it may write | remains
@pytest.mark.parametrize(("role", "group"), ROLES)
def test_every_role_may_fill_memory_only_through_its_own_keys(
        admin: felix_redis.Client, users: Users, admin_raw: redis.Redis, role: str, group: str | None) -> None:
    """A 1 MB value goes into a key the role writes; the same into another group's or
    tenant's key is refused. With maxmemory and noeviction (what the table advises) the
    next such write fails with OOM and no record is evicted."""
    beta_jobs(admin)
    u = users.make(role, group)
    mine, theirs = FILL[role]
    command, key, field = mine[:3]
    big = b"x" * 1_000_000
    before = dump_keyspace(admin_raw)
    u.raw.execute_command(*mine, big)
    assert admin_raw.memory_usage(key, samples=0) > 1_000_000
    with pytest.raises(redis.exceptions.NoPermissionError):
        u.raw.execute_command(*theirs, big)
    assert {k: v for k, v in dump_keyspace(admin_raw).items() if k != key.encode()} == {
        k: v for k, v in before.items() if k != key.encode()}
    used = int(admin_raw.info("memory")["used_memory"])
    admin_raw.config_set("maxmemory-policy", "noeviction")
    admin_raw.config_set("maxmemory", used + 200_000)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for n in range(3):
                again = ("XADD", key, f"7-{n}", "p") if command == "XADD" else (command, key, f"{field}{n}")
                u.raw.execute_command(*again, big)
    finally:
        admin_raw.config_set("maxmemory", 0)
    assert log_entries(admin_raw, K["log"])[:6] == list(enumerate(FIRST_SIX))


# row: group.consume | change its own group's state by hand | remains, own group only
# row: group.manage | as group.consume (the same write commands on its group's keys)
@pytest.mark.parametrize("role", ["group.consume", "group.manage"])
def test_a_group_role_may_rewrite_its_own_groups_state_and_nothing_else(
        admin: felix_redis.Client, users: Users, admin_raw: redis.Redis, role: str) -> None:
    """A dead letter moved back by hand (HDEL from g:workers:dead, ZADD to g:workers:owed:
    a redrive without the script) is handed out again; DEL of the group's keys loses the
    group. Through both, group other, the log, meta and conf are unchanged."""
    u = users.make(role, "workers")
    acting = u.client if role == "group.consume" else admin
    (first,) = acting.group_poll(*S, 0, "workers", max_records=1)
    acting.group_dead_letter(*S, 0, "workers", first, "bad")
    assert [d.offset for d in admin.group_dead_letters(*S, 0, "workers")] == [0]
    others = keys_without(admin_raw, ":g:workers")
    other = described(admin, "other")
    assert u.raw.hdel(group_key("workers", "dead"), "0") == 1
    u.raw.zadd(group_key("workers", "owed"), {"0": 0})
    assert admin.group_dead_letters(*S, 0, "workers") == []
    records = admin.group_poll(*S, 0, "workers", max_records=10)
    assert sorted(r.payload for r in records) == FIRST_SIX
    u.raw.delete(*admin_raw.keys(group_key("workers") + "*"))
    assert admin_raw.keys(group_key("workers") + "*") == []
    with pytest.raises(felix_redis.NotFound):
        admin.group_poll(*S, 0, "workers")
    assert keys_without(admin_raw, ":g:workers") == others
    assert described(admin, "other") == other
    assert drain(admin, "other") == FIRST_SIX


# row: group.consume | write another group's keys, the log, meta, conf, groups | closed
# row: group.manage | remove another group from the set (SREM) | closed (the raw half)
@pytest.mark.parametrize("role", ["group.consume", "group.manage"])
def test_a_group_role_cannot_write_outside_its_group(admin: felix_redis.Client, users: Users,
                                                     admin_raw: redis.Redis, role: str) -> None:
    u = users.make(role, "workers")
    before = dump_keyspace(admin_raw)
    attacks = [
        ("HSET", group_key("other"), "pos", "6"), ("HDEL", group_key("other"), "next"), ("DEL", group_key("other")),
        ("ZADD", group_key("other", "done"), "5", "0"), ("HSET", group_key("other", "dead"), "0", "1|0|x"),
        ("DEL", group_key("other", "lease")), ("HSET", group_key("workers", tenant="beta"), "pos", "6"),
        ("XADD", K["log"], "6-1", "p", "x"), ("XTRIM", K["log"], "MAXLEN", "0"), ("DEL", K["log"]),
        ("HSET", K["meta"], "tail", "100"), ("HDEL", K["meta"], "tail"), ("DEL", K["meta"]),
        ("HSET", K["conf"], "max_len", "1"), ("HDEL", K["conf"], "max_payload"), ("DEL", K["conf"]),
        ("SREM", K["groups"], "other"), ("DEL", K["groups"]),
    ]
    if role == "group.consume":
        attacks.append(("SADD", K["groups"], "bogus"))
    for command in attacks:
        with pytest.raises(redis.exceptions.NoPermissionError):
            u.raw.execute_command(*command)
    assert dump_keyspace(admin_raw) == before
    assert drain(admin, "other") == FIRST_SIX


# row: stream.publish | remove records from the log: XTRIM, or XADD ... MAXLEN/MINID | remains
# (XADD MAXLEN 0: test_xadd_maxlen_0_is_the_documented_remaining_power)
@pytest.mark.parametrize("how", [("MAXLEN", "0"), ("MINID", "6")])
def test_a_publisher_may_xtrim_unfinished_records_which_the_groups_count(
        admin: felix_redis.Client, users: Users, admin_raw: redis.Redis, how: tuple[str, str]) -> None:
    """XTRIM log MAXLEN 0 (or MINID 6): the 6 records nobody read go, both groups count
    them trimmed and never hand them out; the next publish is delivered to both."""
    p = users.make("stream.publish")
    assert p.raw.execute_command("XTRIM", K["log"], *how) == 6
    assert p.client.publish(*S, b"after", shard=0).offset == 6
    for group in ("workers", "other"):
        assert drain(admin, group) == [b"after"]
        assert admin.group_describe(*S, group).shards[0].trimmed == 6


# row: stream.publish | append around the library (XADD with an explicit ID or *) | remains
# (explicit IDs of other forms: test_a_raw_xadd_of_a_malformed_entry_stops_no_group)
def test_a_raw_xadd_star_skips_offsets_and_loses_nothing(admin: felix_redis.Client, users: Users,
                                                         admin_raw: redis.Redis) -> None:
    """XADD log * takes the current time in ms as its offset; the next publish takes the
    one after; the groups deliver all 8 records and count the skipped offsets trimmed."""
    p = users.make("stream.publish")
    star = int(p.raw.xadd(K["log"], {"p": "star"}).split(b"-")[0])
    assert abs(star - time.time() * 1000) < 60_000
    assert p.client.publish(*S, b"after", shard=0).offset == star + 1
    for group in ("workers", "other"):
        records = admin.group_poll(*S, 0, group, max_records=100)
        assert [(r.offset, r.payload) for r in records] == [*enumerate(FIRST_SIX), (star, b"star"),
                                                             (star + 1, b"after")]
        assert admin.group_ack_many(*S, 0, group, records) == [True] * 8
        shard = admin.group_describe(*S, group).shards[0]
        assert (shard.trimmed, shard.position, shard.lag) == (star - 6, star + 2, 0)


# row: stream.publish | append around the library: "a second entry at the last offset".
# An offset's record is its first entry: groups ignore a second one (subscribers see
# it) and settle the offset once, with no lease left over. An entry a publisher adds at
# the tail's offset takes that offset from the next publish, whose record groups then
# ignore: one more way a publisher can destroy records, as XTRIM is.
@pytest.mark.parametrize("made_by", ["raw", "publish"])
def test_a_second_entry_at_an_offset_is_ignored_by_groups(
        admin: felix_redis.Client, users: Users, admin_raw: redis.Redis, made_by: str) -> None:
    p = users.make("stream.publish")
    if made_by == "raw":
        (last_id, _), = admin_raw.xrevrange(K["log"], count=1)
        offset, ms = (int(x) for x in last_id.split(b"-"))
        p.raw.xadd(K["log"], {"p": "second"}, id=f"{offset}-{ms + 1}")
        expected = list(enumerate(FIRST_SIX))
        hidden = b"second"
    else:
        p.raw.xadd(K["log"], {"p": "raw"}, id="6-1")
        assert p.client.publish(*S, b"second", shard=0).offset == 6
        expected = [*enumerate(FIRST_SIX), (6, b"raw")]
        hidden = b"second"
    # subscribers read the log as it is: both entries
    assert [r.payload for r in admin.read(*S, 0, 0)][-1] == hidden
    admin.group_configure(*S, "workers", visibility_timeout_ms=100)
    records = admin.group_poll(*S, 0, "workers", max_records=100)
    assert [(r.offset, r.payload) for r in records] == expected
    admin.group_ack_many(*S, 0, "workers", records)
    time.sleep(0.15)
    assert admin.group_poll(*S, 0, "workers", max_records=100) == []  # nothing left over, no lease
    shard = admin.group_describe(*S, "workers").shards[0]
    assert (shard.position, shard.in_flight, shard.owed, shard.dead, shard.trimmed) == (
        expected[-1][0] + 1, 0, 0, 0, 0)
    assert [r.payload for r in admin.group_poll(*S, 0, "other", max_records=100)] == [x for _, x in expected]
    # the next publish takes the offset after the log's last
    assert p.client.publish(*S, b"next", shard=0).offset == expected[-1][0] + 1


# row: stream.publish | write group keys or groups | closed
def test_a_publisher_cannot_write_group_keys_or_the_group_set(admin: felix_redis.Client, users: Users,
                                                              admin_raw: redis.Redis) -> None:
    p = users.make("stream.publish")
    assert p.raw.hgetall(group_key("workers"))  # it reads them (retention)
    before = dump_keyspace(admin_raw)
    for command in (("HSET", group_key("workers"), "pos", "6"), ("HDEL", group_key("other"), "next"),
                    ("DEL", group_key("workers")), ("ZADD", group_key("workers", "done"), "5", "0"),
                    ("HSET", group_key("workers", "dead"), "0", "1|0|x"), ("SADD", K["groups"], "bogus"),
                    ("SREM", K["groups"], "other"), ("DEL", K["groups"])):
        with pytest.raises(redis.exceptions.NoPermissionError):
            p.raw.execute_command(*command)
    assert dump_keyspace(admin_raw) == before
    assert drain(admin, "workers") == FIRST_SIX


# row: stream.admin | anything on its stream's keys | remains, by design
def test_a_stream_admin_may_write_any_key_of_its_stream_only(admin: felix_redis.Client, users: Users,
                                                             admin_raw: redis.Redis) -> None:
    """DEL of the log, SREM from the group set, HSET of conf: done on acme's jobs; the
    same on beta's jobs refused, and beta's keys and registry unchanged."""
    beta_jobs(admin)
    u = users.make("stream.admin")
    betas = {k: v for k, v in dump_keyspace(admin_raw).items() if b"beta" in k}
    for key, command in (("log", ("DEL",)), ("groups", ("SREM", "other")), ("conf", ("HSET", "max_payload", "1"))):
        u.raw.execute_command(command[0], K[key], *command[1:])
        with pytest.raises(redis.exceptions.NoPermissionError):
            u.raw.execute_command(command[0], BETA[key], *command[1:])
    assert not admin_raw.exists(K["log"])
    assert admin_raw.smembers(K["groups"]) == {b"workers"}
    assert admin_raw.hget(K["conf"], "max_payload") == b"1"
    assert {k: v for k, v in dump_keyspace(admin_raw).items() if b"beta" in k} == betas
    assert [r.payload for r in admin.group_poll("beta", "prod", "jobs", 0, "workers")] == [b"beta-secret"]


# row: stream.admin | SADD a name to felix:tenants | remains (write-only)
def test_a_stream_admin_may_only_add_names_to_the_tenants_set(admin: felix_redis.Client, users: Users,
                                                              admin_raw: redis.Redis) -> None:
    """SADD works; reading the set (or removing from it) is refused; the operator's
    listing skips the junk name and the unknown tenant and lists exactly the streams."""
    beta_jobs(admin)
    u = users.make("stream.admin")
    assert u.raw.sadd("felix:tenants", "bad name!", "ghost") == 2
    for command in (("SMEMBERS",), ("SISMEMBER", "beta"), ("SCARD",), ("SSCAN", "0"), ("TYPE",), ("EXISTS",),
                    ("SREM", "beta"), ("DEL",)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            u.raw.execute_command(command[0], "felix:tenants", *command[1:])
    assert admin_raw.smembers("felix:tenants") == {b"acme", b"beta", b"bad name!", b"ghost"}
    assert sorted(admin.stream_list()) == [("acme", "prod", "jobs"), ("beta", "prod", "jobs")]
    listed = felixctl("--redis-url", users.admin_url, "stream", "list", "--all", "-o", "json")
    assert listed.exit_code == 0, listed.output
    assert "beta" in listed.stdout and "ghost" not in listed.stdout and "bad name" not in listed.stdout


# row: stream.publish | write meta by hand | remains, healed where it can be: "deleting
# every field deletes meta: group creation and replay answer 'does not exist' until the
# next publish writes it again" (the other clauses: the meta and producer tests above)
def test_a_meta_emptied_by_a_publisher_is_written_again_by_the_next_publish(
        admin: felix_redis.Client, users: Users, admin_raw: redis.Redis) -> None:
    p = users.make("stream.publish")
    p.raw.hdel(K["meta"], *p.raw.hgetall(K["meta"]))
    assert not admin_raw.exists(K["meta"])
    with pytest.raises(felix_redis.NotFound, match="does not exist"):
        admin.group_create(*S, "late")
    with pytest.raises(felix_redis.NotFound, match="does not exist"):
        admin.read(*S, 0, 0)
    assert p.client.publish(*S, b"after", shard=0).offset == 6
    admin.group_create(*S, "late")
    assert [r.payload for r in admin.read(*S, 0, 0)] == [*FIRST_SIX, b"after"]
    assert drain(admin, "workers") == [*FIRST_SIX, b"after"]


# row: group.consume | wait on, ring or empty another group's bell | closed
@pytest.mark.parametrize("role", ["group.consume", "group.manage"])
def test_a_group_role_cannot_touch_another_groups_bell(admin: felix_redis.Client, users: Users,
                                                       admin_raw: redis.Redis, role: str) -> None:
    """Raw BZPOPMIN, ZADD and DEL on group other's bell are refused, and so is a
    group_poll (long, with a waiter) crafted to name other's bell among workers' keys."""
    u = users.make(role, "workers")
    admin_raw.zadd(group_key("other", "bell"), {"t": 0})
    for command in [("BZPOPMIN", group_key("other", "bell"), "0.01"), ("ZADD", group_key("other", "bell"), "0", "x"),
                    ("DEL", group_key("other", "bell")),
                    ("BZPOPMIN", group_key("workers", "bell", tenant="beta"), "0.01")]:
        with pytest.raises(redis.exceptions.NoPermissionError):
            u.raw.execute_command(*command)
    with recording(admin) as calls:
        admin.group_poll(*S, 0, "workers", max_records=6, wait=0.05)
    real = last_call(calls, "group_poll")
    assert real.keys[-1] == group_key("workers", "bell") and " " in real.args[2]
    before = dump_keyspace(admin_raw)
    forged = real.forged(keys=[*real.keys[:-1], group_key("other", "bell")])
    with pytest.raises(redis.exceptions.NoPermissionError):  # ACL: a key outside its patterns
        fcall(u.raw, forged)
    # the script refuses it too, for a user whose patterns cover both groups
    with pytest.raises(redis.ResponseError, match="FELIX_INVALID"):
        fcall(admin_raw, forged)
    assert dump_keyspace(admin_raw) == before
    assert admin_raw.zrange(group_key("other", "bell"), 0, -1) == [b"t"]
    assert drain(admin, "other") == FIRST_SIX


# row: group.consume | pop or ring its own group's bell, write its lead field | remains, own group only
def test_a_consumer_stealing_its_own_groups_rings_only_delays_its_group(
        admin: felix_redis.Client, users: Users, admin_raw: redis.Redis) -> None:
    """A consumer of workers forges the watch (a made-up waiter, lapsing in 1.5 s) and
    pops the ring: a long poll of workers still gets a new record once the forged watch
    it was told of lapses, nothing is lost; group other still gets everything."""
    u = users.make("group.consume", "workers")
    finish(admin, "workers")
    lapse = int(admin_raw.time()[0]) * 1000 + 1500
    u.raw.hset(group_key("workers"), "lead", f"forged {lapse}")
    assert u.raw.execute_command("BZPOPMIN", group_key("workers", "bell"), "0.01") is None
    got: list[list[felix_redis.Record]] = []
    thread = threading.Thread(target=lambda: got.append(u.client.group_poll(*S, 0, "workers", wait=8.0)))
    thread.start()
    time.sleep(0.3)
    admin.publish(*S, b"late", shard=0)
    thread.join(10)
    assert [r.payload for r in got[0]] == [b"late"]
    assert drain(admin, "other") == [*FIRST_SIX, b"late"]
