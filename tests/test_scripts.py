"""The Lua scripts: they compile, the loader resolves includes strictly, every header
matches the keys and arguments the Python side passes, and time comes from the server."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from lupa import lua51

import felix_redis
from felix_redis import scripts
from felix_redis.keys import GROUP_ROLES, SHARD_ROLES
from felix_redis.protocol import Batch, Eval
from felix_redis.scripts import ScriptError

NAMES = scripts.script_names()
LUA = scripts.lua_dir()
KEY_LINE = re.compile(r"^--\s*KEYS\[(\d+)\]\s+(\w+)", re.M)
#: A KEYS line with its description's first line (for "optional").
KEY_LINES = re.compile(r"^--\s*KEYS\[\d+\]\s+\w+.*$", re.M)
ARGV_LINE = re.compile(r"^--\s*ARGV\[(\d+)(\.\.)?\]\s+(\w+)", re.M)
ARGV_RANGE = re.compile(r"^--\s*ARGV\[(\d+)\.\.(\d*)\]", re.M)


#: A script's header line that stands for the group key block, which
#: lua/includes/group.lua's header describes key by key (written once, there).
GROUP_BLOCK = re.compile(r"^--\s*KEYS\[1\]\.\.KEYS\[13\]: the group key block\b")


def header(name: str, root: Path = LUA) -> str:
    """The leading comment block of lua/<name>.lua, the group key block line expanded
    to the block's KEYS lines from includes/group.lua."""
    lines = []
    for line in (root / f"{name}.lua").read_text().splitlines():
        if not line.startswith("--") or line.startswith("--- @include"):
            break
        lines.append(line)
        if GROUP_BLOCK.match(line):
            lines += [m.group(0) for m in KEY_LINE.finditer(header("includes/group", root))]
    return "\n".join(lines)


def body(name: str) -> str:
    """The code of lua/<name>.lua without its comments."""
    text = (LUA / f"{name}.lua").read_text()
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())


def test_there_are_scripts() -> None:
    assert {"publish", "group_poll", "group_ack", "group_nack", "stream_create"} <= set(NAMES)


# --------------------------------------------------------------------------- compile


@pytest.mark.parametrize("name", NAMES)
def test_script_compiles_with_lua51(name: str) -> None:
    source = scripts.load(name).source
    lua = lua51.LuaRuntime()
    result = lua.execute("return loadstring(...)", source)
    if isinstance(result, tuple):
        pytest.fail(f"{name} does not compile: {result[1]}")
    assert lua51.lua_type(result) == "function"


def test_compile_check_catches_a_syntax_error() -> None:
    lua = lua51.LuaRuntime()
    result = lua.execute("return loadstring(...)", "local x = = 1")
    assert isinstance(result, tuple) and result[0] is None


@pytest.mark.parametrize("name", NAMES)
def test_source_has_prelude_includes_and_epilogue(name: str) -> None:
    src = scripts.load(name)
    assert src.includes[0] == "prelude"
    assert "local function now_ms()" in src.source
    assert "local function main()" in src.source
    assert src.source.rstrip().endswith("return reply_of(pcall(main))")
    assert "@include" not in src.source
    if "group" in src.includes:
        assert src.includes[:4] == ("prelude", "roles", "acl", "group")  # dependencies first


# ---------------------------------------------------------------------------- loader


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


PRELUDE = {"includes/prelude.lua": "local function p() return 1 end\n"}


def test_loader_orders_dependencies_first_and_once(tmp_path: Path) -> None:
    root = write(tmp_path, {
        **PRELUDE,
        "includes/c.lua": "local function c() return 3 end\n",
        "includes/a.lua": '--- @include "c"\nlocal function a() return c() end\n',
        "includes/b.lua": '--- @include "c"\nlocal function b() return c() end\n',
        "s.lua": '-- s\n--- @include "a"\n--- @include "b"\nreturn a() + b() + p()\n',
    })
    src = scripts.load("s", root)
    assert src.includes == ("prelude", "c", "a", "b")
    assert src.source.count("local function c()") == 1
    order = [src.source.index(f"local function {f}()") for f in ("p", "c", "a", "b")]
    assert order == sorted(order)
    assert scripts.script_names(root) == ["s"]
    lua = lua51.LuaRuntime()
    assert lua51.lua_type(lua.execute("return loadstring(...)", src.source)) == "function"


def test_loader_missing_include(tmp_path: Path) -> None:
    root = write(tmp_path, {**PRELUDE, "s.lua": '--- @include "nope"\nreturn 1\n'})
    with pytest.raises(ScriptError, match="nope"):
        scripts.load("s", root)


def test_loader_missing_nested_include(tmp_path: Path) -> None:
    root = write(tmp_path, {
        **PRELUDE,
        "includes/a.lua": '--- @include "gone"\n',
        "s.lua": '--- @include "a"\nreturn 1\n',
    })
    with pytest.raises(ScriptError, match="gone"):
        scripts.load("s", root)


def test_loader_circular_include(tmp_path: Path) -> None:
    root = write(tmp_path, {
        **PRELUDE,
        "includes/a.lua": '--- @include "b"\n',
        "includes/b.lua": '--- @include "a"\n',
        "s.lua": '--- @include "a"\nreturn 1\n',
    })
    with pytest.raises(ScriptError, match="circular"):
        scripts.load("s", root)


def test_loader_self_include(tmp_path: Path) -> None:
    root = write(tmp_path, {**PRELUDE, "includes/a.lua": '--- @include "a"\n', "s.lua": '--- @include "a"\n'})
    with pytest.raises(ScriptError, match="circular"):
        scripts.load("s", root)


def test_loader_duplicate_include(tmp_path: Path) -> None:
    root = write(tmp_path, {
        **PRELUDE,
        "includes/a.lua": "local x = 1\n",
        "s.lua": '--- @include "a"\n--- @include "a"\nreturn 1\n',
    })
    with pytest.raises(ScriptError, match="twice"):
        scripts.load("s", root)


def test_loader_duplicate_include_inside_an_include(tmp_path: Path) -> None:
    root = write(tmp_path, {
        **PRELUDE,
        "includes/a.lua": "local x = 1\n",
        "includes/b.lua": '--- @include "a"\n--- @include "a"\n',
        "s.lua": '--- @include "b"\nreturn 1\n',
    })
    with pytest.raises(ScriptError, match="twice"):
        scripts.load("s", root)


def test_loader_refuses_explicit_prelude_malformed_lines_and_missing_script(tmp_path: Path) -> None:
    root = write(tmp_path, {
        **PRELUDE,
        "p.lua": '--- @include "prelude"\nreturn 1\n',
        "m.lua": "--- @include nope\nreturn 1\n",
    })
    with pytest.raises(ScriptError, match="automatically"):
        scripts.load("p", root)
    with pytest.raises(ScriptError, match="malformed"):
        scripts.load("m", root)
    with pytest.raises(ScriptError, match="not found"):
        scripts.load("absent", root)


def test_loader_needs_a_prelude(tmp_path: Path) -> None:
    root = write(tmp_path, {"s.lua": "return 1\n"})
    with pytest.raises(ScriptError, match="prelude"):
        scripts.load("s", root)


# --------------------------------------------------------------------------- headers


@pytest.mark.parametrize("name", NAMES)
def test_header_documents_keys_argv_returns_errors(name: str) -> None:
    text = header(name)
    assert text.startswith(f"-- {name}: "), "the header starts with '-- NAME: what it does'"
    assert KEY_LINE.search(text), "no KEYS[n] lines"
    assert ARGV_LINE.search(text) or "(no ARGV)" in text, "no ARGV lines and no '(no ARGV)'"
    assert re.search(r"^-- Returns: \S", text, re.M), "no Returns: line"
    assert re.search(r"^-- Errors: \S", text, re.M), "no Errors: line"
    numbers = [int(n) for n, _ in KEY_LINE.findall(text)]
    assert numbers == list(range(1, len(numbers) + 1)), "KEYS must be numbered 1, 2, 3, ..."
    argv = [int(n) for n, _, _ in ARGV_LINE.findall(text)]
    assert argv == list(range(1, len(argv) + 1)), "ARGV must be numbered 1, 2, 3, ..."


def key_role(key: str) -> str:
    """The role of a key felix-redis built: meta, log, groups, group, lease, ..., producer."""
    match = re.fullmatch(r"felix:\{[^}]+\}:(.+)", key)
    assert match, key
    rest = match.group(1)
    if rest.startswith("g:"):
        parts = rest.split(":")
        return "group" if len(parts) == 2 else parts[2]
    if rest.startswith("producer:"):
        return "producer"
    return rest


@pytest.fixture(scope="module")
def evals() -> dict[str, list[Eval]]:
    """Every Eval the client sends while running each operation once (memory://)."""
    client = felix_redis.connect("memory://scripts-header-check")
    seen: dict[str, list[Eval]] = {}
    original = client._execute

    def record(op: Any) -> Any:
        for call in (op.ops if isinstance(op, Batch) else [op]):
            if isinstance(call, Eval):
                seen.setdefault(call.script, []).append(call)
        return original(op)

    client._execute = record  # type: ignore[method-assign]
    t, n, s, g = "acme", "prod", "jobs", "workers"
    client.stream_create(t, n, s, shards=2)
    client.stream_describe(t, n, s)
    client.group_create(t, n, s, g)
    client.group_configure(t, n, s, g, visibility_timeout_ms=1000, max_attempts=3)
    client.publish_batch(t, n, s, [b"a", b"b", b"c", b"d"], shard=0, key="k")
    client.idempotent_producer().publish(t, n, s, b"e", shard=0)
    client.read(t, n, s, 0, 0)
    a, b, c, d = client.group_poll_as(t, n, s, 0, g, consumer="w1", reclaim=True, max_records=4)
    client.group_ack(t, n, s, 0, g, a)
    client.group_nack(t, n, s, 0, g, b, delay=1)
    client.group_extend(t, n, s, 0, g, c, by=5)
    client.group_dead_letter(t, n, s, 0, g, d, reason="r")
    client.group_dead_letters(t, n, s, 0, g)
    client.group_redrive(t, n, s, 0, g, [3])
    client.group_redrive(t, n, s, 0, g)
    client.group_discard(t, n, s, 0, g)
    client.group_describe(t, n, s, g)
    client.schedule_set(t, n, s, "nightly", b"x", cron="0 3 * * *", timezone="Europe/Zurich")
    client.schedule_set(t, n, s, "often", b"y", every=1)
    client.schedule_list(t, n, s)
    time.sleep(1.1)  # the first due time of "often" comes: the tick publishes it (schedule_fire)
    assert client.schedule_tick(t, n, s)
    client.schedule_delete(t, n, s, "often")
    client.schedule_delete(t, n, s, "nightly")
    client.group_delete(t, n, s, g)
    client.group_create(t, n, s, "other")
    client.stream_trim(t, n, s)
    client.stream_delete(t, n, s)
    client.close()
    return seen


def test_every_script_is_used_and_every_used_script_exists(evals: dict[str, list[Eval]]) -> None:
    assert set(evals) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_header_keys_match_the_keys_python_passes(name: str, evals: dict[str, list[Eval]]) -> None:
    documented = [role for _, role in KEY_LINE.findall(header(name))]
    for op in evals[name]:
        roles = [key_role(k) for k in op.keys]
        if name == "stream_delete":
            # KEYS[5..]: one key per group role per group, in GROUP_ROLES order, then the
            # shard's due index, and nothing else (no producer keys)
            assert roles[:4] == documented == ["meta", "log", "groups", "conf"]
            assert roles[-3:] == ["due", "sched", "schedules"] and "KEYS[last] due" in header(name)
            groups = roles[4:-3]
            assert "producer" not in groups
            per = len(GROUP_ROLES)
            assert len(groups) % per == 0
            for i in range(0, len(groups), per):
                assert tuple(groups[i:i + per]) == GROUP_ROLES
            assert "GROUP_ROLES" in header(name) and f"{per} per group" in header(name)
        elif name == "stream_trim":
            # KEYS[5..]: the group hash and redo zset of each group, then the due index
            assert roles[:4] == documented == ["meta", "log", "groups", "conf"]
            assert roles[-1] == "due" and "KEYS[last] due" in header(name)
            rest = roles[4:-1]
            assert len(rest) % 2 == 0
            assert all(tuple(rest[i:i + 2]) == ("group", "redo") for i in range(0, len(rest), 2))
        else:
            # keys a header marks optional may be left off the end (a publish passes the
            # due index only with a delivery time)
            optional = [bool(re.search(r"optional|only with", line)) for line in KEY_LINES.findall(header(name))]
            left_off = documented[len(roles):]
            assert roles == documented[:len(roles)] and all(optional[len(roles):]), (
                f"{name}: Python passes {roles}, the header says {documented} ({left_off} not optional)")


#: The scripts that work on one group (they include lua/includes/group.lua).
GROUP_SCRIPTS = [n for n in NAMES if "group" in scripts.load(n).includes]


def test_the_group_scripts_are_found() -> None:
    assert len(GROUP_SCRIPTS) >= 10 and "group_poll" in GROUP_SCRIPTS and "publish" not in GROUP_SCRIPTS


@pytest.mark.parametrize("name", GROUP_SCRIPTS)
def test_group_scripts_take_shard_and_group_roles_in_order(name: str) -> None:
    raw = [line for line in (LUA / f"{name}.lua").read_text().splitlines() if line.startswith("--")]
    assert sum(bool(GROUP_BLOCK.match(line)) for line in raw) == 1  # the block is named once ...
    assert not [line for line in raw if KEY_LINE.match(line) and int(KEY_LINE.match(line)[1]) <= 13]  # not written out
    documented = tuple(role for _, role in KEY_LINE.findall(header(name)))
    assert documented[:len(SHARD_ROLES + GROUP_ROLES)] == SHARD_ROLES + GROUP_ROLES
    # then the shard's due index, and (create, delete) its groups set or (poll) the bell
    assert documented[len(SHARD_ROLES + GROUP_ROLES):] in (("due",), ("due", "groups"), ("due", "bell"))


def test_group_include_key_types_follow_group_roles() -> None:
    text = (LUA / "includes" / "group.lua").read_text()
    table = re.search(r"GROUP_KEY_TYPES = (\{.*?\})\n", text)
    assert table
    shard_roles = tuple(re.findall(r"\{'(\w+)', '\w+'\}", table.group(1)))
    assert shard_roles == SHARD_ROLES
    role_table = re.search(r"GROUP_ROLE_TYPES = \{(.*?)\n\}", (LUA / "includes" / "roles.lua").read_text(), re.S)
    assert role_table
    assert tuple(re.findall(r"\{'(\w+)', '\w+'\}", role_table.group(1))) == GROUP_ROLES
    comment = tuple(re.findall(r"KEYS\[\d+\] (\w+)", text.split("local GROUP_KEY_TYPES")[0]))
    assert comment == SHARD_ROLES + GROUP_ROLES


@pytest.mark.parametrize("name", NAMES)
def test_header_argv_matches_the_arguments_python_passes(name: str, evals: dict[str, list[Eval]]) -> None:
    text = header(name)
    fixed = [int(n) for n, dots, _ in ARGV_LINE.findall(text) if not dots]
    variadic = ARGV_RANGE.search(text)
    for op in evals[name]:
        if variadic:  # the fixed part always, then any number (a mode may take none)
            assert int(variadic.group(1)) == len(fixed) + 1
            assert len(op.args) >= len(fixed)
        else:
            assert len(op.args) == len(fixed), f"{name}: Python passes {len(op.args)} args, header {len(fixed)}"


# error codes a helper can raise, so a script that calls it must list them
HELPER_ERRORS = {
    "int_arg": {"INVALID"},
    "expect_type": {"WRONGTYPE"},
    "typed_call": {"WRONGTYPE"},
    "kcall": {"WRONGTYPE"},
    "key_type": {"WRONGTYPE"},
    "check_types": {"WRONGTYPE"},
    "load_group": {"NOT_FOUND", "WRONGTYPE"},
    "check_claim": {"NOT_FOUND", "STALE_CLAIM"},
    "require_group_role": {"NOPERM", "INVALID"},
    "require_stream_role": {"NOPERM", "INVALID"},
    "require_shard_keys": {"INVALID"},
    "require_group_keys": {"INVALID"},
}


@pytest.mark.parametrize("name", NAMES)
def test_errors_line_lists_every_code_the_script_raises(name: str) -> None:
    code = body(name)
    raised = set(re.findall(r"fail\('([A-Z_]+)'", code))
    for helper, codes in HELPER_ERRORS.items():
        if re.search(rf"\b{helper}\(", code):
            raised |= codes
    errors = header(name).split("-- Errors:", 1)[1]
    listed = set(re.findall(r"FELIX_([A-Z_]+)", errors))
    assert raised <= listed, f"{name} raises {sorted(raised - listed)} without documenting it"
    assert listed <= raised | {"NOT_FOUND"}, f"{name} documents {sorted(listed - raised)} it never raises"


def test_every_error_code_maps_to_an_exception() -> None:
    codes: set[str] = set()
    for path in [*LUA.glob("*.lua"), *LUA.glob("includes/*.lua")]:
        codes |= set(re.findall(r"fail\('([A-Z_]+)'", path.read_text()))
    from felix_redis.errors import _CODES

    assert codes <= set(_CODES)


# ------------------------------------------------------------------------------ time


TIME_ARG = re.compile(r"(^|_)(now|time|clock|epoch|timestamp|ts)(_|$)|^ms$", re.I)


@pytest.mark.parametrize("name", NAMES)
def test_no_script_takes_the_time_from_the_client(name: str) -> None:
    argv = [arg for _, _, arg in ARGV_LINE.findall(header(name))]
    assert not [a for a in argv if TIME_ARG.search(a)]
    code = body(name)
    assert "TIME" not in code, "read the clock through now_ms() (or now_ms_text()) from the prelude"
    if re.search(r"\bnow\b", code) and "now_ms_text()" not in code:
        assert re.search(r"\bnow\s*=\s*now_ms\(\)", code), "now must come from now_ms()"
    if "now_ms_text()" in code:
        assert re.search(r"\bms\s*=\s*now_ms_text\(\)", code), "ms must come from now_ms_text()"
    # ARGV values are never used as a time: no arithmetic of ARGV with 'now'
    assert not re.search(r"now\s*=\s*[^\n]*ARGV", code)


WRITES_TIME = ["publish", "stream_create", "group_create", "group_poll", "group_nack", "group_extend",
               "group_dead_letter", "group_redrive"]


@pytest.mark.parametrize("name", WRITES_TIME)
def test_scripts_that_store_times_call_now_ms(name: str) -> None:
    assert "now_ms()" in body(name) or "now_ms_text()" in body(name)


@pytest.mark.parametrize("helper", ["now_ms", "now_ms_text"])
def test_now_ms_reads_redis_time(helper: str) -> None:
    prelude = (LUA / "includes" / "prelude.lua").read_text()
    fn = prelude.split(f"local function {helper}()", 1)[1].split("\nend", 1)[0]
    assert "redis.call('TIME')" in fn


WRITE_COMMANDS = re.compile(r"redis\.call\('(XADD|HSET|HDEL|ZADD|ZREM|SADD|SREM|SET|DEL|PEXPIRE)'")


#: The scripts whose header says they write nothing.
READ_ONLY = [n for n in NAMES if "Writes nothing" in header(n)]


def test_the_read_only_scripts_are_found() -> None:
    assert {"stream_info", "stream_read", "group_describe", "group_dead_letters"} <= set(READ_ONLY)
    assert "group_poll" not in READ_ONLY


@pytest.mark.parametrize("name", READ_ONLY)
def test_read_only_scripts_write_nothing(name: str) -> None:
    assert not WRITE_COMMANDS.search(body(name))
    src = scripts.load(name)
    for inc in src.includes[1:]:
        # includes define helpers; the read-only script may only call non-writing ones
        text = (LUA / "includes" / f"{inc}.lua").read_text()
        writers = {m.group(1) for m in re.finditer(r"local function (\w+)\(", text)
                   if WRITE_COMMANDS.search(text.split(m.group(0), 1)[1].split("\nend", 1)[0])}
        called = {w for w in writers if re.search(rf"\b{w}\(", body(name))}
        assert not called, f"{name} says it writes nothing but calls {called}"
