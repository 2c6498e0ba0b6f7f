"""A small pure-Python model of one consumer group on one shard (CONTRACT.md, "Words" and
guarantees 2-6), and of the shard's retention (docs/concepts.md, "Retention": a queue in
the default safe mode). It is the reference tests/test_model.py holds the Lua scripts
to, and a compact statement of the semantics.

Time: the model has no clock. Every owed record carries the time it falls due (``due``,
ms since the epoch, as the server stores it); a record nacked with a delay is owed but
not due (``due = NOT_DUE``) until the test makes it due. A lapse (the lease ran out) is
an event the test causes on purpose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


class State(Enum):
    NEW = "new"  # published, never delivered
    IN_FLIGHT = "in_flight"  # held under a valid lease
    LAPSED = "lapsed"  # its lease ran out; the next poll notices (owed, or dead at max)
    OWED = "owed"  # waiting for (re)delivery: nacked, lapsed, redriven or delayed
    ACKED = "acked"
    DEAD = "dead"  # a dead letter
    DISCARDED = "discarded"  # a dead letter dropped for good


FINISHED = frozenset({State.ACKED, State.DEAD, State.DISCARDED})
NOT_DUE = math.inf
#: Due time of a record its consumer reclaimed: at once, before every other due record.
RECLAIMED_DUE = 0.0


@dataclass
class Rec:
    payload: bytes
    state: State = State.NEW
    attempts: int = 0  # deliveries so far; a redrive starts over at 0
    due: float = NOT_DUE  # OWED / LAPSED: when it falls due (ms)
    reason: str = ""  # DEAD: why, exactly as group_dead_letters reports it
    owner: str | None = None  # IN_FLIGHT / LAPSED: the named consumer holding it

    @property
    def finished(self) -> bool:
        return self.state in FINISHED


@dataclass
class PollPlan:
    """What a poll must hand out: ``redeliver`` due records (by due time; equal due times
    in any order), then the new records ``fresh`` in offset order."""

    redeliver: list[int]
    fresh: list[int]
    lapsed_dead: list[int]  # lapsed or reclaimed at max_attempts: dead letters now
    due_dead: list[int] = field(default_factory=list)  # due, but max_attempts was lowered below their attempts


def trim_slack(max_len: int) -> int:
    """How far a shard may outgrow ``max_len`` before a publish trims it (10 %, at
    least 1, at most 1000; felix_redis.retention.Retention.maybe_trim)."""
    return max(1, min(1000, max_len // 10))


@dataclass
class ShardModel:
    max_attempts: int
    records: list[Rec] = field(default_factory=list)
    next: int = 0  # next offset to hand out for the first time
    max_len: int = 0  # retention: records kept per shard (0: no limit)
    first: int = 0  # the first offset retention kept in the log

    # -- what describe reports

    @property
    def tail(self) -> int:
        return len(self.records)

    @property
    def position(self) -> int:
        """Smallest unfinished offset (a redriven record is unfinished again)."""
        return next((o for o, r in enumerate(self.records) if not r.finished), self.tail)

    def count(self, *states: State) -> int:
        return sum(r.state in states for r in self.records)

    def describe(self) -> dict[str, int]:
        return {
            "position": self.position,
            "tail": self.tail,
            "lag": self.tail - self.position,
            "pending": self.tail - self.next,
            "owed": self.count(State.OWED, State.LAPSED),  # a lapsed lease is owed
            "in_flight": self.count(State.IN_FLIGHT),
            "dead": self.count(State.DEAD),
        }

    def dead_letters(self) -> list[tuple[int, int]]:
        return [(o, r.attempts) for o, r in enumerate(self.records) if r.state is State.DEAD]

    def in_state(self, *states: State) -> list[int]:
        return [o for o, r in enumerate(self.records) if r.state in states]

    # -- operations

    def publish(self, payloads: list[bytes]) -> list[int]:
        first = self.tail
        self.records += [Rec(p) for p in payloads]
        return list(range(first, self.tail))

    def claim_valid(self, offset: int, attempts: int) -> bool:
        """A claim is current while its record is in flight with the same attempts."""
        r = self.records[offset]
        return r.state is State.IN_FLIGHT and r.attempts == attempts

    def fail_delivery(self, offset: int, due: float, how: str) -> bool:
        """A lapse, nack or reclaim (``how``: what the dead letter's reason names): owed
        again from ``due``, or (when its deliveries reached max_attempts) a dead letter;
        True for a dead letter."""
        r = self.records[offset]
        r.owner = None
        if r.attempts >= self.max_attempts:
            r.state, r.reason = State.DEAD, f"max_attempts reached: {how}"
            return True
        r.state, r.due = State.OWED, due
        return False

    def poll(self, max_records: int, consumer: str | None = None, reclaim: bool = False) -> PollPlan:
        """First a reclaiming consumer's own records (held or lapsed) fail and are due at
        once; then lapsed leases fail, owed from their lease's expiry; then the first
        max_records due records (by due time, then offset as text: the owed sorted set's
        order), of which those whose attempts reached max_attempts (lowered since) become
        dead letters and the others are redelivered; then new records up to max_records."""
        lapsed_dead = []
        for o, r in enumerate(self.records):
            mine = reclaim and consumer and r.owner == consumer and r.state in (State.IN_FLIGHT, State.LAPSED)
            if mine and self.fail_delivery(o, RECLAIMED_DUE, f"reclaimed by {consumer}"):
                lapsed_dead.append(o)
        for o, r in enumerate(self.records):
            if r.state is State.LAPSED and self.fail_delivery(o, r.due, "lease lapsed"):
                lapsed_dead.append(o)
        due = sorted(
            (o for o, r in enumerate(self.records) if r.state is State.OWED and r.due != NOT_DUE),
            key=lambda o: (self.records[o].due, str(o)),
        )[:max_records]
        due_dead = [o for o in due if self.records[o].attempts >= self.max_attempts]
        for o in due_dead:
            r = self.records[o]
            r.state, r.reason = State.DEAD, "max_attempts reached"
        redeliver = [o for o in due if o not in due_dead]
        fresh = list(range(self.next, min(self.tail, self.next + max_records - len(redeliver))))
        return PollPlan(redeliver, fresh, lapsed_dead, due_dead)

    def deliver(self, offset: int, consumer: str | None = None) -> int:
        """Hands ``offset`` out under a lease; returns its attempts (deliveries so far)."""
        r = self.records[offset]
        assert r.state in (State.NEW, State.OWED)
        if r.state is State.NEW:
            assert offset == self.next
            self.next += 1
        r.state, r.due, r.owner = State.IN_FLIGHT, NOT_DUE, consumer
        r.attempts += 1
        return r.attempts

    def ack(self, offset: int) -> bool:
        """Finishes the record (held, lapsed or owed: any claim); False if finished."""
        r = self.records[offset]
        if r.finished:
            return False
        r.state, r.owner = State.ACKED, None
        return True

    def nack(self, offset: int, due: float) -> bool:
        """Hands a held record back (claim checked by the caller); True: dead letter."""
        return self.fail_delivery(offset, due, "nacked")

    def dead_letter(self, offset: int, reason: str) -> None:
        r = self.records[offset]
        r.state, r.reason, r.owner = State.DEAD, reason, None

    def lapse(self, offset: int, expiry: float) -> None:
        r = self.records[offset]
        assert r.state is State.IN_FLIGHT
        r.state, r.due = State.LAPSED, expiry

    def make_due(self, offset: int, due: float) -> None:
        r = self.records[offset]
        assert r.state is State.OWED
        r.due = due

    def redrive(self, offset: int, due: float) -> None:
        """A dead letter is owed again, unfinished, with attempts starting over."""
        r = self.records[offset]
        assert r.state is State.DEAD
        r.state, r.due, r.attempts, r.reason = State.OWED, due, 0, ""

    def discard(self, offset: int) -> None:
        r = self.records[offset]
        assert r.state is State.DEAD
        r.state = State.DISCARDED

    # -- retention (a queue in safe mode: never past an unfinished record)

    def trim(self) -> int:
        """Applies the length limit: keeps the last ``max_len`` records, but never trims
        the position (the smallest unfinished offset, a redriven record included).
        Returns how many records were trimmed."""
        if not self.max_len:
            return 0
        cut = min(max(self.first, self.tail - self.max_len), self.position)
        trimmed = max(0, cut - self.first)
        self.first = max(self.first, cut)
        return trimmed

    def published(self) -> int:
        """After a publish to this shard: trims once the log outgrew its limit by more
        than the slack (felix_redis.retention.Retention.maybe_trim); returns the records trimmed."""
        if self.max_len and self.tail - self.first > self.max_len + trim_slack(self.max_len):
            return self.trim()
        return 0

    def trimmed(self, offset: int) -> bool:
        return offset < self.first
