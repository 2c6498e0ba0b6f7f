"""What every operation sends and how its reply is read, written once.

Each operation is a *plan*: a generator that yields :class:`Eval` (one script call) or
:class:`Cmd` (one plain command) and receives the reply. The sync client and the asyncio
client only differ in how they execute a yielded op (see ``_drive`` in client.py and
asyncio.py), so argument building, reply parsing, validation and multi-step logic
(shards, long polls, retries) exist in one place.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from felix_redis import constants as C
from felix_redis.caches import Caches, StreamSettings, replicas_needed
from felix_redis.checks import (
    KEEP,
    MAX_OFFSET,
    Extras,
    ack_offsets,
    as_bytes,
    check_int,
    check_list,
    check_rate_limit,
    offsets_of,
    poll_ack_args,
    resolve,
    seconds_to_ms,
)
from felix_redis.errors import (
    Conflict,
    ConnectionFailed,
    FelixError,
    GroupExists,
    InvalidArgument,
    MalformedClaims,
    NotDelivered,
    NotFound,
    NotReplicated,
    PermissionDenied,
    SequenceError,
    WrongKeyType,
)
from felix_redis.keys import (
    GROUP_ROLES,
    STREAM_ROLE_CAPS,
    StreamName,
    capability_key,
    check_name,
    check_record_key,
    registry_key,
    shard_for_key,
    tenants_key,
    valid_name,
)
from felix_redis.models import DeadLetter, GroupInfo, Published, Record, ShardState, StreamInfo
from felix_redis.plans import (
    TRANSIENT_ERRORS,
    Batch,
    BlockAny,
    Cmd,
    Eval,
    Op,
    Plan,
    Retrying,
    Sleep,
    Took,
    follow_bell,
    retry_delays,
    retry_safe,
    waiter_name,
    wake_points,
    xread_calls,
)
from felix_redis.producers import ProducerPool, ProducerState, after_failed_send, new_producer_secret
from felix_redis.replies import as_text, flat_dict, parse_delivered, parse_records, stream_tails
from felix_redis.retention import Retention
from felix_redis.schedules import schedule_keys
from felix_redis.sharded import PollState, ShardedPoll, Source

__all__ = [
    # the plans' vocabulary, for the drivers (felix_redis.plans and friends hold them)
    "MAX_OFFSET", "TRANSIENT_ERRORS", "Batch", "BlockAny", "Cmd", "Core", "Eval", "Op", "Plan", "ProducerState",
    "Retrying", "Sleep", "StreamSettings", "as_bytes", "check_list", "new_producer_secret", "offsets_of", "resolve",
    "retry_delays", "retry_safe", "xread_calls",
]

T = TypeVar("T")
# quick_single's send: the producer (None: without producer state), the script call, its
# (stream, shard) slot, and whether the producer was borrowed from the pool
QuickSend = tuple[ProducerState | None, Eval, tuple[str, int], bool]
log = logging.getLogger(__name__)


def not_delivered(context: str, claims: list[str], statuses: list[int], one_shard: bool = False) -> NotDelivered:
    """The error for acks of which some named records never delivered (status -1): the
    others (1 acked now, 0 finished already) were settled, and it says so. ``claims``:
    SHARD:OFFSET of each status; ``one_shard``: the context names the shard, the message
    names offsets."""
    missing = [c for c, x in zip(claims, statuses, strict=True) if x == -1]
    names = [c.split(":", 1)[1] for c in missing] if one_shard else missing
    named = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    which = "record" if len(missing) == 1 else "records"
    message = f"{context}: {which} {named} {'has' if len(missing) == 1 else 'have'} not been delivered to this group"
    if len(statuses) > len(missing):
        settled = len(statuses) - len(missing)
        message += f"; the other {settled} {'was' if settled == 1 else 'were'} settled"
    return NotDelivered(message, [None if x == -1 else x == 1 for x in statuses], missing)


def readable_offsets(refs: list[Any], shard: int) -> tuple[list[int], dict[int, InvalidArgument]]:
    """The offsets of the references of ``refs`` that can be read, and the error of
    each that cannot, by its index; InvalidArgument when none can (nothing is sent)."""
    offsets: list[int] = []
    refused: dict[int, InvalidArgument] = {}
    for i, ref in enumerate(refs):
        try:
            offsets += offsets_of([ref], shard)
        except InvalidArgument as exc:
            refused[i] = exc
    if not offsets:
        raise next(iter(refused.values()))
    return offsets, refused


def malformed_claims(
    context: str, refs: list[Any], offsets: list[int], statuses: list[int], refused: dict[int, InvalidArgument],
) -> MalformedClaims:
    """The error for an ack some of whose references could not be read: the others
    were settled (statuses of ``offsets``: 1 acked now, 0 finished already, -1 never
    delivered), and it names each refused one and why."""
    readable = iter(statuses)
    given = len(refs)
    outcomes: list[bool | None] = []
    for i in range(given):
        status = None if i in refused else next(readable)
        outcomes.append(None if status is None or status == -1 else status == 1)
    why = "; ".join(str(exc) for exc in list(refused.values())[:10])
    never = [str(off) for off, x in zip(offsets, statuses, strict=True) if x == -1]
    message = f"{context}: {len(refused)} of {given} record references refused ({why})"
    if never:
        message += f"; record(s) {', '.join(never[:10])} not delivered to this group"
    settled = sum(1 for x in statuses if x != -1)
    message += f"; the other {settled} settled"
    return MalformedClaims(message, outcomes, [str(refs[i]) for i in refused])


def dead_letters_of(reply: list[Any], shard: int, context: str) -> list[DeadLetter]:
    """A group_dead_letters reply (OFFSET, ATTEMPTS|MS|REASON, ...) by offset."""
    out = []
    for i in range(0, len(reply), 2):
        try:
            attempts, ms, reason = as_text(reply[i + 1]).split("|", 2)
            out.append(DeadLetter(shard, int(reply[i]), int(attempts), reason, int(ms)))
        except ValueError:
            raise FelixError(
                f"{context}: dead-letter entry {as_text(reply[i])!r} is not in felix-redis's format "
                "(ATTEMPTS|MS|REASON); another application wrote it"
            ) from None
    out.sort(key=lambda d: d.offset)
    return out


class Core:
    """Builds plans. Holds the key prefix and defaults, the round-robin counter, and
    three collaborators: :attr:`cache` (names, keys, stream settings), :attr:`producers`
    (the pool plain publishes borrow from) and :attr:`retention` (when a publish trims);
    has no connection of its own."""

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
        self.cache = Caches(prefix)
        #: keys of different shards may not share a command (Redis Cluster; the client sets it)
        self.cluster = False
        #: grows by one whenever the driver met a lost connection, a failover or a restart
        #: (it may have retried through it unseen by the plan): what a sharded group knows
        #: of its shards from before may be stale (the server may have rolled back)
        self.epoch = 0
        # long polls share a group's watch through its bell (group_poll); off for a user
        # whose ACL predates the bell (BZPOPMIN refused)
        self.bells = True
        #: rings popped and not yet named in a poll, by (waiter, bell key): ' @ID'
        self.rings: dict[tuple[str, str], str] = {}
        #: the poll that ran behind a long poll's last block when its wait ran out, by
        #: (waiter, bell key): (time.monotonic() then, epoch, max_records, consumer,
        #: wait_ms, reply); the waiter's next long poll like it starts from that reply
        self.looks: dict[tuple[str, str], tuple[float, int, int, str, int, Any]] = {}
        #: the longest block the driver sends (below its socket timeout; set by the driver)
        self.block_cap_ms = 2**31
        self.producers = ProducerPool()
        self.retention = Retention()
        self._round_robin = itertools.count(random.randrange(1 << 16))

    # -- names and settings

    def name(self, tenant: str, namespace: str, stream: str) -> StreamName:
        """The checked name of a stream, laid out as last seen (:meth:`Caches.name`)."""
        return self.cache.name(tenant, namespace, stream)

    def forget(self, name: StreamName) -> None:
        """Drops a stream's cached settings: the next call reads them again."""
        self.cache.forget(name)

    def settings(self, name: StreamName) -> Plan[StreamSettings]:
        cached = self.cache.fresh_settings(name.path)
        if cached is not None:
            return cached
        reply = yield Eval(
            "stream_info", name.info_keys(0), [], f"stream {name.path}"
        )
        meta = flat_dict(reply[0])
        replication = int(meta["replication"])
        consistency = as_text(meta["consistency"])
        settings = StreamSettings(
            int(meta["shards"]), replication, consistency, replicas_needed(replication, consistency),
            int(meta["max_payload"]), int(meta["max_len"]), int(meta["max_age"]), int(meta.get("spread", 0)),
        )
        self.cache.settings[name.path] = settings
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
        name = self.cache.name(tenant, namespace, stream)
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
            retention_max_len, "retention_max_len", 1, MAX_OFFSET
        )
        max_age = 0 if retention_max_age is None else check_int(
            retention_max_age, "retention_max_age", 1, MAX_OFFSET
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
            spread = int(flat_dict(first[0]).get("spread", 0))
        except NotFound:
            spread = shards if shards > 1 else 0
        name = self.cache.laid(name, spread)
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
        self.cache.forget(name)
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
        kind = as_text((yield Cmd("TYPE", key, key=key)))
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
        text = as_text(info)
        for line in text.splitlines():
            if line.startswith("connected_slaves:"):
                return 1 + int(line.split(":", 1)[1])
        return 1

    def read_all(self, calls: Sequence[Eval | Cmd]) -> Plan[list[Any]]:
        """Replies (or the FelixError each raised) of read-only calls, in one round trip
        (a pipeline; one per node on a Cluster). A call the connection lost is sent
        again on its own, so the driver retries it through a failover as a single call."""
        if not calls:
            return []
        replies = list((yield Batch(list(calls)))) if len(calls) > 1 else [None]
        for i, reply in enumerate(replies):
            if len(calls) == 1 or isinstance(reply, ConnectionFailed):
                try:
                    replies[i] = yield calls[i]
                except FelixError as exc:
                    replies[i] = exc
        return replies

    def stream_describe(self, tenant: str, namespace: str, stream: str) -> Plan[StreamInfo]:
        info, _groups = yield from self.stream_overview(tenant, namespace, stream, groups=False)
        return info

    def stream_overview(
        self, tenant: str, namespace: str, stream: str, groups: bool = True,
    ) -> Plan[tuple[StreamInfo, dict[str, GroupInfo | FelixError]]]:
        """The stream's describe and every group's, in two round trips whatever the
        shard and group counts (shard 0's info, then one pipeline of the rest). A group
        whose describe failed maps to its error (the others still show)."""
        name = self.cache.name(tenant, namespace, stream)
        first = yield Eval(
            "stream_info", name.info_keys(0), [], f"stream {name.path}"
        )
        meta = flat_dict(first[0])
        shards = int(meta["shards"])
        name = self.cache.laid(name, int(meta.get("spread", 0)))
        names = sorted(as_text(g) for g in first[1])
        calls = [Eval("stream_info", name.info_keys(shard), [], f"stream {name.path} shard {shard}")
                 for shard in range(1, shards)]
        if groups:
            for group in names:
                calls += self.group_describe_calls(name, shards, group)
        rest = (yield from self.read_all(calls)) if calls else []
        replies = [first]
        for reply in rest[:shards - 1]:
            if isinstance(reply, FelixError):
                raise reply
            replies.append(reply)
        tails = [int(flat_dict(r[0])["tail"]) for r in replies]
        firsts = [int(flat_dict(r[0])["first"]) for r in replies]
        max_len, max_age = int(meta["max_len"]), int(meta["max_age"])
        info = StreamInfo(
            tenant, namespace, stream,
            kind=as_text(meta["kind"]),
            shards=shards,
            replication=int(meta["replication"]),
            consistency=as_text(meta["consistency"]),
            retention_max_len=max_len or None,
            retention_max_age=max_age or None,
            max_payload=int(meta["max_payload"]),
            retention_mode=as_text(meta.get("mode", b"safe")),
            created_ms=int(meta["created"]),
            groups=names,
            tails=tails,
            firsts=firsts,
            tags=[name.tag(shard) for shard in range(shards)],
        )
        described: dict[str, GroupInfo | FelixError] = {}
        if groups:
            at = shards - 1
            for group in names:
                try:
                    described[group] = self.group_info(name, group, rest[at:at + shards])
                except FelixError as exc:
                    described[group] = exc
                at += shards
        return info, described

    def has_role(
        self, tenant: str, namespace: str, stream: str, role: str, group: str | None = None
    ) -> Plan[bool]:
        """Whether this Redis user holds ``role`` (docs/security.md) on the stream, or on
        its ``group`` for a group role: the check the scripts make, asked with one EXISTS
        on the role's capability key (refused: no). Without ACL every user holds every
        role. Nothing is written; an unknown stream raises NotFound."""
        name = self.cache.name(tenant, namespace, stream)
        if group is not None:
            check_name(group, "group")
        settings = yield from self.settings(name)
        name = self.cache.laid(name, settings)
        if group is not None and role in STREAM_ROLE_CAPS:
            raise InvalidArgument(f"role {role} is held on a whole stream: leave the group out")
        key = capability_key(self.prefix, name.tag(0), role, group)  # unknown role: InvalidArgument
        try:
            yield Cmd("EXISTS", key, key=key)
        except PermissionDenied:
            return False
        return True

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
            kind = as_text((yield Cmd("TYPE", key, key=key)))
            if kind not in ("set", "none"):
                raise WrongKeyType(f"key {key} holds a {kind} where felix-redis keeps a set; another application "
                                   "wrote it")
            # a tenant admin may add any name (SADD only): what is no tenant name is skipped
            tenants = sorted(t for t in (as_text(m) for m in (yield Cmd("SMEMBERS", key, key=key))) if valid_name(t))
        out = []
        for t in tenants:
            yield from self.check_registry(t)
            registry = registry_key(self.prefix, t)
            for member in (yield Cmd("ZRANGE", registry, 0, -1, key=registry)):
                parts = as_text(member).split("/")
                if len(parts) != 3 or parts[0] != t:
                    continue  # not written by felix-redis
                if namespace is None or parts[1] == namespace:
                    out.append((parts[0], parts[1], parts[2]))
        return out

    def stream_delete(self, tenant: str, namespace: str, stream: str) -> Plan[None]:
        name = self.cache.name(tenant, namespace, stream)
        try:
            settings = yield from self.settings(name)
        except NotFound:
            # Gone already, maybe by a delete that stopped before it left the registry.
            registry = registry_key(self.prefix, name.tenant)
            yield Cmd("ZREM", registry, name.path, key=registry)
            self.cache.forget(name)
            raise
        name = self.cache.laid(name, settings)
        yield from self.check_registry(name.tenant)
        existed = 0
        unconfirmed: NotReplicated | None = None
        # Shard 0 last: while it is there the stream exists, and a delete that stopped
        # part-way is completed by running it again.
        for shard in reversed(range(settings.shards)):
            for attempt in range(10):
                groups = [as_text(g) for g in (yield Cmd(
                    "SMEMBERS", name.groups_key(shard), key=name.groups_key(shard)))]
                keys = name.info_keys(shard)
                for group in groups:
                    keys += name.group_key_list(shard, group)
                keys += [name.due_key(shard), *schedule_keys(name, shard)]
                try:
                    existed = yield Eval(
                        "stream_delete", keys, [len(groups), *groups],
                        f"stream {name.path} shard {shard}", settings.replicas,
                    )
                    yield from self.ring_off(name, shard, groups)
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
        self.cache.forget(name)
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
        extras: Extras | None = None,
    ) -> Plan[tuple[int, int, int]]:
        """A plain publish of a batch: idempotent under retries through a borrowed
        producer unless the client was made with ``idempotent_publish=False``; returns
        (shard, first offset, count)."""
        if not self.idempotent_publish:
            return (yield from self.publish(tenant, namespace, stream, payloads, shard, key, None, extras))
        return (yield from self.with_borrowed_producer(
            self.publish, tenant, namespace, stream, payloads, shard, key, extras=extras))

    def publish_single(
        self, tenant: str, namespace: str, stream: str, payload: bytes, shard: int | None, key: object,
        extras: Extras | None = None,
    ) -> Plan[Published]:
        """A plain publish of one payload, as :meth:`publish_plain`, through
        :meth:`publish_one`'s quick path where the caches allow. (Not a generator
        itself: it hands out the plan that runs, one frame less on the hot path.)"""
        if not self.idempotent_publish:
            return self.publish_one(tenant, namespace, stream, payload, shard, key, None, extras)
        if extras is not None:
            return self.with_borrowed_producer(
                self.publish_one, tenant, namespace, stream, payload, shard, key, extras=extras)
        return self.with_borrowed_producer(self.publish_one, tenant, namespace, stream, payload, shard, key)

    def with_borrowed_producer(
        self, publish: Callable[..., Plan[T]], *args: Any, extras: Extras | None = None
    ) -> Plan[T]:
        """``publish(*args, producer)`` with a producer borrowed from the pool for its
        length. When the shard forgot that producer's last sequences (a failover lost
        them), nothing was written and the producer starts over under a new secret, so
        it runs once more, as a first publish: the caller never chose a sequence."""
        state = self.producers.acquire()
        tail = (state,) if extras is None else (state, extras)
        try:
            try:
                return (yield from publish(*args, *tail))
            except SequenceError:
                return (yield from publish(*args, *tail))
        finally:
            self.producers.release(state)

    def publish_one(
        self, tenant: str, namespace: str, stream: str, payload: bytes, shard: int | None, key: object,
        producer: ProducerState | None,
        extras: Extras | None = None,
    ) -> Plan[Published]:
        """One payload with ``producer`` (held by the caller; None: without producer
        state): the script call straight away when the caches allow
        (:meth:`quick_publish`; a plain record only), else :meth:`publish`."""
        if producer is None or extras is not None or (quick := self.quick_publish(
                tenant, namespace, stream, payload, shard, key, producer)) is None:
            s, first, _count = yield from self.publish(
                tenant, namespace, stream, [payload], shard, key, producer, extras)
            return Published(s, first)
        op, slot = quick
        try:
            reply = yield op
        except FelixError as exc:
            reply = yield from after_failed_send(producer, op, exc)
        except BaseException:
            producer.reset()  # interrupted or cancelled with the outcome unknown
            raise
        producer.sequences[slot] = op.args[2]
        return Published(slot[1], int(reply[0]))

    def quick_single(
        self, tenant: object, namespace: object, stream: object, payload: bytes, shard: object, key: object,
        producer: ProducerState | None = None,
    ) -> QuickSend | None:
        """The drivers' fast path for one plain payload, without a plan: the producer
        (``producer``, held by the caller; else one borrowed from the pool, or none
        for a client made with ``idempotent_publish=False``) and the
        script call :meth:`quick_publish` builds. None when the plan must run
        (:meth:`publish_single` or :meth:`publish_one`; nothing is borrowed then). The
        driver runs the call and hands its reply to :meth:`single_sent`, or what it
        raised to :meth:`single_failed`: exactly one of the two, which give a borrowed
        producer back."""
        if producer is not None or not self.idempotent_publish:
            quick = self.quick_publish(tenant, namespace, stream, payload, shard, key, producer)
            return None if quick is None else (producer, quick[0], quick[1], False)
        pooled = self.producers.acquire()
        quick = self.quick_publish(tenant, namespace, stream, payload, shard, key, pooled)
        if quick is None:
            self.producers.release(pooled)
            return None
        return pooled, quick[0], quick[1], True

    def single_sent(self, send: QuickSend, reply: Any) -> Published:
        """The end of a :meth:`quick_single` whose script call answered ``reply``."""
        producer, op, slot, borrowed = send
        if producer is not None:
            producer.sequences[slot] = op.args[2]
            if borrowed:
                self.producers.release(producer)
        return Published(slot[1], int(reply[0]))

    def single_failed(
        self, send: QuickSend, exc: BaseException,
        tenant: str, namespace: str, stream: str, payload: bytes, shard: int | None, key: object,
    ) -> Plan[Published]:
        """The rest of a :meth:`quick_single` whose script call raised ``exc``, as
        :meth:`publish_one` and :meth:`with_borrowed_producer` would go on: one more
        send when the outcome is unknown; a borrowed producer the shard forgot starts
        over and runs the publish once more."""
        producer, op, slot, borrowed = send
        if producer is None:  # a publish without producer state is sent once
            raise exc
        try:
            if not isinstance(exc, FelixError):
                producer.reset()  # interrupted or cancelled with the outcome unknown
                raise exc
            try:
                reply = yield from after_failed_send(producer, op, exc)
            except SequenceError:
                if not borrowed:
                    raise
                return (yield from self.publish_one(tenant, namespace, stream, payload, shard, key, producer))
            producer.sequences[slot] = op.args[2]
            return Published(slot[1], int(reply[0]))
        finally:
            if borrowed:
                self.producers.release(producer)

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
        extras: Extras | None = None,
    ) -> Plan[tuple[int, int, int]]:
        """Publishes payloads to one shard; returns (shard, first offset, count).
        ``extras``: the records' delivery time, expiry and headers (all of them)."""
        name = self.cache.name(tenant, namespace, stream)
        raw_key = None if key is None else check_record_key(key)
        if not payloads:
            raise InvalidArgument("nothing to publish: the batch is empty")
        if len(payloads) > C.MAX_BATCH:
            raise InvalidArgument(f"a batch holds at most {C.MAX_BATCH} payloads, got {len(payloads)}")
        settings = self.cache.fresh_settings(name.path) or (yield from self.settings(name))
        name = self.cache.laid(name, settings)
        for i, payload in enumerate(payloads):
            if len(payload) > settings.max_payload:
                which = f"payload {i}" if len(payloads) > 1 else "the payload"
                raise InvalidArgument(
                    f"stream {name.path}: {which} is {len(payload)} bytes; this stream accepts "
                    f"at most {settings.max_payload}"
                )
        if shard is not None:
            shard = self.shard_of(name, settings, shard)
        else:
            shard = self.choose_shard(settings, None, raw_key)
        keys, context = self.cache.shard_target(name, shard)
        timing: list[Any] = [b"", b"", b""]
        if extras is not None:
            timing = [extras.deliver, extras.expires, extras.headers]
            if extras.delayed:
                keys = [*keys, name.due_key(shard)]
        trims = bool(settings.max_len or settings.max_age)
        if producer is None:
            reply = yield Eval(
                "publish", keys, [raw_key or b"", b"", 0, self.producer_idle_ms, *timing, *payloads],
                context, settings.replicas,
            )
            if extras is not None and extras.delayed:
                yield from self.retention.maybe_prune(name, shard)
            if trims:
                yield from self.retention.maybe_trim(name, settings, shard, reply)
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
            [raw_key or b"", pid, seq, self.producer_idle_ms, *timing, *payloads],
            context, settings.replicas,
        )
        try:
            reply = yield op
        except FelixError as exc:
            reply = yield from after_failed_send(producer, op, exc)
        except BaseException:
            # Cancelled with the outcome unknown.
            producer.reset()
            raise
        producer.sequences[slot] = seq
        if trims:
            yield from self.retention.maybe_trim(name, settings, shard, reply)
        if extras is not None and extras.delayed:
            yield from self.retention.maybe_prune(name, shard)
        return shard, int(reply[0]), int(reply[1])

    def quick_publish(
        self, tenant: object, namespace: object, stream: object, payload: bytes, shard: object,
        key: object, producer: ProducerState | None,
    ) -> tuple[Eval, tuple[str, int]] | None:
        """The script call of :meth:`publish` for one payload with ``producer`` (None:
        without producer state) and the (stream, shard) slot its sequence is for, built
        in one step from the caches, without a plan (:meth:`quick_single` uses it). None
        when the checked plan must run: a name not seen before, settings not cached or
        stale, a stream with retention (it trims after publishing), a shard that is not
        a plain int in range, an oversize payload, or a producer without an id yet."""
        if type(tenant) is not str or type(namespace) is not str or type(stream) is not str:
            return None
        cache = self.cache
        name = cache.names.get((tenant, namespace, stream))
        if name is None:
            return None
        path = name.path
        settings = cache.settings.get(path)
        if (settings is None or time.monotonic() - settings.loaded_at >= cache.settings_ttl_s
                or settings.max_len or settings.max_age or len(payload) > settings.max_payload):
            return None
        pid: str | bytes | None = b"" if producer is None else producer.producer_id
        if pid is None:
            return None
        raw_key = b"" if key is None else check_record_key(key)
        if shard is None:
            shard = shard_for_key(raw_key, settings.shards) if key is not None else (
                next(self._round_robin) % settings.shards)
        elif type(shard) is not int or not 0 <= shard < settings.shards:
            return None
        keys, context = self.cache.shard_target(self.cache.laid(name, settings), shard)
        slot = (path, shard)
        op = Eval(
            "publish", keys,
            [raw_key, pid, 0 if producer is None else producer.sequences.get(slot, 0) + 1, self.producer_idle_ms,
             b"", b"", b"", payload],
            context, settings.replicas,
        )
        return op, slot

    def stream_trim(self, tenant: str, namespace: str, stream: str) -> Plan[int]:
        """Applies retention to every shard now; returns the records trimmed."""
        name = self.cache.name(tenant, namespace, stream)
        settings = yield from self.settings(name)
        name = self.cache.laid(name, settings)
        total = 0
        for shard in range(settings.shards):
            total += yield from self.retention.trim_shard(name, shard)
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
        rate_limit: object = None,
    ) -> Plan[None]:
        name = self.cache.name(tenant, namespace, stream)
        check_name(group, "group")
        rate = check_rate_limit(rate_limit)
        if isinstance(start, str) and start in C.STARTS:
            start_arg: object = start
        elif isinstance(start, int) and not isinstance(start, bool):
            start_arg = check_int(start, "start offset", 0, MAX_OFFSET)
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
        name = self.cache.laid(name, settings)
        context = f"group {group} on stream {name.path}"
        group_key = name.group_key_list(0, group)[0]
        kind = as_text((yield Cmd("TYPE", group_key, key=group_key)))
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
                    [*name.shard_keys(shard), *name.group_key_list(shard, group), name.due_key(shard),
                     name.groups_key(shard)],
                    [group, start_arg, vt, attempts, 1 if shard == 0 else 0, check, rate],
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
        rate_limit: object = KEEP,
    ) -> Plan[None]:
        name = self.cache.name(tenant, namespace, stream)
        check_name(group, "group")
        rate = "" if rate_limit is KEEP else (check_rate_limit(rate_limit) or "0 0")
        vt = "" if visibility_timeout_ms is None else check_int(
            visibility_timeout_ms, "visibility_timeout_ms", 1, C.MAX_VISIBILITY_TIMEOUT_MS)
        attempts = "" if max_attempts is None else check_int(
            max_attempts, "max_attempts", 1, C.MAX_ATTEMPTS_LIMIT)
        settings = yield from self.settings(name)
        name = self.cache.laid(name, settings)

        def ops(check: int) -> Iterable[Eval]:
            for shard in range(settings.shards):
                yield Eval(
                    "group_configure",
                    [*name.shard_keys(shard), *name.group_key_list(shard, group), name.due_key(shard)],
                    [vt, attempts, check, rate], f"group {group} on stream {name.path} shard {shard}",
                    0 if check else settings.replicas,
                )
        yield from ops(1)
        yield from self.each_shard(ops(0))

    def group_keys(
        self, tenant: str, namespace: str, stream: str, group: str, shard: int | None
    ) -> Plan[dict[int, dict[str, str]]]:
        """The keys of a group, by shard and role (docs/keys.md), for people and tools:
        ``{shard: {role: key}}``. (Scripts take a list: StreamName.group_keys.)"""
        name = self.cache.name(tenant, namespace, stream)
        check_name(group, "group")
        settings = yield from self.settings(name)
        name = self.cache.laid(name, settings)
        shards = range(settings.shards) if shard is None else [self.shard_of(name, settings, shard)]
        roles = ("meta", "log", "groups", *GROUP_ROLES, "due")
        return {
            s: dict(zip(roles, [*name.shard_keys(s), name.groups_key(s), *name.group_key_list(s, group),
                                name.due_key(s)], strict=True))
            for s in shards
        }

    def group_list(self, tenant: str, namespace: str, stream: str) -> Plan[list[str]]:
        info = yield from self.stream_describe(tenant, namespace, stream)
        return info.groups

    def group_delete(self, tenant: str, namespace: str, stream: str, group: str) -> Plan[None]:
        name = self.cache.name(tenant, namespace, stream)
        check_name(group, "group")
        settings = yield from self.settings(name)
        name = self.cache.laid(name, settings)

        # Shard 0 last, as group_create makes it last: while it holds the group, the
        # group is listed, a group_create of the name is refused (GroupExists) and a
        # delete that stopped part-way is completed by running it again.
        def ops(check: int) -> Iterable[Eval]:
            for shard in reversed(range(settings.shards)):
                yield Eval(
                    "group_delete",
                    [*name.shard_keys(shard), *name.group_key_list(shard, group), name.due_key(shard),
                     name.groups_key(shard)],
                    [group, check], f"group {group} on stream {name.path} shard {shard}",
                    0 if check else settings.replicas,
                )
        existed = 0
        for op in ops(1):
            existed += yield op
        if not existed:
            raise NotFound(f"group {group} on stream {name.path} does not exist")
        yield from self.each_shard(ops(0))
        for shard in range(settings.shards):
            yield from self.ring_off(name, shard, [group])

    def ring_off(self, name: StreamName, shard: int, groups: Iterable[str]) -> Plan[None]:
        """Deletes the bells of deleted groups on a shard (lua/group_poll.lua: a zset of
        at most one member, left by the last poll that rang it). The delete scripts do not
        take them: a poll that rang a bell after this fails, its group being gone."""
        bells = [f"{name.group_key_list(shard, g)[0]}:bell" for g in groups]
        for bell in bells:
            yield Cmd("DEL", bell, key=bell)

    def group_op(
        self, tenant: str, namespace: str, stream: str, shard: object, group: str
    ) -> Plan[tuple[StreamName, StreamSettings, int, list[str], str]]:
        """A group's shard checked, with its stream's name, settings and keys, and the
        context errors name: from the cache while it is fresh, else read and checked."""
        hit = self.cache.group_target(tenant, namespace, stream, shard, group)
        if hit is not None:
            return hit
        name = self.cache.name(tenant, namespace, stream)
        check_name(group, "group")
        settings = yield from self.settings(name)
        name = self.cache.laid(name, settings)
        checked = self.shard_of(name, settings, shard)
        keys, context = self.cache.group_shard_keys(name, checked, group)
        return name, settings, checked, keys, context

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
        _name, settings, shard, keys, context = self.cache.group_target(tenant, namespace, stream, shard, group) \
            or (yield from self.group_op(tenant, namespace, stream, shard, group))
        deadline = time.monotonic() + wait_ms / 1000
        args: list[Any] = [max_records, consumer or "", 1 if reclaim else 0]
        if ack is not None:
            args += poll_ack_args(ack_offsets(ack, shard))
        again = 0
        # a long poll takes part in the group's watch (lua/group_poll.lua): one waiter
        # blocks on the log, the others on the bell, so a record wakes one of them
        bell = f"{keys[2]}:bell" if wait_ms > 0 and self.bells else None
        bell_keys = [*keys, bell] if bell else keys
        waiter = waiter_name() if bell else ""
        ring_key = (waiter, bell or "")

        def watch_call(ttl: int, ring: str) -> list[Any]:
            """The poll's arguments as a call of the group's watch: the waiter, how long
            its watch lasts (ms), the ring it names."""
            return [args[0], args[1], f"{args[2]} {waiter} {ttl}{ring}", *args[3:]]

        took: Any = None  # the reply of the poll the last block took along (BlockAny.then)
        # an idle loop: this long poll starts from the poll behind the last one's block
        steady = False
        if bell is not None and len(args) == 3 and not reclaim and self.looks:
            took = self.reused_look(ring_key, max_records, args[1], wait_ms)
            steady = took is not None
        # ms of this waiter's watch left, as the look said (its first block ends before)
        watch_left = int(took[6]) - int(took[0]) if steady and int(took[5]) == 1 else -1
        while True:
            watching = bell is not None and self.bells
            if took is not None:
                reply, took = took, None
            elif watching:
                ttl = max(1, int((deadline - time.monotonic()) * 1000)) + C.WATCH_MARGIN_MS
                # a ring this waiter popped: this call takes the watch it handed over
                reply = yield Eval("group_poll", bell_keys, watch_call(ttl, self.rings.pop(ring_key, "")),
                                   context, settings.replicas)
            else:
                reply = yield Eval("group_poll", keys, args, context, settings.replicas)
            count = int(reply[4])
            due = int(reply[1])
            # nothing handed out but something due now (the scan stopped at its bound in a
            # long run of delayed records): at once again, a bounded number of times
            now_due = count == 0 and 0 <= due <= int(reply[0]) and again < C.POLL_AGAIN_MAX
            if count or (wait_ms <= 0 and not now_due):
                return parse_delivered(reply, 5, count, shard)
            args = [*args[:2], 0]  # the acks went with the first call; reclaim once
            if now_due:
                again += 1
                continue
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return []
            block_ms = left_ms
            if due >= 0:
                block_ms = max(1, min(block_ms, due - int(reply[0]) + 1))
            if watch_left >= 0:
                # the watch the look's poll took lapses within this block (it was taken
                # for the rest of that wait, not this one): the poll behind a block that
                # ends before then keeps it
                block_ms = max(1, min(block_ms, watch_left - C.WATCH_MARGIN_MS // 2))
                watch_left = -1
            points = wake_points(keys, reply)
            if watching and bell is not None and int(reply[5]) == 2:
                # another waiter watches: wait on the bell, until the wait ends or what
                # this poll saw falls due (then this poll looks itself: a watcher that
                # died is replaced by the first poll after its watch lapsed)
                moved, rang = yield from follow_bell(self, bell, block_ms, context)
                if rang is None:
                    if self.bells and not moved and block_ms == left_ms and deadline - time.monotonic() < 0.01:
                        return []  # (as below)
                    continue
                # the ring handed this waiter the watch: it watches from the ring's points
                # (the rest of a burst wakes it at once) and names the ring when it polls
                self.rings[ring_key] = rang.claim
                points = rang.points(keys)
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or rang.due_in == 0:
                    continue
                block_ms = left_ms if rang.due_in < 0 else max(1, min(left_ms, rang.due_in + 1))
            # the next poll goes behind the block, in the same write: Redis runs it the
            # moment the block returns (a publish and the poll that takes it: one round
            # trip). Only a call of the group's watch without reclaim: when the wait runs
            # out, its reply starts this waiter's next long poll (a loop stays at one
            # poll per wait); others (a user without the bell, a reclaiming consumer)
            # would make two, and send the poll after the block as before
            then = None
            if watching and not reclaim and not settings.replicas:
                # it runs when the block ends, at the latest when the block the driver
                # sends does. Its watch lasts the rest of this wait and the margin; for a
                # block to the wait's end in an idle loop (this long poll started from a
                # look), one more wait, which the next long poll of the loop starts with
                runs_ms = min(block_ms, self.block_cap_ms)
                ttl = wait_ms if steady and runs_ms >= left_ms else max(1, left_ms - runs_ms)
                then = Eval("group_poll", bell_keys, watch_call(ttl + C.WATCH_MARGIN_MS,
                                                                self.rings.get(ring_key, "")), context)
            moved = yield BlockAny(points, block_ms, context, then=then)
            if type(moved) is Took:
                # the poll ran: the ring it named is used; the loop's top reads its reply
                # (records, or nothing: then the wait's end is told below as before)
                self.rings.pop(ring_key, None)
                took, moved = moved.reply, moved.moved
                if int(took[4]) or moved or block_ms != left_ms or deadline - time.monotonic() >= 0.01:
                    continue
                if len(self.looks) >= C.LOOKS_KEPT_MAX:
                    self.looks.clear()
                self.looks[ring_key] = (time.monotonic(), self.epoch, max_records, args[1], wait_ms, took)
                return []
            if not moved and block_ms == left_ms and deadline - time.monotonic() < 0.01:
                # the wait ran out (the server's timer may fire a ms early), nothing moved
                # and nothing fell due within it: a poll now would find what the last one
                # did (a lapsing lease, a delayed record coming due, the rate window's end
                # are all due times); the caller's next poll looks again. (A block the
                # driver cut short, below its socket timeout, leaves time: polled again.)
                return []

    def reused_look(self, key: tuple[str, str], max_records: int, consumer: str, wait_ms: int) -> Any:
        """The reply of the poll that ran behind this waiter's last block when its wait
        ran out, as the first poll of a long poll that would send the same (no acks, no
        reclaim, the same ``max_records``, consumer and wait), when it ran at most
        ``LOOK_REUSE_S`` ago; else None. Its points and due time still hold: anything
        since is after the points, which the block watches, and the due time is moved
        back by the time since. Not after a lost connection or a failover (``epoch``)."""
        look = self.looks.pop(key, None)
        if look is None:
            return None
        at, epoch, was_max, was_consumer, was_wait, reply = look
        age_ms = int((time.monotonic() - at) * 1000)
        if age_ms > C.LOOK_REUSE_S * 1000 or (was_max, was_consumer, was_wait) != (max_records, consumer, wait_ms):
            return None
        if epoch != self.epoch:
            return None  # a lost connection or failover since: the server may have rolled back below its points
        return [int(reply[0]) + age_ms, *reply[1:]]

    def sharded_poll(
        self,
        tenant: str,
        namespace: str,
        streams: Sequence[str],
        group: str,
        max_records: int,
        wait: float | None,
        consumer: str | None,
        state: PollState,
        reclaim: bool = True,
        only: Sequence[int] | None = None,
        ack: dict[tuple[int, int], list[Any]] | None = None,
        weights: Sequence[int] | None = None,
    ) -> Plan[list[list[Record]]]:
        """Polls the shards (or ``only`` these) of ``streams`` (checked by
        :func:`check_streams`, with ``weights``) that may have work, as the group's
        ``state`` knows them (:class:`ShardedPoll`): per stream, a lead shard for the
        batch, then the next, then the rest a quota each; a stream only for what the
        streams before it (in order, or led by the weights' pick) could not fill.
        Returns the records per stream (by index). ``state``: the group's
        :class:`PollState`, updated. ``ack``: records to ack first, by (stream index,
        shard); each shard's ride on its poll when it is asked, the others go with the
        first round trip. When a call that carried acks fails, the poll raises (ack those
        records again)."""
        max_records = check_int(max_records, "max_records", 1, C.MAX_RECORDS_PER_POLL)
        wait_ms = 0 if wait is None else seconds_to_ms(wait, "wait", 0, C.MAX_DELAY_MS)
        if consumer is not None:
            check_name(consumer, "consumer")
        check_name(group, "group")
        if only is not None and len(streams) > 1:
            raise InvalidArgument("shards= picks shards of one stream; a group over several streams polls them all")
        sources = []
        for index, stream in enumerate(streams):
            name = self.cache.name(tenant, namespace, stream)
            settings = yield from self.settings(name)
            name = self.cache.laid(name, settings)
            chosen = list(range(settings.shards)) if only is None else [
                self.shard_of(name, settings, s) for s in dict.fromkeys(only)]
            if not chosen:
                raise InvalidArgument("a sharded group needs at least one shard")
            sources.append(Source(index, name, settings, chosen, {}))
        for (index, shard), refs in (ack or {}).items():
            source = sources[index]
            checked = self.shard_of(source.name, source.settings, shard)
            source.acks[checked] = ack_offsets(refs, checked)
        poll = ShardedPoll(self.cache, group, sources, max_records, wait_ms, consumer, reclaim, state,
                           None if weights is None else list(weights), self.cluster, lambda: self.epoch, self)
        return (yield from poll.run())

    def ack_sharded(
        self, tenant: str, namespace: str, group: str, by_target: dict[tuple[str, int], list[Any]]
    ) -> Plan[int]:
        """Acks records of several shards, of one or more streams (``by_target``: refs
        by (stream, shard)): one script call per shard, one round trip. Each record is
        settled on its own; records never delivered raise NotDelivered after the others
        were acked."""
        calls, where = [], []
        streams = list(dict.fromkeys(stream for stream, _shard in by_target))
        for (stream, shard), refs in by_target.items():
            _name, settings, shard, keys, context = self.cache.group_target(tenant, namespace, stream, shard, group) \
                or (yield from self.group_op(tenant, namespace, stream, shard, group))
            offsets = offsets_of(refs, shard)
            label = f"{shard}" if len(streams) == 1 else f"{stream} {shard}"
            for start in range(0, len(offsets), C.MAX_BATCH):
                chunk = offsets[start:start + C.MAX_BATCH]
                calls.append(Eval("group_ack", keys, chunk, context, settings.replicas))
                where.append((label, chunk))
        if not calls:
            return 0
        replies = yield Batch(calls)
        for reply in replies:
            if isinstance(reply, FelixError):
                raise reply
        statuses = [int(x) for reply in replies for x in reply]
        if -1 in statuses:
            claims = [f"{label}:{off}" for label, chunk in where for off in chunk]
            paths = ", ".join(f"{tenant}/{namespace}/{stream}" for stream in streams)
            raise not_delivered(f"group {group} on stream{'s' if len(streams) > 1 else ''} {paths}", claims,
                                statuses)
        return sum(statuses)

    def release_sharded(
        self, tenant: str, namespace: str, group: str, by_target: dict[tuple[str, int], list[Any]]
    ) -> Plan[list[tuple[str, FelixError]]]:
        """Hands back records a consumer holds and did not hand to its caller (a sharded
        group's records fetched ahead, at close): a release each (``group_nack`` with no
        delay and ``release``: the delivery is not counted, so the next one says the same
        attempts and none becomes a dead letter), every shard and stream in one round
        trip. Returns the claims not released, with why (a lease that lapsed meanwhile:
        the record is someone else's now; a lost connection: it comes again after its
        lease)."""
        calls, claims = [], []
        for (stream, shard), refs in by_target.items():
            _name, settings, shard, keys, context = self.cache.group_target(tenant, namespace, stream, shard, group) \
                or (yield from self.group_op(tenant, namespace, stream, shard, group))
            for ref in refs:
                target = resolve(ref, shard, need_attempts=True)
                release = [target.offset, target.attempts, 0, 1]  # (group_nack's release: not counted)
                calls.append(Eval("group_nack", keys, release, context, settings.replicas))
                claims.append(f"{stream} {shard}:{target.offset}:{target.attempts}")
        if not calls:
            return []
        try:
            replies = yield Batch(calls)
        except FelixError as exc:  # the driver gave up on the round trip
            replies = [exc] * len(calls)
        return [(claim, reply) for claim, reply in zip(claims, replies, strict=True) if isinstance(reply, FelixError)]

    def group_ack(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str, refs: Iterable[object]
    ) -> Plan[list[bool]]:
        """Acks records of one shard, each on its own: records never delivered raise
        NotDelivered (:func:`not_delivered`), references that cannot be read (malformed,
        another shard's) MalformedClaims, each after the others were acked. When no
        reference can be read, nothing is sent (InvalidArgument)."""
        _name, settings, shard, keys, context = self.cache.group_target(tenant, namespace, stream, shard, group) \
            or (yield from self.group_op(tenant, namespace, stream, shard, group))
        refs = refs if type(refs) is list else check_list(refs, "offsets")
        try:
            offsets, refused = offsets_of(refs, shard), None
        except InvalidArgument:
            offsets, refused = readable_offsets(refs, shard)
        if not offsets:
            return []
        if len(offsets) > C.MAX_BATCH:
            raise InvalidArgument(f"ack takes at most {C.MAX_BATCH} offsets at once")
        reply = yield Eval("group_ack", keys, offsets, context, settings.replicas)
        statuses = [int(x) for x in reply]
        if refused:
            raise malformed_claims(context, refs, offsets, statuses, refused)
        if -1 in statuses:
            raise not_delivered(context, [f"{shard}:{off}" for off in offsets], statuses, True)
        return [x == 1 for x in statuses]

    def group_nack(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str, ref: object,
        delay: float = 0.0,
    ) -> Plan[bool]:
        delay_ms = seconds_to_ms(delay, "delay", 0, C.MAX_DELAY_MS)
        _name, settings, shard, keys, context = yield from self.group_op(
            tenant, namespace, stream, shard, group)
        target = resolve(ref, shard, need_attempts=True)
        reply = yield Eval(
            "group_nack", keys, [target.offset, target.attempts, delay_ms, ""], context, settings.replicas
        )
        return int(reply) == 2

    def group_extend(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str, ref: object,
        by: float | None = None,
    ) -> Plan[int]:
        by_ms: Any = "" if by is None else seconds_to_ms(by, "by", 1, C.MAX_DELAY_MS)
        _name, settings, shard, keys, context = yield from self.group_op(
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
        _name, settings, shard, keys, context = yield from self.group_op(
            tenant, namespace, stream, shard, group)
        target = resolve(ref, shard, need_attempts=True)
        yield Eval(
            "group_dead_letter", keys, [target.offset, target.attempts, raw], context,
            settings.replicas,
        )

    def group_dead_letters(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str
    ) -> Plan[list[DeadLetter]]:
        _name, _settings, shard, keys, context = yield from self.group_op(
            tenant, namespace, stream, shard, group)
        reply = yield Eval("group_dead_letters", keys, [], context)
        return dead_letters_of(reply, shard, context)

    def group_consumers(
        self, tenant: str, namespace: str, stream: str, group: str
    ) -> Plan[dict[str, list[str]]]:
        """Named consumers (``group_poll_as``) and the claims (``SHARD:OFFSET``) of the
        leases each took that the group still holds, from every shard's ``G:owner``
        hash (docs/keys.md). Consumers that never polled by name are not listed."""
        name = self.cache.name(tenant, namespace, stream)
        check_name(group, "group")
        settings = yield from self.settings(name)
        name = self.cache.laid(name, settings)
        owner_at = GROUP_ROLES.index("owner")
        out: dict[str, list[str]] = {}
        keys = [name.group_key_list(shard, group)[owner_at] for shard in range(settings.shards)]
        group_key = name.group_key_list(0, group)[0]
        contexts = [f"group {group} on stream {name.path} shard {shard}" for shard in range(settings.shards)]
        replies = yield from self.read_all([
            Cmd("EXISTS", group_key, key=group_key, context=contexts[0]),
            *(Cmd("HGETALL", key, key=key, context=context) for key, context in zip(keys, contexts, strict=True))])
        if isinstance(replies[0], FelixError):
            raise replies[0]
        if not int(replies[0]):
            raise NotFound(f"{contexts[0]}: the group does not exist")
        for shard, reply in enumerate(replies[1:]):
            if isinstance(reply, FelixError):
                raise reply
            pairs = list(reply.items()) if isinstance(reply, dict) else list(zip(reply[::2], reply[1::2], strict=True))
            try:
                owned = sorted((int(offset), as_text(consumer)) for offset, consumer in pairs)
            except ValueError:
                raise FelixError(f"{contexts[shard]}: the owner hash holds a field that is not an offset; another "
                                 "application wrote it") from None
            for offset, consumer in owned:
                out.setdefault(consumer, []).append(f"{shard}:{offset}")
        return dict(sorted(out.items()))

    def group_dead_letters_all(self, tenant: str, namespace: str, stream: str, group: str) -> Plan[list[DeadLetter]]:
        """Every shard's dead letters in one round trip (a pipeline), by shard and offset."""
        name = self.cache.name(tenant, namespace, stream)
        check_name(group, "group")
        settings = yield from self.settings(name)
        name = self.cache.laid(name, settings)
        targets = [self.cache.group_shard_keys(name, shard, group) for shard in range(settings.shards)]
        replies = yield from self.read_all([Eval("group_dead_letters", keys, [], context) for keys, context in targets])
        out = []
        for shard, (reply, (_keys, context)) in enumerate(zip(replies, targets, strict=True)):
            if isinstance(reply, FelixError):
                raise reply
            out += dead_letters_of(reply, shard, context)
        return out

    def _dead_op(
        self, script: str, tenant: str, namespace: str, stream: str, shard: int, group: str,
        offsets: Iterable[object] | None,
    ) -> Plan[int]:
        _name, settings, shard, keys, context = yield from self.group_op(
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
            cursor = as_text(reply[1])
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

    @staticmethod
    def group_describe_calls(name: StreamName, shards: int, group: str) -> list[Eval]:
        return [Eval("group_describe",
                     [*name.shard_keys(shard), *name.group_key_list(shard, group), name.due_key(shard)],
                     [], f"group {group} on stream {name.path} shard {shard}")
                for shard in range(shards)]

    @staticmethod
    def group_info(name: StreamName, group: str, replies: list[Any]) -> GroupInfo:
        """A GroupInfo from the group_describe replies of every shard (raises the first
        error a shard's call raised)."""
        states = []
        vt = attempts = 0
        for shard, r in enumerate(replies):
            if isinstance(r, NotFound) and shard > 0:
                # shard 0 has it, this one not: a group_delete that stopped part-way
                raise NotFound(
                    f"group {group} on stream {name.path} is incomplete: shard 0 has it, shard {shard} not "
                    "(a group_delete stopped part-way); run group_delete again to finish it") from None
            if isinstance(r, FelixError):
                raise r
            position, tail, nxt = int(r[0]), int(r[1]), int(r[2])
            age = int(r[6])
            vt, attempts = int(r[8]), int(r[9])
            scheduled = int(r[11]) if len(r) > 11 else 0
            pending = tail - nxt + (int(r[12]) if len(r) > 12 else 0)
            owed, in_flight = int(r[3]), int(r[4])
            rate = None
            if len(r) > 13 and r[13] is not None:
                count, per_ms = as_text(r[13]).split()
                rate = (int(count), int(per_ms) / 1000)
            states.append(ShardState(
                shard=shard, position=position, tail=tail, lag=tail - position,
                pending=pending, owed=owed, in_flight=in_flight, dead=int(r[5]),
                oldest_unfinished_age_ms=None if age < 0 else age, trimmed=int(r[7]),
                unfinished=pending + owed + in_flight + scheduled, scheduled=scheduled, rate_limit=rate,
            ))
        return GroupInfo(name.tenant, name.namespace, name.stream, group, vt, attempts, states)

    def group_describe(self, tenant: str, namespace: str, stream: str, group: str) -> Plan[GroupInfo]:
        name = self.cache.name(tenant, namespace, stream)
        check_name(group, "group")
        settings = yield from self.settings(name)
        name = self.cache.laid(name, settings)
        # every shard in one round trip (a pipeline; one per node on a Cluster)
        replies = yield from self.read_all(self.group_describe_calls(name, settings.shards, group))
        return self.group_info(name, group, replies)

    # -- reading (subscribers, replay)

    def read(
        self, tenant: str, namespace: str, stream: str, shard: int, start: int, count: int = 100
    ) -> Plan[tuple[list[Record], int, int]]:
        """Records from ``start`` on; returns (records, tail, first offset kept)."""
        name = self.cache.name(tenant, namespace, stream)
        settings = yield from self.settings(name)
        name = self.cache.laid(name, settings)
        shard = self.shard_of(name, settings, shard)
        start = check_int(start, "start offset", 0, MAX_OFFSET)
        count = check_int(count, "count", 1, C.MAX_RECORDS_PER_POLL)
        reply = yield Eval(
            "stream_read", name.shard_keys(shard), [start, count],
            f"stream {name.path} shard {shard}",
        )
        return parse_records(reply, 3, int(reply[2]), shard), int(reply[0]), int(reply[1])

    def read_at(
        self, tenant: str, namespace: str, stream: str, where: Sequence[tuple[int, int]]
    ) -> Plan[list[Record | None]]:
        """The records at the given (shard, offset)s, in one round trip (a pipeline);
        None where the log no longer holds one (retention trimmed it)."""
        name = self.cache.name(tenant, namespace, stream)
        settings = yield from self.settings(name)
        name = self.cache.laid(name, settings)
        checked = [(self.shard_of(name, settings, shard), check_int(offset, "offset", 0, MAX_OFFSET))
                   for shard, offset in where]
        replies = yield from self.read_all([
            Eval("stream_read", name.shard_keys(shard), [offset, 1], f"stream {name.path} shard {shard}")
            for shard, offset in checked])
        out: list[Record | None] = []
        for (shard, offset), reply in zip(checked, replies, strict=True):
            if isinstance(reply, FelixError):
                raise reply
            found = parse_records(reply, 3, int(reply[2]), shard)
            out.append(found[0] if found and found[0].offset == offset else None)
        return out

    def subscribe_start(
        self, tenant: str, namespace: str, stream: str, start: object, shards: Iterable[int] | None
    ) -> Plan[dict[int, int]]:
        """Where a subscriber starts on each shard: {shard: next offset to read}."""
        name = self.cache.name(tenant, namespace, stream)
        settings = yield from self.settings(name)
        name = self.cache.laid(name, settings)
        chosen = list(range(settings.shards)) if shards is None else [
            self.shard_of(name, settings, s) for s in shards]
        if not chosen:
            raise InvalidArgument("subscribe needs at least one shard")
        cursors: dict[int, int] = {}
        for shard in chosen:
            if isinstance(start, dict):
                if shard not in start:
                    raise InvalidArgument(f"start has no offset for shard {shard}")
                cursors[shard] = check_int(start[shard], f"start offset of shard {shard}", 0, MAX_OFFSET)
            elif isinstance(start, int) and not isinstance(start, bool):
                cursors[shard] = check_int(start, "start offset", 0, MAX_OFFSET)
            elif start in C.STARTS:
                reply = yield Eval(
                    "stream_info", name.info_keys(shard), [],
                    f"stream {name.path} shard {shard}",
                )
                first, tail = stream_tails(reply)
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
        name = self.cache.name(tenant, namespace, stream)
        name = self.cache.laid(name, (yield from self.settings(name)))
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
