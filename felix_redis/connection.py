"""Turn a URL into a redis-py client (sync or asyncio).

Schemes: ``redis://``, ``rediss://`` and ``unix://`` (redis-py's ``from_url``, with its
query options such as ``ssl_ca_certs``), ``redis+sentinel://h1:p1,h2:p2/service/db``,
``redis+cluster://h1:p1,h2:p2`` and ``memory://[name]`` (fakeredis in this process,
running the same Lua scripts; one shared server per name).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from felix_redis.constants import DEFAULT_URL, ENV_URL
from felix_redis.errors import ConnectionFailed, InvalidArgument, redact_url

__all__ = ["ParsedUrl", "async_client", "parse_url", "resolve_url", "sync_client"]

SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel", "redis+cluster",
           "rediss+cluster", "memory")

_memory_servers: dict[str, Any] = {}
_memory_lock = threading.Lock()


def default_retry_for(url: str) -> float:
    """Seconds to retry safe operations: long enough to ride out a Sentinel or Cluster
    failover on those URLs, short elsewhere."""
    scheme = parse_url(url).scheme
    return 20.0 if ("sentinel" in scheme or "cluster" in scheme) else 2.0


def resolve_url(url: str | None) -> str:
    """``url``, else ``$FELIX_REDIS_URL``, else redis://localhost:6379/0."""
    return url or os.environ.get(ENV_URL) or DEFAULT_URL


@dataclass
class ParsedUrl:
    scheme: str
    hosts: list[tuple[str, int]] = field(default_factory=list)
    service: str = "mymaster"
    db: int = 0
    username: str | None = None
    password: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    name: str = ""  # memory:// server name

    @property
    def tls(self) -> bool:
        return self.scheme.startswith("rediss")


def parse_url(url: str) -> ParsedUrl:
    """Parses the multi-host forms (sentinel, cluster) and memory://; others pass through."""
    if not isinstance(url, str) or "://" not in url:
        if not isinstance(url, str):
            raise InvalidArgument(f"a Redis URL must be a string, got {type(url).__name__}")
        raise InvalidArgument(f"not a Redis URL: {redact_url(str(url))!r}")
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise InvalidArgument(
            f"unsupported URL scheme {scheme!r} in {redact_url(url)!r}; use one of {', '.join(SCHEMES)}"
        )
    if scheme == "memory":
        return ParsedUrl(scheme, name=url.split("://", 1)[1].strip("/") or "default")
    if "+" not in scheme:
        if scheme != "unix":
            split = urlsplit(url)
            try:
                split.port  # noqa: B018 - raises ValueError for a bad port
            except ValueError:
                raise InvalidArgument(f"bad port in {redact_url(url)!r}") from None
            path = split.path.strip("/")
            if path and not path.isdigit():
                raise InvalidArgument(f"bad database number {path!r} in {redact_url(url)!r}")
        return ParsedUrl(scheme)
    rest = url.split("://", 1)[1]
    query = ""
    if "?" in rest:
        rest, query = rest.split("?", 1)
    userinfo = ""
    if "@" in rest:
        userinfo, rest = rest.rsplit("@", 1)
    netloc, _, path = rest.partition("/")
    parsed = ParsedUrl(scheme, options=dict(parse_qsl(query)))
    if userinfo:
        user, _, password = userinfo.partition(":")
        parsed.username = unquote(user) or None
        parsed.password = unquote(password) or None
    for part in netloc.split(","):
        if not part:
            continue
        split = urlsplit("//" + part)
        if split.hostname is None:
            raise InvalidArgument(f"bad host {part!r} in {redact_url(url)!r}")
        default_port = 26379 if "sentinel" in scheme else 6379
        try:
            port = split.port or default_port
        except ValueError:
            raise InvalidArgument(f"bad port in {part!r} of {redact_url(url)!r}") from None
        parsed.hosts.append((split.hostname, port))
    if not parsed.hosts:
        raise InvalidArgument(f"no host in {redact_url(url)!r}")
    segments = [s for s in path.split("/") if s]
    if "sentinel" in scheme:
        if segments:
            parsed.service = segments[0]
        if len(segments) > 1:
            parsed.db = _db(segments[1], url)
    elif segments:
        parsed.db = _db(segments[0], url)
    return parsed


def _db(text: str, url: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidArgument(f"bad database number {text!r} in {redact_url(url)!r}") from None


def _conn_kwargs(parsed: ParsedUrl) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"username": parsed.username, "password": parsed.password}
    if parsed.tls:
        kwargs["ssl"] = True
    for key, value in parsed.options.items():
        if key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_ca_path",
                   "ssl_check_hostname"):
            kwargs[key] = value if key != "ssl_check_hostname" else value.lower() in ("1", "true", "yes")
        elif key in ("socket_timeout", "socket_connect_timeout"):
            kwargs[key] = float(value)
    return {k: v for k, v in kwargs.items() if v is not None}


def _sentinel_kwargs(parsed: ParsedUrl, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Connection options for the sentinels themselves: the data servers' TLS options,
    and ``sentinel_password`` / ``sentinel_username`` from the query (sentinels usually
    have no password, or one of their own, so the data password is not sent to them)."""
    out = {k: v for k, v in kwargs.items() if k.startswith("ssl")}
    if "sentinel_password" in parsed.options:
        out["password"] = parsed.options["sentinel_password"]
    if "sentinel_username" in parsed.options:
        out["username"] = parsed.options["sentinel_username"]
    return out or None


def _memory_server(name: str) -> Any:
    import fakeredis

    with _memory_lock:
        server = _memory_servers.get(name)
        if server is None:
            server = _memory_servers[name] = fakeredis.FakeServer()
        return server


def sync_client(url: str) -> Any:
    """A redis-py client for ``url`` (decode_responses off: payloads are bytes)."""
    import redis

    parsed = parse_url(url)
    if parsed.scheme == "memory":
        import fakeredis

        return fakeredis.FakeRedis(server=_memory_server(parsed.name))
    if "sentinel" in parsed.scheme:
        from redis.sentinel import Sentinel

        kwargs = _conn_kwargs(parsed)
        sentinel = Sentinel(parsed.hosts, sentinel_kwargs=_sentinel_kwargs(parsed, kwargs), **kwargs)  # type: ignore[no-untyped-call]
        return sentinel.master_for(parsed.service, db=parsed.db)  # type: ignore[no-untyped-call]
    if "cluster" in parsed.scheme:
        from redis.cluster import ClusterNode, RedisCluster
        from redis.exceptions import RedisClusterException

        nodes = [ClusterNode(h, p) for h, p in parsed.hosts]  # type: ignore[no-untyped-call]
        try:
            return RedisCluster(startup_nodes=nodes, **_conn_kwargs(parsed))
        except (redis.RedisError, RedisClusterException, OSError) as exc:
            hosts = ",".join(f"{h}:{p}" for h, p in parsed.hosts)
            raise ConnectionFailed(
                f"cannot reach Redis Cluster at {hosts}: {str(exc).splitlines()[0][:300]}") from None
    return redis.Redis.from_url(url)


def async_client(url: str) -> Any:
    """A redis.asyncio client for ``url``."""
    import redis.asyncio as aioredis

    parsed = parse_url(url)
    if parsed.scheme == "memory":
        import fakeredis

        return fakeredis.FakeAsyncRedis(server=_memory_server(parsed.name))
    if "sentinel" in parsed.scheme:
        from redis.asyncio.sentinel import Sentinel

        kwargs = _conn_kwargs(parsed)
        sentinel = Sentinel(parsed.hosts, sentinel_kwargs=_sentinel_kwargs(parsed, kwargs), **kwargs)  # type: ignore[no-untyped-call]
        return sentinel.master_for(parsed.service, db=parsed.db)
    if "cluster" in parsed.scheme:
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        nodes = [ClusterNode(h, p) for h, p in parsed.hosts]
        return RedisCluster(startup_nodes=nodes, **_conn_kwargs(parsed))
    return aioredis.Redis.from_url(url)
