"""The Lua side on its own: prelude helpers under lupa, and every script refusing bad
arguments that bypass the Python checks (a second line of defence) without writing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from lupa import lua51

import felix_redis
from felix_redis import Client
from felix_redis.keys import StreamName
from felix_redis.protocol import Eval
from felix_redis.scripts import lua_dir

T, N, S, G = "acme", "prod", "jobs", "workers"
NAME = StreamName.of("felix", T, N, S)
SHARD = NAME.shard_keys(0)
PUBLISH = NAME.publish_keys(0)  # meta, log, conf: what publish and stream_create take
INFO = NAME.info_keys(0)  # meta, log, groups, conf: what stream_info, stream_trim and stream_delete take first
GROUP = [*SHARD, *NAME.group_key_list(0, G)]
SECRET = "0123456789abcdef" * 2  # a well-formed producer secret


# ------------------------------------------------------------------- prelude under lupa


@pytest.fixture(scope="module")
def prelude() -> Any:
    lua = lua51.LuaRuntime()
    lua.execute("redis = {call = function(cmd) if cmd == 'TIME' then return {'1700000000', '123456'} end end}")
    text = (lua_dir() / "includes" / "prelude.lua").read_text()
    p = lua.execute(
        text + "\nreturn {fail = fail, fmt = fmt, now_ms = now_ms, int_arg = int_arg, "
        "int_arg_seen = int_arg_seen, setting_num = setting_num, parse_id = parse_id}"
    )
    # Calls f under pcall: (True, result) or (False, the FELIX_... message).
    p.try_ = lua.execute(
        "return function(f, ...) local ok, e = pcall(f, ...) "
        "if ok then return true, e end return false, type(e) == 'table' and e.felix or tostring(e) end"
    )
    p.table = lua.table_from
    return p


def test_now_ms(prelude: Any) -> None:
    assert prelude.now_ms() == 1_700_000_000_123


@pytest.mark.parametrize("usec", ["0", "7", "99", "999", "1000", "5321", "12345", "99999", "100000", "123456",
                                  "999999"])
def test_now_ms_text_is_now_ms_as_a_decimal_string(usec: str) -> None:
    # TIME gives microseconds without leading zeros: every length must land on the same
    # millisecond as now_ms()'s arithmetic
    lua = lua51.LuaRuntime()
    lua.execute("redis = {call = function(cmd) if cmd == 'TIME' then return {'1700000000', '" + usec + "'} end end}")
    text = (lua_dir() / "includes" / "prelude.lua").read_text()
    p = lua.execute(text + "\nreturn {now_ms = now_ms, now_ms_text = now_ms_text}")
    want = 1_700_000_000_000 + int(usec) // 1000
    assert p.now_ms() == want
    assert p.now_ms_text() == str(want)


def test_int_arg_seen_checks_like_int_arg_and_remembers(prelude: Any) -> None:
    assert prelude.int_arg_seen("3600000", "idle", 1, 2**40) == 3_600_000
    assert prelude.int_arg_seen("3600000", "idle", 1, 2**40) == 3_600_000  # remembered
    for bad in ["0", "x", "", "1.5", None]:
        ok, message = prelude.try_(prelude.int_arg_seen, bad, "idle", 1, 2**40)
        assert ok is False and message.startswith("FELIX_INVALID idle must be")
    # a value remembered for one argument is checked anew for another
    ok, _ = prelude.try_(prelude.int_arg_seen, "3600000", "other", 1, 10)
    assert ok is False


def test_setting_num(prelude: Any) -> None:
    assert prelude.setting_num("1048576") == 1_048_576
    assert prelude.setting_num("1048576") == 1_048_576
    assert prelude.setting_num("junk") is None


def test_fmt_writes_large_integers_without_exponent(prelude: Any) -> None:
    assert prelude.fmt(2**52) == "4503599627370496"
    assert prelude.fmt(1_700_000_000_123) == "1700000000123"
    assert prelude.fmt(0) == "0"


@pytest.mark.parametrize("value, lo, hi, want", [("0", 0, 10, 0), ("10", 0, 10, 10), ("-3", -5, 5, -3),
                                                  ("4503599627370496", 0, 2**52, 2**52)])
def test_int_arg_accepts(prelude: Any, value: str, lo: int, hi: int, want: int) -> None:
    assert prelude.int_arg(value, "x", lo, hi) == want


@pytest.mark.parametrize("value", ["", " 1", "1 ", "1.5", "1e3", "0x10", "+1", "11", "-1", "abc",
                                   "12345678901234567", None])
def test_int_arg_refuses(prelude: Any, value: str | None) -> None:
    ok, message = prelude.try_(prelude.int_arg, value, "thing", 0, 10)
    assert ok is False
    assert message.startswith("FELIX_INVALID thing must be")


def test_fail_raises_a_felix_error(prelude: Any) -> None:
    assert tuple(prelude.try_(prelude.fail, "NOT_FOUND", "no such thing")) == (
        False, "FELIX_NOT_FOUND no such thing")


def test_parse_id(prelude: Any) -> None:
    off, ms = prelude.parse_id("15-1700000000000")
    assert (off, ms) == (15, "1700000000000")


# --------------------------------------------------- scripts refuse bad raw arguments


def run(client: Client, script: str, keys: list[str], args: list[Any]) -> Any:
    return client._execute(Eval(script, keys, args, f"raw {script}"))


@pytest.fixture
def ready(stream: Client) -> Client:
    stream.publish_batch(T, N, S, [b"a", b"b", b"c"])
    stream.group_poll(T, N, S, 0, G, max_records=1)
    return stream


NEW_GROUP = [*SHARD, *NAME.group_key_list(0, "g2"), NAME.groups_key(0)]
NEW_STREAM = StreamName.of("felix", T, N, "fresh").publish_keys(0)
OK_CREATE = ["queue", "2", "0", "1", "leader", "0", "0", "100", "acme/prod/fresh", "0", "safe", "2"]

BAD_RAW: list[tuple[str, list[str], list[Any]]] = [
    ("group_poll", GROUP, ["0", "", "0"]),
    ("group_poll", GROUP, ["10001", "", "0"]),
    ("group_poll", GROUP, ["1.5", "", "0"]),
    ("group_poll", GROUP, ["", "", "0"]),
    ("group_ack", GROUP, []),
    ("group_ack", GROUP, ["-1"]),
    ("group_ack", GROUP, ["0", "x"]),
    ("group_nack", GROUP, ["0", "1", "-1"]),
    ("group_nack", GROUP, ["0", "1", "604800001"]),
    ("group_nack", GROUP, ["0", "0", "0"]),
    ("group_nack", GROUP, ["0", "1", ""]),
    ("group_extend", GROUP, ["0", "1", "0"]),
    ("group_extend", GROUP, ["0", "1", "-5"]),
    ("group_extend", GROUP, ["x", "1", ""]),
    ("group_dead_letter", GROUP, ["0", "1", "x" * 4097]),
    ("group_dead_letter", GROUP, ["0", "-1", ""]),
    ("group_configure", GROUP, ["0", ""]),
    ("group_configure", GROUP, ["", "0"]),
    ("group_configure", GROUP, ["abc", ""]),
    ("group_create", NEW_GROUP, ["g2", "soon", "1000", "5", "1"]),
    ("group_create", NEW_GROUP, ["g2", "earliest", "0", "5", "1"]),
    ("group_create", NEW_GROUP, ["g2", "earliest", "1000", "0", "1"]),
    ("group_create", NEW_GROUP, ["g2", "4", "1000", "5", "1"]),  # beyond the tail (3)
    ("group_redrive", GROUP, ["some", "0"]),
    ("group_redrive", GROUP, ["list", "0"]),
    ("group_redrive", GROUP, ["list", "0", "x"]),
    ("group_discard", GROUP, ["some", "0"]),
    ("group_discard", GROUP, ["list", "0"]),
    ("publish", PUBLISH, ["", "", "0", "0", "", "", "", b"x"]),
    ("publish", PUBLISH, ["", "", "0", "1000", "", "", ""]),
    ("publish", PUBLISH, ["", SECRET, "0", "1000", "", "", "", b"x"]),  # a producer's sequence starts at 1
    ("publish", PUBLISH, ["", "7x", "1", "1000", "", "", "", b"x"]),
    ("publish", PUBLISH, ["", "7", "1", "1000", "", "", "", b"x"]),  # a producer id, not a secret
    ("publish", PUBLISH, ["", SECRET[:31], "1", "1000", "", "", "", b"x"]),  # a secret too short
    ("publish", PUBLISH, ["", SECRET * 2 + "0", "1", "1000", "", "", "", b"x"]),  # a secret too long
    ("publish", PUBLISH, ["", SECRET.upper(), "1", "1000", "", "", "", b"x"]),  # not lower-case hex
    ("publish", PUBLISH, ["", "", "x", "1000", "", "", "", b"x"]),
    ("publish", PUBLISH, ["k" * 1025, "", "0", "1000", "", "", "", b"x"]),  # a record key over 1024 bytes
    ("publish", PUBLISH, ["k" * 1025, SECRET, "1", "1000", "", "", "", b"x"]),
    ("publish", SHARD, ["", "", "0", "1000", "", "", "", b"x"]),  # the conf key missing
    ("publish", [*SHARD, SHARD[0]], ["", "", "0", "1000", "", "", "", b"x"]),  # a third key not the shard's conf
    ("publish", [*PUBLISH, PUBLISH[0]], ["", "", "0", "1000", "", "", "", b"x"]),  # a fourth key
    ("publish", [*PUBLISH, PUBLISH[0]], ["", "", "0", "1000", "+1000", "", "", b"x"]),  # not the due index
    ("publish", PUBLISH, ["", "", "0", "1000", "+1000", "", "", b"x"]),  # a delay without the due index
    ("publish", PUBLISH, ["", "", "0", "1000", "5000", "", "", b"x"]),  # a delivery time without + or @
    ("publish", PUBLISH, ["", "", "0", "1000", "", "0", "", b"x"]),  # an expiry of 0 ms
    ("publish", PUBLISH, ["", "", "0", "1000", "", "", "[1]", b"x"]),  # headers not an object
    ("publish", [PUBLISH[1], PUBLISH[0], PUBLISH[2]], ["", "", "0", "1000", "", "", "", b"x"]),  # keys out of order
    ("stream_read", SHARD, ["-1", "1"]),
    ("stream_read", SHARD, ["0", "0"]),
    ("stream_create", NEW_STREAM, ["topic", *OK_CREATE[1:]]),
    ("stream_create", NEW_STREAM, [OK_CREATE[0], "0", *OK_CREATE[2:]]),
    ("stream_create", NEW_STREAM, [*OK_CREATE[:2], "2", *OK_CREATE[3:]]),
    ("stream_create", NEW_STREAM, [*OK_CREATE[:3], "17", *OK_CREATE[4:]]),
    ("stream_create", NEW_STREAM, [*OK_CREATE[:4], "most", *OK_CREATE[5:]]),
    ("stream_create", NEW_STREAM, [*OK_CREATE[:5], "-1", *OK_CREATE[6:]]),
    ("stream_create", NEW_STREAM, [*OK_CREATE[:7], "0", *OK_CREATE[8:]]),
    ("stream_create", NEW_STREAM, [*OK_CREATE[:10], "sometimes", "2"]),
    ("stream_create", NEW_STREAM, [*OK_CREATE[:11], "3"]),  # spread for another shard count
    ("stream_create", NEW_STREAM, [*OK_CREATE[:11], "-1"]),
    ("stream_create", NEW_STREAM, OK_CREATE[:11]),  # no spread
    ("stream_create", [*NEW_STREAM[:2], NEW_STREAM[0]], OK_CREATE),  # a third key not the shard's conf
    ("stream_create", NEW_STREAM[:2], OK_CREATE),  # the conf key missing
    ("stream_info", [*SHARD, NAME.groups_key(0)], []),  # the conf key missing
    ("stream_info", [*INFO, INFO[0]], []),  # a fifth key
    ("stream_delete", INFO, ["x"]),
    ("stream_delete", INFO, ["1", G]),  # keys of the group missing
    ("stream_delete", [*INFO, *NAME.group_key_list(0, "g2")], ["1", G]),  # keys of another group than ARGV names
    ("stream_delete", [*INFO, *NAME.group_key_list(0, G), SHARD[0] + "x"], ["1", G]),  # a key more
    ("stream_delete", [*SHARD, NAME.groups_key(0), *NAME.group_key_list(0, G)], ["1", G]),  # the conf key missing
    ("stream_trim", INFO, ["1", G]),  # keys of the group missing
    ("stream_trim", [*INFO, *NAME.group_key_list(0, "g2")[:1], NAME.group_key_list(0, "g2")[5]], ["1", G]),  # made up
    ("stream_trim", [*INFO, *NAME.group_key_list(0, G)[:2]], ["1", G]),  # not the group hash and its redo set
    ("group_create", NEW_GROUP, ["g3", "earliest", "1000", "5", "1"]),  # ARGV names a group KEYS are not of
    ("group_delete", [*GROUP, NAME.groups_key(0)], ["g2"]),  # likewise
]


@pytest.mark.parametrize("script, keys, args", BAD_RAW, ids=[f"{s}-{i}" for i, (s, _, _) in enumerate(BAD_RAW)])
def test_script_refuses_bad_raw_arguments(
    ready: Client, unchanged: Callable[[], Any], script: str, keys: list[str], args: list[Any]
) -> None:
    with unchanged(), pytest.raises(felix_redis.InvalidArgument):
        run(ready, script, keys, args)


def test_stream_create_good_raw_arguments_work(client: Client) -> None:
    assert run(client, "stream_create", NEW_STREAM, OK_CREATE) == 1
    assert run(client, "stream_create", NEW_STREAM, OK_CREATE) == 0


def test_group_create_not_strict_leaves_an_existing_group(ready: Client, unchanged: Callable[[], Any]) -> None:
    keys = [*GROUP, NAME.groups_key(0)]
    with unchanged():
        assert run(ready, "group_create", keys, [G, "latest", "5", "1", "0"]) == 0
    with unchanged(), pytest.raises(felix_redis.GroupExists):
        run(ready, "group_create", keys, [G, "latest", "5", "1", "1"])


def test_group_delete_is_safe_to_run_twice(ready: Client) -> None:
    keys = [*GROUP, NAME.groups_key(0)]
    assert run(ready, "group_delete", keys, [G]) == 1
    assert run(ready, "group_delete", keys, [G]) == 0
    assert ready.redis.keys("*:g:*") == []


def test_stream_delete_refuses_a_stale_group_list(ready: Client, unchanged: Callable[[], Any]) -> None:
    from felix_redis.errors import Conflict

    with unchanged(), pytest.raises(Conflict):
        run(ready, "stream_delete", INFO, ["0"])


def test_stream_delete_deletes_the_conf_and_the_producer_states_with_the_shard(
    ready: Client, unchanged: Callable[[], Any]
) -> None:
    """Producer states live in the meta hash and the settings in conf: stream_delete
    takes meta, log, groups, conf and the groups' keys, and leaves nothing of the shard.
    It takes no other key: a key more is refused and nothing is deleted."""
    producer = ready.idempotent_producer()
    producer.publish(T, N, S, b"x", shard=0)
    assert ready.redis.hexists(SHARD[0], f"producer:{producer.id}")
    assert ready.redis.hget(NAME.conf_key(0), "kind") == b"queue"
    keys = [*INFO, *NAME.group_key_list(0, G)]
    with unchanged(), pytest.raises(felix_redis.InvalidArgument):
        run(ready, "stream_delete", [*keys, f"{NAME.base(0)}:producer:9"], ["1", G])
    assert run(ready, "stream_delete", keys, ["1", G]) == 1
    assert set(ready.redis.keys("*{acme/prod/jobs/0}*")) == set()


def test_publish_refuses_oversize_raw_payload(client: Client, unchanged: Callable[[], Any]) -> None:
    client.stream_create(T, N, S, max_payload=10)
    keys = PUBLISH
    assert run(client, "publish", keys, ["", "", "0", "1000", "", "", "", b"x" * 10])[:2] == [0, 1]
    with unchanged(), pytest.raises(felix_redis.InvalidArgument, match="at most 10"):
        run(client, "publish", keys, ["", "", "0", "1000", "", "", "", b"ok", b"x" * 11])
