"""felixctl as a real process: the "Try it" sequence, stdin handling, no hangs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import redis


def felixctl(
    redis_url: str, *args: str, input: bytes | None = None, stdin: Any = None, timeout: float = 30
) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FELIX_")}
    return subprocess.run(
        [sys.executable, "-m", "felixctl", "--redis-url", redis_url, *args],
        input=input, stdin=stdin if input is None else None, capture_output=True, timeout=timeout, env=env,
    )


def ok(result: subprocess.CompletedProcess[bytes]) -> str:
    assert result.returncode == 0, (result.stdout, result.stderr)
    return result.stdout.decode()


def test_try_it_sequence(raw: redis.Redis, redis_url: str) -> None:
    ok(felixctl(redis_url, "stream", "create", "orders", "--kind", "queue"))
    ok(felixctl(redis_url, "pub", "orders", "hello"))  # the quickstart's record, before the group
    ok(felixctl(redis_url, "group", "create", "orders", "workers-1", "--from", "latest"))
    again = felixctl(redis_url, "group", "create", "orders", "workers-1", "--from", "latest")
    assert again.returncode == 1
    assert again.stderr.decode().startswith("felixctl: error: ")

    published = ok(felixctl(redis_url, "pub", "orders", "job-1")).strip()
    shard, offset = published.split(":")
    assert shard == "0"

    first = ok(felixctl(redis_url, "group", "poll", "orders", "workers-1", "--max", "1", "--wait-ms", "5000"))
    assert first == f"0:{offset}:1\tjob-1\n"
    ok(felixctl(redis_url, "group", "nack", "orders", "workers-1", f"0:{offset}:1"))
    second = ok(felixctl(redis_url, "group", "poll", "orders", "workers-1", "--max", "1", "--wait-ms", "5000"))
    assert second == f"0:{offset}:2\tjob-1\n"
    ok(felixctl(redis_url, "group", "ack", "orders", "workers-1", f"0:{offset}:2"))

    described = json.loads(ok(felixctl(redis_url, "group", "describe", "orders", "workers-1", "-o", "json")))
    assert described["owed"] == 0
    assert described["in_flight"] == 0
    assert described["lag"] == 0
    assert all(s["owed"] == 0 for s in described["shards"])
    text = ok(felixctl(redis_url, "group", "describe", "orders", "workers-1"))
    assert "OWED" in text


def test_poll_with_nothing_due_exits_zero(raw: redis.Redis, redis_url: str) -> None:
    ok(felixctl(redis_url, "stream", "create", "orders"))
    ok(felixctl(redis_url, "group", "create", "orders", "w"))
    result = felixctl(redis_url, "group", "poll", "orders", "w")
    assert (result.returncode, result.stdout, result.stderr) == (0, b"", b"")


def test_pub_from_a_pipe(raw: redis.Redis, redis_url: str) -> None:
    ok(felixctl(redis_url, "stream", "create", "orders"))
    ok(felixctl(redis_url, "group", "create", "orders", "w"))
    assert ok(felixctl(redis_url, "pub", "orders", "-", input=b'{"a": 1}\n')) == "0:0\n"
    out = felixctl(redis_url, "group", "poll", "orders", "w", "-o", "json")
    assert json.loads(ok(out))[0]["payload"] == '{"a": 1}'


@pytest.mark.parametrize("stdin", ["devnull", "open-pipe"])
def test_redrive_all_from_a_script_goes_ahead_without_waiting(raw: redis.Redis, redis_url: str, stdin: str) -> None:
    """No terminal (CI, cron, a pipe kept open and silent): --all acts as written,
    nothing waits for an answer."""
    ok(felixctl(redis_url, "stream", "create", "orders"))
    ok(felixctl(redis_url, "group", "create", "orders", "w"))
    ok(felixctl(redis_url, "pub", "orders", "x"))
    ok(felixctl(redis_url, "group", "poll", "orders", "w"))
    ok(felixctl(redis_url, "group", "dead-letter", "orders", "w", "0:0:1"))
    started = time.monotonic()
    if stdin == "devnull":
        result = felixctl(redis_url, "group", "redrive", "orders", "w", "--all", stdin=subprocess.DEVNULL)
    else:
        # stdin stays open and silent, like a CI runner's
        proc = subprocess.Popen(
            [sys.executable, "-m", "felixctl", "--redis-url", redis_url, "group", "redrive", "orders", "w", "--all"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        out, err = _wait_open(proc)
        result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert time.monotonic() - started < 15
    assert ok(result) == "redriven 1 dead letter\n"
    assert ok(felixctl(redis_url, "group", "dead-letters", "orders", "w")) == "no dead letters\n"


def _wait_open(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    """Waits for ``proc`` without closing its stdin, then collects its output."""
    try:
        proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.stdout is not None and proc.stderr is not None and proc.stdin is not None
    proc.stdin.close()
    return proc.stdout.read(), proc.stderr.read()


def test_unreachable_redis_exits_1_without_password(raw: redis.Redis) -> None:
    result = felixctl("redis://default:pa55word@127.0.0.1:1/0", "group", "describe", "orders", "w")
    assert result.returncode == 1
    err = result.stderr.decode()
    assert err.startswith("felixctl: error: ") and "127.0.0.1:1" in err
    assert "pa55word" not in err
    assert "Traceback" not in err


def test_usage_error_exits_2(redis_url: str) -> None:
    assert felixctl(redis_url, "group", "poll", "orders").returncode == 2


def test_console_script_is_installed(redis_url: str) -> None:
    script = os.path.join(os.path.dirname(sys.executable), "felixctl")
    if not os.path.exists(script):
        pytest.skip("felixctl console script not installed next to this interpreter")
    result = subprocess.run([script, "--version"], capture_output=True, timeout=30)
    assert result.returncode == 0
    assert result.stdout.startswith(b"felixctl ")


def test_contract_create_example_on_a_server_without_replicas(raw: redis.Redis, redis_url: str) -> None:
    """The contract's 'stream create ... --replication 3 --consistency quorum' on a
    standalone server (one copy): refused in one error line naming both numbers, nothing
    written. With --force: created with one warning line, and since its own writes WAIT
    like every write of a quorum stream, the command then fails with the distinct
    not-replicated error; so does every publish, applied on the primary."""
    args = ("stream", "create", "jobs", "--kind", "queue", "--shards", "4", "--replication", "3",
            "--consistency", "quorum")
    result = felixctl(redis_url, *args)
    assert result.returncode == 1 and result.stdout == b""
    (line,) = result.stderr.decode().splitlines()
    assert line.startswith("felixctl: error: ") and "replication=3 asks for 3 copies" in line and "has 1 now" in line
    assert not raw.keys("felix:{default/default/jobs/*")
    result = felixctl(redis_url, *args, "--force")
    assert result.returncode == 1
    warning, error = result.stderr.decode().splitlines()
    assert warning.startswith("felixctl: warning: ") and "created anyway" in warning
    assert error.startswith("felixctl: error: ") and "applied on every shard" in error
    result = felixctl(redis_url, "pub", "jobs", '{"order":42,"task":"send-receipt"}', "--shard", "0")
    assert result.returncode == 1
    (line,) = result.stderr.decode().splitlines()
    assert line.startswith("felixctl: error: ") and "failover" in line
    assert raw.xlen("felix:{default/default/jobs/0}:log") == 1


