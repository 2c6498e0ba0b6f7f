"""The ops a plan yields and what a driver does when one fails.

A plan (:mod:`felix_redis.protocol`) is a generator that yields ops: :class:`Eval`
(one script call), :class:`Cmd` (one plain command), :class:`BlockAny` (block until
one of some streams moves), :class:`Batch` (script calls in one round trip) and
:class:`Sleep`; the driver sends each back its reply, or throws in the FelixError it
raised. Which ops may be sent again after a lost reply, and how long a driver keeps
trying, is decided here once for both drivers.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Generator, Sequence
from typing import Any, NamedTuple, TypeVar

from felix_redis.errors import ConnectionFailed, OutcomeUnknown, PermissionDenied
from felix_redis.keys import GROUP_ROLES, SHARD_ROLES

T = TypeVar("T")


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
    driver blocks on each slot at once. The answer is XREAD's (None when nothing moved,
    or the streams that did, as :func:`moved_keys` reads them; on Cluster those of the
    slot that answered first), or :attr:`FAILED` after a failed block: the next poll
    then reports any real failure. A driver may return early (it caps blocks below its
    socket timeout). With ``bell`` (a group's bell key, ``streams`` empty) it waits on
    the bell instead: one BZPOPMIN, answered as the pop (None: nothing rang); a user
    without the command gets PermissionDenied thrown in.

    ``then``: a script call to run right after the block, on the same connection in the
    same write (a pipeline: Redis runs it the moment the block returns, so a wake-up and
    the call it leads to cost one round trip, not two). A driver that ran it answers
    :class:`Took`; one that could not (Redis Cluster, ``memory://``, a client with no
    lane pool: :func:`felix_redis.lane.lane_pool`) or whose call failed (a missing library, a failover) answers as
    without ``then``, and the plan sends the call itself."""

    __slots__ = ("bell", "block_ms", "context", "streams", "then")

    #: what a driver answers for a block that failed (the connection was lost): the
    #: plan cannot tell what moved while it was not looking
    FAILED: Any = object()

    def __init__(
        self, streams: list[tuple[str, str]], block_ms: int, context: str = "", bell: str | None = None,
        then: Eval | None = None,
    ) -> None:
        self.streams = streams
        self.block_ms = block_ms
        self.context = context
        self.bell = bell
        self.then = then


class Took(NamedTuple):
    """A driver's answer to a :class:`BlockAny` whose ``then`` it ran behind the block."""

    #: the block's own answer (as without ``then``)
    moved: Any
    #: the reply of the ``then`` call
    reply: Any


class Batch:
    """Several script calls (or plain commands) in one round trip (a pipeline, no
    transaction). The reply is a list holding each call's reply, or the FelixError it
    raised. On Redis Cluster, where shards live on different nodes, a driver sends one
    pipeline per node; it may run calls one by one instead (calls that WAIT)."""

    __slots__ = ("ops",)

    def __init__(self, ops: Sequence[Eval | Cmd]) -> None:
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
    # a schedule's due time is published once however often it is sent (docs/schedules.md)
    "schedule_due", "schedule_fire", "schedule_set",
})
RETRY_SAFE_COMMANDS = frozenset({
    "INFO", "EXISTS", "TYPE", "SMEMBERS", "SADD", "ZRANGE", "ZADD", "ZREM", "PING", "HGETALL",
    "XREAD",  # a sharded poll's look at idle shards' wake points (never blocking in a Batch)
    "DEL",  # a deleted group's bell (deleting twice is deleting once)
})
#: Error replies that mean "this node cannot take the call now" (a failover or restart
#: is under way; UNBLOCKED: a block cut short because the server became a replica);
#: treated like a lost connection.
TRANSIENT_ERRORS = ("READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "NOREPLICAS", "UNBLOCKED")


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
        if exc.final:
            raise exc
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


def moved_keys(reply: Any) -> set[str]:
    """The keys an XREAD reply has entries for (RESP2 list or RESP3 map; None: none)."""
    if not reply:
        return set()
    keys = reply.keys() if isinstance(reply, dict) else (entry[0] for entry in reply)
    return {key.decode() if isinstance(key, bytes) else str(key) for key in keys}


def xread_calls(op: BlockAny, keyslot: Any, max_block_ms: int) -> list[list[Any]]:
    """The XREAD BLOCK commands for ``op``: one when every key shares a slot, else one
    per slot (Redis Cluster), each blocking at most ``max_block_ms``; for a bell, its
    one BZPOPMIN (timeout in seconds)."""
    if op.bell is not None:
        return [["BZPOPMIN", op.bell, min(op.block_ms, max_block_ms) / 1000]]
    by_slot: dict[int, list[tuple[str, str]]] = {}
    for key, last in op.streams:
        by_slot.setdefault(keyslot(key) if keyslot else 0, []).append((key, last))
    block_ms = min(op.block_ms, max_block_ms)
    return [["XREAD", "COUNT", 1, "BLOCK", block_ms, "STREAMS", *[k for k, _ in points], *[i for _, i in points]]
            for points in by_slot.values()]


#: Where a group's log and wake stream stand in the keys of a group on a shard
#: (:meth:`felix_redis.keys.StreamName.shard_keys`, then ``group_keys``).
_LOG = SHARD_ROLES.index("log")
_WAKE = len(SHARD_ROLES) + GROUP_ROLES.index("wake")


def wake_points(keys: list[str], reply: list[Any]) -> list[tuple[str, str]]:
    """Where a long-poller blocks after an empty poll: the log after the tail the poll
    saw, and the group's wake stream after the wake sequence it saw. Anything that
    happens after the poll has a larger ID, so no wake-up is missed. ``keys``: the
    group's keys on the shard, as a poll takes them."""
    return [(keys[_LOG], f"{int(reply[2])}-0"), (keys[_WAKE], f"{int(reply[3])}-1")]


def read_wake_points(keys: list[str], points: list[tuple[str, str]]) -> tuple[int, int] | None:
    """The log offset and wake sequence :func:`wake_points` made ``points`` of (``keys``:
    the same shard's); None when they hold no points of those keys."""
    at = dict(points)
    log_id, wake_id = at.get(keys[_LOG]), at.get(keys[_WAKE])
    if log_id is None or wake_id is None:
        return None
    return int(log_id.split("-")[0]), int(wake_id.split("-")[0])


#: This process' part of a long-poller's name in a group's watch (lua/group_poll.lua).
_WAITER_TOKEN = f"{random.getrandbits(40):010x}"


def waiter_name() -> str:
    """The name of the thread, or asyncio task, running a long poll in a group's watch:
    the same for each poll it makes, so a watcher that polls again keeps the watch."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        task = None
    ident = id(task) if task is not None else threading.get_ident()
    return f"{os.getpid():x}.{_WAITER_TOKEN}.{ident:x}"


class Ring(NamedTuple):
    """A ring popped from a group's bell, as lua/group_poll.lua writes it (member
    ``ID NEXT WSEQ DUEIN``, or ``ID NEXT WSEQ DUEIN SHARDS`` from a sharded group's
    watcher that took records: :func:`shards_points`): it hands the popper the group's
    watch."""

    #: the ring's id, named in the popper's next poll (which takes the watch it handed over)
    id: str
    #: the log offset and the wake sequence to watch from
    next_offset: int
    wake_seq: int
    #: in how many ms the next owed record or lease is due (-1: none)
    due_in: int
    #: a sharded group's ring: the watch's TTL and the other shards' points (else "")
    shards: str = ""

    @property
    def claim(self) -> str:
        """What the popper's next poll appends to its waiter argument."""
        return f" @{self.id}"

    def points(self, keys: list[str]) -> list[tuple[str, str]]:
        """Where the popper watches (:func:`wake_points`), ``keys`` the group's keys on
        the shard."""
        return wake_points(keys, [0, 0, self.next_offset, self.wake_seq])


def _number(text: str, signed: bool = False) -> bool:
    """``text`` is a decimal integer a ring may carry: at most 18 digits (below 2**63,
    so every point made of it is a stream ID Redis takes; a ring is written by whoever
    may ring the bell, so a forged one must not make a block fail), ``signed``: or -1."""
    if signed and text == "-1":
        return True
    return text.isdigit() and text.isascii() and len(text) <= 18


def read_ring(popped: Any) -> Ring | None:
    """The :class:`Ring` in a BZPOPMIN reply on a group's bell (key, member, score);
    None for no pop (a timeout, a failed block) or a member of another form (nothing to
    take)."""
    if not popped or popped is BlockAny.FAILED or len(popped) < 2:
        return None
    member = popped[1].decode() if isinstance(popped[1], bytes) else str(popped[1])
    parts = member.split(" ")
    if len(parts) not in (4, 5) or not _number(parts[1]) or not _number(parts[2]) \
            or not _number(parts[3], signed=True) or not parts[0].replace(".", "").isdigit() \
            or not parts[0].isascii() or len(parts[0]) > 40:
        return None
    return Ring(parts[0], int(parts[1]), int(parts[2]), int(parts[3]), parts[4] if len(parts) == 5 else "")


#: One shard's entry in a sharded group's ring: its points and due time (ms from the
#: ring: -1 none), or None: unknown (the popper asks the shard).
ShardPoints = tuple[int, int, int] | None


def shards_points(ttl_ms: int, shards: list[ShardPoints]) -> str:
    """What a sharded group's watcher that took records passes on in its ring
    (lua/group_poll.lua, ``+SHARDS``): the watch's TTL (ms), then each other shard's
    points and due time in ms (``NEXT.WSEQ.DUEIN``), or ``?`` for a shard it does not
    know idle."""
    items = ["?" if p is None else f"{p[0]}.{p[1]}.{p[2]}" for p in shards]
    return f"{ttl_ms}:{','.join(items)}"


def read_shards_points(text: str, count: int) -> tuple[int, list[ShardPoints]] | None:
    """The TTL and the ``count`` shards' entries of :func:`shards_points`; None for
    anything else (a ring of another form: nothing to take from it)."""
    ttl, sep, rest = text.partition(":")
    items = rest.split(",") if rest else []
    if not sep or not _number(ttl) or len(items) != count:
        return None
    out: list[ShardPoints] = []
    for item in items:
        if item == "?":
            out.append(None)
            continue
        fields = item.split(".")
        if len(fields) != 3 or not _number(fields[0]) or not _number(fields[1]) \
                or not _number(fields[2], signed=True):
            return None
        out.append((int(fields[0]), int(fields[1]), int(fields[2])))
    return int(ttl), out


def follow_bell(core: Any, bell: str, block_ms: int, context: str) -> Plan[tuple[Any, Ring | None]]:
    """A follower's wait in a group's watch: BZPOPMIN on the group's ``bell`` for up to
    ``block_ms``. Returns the pop (None: nothing rang, or the user may not BZPOPMIN) and
    the ring it holds, if any. A user whose ACL predates the bell (BZPOPMIN refused)
    turns ``core.bells`` off: its polls then watch the log themselves."""
    try:
        popped = yield BlockAny([], block_ms, context, bell=bell)
    except PermissionDenied:
        core.bells = False
        return None, None
    return popped, read_ring(popped)
