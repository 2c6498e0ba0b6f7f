"""What every operation sends and how its reply is read, written once.

Each operation is a *plan*: a generator that yields :class:`Eval` (one script call) or
:class:`Cmd` (one plain command) and receives the reply. The sync client and the asyncio
client only differ in how they execute a yielded op (see ``_drive`` in client.py and
asyncio.py), so argument building, reply parsing, validation and multi-step logic
(shards, long polls, retries) exist in one place.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import random
import secrets
import threading
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from felix_redis import constants as C
from felix_redis.errors import (
    Conflict,
    ConnectionFailed,
    FelixError,
    GroupExists,
    InvalidArgument,
    NotFound,
    NotReplicated,
    OutcomeUnknown,
    PermissionDenied,
    SequenceError,
    WrongKeyType,
)
from felix_redis.keys import (
    GROUP_ROLES,
    StreamName,
    check_name,
    check_record_key,
    registry_key,
    shard_for_key,
    tenants_key,
    valid_name,
)
from felix_redis.models import (
    DeadLetter,
    GroupInfo,
    Published,
    Record,
    ShardState,
    StreamInfo,
    parse_claim,
)

T = TypeVar("T")
log = logging.getLogger(__name__)


class Eval:
    """Run script ``script`` with ``keys`` and ``args``; ``replicas``: WAIT for that many
    replicas after it (a write on a quorum/all stream)."""

    __slots__ = ("args", "context", "keys", "replicas", "script")

    def __init__(
        self,
        script: str,
        keys: list[str],
        args: list[Any],
        context: str,
        replicas: int = 0,
    ) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.context = context
        self.replicas = replicas


class Cmd:
    """Run one plain command. ``key`` routes it on Redis Cluster; ``block_ms`` marks a
    blocking read (the driver allows for it in socket timeouts)."""

    __slots__ = ("args", "block_ms", "context", "key")

    def __init__(self, *args: Any, key: str | None = None, context: str = "", block_ms: int = 0):
        self.args = args
        self.key = key
        self.context = context
        self.block_ms = block_ms


class BlockAny:
    """Block until any of ``streams`` (key, last seen ID) gets a new entry, or
    ``block_ms`` passes. One XREAD BLOCK when all keys share a slot; on Redis Cluster the
    driver blocks on each slot at once. Plans treat the answer only as "look again", so
    a driver may return early (it caps blocks below its socket timeout) or return None
    after a failed block; the next poll then reports any real failure."""

    __slots__ = ("block_ms", "context", "streams")

    def __init__(self, streams: list[tuple[str, str]], block_ms: int, context: str = "") -> None:
        self.streams = streams
        self.block_ms = block_ms
        self.context = context


class Batch:
    """Several script calls in one round trip (a pipeline, no transaction). The reply is a
    list holding each call's reply, or the FelixError it raised. A driver may run them one
    by one instead (Redis Cluster, where shards live on different nodes; calls that WAIT)."""

    __slots__ = ("ops",)

    def __init__(self, ops: list[Eval]) -> None:
        self.ops = ops


class Sleep:
    """Pause the plan (client side), e.g. between retries."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


Op = Eval | Cmd | BlockAny | Batch | Sleep
Plan = Generator[Op, Any, T]


# --------------------------------------------------------------------------- retries

#: Scripts a client may run again after a connection failure or failover without
#: changing the outcome: reads, idempotent writes (ack, create with the same settings,
#: configure) and polls (a poll whose reply was lost leaves leases that lapse, so those
#: records are redelivered later: delayed, never lost). Publishing is safe only with a
#: producer (a re-send is answered from the shard's memory). Not discard: sent again,
#: it finds the records discarded already and refuses them as not dead letters.
RETRY_SAFE_SCRIPTS = frozenset({
    "stream_info", "stream_read", "stream_create", "stream_trim", "group_describe", "group_dead_letters",
    "group_poll", "group_ack", "group_configure",
})
RETRY_SAFE_COMMANDS = frozenset({
    "INFO", "EXISTS", "TYPE", "SMEMBERS", "SADD", "ZRANGE", "ZADD", "ZREM", "PING",
})
#: Error replies that mean "this node cannot take the call now" (a failover or restart
#: is under way); treated like a lost connection.
TRANSIENT_ERRORS = ("READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "NOREPLICAS")


def retry_safe(op: object) -> bool:
    if type(op) is Eval:
        if op.script == "publish":
            return bool(op.args[1])  # a producer id
        return op.script in RETRY_SAFE_SCRIPTS
    if type(op) is Cmd:
        return str(op.args[0]).upper() in RETRY_SAFE_COMMANDS
    if type(op) is Batch:
        return all(retry_safe(e) for e in op.ops)
    return False


def retry_delays(total_s: float) -> Generator[float, None, None]:
    """Jittered exponential pauses (50 ms doubling to 1 s) until ``total_s`` of wall
    time has passed since the first one was asked for."""
    deadline = time.monotonic() + total_s
    base = 0.05
    while (left := deadline - time.monotonic()) > 0:
        yield min(min(base, 1.0) * (0.5 + random.random() / 2), left)
        base *= 2


class Retrying:
    """What a driver does after an op failed with ConnectionFailed: ``pause()`` says how
    long to wait before trying again, or raises the error when the budget is spent or the
    op may not be sent again. An op is sent again when it is safe to repeat
    (:func:`retry_safe`), or when the failure says it never ran (``exc.unsent``: no
    connection could be made, or a failover, restart or moved slot refused it). Any other
    failure of an op that is not safe to repeat raises :class:`OutcomeUnknown`. A failed
    block is not retried: after a short pause the driver answers it as a wake-up, and the
    plan's next poll decides."""

    BLOCK_PAUSE = 0.05

    def __init__(self, op: Op, total_s: float) -> None:
        self.op = op
        self.total_s = total_s
        self.safe = retry_safe(op)
        self.delays: Generator[float, None, None] | None = None

    def pause(self, exc: ConnectionFailed) -> float:
        if type(self.op) is BlockAny:
            return self.BLOCK_PAUSE
        if not (self.safe or exc.unsent):
            raise OutcomeUnknown(
                f"{exc}; the call was sent and may or may not have taken effect "
                "(it is not safe to repeat, so it was not sent again)"
            ) from None
        if self.delays is None:
            self.delays = retry_delays(self.total_s)
        pause = next(self.delays, None)
        if pause is None:
            raise exc
        return pause


def xread_calls(op: BlockAny, keyslot: Any, max_block_ms: int) -> list[list[Any]]:
    """The XREAD BLOCK commands for ``op``: one when every key shares a slot, else one
    per slot (Redis Cluster), each blocking at most ``max_block_ms``."""
    by_slot: dict[int, list[tuple[str, str]]] = {}
    for key, last in op.streams:
        by_slot.setdefault(keyslot(key) if keyslot else 0, []).append((key, last))
    block_ms = min(op.block_ms, max_block_ms)
    return [["XREAD", "COUNT", 1, "BLOCK", block_ms, "STREAMS", *[k for k, _ in points], *[i for _, i in points]]
            for points in by_slot.values()]


# ---------------------------------------------------------------------------- helpers


def as_bytes(payload: object, what: str = "payload") -> bytes:
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, str):
        return payload.encode("utf-8")
    if isinstance(payload, (bytearray, memoryview)):
        return bytes(payload)
    raise InvalidArgument(f"{what} must be bytes or str, got {type(payload).__name__}")


def check_list(value: object, what: str) -> list[Any]:
    """``value`` as a list, refusing str/bytes and Published (iterable, but never meant
    as a list: a Published would pass for the offsets (shard, offset))."""
    if isinstance(value, (str, bytes, bytearray, memoryview, Published)) or not isinstance(value, Iterable):
        raise InvalidArgument(f"{what} must be a list, got {type(value).__name__}")
    return list(value)


def check_int(value: object, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{what} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidArgument(f"{what} must be between {lo} and {hi}, got {value}")
    return value


def seconds_to_ms(value: object, what: str, lo_ms: int, hi_ms: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{what} must be a number of seconds, got {value!r}")
    if not math.isfinite(value):
        raise InvalidArgument(f"{what} must be a finite number of seconds, got {value}")
    if value < 0:
        raise InvalidArgument(f"{what} must not be negative, got {value}")
    ms = round(value * 1000) if value <= hi_ms else hi_ms + 1
    if not lo_ms <= ms <= hi_ms:
        raise InvalidArgument(
            f"{what} must be between {lo_ms / 1000:g} and {hi_ms / 1000:g} seconds, got {value}"
        )
    return ms


def _int(value: Any) -> int:
    return int(value)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _key_text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


def parse_delivered(reply: list[Any], start: int, count: int, shard: int) -> list[Record]:
    """Records from a poll reply: [entry ID 'OFFSET-MS', attempts, key, payload]*."""
    out: list[Record] = []
    for i in range(start, start + 4 * count, 4):
        off, ms = reply[i].split(b"-")
        key = reply[i + 2]
        out.append(Record(shard, int(off), reply[i + 1], reply[i + 3],
                          None if key is None else key.decode("utf-8", "surrogateescape"), int(ms)))
    return out


def parse_records(reply: list[Any], start: int, count: int, shard: int) -> list[Record]:
    """Records from a read reply: [offset, publish ms, key, payload]* (attempts 0)."""
    out: list[Record] = []
    for i in range(start, start + 4 * count, 4):
        off, ms, key, payload = reply[i : i + 4]
        out.append(Record(shard, int(off), 0, payload, _key_text(key), int(ms)))
    return out


def replicas_needed(replication: int, consistency: str) -> int:
    """Replicas WAIT must see: quorum -> a majority of copies, all -> every copy."""
    if consistency == "quorum":
        return replication // 2
    if consistency == "all":
        return replication - 1
    return 0


@dataclass
class StreamSettings:
    """What a client caches about a stream (immutable for its life)."""

    shards: int
    replication: int
    consistency: str
    replicas: int
    max_payload: int = C.DEFAULT_MAX_PAYLOAD
    max_len: int = 0
    max_age: int = 0
    #: the shard count its shards' hash tags are spread for (StreamName.spread); 0: plain
    spread: int = 0
    loaded_at: float = field(default_factory=time.monotonic)


def new_producer_secret() -> str:
    """A producer's secret: 128 random bits as 32 hex digits (``secrets``), made without
    a round trip. Only the client holds it; a shard knows the producer by a digest of it
    (:func:`felix_redis.keys.producer_field`), so no other client can act as this producer."""
    return secrets.token_hex(16)


@dataclass
class ProducerState:
    """Producer secret and the last sequence used per (stream, shard). ``local``: a
    producer of the plain publishes' pool (:class:`ProducerPool`)."""

    producer_id: str | None = None
    sequences: dict[tuple[str, int], int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    local: bool = False

    def reset(self) -> None:
        """Forget the secret: the next publish uses a new one, with sequences from 1."""
        self.producer_id = new_producer_secret() if self.local else None
        self.sequences.clear()


class ProducerPool:
    """Producers for plain publishes: each concurrent caller borrows its own, so one
    producer's sequences reach a shard in order without serialising the callers."""

    def __init__(self) -> None:
        self._free: list[ProducerState] = []

    def acquire(self) -> ProducerState:
        try:
            return self._free.pop()
        except IndexError:
            return ProducerState(new_producer_secret(), local=True)

    def release(self, state: ProducerState) -> None:
        self._free.append(state)


class Target:
    """A resolved record reference: shard, offset and (for claims) attempts."""

    __slots__ = ("attempts", "offset", "shard")

    def __init__(self, shard: int, offset: int, attempts: int | None) -> None:
        self.shard = shard
        self.offset = offset
        self.attempts = attempts


def resolve(ref: object, shard: int | None, *, need_attempts: bool) -> Target:
    """A Record, Item, claim string ``S:O:A`` or bare offset, checked against ``shard``."""
    record = getattr(ref, "record", ref)
    if isinstance(record, Record):
        target = Target(record.shard, record.offset, record.attempts or None)
    elif isinstance(ref, DeadLetter):
        target = Target(ref.shard, ref.offset, None)
    elif isinstance(ref, str):
        claim = parse_claim(ref, attempts_required=need_attempts)
        target = Target(claim.shard, claim.offset, claim.attempts)
    elif isinstance(ref, int) and not isinstance(ref, bool):
        if need_attempts:
            raise InvalidArgument(
                "this operation needs the claim (a Record or 'SHARD:OFFSET:ATTEMPTS'), "
                f"not a bare offset {ref}"
            )
        target = Target(shard if shard is not None else 0, check_int(ref, "offset", 0, 2**52), None)
    else:
        raise InvalidArgument(f"expected a Record, claim string or offset, got {type(ref).__name__}")
    if shard is not None and target.shard != shard:
        raise InvalidArgument(f"record is from shard {target.shard}, not shard {shard}")
    if need_attempts and target.attempts is None:
        raise InvalidArgument("this operation needs the claim's attempts (SHARD:OFFSET:ATTEMPTS)")
    return target


MAX_OFFSET = 2**52


def offsets_of(refs: Iterable[Any], shard: int) -> list[int]:
    """The offsets of ``refs`` on ``shard``, as :func:`resolve` would give them: plain
    ints and Records of that shard are taken as they are; anything else goes through
    resolve (which also gives the error for bad input)."""
    out: list[int] = []
    add = out.append
    for ref in refs:
        kind = type(ref)
        if kind is int and 0 <= ref <= MAX_OFFSET:
            add(ref)
        elif kind is Record and ref.shard == shard:
            add(ref.offset)
        else:
            add(resolve(ref, shard, need_attempts=False).offset)
    return out


def ack_offsets(refs: Iterable[Any], shard: int) -> list[int]:
    """The offsets of the records a poll acks (``ack=``): those of ``shard``, at most
    ``MAX_BATCH`` of them."""
    offsets = offsets_of(refs if type(refs) is list else check_list(refs, "ack"), shard)
    if len(offsets) > C.MAX_BATCH:
        raise InvalidArgument(f"a poll acks at most {C.MAX_BATCH} records at once, got {len(offsets)}")
    return offsets


#: Entries each per-client cache of checked names and built keys holds; a client that
#: touches more streams or groups than that starts the cache over.
CACHE_MAX = 1024


def _plain(tenant: object, namespace: object, stream: object, shard: object, group: object) -> bool:
    """True for exact str names and an exact int shard: the calls the caches serve."""
    return (type(shard) is int and type(group) is str and type(tenant) is str
            and type(namespace) is str and type(stream) is str)


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= CACHE_MAX:
        cache.clear()
    cache[key] = value


# ------------------------------------------------------------------------------ core


class Core:
    """Builds plans. Holds the key prefix, the stream settings cache, defaults and the
    round-robin counter; has no connection of its own."""

    settings_ttl_s = 60.0
    wait_timeout_ms = 2000

    def __init__(
        self,
        *,
        prefix: str = C.DEFAULT_PREFIX,
        idempotent_publish: bool = True,
        retry_for: float = 2.0,
    ):
        if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{} \t\r\n"):
            raise InvalidArgument(f"bad key prefix {prefix!r}")
        self.prefix = prefix
        self.idempotent_publish = idempotent_publish
        #: seconds a retry-safe operation is retried through connection failures
        self.retry_for = retry_for
        self.producer_idle_ms = C.env_int(C.ENV_PRODUCER_IDLE_MS, C.DEFAULT_PRODUCER_IDLE_MS)
        self._settings: dict[str, StreamSettings] = {}
        # Checked names and built keys, so that a repeated call neither matches a name
        # pattern nor builds a key again. Only calls whose names are exact str and shard
        # an exact int are looked up here (no bool, float or subclass is ever equal to a
        # cached entry); anything else takes the checked path.
        self._names: dict[tuple[str, str, str], StreamName] = {}
        #: (path, spread) -> the name laid out for it (Core.laid)
        self._laid: dict[tuple[str, int], StreamName] = {}
        #: (tenant, namespace, stream, shard, group) -> (name, path, keys, context)
        self._groups: dict[tuple[str, str, str, int, str], tuple[StreamName, str, list[str], str]] = {}
        #: (path, shard, spread) -> (meta key, log key, context), for publishing
        self._shards: dict[tuple[str, int, int], tuple[list[str], str]] = {}
        self._last_trim: dict[tuple[str, int], float] = {}
        self.producers = ProducerPool()
        self._round_robin = itertools.count(random.randrange(1 << 16))

    # -- names and settings

    def name(self, tenant: str, namespace: str, stream: str) -> StreamName:
        if type(tenant) is str and type(namespace) is str and type(stream) is str:
            where = (tenant, namespace, stream)
            name = self._names.get(where)
            if name is None:
                name = StreamName.of(self.prefix, tenant, namespace, stream)
                _remember(self._names, where, name)
            return name
        return StreamName.of(self.prefix, tenant, namespace, stream)

    def laid(self, name: StreamName, settings: StreamSettings | int) -> StreamName:
        """``name`` with its shards' tags as the stream's settings (or a spread) say
        (StreamName.spread). The name cache learns it: :meth:`name` then gives names laid
        out as the stream was last seen."""
        spread = settings if isinstance(settings, int) else settings.spread
        if name.spread == spread:
            return name
        where = (name.path, spread)
        laid = self._laid.get(where)
        if laid is None or laid.prefix != name.prefix:
            laid = name.laid_out(spread)
            _remember(self._laid, where, laid)
        key = (name.tenant, name.namespace, name.stream)
        if self._names.get(key) is name:
            self._names[key] = laid
        return laid

    def forget(self, name: StreamName) -> None:
        self._settings.pop(name.path, None)

    def fresh_settings(self, path: str) -> StreamSettings | None:
        """The cached settings of stream ``path`` while they are fresh, else None."""
        cached = self._settings.get(path)
        if cached is not None and time.monotonic() - cached.loaded_at < self.settings_ttl_s:
            return cached
        return None

    def settings(self, name: StreamName) -> Plan[StreamSettings]:
        cached = self.fresh_settings(name.path)
        if cached is not None:
            return cached
        reply = yield Eval(
            "stream_info", name.info_keys(0), [], f"stream {name.path}"
        )
        meta = _pairs(reply[0])
        replication = int(meta["replication"])
        consistency = _text(meta["consistency"])
        settings = StreamSettings(
            int(meta["shards"]), replication, consistency, replicas_needed(replication, consistency),
            int(meta["max_payload"]), int(meta["max_len"]), int(meta["max_age"]), int(meta.get("spread", 0)),
        )
        self._settings[name.path] = settings
        return settings

    def shard_of(self, name: StreamName, settings: StreamSettings, shard: object) -> int:
        shard = check_int(shard, "shard", 0, C.MAX_SHARDS - 1)
        if shard >= settings.shards:
            raise NotFound(
                f"stream {name.path} has {settings.shards} shard(s) (0..{settings.shards - 1}); "
                f"shard {shard} does not exist"
            )
        return shard

    # -- streams

    def stream_create(
        self,
        tenant: str,
        namespace: str,
        stream: str,
        kind: str = "queue",
        shards: int = 1,
        replication: int = 1,
        consistency: str = "leader",
        retention_max_len: int | None = None,
        retention_max_age: int | None = None,
        max_payload: int | None = None,
        retention_mode: str = "safe",
        force: bool = False,
    ) -> Plan[bool]:
        name = self.name(tenant, namespace, stream)
        if retention_mode not in C.RETENTION_MODES:
            raise InvalidArgument(
                f"retention_mode must be one of {', '.join(C.RETENTION_MODES)}, got {retention_mode!r}")
        if kind not in C.KINDS:
            raise InvalidArgument(f"kind must be one of {', '.join(C.KINDS)}, got {kind!r}")
        shards = check_int(shards, "shards", 1, C.MAX_SHARDS)
        replication = check_int(replication, "replication", 1, 16)
        if consistency not in C.CONSISTENCY_LEVELS:
            raise InvalidArgument(
                f"consistency must be one of {', '.join(C.CONSISTENCY_LEVELS)}, got {consistency!r}"
            )
        max_len = 0 if retention_max_len is None else check_int(
            retention_max_len, "retention_max_len", 1, 2**52
        )
        max_age = 0 if retention_max_age is None else check_int(
            retention_max_age, "retention_max_age", 1, 2**52
        )
        payload_limit = C.DEFAULT_MAX_PAYLOAD if max_payload is None else check_int(
            max_payload, "max_payload", 1, 512 * 1024 * 1024
        )
        needed = replicas_needed(replication, consistency)
        yield from self.check_registry(name.tenant)
        # The shards' hash tags: spread over the slots for a new stream of several
        # shards; as shard 0 records them for one that exists (plain before spreading).
        try:
            first = yield Eval("stream_info", name.info_keys(0), [], f"stream {name.path}")
            spread = int(_pairs(first[0]).get("spread", 0))
        except NotFound:
            spread = shards if shards > 1 else 0
        name = self.laid(name, spread)
        args = [kind, shards, 0, replication, consistency, max_len, max_age, payload_limit, name.path, 1,
                retention_mode, spread]
        # Every shard validates first (check=1 writes nothing; it answers 1 for a shard
        # it would create), so a refusal on any shard leaves no shard behind.
        new = []
        for shard in range(shards):  # shard 0 first: it says how an existing stream differs
            args[2] = shard
            if (yield Eval("stream_create", name.publish_keys(shard), list(args), f"stream {name.path} shard {shard}")):
                new.append(shard)
        if replication > 1 and new:
            yield from self.check_copies(name, sorted(new), replication, force)
        # Then shard 0 last: while it is missing the stream does not exist for anyone,
        # and running the same call again completes it.
        args[9] = 0
        replies = yield from self.each_shard(
            Eval("stream_create", name.publish_keys(shard), [*args[:2], shard, *args[3:]],
                 f"stream {name.path} shard {shard}", needed)
            for shard in reversed(range(shards))
        )
        registry = registry_key(self.prefix, name.tenant)
        yield Cmd("ZADD", registry, 0, name.path, key=registry)
        yield Cmd("SADD", tenants_key(self.prefix), name.tenant, key=tenants_key(self.prefix))
        self.forget(name)
        return any(replies)

    def check_copies(self, name: StreamName, shards: list[int], replication: int, force: bool) -> Plan[None]:
        """Refuses (InvalidArgument) a ``replication`` greater than the copies the primary
        of each of ``shards`` has now (itself and its connected replicas), unless ``force``
        (then a warning): every write on a quorum/all stream would raise NotReplicated, and
        the setting would promise copies that do not exist. Nothing is written before.
        A backend that can never have a replica (memory://) refuses even with ``force``."""
        for shard in shards:
            copies = yield from self.copies(name, shard)
            if copies is None:
                raise InvalidArgument(
                    f"replication={replication}: this backend keeps a single copy (no replicas); use replication=1")
            if copies == 0:
                log.warning("stream %s: cannot read how many replicas shard %d's primary has (INFO replication "
                            "refused); created with replication=%d unchecked", name.path, shard, replication)
                return
            if copies >= replication:
                continue
            what = (f"stream {name.path}: replication={replication} asks for {replication} copies of every shard, "
                    f"but shard {shard}'s primary has {copies} now (itself and {copies - 1} connected replica(s))")
            if not force:
                raise InvalidArgument(
                    f"{what}; add replicas first, or pass force=True (felixctl stream create --force) to create "
                    "it anyway, e.g. while a replica is being rebuilt")
            log.warning("%s; created anyway (force): writes on a quorum/all stream raise NotReplicated until "
                        "enough replicas are back", what)
            return

    def each_shard(self, ops: Iterable[Eval]) -> Plan[list[Any]]:
        """Runs an administrative write on every shard, one after the other (``ops``, in
        order), and returns their replies. A NotReplicated (the write was applied on that
        shard's primary but too few replicas confirmed it) does not stop the others: every
        shard gets its write, then one NotReplicated names the shards not confirmed (their
        replies are None). Any other error stops the run where it is; running the same
        call again completes it (the scripts leave a shard that has it as it is)."""
        replies: list[Any] = []
        unconfirmed: list[str] = []
        first: NotReplicated | None = None
        for op in ops:
            try:
                replies.append((yield op))
            except NotReplicated as exc:
                first = first or exc
                unconfirmed.append(op.context)
                replies.append(None)
        if first is not None:
            raise NotReplicated(f"{first} (applied on every shard; not confirmed on: {', '.join(unconfirmed)})")
        return replies

    def check_registry(self, tenant: str) -> Plan[None]:
        """WrongKeyType unless the tenant's stream registry is a sorted set (or missing)."""
        key = registry_key(self.prefix, tenant)
        kind = _text((yield Cmd("TYPE", key, key=key)))
        if kind not in ("zset", "none"):
            raise WrongKeyType(f"key {key} holds a {kind} where felix-redis keeps a zset; another application wrote it")

    def copies(self, name: StreamName, shard: int = 0) -> Plan[int | None]:
        """How many copies of a shard's keys this deployment keeps now (the primary that
        serves it and its connected replicas); 0 when it cannot tell (a user without
        ``+info``); None for a backend that cannot have replicas (memory://, which has
        no INFO command)."""
        try:
            info = yield Cmd("INFO", "replication", key=name.shard_keys(shard)[0])
        except PermissionDenied:
            return 0
        except FelixError as exc:
            if "unknown command" in str(exc).lower():
                return None
            raise
        if isinstance(info, dict):
            return 1 + int(info.get("connected_slaves", 0))
        text = _text(info)
        for line in text.splitlines():
            if line.startswith("connected_slaves:"):
                return 1 + int(line.split(":", 1)[1])
        return 1

    def stream_describe(self, tenant: str, namespace: str, stream: str) -> Plan[StreamInfo]:
        name = self.name(tenant, namespace, stream)
        first = yield Eval(
            "stream_info", name.info_keys(0), [], f"stream {name.path}"
        )
        meta = _pairs(first[0])
        shards = int(meta["shards"])
        name = self.laid(name, int(meta.get("spread", 0)))
        replies = [first]
        for shard in range(1, shards):
            replies.append((yield Eval(
                "stream_info", name.info_keys(shard), [],
                f"stream {name.path} shard {shard}",
            )))
        tails = [int(_pairs(r[0])["tail"]) for r in replies]
        firsts = [int(_pairs(r[0])["first"]) for r in replies]
        max_len, max_age = int(meta["max_len"]), int(meta["max_age"])
        return StreamInfo(
            tenant, namespace, stream,
            kind=_text(meta["kind"]),
            shards=shards,
            replication=int(meta["replication"]),
            consistency=_text(meta["consistency"]),
            retention_max_len=max_len or None,
            retention_max_age=max_age or None,
            max_payload=int(meta["max_payload"]),
            retention_mode=_text(meta.get("mode", b"safe")),
            created_ms=int(meta["created"]),
            groups=sorted(_text(g) for g in first[1]),
            tails=tails,
            firsts=firsts,
            tags=[name.tag(shard) for shard in range(shards)],
        )

    def stream_list(self, tenant: str | None = None, namespace: str | None = None) -> Plan[list[tuple[str, str, str]]]:
        """Streams of one tenant (its registry), or of every tenant the tenants set
        names (an operator's listing: a tenant's admin may read its own registry only)."""
        if tenant is not None:
            check_name(tenant, "tenant")
        if namespace is not None:
            check_name(namespace, "namespace")
        if tenant is not None:
            tenants = [tenant]
        else:
            key = tenants_key(self.prefix)
            kind = _text((yield Cmd("TYPE", key, key=key)))
            if kind not in ("set", "none"):
                raise WrongKeyType(f"key {key} holds a {kind} where felix-redis keeps a set; another application "
                                   "wrote it")
            # a tenant admin may add any name (SADD only): what is no tenant name is skipped
            tenants = sorted(t for t in (_text(m) for m in (yield Cmd("SMEMBERS", key, key=key))) if valid_name(t))
        out = []
        for t in tenants:
            yield from self.check_registry(t)
            registry = registry_key(self.prefix, t)
            for member in (yield Cmd("ZRANGE", registry, 0, -1, key=registry)):
                parts = _text(member).split("/")
                if len(parts) != 3 or parts[0] != t:
                    continue  # not written by felix-redis
                if namespace is None or parts[1] == namespace:
                    out.append((parts[0], parts[1], parts[2]))
        return out

    def stream_delete(self, tenant: str, namespace: str, stream: str) -> Plan[None]:
        name = self.name(tenant, namespace, stream)
        try:
            settings = yield from self.settings(name)
        except NotFound:
            # Gone already, maybe by a delete that stopped before it left the registry.
            registry = registry_key(self.prefix, name.tenant)
            yield Cmd("ZREM", registry, name.path, key=registry)
            self.forget(name)
            raise
        name = self.laid(name, settings)
        yield from self.check_registry(name.tenant)
        existed = 0
        unconfirmed: NotReplicated | None = None
        # Shard 0 last: while it is there the stream exists, and a delete that stopped
        # part-way is completed by running it again.
        for shard in reversed(range(settings.shards)):
            for attempt in range(10):
                groups = [_text(g) for g in (yield Cmd(
                    "SMEMBERS", name.groups_key(shard), key=name.groups_key(shard)))]
                keys = name.info_keys(shard)
                for group in groups:
                    keys += name.group_keys(shard, group)
                try:
                    existed = yield Eval(
                        "stream_delete", keys, [len(groups), *groups],
                        f"stream {name.path} shard {shard}", settings.replicas,
                    )
                    break
                except NotReplicated as exc:  # deleted on the primary: on to the next shard
                    unconfirmed = unconfirmed or exc
                    existed = 1
                    break
                except Conflict:
                    if attempt == 9:
                        raise
        registry = registry_key(self.prefix, name.tenant)
        yield Cmd("ZREM", registry, name.path, key=registry)
        self.forget(name)
        if unconfirmed is not None:
            raise unconfirmed
        if not existed:
            raise NotFound(f"stream {name.path} does not exist")

    def publish_plain(
        self,
        tenant: str,
        namespace: str,
        stream: str,
        payloads: Sequence[bytes],
        shard: int | None,
        key: object,
    ) -> Plan[tuple[int, int, int]]:
        """A plain publish of a batch: idempotent under retries through a borrowed
        producer unless the client was made with ``idempotent_publish=False``; returns
        (shard, first offset, count)."""
        if not self.idempotent_publish:
            return (yield from self.publish(tenant, namespace, stream, payloads, shard, key, None))
        return (yield from self.with_borrowed_producer(
            self.publish, tenant, namespace, stream, payloads, shard, key))

    def publish_single(
        self, tenant: str, namespace: str, stream: str, payload: bytes, shard: int | None, key: object,
    ) -> Plan[Published]:
        """A plain publish of one payload, as :meth:`publish_plain`, through
        :meth:`publish_one`'s quick path where the caches allow. (Not a generator
        itself: it hands out the plan that runs, one frame less on the hot path.)"""
        if not self.idempotent_publish:
            return self.publish_one(tenant, namespace, stream, payload, shard, key, None)
        return self.with_borrowed_producer(self.publish_one, tenant, namespace, stream, payload, shard, key)

    def with_borrowed_producer(
        self, publish: Callable[..., Plan[T]], *args: Any
    ) -> Plan[T]:
        """``publish(*args, producer)`` with a producer borrowed from the pool for its
        length. When the shard forgot that producer's last sequences (a failover lost
        them), nothing was written and the producer starts over under a new secret, so
        it runs once more, as a first publish: the caller never chose a sequence."""
        state = self.producers.acquire()
        try:
            try:
                return (yield from publish(*args, state))
            except SequenceError:
                return (yield from publish(*args, state))
        finally:
            self.producers.release(state)

    def publish_one(
        self, tenant: str, namespace: str, stream: str, payload: bytes, shard: int | None, key: object,
        producer: ProducerState | None,
    ) -> Plan[Published]:
        """One payload with ``producer`` (held by the caller; None: without producer
        state): the script call straight away when the caches allow
        (:meth:`quick_publish`), else :meth:`publish`."""
        if producer is None or (quick := self.quick_publish(
                tenant, namespace, stream, payload, shard, key, producer)) is None:
            s, first, _count = yield from self.publish(tenant, namespace, stream, [payload], shard, key, producer)
            return Published(s, first)
        op, slot = quick
        try:
            reply = yield op
        except FelixError as exc:
            reply = yield from self.publish_failed(producer, op, exc)
        except BaseException:
            producer.reset()  # interrupted or cancelled with the outcome unknown
            raise
        producer.sequences[slot] = op.args[2]
        return Published(slot[1], int(reply[0]))

    def shard_target(self, name: StreamName, shard: int) -> tuple[list[str], str]:
        """The keys publish takes (meta, log, conf) of a checked shard, and the context
        errors name."""
        where = (name.path, shard, name.spread)
        hit = self._shards.get(where) if type(shard) is int else None
        if hit is None:
            hit = (name.publish_keys(shard), f"stream {name.path} shard {shard}")
            if type(shard) is int:
                _remember(self._shards, where, hit)
        return hit

    def choose_shard(self, settings: StreamSettings, shard: int | None, key: bytes | None) -> int:
        if key is not None and shard is None:
            return shard_for_key(key, settings.shards)
        return next(self._round_robin) % settings.shards

    def publish(
        self,
        tenant: str,
        namespace: str,
        stream: str,
        payloads: Sequence[bytes],
        shard: int | None,
        key: object,
        producer: ProducerState | None,
    ) -> Plan[tuple[int, int, int]]:
        """Publishes payloads to one shard; returns (shard, first offset, count)."""
        name = self.name(tenant, namespace, stream)
        raw_key = None if key is None else check_record_key(key)
        if not payloads:
            raise InvalidArgument("nothing to publish: the batch is empty")
        if len(payloads) > C.MAX_BATCH:
            raise InvalidArgument(f"a batch holds at most {C.MAX_BATCH} payloads, got {len(payloads)}")
        settings = self.fresh_settings(name.path) or (yield from self.settings(name))
        name = self.laid(name, settings)
        for i, payload in enumerate(payloads):
            if len(payload) > settings.max_payload:
                raise InvalidArgument(
                    f"stream {name.path}: payload {i} is {len(payload)} bytes; this stream accepts "
                    f"at most {settings.max_payload}"
                )
        if shard is not None:
            shard = self.shard_of(name, settings, shard)
        else:
            shard = self.choose_shard(settings, None, raw_key)
        keys, context = self.shard_target(name, shard)
        trims = bool(settings.max_len or settings.max_age)
        if producer is None:
            reply = yield Eval(
                "publish", keys, [raw_key or b"", b"", 0, self.producer_idle_ms, *payloads],
                context, settings.replicas,
            )
            if trims:
                yield from self.maybe_trim(name, settings, shard, reply)
            return shard, int(reply[0]), int(reply[1])
        # One plan at a time per producer (the caller holds its lock, or borrowed it
        # from the pool): its sequences reach a shard in order.
        if producer.producer_id is None:
            producer.producer_id = new_producer_secret()
        pid = producer.producer_id
        slot = (name.path, shard)
        seq = producer.sequences.get(slot, 0) + 1
        op = Eval(
            "publish", keys,
            [raw_key or b"", pid, seq, self.producer_idle_ms, *payloads],
            context, settings.replicas,
        )
        try:
            reply = yield op
        except FelixError as exc:
            reply = yield from self.publish_failed(producer, op, exc)
        except BaseException:
            # Cancelled with the outcome unknown.
            producer.reset()
            raise
        producer.sequences[slot] = seq
        if trims:
            yield from self.maybe_trim(name, settings, shard, reply)
        return shard, int(reply[0]), int(reply[1])

    def publish_failed(self, producer: ProducerState, op: Eval, exc: FelixError) -> Plan[Any]:
        """The rest of a producer's publish after its first send ``op`` failed with
        ``exc``: the reply of a second send, or the error. One plan at a time per producer."""
        try:
            if not isinstance(exc, ConnectionFailed):
                raise exc
            # Outcome unknown: one more try with the same sequence is answered from the
            # shard's memory if the first landed.
            yield Sleep(0.05 + random.random() * 0.1)
            return (yield op)
        except (ConnectionFailed, SequenceError, NotReplicated):
            # Unknown outcome (lost twice; or applied on the primary only, which a
            # failover may undo) or a sequence the shard refused: start over as a new
            # producer, so the next publish can neither hit a gap nor be mistaken for a
            # re-send of this one.
            producer.reset()
            raise
        except FelixError:
            # Refused before anything was written: the sequence is still free.
            raise
        except BaseException:
            # Cancelled with the outcome unknown.
            producer.reset()
            raise

    def quick_publish(
        self, tenant: object, namespace: object, stream: object, payload: bytes, shard: object,
        key: object, producer: ProducerState,
    ) -> tuple[Eval, tuple[str, int]] | None:
        """The drivers' fast path for one payload with a producer: the script call of
        :meth:`publish` and the (stream, shard) slot its sequence is for, built in one
        step from the caches, without a plan. None when the checked plan must run: a
        name not seen before, settings not cached or stale, a stream with retention (it
        trims after publishing), a shard that is not a plain int in range, an oversize
        payload, or a producer without an id yet. The driver runs the call, hands a
        FelixError to :meth:`publish_failed`, resets the producer on any other
        exception, and on success stores the sequence (``producer.sequences[slot]``)."""
        if type(tenant) is not str or type(namespace) is not str or type(stream) is not str:
            return None
        name = self._names.get((tenant, namespace, stream))
        if name is None:
            return None
        path = name.path
        settings = self._settings.get(path)
        if (settings is None or time.monotonic() - settings.loaded_at >= self.settings_ttl_s
                or settings.max_len or settings.max_age or len(payload) > settings.max_payload):
            return None
        pid = producer.producer_id
        if pid is None:
            return None
        raw_key = b"" if key is None else check_record_key(key)
        if shard is None:
            shard = shard_for_key(raw_key, settings.shards) if key is not None else (
                next(self._round_robin) % settings.shards)
        elif type(shard) is not int or not 0 <= shard < settings.shards:
            return None
        keys, context = self.shard_target(self.laid(name, settings), shard)
        slot = (path, shard)
        op = Eval(
            "publish", keys,
            [raw_key, pid, producer.sequences.get(slot, 0) + 1, self.producer_idle_ms, payload],
            context, settings.replicas,
        )
        return op, slot

    # -- retention

    def maybe_trim(self, name: StreamName, settings: StreamSettings, shard: int, reply: list[Any]) -> Plan[None]:
        """After a publish: trim the shard once it outgrew its retention by a slack of
        10 % (at most 1000 records), or, for an age limit, at most once a second."""
        if not (settings.max_len or settings.max_age):
            return
        # reply[4]: meta's 'first', a hint a publisher may have deleted or garbled by
        # hand; then the trim (which reads the first record kept from the log) is due
        hint = "" if reply[4] is None else _text(reply[4])
        first = int(hint) if hint.isascii() and hint.isdigit() else 0
        kept = int(reply[0]) + int(reply[1]) - first
        due = settings.max_len and kept > settings.max_len + max(1, min(1000, settings.max_len // 10))
        if settings.max_age and not due:
            last = self._last_trim.get((name.path, shard), 0.0)
            due = time.monotonic() - last >= 1.0
        if due:
            self._last_trim[(name.path, shard)] = time.monotonic()
            # best effort: the next publish (or stream_trim) tries again
            with contextlib.suppress(FelixError):
                yield from self.trim_shard(name, shard)

    def trim_shard(self, name: StreamName, shard: int) -> Plan[int]:
        groups_key = name.groups_key(shard)
        for attempt in range(10):
            groups = sorted(_text(g) for g in (yield Cmd("SMEMBERS", groups_key, key=groups_key)))
            keys = name.info_keys(shard)
            for group in groups:
                keys += name.group_keys(shard, group)[:1] + name.group_keys(shard, group)[5:6]
            try:
                reply = yield Eval("stream_trim", keys, [len(groups), *groups], f"stream {name.path} shard {shard}")
                return int(reply[0])
            except Conflict:
                if attempt == 9:
                    raise
        return 0

    def stream_trim(self, tenant: str, namespace: str, stream: str) -> Plan[int]:
        """Applies retention to every shard now; returns the records trimmed."""
        name = self.name(tenant, namespace, stream)
        settings = yield from self.settings(name)
        name = self.laid(name, settings)
        total = 0
        for shard in range(settings.shards):
            total += yield from self.trim_shard(name, shard)
        return total

    # -- groups

    def group_create(
        self,
        tenant: str,
        namespace: str,
        stream: str,
        group: str,
        start: object = "earliest",
        visibility_timeout_ms: int | None = None,
        max_attempts: int | None = None,
    ) -> Plan[None]:
        name = self.name(tenant, namespace, stream)
        check_name(group, "group")
        if isinstance(start, str) and start in C.STARTS:
            start_arg: object = start
        elif isinstance(start, int) and not isinstance(start, bool):
            start_arg = check_int(start, "start offset", 0, 2**52)
        else:
            raise InvalidArgument(f"start must be 'earliest', 'latest' or an offset, got {start!r}")
        # a default from the environment is named as such when it is out of range
        vt_what, attempts_what = "visibility_timeout_ms", "max_attempts"
        if visibility_timeout_ms is None:
            visibility_timeout_ms = C.env_int(C.ENV_VISIBILITY_TIMEOUT_MS, C.DEFAULT_VISIBILITY_TIMEOUT_MS)
            vt_what = f"visibility_timeout_ms (${C.ENV_VISIBILITY_TIMEOUT_MS})"
        vt = check_int(visibility_timeout_ms, vt_what, 1, C.MAX_VISIBILITY_TIMEOUT_MS)
        if max_attempts is None:
            max_attempts = C.env_int(C.ENV_MAX_ATTEMPTS, C.DEFAULT_MAX_ATTEMPTS)
            attempts_what = f"max_attempts (${C.ENV_MAX_ATTEMPTS})"
        attempts = check_int(max_attempts, attempts_what, 1, C.MAX_ATTEMPTS_LIMIT)
        settings = yield from self.settings(name)
        name = self.laid(name, settings)
        context = f"group {group} on stream {name.path}"
        group_key = name.group_keys(0, group)[0]
        kind = _text((yield Cmd("TYPE", group_key, key=group_key)))
        if kind == "hash":
            raise GroupExists(f"{context}: group exists already")
        if kind != "none":
            raise WrongKeyType(
                f"{context}: key {group_key} holds a {kind} where felix-redis keeps a hash; "
                "another application wrote it")
        # Every shard validates first (check=1 writes nothing); then shard 0 last and
        # strict: it decides whether the group exists, so a group made on some shards
        # only is not listed, and running the same call again completes it.

        def ops(check: int) -> Iterable[Eval]:
            for shard in reversed(range(settings.shards)):
                yield Eval(
                    "group_create",
                    [*name.shard_keys(shard), *name.group_keys(shard, group), name.groups_key(shard)],
                    [group, start_arg, vt, attempts, 1 if shard == 0 else 0, check],
                    f"{context} shard {shard}", 0 if check else settings.replicas,
                )
        yield from ops(1)
        yield from self.each_shard(ops(0))

    def group_configure(
        self,
        tenant: str,
        namespace: str,
        stream: str,
        group: str,
        visibility_timeout_ms: int | None = None,
        max_attempts: int | None = None,
    ) -> Plan[None]:
        name = self.name(tenant, namespace, stream)
        check_name(group, "group")
        vt = "" if visibility_timeout_ms is None else check_int(
            visibility_timeout_ms, "visibility_timeout_ms", 1, C.MAX_VISIBILITY_TIMEOUT_MS)
        attempts = "" if max_attempts is None else check_int(
            max_attempts, "max_attempts", 1, C.MAX_ATTEMPTS_LIMIT)
        settings = yield from self.settings(name)
        name = self.laid(name, settings)

        def ops(check: int) -> Iterable[Eval]:
            for shard in range(settings.shards):
                yield Eval(
                    "group_configure", [*name.shard_keys(shard), *name.group_keys(shard, group)],
                    [vt, attempts, check], f"group {group} on stream {name.path} shard {shard}",
                    0 if check else settings.replicas,
                )
        yield from ops(1)
        yield from self.each_shard(ops(0))

    def group_keys(
        self, tenant: str, namespace: str, stream: str, group: str, shard: int | None
    ) -> Plan[dict[int, dict[str, str]]]:
        name = self.name(tenant, namespace, stream)
        check_name(group, "group")
        settings = yield from self.settings(name)
        name = self.laid(name, settings)
        shards = range(settings.shards) if shard is None else [self.shard_of(name, settings, shard)]
        roles = ("meta", "log", "groups", *GROUP_ROLES)
        return {
            s: dict(zip(roles, [*name.shard_keys(s), name.groups_key(s), *name.group_keys(s, group)], strict=True))
            for s in shards
        }

    def group_list(self, tenant: str, namespace: str, stream: str) -> Plan[list[str]]:
        info = yield from self.stream_describe(tenant, namespace, stream)
        return info.groups

    def group_delete(self, tenant: str, namespace: str, stream: str, group: str) -> Plan[None]:
        name = self.name(tenant, namespace, stream)
        check_name(group, "group")
        settings = yield from self.settings(name)
        name = self.laid(name, settings)

        # Shard 0 last, as group_create makes it last: while it holds the group, the
        # group is listed, a group_create of the name is refused (GroupExists) and a
        # delete that stopped part-way is completed by running it again.
        def ops(check: int) -> Iterable[Eval]:
            for shard in reversed(range(settings.shards)):
                yield Eval(
                    "group_delete",
                    [*name.shard_keys(shard), *name.group_keys(shard, group), name.groups_key(shard)],
                    [group, check], f"group {group} on stream {name.path} shard {shard}",
                    0 if check else settings.replicas,
                )
        existed = 0
        for op in ops(1):
            existed += yield op
        if not existed:
            raise NotFound(f"group {group} on stream {name.path} does not exist")
        yield from self.each_shard(ops(0))

    def group_target(
        self, tenant: Any, namespace: Any, stream: Any, shard: Any, group: Any
    ) -> tuple[StreamName, StreamSettings, int, list[str], str] | None:
        """What :meth:`_group_op` returns, from the cache and without a round trip, for a
        group and shard it checked before while the stream's settings are fresh; else
        None. The keys list is shared: callers must not change it."""
        if not _plain(tenant, namespace, stream, shard, group):
            return None
        hit = self._groups.get((tenant, namespace, stream, shard, group))
        if hit is None:
            return None
        name, path, keys, context = hit
        settings = self.fresh_settings(path)
        if settings is None or shard >= settings.shards or name.spread != settings.spread:
            return None
        return name, settings, shard, keys, context

    def _group_op(
        self, tenant: str, namespace: str, stream: str, shard: object, group: str
    ) -> Plan[tuple[StreamName, StreamSettings, int, list[str], str]]:
        hit = self.group_target(tenant, namespace, stream, shard, group)
        if hit is not None:
            return hit
        name = self.name(tenant, namespace, stream)
        check_name(group, "group")
        settings = yield from self.settings(name)
        name = self.laid(name, settings)
        checked = self.shard_of(name, settings, shard)
        keys, context = self.group_shard_keys(name, checked, group)
        return name, settings, checked, keys, context

    def group_shard_keys(self, name: StreamName, shard: int, group: str) -> tuple[list[str], str]:
        """The keys of a group on a shard (shard roles, then group roles) and the context
        errors name; ``shard`` and ``group`` must have been checked. The keys list is
        shared: callers must not change it."""
        where = (name.tenant, name.namespace, name.stream, shard, group)
        plain = _plain(*where)
        hit = self._groups.get(where) if plain else None
        if hit is None or hit[0].spread != name.spread:
            keys = [*name.shard_keys(shard), *name.group_keys(shard, group)]
            hit = (name, name.path, keys, f"group {group} on stream {name.path} shard {shard}")
            if plain:
                _remember(self._groups, where, hit)
        return hit[2], hit[3]

    def group_poll(
        self,
        tenant: str,
        namespace: str,
        stream: str,
        shard: int,
        group: str,
        max_records: int = 16,
        wait: float | None = None,
        consumer: str | None = None,
        reclaim: bool = False,
        ack: Iterable[object] | None = None,
    ) -> Plan[list[Record]]:
        if type(max_records) is not int or not 1 <= max_records <= C.MAX_RECORDS_PER_POLL:
            max_records = check_int(max_records, "max_records", 1, C.MAX_RECORDS_PER_POLL)
        wait_ms = 0 if wait is None else seconds_to_ms(wait, "wait", 0, C.MAX_DELAY_MS)
        if consumer is not None:
            check_name(consumer, "consumer")
        elif reclaim:
            raise InvalidArgument("reclaim needs a consumer name")
        _name, settings, shard, keys, context = self.group_target(tenant, namespace, stream, shard, group) \
            or (yield from self._group_op(tenant, namespace, stream, shard, group))
        deadline = time.monotonic() + wait_ms / 1000
        args: list[Any] = [max_records, consumer or "", 1 if reclaim else 0]
        if ack is not None:
            args += ack_offsets(ack, shard)
        while True:
            reply = yield Eval("group_poll", keys, args, context, settings.replicas)
            count = int(reply[4])
            if count or wait_ms <= 0:
                return parse_delivered(reply, 5, count, shard)
            del args[3:]  # the acks went with the first call
            args[2] = 0  # reclaim once
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return []
            block_ms = left_ms
            due = int(reply[1])
            if due >= 0:
                block_ms = max(1, min(block_ms, due - int(reply[0]) + 1))
            yield BlockAny(wake_points(keys, reply), block_ms, context)

    def sharded_poll(
        self,
        tenant: str,
        namespace: str,
        stream: str,
        group: str,
        max_records: int,
        wait: float | None,
        consumer: str | None,
        reclaimed: set[int],
        cursor: int,
        reclaim: bool = True,
        only: Sequence[int] | None = None,
        ack: dict[int, list[Any]] | None = None,
    ) -> Plan[tuple[list[Record], int]]:
        """Polls every shard fairly: a quota per shard first (starting from a rotating
        shard), then what is left from shards that had more. Returns (records, cursor).
        ``ack``: records to ack first, by shard; each shard's ride on its first poll of
        this call, those of shards not polled in the first pass go in the same round trip.
        When a call that carried acks fails, the poll raises (ack those records again)."""
        max_records = check_int(max_records, "max_records", 1, C.MAX_RECORDS_PER_POLL)
        wait_ms = 0 if wait is None else seconds_to_ms(wait, "wait", 0, C.MAX_DELAY_MS)
        if consumer is not None:
            check_name(consumer, "consumer")
        name = self.name(tenant, namespace, stream)
        check_name(group, "group")
        settings = yield from self.settings(name)
        name = self.laid(name, settings)
        chosen = list(range(settings.shards)) if only is None else [
            self.shard_of(name, settings, s) for s in dict.fromkeys(only)]
        if not chosen:
            raise InvalidArgument("a sharded group needs at least one shard")
        shards = len(chosen)
        context = f"group {group} on stream {name.path}"
        acks: dict[int, list[int]] = {}
        for shard, refs in (ack or {}).items():
            checked = self.shard_of(name, settings, shard)
            acks[checked] = ack_offsets(refs, checked)
        deadline = time.monotonic() + wait_ms / 1000
        quota = max(1, max_records // shards)
        while True:
            order = [chosen[(cursor + i) % shards] for i in range(shards)]
            cursor = (cursor + 1) % shards
            out: list[Record] = []
            more: list[int] = []
            points: dict[str, str] = {}
            block_ms = -1

            def call(shard: int, want: int) -> Eval:
                first = reclaim and consumer is not None and shard not in reclaimed
                if first:
                    reclaimed.add(shard)
                keys, shard_context = self.group_shard_keys(name, shard, group)
                args: list[Any] = [want, consumer or "", 1 if first else 0]
                if shard in acks:
                    args += acks.pop(shard)
                return Eval("group_poll", keys, args, shard_context, settings.replicas)

            def ack_call(shard: int, offsets: list[int]) -> Eval:
                keys, shard_context = self.group_shard_keys(name, shard, group)
                return Eval("group_ack", keys, offsets, shard_context, settings.replicas)

            def take(
                shard: int, want: int, reply: list[Any], out: list[Record] = out, points: dict[str, str] = points
            ) -> bool:
                """Adds the reply's records; True when the shard may have more."""
                nonlocal block_ms
                count = int(reply[4])
                out.extend(parse_delivered(reply, 5, count, shard))
                points.update(wake_points(self.group_shard_keys(name, shard, group)[0], reply))
                due = int(reply[1])
                if due >= 0:
                    until = max(1, due - int(reply[0]) + 1)
                    block_ms = until if block_ms < 0 else min(block_ms, until)
                return count == want

            # pass 1: a quota from each shard, all of them in one round trip
            first_pass = order[: min(shards, max_records)]
            calls = [call(shard, quota) for shard in first_pass]
            carried = [len(c.args) > 3 for c in calls]
            # acks of shards this pass does not poll
            calls += [ack_call(shard, offsets) for shard, offsets in acks.items()]
            carried += [True] * len(acks)
            acks.clear()
            replies = yield Batch(calls)
            failure: FelixError | None = None
            ack_failure: FelixError | None = None
            for i, reply in enumerate(replies):
                if isinstance(reply, (ConnectionFailed, NotReplicated)):
                    failure = failure or reply
                    if carried[i]:
                        ack_failure = ack_failure or reply
                elif isinstance(reply, FelixError):
                    raise reply
                elif i < len(first_pass) and take(first_pass[i], quota, reply):
                    more.append(first_pass[i])
            if ack_failure is not None:
                raise ack_failure
            if failure is not None:
                if out:
                    return out, cursor  # hand out what other shards leased rather than let it lapse
                raise failure
            # pass 2: what is left, one shard at a time: shards pass 1 left out (when there
            # are more shards than records wanted), then those that had more
            for shard in order[len(first_pass):] + more:
                want = max_records - len(out)
                if want <= 0:
                    break
                try:
                    take(shard, want, (yield call(shard, want)))
                except (ConnectionFailed, NotReplicated):
                    if out:
                        return out, cursor
                    raise
            if out or wait_ms <= 0:
                return out, cursor
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return [], cursor
            block_ms = left_ms if block_ms < 0 else min(block_ms, left_ms)
            yield BlockAny(list(points.items()), block_ms, context)

    def ack_sharded(
        self, tenant: str, namespace: str, stream: str, group: str, by_shard: dict[int, list[Any]]
    ) -> Plan[int]:
        """Acks records of several shards: one script call per shard, one round trip."""
        calls = []
        for shard, refs in by_shard.items():
            _name, settings, shard, keys, context = self.group_target(tenant, namespace, stream, shard, group) \
                or (yield from self._group_op(tenant, namespace, stream, shard, group))
            offsets = offsets_of(refs, shard)
            for start in range(0, len(offsets), C.MAX_BATCH):
                calls.append(Eval("group_ack", keys, offsets[start:start + C.MAX_BATCH], context, settings.replicas))
        if not calls:
            return 0
        replies = yield Batch(calls)
        for reply in replies:
            if isinstance(reply, FelixError):
                raise reply
        return sum(int(x) for reply in replies for x in reply)

    def group_ack(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str, refs: Iterable[object]
    ) -> Plan[list[bool]]:
        _name, settings, shard, keys, context = self.group_target(tenant, namespace, stream, shard, group) \
            or (yield from self._group_op(tenant, namespace, stream, shard, group))
        offsets = offsets_of(refs if type(refs) is list else check_list(refs, "offsets"), shard)
        if not offsets:
            return []
        if len(offsets) > C.MAX_BATCH:
            raise InvalidArgument(f"ack takes at most {C.MAX_BATCH} offsets at once")
        reply = yield Eval("group_ack", keys, offsets, context, settings.replicas)
        return [x == 1 or bool(int(x)) for x in reply]

    def group_nack(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str, ref: object,
        delay: float = 0.0,
    ) -> Plan[bool]:
        delay_ms = seconds_to_ms(delay, "delay", 0, C.MAX_DELAY_MS)
        _name, settings, shard, keys, context = yield from self._group_op(
            tenant, namespace, stream, shard, group)
        target = resolve(ref, shard, need_attempts=True)
        reply = yield Eval(
            "group_nack", keys, [target.offset, target.attempts, delay_ms], context, settings.replicas
        )
        return int(reply) == 2

    def group_extend(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str, ref: object,
        by: float | None = None,
    ) -> Plan[int]:
        by_ms: Any = "" if by is None else seconds_to_ms(by, "by", 1, C.MAX_DELAY_MS)
        _name, settings, shard, keys, context = yield from self._group_op(
            tenant, namespace, stream, shard, group)
        target = resolve(ref, shard, need_attempts=True)
        reply = yield Eval(
            "group_extend", keys, [target.offset, target.attempts, by_ms], context, settings.replicas
        )
        return int(reply)

    def group_dead_letter(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str, ref: object,
        reason: str = "",
    ) -> Plan[None]:
        if not isinstance(reason, str):
            raise InvalidArgument(f"reason must be a string, got {type(reason).__name__}")
        raw = reason.encode("utf-8")
        if len(raw) > C.MAX_REASON_BYTES:
            raise InvalidArgument(f"reason is {len(raw)} bytes; at most {C.MAX_REASON_BYTES}")
        _name, settings, shard, keys, context = yield from self._group_op(
            tenant, namespace, stream, shard, group)
        target = resolve(ref, shard, need_attempts=True)
        yield Eval(
            "group_dead_letter", keys, [target.offset, target.attempts, raw], context,
            settings.replicas,
        )

    def group_dead_letters(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str
    ) -> Plan[list[DeadLetter]]:
        _name, _settings, shard, keys, context = yield from self._group_op(
            tenant, namespace, stream, shard, group)
        reply = yield Eval("group_dead_letters", keys, [], context)
        out = []
        for i in range(0, len(reply), 2):
            try:
                attempts, ms, reason = _text(reply[i + 1]).split("|", 2)
                out.append(DeadLetter(shard, int(reply[i]), int(attempts), reason, int(ms)))
            except ValueError:
                raise FelixError(
                    f"{context}: dead-letter entry {_text(reply[i])!r} is not in felix-redis's format "
                    "(ATTEMPTS|MS|REASON); another application wrote it"
                ) from None
        out.sort(key=lambda d: d.offset)
        return out

    def _dead_op(
        self, script: str, tenant: str, namespace: str, stream: str, shard: int, group: str,
        offsets: Iterable[object] | None,
    ) -> Plan[int]:
        _name, settings, shard, keys, context = yield from self._group_op(
            tenant, namespace, stream, shard, group)
        if offsets is not None:
            chosen = offsets_of(check_list(offsets, "offsets"), shard)
            if not chosen:
                return 0
            if len(chosen) > C.MAX_BATCH:
                raise InvalidArgument(f"at most {C.MAX_BATCH} offsets at once")
            reply = yield Eval(script, keys, ["list", "0", *chosen], context, settings.replicas)
            return int(reply[0])
        total, cursor = 0, "0"
        for _ in range(1_000_000):
            reply = yield Eval(script, keys, ["all", cursor], context, settings.replicas)
            total += int(reply[0])
            cursor = _text(reply[1])
            if cursor == "0":
                break
        return total

    def group_redrive(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        offsets: Iterable[object] | None = None,
    ) -> Plan[int]:
        return (yield from self._dead_op("group_redrive", tenant, namespace, stream, shard, group, offsets))

    def group_discard(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        offsets: Iterable[object] | None = None,
    ) -> Plan[int]:
        return (yield from self._dead_op("group_discard", tenant, namespace, stream, shard, group, offsets))

    def group_describe(self, tenant: str, namespace: str, stream: str, group: str) -> Plan[GroupInfo]:
        name = self.name(tenant, namespace, stream)
        check_name(group, "group")
        settings = yield from self.settings(name)
        name = self.laid(name, settings)
        states = []
        vt = attempts = 0
        for shard in range(settings.shards):
            try:
                r = yield Eval(
                    "group_describe", [*name.shard_keys(shard), *name.group_keys(shard, group)], [],
                    f"group {group} on stream {name.path} shard {shard}",
                )
            except NotFound:
                if shard == 0:
                    raise
                # shard 0 has it, this one not: a group_delete that stopped part-way
                raise NotFound(
                    f"group {group} on stream {name.path} is incomplete: shard 0 has it, shard {shard} not "
                    "(a group_delete stopped part-way); run group_delete again to finish it") from None
            position, tail, nxt = int(r[0]), int(r[1]), int(r[2])
            age = int(r[6])
            vt, attempts = int(r[8]), int(r[9])
            states.append(ShardState(
                shard=shard, position=position, tail=tail, lag=tail - position,
                pending=tail - nxt, owed=int(r[3]), in_flight=int(r[4]), dead=int(r[5]),
                oldest_unfinished_age_ms=None if age < 0 else age, trimmed=int(r[7]),
            ))
        return GroupInfo(tenant, namespace, stream, group, vt, attempts, states)

    # -- reading (subscribers, replay)

    def read(
        self, tenant: str, namespace: str, stream: str, shard: int, start: int, count: int = 100
    ) -> Plan[tuple[list[Record], int, int]]:
        """Records from ``start`` on; returns (records, tail, first offset kept)."""
        name = self.name(tenant, namespace, stream)
        settings = yield from self.settings(name)
        name = self.laid(name, settings)
        shard = self.shard_of(name, settings, shard)
        start = check_int(start, "start offset", 0, 2**52)
        count = check_int(count, "count", 1, C.MAX_RECORDS_PER_POLL)
        reply = yield Eval(
            "stream_read", name.shard_keys(shard), [start, count],
            f"stream {name.path} shard {shard}",
        )
        return parse_records(reply, 3, int(reply[2]), shard), int(reply[0]), int(reply[1])

    def subscribe_start(
        self, tenant: str, namespace: str, stream: str, start: object, shards: Iterable[int] | None
    ) -> Plan[dict[int, int]]:
        """Where a subscriber starts on each shard: {shard: next offset to read}."""
        name = self.name(tenant, namespace, stream)
        settings = yield from self.settings(name)
        name = self.laid(name, settings)
        chosen = list(range(settings.shards)) if shards is None else [
            self.shard_of(name, settings, s) for s in shards]
        if not chosen:
            raise InvalidArgument("subscribe needs at least one shard")
        cursors: dict[int, int] = {}
        for shard in chosen:
            if isinstance(start, dict):
                if shard not in start:
                    raise InvalidArgument(f"start has no offset for shard {shard}")
                cursors[shard] = check_int(start[shard], f"start offset of shard {shard}", 0, 2**52)
            elif isinstance(start, int) and not isinstance(start, bool):
                cursors[shard] = check_int(start, "start offset", 0, 2**52)
            elif start in C.STARTS:
                reply = yield Eval(
                    "stream_info", name.info_keys(shard), [],
                    f"stream {name.path} shard {shard}",
                )
                first, tail = _stream_tails(reply)
                cursors[shard] = first if start == "earliest" else tail
            else:
                raise InvalidArgument(
                    f"start must be 'earliest', 'latest', an offset or {{shard: offset}}, got {start!r}")
        return cursors

    def subscribe_step(
        self, tenant: str, namespace: str, stream: str, cursors: dict[int, int], batch: int,
        block_ms: int,
    ) -> Plan[list[Record]]:
        """The next records after ``cursors`` (advanced in place), in offset order per
        shard; blocks up to ``block_ms`` for new ones when there are none."""
        name = self.name(tenant, namespace, stream)
        name = self.laid(name, (yield from self.settings(name)))
        deadline = time.monotonic() + block_ms / 1000
        while True:
            out: list[Record] = []
            points: list[tuple[str, str]] = []
            for shard, start in cursors.items():
                records, tail, _first = yield from self.read(tenant, namespace, stream, shard, start, batch)
                if records:
                    cursors[shard] = records[-1].offset + 1
                    out += records
                else:
                    points.append((name.shard_keys(shard)[1], f"{max(tail, start)}-0"))
            left_ms = int((deadline - time.monotonic()) * 1000)
            if out or left_ms <= 0:
                return out
            yield BlockAny(points, left_ms, f"stream {name.path}")


def _stream_tails(reply: list[Any]) -> tuple[int, int]:
    meta = _pairs(reply[0])
    return int(meta["first"]), int(meta["tail"])


def wake_points(keys: list[str], reply: list[Any]) -> list[tuple[str, str]]:
    """Where a long-poller blocks after an empty poll: the log after the tail the poll
    saw, and the group's wake stream after the wake sequence it saw. Anything that
    happens after the poll has a larger ID, so no wake-up is missed."""
    return [(keys[1], f"{int(reply[2])}-0"), (keys[11], f"{int(reply[3])}-1")]


def _pairs(flat: list[Any]) -> dict[str, Any]:
    return {_text(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}
