"""The Sentinel and Cluster launchers, with real redis-server processes on loopback."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

from felix_redis.testing.server import RedisServer, free_port, redis_server_binary
from felix_redis.testing.topology import (
    CLUSTER_BUS_PORT_OFFSET,
    CLUSTER_SLOTS,
    SENTINEL_PING_PERIOD_MS,
    SETTINGS,
    ClusterTopology,
    SentinelTopology,
    _port_is_free,
)

pytestmark = pytest.mark.skipif(
    redis_server_binary() is None, reason="redis-server is not installed (apt install redis-server)"
)
needs_cli = pytest.mark.skipif(
    shutil.which("redis-cli") is None, reason="redis-cli is not installed (needed for clusters)"
)

# A failover must finish well inside this bound with down-after 2 s / node-timeout 1 s.
FAILOVER_BOUND_S = 20.0
#: Sentinel re-configuring a restarted old primary as a replica (its INFO period is 10 s).
REJOIN_BOUND_S = 45.0


def _answers(port: int) -> bool:
    """True if something on 127.0.0.1:port answers PING (no client retries)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture
def sentinel_topology() -> Iterator[SentinelTopology]:
    with SentinelTopology() as topology:
        yield topology


@pytest.fixture
def cluster_topology() -> Iterator[ClusterTopology]:
    with ClusterTopology() as topology:
        yield topology


def test_sentinel_topology_shape_and_url(sentinel_topology: SentinelTopology) -> None:
    t = sentinel_topology
    assert t.service_name == SETTINGS.service_name == "mymaster"
    assert len(t.sentinel_addresses) == SETTINGS.sentinels
    assert len(t.replicas) == SETTINGS.replicas
    hosts = ",".join(f"127.0.0.1:{p}" for _, p in t.sentinel_addresses)
    assert t.url == f"redis+sentinel://{hosts}/mymaster/0"
    assert t.primary_address() == ("127.0.0.1", t.primary.port)
    for host, port in t.sentinel_addresses:
        state = redis.Redis(host=host, port=port).sentinel_master("mymaster")
        assert int(state["quorum"]) == SETTINGS.quorum
        assert int(state["down-after-milliseconds"]) == SETTINGS.down_after_ms
        assert int(state["failover-timeout"]) == SETTINGS.failover_timeout_ms


def test_sentinel_failover_promotes_the_replica(sentinel_topology: SentinelTopology) -> None:
    t = sentinel_topology
    primary = redis.Redis(port=t.primary.port)
    primary.set("before", "1")
    t.wait_replicas_synced()
    replica = redis.Redis(port=t.replicas[0].port)
    assert replica.get("before") == b"1"

    old_port, replica_port = t.primary.port, t.replicas[0].port
    t.kill_primary()
    started = time.monotonic()
    host, port = t.wait_for_failover(timeout=FAILOVER_BOUND_S)
    assert time.monotonic() - started < FAILOVER_BOUND_S
    assert (host, port) == ("127.0.0.1", replica_port)
    assert port != old_port
    assert t.primary.port == port

    # redis-py, going through the sentinels, now writes to the promoted server.
    sentinel = Sentinel(t.sentinel_addresses, socket_timeout=1.0)  # type: ignore[no-untyped-call]
    new_primary = sentinel.master_for("mymaster", socket_timeout=1.0)  # type: ignore[no-untyped-call]
    new_primary.set("after", "2")
    direct = redis.Redis(port=port)
    assert direct.get("after") == b"2"
    assert direct.get("before") == b"1"  # the replicated write survived the failover
    assert direct.info("replication")["role"] == "master"


def test_settings_leave_a_margin_over_sentinels_ping_period() -> None:
    """A sentinel's first PING to a primary it just switched to may leave a whole ping
    period after the switch; down-after must outlast that by a clear margin, or the new
    primary is marked down and failed over again (SETTINGS' docstring). The launcher's
    default is what compose and docs/operations.md use: no topology needs settings of
    its own to fail over once."""
    assert SETTINGS.down_after_ms >= SENTINEL_PING_PERIOD_MS + 1000
    assert SentinelTopology().settings is SETTINGS


def test_sentinel_topology_stops_every_process(tmp_path: Path) -> None:
    t = SentinelTopology()
    try:
        t.start()
        ports = [s.port for s in t.servers] + [p for _, p in t.sentinel_addresses]
        assert all(_answers(p) for p in ports)
        # the logs can be kept before stop() removes them
        copies = t.copy_logs(tmp_path / "logs")
        names = sorted(c.name for c in copies)
        assert names == sorted([f"redis-{s.port}.log" for s in t.servers]
                               + [f"sentinel-{p}.log" for _, p in t.sentinel_addresses])
        assert "+monitor master mymaster" in (tmp_path / "logs" / f"sentinel-{t.sentinel_ports[0]}.log").read_text()
    finally:
        t.stop()
    assert not any(_answers(p) for p in ports)


def test_failed_start_leaves_nothing_behind() -> None:
    with RedisServer() as squatter:
        # The third "replica" port is taken, so start() must fail and clean up.
        t = SentinelTopology(replicas=2, base_port=squatter.port - 2)
        with pytest.raises(OSError, match="in use"):
            t.start()
        assert not _answers(squatter.port - 2)
        assert _answers(squatter.port)


def _distinct_free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def test_explicit_ports_for_every_process() -> None:
    """ports= and sentinel_ports= name every process's port; a restart on the same ports
    right after a stop works (the port check binds with SO_REUSEADDR, as redis-server
    does, so the sockets the stopped servers left in TIME_WAIT do not count as in use)."""
    ports = _distinct_free_ports(5)
    data, sentinels = ports[:2], ports[2:]
    for round_ in range(2):
        t = SentinelTopology(ports=data, sentinel_ports=sentinels)
        try:
            t.start()
            assert [s.port for s in t.servers] == data and t.data_ports == data
            assert [p for _, p in t.sentinel_addresses] == sentinels == t.sentinel_ports
            assert t.url == "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in sentinels) + "/mymaster/0"
            assert t.primary_address() == ("127.0.0.1", data[0])
            with redis.Redis(port=data[0]) as conn:
                conn.set("round", round_)
        finally:
            t.stop()
        assert not any(_answers(p) for p in ports)


def test_port_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="ports or base_port"):
        SentinelTopology(ports=[40001, 40002], base_port=40001)
    with pytest.raises(ValueError, match="give 3"):
        SentinelTopology(replicas=2, ports=[40001, 40002])
    with pytest.raises(ValueError, match="twice"):
        SentinelTopology(ports=[40001, 40001])
    with pytest.raises(ValueError, match="twice"):
        SentinelTopology(ports=[40001, 40002], sentinel_ports=[40002, 40003, 40004])
    with pytest.raises(ValueError, match="2 sentinel ports for 3 sentinels"):
        SentinelTopology(sentinels=3, sentinel_ports=[40003, 40004])
    with pytest.raises(ValueError, match="out of range"):
        SentinelTopology(ports=[70000])
    t = SentinelTopology(ports=[40001, 40002, 40003], sentinel_ports=[40010])
    assert len(t.replicas) == 2 and t.data_ports == [40001, 40002, 40003] and t.sentinel_ports == [40010]
    t = SentinelTopology(base_port=6400)
    assert t.data_ports == [6400, 6401] and t.sentinel_ports == [26400, 26401, 26402]
    t = SentinelTopology(base_port=6400, sentinel_ports=[36400])
    assert t.data_ports == [6400, 6401] and t.sentinel_ports == [36400]
    c = ClusterTopology(ports=range(41000, 41006))
    assert c.ports == list(range(41000, 41006)) and c.primaries_wanted == 3
    assert ClusterTopology(ports=range(41000, 41008), replicas_per_primary=1).primaries_wanted == 4
    with pytest.raises(ValueError, match="do not split"):
        ClusterTopology(ports=range(41000, 41007))
    with pytest.raises(ValueError, match="give 6"):
        ClusterTopology(primaries=3, ports=range(41000, 41004))
    assert ClusterTopology(base_port=7000).ports == list(range(7000, 7006))


@needs_cli
def test_cluster_on_explicit_ports_restarts_on_them_at_once() -> None:
    ports: list[int] = []
    while len(ports) < 6:
        port = free_port()
        bus = port + CLUSTER_BUS_PORT_OFFSET
        if bus < 65536 and port not in ports and bus not in ports and _port_is_free(bus):
            ports.append(port)
    for _ in range(2):
        t = ClusterTopology(ports=ports)
        try:
            t.start()
            assert t.ports == ports and len(t.primary_ports()) == 3
        finally:
            t.stop()
        assert not any(_answers(p) for p in ports)


@needs_cli
def test_cluster_forms_with_every_slot_covered(cluster_topology: ClusterTopology) -> None:
    t = cluster_topology
    assert t.url == "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in t.ports)
    primaries = t.primary_ports()
    assert len(primaries) == SETTINGS.cluster_primaries
    for port in primaries:
        assert len(t.replica_ports(port)) == SETTINGS.cluster_replicas_per_primary
    covered: set[int] = set()
    for start, end, *_ in redis.Redis(port=t.ports[0]).execute_command("CLUSTER", "SLOTS"):
        covered.update(range(start, end + 1))
    assert len(covered) == CLUSTER_SLOTS


@needs_cli
def test_cluster_hash_tags_spread_over_nodes(cluster_topology: ClusterTopology) -> None:
    t = cluster_topology
    client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in t.startup_nodes])
    owners: dict[int, str] = {}
    for i in range(200):
        tag = f"{{shard-{i}}}"
        node = client.get_node_from_key(f"{tag}:log")
        assert node is not None
        owners.setdefault(node.port, tag)
        client.set(f"{tag}:log", i)
        client.set(f"{tag}:state", i)  # same tag, same slot, same node
        assert client.get_node_from_key(f"{tag}:state") == node
        if len(owners) == len(t.primary_ports()):
            break
    assert set(owners) == set(t.primary_ports())
    for port, tag in owners.items():
        direct = redis.Redis(port=port)
        assert direct.exists(f"{tag}:log", f"{tag}:state") == 2
    client.close()


@needs_cli
def test_cluster_primary_crash_promotes_its_replica(cluster_topology: ClusterTopology) -> None:
    t = cluster_topology
    victim = t.primary_ports()[0]
    (replica,) = t.replica_ports(victim)
    client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in t.startup_nodes])
    # A key whose slot the victim owns.
    key = next(
        k for k in (f"{{k{i}}}" for i in range(1000))
        if client.get_node_from_key(k).port == victim  # type: ignore[union-attr]
    )
    client.set(key, "before")
    redis.Redis(port=victim).execute_command("WAIT", 1, 5000)
    client.close()

    started = time.monotonic()
    new_primary = t.failover(victim, hard=True, timeout=FAILOVER_BOUND_S)
    assert time.monotonic() - started < FAILOVER_BOUND_S
    assert new_primary == replica
    assert not t.alive(victim)
    assert replica in t.primary_ports()

    live = [ClusterNode("127.0.0.1", p) for p in t.ports if t.alive(p)]
    client = RedisCluster(startup_nodes=live)
    assert client.get(key) == b"before"
    client.set(key, "after")
    assert redis.Redis(port=replica).get(key) == b"after"
    client.close()


@needs_cli
def test_cluster_coordinated_failover(cluster_topology: ClusterTopology) -> None:
    t = cluster_topology
    primary = t.primary_ports()[1]
    (replica,) = t.replica_ports(primary)
    assert t.failover(primary, hard=False, timeout=FAILOVER_BOUND_S) == replica
    assert t.alive(primary)
    t.wait_ready()
    assert t.replica_ports(replica) == [primary]


def test_cli_prints_the_url_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "felix_redis.testing.topology", "sentinel"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.startswith("FELIX_REDIS_URL="):
                break
        url = lines[-1].removeprefix("FELIX_REDIS_URL=")
        assert url.startswith("redis+sentinel://127.0.0.1:") and url.endswith("/mymaster/0")
        ports = [int(hp.rsplit(":", 1)[1]) for hp in url.split("//")[1].split("/")[0].split(",")]
        ports += [int(line.rsplit(":", 1)[1].split("/")[0]) for line in lines[:2]]
        assert all(_answers(p) for p in ports)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not any(_answers(p) for p in ports)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


# ------------------------------------------------- the felix client over these URLs

felix_redis = pytest.importorskip("felix_redis")
T, N = "default", "default"


def _connect(url: str) -> object:
    connect = getattr(felix_redis, "connect", None)
    if connect is None:
        pytest.skip("felix_redis.connect is not there yet")
    return connect(url)


def test_felix_client_survives_a_sentinel_failover() -> None:
    """The user's situation: the client made before the crash, its URL unchanged, the
    dead primary left dead. With 2 replicas the sentinels promote one and point the
    other at it, so a quorum stream (replication 2) is written again without anyone
    restarting anything."""
    with SentinelTopology(replicas=2) as t:
        assert {s["down-after-milliseconds"] for s in t.sentinel_states()} == {
            str(SETTINGS.down_after_ms)}
        client: Any = _connect(t.url)
        try:
            client.stream_create(T, N, "orders", replication=2, consistency="quorum")
            client.group_create(T, N, "orders", "workers")
            sent = [client.publish(T, N, "orders", f"job-{i}".encode()).offset for i in range(5)]
            assert sent == [0, 1, 2, 3, 4]
            (first,) = client.group_poll(T, N, "orders", 0, "workers", max_records=1)
            client.group_ack(T, N, "orders", 0, "workers", first)

            old = t.kill_primary()
            t.wait_for_failover(timeout=FAILOVER_BOUND_S)
            assert t.previous_primary is old
            (other,) = [r for r in t.replicas if r is not old]
            # the other replica follows the new primary (the sentinels reconfigure it),
            # and every sentinel names it with the failover over
            t.wait_failover_settled(timeout=FAILOVER_BOUND_S)
            assert {(s["port"], s["flags"]) for s in t.sentinel_states()} == {(str(t.primary.port), "master")}
            info = redis.Redis(port=t.primary.port).info("replication")
            online = [v["port"] for k, v in info.items() if k.startswith("slave") and v["state"] == "online"]
            assert online == [other.port]
            t.wait_replicas_synced(timeout=REJOIN_BOUND_S)
            records = client.group_poll(T, N, "orders", 0, "workers", max_records=10)
            assert [r.payload for r in records] == [f"job-{i}".encode() for i in range(1, 5)]
            assert client.publish(T, N, "orders", b"job-5").offset == 5
            assert not _answers(old.port), "the dead primary came back"
            assert t.failovers() == 1, "the sentinels failed over a second time"
        finally:
            client.close()


@needs_cli
def test_felix_client_over_a_cluster_failover(cluster_topology: ClusterTopology) -> None:
    """The client made before the crash, on the URL that still names the dead node
    (first): it finds the promoted replica and every shard's record."""
    t = cluster_topology
    client: Any = _connect(t.url)
    try:
        shards = 6
        client.stream_create(T, N, "orders", shards=shards)
        client.group_create(T, N, "orders", "workers")
        for shard in range(shards):
            assert client.publish(T, N, "orders", f"s{shard}".encode(), shard=shard).offset == 0
        t.wait_replicas_synced()
        victim = t.primary_ports()[0]
        t.failover(victim, hard=True, timeout=FAILOVER_BOUND_S)
        assert not t.alive(victim)
        for shard in range(shards):
            (record,) = client.group_poll(T, N, "orders", shard, "workers", max_records=4)
            assert (record.shard, record.offset, record.payload) == (shard, 0, f"s{shard}".encode())
        assert client.publish(T, N, "orders", b"after", shard=0).offset == 1
    finally:
        client.close()
