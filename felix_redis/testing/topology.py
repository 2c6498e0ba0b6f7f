"""Local Redis topologies for tests and demos: Sentinel and Cluster on loopback.

``SentinelTopology`` starts a primary, its replicas and a set of sentinels with fast
failover settings; ``ClusterTopology`` forms a Redis Cluster of primaries with
replicas. Both use Debian's ``redis-server`` through :class:`RedisServer`, bind to
127.0.0.1 only, bound every wait with a timeout and stop every process they started
on :meth:`stop` (also when :meth:`start` fails half-way).

The settings shared with ``compose.yaml`` (ports, service name, quorum, failover
timings) live in :data:`SETTINGS`; ``tests/test_compose.py`` checks the compose file
against them.

Run from a shell::

    python -m felix_redis.testing.topology sentinel --base-port 6379
    python -m felix_redis.testing.topology cluster --base-port 7000

It prints the ``FELIX_REDIS_URL=...`` line to use and runs until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import TypeVar

import redis
from redis.sentinel import Sentinel

from felix_redis.testing.server import RedisServer, free_port

__all__ = [
    "SETTINGS",
    "ClusterTopology",
    "SentinelServer",
    "SentinelTopology",
    "TopologySettings",
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
    down_after_ms: int = 1000
    """A primary silent this long is considered down by a sentinel."""
    failover_timeout_ms: int = 5000
    parallel_syncs: int = 1
    redis_port: int = 6379
    """Data port inside compose and the launcher's default base port."""
    sentinel_port: int = 26379
    """Sentinel port inside compose; the launcher puts sentinels at base + offset."""
    cluster_base_port: int = 7000
    cluster_node_timeout_ms: int = 1000
    cluster_primaries: int = 3
    cluster_replicas_per_primary: int = 1

    @property
    def sentinel_port_offset(self) -> int:
        """Distance from a data port to the first sentinel port (20000)."""
        return self.sentinel_port - self.redis_port


SETTINGS = TopologySettings()

T = TypeVar("T")


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
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


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
    for port in ports:
        if not 0 < port < 65536:
            raise ValueError(f"port {port} is out of range; choose a lower --base-port")
        if not _port_is_free(port):
            raise OSError(f"port 127.0.0.1:{port} is in use")


def _client(port: int, timeout: float = 1.0) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=timeout, socket_connect_timeout=timeout
    )


def _raw(port: int, *args: str, timeout: float = 1.0) -> str:
    """Send one command to 127.0.0.1:port and return its bulk reply as text, unparsed."""
    connection = redis.Connection(  # type: ignore[no-untyped-call]
        host="127.0.0.1", port=port, socket_timeout=timeout, socket_connect_timeout=timeout
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


def _info(port: int, section: str) -> dict[str, str]:
    """``INFO section`` as raw ``key -> value`` strings (nested values left unparsed)."""
    return _fields(_raw(port, "INFO", section))


def _cluster_info(port: int) -> dict[str, str]:
    return _fields(_raw(port, "CLUSTER", "INFO"))


def _alive(server: RedisServer) -> bool:
    return server.process is not None and server.process.poll() is None


def _caught_up(primary_port: int, replica_ports: Sequence[int]) -> bool:
    """True if every replica port is online at the primary with the primary's offset."""
    info = _info(primary_port, "replication")
    offset = int(info.get("master_repl_offset", "-1"))
    seen: dict[int, int] = {}
    for key, value in info.items():
        if key.startswith("slave") and key[5:].isdigit():
            fields = dict(part.split("=", 1) for part in value.split(","))
            if fields.get("state") == "online":
                seen[int(fields["port"])] = int(fields["offset"])
    return all(seen.get(port) == offset for port in replica_ports)


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


class SentinelServer(RedisServer):
    """A ``redis-server --sentinel`` with its own writable config file.

    Sentinel rewrites its config file (known replicas, sentinels, epochs), so each one
    gets a file of its own in its private directory.
    """

    def __init__(self, *, port: int | None = None, directives: Sequence[str] = ()) -> None:
        super().__init__(port=port)
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
            *self.directives,
        ]
        if not self.config_file.exists():
            self.config_file.write_text("\n".join(lines) + "\n")
        return [self.binary, str(self.config_file), "--sentinel"]


class _Topology:
    """Start/stop bookkeeping shared by both topologies."""

    def __init__(self) -> None:
        self._started: list[RedisServer] = []

    def _launch(self, server: RedisServer) -> RedisServer:
        self._started.append(server)
        server.start()
        return server

    def _form(self) -> None:
        raise NotImplementedError

    def start(self) -> _Topology:
        """Start every process and wait until the topology is usable."""
        try:
            self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every process this topology started, last started first."""
        errors: list[BaseException] = []
        for server in reversed(self._started):
            try:
                server.stop()
            except Exception as exc:  # keep stopping the rest
                errors.append(exc)
        self._started.clear()
        if errors:
            raise errors[0]

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class SentinelTopology(_Topology):
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels on loopback.

    With ``base_port`` the primary listens on it, replica ``i`` on ``base_port + i``
    and sentinel ``j`` on ``base_port + 20000 + j`` (6379, 6380, 26379.. for 6379);
    without it every process gets a free port. With ``hostname`` (e.g. ``localhost``)
    servers and sentinels use and announce that name instead of 127.0.0.1, the way
    ``compose.yaml`` does with service names.
    """

    def __init__(
        self,
        replicas: int = SETTINGS.replicas,
        sentinels: int = SETTINGS.sentinels,
        *,
        persistence: bool = False,
        extra: Sequence[str] = (),
        base_port: int | None = None,
        settings: TopologySettings = SETTINGS,
        quorum: int | None = None,
        hostname: str | None = None,
    ) -> None:
        super().__init__()
        if replicas < 0 or sentinels < 1:
            raise ValueError("need replicas >= 0 and sentinels >= 1")
        self.settings = settings
        self.quorum = min(quorum or settings.quorum, sentinels)
        self.hostname = hostname
        self.persistence = persistence
        self.extra = list(extra)
        if base_port is None:
            data_ports = [free_port() for _ in range(replicas + 1)]
            sentinel_ports = [free_port() for _ in range(sentinels)]
        else:
            data_ports = [base_port + i for i in range(replicas + 1)]
            first = base_port + settings.sentinel_port_offset
            sentinel_ports = [first + j for j in range(sentinels)]
        self._data_ports = data_ports
        self._sentinel_ports = sentinel_ports
        self._base_port = base_port
        self.primary: RedisServer = self._data_server(data_ports[0], None)
        self.replicas: list[RedisServer] = [
            self._data_server(port, data_ports[0]) for port in data_ports[1:]
        ]
        self.sentinels: list[SentinelServer] = []

    def _data_server(self, port: int, primary_port: int | None) -> RedisServer:
        extra: list[str] = []
        if self.persistence:
            extra += ["--appendonly", "yes", "--appendfsync", "everysec"]
        if primary_port is not None:
            extra += ["--replicaof", self.hostname or "127.0.0.1", str(primary_port)]
        if self.hostname is not None:
            extra += ["--replica-announce-ip", self.hostname]
        return RedisServer(
            port=port, persistence=self.persistence, extra=extra + self.extra
        )

    @property
    def service_name(self) -> str:
        return self.settings.service_name

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", port) for port in self._sentinel_ports]

    @property
    def url(self) -> str:
        """The felix URL: ``redis+sentinel://h:p,h:p,h:p/<service>/<db>``."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinel_addresses)
        return f"redis+sentinel://{hosts}/{self.service_name}/{self.settings.db}"

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
        if self._base_port is not None:
            _check_ports(self._data_ports + self._sentinel_ports)
        self._launch(self.primary)
        for replica in self.replicas:
            self._launch(replica)
        self.wait_replicas_synced()
        directives = self.sentinel_directives()
        if self.hostname is not None:
            # What compose's entrypoint adds: peers and clients reach it by this name.
            directives.append(f"sentinel announce-ip {self.hostname}")
        for port in self._sentinel_ports:
            sentinel = SentinelServer(port=port, directives=directives)
            self.sentinels.append(sentinel)
            self._launch(sentinel)
        self.wait_sentinels_ready()

    def sentinel_directives(self) -> list[str]:
        """The ``sentinel ...`` lines each sentinel starts with."""
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

    def sentinel_client(self, timeout: float = 1.0) -> Sentinel:
        """A redis-py ``Sentinel`` over this topology's sentinels."""
        return Sentinel(  # type: ignore[no-untyped-call]
            self.sentinel_addresses, socket_timeout=timeout, socket_connect_timeout=timeout
        )

    def wait_replicas_synced(self, timeout: float = 15.0) -> None:
        """Wait until every running replica is connected and caught up with the primary."""
        running = [r.port for r in self.replicas if _alive(r)]
        _wait_until(
            "replicas to sync with the primary",
            lambda: _caught_up(self.primary.port, running),
            timeout,
        )

    def wait_sentinels_ready(self, timeout: float = 20.0) -> None:
        """Wait until every sentinel sees the primary, its replicas and the other sentinels."""
        want_replicas = len([r for r in self.replicas if _alive(r)])

        def ready() -> bool:
            for sentinel in self.sentinels:
                with _client(sentinel.port) as conn:
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
        host, port = sentinel.discover_master(self.service_name)  # type: ignore[no-untyped-call]
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
            if _info(port, "replication").get("role") != "master":
                return None
            return host, port

        address = _wait_until("a sentinel failover", promoted, timeout, 0.1)
        new = next(r for r in self.replicas if r.port == address[1])
        self.replicas = [old, *[r for r in self.replicas if r is not new]]
        self.primary = new
        return address


class ClusterTopology(_Topology):
    """A Redis Cluster of ``primaries`` primaries, each with ``replicas_per_primary``.

    With ``base_port`` nodes listen on ``base_port``, ``base_port + 1``, ...; without it
    on free ports whose cluster bus port (port + 10000) is free too.
    """

    def __init__(
        self,
        primaries: int = SETTINGS.cluster_primaries,
        replicas_per_primary: int = SETTINGS.cluster_replicas_per_primary,
        *,
        persistence: bool = False,
        extra: Sequence[str] = (),
        base_port: int | None = None,
        settings: TopologySettings = SETTINGS,
    ) -> None:
        super().__init__()
        if primaries < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 primaries")
        if replicas_per_primary < 0:
            raise ValueError("replicas_per_primary must be >= 0")
        self.settings = settings
        self.primaries_wanted = primaries
        self.replicas_per_primary = replicas_per_primary
        self.persistence = persistence
        self.extra = list(extra)
        total = primaries * (1 + replicas_per_primary)
        self._base_port = base_port
        if base_port is None:
            taken: set[int] = set()
            ports = []
            for _ in range(total):
                port = _free_cluster_port(taken)
                taken |= {port, port + CLUSTER_BUS_PORT_OFFSET}
                ports.append(port)
        else:
            ports = [base_port + i for i in range(total)]
        self.nodes: list[RedisServer] = [self._node(port) for port in ports]
        self._replicas_of: dict[int, list[int]] = {}

    def _node(self, port: int) -> RedisServer:
        extra = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.settings.cluster_node_timeout_ms),
        ]
        if self.persistence:
            extra += ["--appendonly", "yes", "--appendfsync", "everysec"]
        return RedisServer(port=port, persistence=self.persistence, extra=extra + self.extra)

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        """The felix URL: ``redis+cluster://h:p,h:p,...`` over every node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", port) for port in self.ports]

    def start(self) -> ClusterTopology:
        super().start()
        return self

    def __enter__(self) -> ClusterTopology:
        return self.start()

    def _form(self) -> None:
        if self._base_port is not None:
            _check_ports(
                self.ports + [p + CLUSTER_BUS_PORT_OFFSET for p in self.ports]
            )
        for node in self.nodes:
            self._launch(node)
        cli = shutil.which("redis-cli")
        if cli is None:
            raise FileNotFoundError("no redis-cli on PATH (needed to form the cluster)")
        command = [
            cli, "--cluster", "create",
            *(f"127.0.0.1:{p}" for p in self.ports),
            "--cluster-replicas", str(self.replicas_per_primary),
            "--cluster-yes",
        ]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
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
        for line in _raw(port, "CLUSTER", "NODES").splitlines():
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

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until every live node reports ``cluster_state:ok`` with all slots covered
        and every replica is attached to its primary."""
        live = [p for p in self.ports if self.alive(p)]

        def ready() -> bool:
            for port in live:
                info = _cluster_info(port)
                if info.get("cluster_state") != "ok":
                    return False
                if int(info.get("cluster_slots_assigned", "0")) != CLUSTER_SLOTS:
                    return False
                if int(info.get("cluster_slots_ok", "0")) != CLUSTER_SLOTS:
                    return False
            for port in live:
                repl = _info(port, "replication")
                if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                    return False
            return True

        _wait_until("the cluster to be ready", ready, timeout, 0.1)

    def wait_replicas_synced(self, timeout: float = 15.0) -> None:
        """Wait until every live replica has caught up with its primary's offset."""

        def synced() -> bool:
            return all(
                _caught_up(port, [r for r in self.replica_ports(port) if self.alive(r)])
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
                    and _info(port, "replication").get("role") == "master"
                ),
                None,
            )
            if winner is None:
                return None
            # Every live node must agree, so any of them routes to the new primary.
            for via in (p for p in self.ports if self.alive(p)):
                if _cluster_info(via).get("cluster_state") != "ok":
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
            with _client(replicas[0], timeout=5.0) as conn:
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
            repl = _info(replica_port, "replication")
            return repl.get("master_link_status") == "up"

        _wait_until(f"127.0.0.1:{replica_port} to follow {primary_port}", attached, timeout, 0.1)


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m felix_redis.testing.topology",
        description="Run a local Redis Sentinel or Cluster topology on 127.0.0.1 "
        "until Ctrl-C or SIGTERM.",
    )
    sub = parser.add_subparsers(dest="kind", required=True)
    sen = sub.add_parser("sentinel", help="a primary, replicas and sentinels")
    sen.add_argument("--base-port", type=int, default=None,
                     help="primary port; replicas follow it, sentinels at +20000 "
                          "(default: free ports)")
    sen.add_argument("--replicas", type=int, default=SETTINGS.replicas)
    sen.add_argument("--sentinels", type=int, default=SETTINGS.sentinels)
    sen.add_argument("--persistence", action="store_true",
                     help="AOF (appendfsync everysec) and RDB in each server's directory")
    clu = sub.add_parser("cluster", help="a Redis Cluster with replicas")
    clu.add_argument("--base-port", type=int, default=None,
                     help="first node's port; the others follow (default: free ports)")
    clu.add_argument("--primaries", type=int, default=SETTINGS.cluster_primaries)
    clu.add_argument("--replicas-per-primary", type=int,
                     default=SETTINGS.cluster_replicas_per_primary)
    clu.add_argument("--persistence", action="store_true",
                     help="AOF (appendfsync everysec) and RDB in each node's directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m felix_redis.testing.topology``."""
    args = _parser().parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {
        sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    topology: SentinelTopology | ClusterTopology
    if args.kind == "sentinel":
        topology = SentinelTopology(
            replicas=args.replicas, sentinels=args.sentinels,
            persistence=args.persistence, base_port=args.base_port,
        )
    else:
        topology = ClusterTopology(
            primaries=args.primaries, replicas_per_primary=args.replicas_per_primary,
            persistence=args.persistence, base_port=args.base_port,
        )
    try:
        topology.start()
        if isinstance(topology, SentinelTopology):
            print(f"primary   {topology.primary.url}")
            for replica in topology.replicas:
                print(f"replica   {replica.url}")
            for host, port in topology.sentinel_addresses:
                print(f"sentinel  {host}:{port}")
        else:
            for port in topology.primary_ports():
                replicas = ", ".join(str(p) for p in topology.replica_ports(port))
                print(f"primary   127.0.0.1:{port}  replicas: {replicas or '-'}")
        print(f"FELIX_REDIS_URL={topology.url}", flush=True)
        print("running; Ctrl-C or SIGTERM stops it", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
        return 0
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"topology: error: {exc}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(Exception):
            topology.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    raise SystemExit(main())
