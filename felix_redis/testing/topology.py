"""Local Redis topologies for tests and demos: Sentinel and Cluster on loopback.

``SentinelTopology`` starts a primary, its replicas and a set of sentinels with fast
failover settings; ``ClusterTopology`` forms a Redis Cluster of primaries with
replicas. Both use Debian's ``redis-server`` through :class:`RedisServer`, bind to
127.0.0.1 only, bound every wait with a timeout and stop every process they started
on :meth:`stop` (also when :meth:`start` fails half-way).

Either can be secured: ``password=`` sets ``requirepass`` and ``masterauth`` on every
data server (sentinels reach them with ``sentinel auth-pass``), ``tls=`` makes every
process (sentinels too) listen with TLS only and talk TLS to each other
(``tls-replication``, ``tls-cluster``). The topology's :attr:`url` then carries the
password and the certificate options. Passwords go into each process's config file,
never onto its command line.

Ports: free ones by default; ``ports=`` / ``sentinel_ports=`` name every one; or
``base_port=`` puts data servers (cluster nodes) at ``base``, ``base + 1``, ... and
sentinels at ``base + 20000``, ``base + 20001``, ...

The settings shared with ``compose.yaml`` (ports inside the compose network, service
name, quorum, failover timings) live in :data:`SETTINGS`; ``tests/test_compose.py``
checks the compose file against them.

Run from a shell (not on 6379: a packaged redis-server usually holds it)::

    python -m felix_redis.testing.topology sentinel --base-port 6400
    python -m felix_redis.testing.topology sentinel --ports 6400,6401 --sentinel-ports 26400,26401,26402
    python -m felix_redis.testing.topology cluster --base-port 7000
    FELIX_PW=s3cret python -m felix_redis.testing.topology sentinel --tls --password-from-env FELIX_PW

It prints the ``FELIX_REDIS_URL=...`` line to use and runs until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import redis
from redis.sentinel import Sentinel

from felix_redis.testing.certs import Certs, make_topology_certs
from felix_redis.testing.server import RedisServer, free_port

__all__ = [
    "SENTINEL_PING_PERIOD_MS",
    "SETTINGS",
    "ClusterTopology",
    "SentinelServer",
    "SentinelTopology",
    "TopologySettings",
    "TopologyTls",
    "main",
    "sentinel_config_lines",
]

CLUSTER_SLOTS = 16384
CLUSTER_BUS_PORT_OFFSET = 10000  # Redis' fixed default: bus port = port + 10000


@dataclass(frozen=True)
class TopologySettings:
    """Settings shared by the launcher, ``compose.yaml`` and ``docs/operations.md``."""

    service_name: str = "mymaster"
    """Name the sentinels monitor the primary under (the URL's path segment)."""
    db: int = 0
    quorum: int = 2
    """Sentinels that must agree the primary is down before a failover starts."""
    sentinels: int = 3
    replicas: int = 1
    down_after_ms: int = 2000
    """A primary silent this long is considered down by a sentinel. 2000, not 1000:
    see :data:`SETTINGS`."""
    failover_timeout_ms: int = 5000
    parallel_syncs: int = 1
    redis_port: int = 6379
    """Data port inside the compose network (each container has its own). The launcher
    never uses it: on a host a packaged redis-server usually holds 6379, so the launcher
    takes free ports unless given ``--ports`` or ``--base-port``."""
    sentinel_port: int = 26379
    """Sentinel port inside the compose network."""
    cluster_base_port: int = 7000
    cluster_node_timeout_ms: int = 1000
    cluster_primaries: int = 3
    cluster_replicas_per_primary: int = 1

    @property
    def sentinel_port_offset(self) -> int:
        """Distance from ``--base-port`` to the first sentinel port (20000, as from
        6379 to 26379 in compose)."""
        return self.sentinel_port - self.redis_port


SETTINGS = TopologySettings()
"""The launcher's defaults, also ``compose.yaml``'s (``tests/test_compose.py`` checks).

``down-after-milliseconds`` is 2000, not 1000: at 1000 a failover is sometimes followed
by a second one. On ``+switch-master`` a sentinel resets the primary's state and starts
the ``down-after`` clock, but it keeps the link's last reconnect time, and it reconnects
(and sends its first PING to the new primary) at most once per
:data:`SENTINEL_PING_PERIOD_MS`. If its last attempt on the dead primary came just
before the switch, that first PING leaves a full second later, in the very tick the
clock runs out: ``+sdown`` of the new primary about 1.0 s after ``+switch-master`` (its
PONG follows tens of ms later). The other sentinels' "down" answers about the old
primary still count for 5 s, so the same tick reaches ``+odown``; the reset also cleared
the failover delay, so a new failover starts (``+new-epoch 2``), and it promotes another
replica. That one has no replica left (the first promoted server stays a primary until
the sentinels convert it, 10 s or more later), so quorum writes fail with NotReplicated
and leader writes taken by the first one are lost. About one failover in ten hit it on
an idle 2-core machine (2 of 20 kills at 1000 ms, 0 of 20 at 2000 ms).

2000 ms leaves a second of margin over the ping period; Redis' own sentinel tests use
2000, and redis/redis#8607 (a sentinel changing the primary again and again at 500 ms)
was cured by 2000. The price: a dead primary is detected 1 s later than at 1000 ms."""

#: Sentinel's own ping period: it PINGs every instance, and tries to reconnect a lost
#: link, at most this often (``SENTINEL_PING_PERIOD`` in sentinel.c; only
#: ``SENTINEL DEBUG ping-period`` changes it).
SENTINEL_PING_PERIOD_MS = 1000

T = TypeVar("T")


@dataclass(frozen=True)
class TopologyTls:
    """The TLS files of a topology.

    Every ``redis-server`` and sentinel presents ``cert``/``key`` (to clients, and as its
    client certificate to the others: replication, sentinel links, the cluster bus) and
    trusts ``ca``. With ``auth_clients="yes"`` (redis-server's default) a client needs a
    certificate signed by ``ca`` too: :attr:`url` options carry ``client_cert`` and
    ``client_key``.
    """

    ca: str
    cert: str
    key: str
    client_cert: str | None = None
    client_key: str | None = None
    auth_clients: str = "yes"

    @classmethod
    def from_certs(cls, certs: Certs, *, auth_clients: str = "yes") -> TopologyTls:
        """The files :func:`felix_redis.testing.certs.make_topology_certs` makes."""
        return cls(certs.crt("ca"), certs.crt("node"), certs.key("node"), certs.crt("client"),
                   certs.key("client"), auth_clients)

    def server_directives(self) -> list[str]:
        """Config lines for a server or sentinel listening with TLS only on ``port``."""
        return [
            f'tls-cert-file "{self.cert}"',
            f'tls-key-file "{self.key}"',
            f'tls-ca-cert-file "{self.ca}"',
            f"tls-auth-clients {self.auth_clients}",
            "tls-replication yes",  # replicas and sentinels connect with TLS
        ]

    def url_options(self) -> dict[str, str]:
        """The felix URL query options (docs/security.md)."""
        options = {"ssl_ca_certs": self.ca}
        if self.client_cert:
            options["ssl_certfile"] = self.client_cert
            if self.client_key:
                options["ssl_keyfile"] = self.client_key
        return options

    def client_kwargs(self) -> dict[str, Any]:
        """redis-py connection options (``ssl=True`` and the files)."""
        out: dict[str, Any] = {"ssl": True, "ssl_ca_certs": self.ca}
        if self.client_cert:
            out["ssl_certfile"] = self.client_cert
            if self.client_key:
                out["ssl_keyfile"] = self.client_key
        return out

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca)
        context.check_hostname = False  # the probes connect to 127.0.0.1; chains are checked
        if self.client_cert:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context


def _wait_until(
    what: str, check: Callable[[], T | None], timeout: float, interval: float = 0.05
) -> T:
    """Call ``check`` until it returns something other than None/False, or time out."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            result = check()
        except (redis.RedisError, OSError) as exc:
            last_error = exc
            result = None
        if result is not None and result is not False:
            return result
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}{detail}")
        time.sleep(interval)


def _port_is_free(port: int) -> bool:
    """True if a listener could bind 127.0.0.1:port now.

    SO_REUSEADDR, as redis-server sets it: a port whose last server just stopped keeps
    sockets in TIME_WAIT for a minute, which would fail a plain bind, but not Redis'.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int, taken: set[int]) -> list[int]:
    """``count`` distinct free ports, none of them in ``taken`` (which they join)."""
    ports: list[int] = []
    for _ in range(count * 50):
        if len(ports) == count:
            break
        port = free_port()
        if port not in taken:
            taken.add(port)
            ports.append(port)
    if len(ports) != count:
        raise RuntimeError(f"found only {len(ports)} of {count} free ports")
    return ports


def _free_cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(500):
        port = random.randint(20000, 55000 - 1)
        if port in taken or port + CLUSTER_BUS_PORT_OFFSET in taken:
            continue
        if _port_is_free(port) and _port_is_free(port + CLUSTER_BUS_PORT_OFFSET):
            return port
    raise RuntimeError("found no free port pair for a cluster node")


def _check_ports(ports: Sequence[int]) -> None:
    """Every port in range and free, or ValueError / OSError naming the first that is not."""
    for port in ports:
        if not 0 < port < 65536:
            raise ValueError(f"port {port} is out of range (1-65535); choose lower ports")
        if not _port_is_free(port):
            raise OSError(f"port 127.0.0.1:{port} is in use")


def _port_list(ports: Sequence[int], what: str) -> list[int]:
    out = [int(p) for p in ports]
    if len(set(out)) != len(out):
        raise ValueError(f"{what} name a port twice: {out}")
    for port in out:
        if not 0 < port < 65536:
            raise ValueError(f"port {port} is out of range (1-65535)")
    return out


def _client(port: int, timeout: float = 1.0, **options: Any) -> redis.Redis:
    """A redis-py client of 127.0.0.1:port; ``options``: password, ssl, ssl_ca_certs, ..."""
    return redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=timeout, socket_connect_timeout=timeout,
        **options,
    )


def _raw(port: int, *args: str, timeout: float = 1.0, **options: Any) -> str:
    """Send one command to 127.0.0.1:port and return its bulk reply as text, unparsed.

    ``options``: redis-py connection options (password, ssl=True, ssl_ca_certs, ...)."""
    options = dict(options)
    use_tls = options.pop("ssl", False)
    cls = redis.SSLConnection if use_tls else redis.Connection
    connection: redis.Connection = cls(
        host="127.0.0.1", port=port, socket_timeout=timeout, socket_connect_timeout=timeout,
        **options,
    )
    try:
        connection.send_command(*args)  # type: ignore[no-untyped-call]
        reply = connection.read_response()
    finally:
        connection.disconnect()  # type: ignore[no-untyped-call]
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _fields(text: str) -> dict[str, str]:
    """``key:value`` lines (INFO, CLUSTER INFO) as a dict of strings."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if ":" in line and not line.startswith("#"):
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def _info(port: int, section: str, **options: Any) -> dict[str, str]:
    """``INFO section`` as raw ``key -> value`` strings (nested values left unparsed)."""
    return _fields(_raw(port, "INFO", section, **options))


def _cluster_info(port: int, **options: Any) -> dict[str, str]:
    return _fields(_raw(port, "CLUSTER", "INFO", **options))


def _alive(server: RedisServer) -> bool:
    return server.process is not None and server.process.poll() is None


def _caught_up(primary_port: int, replica_ports: Sequence[int], **options: Any) -> bool:
    """True if every replica port is online at the primary with the primary's offset."""
    info = _info(primary_port, "replication", **options)
    offset = int(info.get("master_repl_offset", "-1"))
    seen: dict[int, int] = {}
    for key, value in info.items():
        if key.startswith("slave") and key[5:].isdigit():
            fields = dict(part.split("=", 1) for part in value.split(","))
            if fields.get("state") == "online":
                seen[int(fields["port"])] = int(fields["offset"])
    return all(seen.get(port) == offset for port in replica_ports)


def _tls_ping(port: int, tls: TopologyTls) -> bool:
    """True if 127.0.0.1:port completes a TLS handshake and answers PING (or NOAUTH)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as raw_sock, \
                tls.context().wrap_socket(raw_sock) as sock:
            sock.sendall(b"PING\r\n")
            data = sock.recv(64)
    except (OSError, ssl.SSLError):
        return False
    return data.startswith(b"+PONG") or data.startswith(b"-NOAUTH")


class _Server(RedisServer):
    """A :class:`RedisServer` that reads ``secrets`` (config lines holding passwords) from
    a private file rather than its command line, and whose readiness check speaks TLS
    when it listens with TLS only."""

    def __init__(
        self, *, tls: TopologyTls | None = None, secrets: Sequence[str] = (), **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.tls = tls
        self.secrets = list(secrets)

    @property
    def secrets_file(self) -> Path:
        return Path(self.dir) / "secrets.conf"

    def _secret_lines(self) -> list[str]:
        lines = list(self.secrets)
        if self.tls is not None:
            # port 0: no plain listener at all; the TLS port is this server's port
            lines += ["port 0", f"tls-port {self.port}", *self.tls.server_directives()]
        return lines

    def command(self) -> list[str]:
        args = super().command()
        lines = self._secret_lines()
        if not lines:
            return args
        fd = os.open(self.secrets_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write("\n".join(lines) + "\n")
        # redis-server reads the file first; the "include" comes last so that its
        # "port 0" wins over the "--port" RedisServer puts on the command line
        return [*args, "--include", str(self.secrets_file)]

    def _ping(self) -> bool:
        if self.tls is None:
            return super()._ping()
        return _tls_ping(self.port, self.tls)


def sentinel_config_lines(
    settings: TopologySettings,
    primary_host: str,
    primary_port: int,
    *,
    quorum: int | None = None,
    announce_hostnames: bool = False,
) -> list[str]:
    """The ``sentinel ...`` directives every sentinel of a topology gets.

    ``compose.yaml``'s ``docker/sentinel.conf`` holds the same lines with
    ``announce_hostnames=True`` and the primary at ``redis-primary:6379``.
    """
    name = settings.service_name
    lines = []
    if announce_hostnames:
        # Must come before "monitor" so the primary's hostname can be resolved.
        lines += ["sentinel resolve-hostnames yes", "sentinel announce-hostnames yes"]
    lines += [
        f"sentinel monitor {name} {primary_host} {primary_port} {quorum or settings.quorum}",
        f"sentinel down-after-milliseconds {name} {settings.down_after_ms}",
        f"sentinel failover-timeout {name} {settings.failover_timeout_ms}",
        f"sentinel parallel-syncs {name} {settings.parallel_syncs}",
    ]
    return lines


class SentinelServer(_Server):
    """A ``redis-server --sentinel`` with its own writable config file.

    Sentinel rewrites its config file (known replicas, sentinels, epochs), so each one
    gets a file of its own in its private directory (mode 0600: it may hold
    ``sentinel auth-pass`` and ``requirepass``).
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        directives: Sequence[str] = (),
        tls: TopologyTls | None = None,
        secrets: Sequence[str] = (),
    ) -> None:
        super().__init__(port=port, tls=tls, secrets=secrets)
        self.directives = list(directives)

    @property
    def config_file(self) -> Path:
        return Path(self.dir) / "sentinel.conf"

    def command(self) -> list[str]:
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f'dir "{self.dir}"',
            f'logfile "{self.logfile}"',
            "daemonize no",
            "protected-mode no",
            *self._secret_lines(),  # port 0 and tls-port when TLS, requirepass
            *self.directives,
        ]
        if not self.config_file.exists():
            fd = os.open(self.config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as file:
                file.write("\n".join(lines) + "\n")
        return [self.binary, str(self.config_file), "--sentinel"]


class _Topology:
    """Start/stop bookkeeping, ports and security options shared by both topologies."""

    def __init__(
        self, *, password: str | None, tls: TopologyTls | bool | None, timeout: float = 1.0
    ) -> None:
        self._started: list[RedisServer] = []
        if password is not None and (not password or any(c.isspace() for c in password)):
            raise ValueError("the password must be non-empty, without spaces")
        self.password = password
        self._own_certs: str | None = None
        if tls is True:
            # made by start(), removed by stop()
            self._own_certs = os.path.join(
                tempfile.gettempdir(), f"felix-redis-certs-{uuid.uuid4().hex[:12]}"
            )
            tls = TopologyTls.from_certs(Certs(Path(self._own_certs)))
        self.tls: TopologyTls | None = tls or None
        self._timeout = timeout
        self._explicit_ports: list[int] = []

    # -- how the topology reaches its own processes

    def connection_options(self) -> dict[str, Any]:
        """redis-py options for the data servers (cluster nodes): password and TLS."""
        options: dict[str, Any] = {}
        if self.password is not None:
            options["password"] = self.password
        if self.tls is not None:
            options.update(self.tls.client_kwargs())
        return options

    def client(self, port: int, timeout: float = 1.0) -> redis.Redis:
        """A redis-py client of the data server on 127.0.0.1:port (password, TLS)."""
        return _client(port, timeout, **self.connection_options())

    def _raw(self, port: int, *args: str) -> str:
        return _raw(port, *args, timeout=self._timeout, **self.connection_options())

    def _info(self, port: int, section: str) -> dict[str, str]:
        return _fields(self._raw(port, "INFO", section))

    def _url(self, scheme: str, hosts: str, path: str, query: dict[str, str]) -> str:
        """``scheme[s]://[:password@]hosts/path[?query]``, the password percent-encoded."""
        if self.tls is not None:
            scheme = scheme.replace("redis", "rediss", 1)
            query = {**self.tls.url_options(), **query}
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        tail = f"?{urlencode(query, safe='/')}" if query else ""
        return f"{scheme}://{auth}{hosts}{path}{tail}"

    # -- start and stop

    def _launch(self, server: RedisServer) -> RedisServer:
        self._started.append(server)
        server.start()
        return server

    def _form(self) -> None:
        raise NotImplementedError

    def start(self) -> _Topology:
        """Start every process and wait until the topology is usable."""
        try:
            if self._own_certs is not None:
                make_topology_certs(Path(self._own_certs))
            self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every process this topology started, last started first (and remove the
        certificates it made)."""
        errors: list[BaseException] = []
        for server in reversed(self._started):
            try:
                server.stop()
            except Exception as exc:  # keep stopping the rest
                errors.append(exc)
        self._started.clear()
        if self._own_certs is not None:
            shutil.rmtree(self._own_certs, ignore_errors=True)
        if errors:
            raise errors[0]

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _logged(self) -> list[tuple[str, RedisServer]]:
        return [("redis", server) for server in self._started]

    def copy_logs(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Copy every started process's logfile into ``directory`` (made if missing) as
        ``redis-<port>.log`` / ``sentinel-<port>.log``, before :meth:`stop` removes them;
        returns the copies. A log that cannot be read is left out."""
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        copies = []
        for role, server in self._logged():
            copy = target / f"{role}-{server.port}.log"
            with contextlib.suppress(OSError):
                shutil.copyfile(server.logfile, copy)
                copies.append(copy)
        return copies


class SentinelTopology(_Topology):
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels on loopback.

    Ports: ``ports`` (the primary's first, then one per replica) and ``sentinel_ports``
    name them; ``base_port`` puts the primary on it, replica ``i`` on ``base_port + i``
    and sentinel ``j`` on ``base_port + 20000 + j`` (6400, 6401, 26400.. for 6400);
    whatever is not named gets free ports. ``replicas`` and ``sentinels`` default to the
    number of ports given, else to :data:`SETTINGS`.

    ``password``: ``requirepass`` and ``masterauth`` on every data server, and
    ``sentinel auth-pass`` on the sentinels. ``sentinel_password``: ``requirepass`` on
    the sentinels too (default: none; the sentinels only hand out addresses, and with
    ``tls`` only clients holding a certificate of the CA reach them); the URL carries
    it as ``sentinel_password``. ``tls``: a :class:`TopologyTls`, or True for
    certificates made in a temporary directory (removed on :meth:`stop`); every process
    then listens with TLS only.

    With ``hostname`` (e.g. ``localhost``) servers and sentinels use and announce that
    name instead of 127.0.0.1, the way ``compose.yaml`` does with service names.
    """

    def __init__(
        self,
        replicas: int | None = None,
        sentinels: int | None = None,
        *,
        persistence: bool = False,
        extra: Sequence[str] = (),
        ports: Sequence[int] | None = None,
        sentinel_ports: Sequence[int] | None = None,
        base_port: int | None = None,
        settings: TopologySettings = SETTINGS,
        quorum: int | None = None,
        hostname: str | None = None,
        password: str | None = None,
        sentinel_password: str | None = None,
        tls: TopologyTls | bool | None = None,
    ) -> None:
        super().__init__(password=password, tls=tls)
        if sentinel_password is not None and (
            not sentinel_password or any(c.isspace() for c in sentinel_password)
        ):
            raise ValueError("the sentinel password must be non-empty, without spaces")
        self.sentinel_password = sentinel_password
        if ports is not None and base_port is not None:
            raise ValueError("give ports or base_port, not both")
        taken: set[int] = set()
        if ports is not None:
            data_ports = _port_list(ports, "ports")
            if replicas is None:
                replicas = len(data_ports) - 1
            elif len(data_ports) != replicas + 1:
                raise ValueError(
                    f"{len(data_ports)} ports for a primary and {replicas} replicas; "
                    f"give {replicas + 1}"
                )
            self._explicit_ports += data_ports
        else:
            if replicas is None:
                replicas = settings.replicas
            if base_port is not None:
                data_ports = [base_port + i for i in range(replicas + 1)]
                self._explicit_ports += data_ports
            else:
                data_ports = []
        if sentinel_ports is not None:
            sentinel_list = _port_list(sentinel_ports, "sentinel ports")
            if sentinels is None:
                sentinels = len(sentinel_list)
            elif len(sentinel_list) != sentinels:
                raise ValueError(f"{len(sentinel_list)} sentinel ports for {sentinels} sentinels")
            self._explicit_ports += sentinel_list
        else:
            if sentinels is None:
                sentinels = settings.sentinels
            if base_port is not None:
                first = base_port + settings.sentinel_port_offset
                sentinel_list = [first + j for j in range(sentinels)]
                self._explicit_ports += sentinel_list
            else:
                sentinel_list = []
        if replicas < 0 or sentinels < 1:
            raise ValueError("need replicas >= 0 and sentinels >= 1")
        if len(set(self._explicit_ports)) != len(self._explicit_ports):
            raise ValueError(f"a port is named twice: {self._explicit_ports}")
        taken |= set(self._explicit_ports)
        if not data_ports:
            data_ports = _free_ports(replicas + 1, taken)
        if not sentinel_list:
            sentinel_list = _free_ports(sentinels, taken)
        self.settings = settings
        self.quorum = min(quorum or settings.quorum, sentinels)
        self.hostname = hostname
        self.persistence = persistence
        self.extra = list(extra)
        self._data_ports = data_ports
        self._sentinel_ports = sentinel_list
        self.primary: RedisServer = self._data_server(data_ports[0], None)
        self.replicas: list[RedisServer] = [
            self._data_server(port, data_ports[0]) for port in data_ports[1:]
        ]
        self.sentinels: list[SentinelServer] = []
        #: the primary before the last failover :meth:`wait_for_failover` saw
        self.previous_primary: RedisServer | None = None

    def _data_server(self, port: int, primary_port: int | None) -> RedisServer:
        extra: list[str] = []
        if self.persistence:
            extra += ["--appendonly", "yes", "--appendfsync", "everysec"]
        if primary_port is not None:
            extra += ["--replicaof", self.hostname or "127.0.0.1", str(primary_port)]
        if self.hostname is not None:
            extra += ["--replica-announce-ip", self.hostname]
        secrets = []
        if self.password is not None:
            secrets = [f"requirepass {self.password}", f"masterauth {self.password}"]
        return _Server(
            port=port, persistence=self.persistence, extra=extra + self.extra,
            tls=self.tls, secrets=secrets,
        )

    @property
    def service_name(self) -> str:
        return self.settings.service_name

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", port) for port in self._sentinel_ports]

    @property
    def data_ports(self) -> list[int]:
        """The ports the data servers were started on (the first primary's first)."""
        return list(self._data_ports)

    @property
    def sentinel_ports(self) -> list[int]:
        return list(self._sentinel_ports)

    @property
    def url(self) -> str:
        """The felix URL: ``redis+sentinel://h:p,h:p,h:p/<service>/<db>``; with TLS
        ``rediss+sentinel://`` and the CA and client certificate options, with a password
        ``:password@`` (and ``sentinel_password=`` when the sentinels have one)."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinel_addresses)
        query = {}
        if self.sentinel_password is not None:
            query["sentinel_password"] = self.sentinel_password
        return self._url(
            "redis+sentinel", hosts, f"/{self.service_name}/{self.settings.db}", query
        )

    @property
    def servers(self) -> list[RedisServer]:
        """Every data server, the current primary first."""
        return [self.primary, *self.replicas]

    def start(self) -> SentinelTopology:
        super().start()
        return self

    def __enter__(self) -> SentinelTopology:
        return self.start()

    def _form(self) -> None:
        _check_ports(self._explicit_ports)
        self._launch(self.primary)
        for replica in self.replicas:
            self._launch(replica)
        self.wait_replicas_synced()
        directives = self.sentinel_directives()
        if self.hostname is not None:
            # What compose's entrypoint adds: peers and clients reach it by this name.
            directives.append(f"sentinel announce-ip {self.hostname}")
        secrets = []
        if self.password is not None:
            secrets.append(f"sentinel auth-pass {self.service_name} {self.password}")
        if self.sentinel_password is not None:
            # its own clients and its peers (sentinels log in to each other with it)
            secrets.append(f"requirepass {self.sentinel_password}")
        for port in self._sentinel_ports:
            sentinel = SentinelServer(port=port, directives=directives, tls=self.tls)
            # auth-pass must follow the monitor line that names the service
            sentinel.directives += secrets
            self.sentinels.append(sentinel)
            self._launch(sentinel)
        self.wait_sentinels_ready()

    def _logged(self) -> list[tuple[str, RedisServer]]:
        return [("sentinel" if server in self.sentinels else "redis", server)
                for server in self._started]

    def sentinel_directives(self) -> list[str]:
        """The ``sentinel ...`` lines each sentinel starts with (passwords aside)."""
        return sentinel_config_lines(
            self.settings,
            self.hostname or "127.0.0.1",
            self.primary.port,
            quorum=self.quorum,
            announce_hostnames=self.hostname is not None,
        )

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self.sentinels.clear()

    def sentinel_options(self) -> dict[str, Any]:
        """redis-py options for the sentinels themselves: TLS, their own password."""
        options: dict[str, Any] = {}
        if self.sentinel_password is not None:
            options["password"] = self.sentinel_password
        if self.tls is not None:
            options.update(self.tls.client_kwargs())
        return options

    def sentinel_client(self, timeout: float = 1.0) -> Sentinel:
        """A redis-py ``Sentinel`` over this topology's sentinels (``master_for`` and
        ``slave_for`` clients get the data servers' password and TLS options)."""
        return Sentinel(  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis-py 8.2
            self.sentinel_addresses,
            sentinel_kwargs={
                "socket_timeout": timeout, "socket_connect_timeout": timeout,
                **self.sentinel_options(),
            },
            socket_timeout=timeout, socket_connect_timeout=timeout,
            **self.connection_options(),
        )

    def wait_replicas_synced(self, timeout: float = 15.0) -> None:
        """Wait until every running replica is connected and caught up with the primary."""
        running = [r.port for r in self.replicas if _alive(r)]
        _wait_until(
            "replicas to sync with the primary",
            lambda: _caught_up(self.primary.port, running, **self.connection_options()),
            timeout,
        )

    def wait_sentinels_ready(self, timeout: float = 20.0) -> None:
        """Wait until every sentinel sees the primary, its replicas and the other sentinels."""
        want_replicas = len([r for r in self.replicas if _alive(r)])

        def ready() -> bool:
            for sentinel in self.sentinels:
                with _client(sentinel.port, **self.sentinel_options()) as conn:
                    state = conn.sentinel_master(self.service_name)
                if int(state["num-other-sentinels"]) < len(self.sentinels) - 1:
                    return False
                if int(state["num-slaves"]) < want_replicas:
                    return False
                if int(state["port"]) != self.primary.port:
                    return False
            return True

        _wait_until("sentinels to discover each other and the replicas", ready, timeout, 0.1)

    def primary_address(self) -> tuple[str, int]:
        """The primary address the sentinels currently report."""
        sentinel = self.sentinel_client()
        try:
            host, port = sentinel.discover_master(self.service_name)  # type: ignore[no-untyped-call, unused-ignore]
        finally:
            for conn in sentinel.sentinels:
                conn.close()
        return str(host), int(port)

    def kill_primary(self) -> RedisServer:
        """SIGKILL the current primary (a crash) and return it."""
        victim = self.primary
        victim.kill()
        return victim

    def wait_for_failover(self, timeout: float = 30.0) -> tuple[str, int]:
        """Wait until the sentinels promote a replica; return the new primary's address.

        Afterwards :attr:`primary` is the promoted server and the old primary is moved
        to :attr:`replicas` (the sentinels make it a replica when it comes back).
        """
        old = self.primary

        def promoted() -> tuple[str, int] | None:
            host, port = self.primary_address()
            if port == old.port:
                return None
            if self._info(port, "replication").get("role") != "master":
                return None
            return host, port

        address = _wait_until("a sentinel failover", promoted, timeout, 0.1)
        new = next(r for r in self.replicas if r.port == address[1])
        self.replicas = [old, *[r for r in self.replicas if r is not new]]
        self.primary = new
        self.previous_primary = old
        return address

    def sentinel_states(self) -> list[dict[str, str]]:
        """``SENTINEL MASTER <service>`` of every sentinel, raw strings (flags, ip, port,
        config-epoch, ...); an unreachable sentinel raises."""
        states = []
        for sentinel in self.sentinels:
            with _client(sentinel.port, **self.sentinel_options()) as conn:
                state = conn.sentinel_master(self.service_name)
            states.append({str(key): str(value) for key, value in state.items()})
        return states

    def failovers(self) -> int:
        """How many failovers the sentinels have made since :meth:`start`: the highest
        ``config-epoch`` any sentinel reports (each failover takes a new one)."""
        return max(int(state.get("config-epoch", "0")) for state in self.sentinel_states())

    def wait_failover_settled(
        self, followers: Sequence[int] | None = None, timeout: float = 30.0
    ) -> None:
        """Wait until the failover :meth:`wait_for_failover` saw is over everywhere:

        * every sentinel names :attr:`primary`, at the same ``config-epoch``, with its
          flags plain ``master``: no ``disconnected`` (it reached the new primary), no
          ``s_down``/``o_down``, and no ``failover_in_progress`` (the leader ends the
          failover, ``+failover-end``, once it saw the replicas reconfigured,
          ``+slave-reconf-done``);
        * the primary has each follower ``online``, so a quorum write can be confirmed.

        ``followers``: replica ports that must follow the primary; by default every
        running replica but the previous primary (which the sentinels convert only
        when they see it again, a paused one once resumed).
        """
        if followers is None:
            followers = [
                r.port for r in self.replicas if r is not self.previous_primary and _alive(r)
            ]
        want = sorted(followers)
        port = self.primary.port

        def settled() -> bool:
            states = self.sentinel_states()
            if any(int(s.get("port", "0")) != port or s.get("flags") != "master" for s in states):
                return False
            if len({s.get("config-epoch") for s in states}) != 1:
                return False
            info = self._info(port, "replication")
            online = set()
            for key, value in info.items():
                if key.startswith("slave") and key[5:].isdigit():
                    fields = dict(part.split("=", 1) for part in value.split(","))
                    if fields.get("state") == "online":
                        online.add(int(fields["port"]))
            return info.get("role") == "master" and set(want) <= online

        _wait_until(
            f"the failover to 127.0.0.1:{port} to settle (replicas {want})", settled, timeout, 0.1
        )


class ClusterTopology(_Topology):
    """A Redis Cluster of ``primaries`` primaries, each with ``replicas_per_primary``.

    Ports: ``ports`` names every node's (``primaries * (1 + replicas_per_primary)`` of
    them; ``primaries`` defaults to what that many ports make); ``base_port`` puts nodes
    on ``base_port``, ``base_port + 1``, ...; otherwise free ports. Each node's cluster
    bus port (port + 10000) must be free too.

    ``password``: ``requirepass`` and ``masterauth`` on every node. ``tls``: a
    :class:`TopologyTls`, or True for certificates made in a temporary directory;
    nodes then listen with TLS only and the cluster bus and replication use TLS
    (``tls-cluster``, ``tls-replication``).
    """

    def __init__(
        self,
        primaries: int | None = None,
        replicas_per_primary: int | None = None,
        *,
        persistence: bool = False,
        extra: Sequence[str] = (),
        ports: Sequence[int] | None = None,
        base_port: int | None = None,
        settings: TopologySettings = SETTINGS,
        password: str | None = None,
        tls: TopologyTls | bool | None = None,
    ) -> None:
        super().__init__(password=password, tls=tls)
        if ports is not None and base_port is not None:
            raise ValueError("give ports or base_port, not both")
        if replicas_per_primary is None:
            replicas_per_primary = settings.cluster_replicas_per_primary
        if replicas_per_primary < 0:
            raise ValueError("replicas_per_primary must be >= 0")
        per = 1 + replicas_per_primary
        if ports is not None:
            node_ports = _port_list(ports, "ports")
            if primaries is None:
                if len(node_ports) % per:
                    raise ValueError(
                        f"{len(node_ports)} ports do not split into primaries with "
                        f"{replicas_per_primary} replicas each"
                    )
                primaries = len(node_ports) // per
            elif len(node_ports) != primaries * per:
                raise ValueError(
                    f"{len(node_ports)} ports for {primaries} primaries with "
                    f"{replicas_per_primary} replicas each; give {primaries * per}"
                )
        if primaries is None:
            primaries = settings.cluster_primaries
        if primaries < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 primaries")
        self.settings = settings
        self.primaries_wanted = primaries
        self.replicas_per_primary = replicas_per_primary
        self.persistence = persistence
        self.extra = list(extra)
        total = primaries * per
        if ports is None and base_port is None:
            taken: set[int] = set()
            node_ports = []
            for _ in range(total):
                port = _free_cluster_port(taken)
                taken |= {port, port + CLUSTER_BUS_PORT_OFFSET}
                node_ports.append(port)
        else:
            if ports is None:
                assert base_port is not None
                node_ports = [base_port + i for i in range(total)]
            self._explicit_ports = node_ports + [
                p + CLUSTER_BUS_PORT_OFFSET for p in node_ports
            ]
        self.nodes: list[RedisServer] = [self._node(port) for port in node_ports]
        self._replicas_of: dict[int, list[int]] = {}

    def _node(self, port: int) -> RedisServer:
        extra = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.settings.cluster_node_timeout_ms),
        ]
        if self.persistence:
            extra += ["--appendonly", "yes", "--appendfsync", "everysec"]
        secrets = []
        if self.password is not None:
            secrets = [f"requirepass {self.password}", f"masterauth {self.password}"]
        if self.tls is not None:
            secrets.append("tls-cluster yes")  # the bus port is tls-port + 10000
        return _Server(
            port=port, persistence=self.persistence, extra=extra + self.extra,
            tls=self.tls, secrets=secrets,
        )

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        """The felix URL: ``redis+cluster://h:p,h:p,...`` over every node; with TLS
        ``rediss+cluster://`` and the CA and client certificate options, with a password
        ``:password@``."""
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        return self._url("redis+cluster", hosts, "", {})

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", port) for port in self.ports]

    def start(self) -> ClusterTopology:
        super().start()
        return self

    def __enter__(self) -> ClusterTopology:
        return self.start()

    def _form(self) -> None:
        _check_ports(self._explicit_ports)
        for node in self.nodes:
            self._launch(node)
        cli = shutil.which("redis-cli")
        if cli is None:
            raise FileNotFoundError("no redis-cli on PATH (needed to form the cluster)")
        command = [cli]
        env = dict(os.environ)
        env.pop("REDISCLI_AUTH", None)
        if self.tls is not None:
            command += ["--tls", "--cacert", self.tls.ca]
            if self.tls.client_cert:
                command += ["--cert", self.tls.client_cert]
                if self.tls.client_key:
                    command += ["--key", self.tls.client_key]
        if self.password is not None:
            env["REDISCLI_AUTH"] = self.password  # not on the command line
        command += [
            "--cluster", "create",
            *(f"127.0.0.1:{p}" for p in self.ports),
            "--cluster-replicas", str(self.replicas_per_primary),
            "--cluster-yes",
        ]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
            env=env,
        )
        if done.returncode != 0 or "[OK] All 16384 slots covered" not in done.stdout:
            raise RuntimeError(
                f"redis-cli --cluster create failed ({done.returncode}):\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
            )
        self.wait_ready()

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def alive(self, port: int) -> bool:
        return _alive(self.node(port))

    def cluster_nodes(self, via: int | None = None) -> list[dict[str, str]]:
        """``CLUSTER NODES`` from one live node, as dicts (id, port, role, primary_id, slots)."""
        port = via if via is not None else next(p for p in self.ports if self.alive(p))
        rows = []
        for line in self._raw(port, "CLUSTER", "NODES").splitlines():
            parts = line.split()
            flags = parts[2].split(",")
            role = "primary" if "master" in flags else "replica"
            rows.append(
                {
                    "id": parts[0],
                    "port": parts[1].split("@")[0].rsplit(":", 1)[1],
                    "role": role,
                    "primary_id": parts[3] if parts[3] != "-" else "",
                    "failed": "yes" if ("fail" in flags or "fail?" in flags) else "no",
                    "slots": " ".join(parts[8:]),
                }
            )
        return rows

    def primary_ports(self) -> list[int]:
        """Ports of live nodes that are primaries with slots."""
        return sorted(
            int(row["port"])
            for row in self.cluster_nodes()
            if row["role"] == "primary" and row["slots"] and self.alive(int(row["port"]))
        )

    def replica_ports(self, primary_port: int) -> list[int]:
        """Ports of the replicas attached to the primary on ``primary_port``."""
        rows = self.cluster_nodes()
        primary_id = next(r["id"] for r in rows if int(r["port"]) == primary_port)
        return sorted(int(r["port"]) for r in rows if r["primary_id"] == primary_id)

    def primary_port_for_key(self, key: str | bytes) -> int:
        """Port of the live primary serving ``key``'s slot, as the cluster sees it now."""
        via = next(p for p in self.ports if self.alive(p))
        with self.client(via) as conn:
            slot = int(conn.execute_command("CLUSTER", "KEYSLOT", key))
        for row in self.cluster_nodes(via):
            if row["role"] != "primary" or row["failed"] == "yes":
                continue
            for part in row["slots"].split():
                if part.startswith("["):
                    continue  # a slot being migrated or imported
                first, _, last = part.partition("-")
                if int(first) <= slot <= int(last or first):
                    return int(row["port"])
        raise LookupError(f"no live primary serves slot {slot}")

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until every live node reports ``cluster_state:ok`` with all slots covered
        and every replica is attached to its primary."""
        live = [p for p in self.ports if self.alive(p)]

        def ready() -> bool:
            for port in live:
                info = _fields(self._raw(port, "CLUSTER", "INFO"))
                if info.get("cluster_state") != "ok":
                    return False
                if int(info.get("cluster_slots_assigned", "0")) != CLUSTER_SLOTS:
                    return False
                if int(info.get("cluster_slots_ok", "0")) != CLUSTER_SLOTS:
                    return False
            for port in live:
                repl = self._info(port, "replication")
                if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                    return False
            return True

        _wait_until("the cluster to be ready", ready, timeout, 0.1)

    def wait_replicas_synced(self, timeout: float = 15.0) -> None:
        """Wait until every live replica has caught up with its primary's offset."""

        def synced() -> bool:
            return all(
                _caught_up(
                    port,
                    [r for r in self.replica_ports(port) if self.alive(r)],
                    **self.connection_options(),
                )
                for port in self.primary_ports()
            )

        _wait_until("cluster replicas to catch up", synced, timeout)

    def kill_node(self, port: int) -> None:
        """SIGKILL the node on ``port`` (a crash)."""
        with contextlib.suppress(redis.RedisError, OSError, StopIteration):
            # Remember who can take over, for wait_for_promotion.
            self._replicas_of[port] = self.replica_ports(port)
        self.node(port).kill()

    def wait_for_promotion(self, old_primary_port: int, timeout: float = 30.0) -> int:
        """Wait until a replica of the (dead) primary on ``old_primary_port`` took over
        its slots and the cluster is ok again; return the new primary's port."""
        candidates = self._replicas_of.get(old_primary_port) or []
        if not candidates:
            raise ValueError(f"127.0.0.1:{old_primary_port} had no known replica")

        def promoted() -> int | None:
            winner = next(
                (
                    port
                    for port in candidates
                    if self.alive(port)
                    and self._info(port, "replication").get("role") == "master"
                ),
                None,
            )
            if winner is None:
                return None
            # Every live node must agree, so any of them routes to the new primary.
            for via in (p for p in self.ports if self.alive(p)):
                if _fields(self._raw(via, "CLUSTER", "INFO")).get("cluster_state") != "ok":
                    return None
                rows = self.cluster_nodes(via)
                row = next((r for r in rows if int(r["port"]) == winner), None)
                if row is None or row["role"] != "primary" or not row["slots"]:
                    return None
            return winner

        return _wait_until(
            f"a replica of 127.0.0.1:{old_primary_port} to be promoted", promoted, timeout, 0.1
        )

    def failover(self, primary_port: int, *, hard: bool = True, timeout: float = 30.0) -> int:
        """Move ``primary_port``'s slots to one of its replicas; return the new primary.

        ``hard=True`` SIGKILLs the primary and waits for the cluster's own failover;
        ``hard=False`` runs a coordinated ``CLUSTER FAILOVER`` on a replica.
        """
        replicas = self.replica_ports(primary_port)
        if not replicas:
            raise ValueError(f"127.0.0.1:{primary_port} has no replica to fail over to")
        self._replicas_of[primary_port] = replicas
        if hard:
            self.kill_node(primary_port)
        else:
            with self.client(replicas[0], timeout=5.0) as conn:
                conn.execute_command("CLUSTER FAILOVER")
        new = self.wait_for_promotion(primary_port, timeout)
        if not hard:
            self._wait_attached(primary_port, new, timeout)
        return new

    def _wait_attached(self, replica_port: int, primary_port: int, timeout: float) -> None:
        """Wait until every live node sees ``replica_port`` as a replica of ``primary_port``."""

        def attached() -> bool:
            for via in (p for p in self.ports if self.alive(p)):
                rows = self.cluster_nodes(via)
                ids = {int(r["port"]): r["id"] for r in rows}
                row = next(r for r in rows if int(r["port"]) == replica_port)
                if row["role"] != "replica" or row["primary_id"] != ids[primary_port]:
                    return False
            repl = self._info(replica_port, "replication")
            return repl.get("master_link_status") == "up"

        _wait_until(f"127.0.0.1:{replica_port} to follow {primary_port}", attached, timeout, 0.1)


# --------------------------------------------------------------------------- CLI


def _ports_option(text: str) -> list[int]:
    try:
        ports = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ports: {text!r}") from None
    if not ports:
        raise argparse.ArgumentTypeError("no port given")
    return ports


def _add_security_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--password-from-env", metavar="VAR", default=None,
                        help="requirepass/masterauth on every data server: the value of "
                             "environment variable VAR (never printed; clients take it from "
                             "$FELIX_REDIS_PASSWORD)")
    parser.add_argument("--tls", action="store_true",
                        help="TLS only, on every process: certificates made in a temporary "
                             "directory (removed on exit), or in --certs-dir")
    parser.add_argument("--certs-dir", metavar="DIR", default=None,
                        help="with --tls: use ca.crt, node.crt/key and client.crt/key in DIR "
                             "(made there when missing, kept on exit)")
    parser.add_argument("--persistence", action="store_true",
                        help="AOF (appendfsync everysec) and RDB in each server's directory")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m felix_redis.testing.topology",
        description="Run a local Redis Sentinel or Cluster topology on 127.0.0.1 "
        "until Ctrl-C or SIGTERM.",
    )
    sub = parser.add_subparsers(dest="kind", required=True)
    sen = sub.add_parser("sentinel", help="a primary, replicas and sentinels")
    sen.add_argument("--ports", type=_ports_option, default=None, metavar="P,P,...",
                     help="data server ports, the primary's first (default: free ports)")
    sen.add_argument("--sentinel-ports", type=_ports_option, default=None, metavar="P,P,...",
                     help="sentinel ports (default: free ports, or --base-port + 20000...)")
    sen.add_argument("--base-port", type=int, default=None,
                     help="primary port; replicas follow it, sentinels at +20000 "
                          "(instead of --ports)")
    sen.add_argument("--replicas", type=int, default=None,
                     help=f"default: as many as --ports name, else {SETTINGS.replicas}")
    sen.add_argument("--sentinels", type=int, default=None,
                     help=f"default: as many as --sentinel-ports name, else {SETTINGS.sentinels}")
    _add_security_options(sen)
    clu = sub.add_parser("cluster", help="a Redis Cluster with replicas")
    clu.add_argument("--ports", type=_ports_option, default=None, metavar="P,P,...",
                     help="every node's port; each bus port (port + 10000) must be free too "
                          "(default: free ports)")
    clu.add_argument("--base-port", type=int, default=None,
                     help="first node's port; the others follow (instead of --ports)")
    clu.add_argument("--primaries", type=int, default=None,
                     help=f"default: what --ports make, else {SETTINGS.cluster_primaries}")
    clu.add_argument("--replicas-per-primary", type=int,
                     default=SETTINGS.cluster_replicas_per_primary)
    _add_security_options(clu)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m felix_redis.testing.topology``."""
    args = _parser().parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    password = None
    if args.password_from_env is not None:
        password = os.environ.get(args.password_from_env)
        if not password:
            print(f"topology: error: environment variable {args.password_from_env} is not set "
                  "or empty", file=sys.stderr)
            return 1
    tls: TopologyTls | bool | None = None
    if args.certs_dir is not None and not args.tls:
        print("topology: error: --certs-dir needs --tls", file=sys.stderr)
        return 1
    if args.tls:
        tls = True
        if args.certs_dir is not None:
            try:
                certs = make_topology_certs(Path(args.certs_dir).resolve())
            except (OSError, subprocess.SubprocessError) as exc:
                print(f"topology: error: cannot make certificates in {args.certs_dir}: {exc}",
                      file=sys.stderr)
                return 1
            tls = TopologyTls.from_certs(certs)

    previous = {
        sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    topology: SentinelTopology | ClusterTopology | None = None
    try:
        if args.kind == "sentinel":
            topology = SentinelTopology(
                replicas=args.replicas, sentinels=args.sentinels, persistence=args.persistence,
                ports=args.ports, sentinel_ports=args.sentinel_ports, base_port=args.base_port,
                password=password, tls=tls,
            )
        else:
            topology = ClusterTopology(
                primaries=args.primaries, replicas_per_primary=args.replicas_per_primary,
                persistence=args.persistence, ports=args.ports, base_port=args.base_port,
                password=password, tls=tls,
            )
        topology.start()
        scheme = "rediss" if topology.tls is not None else "redis"
        if isinstance(topology, SentinelTopology):
            print(f"primary   {scheme}://127.0.0.1:{topology.primary.port}/0")
            for replica in topology.replicas:
                print(f"replica   {scheme}://127.0.0.1:{replica.port}/0")
            for host, port in topology.sentinel_addresses:
                print(f"sentinel  {host}:{port}")
        else:
            for port in topology.primary_ports():
                replicas = ", ".join(str(p) for p in topology.replica_ports(port))
                print(f"primary   127.0.0.1:{port}  replicas: {replicas or '-'}")
        if topology.tls is not None:
            print(f"tls       CA {topology.tls.ca}, client certificate "
                  f"{topology.tls.client_cert} (key {topology.tls.client_key})")
        # the password stays out of the printed URL: clients read $FELIX_REDIS_PASSWORD
        shown = topology.url
        if password is not None:
            shown = shown.replace(f":{quote(password, safe='')}@", "", 1)
            print(f"password  export FELIX_REDIS_PASSWORD=\"${args.password_from_env}\" "
                  "(the URL holds none)")
        print(f"FELIX_REDIS_URL={shown}", flush=True)
        print("running; Ctrl-C or SIGTERM stops it", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
        return 0
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
        message = str(exc)
        if password:
            message = message.replace(password, "***")
        print(f"topology: error: {message}", file=sys.stderr)
        return 1
    finally:
        if topology is not None:
            with contextlib.suppress(Exception):
                topology.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    raise SystemExit(main())
