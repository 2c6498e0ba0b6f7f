"""A connection kept out of redis-py's pool for the script calls of a client.

Every ``execute_command`` borrows a connection from the pool and gives it back: the pool
takes its lock, checks the process id, asks the socket whether unread data is waiting (a
system call) and records metrics, both ways: on a loopback Redis, a good part of a
script call's round trip (docs/benchmarks.md, ``bench/roundtrip.py``). A client's
script calls (``FCALL`` / ``EVALSHA``: publish, poll, ack and the rest; never a blocking
read) go instead through one connection the client borrowed once and keeps: the *lane*. It is used by one call at
a time; a call that finds it in use (another thread's, or another task's) borrows a
connection from the pool for that one call (:func:`pool_call`), so nothing ever waits
for the lane. On Redis Cluster, where there is no lane, a call borrows a connection of
the node serving its slot the same way, and a batch one of each node for the calls
that node serves, sent there as one pipeline (:func:`pool_call_many`).

What the pool's checks guarded against is handled here:

- a reply left unread (a call interrupted between sending and reading, by an exception
  or a cancelled task): redis-py disconnects on any exception while sending or
  reading, and the lane marks a reply as awaited from sending to reading
  (``awaiting_reply``), so a call that never finished leaves the mark and the next
  one reconnects first;
- a connection the server closed (``timeout`` in redis.conf, ``CLIENT KILL``, a
  restart): before each call the lane asks the socket, as the pool does at each
  checkout, whether anything is waiting on it (a closed socket reads as such) and
  reconnects if so; a call is never sent on a connection known to be dead;
- a fork: a child process never uses its parent's lane connection, it borrows its own;
- lost connections: one attempt, never redis-py's own ``retry`` (which would send a
  call that is not safe to repeat a second time after its reply was lost). A call that
  could not get a connection at all raises :class:`NotSent`, so the client knows it may
  send it again whatever it does; any other failure drops the connection and raises
  redis-py's ``ConnectionError``/``TimeoutError``, and the client decides
  (``felix_redis.protocol.Retrying``).
- Sentinel: a connection connects through its class's own ``connect()``, which asks the
  sentinels for the primary (``send_command`` would dial the address it had before, a
  dead primary's after a failover); a connection still on a primary that the sentinels
  have since replaced (the pool learned the new address) is dropped before the next
  call, as the pool drops its idle ones; a READONLY reply (the primary was demoted)
  drops the connection too, as Sentinel's connection class does, but stays a READONLY
  error: the call did not run.

Not used for Redis Cluster (every call goes to its slot's node), ``memory://``
(fakeredis), single-connection clients, RESP3 clients (``protocol=3``: their pushes are
redis-py's to handle), client-side caching, nor pools of fewer than 4 connections (each
client's lane holds one of them, so several clients on one small pool would take them
all).

A call on the lane is packed by hiredis and written to the connection's socket, and its
reply read by the connection's own parser (:func:`_send_read`): the layers redis-py puts
around them (its packer's argument checks, the health-check and error-wrapping calls)
are skipped (docs/benchmarks.md says what that saves). Their effects are kept: a
connection with health checks, another parser or another text encoding takes redis-py's
own path, and a failure drops the connection and raises the error redis-py would. The
asyncio lane writes the packed command to the connection's stream itself
(:func:`_async_write`): redis-py's ``send_packed_command`` would run the write as a
task of its own (``asyncio.wait_for``), two more turns of the event loop per call.

The synchronous lane borrows its connection from the pool (and gives it back on
``close()`` or when the client is garbage-collected). The asyncio lane makes a
connection of its own with the pool's settings, outside the pool's count: a dropped
asyncio client cannot give a connection back without an event loop, so it never holds
one of the pool's; ``close()`` closes it, after the call using it, if any, is done.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Any

from redis.asyncio.sentinel import SentinelManagedConnection as _AsyncSentinelConnection
from redis.exceptions import AuthenticationError, ReadOnlyError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import SentinelManagedConnection as _SentinelConnection

_HiredisParser: Any
_STOCK: Any
try:
    from redis._parsers import _HiredisParser
    from redis.connection import AbstractConnection as _STOCK
    from redis.connection import HiredisRespSerializer, PythonRespSerializer

    _STOCK_PACKERS: tuple[type, ...] = (HiredisRespSerializer, PythonRespSerializer)
except ImportError:  # pragma: no cover - another redis-py layout: the plain path only
    _HiredisParser = _STOCK = None
    _STOCK_PACKERS = ()
_ASYNC_STOCK: Any
try:
    from redis.asyncio.connection import AbstractConnection as _ASYNC_STOCK
except ImportError:  # pragma: no cover - another redis-py layout: redis-py's write only
    _ASYNC_STOCK = None

#: What redis-py does around a command that the lane's direct path would skip: a
#: connection class overriding any of these (Sentinel's turns a read-only replica's
#: error into a reconnect) keeps redis-py's path.
_LAYERS = ("send_command", "send_packed_command", "read_response")
_stock_classes: dict[type, bool] = {}
_async_stock_classes: dict[type, bool] = {}


def _stock_connection(conn: Any) -> bool:
    """``conn`` is redis-py's own connection class (or one that overrides none of
    :data:`_LAYERS`, but for Sentinel's ``read_response``, whose one addition, a
    reconnect after READONLY, :func:`_send_read` makes too) with redis-py's own command
    packer."""
    cls = type(conn)
    stock = _stock_classes.get(cls)
    if stock is None:
        stock = _STOCK is not None and all(
            getattr(cls, m, None) is getattr(_STOCK, m)
            or (m == "read_response" and getattr(cls, m, None) is _SentinelConnection.read_response)
            for m in _LAYERS
        )
        _stock_classes[cls] = stock
    return stock and type(getattr(conn, "_command_packer", None)) in _STOCK_PACKERS

_hiredis_pack: Any
try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - hiredis is a dependency, but optional for redis-py
    _hiredis_pack = None

__all__ = [
    "AsyncLane", "Lane", "NotSent", "async_borrow", "async_ensure_connected", "async_node_call", "async_pool_call",
    "async_pool_call_many",
    "borrow", "ensure_connected", "lane_pool", "pool_call", "read_reply",
]


class NotSent(RedisConnectionError):
    """No connection could be made for a call, so it was never sent (``cause``: what the
    connect raised). The drivers may send such a call again whatever it does."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def lane_pool(raw: Any) -> Any:
    """The connection pool a lane may borrow from, or None when the client is not one
    a lane suits (see the module's docstring)."""
    if hasattr(raw, "get_node_from_key") or type(raw).__module__.split(".", 1)[0] == "fakeredis":
        return None
    if getattr(raw, "connection", None) is not None or getattr(raw, "single_connection_client", False):
        return None
    pool = getattr(raw, "connection_pool", None)
    if pool is None or type(pool).__module__.split(".", 1)[0] != "redis":
        return None
    if int(getattr(pool, "max_connections", None) or 2**31) < 4:
        return None
    # RESP3 connections carry pushes (client-side caching invalidations, maintenance
    # notifications) that redis-py handles on its own terms; the lane would take a
    # waiting push for a dead connection
    kwargs = getattr(pool, "connection_kwargs", {})
    if str(kwargs.get("protocol") or 2) == "3" or getattr(pool, "cache", None) is not None:
        return None
    return pool


class Lane:
    """The lane of a synchronous client. A caller takes :attr:`lock` without waiting
    (``lock.acquire(False)``) and, when it got it, calls :meth:`call`; otherwise it uses
    ``execute_command``."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.lock = threading.Lock()
        _lanes.add(self)
        self.awaiting_reply = False
        # [connection, pid of the process that borrowed it]: also what the finalizer
        # gives back when the lane is dropped unclosed (it must not hold the lane itself)
        self._held: list[Any] = [None, 0]
        self._finalizer = weakref.finalize(self, _give_back, pool, self._held)

    @property
    def conn(self) -> Any:
        """The connection borrowed, or None."""
        return self._held[0]

    def call(self, args: tuple[Any, ...] | list[Any]) -> Any:
        """Sends ``args`` on the lane and returns the reply; an error reply raises, as
        from ``execute_command``. The caller holds :attr:`lock`.

        One attempt: a lost connection raises (:class:`NotSent` when the call never
        left) and the client decides whether the call may be sent again; redis-py's
        own retry would send a call that is not safe to repeat a second time."""
        conn = self._connection()
        self.awaiting_reply = True
        try:
            reply = _send_read(conn, args)
        except (ResponseError, NotSent):
            self.awaiting_reply = False  # the whole error reply was read, or nothing was sent
            raise
        else:
            self.awaiting_reply = False
        finally:
            if conn.should_reconnect():
                conn.disconnect()
        return reply

    def call_many(self, commands: list[tuple[Any, ...]]) -> list[Any] | None:
        """Sends ``commands`` on the lane in one write and reads their replies, in
        order: a pipeline without redis-py's pipeline object. An error reply is returned
        in its place (as ``execute(raise_on_error=False)`` does); a lost connection
        raises (:class:`NotSent` when nothing left). None, with nothing sent, where
        hiredis cannot pack them (the caller uses a redis-py pipeline). The caller
        holds :attr:`lock`."""
        conn = self._connection()
        ensure_connected(conn)
        sock, parser = conn._sock, conn._parser
        if (sock is None or type(parser) is not _HiredisParser or conn.health_check_interval
                or not _stock_connection(conn)):
            return None
        packed = []
        for command in commands:
            one = _hiredis_packed(conn, command)
            if one is None:
                return None
            packed.append(one)
        self.awaiting_reply = True
        try:
            sock.sendall(b"".join(packed))
            replies = [parser.read_response() for _ in commands]
        except BaseException as exc:
            raise _io_failure(conn, exc) from None
        finally:
            self.awaiting_reply = False
        if any(isinstance(reply, ReadOnlyError) for reply in replies):
            conn.disconnect()  # a replica now: the next call connects anew
        return replies

    def _connection(self) -> Any:
        conn = self.conn
        if conn is None or self._held[1] != os.getpid():
            # first use, or a forked child: borrow a connection of this process (the
            # parent's stays the parent's); none to be had: NotSent
            conn = borrow(self.pool)
            self._held[:] = [conn, os.getpid()]
            if not self._finalizer.alive:  # used again after close()
                self._finalizer = weakref.finalize(self, _give_back, self.pool, self._held)
            self.awaiting_reply = False
        elif self.awaiting_reply or _stale_primary(self.pool, conn):
            conn.disconnect()  # the last call never read its reply, or a failover
            self.awaiting_reply = False
        elif conn._sock is not None:
            try:
                if conn.can_read():
                    conn.disconnect()
            except Exception:  # as the pool does: any doubt, reconnect
                conn.disconnect()
        return conn

    def close(self) -> None:
        """Gives the connection back to the pool."""
        with self.lock:
            self._finalizer()


_lanes: weakref.WeakSet[Lane] = weakref.WeakSet()


def _new_locks_in_child() -> None:
    """A forked child gets new lane locks: a thread of the parent (a handler, the acks'
    flusher) may have held one at the fork, and would never release it here."""
    for lane in list(_lanes):
        lane.lock = threading.Lock()


os.register_at_fork(after_in_child=_new_locks_in_child)


def _give_back(pool: Any, held: list[Any]) -> None:
    conn, pid = held
    held[:] = [None, 0]
    if conn is not None and pid == os.getpid():
        with contextlib.suppress(Exception):  # the pool may be closed already
            pool.release(conn)


def _send_read(conn: Any, args: tuple[Any, ...] | list[Any]) -> Any:
    """Sends ``args`` on ``conn`` and reads the reply, as ``send_command`` and
    ``read_response`` do. For the usual connection (redis-py's own connection class and
    command packer, RESP2, its hiredis parser, no health checks, UTF-8 text) the command
    is packed by hiredis and written to the socket, and the reply read by the
    connection's parser, without the layers around them (``bench/roundtrip.py`` measures
    what that saves); failures are told and handled as those layers do: the connection
    is dropped and a redis-py ``ConnectionError`` or ``TimeoutError`` raised, for its
    retries."""
    ensure_connected(conn)
    sock, parser = conn._sock, conn._parser
    packed = None
    if (sock is not None and type(parser) is _HiredisParser and not conn.health_check_interval
            and _stock_connection(conn)):
        packed = _hiredis_packed(conn, args)
    if packed is None:
        conn.send_command(*args)
        return _read(conn)
    try:
        sock.sendall(packed)
        reply = parser.read_response()
    except BaseException as exc:
        raise _io_failure(conn, exc) from None
    if isinstance(reply, ResponseError):
        if isinstance(reply, ReadOnlyError):
            conn.disconnect()  # a replica now: the next call connects anew (Sentinel: to the new primary)
        try:
            raise reply
        finally:
            del reply  # no reference cycle through the traceback
    return reply


def _io_failure(conn: Any, exc: BaseException) -> BaseException:
    """What a failure of writing a command or reading its reply raises: the connection
    is dropped (a reply, if any, was not read), and a socket timeout or error becomes
    redis-py's TimeoutError or ConnectionError, as its own layers raise them, for its
    retries; anything else (an interrupt) is raised as it is."""
    conn.disconnect()
    if isinstance(exc, TimeoutError):  # (socket.timeout)
        return RedisTimeoutError(f"Timeout on the connection to {_address(conn)}")
    if isinstance(exc, OSError):
        return RedisConnectionError(f"Error on the connection to {_address(conn)}: {exc}")
    return exc


def _address(conn: Any) -> str:
    """Where ``conn`` goes, for an error's message: host:port, or a unix socket's path."""
    host = getattr(conn, "host", None)
    return f"{host}:{getattr(conn, 'port', '')}" if host is not None else str(getattr(conn, "path", "?"))


def ensure_connected(conn: Any) -> None:
    """Connects ``conn`` if it has no socket, through its class's own ``connect()`` (a
    Sentinel-managed connection asks the sentinels for the primary there;
    ``send_command`` would dial the address it had before, a dead primary's after a
    failover). A failure raises :class:`NotSent`; wrong credentials raise as they are."""
    if conn._sock is not None:
        return
    try:
        conn.connect()
    except AuthenticationError:
        raise
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise NotSent(exc) from None


def read_reply(conn: Any) -> Any:
    """``conn.read_response()``, but a Sentinel-managed connection's reply is read through
    the plain connection class: Sentinel's turns a READONLY reply (its primary was
    demoted) into a ConnectionError, which would hide that the call did not run. The
    caller drops the connection after a READONLY reply, as Sentinel's would. For a
    redis.asyncio connection it returns the coroutine to await."""
    if isinstance(conn, _SentinelConnection):
        return super(_SentinelConnection, conn).read_response()
    if isinstance(conn, _AsyncSentinelConnection):
        return super(_AsyncSentinelConnection, conn).read_response()
    return conn.read_response()


def _read(conn: Any) -> Any:
    try:
        return read_reply(conn)
    except ReadOnlyError:
        conn.disconnect()  # see read_reply
        raise


def pool_call(pool: Any, args: tuple[Any, ...] | list[Any]) -> Any:
    """``args`` on a connection borrowed from ``pool`` for this one call, as a lane call
    is made: one attempt, :class:`NotSent` when no connection could be had."""
    conn = borrow(pool)
    try:
        return _send_read(conn, args)
    except (ResponseError, NotSent):
        raise
    except BaseException:
        conn.disconnect()  # a reply may still be on its way: never reuse the connection
        raise
    finally:
        pool.release(conn)


def pool_call_many(pool: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """``commands`` in one write on a connection borrowed from ``pool`` (on Redis
    Cluster, a node's), their replies read in order, an error reply in its place: a
    pipeline, with no transaction and none of redis-py's retries (a pipeline sent again
    after its replies were lost would run calls that are not safe to repeat twice). One
    attempt, as :func:`pool_call`: :class:`NotSent` when no connection could be had, else
    a lost connection is dropped and raises."""
    conn = borrow(pool)
    try:
        ensure_connected(conn)
        conn.send_packed_command(conn.pack_commands(commands))
        replies = [_reply_or_error(conn) for _ in commands]
        if any(isinstance(reply, ReadOnlyError) for reply in replies):
            conn.disconnect()  # a replica now: the next call connects anew
        return replies
    except NotSent:
        raise
    except BaseException:
        conn.disconnect()  # replies may still be on their way: never reuse the connection
        raise
    finally:
        pool.release(conn)


def _reply_or_error(conn: Any) -> Any:
    """One reply from ``conn``; an error reply is returned, not raised."""
    try:
        return read_reply(conn)
    except ResponseError as exc:
        return exc


def borrow(pool: Any) -> Any:
    """A connection of ``pool``, connected to the current primary: one left open to a
    primary the sentinels have since replaced is dropped first (the pool hands out such
    idle connections as they are). No connection to be had raises :class:`NotSent`."""
    try:
        conn = pool.get_connection()
    except AuthenticationError:
        raise
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise NotSent(exc) from None
    if _stale_primary(pool, conn):
        conn.disconnect()  # _send_read connects it again, through the sentinels
    return conn


def _hiredis_packed(conn: Any, args: tuple[Any, ...] | list[Any]) -> bytes | None:
    """The command as hiredis packs it, or None where redis-py must pack it (another
    text encoding, a value hiredis refuses); redis-py's own hiredis packer gives the same
    bytes (tests/test_lane.py)."""
    encoder = conn.encoder
    if _hiredis_pack is None or encoder.encoding != "utf-8" or encoder.encoding_errors != "strict":
        return None
    if isinstance(args[0], str) and " " in args[0]:
        return None  # "FUNCTION LOAD": redis-py's packer splits the name into its words
    try:
        packed: bytes = _hiredis_pack(args if type(args) is tuple else tuple(args))
        return packed
    except TypeError:
        return None


class AsyncLane:
    """The lane of an asyncio client: tasks of one event loop, so a flag is the lock. A
    caller that finds :attr:`in_use` false sets it, awaits :meth:`call` and clears it
    (what :attr:`Lane.lock` is to the synchronous lane)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.conn: Any = None
        self.awaiting_reply = False
        self.in_use = False

    async def call(self, args: tuple[Any, ...] | list[Any]) -> Any:
        conn = await self._connection()
        self.awaiting_reply = True
        try:
            reply = await _async_send_read(conn, args)  # one attempt, as Lane.call
        except (ResponseError, NotSent):
            self.awaiting_reply = False
            raise
        else:
            self.awaiting_reply = False
        finally:
            if self.conn is not conn:
                await conn.disconnect()  # the client was closed while this call ran
            elif conn.should_reconnect():
                await conn.disconnect()
        return reply

    async def call_many(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """As :meth:`Lane.call_many`: ``commands`` in one write, their replies in
        order, an error reply in its place. The caller holds the lane (:attr:`in_use`)."""
        conn = await self._connection()
        await async_ensure_connected(conn)
        chunks: list[Any] = []
        for command in commands:
            packed = _pack(conn, command)
            if isinstance(packed, list):
                chunks.extend(packed)
            else:
                chunks.append(packed)
        self.awaiting_reply = True
        try:
            await _async_write(conn, chunks)
            replies = await _async_replies(conn, len(commands))
            self.awaiting_reply = False  # (else the next call drops the connection first)
        finally:
            if self.conn is not conn or conn.should_reconnect():
                await conn.disconnect()  # the client was closed while this ran, or a failure
        if any(isinstance(reply, ReadOnlyError) for reply in replies):
            await conn.disconnect()  # a replica now: the next call connects anew
        return replies

    async def _connection(self) -> Any:
        conn = self.conn
        if conn is None:
            # a connection of the lane's own (see the module's docstring)
            conn = self.conn = self.pool.make_connection()
            self.awaiting_reply = False
        elif self.awaiting_reply or _stale_primary(self.pool, conn):
            await conn.disconnect()  # the last call never read its reply (cancelled), or a failover
            self.awaiting_reply = False
        elif conn.is_connected:
            try:
                if await _async_can_read(conn):
                    await conn.disconnect()
            except Exception:  # as the pool does: any doubt, reconnect
                await conn.disconnect()
        return conn

    async def close(self) -> None:
        """Closes the lane's connection; one a call is using is closed when it is done."""
        conn, self.conn = self.conn, None
        if conn is not None and not self.in_use:
            with contextlib.suppress(Exception):
                await conn.disconnect()


async def _async_can_read(conn: Any) -> bool:
    """Whether a redis.asyncio connection between calls holds unread bytes (or is
    closed): ``can_read`` since redis-py 8, ``can_read_destructive`` before (7.4, our
    floor, has only that one; asking for the missing ``can_read`` raised, and the lane
    took that for doubt and reconnected before every call)."""
    check = getattr(conn, "can_read", None)
    if check is None:
        check = conn.can_read_destructive
    return bool(await check())


def _async_writer(conn: Any) -> Any:
    """The stream writer an asyncio lane call writes to itself, or None where redis-py's
    ``send_packed_command`` must: a connection class that overrides how commands are
    sent, health checks, no stream yet, or a transport that is closing or still holds
    unsent bytes (redis-py waits for those: its drain, under its write timeout)."""
    cls = type(conn)
    stock = _async_stock_classes.get(cls)
    if stock is None:
        stock = _ASYNC_STOCK is not None and all(getattr(cls, m, None) is getattr(_ASYNC_STOCK, m)
                                                for m in ("send_command", "send_packed_command"))
        _async_stock_classes[cls] = stock
    writer = getattr(conn, "_writer", None) if stock and not conn.health_check_interval else None
    if writer is None:
        return None
    transport = writer.transport
    try:
        if transport.is_closing() or transport.get_write_buffer_size():
            return None
    except Exception:  # a transport without these: redis-py's path
        return None
    return writer


async def _async_write(conn: Any, packed: bytes | list[bytes]) -> None:
    """Writes a packed command (or several) on a connected redis.asyncio ``conn``. On
    redis-py's own connection with an empty write buffer the bytes go to the transport
    at once: it sends them (or keeps what the socket does not take yet, and sends that
    as soon as it can), so there is nothing to wait for. redis-py's
    ``send_packed_command`` runs its write in ``asyncio.wait_for`` under the socket
    timeout, which makes it a task of its own: two more turns of the event loop per
    call (docs/benchmarks.md). A write that never reaches the server shows as the
    reply's read timing out (the same socket timeout), a lost connection as the read's
    ConnectionError, as on redis-py's path."""
    writer = _async_writer(conn)
    if writer is None:
        await conn.send_packed_command(packed)
        return
    try:
        if isinstance(packed, bytes):
            writer.write(packed)
        else:
            writer.writelines(packed)
    except Exception as exc:
        await conn.disconnect(nowait=True)
        raise RedisConnectionError(f"Error while writing to the connection to {_address(conn)}: {exc}") from None


def _stale_primary(pool: Any, conn: Any) -> bool:
    """A Sentinel pool that has learned of a new primary, and a connection to another."""
    address = getattr(pool, "master_address", None)
    return address is not None and conn.host is not None and (conn.host, conn.port) != tuple(address)


async def async_ensure_connected(conn: Any) -> None:
    """As :func:`ensure_connected`, for a redis.asyncio connection."""
    if conn.is_connected:
        return
    try:
        await conn.connect()  # the class's own connect (Sentinel asks for the primary)
    except AuthenticationError:
        raise
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise NotSent(exc) from None


async def _async_send_read(conn: Any, args: tuple[Any, ...] | list[Any]) -> Any:
    """As :func:`_send_read`, on a redis.asyncio connection."""
    await async_ensure_connected(conn)
    await _async_write(conn, _pack(conn, args))
    try:
        return await read_reply(conn)
    except ReadOnlyError:
        await conn.disconnect()
        raise


async def async_borrow(pool: Any) -> Any:
    """As :func:`borrow`, from a redis.asyncio pool (whose ``release`` keeps a connection
    to a replaced primary as it is)."""
    try:
        conn = await pool.get_connection()
    except AuthenticationError:
        raise
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise NotSent(exc) from None
    if _stale_primary(pool, conn):
        await conn.disconnect()
    return conn


async def async_pool_call(pool: Any, args: tuple[Any, ...] | list[Any]) -> Any:
    """As :func:`pool_call`, on a redis.asyncio connection pool."""
    conn = await async_borrow(pool)
    try:
        return await _async_call(conn, args)
    finally:
        await pool.release(conn)


async def async_node_call(node: Any, args: tuple[Any, ...] | list[Any]) -> Any:
    """As :func:`pool_call`, on a connection of a redis.asyncio Redis Cluster node."""
    try:
        conn = node.acquire_connection()
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise NotSent(exc) from None
    try:
        return await _async_call(conn, args)
    finally:
        node.release(conn)


async def async_pool_call_many(pool: Any, commands: list[Any]) -> list[Any]:
    """As :func:`pool_call_many`, on a redis.asyncio connection pool."""
    conn = await async_borrow(pool)
    try:
        return await _async_call_many(conn, commands)
    finally:
        await pool.release(conn)


async def async_node_call_many(node: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """As :func:`pool_call_many`, on a connection of a redis.asyncio Redis Cluster node."""
    try:
        conn = node.acquire_connection()
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise NotSent(exc) from None
    try:
        return await _async_call_many(conn, commands)
    finally:
        node.release(conn)


async def _async_call_many(conn: Any, commands: list[Any]) -> list[Any]:
    """``commands`` in one write on a borrowed redis.asyncio ``conn``, their replies (an
    error reply in its place); a connection left mid-reply is dropped, never reused."""
    try:
        await async_ensure_connected(conn)
        await _async_write(conn, conn.pack_commands(commands))
        replies = await _async_replies(conn, len(commands))
        if any(isinstance(reply, ReadOnlyError) for reply in replies):
            await conn.disconnect()  # a replica now: the next call connects anew
        return replies
    except NotSent:
        raise
    except BaseException:
        await conn.disconnect()  # replies may still be on their way (or a cancelled task)
        raise


async def _async_call(conn: Any, args: tuple[Any, ...] | list[Any]) -> Any:
    """One call on a borrowed connection; one left mid-reply is dropped, never reused."""
    try:
        return await _async_send_read(conn, args)
    except (ResponseError, NotSent):
        raise
    except BaseException:
        await conn.disconnect()
        raise


def _pack(conn: Any, args: tuple[Any, ...] | list[Any]) -> Any:
    """The command in RESP for the asyncio lane. redis.asyncio packs in Python, where
    the synchronous client uses hiredis: the lane uses hiredis too where
    :func:`_hiredis_packed` can; anything else is left to redis-py (and its error)."""
    packed = _hiredis_packed(conn, args)
    return packed if packed is not None else conn.pack_command(*args)


async def _async_replies(conn: Any, count: int) -> list[Any]:
    """``count`` replies from a redis.asyncio ``conn``, an error reply in its place."""
    replies: list[Any] = []
    for _ in range(count):
        try:
            replies.append(await read_reply(conn))
        except ResponseError as exc:
            replies.append(exc)
    return replies
