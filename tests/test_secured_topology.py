"""Secured Sentinel and Cluster deployments on loopback: a password on every data
server and TLS on every process (sentinels and the cluster bus included).

* a felix client rides out a failover on the same client object (the dead node
  stays dead, the URL is the one it was made with);
* ``felixctl acl grant --apply`` puts a user on every node, replicas too, so a real
  ACL user keeps publishing and polling through the promoted node; a node it cannot
  reach is named and the exit status is 1.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import pytest
import redis
from click.testing import CliRunner
from redis.backoff import NoBackoff
from redis.retry import Retry

import felix_redis
from felix_redis.connection import parse_url
from felix_redis.testing.certs import have_openssl, make_topology_certs
from felix_redis.testing.server import redis_server_binary, tls_support
from felix_redis.testing.topology import ClusterTopology, SentinelTopology, TopologyTls
from felixctl.cli import cli

pytestmark = [
    pytest.mark.skipif(redis_server_binary() is None, reason="needs a redis-server binary"),
    pytest.mark.skipif(not have_openssl(), reason="needs the openssl CLI to make test certificates"),
]
needs_cli = pytest.mark.skipif(
    __import__("shutil").which("redis-cli") is None, reason="redis-cli forms the cluster"
)

T, N = "acme", "prod"
#: The default user's password on every data server: characters a URL must encode.
PW = "adm1n/p@ss:word"
#: The sentinels' own password, in the one test that gives them one.
SENTINEL_PW = "sen-pw-3"
#: The ACL user's password.
USER_PW = "app-pw-2"
#: A failover with down-after 2 s / node-timeout 1 s finishes well inside this.
FAILOVER_BOUND_S = 20.0
#: What a client may take, after the promotion, to publish, poll and ack again.
AFTER_PROMOTION_S = 10.0

R = TypeVar("R")


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TopologyTls:
    supported, why_not = tls_support()
    if not supported:
        pytest.skip(why_not)
    return TopologyTls.from_certs(make_topology_certs(tmp_path_factory.mktemp("certs")))


@pytest.fixture
def sentinel(tls: TopologyTls) -> Iterator[SentinelTopology]:
    topology = SentinelTopology(password=PW, tls=tls)
    try:
        topology.start()
        yield topology
    finally:
        topology.stop()


@pytest.fixture
def cluster(tls: TopologyTls) -> Iterator[ClusterTopology]:
    topology = ClusterTopology(password=PW, tls=tls)
    try:
        topology.start()
        yield topology
    finally:
        topology.stop()


def within(seconds: float, what: str, call: Callable[[], R]) -> R:
    """``call()`` in a daemon thread, failing the test if it takes longer than ``seconds``
    (a client stuck for good must not hang the suite)."""
    out: list[R] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True, name=f"within: {what}")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"{what} did not finish within {seconds:.0f} s")
    if errors:
        raise errors[0]
    return out[0]


def _publish_poll_ack(client: felix_redis.Client, stream: str, payload: bytes,
                      expect: list[bytes], group: str = "workers") -> None:
    """Publish ``payload``, poll until ``expect`` (in order) arrived, ack them all."""
    client.publish(T, N, stream, payload, shard=0)
    got: list[Any] = []
    deadline = time.monotonic() + AFTER_PROMOTION_S
    while len(got) < len(expect) and time.monotonic() < deadline:
        got += client.group_poll(T, N, stream, 0, group, max_records=10, wait=0.2)
    assert [r.payload for r in got] == expect
    for record in got:
        assert client.group_ack(T, N, stream, 0, group, record)


def _plain_ping(port: int) -> bytes:
    """What a plain-TCP PING to 127.0.0.1:port gets back (b'' when the server drops it)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64)
    except OSError:
        return b""


def _check_secured(t: SentinelTopology | ClusterTopology, tls: TopologyTls, ports: list[int]) -> None:
    """TLS only, a client certificate of the CA required, the password required."""
    with ThreadPoolExecutor(len(ports)) as pool:  # a TLS port keeps a plain client waiting
        assert not any(reply.startswith(b"+PONG") for reply in pool.map(_plain_ping, ports))
    port = ports[0]

    def ping(**options: Any) -> bool:
        # no redis-py retries: a refusal is final here
        with redis.Redis(port=port, socket_timeout=2, retry=Retry(NoBackoff(), 0), **options) as conn:
            return bool(conn.ping())

    with pytest.raises(redis.AuthenticationError):
        ping(**tls.client_kwargs())
    with pytest.raises(redis.AuthenticationError):
        ping(password="wrong", **tls.client_kwargs())
    with pytest.raises(redis.ConnectionError):
        ping(password=PW, ssl=True, ssl_ca_certs=tls.ca)  # no client certificate
    assert ping(password=PW, **tls.client_kwargs())


def test_secured_urls_without_starting(tls: TopologyTls) -> None:
    s = SentinelTopology(password=PW, tls=tls, sentinel_ports=[36001, 36002, 36003], ports=[36010, 36011])
    expected_query = f"ssl_ca_certs={tls.ca}&ssl_certfile={tls.client_cert}&ssl_keyfile={tls.client_key}"
    assert s.url == (f"rediss+sentinel://:{quote(PW, safe='')}@127.0.0.1:36001,127.0.0.1:36002,127.0.0.1:36003"
                     f"/mymaster/0?{expected_query}")
    parsed = parse_url(s.url)
    assert parsed.password == PW and parsed.tls and parsed.options["ssl_ca_certs"] == tls.ca
    s2 = SentinelTopology(password=PW, sentinel_password="sen-pw", ports=[36010, 36011])
    assert s2.url.startswith(f"redis+sentinel://:{quote(PW, safe='')}@127.0.0.1:")
    assert s2.url.endswith("/mymaster/0?sentinel_password=sen-pw")
    c = ClusterTopology(password=PW, tls=tls, ports=range(36100, 36106))
    assert c.url == (f"rediss+cluster://:{quote(PW, safe='')}@"
                     + ",".join(f"127.0.0.1:{p}" for p in range(36100, 36106)) + f"?{expected_query}")
    assert ClusterTopology(ports=range(36100, 36106)).url.startswith("redis+cluster://127.0.0.1:36100,")


def test_sentinel_with_password_and_tls_fails_over_on_the_same_client(
        sentinel: SentinelTopology, tls: TopologyTls) -> None:
    t = sentinel
    _check_secured(t, tls, [s.port for s in t.servers] + t.sentinel_ports)
    client = felix_redis.connect(t.url)
    try:
        client.stream_create(T, N, "orders")
        client.group_create(T, N, "orders", "workers")
        for i in range(3):
            client.publish(T, N, "orders", f"before-{i}".encode())
        (first,) = client.group_poll(T, N, "orders", 0, "workers", max_records=1)
        assert first.payload == b"before-0" and client.group_ack(T, N, "orders", 0, "workers", first)
        t.wait_replicas_synced()
        old = t.kill_primary()
        t.wait_for_failover(timeout=FAILOVER_BOUND_S)
        promoted = time.monotonic()
        assert t.primary.port != old.port
        within(AFTER_PROMOTION_S, "publish, poll and ack after the promotion", lambda: _publish_poll_ack(
            client, "orders", b"after", [b"before-1", b"before-2", b"after"]))
        assert time.monotonic() - promoted < AFTER_PROMOTION_S
        assert client.group_describe(T, N, "orders", "workers").lag == 0
        assert not old.process or old.process.poll() is not None  # the dead node stayed dead
    finally:
        client.close()


def _stream_on(t: ClusterTopology, client: felix_redis.Client, *, default_node: bool) -> tuple[str, int]:
    """A stream name whose shard 0 lives on the client's default node (or on another
    primary), and that primary's port."""
    default = client.redis.get_default_node().port
    for i in range(200):
        name = f"orders-{i}"
        key = client.core.name(T, N, name).shard_keys(0)[0]
        port = t.primary_port_for_key(key)
        if (port == default) == default_node:
            return name, port
    raise AssertionError("no stream name found on the wanted node")


@needs_cli
@pytest.mark.parametrize("victim", ["another primary", "the client's default node"])
def test_cluster_with_password_and_tls_fails_over_on_the_same_client(
        cluster: ClusterTopology, tls: TopologyTls, victim: str) -> None:
    """Kill the primary holding the stream's shard. When that primary is the node
    redis-py's RedisCluster picked as its default node, the client must not keep asking
    the dead node (redis-py routes FCALL by asking the default node COMMAND GETKEYS)."""
    t = cluster
    _check_secured(t, tls, t.ports)
    client = felix_redis.connect(t.url)
    try:
        stream, holder = _stream_on(t, client, default_node=victim != "another primary")
        client.stream_create(T, N, stream)
        client.group_create(T, N, stream, "workers")
        for i in range(3):
            client.publish(T, N, stream, f"before-{i}".encode())
        (first,) = client.group_poll(T, N, stream, 0, "workers", max_records=1)
        assert client.group_ack(T, N, stream, 0, "workers", first)
        t.wait_replicas_synced()
        (replica,) = t.replica_ports(holder)
        assert t.failover(holder, hard=True, timeout=FAILOVER_BOUND_S) == replica
        promoted = time.monotonic()
        within(AFTER_PROMOTION_S, "publish, poll and ack after the promotion", lambda: _publish_poll_ack(
            client, stream, b"after", [b"before-1", b"before-2", b"after"]))
        assert time.monotonic() - promoted < AFTER_PROMOTION_S
        assert t.primary_port_for_key(client.core.name(T, N, stream).shard_keys(0)[0]) == replica
        assert not t.alive(holder)
    finally:
        client.close()


# -- felixctl acl grant --apply on every node


def _grant(url: str, user: str, *extra: str) -> Any:
    return CliRunner().invoke(
        cli, ["--redis-url", url, "--tenant", T, "--namespace", N, "acl", "grant", user, *extra,
              "--apply", "--password-from-env", "FELIXTEST_USER_PW"],
        env={"FELIXTEST_USER_PW": USER_PW})


def _user_url(admin_url: str, user: str) -> str:
    return admin_url.replace(f":{quote(PW, safe='')}@", f"{user}:{quote(USER_PW, safe='')}@", 1)


def _applied(stderr: str) -> dict[str, str]:
    """``host:port -> role`` from the 'applied: ... on host:port (role)' lines."""
    out = {}
    for line in stderr.splitlines():
        if line.startswith("applied: "):
            address, role = line.rsplit(" on ", 1)[1].split(" ")
            out[address] = role.strip("()")
    return out


def _grant_roles(url: str, user: str, stream: str) -> dict[str, str]:
    """stream.publish and group.consume for ``user``; the nodes both runs reported."""
    reported = []
    for extra in (("--stream", stream, "--role", "stream.publish"),
                  ("--stream", stream, "--group", "workers", "--role", "group.consume")):
        result = _grant(url, user, *extra)
        assert result.exit_code == 0, (result.output, result.exception)
        assert USER_PW not in result.output and PW not in result.output and SENTINEL_PW not in result.output
        assert result.stdout.startswith(f"ACL SETUSER {user} >*** on ")
        reported.append(_applied(result.stderr))
    assert reported[0] == reported[1]
    return reported[0]


def _has_roles(t: SentinelTopology | ClusterTopology, port: int, user: str, stream: str) -> bool:
    with t.client(port, timeout=2.0) as conn:
        found = conn.acl_getuser(user)
    if not found:
        return False
    keys = " ".join(str(k) for k in found["keys"])
    selectors = str(found.get("selectors"))
    return (f"felixcap:{{{T}/{N}/{stream}/*}}:publish" in keys + selectors
            and f"felixcap:{{{T}/{N}/{stream}/*}}:g:workers:consume" in keys + selectors)


@pytest.fixture
def sentinel_with_own_password(tls: TopologyTls) -> Iterator[SentinelTopology]:
    """The sentinels require a password of their own (``requirepass`` on each; they use
    it with each other too): the URL carries it as ``sentinel_password``."""
    topology = SentinelTopology(password=PW, sentinel_password=SENTINEL_PW, tls=tls)
    try:
        topology.start()
        yield topology
    finally:
        topology.stop()


def test_acl_grant_applies_on_every_sentinel_node_and_survives_a_failover(
        sentinel_with_own_password: SentinelTopology, tls: TopologyTls) -> None:
    t = sentinel_with_own_password
    assert f"sentinel_password={SENTINEL_PW}" in t.url
    for port in t.sentinel_ports:
        with redis.Redis(port=port, socket_timeout=2, retry=Retry(NoBackoff(), 0), **tls.client_kwargs()) as anon, \
                pytest.raises(redis.AuthenticationError):
            anon.sentinel_masters()
    user = f"app{os.getpid()}"
    admin = felix_redis.connect(t.url)
    member: felix_redis.Client | None = None
    try:
        admin.stream_create(T, N, "jobs")
        admin.group_create(T, N, "jobs", "workers")  # the default user loads the library
        reported = _grant_roles(t.url, user, "jobs")
        assert reported == {f"127.0.0.1:{t.primary.port}": "primary",
                            **{f"127.0.0.1:{r.port}": "replica" for r in t.replicas}}
        for server in t.servers:
            assert _has_roles(t, server.port, user, "jobs"), server.port

        member = m = felix_redis.connect(_user_url(t.url, user))
        _publish_poll_ack(m, "jobs", b"one", [b"one"])
        with pytest.raises(felix_redis.PermissionDenied):
            m.group_redrive(T, N, "jobs", 0, "workers")  # a consumer, not a manager
        t.wait_replicas_synced()
        old = t.kill_primary()
        t.wait_for_failover(timeout=FAILOVER_BOUND_S)
        within(AFTER_PROMOTION_S, "the ACL user's publish, poll and ack on the promoted node",
               lambda: _publish_poll_ack(m, "jobs", b"two", [b"two"]))

        # the dead node is named, the others still get the rules, exit status 1
        again = _grant(t.url, user, "--stream", "jobs", "--role", "stream.publish")
        assert again.exit_code == 1, again.output
        assert _applied(again.stderr) == {f"127.0.0.1:{t.primary.port}": "primary"}
        assert f"not applied on 127.0.0.1:{old.port} (replica): " in again.stderr
        last = again.stderr.strip().splitlines()[-1]
        assert last.startswith("felixctl: error: ACL SETUSER") and f"127.0.0.1:{old.port} (replica)" in last
        assert PW not in again.output and USER_PW not in again.output and SENTINEL_PW not in again.output
    finally:
        if member is not None:
            member.close()
        admin.close()


@needs_cli
def test_acl_grant_applies_on_every_cluster_node_and_survives_a_failover(
        cluster: ClusterTopology, tls: TopologyTls) -> None:
    t = cluster
    user = f"app{os.getpid()}"
    admin = felix_redis.connect(t.url)
    member: felix_redis.Client | None = None
    try:
        reported = _grant_roles(t.url, user, "jobs")
        roles = {f"127.0.0.1:{row['port']}": row["role"] for row in t.cluster_nodes()}
        assert reported == roles and sorted(roles.values()) == ["primary"] * 3 + ["replica"] * 3
        for port in t.ports:
            assert _has_roles(t, port, user, "jobs"), port

        member = m = felix_redis.connect(_user_url(t.url, user))
        # The victim is not the member client's default node: that case (redis-py's FCALL
        # routing through the default node) is the failover test's; here the rules are.
        stream, holder = _stream_on(t, m, default_node=False)
        _grant_roles(t.url, user, stream)
        admin.stream_create(T, N, stream)
        admin.group_create(T, N, stream, "workers")
        _publish_poll_ack(m, stream, b"one", [b"one"])
        t.wait_replicas_synced()
        (replica,) = t.replica_ports(holder)
        assert t.failover(holder, hard=True, timeout=FAILOVER_BOUND_S) == replica
        assert _has_roles(t, replica, user, stream)
        within(AFTER_PROMOTION_S, "the ACL user's publish, poll and ack on the promoted node",
               lambda: _publish_poll_ack(m, stream, b"two", [b"two"]))

        again = _grant(t.url, user, "--stream", stream, "--role", "stream.publish")
        assert again.exit_code == 1, again.output
        applied = _applied(again.stderr)
        assert set(applied) == {f"127.0.0.1:{p}" for p in t.ports if p != holder}
        assert applied[f"127.0.0.1:{replica}"] == "primary"
        assert f"not applied on 127.0.0.1:{holder} (primary): " in again.stderr
        assert again.stderr.strip().splitlines()[-1].startswith("felixctl: error: ACL SETUSER")
    finally:
        if member is not None:
            member.close()
        admin.close()


def test_launcher_cli_with_tls_password_and_explicit_ports(tls: TopologyTls, tmp_path: Path) -> None:
    """``sentinel --tls --certs-dir DIR --password-from-env VAR --ports ... --sentinel-ports
    ...``: every process on the ports named, the printed URL holds no password, and a
    client with $FELIX_REDIS_PASSWORD set connects through it."""
    import subprocess
    import sys

    from felix_redis.testing.server import free_port

    ports = sorted({free_port() for _ in range(5)})[:5]
    data, sentinels = ports[:2], ports[2:]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FELIXTEST_TOPO_PW": PW}
    proc = subprocess.Popen(
        [sys.executable, "-m", "felix_redis.testing.topology", "sentinel", "--tls", "--certs-dir", str(tmp_path),
         "--password-from-env", "FELIXTEST_TOPO_PW", "--ports", ",".join(map(str, data)),
         "--sentinel-ports", ",".join(map(str, sentinels))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            if line.startswith("FELIX_REDIS_URL="):
                break
        assert lines and lines[-1].startswith("FELIX_REDIS_URL="), (lines, proc.poll())
        url = lines[-1].removeprefix("FELIX_REDIS_URL=")
        hosts = ",".join(f"127.0.0.1:{p}" for p in sentinels)
        assert url == (f"rediss+sentinel://{hosts}/mymaster/0?ssl_ca_certs={tmp_path}/ca.crt"
                       f"&ssl_certfile={tmp_path}/client.crt&ssl_keyfile={tmp_path}/client.key")
        assert PW not in "\n".join(lines) and quote(PW, safe="") not in "\n".join(lines)
        assert f"primary   rediss://127.0.0.1:{data[0]}/0" in lines
        assert f"replica   rediss://127.0.0.1:{data[1]}/0" in lines
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FELIX_REDIS_PASSWORD", PW)
            with felix_redis.connect(url) as client:
                client.stream_create(T, N, "cli")
                assert client.publish(T, N, "cli", b"x").offset == 0
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        context.load_cert_chain(str(tmp_path / "client.crt"), str(tmp_path / "client.key"))
        for port in ports:  # TLS only, on every port named
            with socket.create_connection(("127.0.0.1", port), timeout=2) as raw, \
                    context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                sock.sendall(b"PING\r\n")
                assert sock.recv(64)[:1] in (b"+", b"-")
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        for port in ports:
            with socket.socket() as probe:
                assert probe.connect_ex(("127.0.0.1", port)) != 0
        assert (tmp_path / "ca.crt").exists()  # --certs-dir is kept
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
