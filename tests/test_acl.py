"""Roles and tenants with Redis ACL: real ACL users on the private redis-server."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from click.testing import CliRunner

import felix_redis
from felix_redis import PermissionDenied, acl
from felixctl.cli import cli
from tests.conftest import dump_keyspace, finished_runs
from tests.support.scripts import run_script

PW = "pw-secret-1"
_users = itertools.count()


def user_url(redis_url: str, user: str) -> str:
    return redis_url.replace("redis://", f"redis://{user}:{PW}@", 1)


@pytest.fixture
def admin(raw: redis.Redis, redis_url: str) -> Iterator[felix_redis.Client]:
    """The default user: two tenants, each with a 2-shard stream 'jobs' and groups."""
    c = felix_redis.connect(redis_url)
    for tenant in ("acme", "beta"):
        c.stream_create(tenant, "prod", "jobs", shards=2)
        c.group_create(tenant, "prod", "jobs", "workers")
        c.group_create(tenant, "prod", "jobs", "other")
        for i in range(6):
            c.publish(tenant, "prod", "jobs", f"{tenant}-{i}".encode(), shard=i % 2)
    yield c
    c.close()


@pytest.fixture
def make_user(raw: redis.Redis, redis_url: str) -> Iterator[Callable[..., felix_redis.Client]]:
    """make_user((role, tenant, stream, group), ...) -> a client connected as a new user."""
    made: list[tuple[str, felix_redis.Client]] = []

    def make(*grants: tuple[str, str, str, str | None]) -> felix_redis.Client:
        user = f"felixtest{os.getpid()}x{next(_users)}"
        for i, (role, tenant, stream, group) in enumerate(grants):
            args = acl.setuser_args(user, acl.rules(role, tenant, "prod", stream, group),
                                    password=PW if i == 0 else None)
            acl.grant(raw, args)
        c = felix_redis.connect(user_url(redis_url, user))
        made.append((user, c))
        return c

    yield make
    for user, c in made:
        c.close()
        raw.execute_command("ACL", "DELUSER", user)


def test_consume_user_consumes_but_cannot_manage(admin: felix_redis.Client, make_user: Any, raw: redis.Redis) -> None:
    u = make_user(("group.consume", "acme", "jobs", "workers"))
    a = ("acme", "prod", "jobs")
    recs = u.group_poll(*a, 0, "workers", max_records=3)
    assert [r.payload for r in recs] == [b"acme-0", b"acme-2", b"acme-4"]
    assert u.group_ack(*a, 0, "workers", recs[0].claim)
    u.group_extend(*a, 0, "workers", recs[1].claim, by=60)
    assert u.group_nack(*a, 0, "workers", recs[1].claim) is not None
    u.group_dead_letter(*a, 0, "workers", recs[2].claim, reason="bad")
    assert [d.offset for d in u.group_dead_letters(*a, 0, "workers")] == [2]
    assert u.group_describe(*a, "workers").shards[0].dead == 1
    assert u.group_poll(*a, 1, "workers", max_records=1, wait=0.05)  # long-poll path (XREAD) allowed
    before = dump_keyspace(raw)
    for op in (
        lambda: u.group_redrive(*a, 0, "workers"),
        lambda: u.group_discard(*a, 0, "workers", [2]),
        lambda: u.group_configure(*a, "workers", max_attempts=9),
        lambda: u.group_delete(*a, "workers"),
    ):
        with pytest.raises(PermissionDenied, match=r"group\.manage role on group workers of stream acme/prod/jobs"):
            op()
    with pytest.raises(PermissionDenied):
        u.group_create(*a, "mine")
    with pytest.raises(PermissionDenied, match=r"lacks the stream\.publish role on stream acme/prod/jobs"):
        u.publish(*a, b"x")  # by the script's role check: the consumer may read meta and log
    assert dump_keyspace(raw) == before


def test_consume_user_cannot_touch_another_group(admin: felix_redis.Client, make_user: Any,
                                                 raw: redis.Redis) -> None:
    u = make_user(("group.consume", "acme", "jobs", "workers"))
    before = dump_keyspace(raw)
    for op in (
        lambda: u.group_poll("acme", "prod", "jobs", 0, "other"),
        lambda: u.group_describe("acme", "prod", "jobs", "other"),
        lambda: u.group_ack("acme", "prod", "jobs", 0, "other", 0),
    ):
        with pytest.raises(PermissionDenied):
            op()
    r = redis.Redis.from_url(user_url(_url(raw), _name(u)))
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.hgetall("felix:{acme/prod/jobs/0}:g:other")
    # raw writes on the log (publishing around the scripts) are not granted to a consumer
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.xadd("felix:{acme/prod/jobs/0}:log", {"p": "x"}, id="999-1")
    r.close()
    assert dump_keyspace(raw) == before


def _url(raw: redis.Redis) -> str:
    kw = raw.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/0"


def _name(c: felix_redis.Client) -> str:
    return str(c.redis.connection_pool.connection_kwargs["username"])


def test_manage_user_redrives_and_discards(admin: felix_redis.Client, make_user: Any) -> None:
    a = ("acme", "prod", "jobs")
    recs = admin.group_poll(*a, 0, "workers", max_records=2)
    for r in recs:
        admin.group_dead_letter(*a, 0, "workers", r.claim)
    m = make_user(("group.manage", "acme", "jobs", "workers"))
    assert m.group_redrive(*a, 0, "workers", [recs[0].offset]) == 1
    assert m.group_discard(*a, 0, "workers", [recs[1].offset]) == 1
    m.group_configure(*a, "workers", max_attempts=7)
    m.group_delete(*a, "workers")
    m.group_create(*a, "workers")
    with pytest.raises(PermissionDenied):
        m.group_create(*a, "fresh")  # the role covers group workers only
    with pytest.raises(PermissionDenied, match=r"group\.consume"):
        m.group_poll(*a, 0, "workers")


def test_publisher_publishes_only(admin: felix_redis.Client, make_user: Any) -> None:
    p = make_user(("stream.publish", "acme", "jobs", None))
    a = ("acme", "prod", "jobs")
    assert p.publish(*a, b"new", shard=1).shard == 1  # idempotent by default: a producer secret, no INCR
    assert p.idempotent_producer().publish_keyed(*a, "k", b"keyed").offset >= 0
    with pytest.raises(PermissionDenied):
        p.group_poll(*a, 0, "workers")
    with pytest.raises(PermissionDenied):
        p.stream_delete(*a)
    with pytest.raises(PermissionDenied):
        p.stream_create("acme", "prod", "jobs", shards=2)


def test_tenant_a_cannot_read_or_write_tenant_b(admin: felix_redis.Client, make_user: Any,
                                                raw: redis.Redis) -> None:
    u = make_user(("group.consume", "acme", "jobs", "workers"), ("group.manage", "acme", "jobs", "workers"),
                  ("stream.publish", "acme", "jobs", None), ("stream.admin", "acme", "jobs", None))
    u.group_poll("acme", "prod", "jobs", 0, "workers")  # its own tenant works
    before = {k: v for k, v in dump_keyspace(raw).items() if b"beta" in k}
    b = ("beta", "prod", "jobs")
    ops: list[Callable[[], object]] = [
        lambda: u.stream_describe(*b),
        lambda: u.read(*b, 0, 0),
        lambda: u.publish(*b, b"x"),
        lambda: u.stream_trim(*b),
        lambda: u.stream_delete(*b),
        lambda: u.stream_create("beta", "prod", "new"),
        lambda: u.group_create(*b, "g2"),
        lambda: u.group_delete(*b, "workers"),
        lambda: u.group_describe(*b, "workers"),
        lambda: u.group_poll(*b, 0, "workers"),
        lambda: u.group_ack(*b, 0, "workers", 0),
        lambda: u.group_nack(*b, 0, "workers", "0:0:1"),
        lambda: u.group_extend(*b, 0, "workers", "0:0:1"),
        lambda: u.group_dead_letter(*b, 0, "workers", "0:0:1"),
        lambda: u.group_dead_letters(*b, 0, "workers"),
        lambda: u.group_redrive(*b, 0, "workers"),
        lambda: u.group_discard(*b, 0, "workers"),
    ]
    for op in ops:
        with pytest.raises(PermissionDenied):
            op()
    r = redis.Redis.from_url(user_url(_url(raw), _name(u)))
    beta_keys = [k.decode() for k in raw.keys("felix:{beta/*")]
    assert beta_keys
    for key in beta_keys:
        for command in (("GET", key), ("XRANGE", key, "-", "+"), ("HGETALL", key), ("TYPE", key), ("DEL", key),
                        ("HSET", key, "x", "1")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.execute_command(*command)
    r.close()
    assert {k: v for k, v in dump_keyspace(raw).items() if b"beta" in k} == before


def test_default_user_keeps_working(admin: felix_redis.Client, make_user: Any) -> None:
    make_user(("group.consume", "acme", "jobs", "workers"))
    a = ("acme", "prod", "jobs")
    recs = admin.group_poll(*a, 0, "workers", max_records=1)
    admin.group_dead_letter(*a, 0, "workers", recs[0].claim)
    assert admin.group_redrive(*a, 0, "workers") == 1
    assert ("beta", "prod", "jobs") in admin.stream_list()
    admin.stream_delete("beta", "prod", "jobs")


def test_rules_refuse_bad_input() -> None:
    with pytest.raises(felix_redis.InvalidArgument, match="unknown role"):
        acl.rules("group.own", "t", "n", "s", "g")
    with pytest.raises(felix_redis.InvalidArgument, match="name the group"):
        acl.rules("group.consume", "t", "n", "s")
    with pytest.raises(felix_redis.InvalidArgument, match="leave the group out"):
        acl.rules("stream.publish", "t", "n", "s", "g")
    with pytest.raises(felix_redis.InvalidArgument):
        acl.rules("group.consume", "t*", "n", "s", "g")


def test_capability_keys_are_outside_the_data_patterns() -> None:
    rules = acl.rules("group.consume", "acme", "prod", "jobs", "workers")
    assert "~felixcap:{acme/prod/jobs/*}:g:workers:consume" in rules
    assert not any(r.startswith("~felix:{acme/prod/jobs/*}:*") for r in rules)
    assert "+eval" not in rules and "+@all" not in rules


def test_cli_grant_prints_and_applies(admin: felix_redis.Client, raw: redis.Redis, redis_url: str) -> None:
    user = f"felixcli{os.getpid()}"
    runner = CliRunner()
    base = ["--redis-url", redis_url, "--tenant", "acme", "--namespace", "prod", "acl", "grant", user,
            "--stream", "jobs", "--group", "workers", "--role", "group.consume"]
    printed = runner.invoke(cli, base)
    assert printed.exit_code == 0, printed.output
    assert printed.stdout.startswith(f"ACL SETUSER {user} on +ping")
    assert "felixcap:{acme/prod/jobs/*}:g:workers:consume" in printed.stdout
    assert raw.execute_command("ACL", "GETUSER", user) is None  # printing changes nothing
    raw.function_flush()  # --apply installs the library the role calls
    try:
        applied = runner.invoke(cli, [*base, "--apply", "--password-from-env", "FELIXTEST_PW"],
                                env={"FELIXTEST_PW": PW})
        assert applied.exit_code == 0, applied.output
        assert PW not in applied.output and ">***" in applied.stdout
        port = raw.connection_pool.connection_kwargs["port"]
        name = felix_redis.scripts.library().name
        assert applied.stderr.strip().splitlines() == [
            f"applied: group.consume for user {user} on 127.0.0.1:{port} (primary)",
            f"installed: function library {name}"]
        assert [x[1] for x in raw.function_list()] == [name.encode()]
        c = felix_redis.connect(user_url(redis_url, user))
        assert c.group_poll("acme", "prod", "jobs", 0, "workers")
        c.close()
        # NOPERM through felixctl: exit 1, one 'felixctl: error:' line
        denied = runner.invoke(cli, ["--redis-url", user_url(redis_url, user), "--tenant", "acme",
                                     "--namespace", "prod", "group", "redrive", "jobs", "workers", "--shard", "0",
                                     "--all", "--yes"])
        assert denied.exit_code == 1, denied.output
        lines = denied.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("felixctl: error:") and "group.manage" in lines[0]
        assert PW not in denied.stderr
    finally:
        raw.execute_command("ACL", "DELUSER", user)


def test_rules_let_a_role_route_on_a_cluster_without_reading_data() -> None:
    """redis-py's RedisCluster reads CLUSTER SLOTS and COMMAND on connect and asks COMMAND
    GETKEYS where an FCALL goes: every role gets those keyless commands, nothing more of
    CLUSTER (tests/test_secured_topology.py runs roles on a real cluster)."""
    for role, group in (("group.consume", "workers"), ("group.manage", "workers"), ("stream.publish", None),
                        ("stream.admin", None)):
        rules = acl.rules(role, "acme", "prod", "jobs", group)
        assert {"+cluster|slots", "+command", "+asking"} <= set(rules)
        assert "+cluster" not in rules and not any(r.startswith("+cluster|") and r != "+cluster|slots" for r in rules)


def test_grant_everywhere_on_one_server(raw: redis.Redis) -> None:
    user = f"felixeverywhere{os.getpid()}"
    args = acl.setuser_args(user, acl.rules("stream.publish", "acme", "prod", "jobs"), password=PW)
    try:
        (result,) = acl.grant_everywhere(raw, args)
        port = raw.connection_pool.connection_kwargs["port"]
        assert (result.address, result.role, result.ok, str(result)) == (
            f"127.0.0.1:{port}", "primary", True, f"127.0.0.1:{port} (primary)")
        assert raw.execute_command("ACL", "GETUSER", user) is not None
        (refused,) = acl.grant_everywhere(raw, ["ACL", "SETUSER", user, "+nosuchcommand"])
        assert not refused.ok and "nosuchcommand" in (refused.error or "").lower()
    finally:
        raw.execute_command("ACL", "DELUSER", user)


def test_cli_grant_refuses_missing_password_env() -> None:
    result = CliRunner().invoke(cli, ["--redis-url", "memory://acl", "acl", "grant", "u", "--stream", "s",
                                      "--role", "stream.publish", "--password-from-env", "FELIX_NO_SUCH_VAR_X"])
    assert result.exit_code == 1
    assert "FELIX_NO_SUCH_VAR_X" in result.stderr


def test_roles_call_the_functions_an_admin_installed_and_fail_with_not_installed_until_then(
        admin: felix_redis.Client, make_user: Any, raw: redis.Redis) -> None:
    """Roles get +fcall but neither FUNCTION LOAD nor EVALSHA/SCRIPT LOAD: a role's client
    on a server without the library fails with NotInstalled (a PermissionDenied) and
    changes nothing; once an administrator installed it, role clients (the same one
    too) call the functions, and the role checks hold there too."""
    a = ("acme", "prod", "jobs")
    raw.function_flush()
    u = make_user(("group.consume", "acme", "jobs", "workers"))
    rules = acl.rules("group.consume", "acme", "prod", "jobs", "workers")
    assert "+evalsha" not in rules and "+script|load" not in rules and "+fcall" in rules
    before = dump_keyspace(raw)
    raw.config_resetstat()
    with pytest.raises(felix_redis.NotInstalled, match="felixctl install") as caught:
        u.group_poll(*a, 0, "workers", max_records=1)
    assert isinstance(caught.value, PermissionDenied)
    with pytest.raises(felix_redis.NotInstalled):
        u.publish(*a, b"x")  # whatever the role: nothing to fall back to
    assert u._runner.functions  # no switch to EVALSHA
    stats = raw.info("commandstats")
    assert "cmdstat_evalsha" not in stats and "cmdstat_script|load" not in stats
    assert not raw.function_list()  # the role could not load it
    assert dump_keyspace(raw) == before
    for command in (("SCRIPT", "LOAD", "return 1"), ("EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "0"),
                    ("EVAL", "return 1", "0"), ("FUNCTION", "LOAD", "#!lua name=x\nredis.register_function('x', "
                                                                   "function() return 1 end)")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            u.redis.execute_command(*command)
    assert admin.load_library() == felix_redis.scripts.library().name  # the administrator installs it
    v = make_user(("group.consume", "acme", "jobs", "workers"))
    raw.config_resetstat()
    (r,) = v.group_poll(*a, 0, "workers", max_records=1)
    assert v.group_ack(*a, 0, "workers", r)
    (r,) = u.group_poll(*a, 0, "workers", max_records=1)  # the client that was refused works now
    assert u.group_ack(*a, 0, "workers", r)
    stats = raw.info("commandstats")
    assert v._runner.functions and u._runner.functions
    assert stats["cmdstat_fcall"]["calls"] >= 4 and "cmdstat_evalsha" not in stats
    with pytest.raises(PermissionDenied, match=r"group\.manage role"):
        v.group_redrive(*a, 0, "workers")
    with pytest.raises(PermissionDenied):
        v.group_poll(*a, 0, "other", max_records=1)


def test_a_role_on_one_group_cannot_be_used_on_another_groups_keys(
        admin: felix_redis.Client, make_user: Any, raw: redis.Redis) -> None:
    """manage on 'other' and consume on 'workers' (same stream, so ACL key patterns
    allow both groups' keys): a redrive call that names 'other' (the capability held)
    but hands over the keys of 'workers' is refused, and changes nothing."""
    a = ("acme", "prod", "jobs")
    (r,) = admin.group_poll(*a, 0, "workers", max_records=1)
    admin.group_dead_letter(*a, 0, "workers", r, reason="x")
    u = make_user(("group.manage", "acme", "jobs", "other"), ("group.consume", "acme", "jobs", "workers"))
    name = admin.core.name(*a)
    workers = name.group_key_list(0, "workers")
    other = name.group_key_list(0, "other")
    before = dump_keyspace(raw)
    for keys in ([*name.shard_keys(0), other[0], *workers[1:]], [*name.shard_keys(0), *other[:-1], workers[-1]]):
        with pytest.raises(redis.ResponseError, match="FELIX_INVALID KEYS"):
            run_script(u, "group_redrive", keys, ["all", "0"])
    with pytest.raises(PermissionDenied, match=r"group\.manage role on group workers"):
        u.group_redrive(*a, 0, "workers")
    assert dump_keyspace(raw) == before
    u.group_redrive(*a, 0, "other")  # the role it holds, on that group's own keys


def test_cli_install_as_admin_lets_roles_call_the_functions(
        admin: felix_redis.Client, make_user: Any, raw: redis.Redis, redis_url: str) -> None:
    """felixctl install: the default user loads the library; a role's client
    then calls it; a role itself may not load it (one 'felixctl: error:' line, exit 1)."""
    raw.function_flush()
    u = make_user(("group.consume", "acme", "jobs", "workers"))
    runner = CliRunner()
    user = u.redis.connection_pool.connection_kwargs["username"]
    denied = runner.invoke(cli, ["--redis-url", user_url(redis_url, user), "install"])
    assert denied.exit_code == 1, denied.output
    (line,) = denied.stderr.strip().splitlines()
    assert line.startswith("felixctl: error:") and "loading library felix_" in line
    assert not raw.function_list()
    loaded = runner.invoke(cli, ["--redis-url", redis_url, "install"])
    assert loaded.exit_code == 0, loaded.output
    name = loaded.stdout.strip()
    assert name == felix_redis.scripts.library().name
    assert [x[1] for x in raw.function_list()] == [name.encode()]
    raw.config_resetstat()
    assert u.group_poll("acme", "prod", "jobs", 0, "workers", max_records=1)
    assert u._runner.functions and "cmdstat_evalsha" not in raw.info("commandstats")


def test_a_stream_role_cannot_mix_the_keys_of_two_streams(admin: felix_redis.Client, make_user: Any,
                                                         raw: redis.Redis) -> None:
    """publish on two streams (ACL key patterns allow both): a publish call whose meta is
    one stream's and whose log is the other's is refused, twice (the second call meets
    the remembered shape of the first stream), and changes nothing."""
    admin.stream_create("acme", "prod", "other")
    u = make_user(("stream.publish", "acme", "jobs", None), ("stream.publish", "acme", "other", None))
    jobs, other = admin.core.name("acme", "prod", "jobs"), admin.core.name("acme", "prod", "other")
    u.publish("acme", "prod", "jobs", b"ok", shard=0)  # jobs' shape is known from here on
    before = dump_keyspace(raw)
    keys = [jobs.publish_keys(0)[0], other.publish_keys(0)[1], jobs.publish_keys(0)[2]]
    for _ in range(2):
        refused = r"FELIX_INVALID KEYS\[2\] is .*, not felix:\{acme/prod/jobs/0\}:log"
        with pytest.raises(redis.ResponseError, match=refused):
            run_script(u, "publish", keys, ["", "", "0", "60000", "", "", "", "x"])
    assert dump_keyspace(raw) == before


def test_a_role_may_not_prune_libraries(admin: felix_redis.Client, make_user: Any, raw: redis.Redis,
                                        redis_url: str) -> None:
    """felixctl acl prune-libraries as a role user: refused with one error line, exit 1,
    and every library stays."""
    admin.load_library()
    old = "felix_0123456789ab"
    raw.function_load(f"#!lua name={old}\nredis.register_function('{old}_noop', function() return 1 end)")
    u = make_user(("group.consume", "acme", "jobs", "workers"))
    user = u.redis.connection_pool.connection_kwargs["username"]
    denied = CliRunner().invoke(cli, ["--redis-url", user_url(redis_url, user), "acl", "prune-libraries"])
    assert denied.exit_code == 1, denied.output
    (line,) = denied.stderr.strip().splitlines()
    assert line.startswith("felixctl: error:") and "pruning old function libraries" in line
    assert {x[1] for x in raw.function_list()} == {old.encode(), felix_redis.scripts.library().name.encode()}
    with pytest.raises(PermissionDenied):
        u.prune_libraries()


def test_create_without_info_permission_makes_the_stream(raw: redis.Redis, redis_url: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A user who may not run INFO cannot tell how many replicas there are: the stream
    is made all the same, with a warning that the replication was not checked."""
    user = f"felixnoinfo{os.getpid()}"
    raw.execute_command("ACL", "SETUSER", user, "on", f">{PW}", "~*", "&*", "+@all", "-info")
    try:
        with felix_redis.connect(user_url(redis_url, user)) as c, \
                caplog.at_level(logging.WARNING, logger="felix_redis"):
            assert c.stream_create("acme", "prod", "noinfo", replication=2)
            assert c.stream_describe("acme", "prod", "noinfo").replication == 2
        (warning,) = caplog.records
        assert "cannot read how many replicas" in warning.getMessage() and "unchecked" in warning.getMessage()
    finally:
        raw.execute_command("ACL", "DELUSER", user)


def test_roles_keep_finished_runs_and_walk_the_position(admin: felix_redis.Client, make_user: Any,
                                                        raw: redis.Redis) -> None:
    """Every command the finished-record runs use is one the roles grant: acks above a
    held-back record (the top run in the group hash, runs below it in the done key,
    merging both ways), the position's walk over them and redrives splitting runs."""
    consumer = make_user(("group.consume", "acme", "jobs", "workers"))
    manager = make_user(("group.manage", "acme", "jobs", "workers"))
    a = ("acme", "prod", "jobs")
    for i in range(3):
        admin.publish(*a, f"more-{i}".encode(), shard=0)
    recs = consumer.group_poll(*a, 0, "workers", max_records=6)  # offsets 0..5 of shard 0
    gk = admin.group_keys(*a, "workers")[0]
    assert consumer.group_ack(*a, 0, "workers", recs[5]) is True  # the top run
    assert consumer.group_ack(*a, 0, "workers", recs[2]) is True  # a run in the done key
    consumer.group_dead_letter(*a, 0, "workers", recs[3], reason="bad")  # extends it
    assert finished_runs(raw, gk) == [(2, 3), (5, 5)]
    assert consumer.group_ack(*a, 0, "workers", recs[4]) is True  # joins it to the top run
    assert finished_runs(raw, gk) == [(2, 5)] and not raw.exists(gk["done"])
    assert manager.group_redrive(*a, 0, "workers", [3]) == 1  # splits the top run
    assert finished_runs(raw, gk) == [(2, 2), (4, 5)]
    assert consumer.group_ack_many(*a, 0, "workers", recs[:2]) == [True, True]  # walks over 2
    assert consumer.group_describe(*a, "workers").shards[0].position == 3
    (again,) = consumer.group_poll(*a, 0, "workers", max_records=1)
    assert again.offset == 3
    assert consumer.group_ack(*a, 0, "workers", again) is True  # walks over the top run
    assert consumer.group_describe(*a, "workers").shards[0].position == 6
    assert finished_runs(raw, gk) == [] and raw.hget(gk["group"], "top") is None
