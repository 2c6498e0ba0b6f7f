"""Passwords stay secret, and credentials can come from the URL, a file or the environment.

A password must never show in: ConnectionFailed messages (sync and asyncio; plain,
sentinel and cluster URLs; user:password@ and ?password= forms), ``client.url`` and
reprs, felixctl error lines, ``--help`` output, ``felixctl demo`` output, or a
``felixctl worker``'s log. Credentials: the URL's own password wins; else
``$FELIX_REDIS_PASSWORD``. The URL: ``--redis-url`` / ``--redis-url-file`` on the command
line, else ``$FELIX_REDIS_URL``, else ``$FELIX_REDIS_URL_FILE``, else the default.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

import felix_redis
import felix_redis.asyncio as felix_asyncio
from felix_redis.connection import async_client, resolve_url, sync_client
from felix_redis.errors import redact_url
from felix_redis.testing.server import RedisServer, redis_server_binary
from felixctl.cli import cli

SECRET = "s3cret-Pw"
APP_SECRET = "app-Pw-42"
#: a password with an unencoded space (issue 19 item 7a): masked all the same
SPACED = "pa ss-7"
ROOT = Path(__file__).resolve().parent.parent
T, N = "acme", "prod"

needs_server = pytest.mark.skipif(redis_server_binary() is None, reason="needs a redis-server binary")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FELIX_REDIS_URL", "FELIX_REDIS_URL_FILE", "FELIX_REDIS_PASSWORD"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def locked() -> Iterator[RedisServer]:
    """A Redis with ``requirepass`` and an ACL user ``app``."""
    server = RedisServer(extra=["--requirepass", SECRET, "--user", "app", "on", f">{APP_SECRET}", "~*", "&*", "+@all"])
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _no_secret(*texts: object) -> None:
    for text in texts:
        for secret in (SECRET, APP_SECRET, SPACED, "pa ss", "ss-7"):
            assert secret not in str(text), text


# -- redact_url


@pytest.mark.parametrize("url, shown", [
    (f"redis://:{SECRET}@h:6379/0", "redis://:***@h:6379/0"),
    (f"redis://app:{SECRET}@h:6379/0", "redis://app:***@h:6379/0"),
    (f"redis://h:6379/0?password={SECRET}&db=1", "redis://h:6379/0?password=***&db=1"),
    (f"rediss+sentinel://:{SECRET}@s1,s2/m/0?sentinel_password={SECRET}",
     "rediss+sentinel://:***@s1,s2/m/0?sentinel_password=***"),
    (f"unix://:{SECRET}@/run/redis.sock?db=2", "unix://:***@/run/redis.sock?db=2"),
    ("redis://u:p@ss/w@h:6379/0", "redis://u:***@h:6379/0"),  # unencoded @ and / in the password
    ("redis://h:6379/0?ssl_ca_certs=/pki/a@b.pem", "redis://h:6379/0?ssl_ca_certs=/pki/a@b.pem"),
    (f"cannot reach Redis at 'redis://:{SECRET}@h:1/0': refused",
     "cannot reach Redis at 'redis://:***@h:1/0': refused"),
])
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


# -- library errors and reprs


UNREACHABLE = [
    f"redis://:{SECRET}@127.0.0.1:1/0",
    f"redis://app:{SECRET}@127.0.0.1:1/0",
    f"redis://127.0.0.1:1/0?password={SECRET}",
    f"rediss://:{SECRET}@127.0.0.1:1/0?ssl_cert_reqs=none",
    f"redis+sentinel://app:{SECRET}@127.0.0.1:1/mymaster/0?sentinel_password={SECRET}",
    f"redis+cluster://:{SECRET}@127.0.0.1:1",
    f"redis://:{SPACED}@127.0.0.1:1/0",
    f"redis://app:{SPACED}@127.0.0.1:1/0",
    f"redis+sentinel://:{SPACED}@127.0.0.1:1/mymaster/0",
    f"redis+cluster://:{SPACED}@127.0.0.1:1",
]


@pytest.mark.parametrize("url", UNREACHABLE)
def test_connection_failures_hide_the_password(url: str) -> None:
    with pytest.raises(felix_redis.ConnectionFailed) as info:
        client = felix_redis.connect(url, retry_for=0)
        _no_secret(client.url, repr(client), repr(client.redis))
        try:
            client.stream_list()
        finally:
            client.close()
    _no_secret(info.value, repr(info.value.args), info.value.__cause__, info.value.__context__)
    assert "127.0.0.1:1" in str(info.value)


@pytest.mark.parametrize("url", UNREACHABLE)
def test_connection_failures_hide_the_password_asyncio(url: str) -> None:
    async def main() -> BaseException:
        client = felix_asyncio.connect(url, retry_for=0)
        _no_secret(client.url, repr(client), repr(client.redis))
        try:
            with pytest.raises(felix_redis.ConnectionFailed) as info:
                await client.stream_list()
        finally:
            await client.close()
        return info.value

    error = asyncio.run(main())
    _no_secret(error, repr(error.args), error.__cause__, error.__context__)
    assert "127.0.0.1:1" in str(error)


def test_environment_password_is_not_shown_either(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FELIX_REDIS_PASSWORD", SECRET)
    client = felix_redis.connect("redis://127.0.0.1:1/0", retry_for=0)
    with pytest.raises(felix_redis.ConnectionFailed) as info:
        client.stream_list()
    client.close()
    _no_secret(info.value, client.url, repr(client.redis))


# -- where the password comes from


@needs_server
def test_password_from_the_environment(locked: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    bare = f"redis://127.0.0.1:{locked.port}/0"
    # no password: refused at once (no retry fixes credentials), naming the server
    started = time.monotonic()
    with pytest.raises(felix_redis.PermissionDenied, match="refused the credentials"):
        felix_redis.connect(bare).stream_list()
    assert time.monotonic() - started < 1.5
    monkeypatch.setenv("FELIX_REDIS_PASSWORD", SECRET)
    for url in (bare, f"redis://:@127.0.0.1:{locked.port}/0"):
        with felix_redis.connect(url) as client:
            assert client.stream_list() == []
    # a username in the URL, its password from the environment (an ACL user)
    monkeypatch.setenv("FELIX_REDIS_PASSWORD", APP_SECRET)
    with felix_redis.connect(f"redis://app@127.0.0.1:{locked.port}/0") as client:
        assert client.redis.acl_whoami() == "app"

    async def main() -> None:
        async with felix_asyncio.connect(f"redis://app@127.0.0.1:{locked.port}/0") as client:
            assert await client.redis.acl_whoami() == "app"

    asyncio.run(main())


@needs_server
def test_the_urls_own_password_wins(locked: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FELIX_REDIS_PASSWORD", "wrong")
    for url in (f"redis://:{SECRET}@127.0.0.1:{locked.port}/0", f"redis://127.0.0.1:{locked.port}/0?password={SECRET}"):
        with felix_redis.connect(url) as client:
            assert client.stream_list() == []
    monkeypatch.setenv("FELIX_REDIS_PASSWORD", SECRET)
    with pytest.raises(felix_redis.PermissionDenied) as info:
        felix_redis.connect(f"redis://:wrong@127.0.0.1:{locked.port}/0", retry_for=0).stream_list()
    _no_secret(info.value)
    assert "wrong" not in str(info.value)


def test_environment_password_reaches_sentinel_and_cluster_data_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FELIX_REDIS_PASSWORD", SECRET)
    for raw in (sync_client("redis+sentinel://s1:26379/m/0?sentinel_password=spw"),
                async_client("redis+sentinel://s1:26379/m/0?sentinel_password=spw")):
        assert raw.connection_pool.connection_kwargs["password"] == SECRET
        for sentinel in raw.connection_pool.sentinel_manager.sentinels:  # sentinels keep their own
            assert sentinel.connection_pool.connection_kwargs["password"] == "spw"
    assert sync_client("redis+sentinel://:own@s1/m/0").connection_pool.connection_kwargs["password"] == "own"
    assert async_client("redis+cluster://h:7000").nodes_manager.connection_kwargs["password"] == SECRET
    assert async_client("redis+cluster://:own@h:7000").nodes_manager.connection_kwargs["password"] == "own"


def test_url_from_a_file_for_the_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "url"
    path.write_text("  redis://:pw@h:6379/3\n")
    monkeypatch.setenv("FELIX_REDIS_URL_FILE", str(path))
    assert resolve_url(None) == "redis://:pw@h:6379/3"
    assert resolve_url("redis://other:6379/0") == "redis://other:6379/0"
    monkeypatch.setenv("FELIX_REDIS_URL", "redis://env:6379/0")
    assert resolve_url(None) == "redis://env:6379/0"
    monkeypatch.delenv("FELIX_REDIS_URL")
    path.write_text(SECRET + "\n")  # a bare password is not a URL; never echoed
    with pytest.raises(felix_redis.InvalidArgument) as info:
        resolve_url(None)
    assert str(path) in str(info.value)
    _no_secret(info.value)


# -- felixctl


def _felixctl(*args: str, env: dict[str, str] | None = None) -> Result:
    result = CliRunner().invoke(cli, list(args), env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    yield path
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name)


def test_help_never_shows_the_url_or_password(tmp_path: Path) -> None:
    url_file = tmp_path / "url"
    url_file.write_text(f"redis://:{SECRET}@127.0.0.1:1/0\n")
    env = {"FELIX_REDIS_URL": f"redis://app:{SECRET}@127.0.0.1:1/0?sentinel_password={APP_SECRET}",
           "FELIX_REDIS_PASSWORD": SECRET, "FELIX_REDIS_URL_FILE": str(url_file)}
    paths = list(_commands(cli))
    assert len(paths) > 10
    for path in paths:
        result = _felixctl(*path, "--help", env=env)
        assert result.exit_code == 0, (path, result.output)
        _no_secret(result.output)
    result = _felixctl("--help", env=env)
    assert "--redis-url-file" in result.output and "FELIX_REDIS_URL_FILE" in result.output
    assert "FELIX_REDIS_PASSWORD" in result.output


def test_help_works_without_the_url_file() -> None:
    result = _felixctl("stream", "--help", env={"FELIX_REDIS_URL_FILE": "/nonexistent/felix-url"})
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("args, env", [
    ((f"--redis-url=redis://:{SECRET}@127.0.0.1:1/0",), {}),
    (("--redis-url", f"redis://127.0.0.1:1/0?password={SECRET}"), {}),
    (("--redis-url", f"redis+cluster://app:{SECRET}@127.0.0.1:1"), {}),
    ((), {"FELIX_REDIS_URL": f"redis://:{SECRET}@127.0.0.1:1/0"}),
    (("--redis-url", "redis://127.0.0.1:1/0"), {"FELIX_REDIS_PASSWORD": SECRET}),
])
def test_felixctl_error_lines_hide_the_password(args: tuple[str, ...], env: dict[str, str]) -> None:
    result = _felixctl(*args, "stream", "list", env=env)
    assert result.exit_code == 1
    assert result.output.startswith("felixctl: error: ") and "127.0.0.1:1" in result.output
    _no_secret(result.output)


@needs_server
def test_felixctl_url_file(locked: RedisServer, tmp_path: Path) -> None:
    good = tmp_path / "url"
    good.write_text(f"redis://:{SECRET}@127.0.0.1:{locked.port}/0\n")
    wrong = tmp_path / "wrong"
    wrong.write_text(f"redis://:{APP_SECRET}@127.0.0.1:{locked.port}/0")
    bare = tmp_path / "bare"
    bare.write_text(SECRET)
    empty = tmp_path / "empty"
    empty.write_text("\n")

    assert _felixctl("--redis-url-file", str(good), "stream", "list").exit_code == 0
    assert _felixctl("stream", "list", env={"FELIX_REDIS_URL_FILE": str(good)}).exit_code == 0
    # the command line beats the environment, and $FELIX_REDIS_URL beats $FELIX_REDIS_URL_FILE
    assert _felixctl("--redis-url-file", str(good), "stream", "list",
                     env={"FELIX_REDIS_URL": "redis://127.0.0.1:1/0"}).exit_code == 0
    assert _felixctl("--redis-url", "redis://127.0.0.1:1/0", "stream", "list",
                     env={"FELIX_REDIS_URL_FILE": str(good)}).exit_code == 1
    assert _felixctl("stream", "list", env={"FELIX_REDIS_URL": good.read_text().strip(),
                                            "FELIX_REDIS_URL_FILE": str(wrong)}).exit_code == 0
    # the worker command takes the main group's URL from the file too
    result = _felixctl("--redis-url-file", str(good), "worker", "jobs", "workers", "tests.support.worker_jobs:handle",
                       "--burst")
    assert result.exit_code == 1 and "jobs" in result.output  # no such stream: it did reach Redis
    _no_secret(result.output)

    result = _felixctl("--redis-url-file", str(wrong), "stream", "list")
    assert result.exit_code == 1 and f"127.0.0.1:{locked.port}" in result.output
    _no_secret(result.output)
    for path in (bare, empty, tmp_path / "missing"):
        result = _felixctl("--redis-url-file", str(path), "stream", "list")
        assert result.exit_code == 2, result.output
        assert str(path) in result.output
        _no_secret(result.output)
    result = _felixctl("--redis-url", "redis://h/0", "--redis-url-file", str(good), "stream", "list")
    assert result.exit_code == 2 and "not both" in result.output


@needs_server
def test_felixctl_password_from_the_environment(locked: RedisServer) -> None:
    url = f"redis://127.0.0.1:{locked.port}/0"
    assert _felixctl("--redis-url", url, "stream", "list").exit_code == 1
    result = _felixctl("--redis-url", url, "stream", "list", env={"FELIX_REDIS_PASSWORD": SECRET})
    assert result.exit_code == 0, result.output


@needs_server
def test_demo_output_hides_the_password(locked: RedisServer) -> None:
    url = f"redis://:{SECRET}@127.0.0.1:{locked.port}/0"
    result = _felixctl("--redis-url", url, "demo", "--orders", "2", "--keep")
    assert result.exit_code == 0, result.output
    assert f"127.0.0.1:{locked.port}" in result.output and "Kept it: felixctl --redis-url" in result.output
    _no_secret(result.output)


@needs_server
def test_worker_log_hides_the_password(locked: RedisServer, tmp_path: Path) -> None:
    """A felixctl worker (DEBUG logging) works, then loses its Redis and logs the
    failures; the password is in neither."""
    url = f"redis://:{SECRET}@127.0.0.1:{locked.port}/0"
    with felix_redis.connect(url) as client:
        client.stream_create(T, N, "secret-jobs")
        client.group_create(T, N, "secret-jobs", "workers")
        client.publish(T, N, "secret-jobs", b"{}")
    log = tmp_path / "worker.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORKER_JOBS_URL": url, "FELIX_REDIS_URL": url}
    args = [sys.executable, "-m", "felixctl", "--tenant", T, "--namespace", N, "worker", "secret-jobs", "workers",
            "tests.support.worker_jobs:handle", "--log-level", "DEBUG", "--poll-wait", "0.2"]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 20
        while "acked" not in log.read_text().lower() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "acked" in log.read_text().lower(), log.read_text()
        locked.stop(cleanup=False)
        deadline = time.monotonic() + 20
        while "poll failed" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "poll failed" in log.read_text(), log.read_text()
        assert f"127.0.0.1:{locked.port}" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        locked.start()
    _no_secret(log.read_text())
