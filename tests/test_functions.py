"""The scripts as one Redis function library (FCALL), and the EVALSHA fallback."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from click.testing import CliRunner

import felix_redis
import felix_redis.asyncio as fa
from felix_redis import scripts
from felix_redis.testing.server import RedisServer
from felixctl.cli import cli

T, N, S, G = "acme", "prod", "jobs", "workers"


def calls(raw: redis.Redis, command: str) -> int:
    return int(raw.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def pairs(flat: list[Any]) -> dict[Any, Any]:
    """A RESP2 map (a flat list of names and values) as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def drain_once(c: felix_redis.Client, n: int = 3) -> None:
    """One publish, poll, ack cycle through every kind of call: single, batch, sharded."""
    c.publish_batch(T, N, S, [b"x"] * n, shard=0)
    records = c.group_poll(T, N, S, 0, G, max_records=n)
    assert len(records) == n
    assert c.group_ack_many(T, N, S, 0, G, records) == [True] * n
    c.publish(T, N, S, b"y", shard=1)
    items = c.group_sharded(T, N, S, G).poll(4)  # a pipeline of one call per shard
    assert [i.record.payload for i in items] == [b"y"]
    c.group_sharded(T, N, S, G).ack_many(items)


@pytest.fixture
def setup(redis_client: felix_redis.Client, raw: redis.Redis) -> Iterator[felix_redis.Client]:
    redis_client.stream_create(T, N, S, shards=2)
    redis_client.group_create(T, N, S, G)
    yield redis_client
    raw.config_set("maxmemory", 0)


def test_library_holds_every_script_as_a_function_named_by_its_digest(raw: redis.Redis) -> None:
    lib = scripts.library()
    assert set(lib.functions) == set(scripts.script_names())
    assert lib.name.startswith("felix_") and all(f == f"{lib.name}_{n}" for n, f in lib.functions.items())
    raw.function_load(lib.code, replace=True)
    (listed,) = [pairs(x) for x in raw.function_list(library=lib.name)]
    assert listed[b"library_name"] == lib.name.encode()
    flags = {pairs(f)[b"name"].decode(): {g.decode() for g in pairs(f)[b"flags"]} for f in listed[b"functions"]}
    assert set(flags) == set(lib.functions.values())
    for name, fn in lib.functions.items():
        assert flags[fn] == ({"no-writes"} if name in scripts.READ_ONLY else set())


def test_client_calls_the_functions_and_loads_them_where_missing(setup: felix_redis.Client,
                                                                   raw: redis.Redis) -> None:
    c = setup
    raw.function_flush()
    raw.config_resetstat()
    drain_once(c)
    assert calls(raw, "fcall") > 0 and calls(raw, "evalsha") == 0
    assert c._runner.functions
    # a server that lost them (FUNCTION FLUSH, a restart without persistence) gets them again
    raw.function_flush()
    drain_once(c)
    assert raw.function_list(library=scripts.library().name)
    raw.function_flush()
    assert c.load_library() == scripts.library().name
    assert raw.function_list(library=scripts.library().name)


def test_async_client_loads_the_functions_again_after_a_flush(setup: felix_redis.Client, raw: redis.Redis,
                                                               redis_url: str) -> None:
    async def main() -> None:
        c = fa.connect(redis_url)
        try:
            await c.publish(T, N, S, b"a", shard=0)
            raw.function_flush()
            (r,) = await c.group_poll(T, N, S, 0, G, max_records=1)
            assert await c.group_ack(T, N, S, 0, G, r)
            raw.function_flush()
            await c.publish(T, N, S, b"b", shard=1)
            items = await (await c.group_sharded(T, N, S, G)).poll(4)
            assert [i.record.payload for i in items] == [b"b"]
            assert c._runner.functions
            raw.function_flush()
            assert await c.load_library() == scripts.library().name
            assert raw.function_list(library=scripts.library().name)
        finally:
            await c.close()

    raw.config_resetstat()
    asyncio.run(main())
    assert calls(raw, "fcall") > 0 and calls(raw, "evalsha") == 0


def test_evalsha_mode_runs_the_same_scripts(setup: felix_redis.Client, raw: redis.Redis) -> None:
    c = setup
    c._runner.functions = False
    raw.script_flush()
    raw.config_resetstat()
    drain_once(c)
    raw.script_flush()
    drain_once(c)
    assert calls(raw, "evalsha") > 0 and calls(raw, "fcall") == 0


def test_a_server_without_functions_gets_evalsha() -> None:
    """FCALL refused as an unknown command (renamed away here, or an older server):
    EVALSHA from then on, on the client's lane and through the pool alike."""
    with RedisServer(extra=["--rename-command", "FCALL", ""]) as server:
        c = felix_redis.connect(server.url)
        try:
            c.stream_create(T, N, S, shards=2)
            c.group_create(T, N, S, G)
            c.publish(T, N, S, b"x", shard=0)
            assert not c._runner.functions
            assert [r.payload for r in c.group_poll(T, N, S, 0, G, max_records=2)] == [b"x"]
            # the same with the lane taken (another thread's call): through the pool
            c2 = felix_redis.connect(server.url)
            assert c2._lane is not None
            with c2._lane.lock:
                c2.publish(T, N, S, b"y", shard=1)
                assert not c2._runner.functions
                assert [r.payload for r in c2.group_poll(T, N, S, 1, G, max_records=2)] == [b"y"]
            c2.close()
        finally:
            c.close()


def test_read_only_operations_run_when_writes_are_refused(setup: felix_redis.Client, raw: redis.Redis) -> None:
    """maxmemory reached: FCALL of a function without no-writes is refused up front, so
    the read-only scripts carry the flag and keep working, as through EVALSHA."""
    c = setup
    c.publish(T, N, S, b"x", shard=0)
    raw.config_set("maxmemory", 1)
    assert c.group_describe(T, N, S, G).shards[0].tail == 1
    assert [r.payload for r in c.read(T, N, S, 0, 0)] == [b"x"]
    assert c.stream_describe(T, N, S).shards == 2
    assert c.group_dead_letters(T, N, S, 0, G) == []
    with pytest.raises(felix_redis.FelixError):
        c.publish(T, N, S, b"y", shard=0)
    raw.config_set("maxmemory", 0)
    assert c.group_describe(T, N, S, G).shards[0].tail == 1


def fake_library(raw: redis.Redis, name: str) -> None:
    """A one-function library named ``name`` (function names are global: made unique)."""
    raw.function_load(f"#!lua name={name}\nredis.register_function('{name}_noop', function() return 1 end)",
                      replace=True)


def library_names(raw: redis.Redis) -> set[str]:
    return {pairs(x)[b"library_name"].decode() for x in raw.function_list()}


OLD = ["felix_0123456789ab", "felix_fedcba987654"]
FOREIGN = ["felix_custom", "felix_0123456789abc", "reports"]  # not felix_<12 hex digits>


def test_prune_libraries_deletes_other_versions_only(setup: felix_redis.Client, raw: redis.Redis) -> None:
    c = setup
    c.load_library()
    for name in OLD + FOREIGN:
        fake_library(raw, name)
    assert c.prune_libraries() == OLD
    assert library_names(raw) == {scripts.library().name, *FOREIGN}
    assert c.prune_libraries() == []
    drain_once(c)


def test_a_version_whose_library_was_pruned_loads_it_again(setup: felix_redis.Client, raw: redis.Redis,
                                                           redis_url: str) -> None:
    """Another version prunes this one's library: this client's next calls load it again."""
    c = setup
    c.load_library()
    newer = felix_redis.connect(redis_url)
    newer._runner.library = scripts.Library("felix_ffffffffffff", "", {})  # another version's client
    try:
        assert newer.prune_libraries() == [scripts.library().name]
    finally:
        newer.close()
    assert scripts.library().name not in library_names(raw)
    raw.config_resetstat()
    drain_once(c)
    assert scripts.library().name in library_names(raw)
    assert calls(raw, "fcall") > 0 and calls(raw, "evalsha") == 0


def test_async_prune_libraries(setup: felix_redis.Client, raw: redis.Redis, redis_url: str) -> None:
    async def main() -> list[str]:
        c = fa.connect(redis_url)
        try:
            await c.load_library()
            return await c.prune_libraries()
        finally:
            await c.close()

    for name in OLD + FOREIGN:
        fake_library(raw, name)
    assert asyncio.run(main()) == OLD
    assert library_names(raw) == {scripts.library().name, *FOREIGN}


def test_cli_prune_libraries(setup: felix_redis.Client, raw: redis.Redis, redis_url: str) -> None:
    setup.load_library()
    fake_library(raw, OLD[0])
    result = CliRunner().invoke(cli, ["--redis-url", redis_url, "acl", "prune-libraries"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [OLD[0]]
    assert f"removed 1 old function library; this version's is {scripts.library().name}" in result.stderr
    result = CliRunner().invoke(cli, ["--redis-url", redis_url, "acl", "prune-libraries"])
    assert result.exit_code == 0 and result.stdout == ""
    assert "removed 0 old function libraries" in result.stderr


def test_other_libraries_reads_resp2_and_resp3_listings() -> None:
    current = scripts.library().name
    resp2 = [[b"library_name", n.encode(), b"engine", b"LUA", b"functions", []] for n in [*OLD, current, *FOREIGN]]
    resp3 = [{"library_name": n, "engine": "LUA", "functions": []} for n in [OLD[1], current, "reports"]]
    assert scripts.other_libraries(resp2, current) == OLD
    assert scripts.other_libraries(resp3, current) == [OLD[1]]
    assert scripts.other_libraries([], current) == [] and scripts.other_libraries(None, current) == []


@pytest.mark.parametrize("user", ["plainuser", "functionuser"])
def test_a_user_refused_fcall_gets_evalsha_whatever_its_name(
    setup: felix_redis.Client, raw: redis.Redis, redis_url: str, user: str
) -> None:
    """ACL refusing FCALL turns the client to EVALSHA, also for a user whose name says
    "function" (Valkey names the user in its refusal; that once read as a refused
    FUNCTION LOAD), and every call of the pipeline that met the refusal goes again."""
    from felix_redis.plans import Batch, Eval

    setup.load_library()
    raw.execute_command("ACL", "SETUSER", user, "on", ">pw-f", "~*", "+@all", "-fcall")
    try:
        c = felix_redis.connect(redis_url.replace("redis://", f"redis://{user}:pw-f@", 1))
        name = c.core.cache.laid(c.core.cache.name(T, N, S), 2)
        # the first call of this client is a pipeline of two: both are refused FCALL
        replies = c._execute(Batch([Eval("stream_info", name.info_keys(s), [], f"shard {s}") for s in range(2)]))
        assert all(isinstance(r, list) for r in replies), replies
        assert not c._runner.functions
        assert c.group_describe(T, N, S, G).pending == 0
        c.close()
    finally:
        raw.execute_command("ACL", "DELUSER", user)
