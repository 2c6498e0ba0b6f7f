"""The values felix-redis hands back: records, claims, descriptions."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import NamedTuple

from felix_redis.errors import InvalidArgument
from felix_redis.keys import key_slot

__all__ = [
    "Claim",
    "DeadLetter",
    "GroupInfo",
    "Published",
    "Record",
    "ShardState",
    "StreamInfo",
    "parse_claim",
]


def ms_to_datetime(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


class Published(NamedTuple):
    """Where a published record landed; a tuple too (``shard, offset = client.publish(...)``)."""

    shard: int
    offset: int


class Record:
    """One delivered (or read) record.

    ``claim`` is ``SHARD:OFFSET:ATTEMPTS``; ``attempts`` is 0 for records read by a
    subscriber rather than delivered to a group.
    """

    __slots__ = ("_extra", "attempts", "key", "offset", "payload", "published_ms", "shard")

    def __init__(
        self,
        shard: int,
        offset: int,
        attempts: int,
        payload: bytes,
        key: str | None,
        published_ms: int,
        headers: dict[str, str] | None = None,
        deliver_ms: int | None = None,
        expires_ms: int | None = None,
    ) -> None:
        self.shard = shard
        self.offset = offset
        self.attempts = attempts
        self.payload = payload
        self.key = key
        self.published_ms = published_ms
        # headers, due and expiry times: None for a plain record (most are)
        self._extra = (headers, deliver_ms, expires_ms) if (headers or deliver_ms or expires_ms) else None

    @property
    def headers(self) -> dict[str, str]:
        """The record's headers (a new dict each time; empty when it has none)."""
        return dict(self._extra[0] or {}) if self._extra else {}

    @property
    def deliver_ms(self) -> int | None:
        """When the record was due for delivery (ms since the epoch, server clock), for a
        delayed record; None for one due at once."""
        return self._extra[1] if self._extra else None

    @property
    def expires_ms(self) -> int | None:
        """When the record expires (ms since the epoch, server clock); None: never."""
        return self._extra[2] if self._extra else None

    @property
    def deliver_at(self) -> datetime | None:
        """The due time of a delayed record (timezone-aware, UTC); None for one due at once."""
        ms = self.deliver_ms
        return None if ms is None else ms_to_datetime(ms)

    @property
    def expires_at(self) -> datetime | None:
        """When the record expires (timezone-aware, UTC); None: never."""
        ms = self.expires_ms
        return None if ms is None else ms_to_datetime(ms)

    @property
    def published_at(self) -> datetime:
        """Publish time, from the Redis server's clock."""
        return ms_to_datetime(self.published_ms)

    @property
    def claim(self) -> str:
        return f"{self.shard}:{self.offset}:{self.attempts}"

    def __repr__(self) -> str:
        return (
            f"Record(claim={self.claim!r}, key={self.key!r}, payload={self.payload[:60]!r}"
            f"{'...' if len(self.payload) > 60 else ''})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Record):
            return NotImplemented
        return (self.shard, self.offset, self.attempts, self.payload, self.key) == (
            other.shard, other.offset, other.attempts, other.payload, other.key
        )

    def __hash__(self) -> int:
        return hash((self.shard, self.offset, self.attempts))


@dataclass(frozen=True, slots=True)
class Claim:
    """A parsed ``SHARD:OFFSET:ATTEMPTS`` (attempts None for ``SHARD:OFFSET``)."""

    shard: int
    offset: int
    attempts: int | None

    def __str__(self) -> str:
        if self.attempts is None:
            return f"{self.shard}:{self.offset}"
        return f"{self.shard}:{self.offset}:{self.attempts}"


#: The canonical form only: decimal digits (ASCII), no sign, space, separator or leading
#: zero (a lone 0 is the number zero), so one record has one spelling.
_NUMBER = r"(0|[1-9][0-9]{0,15})"
_CLAIM_RE = re.compile(rf"(0|[1-9][0-9]{{0,8}}):{_NUMBER}(?::{_NUMBER})?")


def parse_claim(text: str, *, attempts_required: bool = True) -> Claim:
    """``"0:15:1"`` -> Claim(0, 15, 1); InvalidArgument names what is wrong. Only the
    canonical form is taken: decimal digits, no sign, spaces, ``_`` or leading zeros."""
    if not isinstance(text, str):
        raise InvalidArgument(f"claim must be a string, got {type(text).__name__}")
    match = _CLAIM_RE.fullmatch(text)
    if match is None or (attempts_required and match.group(3) is None):
        form = "SHARD:OFFSET:ATTEMPTS" if attempts_required else "SHARD:OFFSET[:ATTEMPTS]"
        raise InvalidArgument(
            f"malformed claim {text[:80]!r}: expected {form} in decimal digits (no sign, spaces or "
            "leading zeros), e.g. 0:15:1")
    attempts = int(match.group(3)) if match.group(3) is not None else None
    if attempts is not None and attempts < 1:
        raise InvalidArgument(f"malformed claim {text!r}: attempts start at 1")
    return Claim(int(match.group(1)), int(match.group(2)), attempts)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A pointer to a record that failed for good; the record stays in the log."""

    shard: int
    offset: int
    attempts: int
    reason: str
    dead_ms: int

    @property
    def dead_at(self) -> datetime:
        """When it became a dead letter (timezone-aware, the Redis server's clock)."""
        return ms_to_datetime(self.dead_ms)

    @property
    def time(self) -> datetime:
        """The contract's name for :attr:`dead_at`."""
        return self.dead_at

    @property
    def claim(self) -> str:
        return f"{self.shard}:{self.offset}"


@dataclass(frozen=True, slots=True)
class ShardState:
    """A group's state on one shard (``group_describe``).

    ``lag`` is tail - position: it also counts finished records above a position held
    back by an unfinished one. ``unfinished`` is what the group still has to finish:
    pending + owed + in flight + scheduled (the number to alert on, with the oldest
    unfinished age).
    ``trimmed``: records retention removed before this group finished them.
    ``scheduled``: delayed records not yet due (neither pending nor owed; lag counts
    them, unfinished too). ``rate_limit``: (count, per_seconds) or None, the group's."""

    shard: int
    position: int
    tail: int
    lag: int
    pending: int
    owed: int
    in_flight: int
    dead: int
    oldest_unfinished_age_ms: int | None
    trimmed: int = 0
    unfinished: int = 0
    scheduled: int = 0
    rate_limit: tuple[int, float] | None = None


@dataclass(frozen=True)
class GroupInfo:
    tenant: str
    namespace: str
    stream: str
    group: str
    visibility_timeout_ms: int
    max_attempts: int
    shards: list[ShardState] = field(default_factory=list)

    @property
    def lag(self) -> int:
        return sum(s.lag for s in self.shards)

    @property
    def pending(self) -> int:
        return sum(s.pending for s in self.shards)

    @property
    def scheduled(self) -> int:
        return sum(s.scheduled for s in self.shards)

    @property
    def rate_limit(self) -> tuple[int, float] | None:
        """The group's rate limit, (count, per_seconds) per shard, or None."""
        return self.shards[0].rate_limit if self.shards else None

    @property
    def unfinished(self) -> int:
        return sum(s.unfinished for s in self.shards)

    @property
    def trimmed(self) -> int:
        return sum(s.trimmed for s in self.shards)

    @property
    def owed(self) -> int:
        return sum(s.owed for s in self.shards)

    @property
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.shards)

    @property
    def dead(self) -> int:
        return sum(s.dead for s in self.shards)

    @property
    def oldest_unfinished_age_ms(self) -> int | None:
        ages = [s.oldest_unfinished_age_ms for s in self.shards if s.oldest_unfinished_age_ms is not None]
        return max(ages) if ages else None


@dataclass(frozen=True)
class StreamInfo:
    tenant: str
    namespace: str
    stream: str
    kind: str
    shards: int
    replication: int
    consistency: str
    retention_max_len: int | None
    retention_max_age: int | None
    max_payload: int
    created_ms: int
    groups: list[str] = field(default_factory=list)
    tails: list[int] = field(default_factory=list)
    firsts: list[int] = field(default_factory=list)
    retention_mode: str = "safe"
    #: each shard's hash tag (docs/keys.md) and its Redis Cluster slot
    tags: list[str] = field(default_factory=list)
    #: on Redis Cluster, the node (host:port) serving each shard now, by the client's
    #: slot map; None elsewhere
    nodes: list[str] | None = None

    @property
    def created_at(self) -> datetime:
        return ms_to_datetime(self.created_ms)

    @property
    def slots(self) -> list[int]:
        """Each shard's Redis Cluster hash slot (computed from its tag; meaningful on a
        Cluster, where it decides the node)."""
        return [key_slot(tag) for tag in self.tags]
