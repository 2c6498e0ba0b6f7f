"""Errors met while connecting name the fix (issue 25, "Errors that name the fix").

- no password against a ``requirepass`` server: says a password is needed and where
  it is given (the URL, ``$FELIX_REDIS_PASSWORD``, a URL file);
- ``redis+sentinel://`` with no sentinel answering: says every sentinel refused the
  connection and which, without redis-py's hidden retries of each sentinel (some 8 s
  for two sentinels, before the client's own retries even began);
- ``rediss://`` against a plain-text port: says it is not a TLS port, within the
  connect timeout (the handshake waited the 10 s socket timeout, twice);
- a database the server does not have: names the URL (password masked).

Sync, asyncio and a ``felixctl`` subprocess each; every wait bounded. No message
holds a password.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

import felix_redis
import felix_redis.asyncio as felix_asyncio
from felix_redis.connection import SentinelsFailed
from felix_redis.testing.server import RedisServer, free_port, redis_server_binary

SECRET = "s3cret-Pw-25"
OTHER = "wr0ng-Pw-25"

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="needs a redis-server binary")


@pytest.fixture(scope="module")
def locked() -> Iterator[RedisServer]:
    """A plain-text redis-server with ``requirepass``."""
    server = RedisServer(extra=["--requirepass", SECRET])
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FELIX_REDIS_PASSWORD", "FELIX_REDIS_URL", "FELIX_REDIS_URL_FILE"):
        monkeypatch.delenv(name, raising=False)


def _no_secret(*texts: object) -> None:
    for text in texts:
        for secret in (SECRET, OTHER):
            assert secret not in str(text), text


def _sync_error(url: str, **kwargs: Any) -> tuple[BaseException, float]:
    started = time.monotonic()
    client = felix_redis.connect(url, **kwargs)
    try:
        with pytest.raises(felix_redis.FelixError) as info:
            client.stream_list()
    finally:
        client.close()
    return info.value, time.monotonic() - started


def _async_error(url: str, **kwargs: Any) -> tuple[BaseException, float]:
    async def main() -> BaseException:
        client = felix_asyncio.connect(url, **kwargs)
        try:
            with pytest.raises(felix_redis.FelixError) as info:
                await client.stream_list()
        finally:
            await client.close()
        return info.value

    started = time.monotonic()
    error = asyncio.run(main())
    return error, time.monotonic() - started


def _felixctl(url: str, *args: str, timeout: float = 60) -> tuple[str, float]:
    """``felixctl --redis-url URL stream list``'s one error line (exit status 1)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FELIX_")}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "felixctl", "--redis-url", url, *(args or ("stream", "list"))],
                            capture_output=True, timeout=timeout, env=env)
    elapsed = time.monotonic() - started
    stderr = result.stderr.decode()
    assert result.returncode == 1 and result.stdout == b"", (result.returncode, result.stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("felixctl: error: "), stderr
    _no_secret(stderr)
    return lines[0], elapsed


# -- no password against a requirepass server


def _names_where_a_password_goes(message: str) -> None:
    assert "needs a password" in message, message
    assert "in the URL" in message and "$FELIX_REDIS_PASSWORD" in message, message
    assert "$FELIX_REDIS_URL_FILE" in message and "--redis-url-file" in message, message
    assert "HELLO must be called" not in message.split("needs a password", 1)[0], message


@pytest.mark.parametrize("errors", [_sync_error, _async_error], ids=["sync", "asyncio"])
def test_no_password_says_one_is_needed_and_where(locked: RedisServer, errors: Any) -> None:
    error, elapsed = errors(locked.url)
    assert isinstance(error, felix_redis.PermissionDenied), error
    assert f"127.0.0.1:{locked.port}" in str(error)
    _names_where_a_password_goes(str(error))
    assert elapsed < 3, elapsed  # no retry fixes credentials


def test_no_password_through_felixctl(locked: RedisServer) -> None:
    line, elapsed = _felixctl(locked.url)
    _names_where_a_password_goes(line)
    assert elapsed < 15, elapsed


@pytest.mark.parametrize("errors", [_sync_error, _async_error], ids=["sync", "asyncio"])
def test_a_wrong_password_says_so_without_showing_it(locked: RedisServer, errors: Any) -> None:
    error, _ = errors(f"redis://:{OTHER}@127.0.0.1:{locked.port}/0")
    assert isinstance(error, felix_redis.PermissionDenied), error
    assert "refused the credentials" in str(error) and "check the user name and password" in str(error), error
    assert "needs a password" not in str(error)
    _no_secret(error, repr(error.args))


# -- a database the server does not have


@pytest.mark.parametrize("errors", [_sync_error, _async_error], ids=["sync", "asyncio"])
def test_a_database_out_of_range_names_the_url(locked: RedisServer, errors: Any) -> None:
    error, elapsed = errors(f"redis://:{SECRET}@127.0.0.1:{locked.port}/99")
    assert isinstance(error, felix_redis.InvalidArgument), error
    message = str(error)
    assert f"redis://:***@127.0.0.1:{locked.port}/99" in message, message
    assert "DB index is out of range" in message and "databases" in message, message
    _no_secret(error, repr(error.args))
    assert elapsed < 3, elapsed


def test_a_database_out_of_range_through_felixctl(locked: RedisServer) -> None:
    line, _ = _felixctl(f"redis://:{SECRET}@127.0.0.1:{locked.port}/99")
    assert f"redis://:***@127.0.0.1:{locked.port}/99" in line and "DB index is out of range" in line, line


# -- rediss:// against a plain-text port


def _says_not_tls(message: str, port: int) -> None:
    assert f"127.0.0.1:{port} is not a TLS port" in message, message
    assert "redis://" in message and "tls-port" in message, message


@pytest.mark.parametrize("errors", [_sync_error, _async_error], ids=["sync", "asyncio"])
def test_tls_against_a_plain_text_port_says_so_soon(locked: RedisServer, errors: Any) -> None:
    # the default retry_for (2 s): each attempt now waits the 2 s connect timeout, not
    # the 10 s socket timeout, and the message says what the port is
    error, elapsed = errors(f"rediss://:{SECRET}@127.0.0.1:{locked.port}/0?ssl_cert_reqs=none")
    assert isinstance(error, felix_redis.ConnectionFailed), error
    _says_not_tls(str(error), locked.port)
    _no_secret(error, repr(error.args))
    assert elapsed < 9, elapsed


def test_tls_against_a_plain_text_port_through_felixctl(locked: RedisServer) -> None:
    line, elapsed = _felixctl(f"rediss://127.0.0.1:{locked.port}/0")
    _says_not_tls(line, locked.port)
    assert elapsed < 12, elapsed


def test_tls_against_a_silent_port_may_not_be_tls() -> None:
    """A port that takes the connection but answers nothing (neither TLS nor Redis):
    'may not be a TLS port', after the connect timeout."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        error, elapsed = _sync_error(f"rediss://127.0.0.1:{port}/0?socket_connect_timeout=0.5", retry_for=0)
    assert isinstance(error, felix_redis.ConnectionFailed), error
    assert f"127.0.0.1:{port} may not be a TLS port" in str(error), error
    assert elapsed < 5, elapsed


# -- redis+sentinel:// with no sentinel answering


def _sentinel_url() -> tuple[str, list[str]]:
    hosts = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    return f"redis+sentinel://:{SECRET}@{','.join(hosts)}/mymaster/0", hosts


def _says_every_sentinel_refused(message: str, hosts: list[str]) -> None:
    assert "every sentinel refused the connection" in message, message
    assert all(host in message for host in hosts), message
    assert "mymaster" in message, message


@pytest.mark.parametrize("errors", [_sync_error, _async_error], ids=["sync", "asyncio"])
def test_no_sentinel_answering_says_which_refused(errors: Any) -> None:
    url, hosts = _sentinel_url()
    # retry_for=1: each attempt is now one connection per sentinel (redis-py tried each
    # sentinel 4 times with backoff, some 8 s, before the client's budget was looked at)
    error, elapsed = errors(url, retry_for=1)
    assert isinstance(error, felix_redis.ConnectionFailed) and error.unsent, error
    _says_every_sentinel_refused(str(error), hosts)
    _no_secret(error, repr(error.args))
    assert elapsed < 5, elapsed


def test_no_sentinel_answering_through_felixctl() -> None:
    """felixctl's budget on a Sentinel URL is 20 s, to ride out a failover; but when no
    sentinel has ever answered, nothing runs at those addresses and waiting cannot help:
    the error comes at once (it took 26 s or more, each try of the client being 4 tries
    of each sentinel)."""
    url, hosts = _sentinel_url()
    line, elapsed = _felixctl(url, timeout=90)
    _says_every_sentinel_refused(line, hosts)
    assert elapsed < 8, elapsed


@pytest.mark.parametrize("errors", [_sync_error, _async_error], ids=["sync", "asyncio"])
def test_no_sentinel_ever_answering_is_not_waited_for(errors: Any) -> None:
    url, hosts = _sentinel_url()
    error, elapsed = errors(url, retry_for=20)
    assert isinstance(error, felix_redis.ConnectionFailed) and error.final, error
    _says_every_sentinel_refused(str(error), hosts)
    assert elapsed < 5, elapsed


def test_sentinels_that_answered_once_are_waited_for() -> None:
    """A sentinel that answered this client before may be restarting (or the whole
    Sentinel set, during a failover): its refusal is retried for the client's budget."""
    from felix_redis._driver import translate
    from felix_redis.plans import Cmd, Retrying

    refused = RedisConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
    op = Cmd("PING")
    seen = translate(SentinelsFailed("orders", [("127.0.0.1:1", refused)], [], never_answered=False), op, "s")
    assert isinstance(seen, felix_redis.ConnectionFailed) and seen.unsent and not seen.final
    assert Retrying(op, 5.0).pause(seen) > 0
    never = translate(SentinelsFailed("orders", [("127.0.0.1:1", refused)], [], never_answered=True), op, "s")
    assert isinstance(never, felix_redis.ConnectionFailed) and never.final
    with pytest.raises(felix_redis.ConnectionFailed):
        Retrying(op, 5.0).pause(never)
    # one that answered but knew no primary (a failover under way): waited for, even the first time
    answered = SentinelsFailed("orders", [], ["127.0.0.1:2"], never_answered=False)
    assert not translate(answered, op, "s").final


def test_the_sentinels_message_tells_each_apart() -> None:
    """Sentinels that answered but know no healthy primary (a failover under way, or
    another service name) are named apart from those that could not be asked."""
    refused = RedisConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
    error = SentinelsFailed("orders", [("127.0.0.1:1", refused)], ["127.0.0.1:2"])
    assert not error.all_refused
    message = str(error)
    assert message.startswith("No master found for 'orders' by the sentinels: "), message
    assert "refused the connection: 127.0.0.1:1" in message, message
    assert "answered but know no healthy primary for 'orders': 127.0.0.1:2" in message, message
    assert SentinelsFailed("orders", [("127.0.0.1:1", refused)], []).all_refused
