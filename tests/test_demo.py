"""felixctl demo: runs to completion, tells the story, cleans up after itself."""

from __future__ import annotations

import re
import time

import pytest
import redis
from click.testing import CliRunner

import felix_redis
import felixctl.demo as demo_module
from felixctl.cli import cli
from felixctl.demo import Mishaps, choose_backend

CLOSED = "redis://127.0.0.1:1/0"


def run_demo(url: str, *args: str) -> str:
    started = time.monotonic()
    result = CliRunner().invoke(cli, ["--redis-url", url, "demo", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert time.monotonic() - started < 15
    return result.stdout


def check_story(out: str) -> None:
    lower = out.lower()
    assert "dead letter" in lower
    assert "redriv" in lower
    assert "attempt 2" in out  # a retry
    assert "now a dead letter: 3 attempts used up" in out
    assert "after the redrive" in out
    tail = out.rstrip().splitlines()
    end = max(i for i, line in enumerate(tail) if line.endswith("Nothing owed, nothing in flight."))
    assert tail[end + 1] == "" and all(  # then only the clean-up
        line.startswith(("Deleted the demo stream", "Kept it:", "Removed the function library",
                         "Kept the function library")) for line in tail[end + 2:]), tail[end:]
    lines = out[out.index("Final state"):].splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("SHARD"))
    rows = [line.split() for line in lines[header + 1:header + 4] if line.strip()]
    assert rows and rows[-1][0] == "all"
    for row in rows:  # LAG, IN-FLIGHT, OWED, DEAD
        assert row[-6] == row[-4] == row[-3] == row[-2] == "0", row


def test_demo_on_a_throwaway_server(raw: redis.Redis, redis_url: str) -> None:
    raw.set("someone-elses-key", "untouched")
    out = run_demo(redis_url)
    check_story(out)
    assert f"the Redis at {redis_url}" in out
    assert "Deleted the demo stream" in out
    assert raw.get("someone-elses-key") == b"untouched"
    assert raw.zcard("felix:streams") == 0
    # Nothing of the demo stays for good (idempotent-producer memory expires by itself).
    left = [k for k in raw.keys("felix:{demo-*") if raw.ttl(k) < 0]
    assert left == []


def test_demo_removes_the_library_it_loaded_on_an_empty_server(raw: redis.Redis, redis_url: str) -> None:
    raw.function_flush()
    out = run_demo(redis_url, "--orders", "1")
    check_story(out)
    assert "Removed the function library felix_" in out
    assert raw.function_list() == []


def test_demo_leaves_a_library_that_was_there(raw: redis.Redis, redis_url: str) -> None:
    raw.function_flush()
    with felix_redis.connect(redis_url) as client:
        name = client.load_library()
    out = run_demo(redis_url, "--orders", "1")
    assert "function library" not in out
    assert [lib[b"library_name"].decode() for lib in map(_fields, raw.function_list())] == [name]


def test_demo_keep_says_it_kept_the_library(raw: redis.Redis, redis_url: str) -> None:
    raw.function_flush()
    out = run_demo(redis_url, "--orders", "1", "--keep")
    assert "Kept the function library felix_" in out and "FUNCTION DELETE felix_" in out
    assert len(raw.function_list()) == 1


def _fields(entry: list[object] | dict[bytes, object]) -> dict[bytes, object]:
    return entry if isinstance(entry, dict) else dict(zip(entry[::2], entry[1::2], strict=False))  # type: ignore[arg-type]


def test_demo_on_memory() -> None:
    out = run_demo("memory://demo-test", "--orders", "3", "--workers", "2")
    check_story(out)
    assert "in-process memory://demo-test backend" in out


def test_demo_keep_leaves_the_stream(raw: redis.Redis, redis_url: str) -> None:
    out = run_demo(redis_url, "--orders", "1", "--keep")
    check_story(out)
    tenant = re.search(r"--tenant (demo-[0-9a-f]+)", out)
    assert tenant is not None
    members = [m.decode() for m in raw.zrange(f"felix:streams:{tenant.group(1)}", 0, -1)]
    assert members == [f"{tenant.group(1)}/checkout/orders"]


def test_same_seed_same_failures(redis_url: str) -> None:
    def dead_letters(out: str) -> str:
        return out[out.index("Dead letters"):out.index("Fixing the bug")]

    first = run_demo("memory://seed-a", "--seed", "42")
    second = run_demo("memory://seed-b", "--seed", "42")
    assert dead_letters(first) == dead_letters(second)
    assert Mishaps.make([1, 2, 3], 42) == Mishaps.make([1, 2, 3], 42)


def test_choose_backend_prefers_the_given_url() -> None:
    backend = choose_backend("redis://:pw@example.invalid:6379/0")
    assert backend.url == "redis://:pw@example.invalid:6379/0"
    assert "pw@" not in backend.description
    assert backend.server is None


def test_choose_backend_starts_a_throwaway_server(monkeypatch: pytest.MonkeyPatch) -> None:
    if demo_module.redis_server_binary() is None:
        pytest.skip("no redis-server binary")
    backend = choose_backend(None, local_url=CLOSED)
    try:
        assert backend.server is not None
        assert "throwaway redis-server" in backend.description
        assert redis.Redis.from_url(backend.url).ping()
    finally:
        backend.close()


def test_choose_backend_falls_back_to_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_module, "redis_server_binary", lambda: None)
    backend = choose_backend(None, local_url=CLOSED)
    assert backend.url.startswith("memory://demo-")
    assert "memory://" in backend.description


def test_choose_backend_uses_a_local_redis_that_answers(redis_url: str) -> None:
    backend = choose_backend(None, local_url=redis_url)
    assert backend.url == redis_url
    assert backend.server is None
    assert "answered" in backend.description


def test_demo_help_has_examples() -> None:
    result = CliRunner().invoke(cli, ["demo", "--help"])
    assert result.exit_code == 0
    assert "felixctl demo --orders" in result.stdout


def test_readme_first_command_leaves_a_server_it_found_empty_empty(raw: redis.Redis, redis_url: str) -> None:
    """`felixctl demo` as the README runs it (a real process, the server from
    $FELIX_REDIS_URL): on a server with no keys and no function library, it leaves none."""
    import os
    import subprocess
    import sys

    raw.function_flush()
    assert raw.dbsize() == 0 and raw.function_list() == []
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FELIX_")}, "FELIX_REDIS_URL": redis_url}
    done = subprocess.run([sys.executable, "-m", "felixctl", "demo"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    check_story(done.stdout)
    assert "Removed the function library felix_" in done.stdout
    assert raw.function_list() == []
    # only the idempotent-producer memory is left, and it expires by itself
    assert [k for k in raw.keys("*") if raw.ttl(k) < 0] == []
