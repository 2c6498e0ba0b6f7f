"""Turn a URL into a redis-py client (sync or asyncio).

Schemes: ``redis://``, ``rediss://`` and ``unix://`` (redis-py's ``from_url``, with its
query options such as ``ssl_ca_certs``), ``redis+sentinel://h1:p1,h2:p2/service/db``,
``redis+cluster://h1:p1,h2:p2`` and ``memory://[name]`` (fakeredis in this process,
running the same Lua scripts; one shared server per name).

Query options are checked up front: a name the scheme does not take (``?bogus=1``,
``?PASSWORD=``) is refused with :class:`InvalidArgument` naming it, never its value.
On every ``rediss`` scheme the server's host name is checked against its certificate
unless the URL says ``ssl_check_hostname=false`` or ``ssl_cert_reqs=none`` (set
explicitly, whatever redis-py's own default).

Credentials: the URL's own ``user:password@`` (or ``?password=``); when the URL has no
password, ``$FELIX_REDIS_PASSWORD``. The URL itself: the one given, else
``$FELIX_REDIS_URL``, else the contents of the file ``$FELIX_REDIS_URL_FILE``, else
redis://localhost:6379/0. See docs/security.md.
"""

from __future__ import annotations

import asyncio as _asyncio
import functools
import os
import socket
import ssl
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from redis.exceptions import ConnectionError as RedisConnectionError

from felix_redis.constants import (
    DEFAULT_URL,
    ENV_PASSWORD,
    ENV_URL,
    ENV_URL_FILE,
    SENTINEL_SOCKET_TIMEOUT_S,
    SOCKET_CONNECT_TIMEOUT_S,
    SOCKET_TIMEOUT_S,
)
from felix_redis.errors import ConnectionFailed, InvalidArgument, redact_url

__all__ = ["NotTlsError", "ParsedUrl", "SentinelsFailed", "async_client", "check_hostname", "env_password",
           "parse_url", "read_url_file", "resolve_url", "sync_client"]

SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel", "redis+cluster",
           "rediss+cluster", "memory")

#: TLS query options passed on to redis-py (all need a ``rediss`` scheme).
TLS_OPTIONS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
CERT_REQS = ("none", "optional", "required")
_TRUE = ("1", "true", "yes", "y", "t")
_FALSE = ("0", "false", "no", "n", "f")
#: Query options of ``redis://``, ``rediss://`` and ``unix://`` URLs, passed on to
#: redis-py's ``from_url`` (with those its URL parser converts, see :func:`_plain_options`).
PLAIN_OPTIONS = frozenset({
    "db", "username", "password", "client_name", "socket_timeout", "socket_connect_timeout",
    "socket_keepalive", "retry_on_timeout", "max_connections", "health_check_interval", "protocol",
    "ssl_password", "ssl_min_version", "ssl_ciphers", *TLS_OPTIONS,
})
#: Query options of the Cluster schemes (those :func:`_conn_kwargs` uses); Sentinel's
#: add :data:`SENTINEL_OPTIONS` (:func:`_sentinel_kwargs`).
CLUSTER_OPTIONS = frozenset({"username", "password", "socket_timeout", "socket_connect_timeout", *TLS_OPTIONS})
SENTINEL_OPTIONS = CLUSTER_OPTIONS | {"sentinel_username", "sentinel_password"}

_memory_servers: dict[str, Any] = {}
_memory_lock = threading.Lock()


def default_retry_for(url: str) -> float:
    """Seconds to retry safe operations: long enough to ride out a Sentinel or Cluster
    failover on those URLs, short elsewhere."""
    scheme = parse_url(url).scheme
    return 20.0 if ("sentinel" in scheme or "cluster" in scheme) else 2.0


def resolve_url(url: str | None) -> str:
    """``url``, else ``$FELIX_REDIS_URL``, else the URL in the file ``$FELIX_REDIS_URL_FILE``,
    else redis://localhost:6379/0."""
    if url:
        return url
    if os.environ.get(ENV_URL):
        return os.environ[ENV_URL]
    if os.environ.get(ENV_URL_FILE):
        return read_url_file(os.environ[ENV_URL_FILE], source=f"${ENV_URL_FILE}")
    return DEFAULT_URL


def read_url_file(path: str, *, source: str = "the URL file") -> str:
    """The Redis URL held in the file ``path`` (surrounding whitespace stripped).

    Errors name the file, never its contents (it may hold a password)."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read(65_536).strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise InvalidArgument(f"cannot read the Redis URL from {source} {path!r}: {reason}") from None
    if not text:
        raise InvalidArgument(f"{source} {path!r} is empty; it should hold one Redis URL")
    if len(text.split()) != 1 or "://" not in text:
        raise InvalidArgument(f"{source} {path!r} does not hold one Redis URL (scheme://...); "
                              "its contents are not shown")
    try:
        parse_url(text)
    except InvalidArgument:
        raise InvalidArgument(f"{source} {path!r} does not hold a valid Redis URL; its contents are not shown "
                              f"(schemes: {', '.join(SCHEMES)})") from None
    return text


def env_password() -> str | None:
    """``$FELIX_REDIS_PASSWORD``, used when the URL has no password (None if unset or empty)."""
    return os.environ.get(ENV_PASSWORD) or None


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
        split = urlsplit(url)
        if scheme != "unix":
            try:
                split.port  # noqa: B018 - raises ValueError for a bad port
            except ValueError:
                raise InvalidArgument(f"bad port in {redact_url(url)!r}") from None
            path = split.path.strip("/")
            if path and not path.isdigit():
                raise InvalidArgument(f"bad database number {path!r} in {redact_url(url)!r}")
        plain = ParsedUrl(scheme, options=dict(parse_qsl(split.query)))
        _check_option_names(plain, url, _plain_options())
        plain.password = unquote(split.password) if split.password else plain.options.get("password") or None
        _check_tls_options(plain, url)
        return plain
    rest = url.split("://", 1)[1]
    query = ""
    if "?" in rest:
        rest, query = rest.split("?", 1)
    userinfo = ""
    if "@" in rest:
        userinfo, rest = rest.rsplit("@", 1)
    netloc, _, path = rest.partition("/")
    parsed = ParsedUrl(scheme, options=dict(parse_qsl(query)))
    _check_option_names(parsed, url, SENTINEL_OPTIONS if "sentinel" in scheme else CLUSTER_OPTIONS)
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
    if parsed.password is None and parsed.options.get("password"):
        parsed.password = parsed.options["password"]
    if parsed.username is None and parsed.options.get("username"):
        parsed.username = parsed.options["username"]
    _check_tls_options(parsed, url)
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


def _plain_options() -> frozenset[str]:
    """:data:`PLAIN_OPTIONS` and those the installed redis-py's URL parser converts."""
    from redis import connection

    return PLAIN_OPTIONS | frozenset(getattr(connection, "URL_QUERY_ARGUMENT_PARSERS", ()))


def _check_option_names(parsed: ParsedUrl, url: str, known: frozenset[str]) -> None:
    """Refuses a query option the scheme does not take: redis-py would fail later with a
    bare TypeError, or keep it (value and all) in the client's repr. The message names
    the option, never its value."""
    unknown = sorted(name for name in parsed.options if name not in known)
    if not unknown:
        return
    name = unknown[0]
    hint = f"; option names are lower case: {name.lower()!r}" if name.lower() in known else ""
    where = redact_url(url.split("?", 1)[0])
    takes = "" if "db" in known else f": {', '.join(sorted(known))}"
    raise InvalidArgument(f"unknown query option {name!r} in the Redis URL {where}?...{hint} (the options "
                          f"{parsed.scheme}:// takes{takes}: see docs/security.md)")


def check_hostname(parsed: ParsedUrl) -> bool:
    """Whether a TLS connection checks the server's host name: yes unless the URL says
    ``ssl_check_hostname=false`` or ``ssl_cert_reqs=none``."""
    given = parsed.options.get("ssl_check_hostname")
    if given is not None:
        return given.lower() in _TRUE
    return parsed.options.get("ssl_cert_reqs") != "none"


def _check_tls_options(parsed: ParsedUrl, url: str) -> None:
    """Refuses TLS options redis-py would fail on later with a bare error."""
    given = [key for key in TLS_OPTIONS if key in parsed.options]
    if given and not parsed.tls:
        raise InvalidArgument(f"{', '.join(given)} need(s) a TLS URL (rediss://, rediss+sentinel://, "
                              f"rediss+cluster://), got {redact_url(url)!r}")
    reqs = parsed.options.get("ssl_cert_reqs")
    if reqs is not None and reqs not in CERT_REQS:
        raise InvalidArgument(f"ssl_cert_reqs must be one of {', '.join(CERT_REQS)}, got {reqs!r}")
    check = parsed.options.get("ssl_check_hostname")
    if check is not None and check.lower() not in _TRUE + _FALSE:
        raise InvalidArgument(f"ssl_check_hostname must be true or false, got {check!r}")
    if reqs == "none" and check is not None and check.lower() in _TRUE:
        raise InvalidArgument("ssl_check_hostname=true needs the certificate checked: not with ssl_cert_reqs=none")
    if "ssl_keyfile" in parsed.options and "ssl_certfile" not in parsed.options:
        raise InvalidArgument("ssl_keyfile needs ssl_certfile (the client certificate it belongs to)")


def _conn_kwargs(parsed: ParsedUrl) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"username": parsed.username, "password": parsed.password or env_password()}
    if parsed.tls:
        kwargs["ssl"] = True
        kwargs["ssl_check_hostname"] = check_hostname(parsed)
    for key, value in parsed.options.items():
        if key in TLS_OPTIONS and key != "ssl_check_hostname":
            kwargs[key] = value
        elif key in ("socket_timeout", "socket_connect_timeout"):
            kwargs[key] = float(value)
    return {k: v for k, v in kwargs.items() if v is not None}


def _defaults(kwargs: dict[str, Any], retry: Any) -> dict[str, Any]:
    """``kwargs`` with felix-redis' own connection defaults where they give none: socket
    timeouts (:data:`~felix_redis.constants.SOCKET_TIMEOUT_S`) and ``retry``, a redis-py
    Retry that sends nothing again. The client decides what may be sent again
    (:class:`felix_redis.protocol.Retrying`): redis-py's own retry would send a call that
    is not safe to repeat a second time after its reply was lost."""
    out = dict(kwargs)
    out.setdefault("socket_timeout", SOCKET_TIMEOUT_S)
    out.setdefault("socket_connect_timeout", SOCKET_CONNECT_TIMEOUT_S)
    if retry is not None:
        out.setdefault("retry", retry)
    return out


def _no_retry(asyncio: bool) -> Any:
    if asyncio:
        from redis.asyncio.retry import Retry as AsyncRetry
        from redis.backoff import NoBackoff

        return AsyncRetry(NoBackoff(), 0)
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return Retry(NoBackoff(), 0)


def _sentinel_kwargs(parsed: ParsedUrl, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Connection options for the sentinels themselves: the data servers' TLS options,
    ``sentinel_password`` / ``sentinel_username`` from the query (sentinels usually
    have no password, or one of their own, so the data password is not sent to them),
    short timeouts and one attempt (``kwargs``' retry, which sends nothing again): a
    sentinel that does not answer at once is skipped for the next. (redis-py's default
    would try each sentinel 4 times with backoff, some 8 s for two sentinels that refuse
    the connection, before the client's own retries, :class:`felix_redis.plans.Retrying`,
    even begin.)"""
    out = {k: v for k, v in kwargs.items() if k.startswith("ssl") or k == "retry"}
    if "sentinel_password" in parsed.options:
        out["password"] = parsed.options["sentinel_password"]
    if "sentinel_username" in parsed.options:
        out["username"] = parsed.options["sentinel_username"]
    out.setdefault("socket_timeout", SENTINEL_SOCKET_TIMEOUT_S)
    out.setdefault("socket_connect_timeout", SENTINEL_SOCKET_TIMEOUT_S)
    return out


def _plain_kwargs(parsed: ParsedUrl) -> dict[str, Any]:
    """``from_url`` options besides the URL's own: ``password=$FELIX_REDIS_PASSWORD``
    when the URL has none (``from_url`` lets the URL's own password win anyway), and on
    ``rediss://`` the host name check, explicitly (redis-py 5 did not check by default)."""
    out: dict[str, Any] = {}
    password = env_password()
    if password and parsed.password is None:
        out["password"] = password
    if parsed.tls:
        out["ssl_check_hostname"] = check_hostname(parsed)
    return out


# -- Sentinel: what each sentinel said


def _sentinel_error_classes() -> tuple[type, ...]:
    from redis.asyncio.sentinel import MasterNotFoundError as AsyncMasterNotFound
    from redis.sentinel import MasterNotFoundError

    return MasterNotFoundError, AsyncMasterNotFound


class SentinelsFailed(*_sentinel_error_classes()):  # type: ignore[misc]
    """No sentinel named a healthy primary for the service (redis-py's
    MasterNotFoundError, sync and asyncio), with what each sentinel did: ``failures``,
    the address and error of each that could not be asked, and ``answered``, the
    addresses of those that answered but knew no healthy primary (a failover under way,
    or another service name). Its message says so, naming the sentinels; redis-py's own
    keeps each sentinel's client repr and error repr in one long line."""

    def __init__(self, service: str, failures: list[tuple[str, BaseException]], answered: list[str],
                 never_answered: bool = False) -> None:
        self.service, self.failures, self.answered = service, failures, answered
        #: no sentinel has ever answered this client (its first try, or all tries since)
        self.never_answered = never_answered
        super().__init__(_sentinels_message(service, failures, answered))

    @property
    def all_refused(self) -> bool:
        """Every sentinel refused the connection: none is running at those addresses."""
        return not self.answered and bool(self.failures) and all(
            _sentinel_failure(exc)[0] == "refused" for _, exc in self.failures)

    @property
    def hopeless(self) -> bool:
        """Every sentinel refused the connection and none ever answered this client:
        nothing runs at those addresses (a wrong URL, or none started), so waiting cannot
        help. Sentinels that answered once may be restarting: those are waited for."""
        return self.never_answered and self.all_refused


def _sentinel_failure(exc: BaseException) -> tuple[str, str]:
    """The kind of a sentinel's failure and its gist."""
    from redis.exceptions import AuthenticationError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = text if len(text) <= 200 else text[:200] + "..."
    if isinstance(exc, AuthenticationError):
        return "credentials", text
    if isinstance(exc, (RedisTimeoutError, TimeoutError)):
        return "timeout", text
    if isinstance(exc.__context__, ConnectionRefusedError) or "connection refused" in text.lower():
        return "refused", text
    return "other", text


def _sentinels_message(service: str, failures: list[tuple[str, BaseException]], answered: list[str]) -> str:
    kinds: dict[str, list[str]] = {}
    for address, exc in failures:
        kind, text = _sentinel_failure(exc)
        kinds.setdefault(kind, []).append(address if kind in ("refused", "timeout") else f"{address} ({text})")
    head = f"No master found for {service!r}"
    if not answered and list(kinds) == ["refused"]:
        return (f"{head}: every sentinel refused the connection ({', '.join(kinds['refused'])}): "
                "is a sentinel running at each? (a sentinel's port is 26379 by default, not its Redis's)")
    parts = []
    if "refused" in kinds:
        parts.append(f"refused the connection: {', '.join(kinds['refused'])}")
    if "timeout" in kinds:
        parts.append(f"did not answer in time: {', '.join(kinds['timeout'])}")
    if "credentials" in kinds:
        parts.append(f"refused the credentials: {', '.join(kinds['credentials'])} (a sentinel with its own "
                     "requirepass needs sentinel_password=... in the URL's query; see docs/security.md)")
    if "other" in kinds:
        parts.append(f"failed: {', '.join(kinds['other'])}")
    if answered:
        parts.append(f"answered but know no healthy primary for {service!r}: {', '.join(answered)} "
                     "(a failover under way, or another service name: the URL's path is /SERVICE/DB)")
    return f"{head} by the sentinels: " + "; ".join(parts)


def _sentinel_address(sentinel: Any) -> str:
    kwargs = getattr(getattr(sentinel, "connection_pool", None), "connection_kwargs", {})
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


#: How long a primary announced as replaced is passed over when a sentinel still names
#: it (one that has not heard of the failover yet; sentinels hear of it from each other
#: within their 2 s hello period): long enough for a lagging sentinel to catch up.
REPLACED_S = 60.0


class _ReplacedPrimaries:
    """What the Sentinel watch heard: primaries a failover replaced. A sentinel that has
    not heard of that failover yet names the old primary, still running and taking
    writes until the sentinels turn it into a replica, and those writes are lost then.
    redis-py takes the first sentinel's answer; the managers pass over such an answer
    and ask the next sentinel, for :data:`REPLACED_S` after the announcement (or until
    an announcement names that primary again)."""

    _replaced: dict[tuple[str, tuple[str, int]], float]

    def note_switch(self, service: str, old: tuple[str, int], new: tuple[str, int]) -> None:
        """``+switch-master`` said ``service`` moved from ``old`` to ``new``."""
        book = self.__dict__.setdefault("_replaced", {})
        book.pop((service, new), None)
        book[(service, old)] = time.monotonic() + REPLACED_S

    def replaced(self, service: str, state: Any) -> bool:
        """Whether ``state`` (one sentinel's view of ``service``) names a primary
        announced as replaced less than :data:`REPLACED_S` ago."""
        book = self.__dict__.get("_replaced")
        if not book:
            return False
        key = (service, (str(state.get("ip")), int(state.get("port") or 0)))
        until = book.get(key)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        book.pop(key, None)
        return False


@functools.cache
def _sentinel_classes() -> tuple[type, type]:
    """redis-py's Sentinel managers, sync and asyncio, whose ``discover_master`` raises
    :class:`SentinelsFailed`. The loop is redis-py's (ask each sentinel in turn, the
    first that names a healthy primary goes first next time), keeping the errors, and
    passing over a sentinel that still names a primary announced as replaced
    (:class:`_ReplacedPrimaries`)."""
    from redis.asyncio.sentinel import Sentinel as AsyncSentinel
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.sentinel import Sentinel

    class FelixSentinel(_ReplacedPrimaries, Sentinel):
        def discover_master(self, service_name: str) -> tuple[str, Any]:
            failures: list[tuple[str, BaseException]] = []
            answered: list[str] = []
            for number, sentinel in enumerate(self.sentinels):
                try:
                    masters: Any = sentinel.sentinel_masters()
                except (RedisConnectionError, RedisTimeoutError) as exc:
                    failures.append((_sentinel_address(sentinel), exc))
                    continue
                self.answered_once = True
                state = masters.get(service_name)
                if state and self.check_master_state(state, service_name) and not self.replaced(  # type: ignore[no-untyped-call]
                        service_name, state):
                    self.sentinels[0], self.sentinels[number] = sentinel, self.sentinels[0]
                    ip = self._force_master_ip if self._force_master_ip is not None else state["ip"]
                    return ip, state["port"]
                answered.append(_sentinel_address(sentinel))
            raise SentinelsFailed(service_name, failures, answered, not getattr(self, "answered_once", False))

    class AsyncFelixSentinel(_ReplacedPrimaries, AsyncSentinel):
        async def discover_master(self, service_name: str) -> tuple[str, Any]:
            failures: list[tuple[str, BaseException]] = []
            answered: list[str] = []
            for number, sentinel in enumerate(self.sentinels):
                try:
                    masters: Any = await sentinel.sentinel_masters()
                except (RedisConnectionError, RedisTimeoutError) as exc:
                    failures.append((_sentinel_address(sentinel), exc))
                    continue
                self.answered_once = True
                state = masters.get(service_name)
                if state and self.check_master_state(state, service_name) and not self.replaced(service_name, state):
                    self.sentinels[0], self.sentinels[number] = sentinel, self.sentinels[0]
                    ip = self._force_master_ip if self._force_master_ip is not None else state["ip"]
                    return ip, state["port"]
                answered.append(_sentinel_address(sentinel))
            raise SentinelsFailed(service_name, failures, answered, not getattr(self, "answered_once", False))

    return FelixSentinel, AsyncFelixSentinel


# -- TLS: a handshake that a plain-text port never answers


class NotTlsError(RedisConnectionError):
    """A ``rediss://`` URL's port did not complete a TLS handshake, and a plain-text
    Redis answers there (or may: see :func:`_tls_failure`)."""


def _plain_redis_answers(host: str, port: int, timeout: float) -> bool | None:
    """Whether a plain-text Redis answers ``PING`` at ``host:port`` (``+PONG``, or an
    error such as ``-NOAUTH``: RESP either way); None when no connection could be made."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None
    try:
        sock.sendall(b"PING\r\n")
        reply = sock.recv(64)
    except OSError:
        return False
    finally:
        sock.close()
    return reply[:1] in (b"+", b"-")


async def _plain_redis_answers_async(host: str, port: int, timeout: float) -> bool | None:
    try:
        reader, writer = await _asyncio.wait_for(_asyncio.open_connection(host, port), timeout)
    except (OSError, _asyncio.TimeoutError):
        return None
    try:
        writer.write(b"PING\r\n")
        reply = await _asyncio.wait_for(reader.read(64), timeout)
    except (OSError, _asyncio.TimeoutError):
        return False
    finally:
        writer.close()
    return reply[:1] in (b"+", b"-")


def _tls_failure(host: str, port: int, exc: BaseException, timeout: float | None, plain: bool) -> NotTlsError:
    """The error for a TLS handshake with ``host:port`` that failed with ``exc`` (not on
    a certificate: that is a TLS server) though a TCP connection can be made there:
    ``plain``, a plain-text Redis answered PING on that port."""
    timed_out = isinstance(exc, (TimeoutError, socket.timeout, _asyncio.TimeoutError))
    why = (f"timed out after {timeout:g} s" if timed_out and timeout
           else f"failed ({str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__})")
    if plain:
        what = (f"{host}:{port} is not a TLS port, a plain-text Redis answers there: use redis:// for it, "
                "or the port the server takes TLS on (its tls-port)")
    else:
        what = (f"{host}:{port} may not be a TLS port (a plain-text Redis never answers a TLS handshake): "
                "use redis:// for a plain-text port, or the server's tls-port")
    return NotTlsError(f"the TLS handshake with {host}:{port} {why}; {what}")


@functools.cache
def _tls_connection_classes() -> tuple[type, type]:
    """redis-py's SSLConnection, sync and asyncio, that bound the TLS handshake by the
    connect timeout (redis-py's sync class waits up to the socket timeout, 10 s, for a
    handshake a plain-text port never answers) and, when it fails other than on the
    certificate, ask the port in plain text whether a Redis answers there, to say so."""
    from redis.asyncio.connection import SSLConnection as AsyncSSLConnection
    from redis.connection import SSLConnection

    class FelixSSLConnection(SSLConnection):
        def _wrap_socket_with_ssl(self, sock: socket.socket) -> Any:
            sock.settimeout(self.socket_connect_timeout)  # the handshake is part of connecting
            try:
                wrapped = super()._wrap_socket_with_ssl(sock)  # type: ignore[no-untyped-call]
            except ssl.SSLCertVerificationError:
                raise
            except OSError as exc:
                plain = _plain_redis_answers(self.host, self.port, min(1.0, self.socket_connect_timeout or 1.0))
                if plain is None:
                    raise
                raise _tls_failure(self.host, self.port, exc, self.socket_connect_timeout, plain) from exc
            wrapped.settimeout(self.socket_timeout)
            return wrapped

    class AsyncFelixSSLConnection(AsyncSSLConnection):
        async def _connect(self) -> None:
            try:
                await super()._connect()  # type: ignore[no-untyped-call]
            except ssl.SSLCertVerificationError:
                raise
            except (ssl.SSLError, TimeoutError, _asyncio.TimeoutError) as exc:
                # (the TCP connection and the handshake share one timeout here)
                wait = min(1.0, self.socket_connect_timeout or 1.0)
                plain = await _plain_redis_answers_async(self.host, self.port, wait)
                if plain is None:
                    raise
                raise _tls_failure(self.host, self.port, exc, self.socket_connect_timeout, plain) from exc

    return FelixSSLConnection, AsyncFelixSSLConnection


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
        sentinel_class = _sentinel_classes()[0]
        kwargs = _defaults(_conn_kwargs(parsed), _no_retry(False))
        sentinel = sentinel_class(parsed.hosts, sentinel_kwargs=_sentinel_kwargs(parsed, kwargs), **kwargs)
        return sentinel.master_for(parsed.service, db=parsed.db)
    if "cluster" in parsed.scheme:
        from redis.cluster import ClusterNode, RedisCluster
        from redis.exceptions import RedisClusterException

        nodes = [ClusterNode(h, p) for h, p in parsed.hosts]  # type: ignore[no-untyped-call]
        try:
            # (redis-py gives the nodes' connections no retries of their own on a Cluster)
            return RedisCluster(startup_nodes=nodes, **_defaults(_conn_kwargs(parsed), None))
        except (redis.RedisError, RedisClusterException, OSError) as exc:
            hosts = ",".join(f"{h}:{p}" for h, p in parsed.hosts)
            raise ConnectionFailed(
                f"cannot reach Redis Cluster at {hosts}: {str(exc).splitlines()[0][:300]}") from None
    kwargs = _defaults(_plain_kwargs(parsed), _no_retry(False))
    if parsed.scheme == "rediss":
        kwargs["connection_class"] = _tls_connection_classes()[0]
    return redis.Redis.from_url(url, **kwargs)


def async_client(url: str) -> Any:
    """A redis.asyncio client for ``url``."""
    import redis.asyncio as aioredis

    parsed = parse_url(url)
    if parsed.scheme == "memory":
        import fakeredis

        return fakeredis.FakeAsyncRedis(server=_memory_server(parsed.name))
    if "sentinel" in parsed.scheme:
        sentinel_class = _sentinel_classes()[1]
        kwargs = _defaults(_conn_kwargs(parsed), _no_retry(True))
        sentinel = sentinel_class(parsed.hosts, sentinel_kwargs=_sentinel_kwargs(parsed, kwargs), **kwargs)
        return sentinel.master_for(parsed.service, db=parsed.db)
    if "cluster" in parsed.scheme:
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        nodes = [ClusterNode(h, p) for h, p in parsed.hosts]
        return RedisCluster(startup_nodes=nodes, **_defaults(_conn_kwargs(parsed), None))
    client = aioredis.Redis.from_url(url, **_defaults(_plain_kwargs(parsed), _no_retry(True)))
    if parsed.scheme == "rediss":
        # (the asyncio pool's from_url lets the URL's scheme choose the class: set it after)
        client.connection_pool.connection_class = _tls_connection_classes()[1]
    return client


class _ConnectWatch:
    """One per pool, registered on each of its connections: calls the clients' callbacks
    back when a connection it saw connected connects again on a new socket (a first
    connect is no news, nor a connect callback on the same socket: some redis-py
    versions call them whenever a connection is taken from the pool)."""

    def __init__(self) -> None:
        self.callbacks: list[weakref.WeakMethod[Any]] = []
        #: the socket (sync) or stream writer (asyncio) each connection was last seen on
        self.seen: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    @staticmethod
    def _socket(conn: Any) -> Any:
        return getattr(conn, "_sock", None) or getattr(conn, "_writer", None)

    def _mark(self, conn: Any, sock: Any) -> None:
        try:
            self.seen[conn] = weakref.ref(sock)
        except TypeError:  # (a socket object that takes no weak reference: its id)
            self.seen[conn] = id(sock)

    def watch(self, conn: Any) -> None:
        if hasattr(conn, "register_connect_callback"):
            conn.register_connect_callback(self.connected)
            sock = self._socket(conn)
            if sock is not None:
                self._mark(conn, sock)  # connected already: a new socket is a reconnect

    def connected(self, conn: Any) -> None:
        sock = self._socket(conn)
        last = self.seen.get(conn)
        if sock is None or (last is not None and (last() if callable(last) else last) in (sock, id(sock))):
            return  # the same socket as before
        self._mark(conn, sock)
        if last is None:
            return  # its first connect
        alive = [ref for ref in self.callbacks if ref() is not None]
        self.callbacks = alive  # (the clients gone are dropped)
        for ref in alive:
            callback = ref()
            if callback is not None:
                callback(conn)


def watch_connects(raw: Any, callback: Any) -> None:
    """Has ``callback(connection)`` (a bound method: kept as a weak reference) called
    whenever a connection of ``raw``'s pool connects again after it was connected
    (redis-py reconnects a dropped connection without a word: a restart, a failover
    behind Sentinel, a server that closed an idle connection). One watch per pool, however
    many clients are made over it; the connections the pool has already are watched too.
    Not on Redis Cluster, whose node pools are made later (there a failover shows as
    errors and redirects, which read the slot map again), nor for clients without a pool."""
    pool = getattr(raw, "connection_pool", None)
    make = getattr(pool, "make_connection", None)
    if pool is None or make is None or hasattr(raw, "get_node_from_key"):
        return
    watch = getattr(pool, "_felix_watch", None)
    if watch is None:
        watch = _ConnectWatch()

        def make_connection(*args: Any, **kwargs: Any) -> Any:
            conn = make(*args, **kwargs)
            watch.watch(conn)
            return conn

        # (the pool holds the watch through this function: they live as long as each other)
        setattr(pool, "make_connection", make_connection)  # noqa: B010 (a plain attribute of redis-py's pool)
        setattr(pool, "_felix_watch", watch)  # noqa: B010
        existing = [*getattr(pool, "_available_connections", ()), *getattr(pool, "_in_use_connections", ())]
        single = getattr(raw, "connection", None)
        for conn in [*existing, *([single] if single is not None else [])]:
            watch.watch(conn)
    watch.callbacks.append(weakref.WeakMethod(callback))
