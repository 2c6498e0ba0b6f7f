"""What the two drivers (:mod:`felix_redis.client`, sync, and :mod:`felix_redis.asyncio`)
share and neither owns: redis-py errors as FelixErrors, what a raw client must be, the
longest block a connection allows, a Batch run as one pipeline, and the items and
routing of a sharded group. Nothing here does I/O: each driver runs these on its own
connections, with or without ``await``."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

from redis.exceptions import (
    AskError,
    AuthenticationError,
    BusyLoadingError,
    ClusterError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)

from felix_redis import scripts
from felix_redis.checks import check_int, check_streams, seconds_to_ms
from felix_redis.connection import NotTlsError, SentinelsFailed
from felix_redis.constants import ENV_PASSWORD, ENV_URL_FILE, MAX_BATCH, MAX_DELAY_MS, MAX_RECORDS_PER_POLL
from felix_redis.errors import (
    ConnectionFailed,
    FelixError,
    InvalidArgument,
    NotReplicated,
    PermissionDenied,
    from_response,
)
from felix_redis.lane import NotSent
from felix_redis.models import Record, StreamInfo, parse_claim
from felix_redis.plans import Took
from felix_redis.protocol import TRANSIENT_ERRORS, Batch, BlockAny, Cmd, Core, Eval, Op, Plan, check_list, retry_delays
from felix_redis.sharded import PollState

log = logging.getLogger("felix_redis")

#: Tries, 0.2 s apart, of sending a group's queued acks while the connection is lost;
#: then they are dropped (their records are delivered again after their leases).
FLUSH_TRIES = 50

#: redis-py exceptions that mean "this node cannot take the call now": a failover,
#: a cluster re-sharding or a restart (LOADING) is under way. The call did not run, so
#: the driver sends it again whatever it does (ConnectionFailed with ``unsent``).
UNAVAILABLE = (ClusterError, RedisClusterException, TryAgainError, AskError, ReadOnlyError, BusyLoadingError)


def took(op: BlockAny, replies: list[Any]) -> Any:
    """A driver's answer to ``op`` (a block with a ``then`` call) from the two replies of
    the write that sent both: :class:`Took`; the block's answer alone when the call
    failed (a missing library, a failover's refusal: the plan sends it again, as it
    would without ``then``). A block refused (no XREAD for this user) raises, as without
    ``then``; but when the poll behind it ran anyway and handed records out, they are
    answered (nothing moved) so that they reach the caller: the next block raises."""
    moved, reply = replies
    if isinstance(moved, Exception):
        if isinstance(reply, list) and len(reply) > 4 and int(reply[4]) > 0:
            return Took(None, reply)
        raise moved
    if isinstance(reply, Exception) or op.then is None:
        return moved
    return Took(moved, reply)


def translate(exc: Exception, op: Op, server: str) -> Exception:
    """A FelixError for a redis-py exception raised while running ``op``."""
    context = getattr(op, "context", "")
    prefix = f"{context}: " if context else ""
    if isinstance(exc, UNAVAILABLE) or (isinstance(exc, ResponseError) and str(exc).startswith(TRANSIENT_ERRORS)):
        # A failover, re-sharding or restart under way; the call did not run (redis-py
        # strips some error codes from the message, so these are also told apart by type)
        return ConnectionFailed(f"{prefix}Redis at {server} cannot take the call now: {type(exc).__name__}: {exc}",
                                unsent=True)
    if isinstance(exc, ResponseError):
        if str(exc).startswith("DB index is out of range"):
            # SELECT while connecting: the URL names a database the server does not have
            return InvalidArgument(
                f"{prefix}Redis at {server} has no such database ({exc}): the URL's database number "
                "(redis://host:port/DB, redis+sentinel://.../SERVICE/DB) must be below the server's "
                "`databases` setting (16 by default)")
        mapped = from_response(str(exc))
        if mapped is None:
            return FelixError(f"{prefix}Redis error: {exc}")
        return type(mapped)(f"{prefix}{mapped}")
    if isinstance(exc, AuthenticationError):
        # a missing or wrong user name or password: no retry will fix it
        return PermissionDenied(credentials_refused(exc, server))
    if isinstance(exc, NotSent):
        return ConnectionFailed(f"cannot reach Redis at {server}: {_short(exc.cause, server)}", unsent=True)
    # no connection was made (no sentinel named a primary, a port that does not take TLS):
    # the call was not sent
    unsent = isinstance(exc, (SentinelsFailed, NotTlsError))
    sentinels = exc if isinstance(exc, SentinelsFailed) else exc.__cause__
    final = isinstance(sentinels, SentinelsFailed) and sentinels.hopeless
    return ConnectionFailed(f"cannot reach Redis at {server}: {_short(exc, server)}", unsent=unsent or final,
                            final=final)


#: How servers say no password was sent (redis-py drops the NOAUTH code): to a command,
#: and to the HELLO redis-py opens a connection with.
_NO_PASSWORD_SENT = ("Authentication required", "NOAUTH", "HELLO must be called with the client already authenticated")


def credentials_refused(exc: BaseException, server: str) -> str:
    """What a server's refusal of the credentials means, and where they are given (the
    names of the places, never a value; the fix first: felixctl shows 300 characters)."""
    gist = _short(exc, server).split(", otherwise the HELLO AUTH", 1)[0]
    if gist.startswith(_NO_PASSWORD_SENT):
        return (f"Redis at {server} refused the credentials: none were given, and it needs a password: give it "
                f"in the URL (:PASSWORD@ or USER:PASSWORD@ before the host), in ${ENV_PASSWORD}, or in a URL file "
                f"(${ENV_URL_FILE}, felixctl --redis-url-file); see docs/security.md (the server said: {gist})")
    return (f"Redis at {server} refused the credentials: {gist} (check the user name and password: the URL's "
            f"own, else ${ENV_PASSWORD}; see docs/security.md)")


def _short(exc: BaseException, server: str = "") -> str:
    """The gist of a redis-py connection error (some carry kilobytes of pool repr)."""
    if isinstance(exc, (SentinelsFailed, NotTlsError)) or isinstance(exc.__cause__, (SentinelsFailed, NotTlsError)):
        # felix-redis' own words: what each sentinel did, or a port that does not take TLS
        text = str(exc).splitlines()[0]
        return text if len(text) <= 1500 else text[:1500] + "..."
    if type(exc).__name__ == "MasterNotFoundError":
        return str(exc).split(" : ", 1)[0] + " by the sentinels"
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if text == "Timeout connecting to server" and server.startswith("rediss"):
        text += " (on a TLS URL: the port may not take TLS, as a plain-text port never answers a TLS handshake)"
    return text if len(text) <= 300 else text[:300] + "..."


def not_replicated(op: Eval, acked: int, timeout_ms: int) -> NotReplicated:
    return NotReplicated(
        f"{op.context}: the write was applied on the primary but only {acked} of "
        f"{op.replicas} required replica(s) confirmed it within {timeout_ms} ms; "
        "it may not survive a failover"
    )


def with_nodes(info: StreamInfo, raw: Any) -> StreamInfo:
    """``info`` with the node serving each shard now (Redis Cluster ``raw``), by the
    client's slot map."""
    nodes = []
    for tag in info.tags:
        node = raw.get_node_from_key("{" + tag + "}")
        nodes.append(f"{node.host}:{node.port}")
    return dataclasses.replace(info, nodes=nodes)


def max_block_ms(raw: Any) -> int:
    """Longest XREAD BLOCK that stays clear of the client's socket timeout (redis-py's
    default is 5 s); plans split longer waits into several blocks."""
    timeouts = []
    pools = [getattr(raw, "connection_pool", None)]
    pools += [getattr(n.redis_connection, "connection_pool", None)
              for n in getattr(raw, "get_nodes", lambda: [])() if n.redis_connection is not None]
    kwargs = getattr(raw, "nodes_manager", None)
    if kwargs is not None:
        timeouts.append(kwargs.connection_kwargs.get("socket_timeout"))
    for pool in pools:
        if pool is not None:
            timeouts.append(getattr(pool, "connection_kwargs", {}).get("socket_timeout"))
    finite = [float(t) for t in timeouts if t]
    if not finite:
        return 60_000
    return max(50, int(min(finite) * 1000 * 0.8) - 200)


def check_raw_client(raw: Any, asyncio: bool = False) -> None:
    """Refuses what a Client (``asyncio``: an AsyncClient) cannot wrap: not a redis-py
    client, one of the other flavour (sync or asyncio), or one that decodes replies."""
    if not (hasattr(raw, "register_script") and hasattr(raw, "execute_command")):
        raise InvalidArgument(
            f"Client() wraps a Redis client (redis.Redis, Sentinel.master_for(...), RedisCluster), "
            f"got {type(raw).__name__}; use felix_redis.connect(url) for a URL"
        )
    if inspect.iscoroutinefunction(raw.execute_command) != asyncio:
        raise InvalidArgument(
            f"felix_redis.asyncio.Client wraps a redis.asyncio client, got the synchronous {type(raw).__name__}"
            if asyncio else
            f"felix_redis.Client wraps a synchronous redis-py client, got {type(raw).__module__}.{type(raw).__name__}; "
            "use felix_redis.asyncio.Client for a redis.asyncio client"
        )
    pool = getattr(raw, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", {}) if pool is not None else {}
    if kwargs.get("decode_responses") or (getattr(raw, "get_encoder", None) and getattr(
        raw.get_encoder(), "decode_responses", False
    )):
        raise InvalidArgument(
            "felix-redis needs a Redis client with decode_responses=False (payloads are bytes)"
        )


class BatchRun:
    """The driver-independent part of running a Batch as one pipeline of plain FCALL
    (or EVALSHA) commands: the commands to send, and what the replies mean. Calls that
    did not run because the server lacks the library or script are sent again once it
    is loaded; calls refused FCALL are sent again as EVALSHA (see :class:`scripts.Runner`);
    calls a failover or restart refused (READONLY, LOADING, ...: they did not run) are
    sent again after :attr:`pause`, for ``retry_for`` seconds, as a single call would be.

    ``redirects`` (Redis Cluster, one node's calls): a call answered MOVED or ASK did not
    run there; it is left out of :attr:`results` and its index put in :attr:`redirected`,
    for the driver to send on its own once the slot map is read again."""

    def __init__(self, op: Batch, runner: scripts.Runner, url: str, retry_for: float = 0.0,
                 redirects: bool = False) -> None:
        self.op, self.runner, self.url = op, runner, url
        self.results: list[Any] = [None] * len(op.ops)
        self.todo: list[int] = list(range(len(op.ops)))
        self.redirects = redirects
        #: the calls answered MOVED or ASK (with ``redirects``), in order
        self.redirected: list[int] = []
        #: set by a driver whose run stopped on a lost connection (or a slot moved):
        #: the slot map is to be read again
        self.failed = False
        self.rounds = 0
        #: seconds the driver waits before sending the next round (refused calls)
        self.pause = 0.0
        self._delays = retry_delays(retry_for)

    def commands(self) -> list[tuple[Any, ...]] | None:
        """The commands of the next round, or None when every call has its reply."""
        if not self.todo:
            return None
        if not self.pause:
            self.rounds += 1
            if self.rounds > 4:
                raise ConnectionFailed(f"Redis at {self.url} keeps forgetting the scripts (FLUSH?)")
        return [e.args if isinstance(e, Cmd) else self.runner.command(e.script, e.keys, e.args)
                for e in (self.op.ops[i] for i in self.todo)]

    def take(self, replies: list[Any]) -> set[str]:
        """Records the replies; returns the names of the scripts to load first."""
        again, load = [], set()
        pause: float | None = None  # this round's, taken when the first call was refused
        functions = self.runner.functions  # FCALL this round: a refusal of it is sent again as EVALSHA
        for i, reply in zip(self.todo, replies, strict=True):
            op = self.op.ops[i]
            if self.redirects and isinstance(reply, AskError):  # (MovedError is one too)
                self.redirected.append(i)
            elif isinstance(op, Cmd):
                self.results[i] = translate(reply, op, self.url) if isinstance(reply, Exception) else reply
            elif self.runner.missing(reply):
                again.append(i)
                load.add(op.script)
            elif self.runner.switch_to_evalsha(reply) or (functions and self.runner.refused_fcall(reply)):
                again.append(i)  # the first refusal switched the client; the others of the round go again too
            else:
                result = translate(reply, self.op.ops[i], self.url) if isinstance(reply, Exception) else reply
                if isinstance(result, ConnectionFailed) and result.unsent and not result.final:
                    pause = next(self._delays, None) if pause is None else pause
                    if pause is not None:
                        again.append(i)  # it did not run: once more, after the pause
                        continue
                self.results[i] = result
        self.pause = pause or 0.0
        self.todo = again
        return load


def by_node(op: Batch, node_of: Callable[[str], Any]) -> tuple[list[int], list[tuple[Any, list[int]]]]:
    """Redis Cluster: the calls of ``op`` (by index) to send one by one, and those to
    send as one pipeline per node, with the node (``node_of(key)``: the node serving the
    key's slot) they go to. A call alone goes by itself: one with no key to route it (a
    Cmd with ``key`` None), one that waits for replicas (WAIT must go out on the
    connection of its write), one whose node is not known now (the slot map has no node
    for its slot: sent alone, it gets the error a single call gets), and the only call
    of its node."""
    alone: list[int] = []
    nodes: dict[str, tuple[Any, list[int]]] = {}
    for i, e in enumerate(op.ops):
        key = e.key if isinstance(e, Cmd) else e.keys[0] if e.keys and not e.replicas else None
        if key is None:
            alone.append(i)
            continue
        try:
            node = node_of(key)
        except (RedisClusterException, ClusterError):
            alone.append(i)
            continue
        nodes.setdefault(node.name, (node, []))[1].append(i)
    many = []
    for node, indices in nodes.values():
        if len(indices) == 1:
            alone += indices
        else:
            many.append((node, indices))
    return sorted(alone), many


def outcome(run: Any, op: Eval | Cmd) -> Any:
    """``run(op)``'s reply, or the FelixError it raised (for a Batch's reply list)."""
    try:
        return run(op)
    except FelixError as exc:
        return exc


def describe_server(raw: Any) -> str:
    """How errors name a server the client was not given a URL for."""
    try:
        kwargs = raw.connection_pool.connection_kwargs
        return f"redis://{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"
    except AttributeError:
        return type(raw).__name__


class Item:
    """A record handed out by a ShardedGroup; settles through the group. ``stream``:
    the stream it came from (the group may poll several)."""

    __slots__ = ("record", "stream")

    def __init__(self, record: Record, stream: str) -> None:
        self.record = record
        self.stream = stream

    @property
    def shard(self) -> int:
        return self.record.shard

    @property
    def offset(self) -> int:
        return self.record.offset

    @property
    def attempts(self) -> int:
        return self.record.attempts

    @property
    def payload(self) -> bytes:
        return self.record.payload

    @property
    def published_at(self) -> datetime:
        return self.record.published_at

    @property
    def key(self) -> str | None:
        return self.record.key

    @property
    def headers(self) -> dict[str, str]:
        return self.record.headers

    @property
    def deliver_at(self) -> datetime | None:
        return self.record.deliver_at

    @property
    def expires_at(self) -> datetime | None:
        return self.record.expires_at

    @property
    def claim(self) -> str:
        return self.record.claim

    def __repr__(self) -> str:
        return f"Item({self.record!r}, stream={self.stream!r})"


def _shard(item: Item | Record | str) -> int:
    """The shard a settle goes to: the record's, or the claim string's."""
    if isinstance(item, Item):
        return item.record.shard
    if isinstance(item, Record):
        return item.shard
    if isinstance(item, str):
        return parse_claim(item, attempts_required=False).shard
    raise InvalidArgument(f"expected an Item, Record or claim string, got {type(item).__name__}")


Ref = Item | Record | str


class ShardedGroupBase:
    """What the sync and asyncio sharded groups share: where they poll, routing.
    ``stream``: one stream's name, or a list of them in priority order (``weights``:
    None for strict order, else one weight per stream). ``prefetch``: 0, or how many
    records a poll fetches in one round trip when the group holds none fetched ahead;
    ``poll(n)`` hands them out ``n`` at a time (docs/concepts.md, "Prefetch")."""

    def __init__(
        self, core: Core, tenant: str, namespace: str, stream: str | Sequence[str], group: str,
        consumer: str | None = None, reclaim: bool = True, shards: Iterable[int] | None = None,
        weights: Sequence[int] | None = None, prefetch: int = 0,
    ) -> None:
        #: records a poll fetches at once (0: what it was asked for); the records beyond
        #: what it was asked for wait, leased, in ``_buffer`` for the next polls
        self.prefetch = 0 if prefetch == 0 and type(prefetch) is int else check_int(
            prefetch, "prefetch", 1, MAX_RECORDS_PER_POLL)
        self._buffer: list[Item] = []
        self._buffer_lock = threading.Lock()  # two threads polling one group take none twice
        self._buffer_pid = os.getpid()  # a forked child neither hands out nor releases its parent's
        #: time.monotonic() before the fetch that brought the oldest record in the buffer
        #: (its lease runs from then)
        self.fetched_at = 0.0
        self._core = core
        self.streams, self.weights = check_streams(stream, weights)
        self.shards = None if shards is None else list(shards)
        if self.shards is not None and len(self.streams) > 1:
            raise InvalidArgument("shards= picks shards of one stream; a group over several streams polls them all")
        self.tenant, self.namespace, self.group = tenant, namespace, group
        #: the stream's name; for a group over several streams, the first (see ``streams``)
        self.stream = self.streams[0]
        self.consumer = consumer
        self.reclaim = reclaim
        self._index = {name: i for i, name in enumerate(self.streams)}
        self._state = PollState(len(self.streams))
        #: acks made with ``ack(item, wait=False)`` and not sent yet (they ride on the
        #: next poll, go after ``ACK_LINGER_S``, at ``flush()`` or ``close()``)
        self._queued: list[Ref] = []
        #: when the first of the queued acks was queued (time.monotonic(); 0.0: they are
        #: acks put back after a failed send, due at once)
        self._queued_at = 0.0
        self._queue_lock = threading.Lock()
        self._flush_failures = 0  # lost connections in a row while sending the queued acks

    def _queue_ack(self, item: Ref) -> bool:
        """Queues an ack of ``item`` (checked now: a bad reference raises here, and
        nothing is queued); True when the queue was empty (the caller starts its
        linger)."""
        self._check_ref(item)
        with self._queue_lock:
            self._queued.append(item)
            if len(self._queued) == 1:
                self._queued_at = time.monotonic()
                return True
            return False

    def _check_poll(self, max_records: int, wait: float | None) -> None:
        """A poll's arguments, checked before it hands out records fetched ahead (the
        plan checks them again when it runs)."""
        check_int(max_records, "max_records", 1, MAX_RECORDS_PER_POLL)
        if wait is not None:
            seconds_to_ms(wait, "wait", 0, MAX_DELAY_MS)

    def _fetched(self, items: list[Item], max_records: int, sent: float) -> list[Item]:
        """The first ``max_records`` of what a prefetching poll fetched (sent at
        ``sent``, time.monotonic()); the rest wait in the buffer (leased to this
        consumer) for the next polls, after what another poll of this group left there
        meanwhile."""
        if len(items) > max_records:
            with self._buffer_lock:
                self._own_buffer()
                if not self._buffer:
                    self.fetched_at = sent
                self._buffer.extend(items[max_records:])
            return items[:max_records]
        return items

    def _take_buffer(self) -> list[Item]:
        """Empties the buffer (at close: its records are released)."""
        with self._buffer_lock:
            self._own_buffer()
            held, self._buffer = self._buffer, []
        return held

    def _own_buffer(self) -> None:
        """In a forked child (the sync client's fork hook does this for the groups it
        tracks; this covers the rest, and asyncio's), the parent's records fetched ahead
        are dropped, neither handed out nor released: they are the parent's. Called
        under ``_buffer_lock``."""
        if self._buffer_pid != (pid := os.getpid()):
            self._buffer, self._buffer_pid = [], pid

    def _release_plan(self, items: list[Item]) -> Plan[None]:
        """Releases ``items`` (fetched ahead, never handed out; their deliveries are not
        counted): one round trip; what was not released is logged."""
        try:
            failed = yield from self._core.release_sharded(
                self.tenant, self.namespace, self.group, self._by_target(items))
        except FelixError as exc:  # the stream or group could not be read
            failed = [(item.record.claim, exc) for item in items]
        for claim, why in failed:
            log.warning("record %s fetched ahead by group %s and not handed out was not released: %s",
                        claim, self.group, why)

    @property
    def fetched_ahead(self) -> int:
        """Records a prefetching group fetched and has not handed out yet (leased to it)."""
        return len(self._buffer) if self._buffer_pid == os.getpid() else 0

    def _check_ref(self, item: Ref) -> None:
        if type(item) is not Item or item.stream not in self._index:
            # anything but an Item of this group's: checked now, its shard against the
            # stream's shards when they are known (a poll of this group learned them)
            stream, shard = self._stream_of(item), _shard(item)
            name = self._core.cache.name(self.tenant, self.namespace, stream)
            if (settings := self._core.cache.settings.get(name.path)) is not None:
                self._core.shard_of(name, settings, shard)

    def _checked_refs(self, ack: Iterable[Ref] | None) -> list[Ref]:
        """A poll's ``ack``, every reference checked (a bad one raises, nothing queued)."""
        refs = [] if ack is None else check_list(ack, "ack")
        for ref in refs:
            self._check_ref(ref)
        return refs

    def _from_buffer(self, max_records: int) -> list[Item]:
        """Up to ``max_records`` records fetched ahead (taken last, after everything that
        can raise or be cancelled: they are not lost to the caller)."""
        with self._buffer_lock:
            self._own_buffer()
            taken, self._buffer = self._buffer[:max_records], self._buffer[max_records:]
        return taken

    def _take_queued(self) -> list[Ref]:
        with self._queue_lock:
            taken, self._queued = self._queued, []
        return taken

    def _requeue(self, refs: list[Ref]) -> None:
        """Puts back acks whose call failed, to go with the next poll or flush."""
        if refs:
            with self._queue_lock:
                self._queued[:0] = refs
                self._queued_at = 0.0

    def _linger_left(self, linger: float) -> float:
        """Seconds the queued acks still wait for a poll to take them along before a
        background send (0: send now). A poll may have taken the acks whose linger is
        ending: those queued since wait out ``linger`` from the first of them."""
        if not self._queued or not self._queued_at:
            return 0.0
        return max(0.0, self._queued_at + linger - time.monotonic())

    @property
    def queued_acks(self) -> int:
        """Acks made with ``ack(item, wait=False)`` that were not sent to Redis yet."""
        return len(self._queued)

    def _flush_failed(self, exc: FelixError, again: bool) -> bool:
        """What a background flush of the queued acks does after ``exc``: True to try
        again later (a lost connection, when ``again``); otherwise the acks are dropped
        (their records are delivered again after their lease), and it is logged."""
        if isinstance(exc, (ConnectionFailed, NotReplicated)):
            self._flush_failures += 1
            if again and self._flush_failures < FLUSH_TRIES:
                log.warning("queued acks of group %s not sent, trying again: %s", self.group, exc)
                return True
            self._flush_failures = 0
            self._take_queued()
            log.warning("queued acks of group %s not sent; their records will be delivered again: %s",
                        self.group, exc)
            return False
        log.warning("queued acks of group %s: %s", self.group, exc)
        return False

    def _with_queued(self, ack: Iterable[Ref] | None) -> tuple[list[Ref], list[Ref] | None]:
        """The queued acks a poll takes along, and its ``ack=`` with them; the queued
        acks stay queued when together they would pass a poll's limit per shard."""
        if not self._queued:
            return [], None if ack is None else check_list(ack, "ack")
        given = [] if ack is None else check_list(ack, "ack")
        if len(self._queued) + len(given) > MAX_BATCH:
            return [], given
        queued = self._take_queued()
        return queued, queued + given

    def _stream_of(self, item: Ref) -> str:
        """The stream a settle goes to: the Item's; a Record or claim string names none,
        so only a group over one stream takes them."""
        if isinstance(item, Item):
            if item.stream not in self._index:
                raise InvalidArgument(
                    f"the item came from stream {item.stream}, which group {self.group} does not poll")
            return item.stream
        if len(self.streams) > 1:
            raise InvalidArgument(
                f"a group over several streams settles the Items it handed out (they name their stream), "
                f"not a {type(item).__name__}")
        return self.stream

    def _where(self, item: Ref) -> tuple[str, str, str, int, str]:
        return self.tenant, self.namespace, self._stream_of(item), _shard(item), self.group

    def _poll_plan(
        self, max_records: int, wait: float | None, ack: Iterable[Ref] | None = None
    ) -> Plan[list[Item]]:
        acks = None
        if ack is not None:
            acks = {(self._index[stream], shard): refs for (stream, shard), refs in self._by_target(ack).items()}
        per_stream = yield from self._core.sharded_poll(
            self.tenant, self.namespace, self.streams, self.group, max_records, wait,
            self.consumer, self._state, self.reclaim, self.shards, acks, self.weights,
        )
        if len(per_stream) == 1:
            stream = self.stream
            return [Item(r, stream) for r in per_stream[0]]
        streams = self.streams
        return [Item(r, streams[i]) for i, records in enumerate(per_stream) for r in records]

    def _ack_plan(self, items: Iterable[Ref]) -> Plan[int]:
        return (yield from self._core.ack_sharded(self.tenant, self.namespace, self.group, self._by_target(items)))

    def _by_target(self, items: Iterable[Ref]) -> dict[tuple[str, int], list[Ref]]:
        """``items`` by (stream, shard); an Item of this group's goes as its Record (what
        the offsets are read from at once), anything else as it is, checked later."""
        grouped: dict[tuple[str, int], list[Ref]] = {}
        index = self._index
        for item in check_list(items, "items"):
            if type(item) is Item and item.stream in index:
                record = item.record
                key = (item.stream, record.shard)
                if (refs := grouped.get(key)) is None:
                    grouped[key] = [record]
                else:
                    refs.append(record)
            else:
                grouped.setdefault((self._stream_of(item), _shard(item)), []).append(item)
        return grouped
