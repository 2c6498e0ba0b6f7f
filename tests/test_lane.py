"""The lane (felix_redis/lane.py): script calls on one connection a client keeps out of
redis-py's pool. What the pool's checks guarded against must still hold: no reply is
ever read by the wrong call, a connection the server closed is replaced without
writing twice, threads, tasks and forked children each get right answers."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import threading
import time
from typing import Any

import pytest
import redis

import felix_redis
import felix_redis.asyncio as aio
from felix_redis import lane as lane_module

T, N, S = "acme", "prod", "jobs"


def lane_conn(client: Any) -> Any:
    assert client._lane is not None
    return client._lane.conn


def lane_client_id(client: Any) -> int:
    conn = lane_conn(client)
    conn.send_command("CLIENT", "ID")
    return int(conn.read_response())


def test_script_calls_ride_the_lane(redis_client: felix_redis.Client, raw: redis.Redis) -> None:
    redis_client.stream_create(T, N, S)
    redis_client.publish(T, N, S, b"a")
    conn = lane_conn(redis_client)
    assert conn is not None
    before = conn._sock
    for i in range(1, 20):
        assert redis_client.publish(T, N, S, b"x").offset == i
    # every call went over the same socket, and the pool lent nothing else for them
    assert lane_conn(redis_client)._sock is before
    pool = redis_client.redis.connection_pool
    assert conn in pool._in_use_connections


def test_error_reply_keeps_the_connection(redis_client: felix_redis.Client) -> None:
    redis_client.stream_create(T, N, S)
    redis_client.publish(T, N, S, b"a")
    sock = lane_conn(redis_client)._sock
    with pytest.raises(felix_redis.NotFound):
        redis_client.publish(T, N, "missing", b"x")
    with pytest.raises(felix_redis.InvalidArgument):
        redis_client.group_poll(T, N, S, 0, "nope", max_records=0)
    assert redis_client.publish(T, N, S, b"b").offset == 1
    assert lane_conn(redis_client)._sock is sock


@pytest.mark.usefixtures("first_lead_zero")
def test_a_batch_rides_the_lane_in_one_write_with_error_replies_in_place(
    redis_client: felix_redis.Client, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sharded poll's calls go out on the lane in one write (no redis-py pipeline),
    each reply in its place, an error reply as a value that does not spoil the others
    nor the connection."""
    redis_client.stream_create(T, N, S, shards=4)
    redis_client.group_create(T, N, S, "workers")
    for shard in range(4):
        redis_client.publish(T, N, S, f"r{shard}", shard=shard)
    group = redis_client.group_sharded(T, N, S, "workers")
    group.poll(1)  # the caches and the lane's connection
    sock = lane_conn(redis_client)._sock
    writes: list[bytes] = []
    real_sendall = sock.sendall

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(sock, name)

        def sendall(self, data: bytes) -> None:
            writes.append(data)
            real_sendall(data)

    conn = lane_conn(redis_client)
    monkeypatch.setattr(conn, "_sock", Spy())
    monkeypatch.setattr(redis.client.Pipeline, "execute", lambda *a, **k: pytest.fail("a redis-py pipeline ran"))
    items = group.poll(3)
    assert sorted(i.payload for i in items) == [b"r1", b"r2", b"r3"]
    # the lead (0) runs dry, so does the next (1) after its one: the rest (2 and 3) are
    # asked for a quota each in one write of two calls
    assert [w.count(b"group_poll") for w in writes] == [1, 1, 2]
    monkeypatch.setattr(conn, "_sock", sock)
    replies = redis_client._lane.call_many([("SET", "k", "v"), ("INCR", "k"), ("GET", "k")])
    assert replies is not None and replies[0] == b"OK" and replies[2] == b"v"
    assert isinstance(replies[1], redis.ResponseError) and "not an integer" in str(replies[1])
    assert lane_conn(redis_client)._sock is sock


def test_call_interrupted_between_send_and_read_leaves_no_stale_reply(
    redis_client: felix_redis.Client, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call stopped after sending (here by KeyboardInterrupt where redis-py cannot see
    it) leaves its reply unread; the next call must not take it for its own."""
    redis_client.stream_create(T, N, S)
    assert redis_client.publish(T, N, S, b"0").offset == 0
    real = lane_module._send_read

    def send_then_interrupt(conn: Any, args: Any) -> Any:
        conn.send_command(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(lane_module, "_send_read", send_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        redis_client.publish(T, N, S, b"1")
    monkeypatch.setattr(lane_module, "_send_read", real)
    # the interrupted publish did land (offset 1); the next one is offset 2, not the
    # unread reply "1" of the call before
    assert redis_client.publish(T, N, S, b"2").offset == 2
    assert redis_client.publish(T, N, S, b"3").offset == 3
    assert raw.xlen(f"felix:{{{T}/{N}/{S}/0}}:log") == 4


def test_connection_closed_by_the_server_is_replaced_without_a_second_write(
    raw: redis.Redis, redis_url: str
) -> None:
    """CLIENT KILL of the lane's connection while it sits idle: the next publish (plain:
    felix-redis never repeats it, and a client from a URL has no redis-py retries) goes
    out on a new connection and is written exactly once."""
    client = felix_redis.connect(redis_url, idempotent_publish=False)
    try:
        client.stream_create(T, N, S)
        assert client.publish(T, N, S, b"0").offset == 0
        raw.client_kill_filter(_id=lane_client_id(client))
        assert client.publish(T, N, S, b"1").offset == 1
        assert client.publish(T, N, S, b"2").offset == 2
        assert raw.xlen(f"felix:{{{T}/{N}/{S}/0}}:log") == 3
    finally:
        client.close()


def test_threads_sharing_a_client_each_get_their_own_replies(redis_client: felix_redis.Client) -> None:
    """Several threads publish and poll through one client: one of them at a time has
    the lane, the others go through the pool; every reply belongs to its call."""
    redis_client.stream_create(T, N, S)
    redis_client.group_create(T, N, S, "g")
    offsets: list[list[int]] = [[] for _ in range(6)]
    polled: list[int] = []
    errors: list[BaseException] = []

    def publisher(i: int) -> None:
        try:
            for _ in range(150):
                offsets[i].append(redis_client.publish(T, N, S, f"{i}".encode()).offset)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=publisher, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while any(t.is_alive() for t in threads) or len(polled) < 900:
        assert time.monotonic() < deadline, "the publishers or the polls hung"
        records = redis_client.group_poll(T, N, S, 0, "g", max_records=50)
        redis_client.group_ack_many(T, N, S, 0, "g", records)
        polled.extend(r.offset for r in records)
        if not records and not any(t.is_alive() for t in threads):
            break
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert not errors
    everything = sorted(o for mine in offsets for o in mine)
    assert everything == list(range(900))
    for mine in offsets:
        assert mine == sorted(mine)  # each thread's publishes in its own order
    assert sorted(polled) == list(range(900))


def _child_publishes(parent_conn: int, client: felix_redis.Client, out: Any) -> None:
    try:
        got = [client.publish(T, N, S, b"child").offset for _ in range(10)]
        # the child borrowed a connection of its own, not the copy of the parent's
        out.put(("ok", got) if id(lane_conn(client)) != parent_conn else ("error", "parent's connection"))
    except BaseException as exc:  # pragma: no cover - reported to the parent
        out.put(("error", repr(exc)))


def test_forked_child_uses_its_own_connection(redis_client: felix_redis.Client, redis_url: str) -> None:
    redis_client.stream_create(T, N, S)
    assert redis_client.publish(T, N, S, b"parent").offset == 0
    sock = lane_conn(redis_client)._sock
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_publishes, args=(id(lane_conn(redis_client)), redis_client, out))
    child.start()
    try:
        status, got = out.get(timeout=30)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join(10)
    assert status == "ok", got
    assert got == list(range(1, 11))
    # the parent's lane is untouched: same socket, right answers
    assert redis_client.publish(T, N, S, b"parent").offset == 11
    assert lane_conn(redis_client)._sock is sock


def test_dropped_client_gives_its_lane_connection_back(raw: redis.Redis, redis_url: str) -> None:
    wrapped = redis.Redis.from_url(redis_url)
    try:
        client = felix_redis.Client(wrapped)
        client.stream_create(T, N, S)
        client.publish(T, N, S, b"x")
        assert len(wrapped.connection_pool._in_use_connections) == 1
        del client
        gc.collect()
        assert len(wrapped.connection_pool._in_use_connections) == 0
    finally:
        wrapped.close()


def test_close_gives_the_lane_connection_back(redis_url: str, raw: redis.Redis) -> None:
    wrapped = redis.Redis.from_url(redis_url)
    client = felix_redis.Client(wrapped)
    client.stream_create(T, N, S)
    client.publish(T, N, S, b"x")
    client.close()
    assert len(wrapped.connection_pool._in_use_connections) == 0
    # usable again after close, as redis-py clients are
    assert client.publish(T, N, S, b"y").offset == 1
    client.close()


def test_no_lane_where_it_does_not_suit(redis_url: str) -> None:
    assert felix_redis.connect("memory://lane-test")._lane is None
    single = redis.Redis.from_url(redis_url, single_connection_client=True)
    small = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(redis_url, max_connections=2))
    try:
        assert felix_redis.Client(single)._lane is None
        assert felix_redis.Client(small)._lane is None
        assert felix_redis.Client(redis.Redis.from_url(redis_url))._lane is not None
    finally:
        single.close()
        small.close()


def test_async_tasks_sharing_a_client_each_get_their_own_replies(raw: redis.Redis, redis_url: str) -> None:
    async def main() -> list[int]:
        client = aio.connect(redis_url)
        try:
            await client.stream_create(T, N, S)
            assert client._lane is not None

            async def publish_some(i: int) -> list[int]:
                return [(await client.publish(T, N, S, f"{i}".encode())).offset for _ in range(50)]

            results = await asyncio.gather(*(publish_some(i) for i in range(8)))
            return sorted(o for r in results for o in r)
        finally:
            await client.close()

    assert asyncio.run(main()) == list(range(400))


@pytest.mark.usefixtures("first_lead_zero")
def test_an_async_batch_rides_the_lane_in_one_write_with_error_replies_in_place(
    raw: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        client = aio.connect(redis_url)
        try:
            await client.stream_create(T, N, S, shards=4)
            await client.group_create(T, N, S, "workers")
            for shard in range(4):
                await client.publish(T, N, S, f"r{shard}", shard=shard)
            group = client.group_sharded(T, N, S, "workers")
            await group.poll(1)  # the caches and the lane's connection
            conn = client._lane.conn
            writes: list[int] = []  # per write of the lane, the group_polls it holds
            real_write = lane_module._async_write

            async def spy(conn: Any, packed: Any) -> None:
                chunks = [packed] if isinstance(packed, bytes) else list(packed)
                writes.append(sum(bytes(c).count(b"group_poll") for c in chunks))
                await real_write(conn, packed)

            monkeypatch.setattr(lane_module, "_async_write", spy)
            monkeypatch.setattr(redis.asyncio.client.Pipeline, "execute",
                                lambda *a, **k: pytest.fail("a redis-py pipeline ran"))
            items = await group.poll(3)
            assert sorted(i.payload for i in items) == [b"r1", b"r2", b"r3"]
            # the lead, the next shard, then the rest's quotas in one write (older redis-py
            # may write other commands on the connection too: those carry no group_poll)
            assert [w for w in writes if w] == [1, 1, 2]
            replies = await client._lane.call_many([("SET", "k", "v"), ("INCR", "k"), ("GET", "k")])
            assert replies[0] in (b"OK", True) and replies[2] == b"v"
            assert isinstance(replies[1], redis.ResponseError) and "not an integer" in str(replies[1])
            assert client._lane.conn is conn
        finally:
            await client.close()

    asyncio.run(main())


def test_async_call_cancelled_between_send_and_read_leaves_no_stale_reply(
    raw: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = lane_module._async_send_read

    async def send_then_cancel(conn: Any, args: Any) -> Any:
        await conn.send_command(*args)
        raise asyncio.CancelledError

    async def main() -> None:
        client = aio.connect(redis_url)
        try:
            await client.stream_create(T, N, S)
            assert (await client.publish(T, N, S, b"0")).offset == 0
            monkeypatch.setattr(lane_module, "_async_send_read", send_then_cancel)
            with pytest.raises(asyncio.CancelledError):
                await client.publish(T, N, S, b"1")
            monkeypatch.setattr(lane_module, "_async_send_read", real)
            assert (await client.publish(T, N, S, b"2")).offset == 2
            assert (await client.publish(T, N, S, b"3")).offset == 3
        finally:
            await client.close()

    asyncio.run(main())
    assert raw.xlen(f"felix:{{{T}/{N}/{S}/0}}:log") == 4


def test_async_connection_closed_by_the_server_is_replaced(raw: redis.Redis, redis_url: str) -> None:
    """CLIENT KILL of the asyncio lane's connection: the next plain publish goes out on a
    new connection and is written once."""

    async def main() -> None:
        client = aio.connect(redis_url, idempotent_publish=False)
        try:
            await client.stream_create(T, N, S)
            assert (await client.publish(T, N, S, b"0")).offset == 0
            conn = client._lane.conn
            await conn.send_command("CLIENT", "ID")
            raw.client_kill_filter(_id=int(await conn.read_response()))
            # the event loop learns of the closed socket when it next runs (redis-py's
            # own pool misses it even then and fails the call)
            await asyncio.sleep(0.2)
            assert (await client.publish(T, N, S, b"1")).offset == 1
        finally:
            await client.close()

    asyncio.run(main())
    assert raw.xlen(f"felix:{{{T}/{N}/{S}/0}}:log") == 2


def test_async_lane_keeps_its_connection_from_call_to_call(raw: redis.Redis, redis_url: str) -> None:
    """The asyncio lane checks its idle connection for unread bytes before a call and
    keeps it when there are none: the server sees no new connection however many calls
    run, and the same client id answers before and after them (under redis-py 7.4, whose
    asyncio connection has ``can_read_destructive`` but no ``can_read``, the check raised
    and the lane reconnected before every call)."""

    async def lane_id(client: Any) -> int:
        conn = client._lane.conn
        await conn.send_command("CLIENT", "ID")
        return int(await conn.read_response())

    async def main() -> tuple[int, int, int, int]:
        client = aio.connect(redis_url, idempotent_publish=False)
        try:
            await client.stream_create(T, N, S)
            await client.publish(T, N, S, b"first")
            first = await lane_id(client)
            before = int(raw.info("stats")["total_connections_received"])
            for _ in range(5):
                await client.publish(T, N, S, b"x")
            after = int(raw.info("stats")["total_connections_received"])
            return before, after, first, await lane_id(client)
        finally:
            await client.close()

    before, after, first, last = asyncio.run(main())
    assert after == before, f"{after - before} new connections for 5 calls"
    assert first == last


def test_async_lane_writes_to_the_transport_but_keeps_redis_pys_write_where_it_must(
    raw: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An asyncio lane call on redis-py's own connection writes its command to the
    stream at once (no ``send_packed_command``: its ``asyncio.wait_for`` runs the write
    as a task of its own); a connection with health checks, or whose transport still
    holds unsent bytes, goes through ``send_packed_command``; every call is answered
    right and written once; a batch too."""

    async def main() -> None:
        client = aio.connect(redis_url)
        try:
            await client.stream_create(T, N, S)
            assert (await client.publish(T, N, S, b"a")).offset == 0
            conn = client._lane.conn
            layered: list[int] = []
            real = conn.send_packed_command

            async def counted(command: Any, *args: Any, **kwargs: Any) -> Any:
                chunks = [command] if isinstance(command, (bytes, str)) else list(command)
                if any(b"FCALL" in bytes(c) or b"EVALSHA" in bytes(c) for c in chunks if isinstance(c, bytes)):
                    layered.append(1)  # (not a handshake of a reconnect)
                return await real(command, *args, **kwargs)

            monkeypatch.setattr(conn, "send_packed_command", counted)
            assert [(await client.publish(T, N, S, b"x")).offset for _ in range(3)] == [1, 2, 3]
            with pytest.raises(felix_redis.NotFound):  # an error reply, after a direct write
                await client.publish(T, N, "missing", b"x")
            group = client.group_sharded(T, N, S, "g")
            await client.group_create(T, N, S, "g")
            items = await group.poll(4)
            assert len(items) == 4 and await group.ack_many(items) == 4
            assert layered == []
            monkeypatch.setattr(conn, "health_check_interval", 30)
            assert (await client.publish(T, N, S, b"y")).offset == 4
            assert layered  # (its health check's PING may be written the same way)
            monkeypatch.setattr(conn, "health_check_interval", 0)
            layered.clear()
            transport = conn._writer.transport
            # bytes still queued (patched on the class: it holds for a transport made by a reconnect too)
            monkeypatch.setattr(type(transport), "get_write_buffer_size", lambda self: 1)
            assert (await client.publish(T, N, S, b"z")).offset == 5
            assert layered == [1]
        finally:
            await client.close()

    asyncio.run(main())
    assert raw.xlen(f"felix:{{{T}/{N}/{S}/0}}:log") == 6


def test_async_lane_write_failure_drops_the_connection_and_the_call_fails_as_redis_pys(
    raw: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transport refuses the write: the connection is dropped and the call raises
    redis-py's ConnectionError (the client's own retry of the idempotent publish goes
    out on a new connection, once)."""

    async def main() -> None:
        client = aio.connect(redis_url)
        try:
            await client.stream_create(T, N, S)
            assert (await client.publish(T, N, S, b"a")).offset == 0
            failures = [RuntimeError("injected")]
            real = asyncio.StreamWriter.write

            def flaky(writer: asyncio.StreamWriter, data: Any) -> None:
                if failures:
                    raise failures.pop()
                real(writer, data)

            # (patched on the class: it holds for a stream made by a reconnect too)
            monkeypatch.setattr(asyncio.StreamWriter, "write", flaky)
            assert (await client.publish(T, N, S, b"b")).offset == 1
            assert failures == []
        finally:
            await client.close()

    asyncio.run(main())
    assert raw.xlen(f"felix:{{{T}/{N}/{S}/0}}:log") == 2


def test_lane_write_failure_on_a_unix_socket_raises_a_connection_error(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unix-socket connection has no host or port: a failed read (sync) or write
    (asyncio) still becomes redis-py's ConnectionError (which the client retries; the
    publish is idempotent: written once)."""
    from felix_redis.testing.server import RedisServer

    sock = tmp_path / "redis.sock"
    with RedisServer(extra=["--unixsocket", str(sock), "--unixsocketperm", "700"]):
        url = f"unix://{sock}"
        client = felix_redis.connect(url)
        try:
            client.stream_create(T, N, S)
            assert client.publish(T, N, S, b"a").offset == 0
            parser = lane_conn(client)._parser
            failures = [OSError("injected")]  # what a socket raises
            real = parser.read_response

            def flaky(*args: Any, **kwargs: Any) -> Any:
                if failures:
                    raise failures.pop()
                return real(*args, **kwargs)

            monkeypatch.setattr(parser, "read_response", flaky)
            assert client.publish(T, N, S, b"b").offset == 1  # the retry, on a new connection
            assert failures == []
        finally:
            client.close()

        async def main() -> None:
            aclient = aio.connect(url)
            try:
                assert (await aclient.publish(T, N, S, b"c")).offset == 2
                failures = [RuntimeError("injected")]
                real_write = asyncio.StreamWriter.write

                def flaky_write(writer: asyncio.StreamWriter, data: Any) -> None:
                    if failures:
                        raise failures.pop()
                    real_write(writer, data)

                monkeypatch.setattr(asyncio.StreamWriter, "write", flaky_write)
                assert (await aclient.publish(T, N, S, b"d")).offset == 3
                assert failures == []
            finally:
                await aclient.close()

        asyncio.run(main())
        raw = redis.Redis(unix_socket_path=str(sock))
        assert raw.xlen(f"felix:{{{T}/{N}/{S}/0}}:log") == 4
        raw.close()


def test_dropped_async_clients_hold_none_of_a_shared_pool(raw: redis.Redis, redis_url: str) -> None:
    """Async clients made and dropped without close() on one shared pool of 5: the
    lane's connection is its own, never one of the pool's, so none is lost."""
    import redis.asyncio as aioredis

    async def main() -> None:
        shared = aioredis.Redis(connection_pool=aioredis.ConnectionPool.from_url(redis_url, max_connections=5))
        try:
            for i in range(8):
                client = aio.Client(shared)
                await client.stream_create(T, N, f"s{i}")
                await client.publish(T, N, f"s{i}", b"x")
                assert client._lane is not None and client._lane.conn is not None
                await client._lane.conn.disconnect()  # what garbage collection does
                del client
                gc.collect()
            assert len(shared.connection_pool._in_use_connections) == 0
        finally:
            await shared.aclose()

    asyncio.run(main())


def test_async_close_waits_for_the_call_on_the_lane(
    raw: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() while a call is on the lane: the call gets its own reply, and the
    connection is closed after it, never handed to anyone else meanwhile."""
    real = lane_module._async_send_read
    sent = asyncio.Event()

    async def slow(conn: Any, args: Any) -> Any:
        await conn.send_command(*args)
        sent.set()
        await asyncio.sleep(0.3)
        return await conn.read_response()

    async def main() -> None:
        # plain publishes: felix-redis would not repeat one whose connection was lost
        client = aio.connect(redis_url, idempotent_publish=False)
        await client.stream_create(T, N, S)
        assert (await client.publish(T, N, S, b"0")).offset == 0
        conn = client._lane.conn
        monkeypatch.setattr(lane_module, "_async_send_read", slow)
        publishing = asyncio.ensure_future(client.publish(T, N, S, b"1"))
        await sent.wait()
        await client.close()
        assert (await publishing).offset == 1
        monkeypatch.setattr(lane_module, "_async_send_read", real)
        assert not conn.is_connected
        assert client._lane.conn is None

    asyncio.run(main())
    assert raw.xlen(f"felix:{{{T}/{N}/{S}/0}}:log") == 2


def test_no_lane_for_resp3_clients(redis_url: str) -> None:
    resp3 = redis.Redis.from_url(redis_url, protocol=3)
    try:
        assert felix_redis.Client(resp3)._lane is None
    finally:
        resp3.close()


def test_connection_to_a_replaced_primary_is_dropped_before_the_next_call(redis_client: felix_redis.Client) -> None:
    """A Sentinel pool that has learned of a new primary (its master_address): the
    lane's connection to another address is closed before anything is sent on it (a
    new one then asks the sentinels). A plain pool stands in for the Sentinel pool."""
    redis_client.stream_create(T, N, S)
    redis_client.publish(T, N, S, b"0")
    lane = redis_client._lane
    conn = lane_conn(redis_client)
    sock = conn._sock
    lane.pool.master_address = (conn.host, conn.port)  # the primary it is on: kept
    try:
        assert redis_client.publish(T, N, S, b"1").offset == 1
        assert conn._sock is sock
        lane.pool.master_address = ("127.0.0.2", conn.port)  # a new primary elsewhere
        with lane.lock:
            assert lane._connection() is conn
        assert conn._sock is None  # closed, not used
    finally:
        del lane.pool.master_address
    assert redis_client.publish(T, N, S, b"2").offset == 2


def test_async_lane_packs_commands_as_redis_py_does() -> None:
    """The asyncio lane packs with hiredis where redis.asyncio packs in Python: the
    same bytes for every kind of argument felix-redis sends; another text encoding,
    or a value hiredis refuses, is left to redis-py."""
    from redis.asyncio.connection import Connection

    conn = Connection()
    args = ("FCALL", "felix_x_publish", 3, "felix:{t/n/s/0}:meta", "k", "ключ", "", 0, 2**53, -5, 1.5,
            b"\x00\xff payload")
    packed = lane_module._pack(conn, args)
    assert isinstance(packed, bytes)
    assert packed == b"".join(conn.pack_command(*args))
    latin = Connection(encoding="latin-1")
    assert lane_module._pack(latin, ("SET", "k", "é")) == latin.pack_command("SET", "k", "é")
    with pytest.raises(redis.DataError):
        lane_module._pack(conn, ("SET", "k", None))


def test_async_publish_keeps_a_non_ascii_key(raw: redis.Redis, redis_url: str) -> None:
    async def main() -> None:
        client = aio.connect(redis_url)
        try:
            await client.stream_create(T, N, S)
            await client.publish(T, N, S, "paiement reçu ✓", key="clé-ключ")
        finally:
            await client.close()

    asyncio.run(main())
    reader = felix_redis.connect(redis_url)
    try:
        (record,) = reader.read(T, N, S, 0, 0)
        assert record.key == "clé-ключ" and record.payload == "paiement reçu ✓".encode()
    finally:
        reader.close()


def test_sync_lane_packs_commands_as_redis_py_does() -> None:
    """The synchronous lane packs with hiredis itself, to the bytes redis-py sends; another
    text encoding, or a value hiredis refuses, is left to redis-py (None)."""
    from redis.connection import Connection

    conn = Connection()
    args = ("FCALL", "felix_x_publish", 3, "felix:{t/n/s/0}:meta", "k", "ключ", "", 0, 2**53, -5, 1.5,
            b"\x00\xff payload")
    assert lane_module._hiredis_packed(conn, args) == b"".join(conn.pack_command(*args))
    assert lane_module._hiredis_packed(conn, list(args)) == b"".join(conn.pack_command(*args))
    assert lane_module._hiredis_packed(Connection(encoding="latin-1"), ("SET", "k", "é")) is None
    assert lane_module._hiredis_packed(conn, ("SET", "k", None)) is None


def test_lane_calls_skip_redis_py_layers_but_not_its_checks(
    redis_client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Script calls on a plain connection are written to its socket and read by its
    parser; a connection with health checks goes through send_command/read_response."""
    redis_client.stream_create(T, N, S)
    redis_client.publish(T, N, S, b"a")
    conn = lane_conn(redis_client)
    layered: list[str] = []
    real_send, real_read = conn.send_command, conn.read_response

    def send(*args: Any, **kwargs: Any) -> Any:
        layered.append("send")
        return real_send(*args, **kwargs)

    def read(*args: Any, **kwargs: Any) -> Any:
        layered.append("read")
        return real_read(*args, **kwargs)

    monkeypatch.setattr(conn, "send_command", send)
    monkeypatch.setattr(conn, "read_response", read)
    assert [redis_client.publish(T, N, S, b"x").offset for _ in range(3)] == [1, 2, 3]
    assert layered == []
    with pytest.raises(felix_redis.NotFound):  # an error reply, read on the fast path
        redis_client.publish(T, N, "missing", b"x")
    assert layered == []
    monkeypatch.setattr(conn, "health_check_interval", 30)
    assert redis_client.publish(T, N, S, b"y").offset == 4
    assert "send" in layered and "read" in layered


def test_lane_failure_mid_call_drops_the_connection_and_the_retry_writes_once(
    redis_client: felix_redis.Client, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timeout while the fast path reads a reply: the connection is dropped (its reply
    may still come) and the call fails as redis-py's would; the client's own retry of
    the (idempotent) publish lands on a new connection, once."""
    redis_client.stream_create(T, N, S)
    assert redis_client.publish(T, N, S, b"a").offset == 0
    conn = lane_conn(redis_client)
    first_id = lane_client_id(redis_client)
    parser = conn._parser
    real = parser.read_response
    failures = [TimeoutError("injected")]  # what a socket raises

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return real(*args, **kwargs)

    monkeypatch.setattr(parser, "read_response", flaky)
    assert redis_client.publish(T, N, S, b"b").offset == 1
    assert failures == []
    assert lane_client_id(redis_client) != first_id
    assert raw.xlen(f"felix:{{{T}/{N}/{S}/0}}:log") == 2


def test_connection_classes_with_their_own_layers_keep_them(raw: redis.Redis, redis_url: str) -> None:
    """Only redis-py's own connection classes take the direct path: a class overriding
    send or read, or a connection with another command packer, keeps redis-py's path,
    overrides run. Sentinel's connection is one of redis-py's own: its one override (a
    READONLY reply drops the connection) is made by the lane itself."""
    from redis.connection import Connection, SSLConnection
    from redis.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection

    assert lane_module._stock_connection(Connection())
    assert lane_module._stock_connection(SSLConnection())
    assert lane_module._stock_connection(SentinelManagedConnection(connection_pool=None))
    assert lane_module._stock_connection(SentinelManagedSSLConnection(connection_pool=None))

    class CustomPacker:
        def pack(self, *args: Any) -> list[bytes]:
            return Connection().pack_command(*args)

    assert not lane_module._stock_connection(Connection(command_packer=CustomPacker()))

    reads: list[int] = []

    class Counting(Connection):
        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            reads.append(1)
            return super().read_response(*args, **kwargs)

    pool = redis.ConnectionPool.from_url(redis_url, connection_class=Counting)
    client = felix_redis.Client(redis.Redis(connection_pool=pool))
    try:
        client.stream_create(T, N, S)
        assert client._lane is not None
        before = len(reads)
        assert [client.publish(T, N, S, b"x").offset for _ in range(3)] == [0, 1, 2]
        assert len(reads) >= before + 3
    finally:
        client.close()
        pool.disconnect()
