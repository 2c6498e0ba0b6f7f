"""Property-based test of the group semantics: random sequences of publish, poll (also
as named consumers that reclaim), ack, nack, extend, dead_letter, redrive, discard,
lapse, group_configure (max attempts and visibility timeout) and retention (a length
limit applied by publishing and by stream_trim), run against the real Redis and
memory://, each step checked against the pure-Python model of tests/support/model.py, dead-letter
reasons included.

Time is controlled, not waited for: the group's visibility timeout is long, and a lease
"lapses" when the test rewrites its expiry in the lease sorted set to a moment in the
past; a delayed nack "falls due" when the test rewrites its due time the same way. The
moments come from a counter near the epoch, so they never tie with each other and fall
before any due time the server sets itself (a nack without delay, a redrive), which the
test reads back from Redis (checking it lies between the server times before and after).
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import felix_redis
from felix_redis import NotFound, StaleClaim
from felix_redis.keys import GROUP_ROLES, StreamName
from felix_redis.models import Record
from tests.conftest import finished_runs, lease_expiry
from tests.support.model import NOT_DUE, ShardModel, State

T, N, S, G = "acme", "prod", "jobs", "workers"
VT_MS = 600_000  # leases never lapse by themselves while an example runs
DELAY_S = 600.0  # a delayed nack stays not due until the test makes it due
LEASE, OWED, HELD = GROUP_ROLES.index("lease"), GROUP_ROLES.index("owed"), GROUP_ROLES.index("held")
#: Per-record group state that must be gone once every record is finished.
RECORD_STATE_ROLES = ("lease", "owed", "attempts", "done", "redo", "owner", "byowner", "held")
#: Named consumers; "a" is a prefix of the others (the reclaim range must not mix them).
CONSUMERS = st.sampled_from([None, "a", "ab", "a.b"])

F = TypeVar("F", bound=Callable[..., Any])


def step(fn: F) -> F:
    """Marks the machine unsound until the invariants passed after this step, so that
    teardown settles only a machine whose steps all agreed with the model."""

    @functools.wraps(fn)
    def wrapper(self: GroupMachine, *args: Any, **kwargs: Any) -> Any:
        self.sound = False
        event(f"rule {fn.__name__}")
        return fn(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class GroupMachine(RuleBasedStateMachine):
    """One stream (1 or 2 shards) with one group; ``self.model`` has one ShardModel per shard."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.client = felix_redis.connect(url)
        self.raw = self.client.redis
        self.raw.flushall()
        self.model: list[ShardModel] = []
        self.clock = itertools.count(1_000)  # past moments (ms) for lapses and make_due
        self.handed: list[str] = []  # every claim handed out so far
        self.settled = False
        self.sound = True
        self.vt_ms = VT_MS  # the group's visibility timeout now

    def teardown(self) -> None:
        try:
            if self.sound and self.model:
                self.settle()
        finally:
            self.client.close()

    # -- helpers

    @property
    def name(self) -> StreamName:
        """The stream's name, laid out as its shard 0 says (spread hash tags)."""
        return self.client.core.name(T, N, S)

    def shard(self, s: int) -> int:
        return s % len(self.model)

    def key(self, s: int, role: int) -> str:
        return self.name.group_key_list(s, G)[role]

    def server_ms(self) -> int:
        sec, usec = self.raw.time()
        return int(sec) * 1000 + int(usec) // 1000

    def owed_score(self, s: int, offset: int) -> float:
        score = self.raw.zscore(self.key(s, OWED), str(offset))
        assert score is not None, f"{s}:{offset} should be owed"
        return float(score)

    def where(self, *states: State, due: bool | None = None) -> list[tuple[int, int]]:
        return [
            (s, o)
            for s, m in enumerate(self.model)
            for o in m.in_state(*states)
            if due is None or (m.records[o].due != NOT_DUE) == due
        ]

    def poll_checked(
        self, s: int, max_records: int, consumer: str | None = None, reclaim: bool = False, note: bool = False
    ) -> list[Record]:
        m = self.model[s]
        if note and reclaim and any(r.owner == consumer for r in m.records):
            event(f"poll: {consumer} reclaims")
        plan = m.poll(max_records, consumer, reclaim)  # reclaims and lapses are noticed first
        before = self.server_ms()
        if consumer is None:
            got = self.client.group_poll(T, N, S, s, G, max_records=max_records)
        else:
            got = self.client.group_poll_as(T, N, S, s, G, consumer, reclaim=reclaim, max_records=max_records)
        after = self.server_ms()
        claims = [r.claim for r in got]
        k = len(plan.redeliver)
        want = [f"{s}:{o}:{m.records[o].attempts + 1}" for o in plan.redeliver + plan.fresh]
        context = f"poll({max_records}, {consumer}, reclaim={reclaim}) on shard {s}: got {claims}, want {want}"
        assert len(got) == len(want), context
        # due redeliveries first, by due time (records due at the same ms in any order) ...
        again = [r.offset for r in got[:k]]
        assert len(set(again)) == k, f"a record handed out twice: {context}"
        for o in again:
            r = m.records[o] if o < m.tail else None
            assert r and r.state is State.OWED and r.due != NOT_DUE, f"{o} is not due for redelivery: {context}"
        assert [m.records[o].due for o in again] == [m.records[o].due for o in plan.redeliver], (
            f"redeliveries out of due order: {context}"
        )
        # ... then new records in offset order
        assert [r.offset for r in got[k:]] == plan.fresh, context
        for r in got:
            assert r.shard == s
            assert r.payload == m.records[r.offset].payload
            assert r.attempts == m.deliver(r.offset, consumer), f"attempts of {r.claim}: {context}"
            assert r.attempts <= m.max_attempts
            expiry = lease_expiry(self.raw, {"held": self.key(s, HELD), "lease": self.key(s, LEASE)}, r.offset)
            assert expiry is not None and before + self.vt_ms <= expiry <= after + self.vt_ms, (
                f"lease of {r.claim} expires at {expiry}, want now + {self.vt_ms} ms in [{before}, {after}]")
        if note:
            event(f"poll: {'some' if k else 'no'} redeliveries, {'some' if plan.fresh else 'no'} new")
            if plan.lapsed_dead:
                event("poll: a lapsed or reclaimed record at max_attempts became a dead letter")
            if plan.due_dead:
                event("poll: a due record past a lowered max_attempts became a dead letter")
        return got

    def settle(self) -> None:
        """Hands out and acks everything: the position reaches the tail and no
        per-record group state is left (dead letters stay, as pointers)."""
        for s, m in enumerate(self.model):
            while self.poll_checked(s, 10_000):
                pass
            assert m.next == m.tail
            if m.tail:
                offsets = list(range(m.tail))
                acked = self.client.group_ack_many(T, N, S, s, G, offsets)
                assert acked == [m.ack(o) for o in offsets]
        self.check_agrees()
        for s, shard in enumerate(self.client.group_describe(T, N, S, G).shards):
            assert (shard.position, shard.lag, shard.owed, shard.in_flight) == (self.model[s].tail, 0, 0, 0)
            keys = dict(zip(GROUP_ROLES, self.name.group_key_list(s, G), strict=True))
            left = {role: keys[role] for role in RECORD_STATE_ROLES if self.raw.exists(keys[role])}
            assert not left, f"shard {s}: per-record group state left behind: {left}"

    def pick_claim(self, data: st.DataObject) -> tuple[int, int, int, str]:
        """A claim held now, any claim handed out so far (maybe stale), or a made-up one
        (maybe for a record never delivered, or beyond the tail)."""
        held = [f"{s}:{o}:{self.model[s].records[o].attempts}" for s, o in self.where(State.IN_FLIGHT)]
        kind = data.draw(st.sampled_from(["held", "held", "held", "handed", "made up"]))
        if kind == "held" and held:
            claim = data.draw(st.sampled_from(held))
        elif kind != "made up" and self.handed:
            claim = data.draw(st.sampled_from(self.handed))
        else:
            s = data.draw(st.sampled_from(range(len(self.model))))
            o = data.draw(st.integers(0, self.model[s].tail))
            a = data.draw(st.integers(1, self.model[s].max_attempts + 1))
            claim = f"{s}:{o}:{a}"
        s, o, a = map(int, claim.split(":"))
        return s, o, a, claim

    def claim_op(self, data: st.DataObject, call: Callable[[int, str], Any]) -> tuple[int, int, Any] | None:
        """Runs ``call(shard, claim)`` on a picked claim; checks the refusal of a claim the
        model says is not current (None then), else returns (shard, offset, result)."""
        s, o, a, claim = self.pick_claim(data)
        m = self.model[s]
        if o >= m.tail:
            with pytest.raises(NotFound):
                call(s, claim)
            return None
        if not m.claim_valid(o, a):
            event("stale claim refused")
            with pytest.raises(StaleClaim):
                call(s, claim)
            return None
        return s, o, call(s, claim)

    # -- rules

    @initialize(shards=st.integers(1, 2), max_attempts=st.integers(1, 3), records=st.integers(0, 6),
                max_len=st.sampled_from([0, 0, 1, 2, 3, 5]))
    def create(self, shards: int, max_attempts: int, records: int, max_len: int) -> None:
        self.client.stream_create(T, N, S, shards=shards, retention_max_len=max_len or None)
        self.client.group_create(T, N, S, G, visibility_timeout_ms=VT_MS, max_attempts=max_attempts)
        self.model = [ShardModel(max_attempts, max_len=max_len) for _ in range(shards)]
        for i in range(records):
            s = i % shards
            self.client.publish(T, N, S, b"%d" % i, shard=s)
            self.model[s].publish([b"%d" % i])
            self.model[s].published()

    @rule(shard=st.integers(0, 1), payloads=st.lists(st.binary(max_size=3), min_size=1, max_size=3))
    @step
    def publish(self, shard: int, payloads: list[bytes]) -> None:
        s = self.shard(shard)
        got = self.client.publish_batch(T, N, S, payloads, shard=s)
        assert [(p.shard, p.offset) for p in got] == [(s, o) for o in self.model[s].publish(payloads)]
        if self.model[s].published():
            event("publish: retention trimmed the log")

    @precondition(lambda self: self.where(State.NEW, State.OWED, State.LAPSED, State.IN_FLIGHT))
    @rule(shard=st.integers(0, 1), max_records=st.integers(1, 4), consumer=CONSUMERS, reclaim=st.booleans())
    @step
    def poll(self, shard: int, max_records: int, consumer: str | None, reclaim: bool) -> None:
        reclaim = reclaim and consumer is not None
        got = self.poll_checked(self.shard(shard), max_records, consumer, reclaim, note=True)
        self.handed += [r.claim for r in got]

    @precondition(lambda self: self.handed)
    @rule(data=st.data())
    @step
    def ack(self, data: st.DataObject) -> None:
        """By any claim, held or stale: True iff the record was unfinished; a record never
        delivered is NotFound."""
        s, o, _, claim = self.pick_claim(data)
        m = self.model[s]
        if o >= m.next:
            with pytest.raises(NotFound):
                self.client.group_ack(T, N, S, s, G, claim)
            return
        want = m.ack(o)
        event(f"ack: {'acked now' if want else 'already finished'}")
        assert self.client.group_ack(T, N, S, s, G, claim) is want, claim

    @precondition(lambda self: any(m.next for m in self.model))
    @rule(data=st.data(), undelivered=st.booleans())
    @step
    def ack_many(self, data: st.DataObject, undelivered: bool) -> None:
        """Several offsets (repeats too) at once; with one never delivered: NotFound (its
        outcome None), and the others are settled all the same (issue 25: each claim on
        its own)."""
        s = data.draw(st.sampled_from([s for s, m in enumerate(self.model) if m.next]))
        m = self.model[s]
        offsets = data.draw(st.lists(st.integers(0, m.next - 1), min_size=1, max_size=4))
        if undelivered:
            at = data.draw(st.integers(0, len(offsets)))
            offsets.insert(at, data.draw(st.integers(m.next, m.tail)))
            with pytest.raises(NotFound) as raised:
                self.client.group_ack_many(T, N, S, s, G, offsets)
            want: list[bool | None] = [None if i == at else m.ack(o) for i, o in enumerate(offsets)]
            assert getattr(raised.value, "outcomes", None) == want, offsets
            return
        assert self.client.group_ack_many(T, N, S, s, G, offsets) == [m.ack(o) for o in offsets], offsets

    @precondition(lambda self: self.handed)
    @rule(data=st.data(), delayed=st.booleans())
    @step
    def nack(self, data: st.DataObject, delayed: bool) -> None:
        before = self.server_ms()
        delay = DELAY_S if delayed else 0
        done = self.claim_op(data, lambda s, claim: self.client.group_nack(T, N, S, s, G, claim, delay=delay))
        if done is None:
            return
        s, o, dead = done
        due = NOT_DUE
        if not dead:
            score = self.owed_score(s, o)
            if delayed:
                assert before + DELAY_S * 1000 <= score <= self.server_ms() + DELAY_S * 1000
            else:
                assert before <= score <= self.server_ms()
                due = score
        assert dead == self.model[s].nack(o, due), f"nack {s}:{o}: dead letter {dead}"
        event(f"nack: {'dead letter' if dead else 'delayed' if delayed else 'owed'}")

    @precondition(lambda self: self.handed)
    @rule(data=st.data(), by=st.sampled_from([None, 300.0]))
    @step
    def extend(self, data: st.DataObject, by: float | None) -> None:
        before = self.server_ms()
        done = self.claim_op(data, lambda s, claim: self.client.group_extend(T, N, S, s, G, claim, by=by))
        if done is not None:
            by_ms = self.vt_ms if by is None else by * 1000
            assert before + by_ms <= done[2] <= self.server_ms() + by_ms

    @precondition(lambda self: self.handed)
    @rule(data=st.data(), reason=st.sampled_from(["", "bad card", "a|b"]))
    @step
    def dead_letter(self, data: st.DataObject, reason: str) -> None:
        done = self.claim_op(
            data, lambda s, claim: self.client.group_dead_letter(T, N, S, s, G, claim, reason=reason))
        if done is not None:
            self.model[done[0]].dead_letter(done[1], reason)
            event("dead letter on request")

    @precondition(lambda self: self.where(State.IN_FLIGHT))
    @rule(data=st.data())
    @step
    def lapse(self, data: st.DataObject) -> None:
        """Time passes for one lease: its expiry moves into the past."""
        s, o = data.draw(st.sampled_from(self.where(State.IN_FLIGHT)))
        moment = next(self.clock)
        # the record's lease covers a range (docs/keys.md): the record gets one of its own
        lease, held = self.key(s, LEASE), self.key(s, HELD)
        ((first, last),) = self.raw.zrange(held, o, "+inf", byscore=True, offset=0, num=1, withscores=True)
        first, last = int(first), int(last)
        assert first <= o <= last
        expiry = self.raw.zscore(lease, first)
        pipe = self.raw.pipeline(transaction=True)
        pipe.zrem(lease, first)
        pipe.zrem(held, first)
        for a, b, score in ((first, o - 1, expiry), (o + 1, last, expiry), (o, o, moment)):
            if a <= b:
                pipe.zadd(lease, {str(a): score})
                pipe.zadd(held, {str(a): b})
        pipe.execute()
        self.model[s].lapse(o, moment)

    @precondition(lambda self: self.where(State.OWED, due=False))
    @rule(data=st.data())
    @step
    def make_due(self, data: st.DataObject) -> None:
        """Time passes for one delayed nack: its due time moves into the past."""
        s, o = data.draw(st.sampled_from(self.where(State.OWED, due=False)))
        moment = next(self.clock)
        assert self.raw.zadd(self.key(s, OWED), {str(o): moment}, xx=True, ch=True) == 1
        self.model[s].make_due(o, moment)

    def pick_dead(self, data: st.DataObject, everything: bool) -> tuple[int, list[int]]:
        s = data.draw(st.sampled_from(sorted({s for s, _ in self.where(State.DEAD)})))
        dead = self.model[s].in_state(State.DEAD)
        return s, dead if everything else data.draw(st.lists(st.sampled_from(dead), min_size=1, unique=True))

    @precondition(lambda self: self.where(State.DEAD))
    @rule(data=st.data(), everything=st.booleans())
    @step
    def redrive(self, data: st.DataObject, everything: bool) -> None:
        """Dead letters owed again, due now; one whose record retention trimmed stays a
        dead letter (named in a list: NotFound, and nothing changes)."""
        s, chosen = self.pick_dead(data, everything)
        m = self.model[s]
        trimmed = [o for o in chosen if m.trimmed(o)]
        if trimmed and not everything:
            event("redrive of a trimmed record refused")
            with pytest.raises(NotFound, match="trimmed"):
                self.client.group_redrive(T, N, S, s, G, chosen)
            return
        chosen = [o for o in chosen if not m.trimmed(o)]
        before = self.server_ms()
        assert self.client.group_redrive(T, N, S, s, G, None if everything else chosen) == len(chosen)
        after = self.server_ms()
        if any(o < m.position for o in chosen):
            event("redrive below the position")
        for o in chosen:
            due = self.owed_score(s, o)
            assert before <= due <= after
            m.redrive(o, due)

    @precondition(lambda self: self.where(State.DEAD))
    @rule(data=st.data(), everything=st.booleans())
    @step
    def discard(self, data: st.DataObject, everything: bool) -> None:
        s, chosen = self.pick_dead(data, everything)
        assert self.client.group_discard(T, N, S, s, G, None if everything else chosen) == len(chosen)
        for o in chosen:
            self.model[s].discard(o)

    @precondition(lambda self: self.handed)
    @rule(data=st.data(), redrive=st.booleans())
    @step
    def not_a_dead_letter(self, data: st.DataObject, redrive: bool) -> None:
        """Redrive or discard naming a record that is not a dead letter (among some that
        are): NotFound, and nothing changes."""
        s = data.draw(st.sampled_from([s for s, m in enumerate(self.model) if m.tail]))
        m = self.model[s]
        others = [o for o in range(m.tail + 1) if o >= m.tail or m.records[o].state is not State.DEAD]
        offsets = data.draw(st.lists(st.sampled_from(m.in_state(State.DEAD) or [0]), max_size=2, unique=True))
        offsets = [o for o in offsets if o < m.tail and m.records[o].state is State.DEAD]
        offsets.insert(data.draw(st.integers(0, len(offsets))), data.draw(st.sampled_from(others)))
        with pytest.raises(NotFound):
            (self.client.group_redrive if redrive else self.client.group_discard)(T, N, S, s, G, offsets)

    @precondition(lambda self: any(m.max_len and m.tail - m.first > m.max_len for m in self.model))
    @rule()
    @step
    def trim(self) -> None:
        """stream_trim: each shard keeps its last max_len records, never past its position."""
        want = sum(m.trim() for m in self.model)
        assert self.client.stream_trim(T, N, S) == want
        event(f"trim: {'some' if want else 'nothing'} trimmed")

    @precondition(lambda self: self.where(State.OWED, State.LAPSED, State.IN_FLIGHT))
    @rule(data=st.data(), vt_ms=st.sampled_from([None, 300_000, 900_000]))
    @step
    def configure(self, data: st.DataObject, vt_ms: int | None) -> None:
        """group_configure: the new max attempts counts for every record from now on
        (held, owed or due); the new visibility timeout for leases granted from now on,
        those granted before keep their expiry. Max attempts is often set to the attempts
        of a record delivered and unfinished now (the boundary where it may not be
        delivered again)."""
        delivered = self.where(State.OWED, State.LAPSED, State.IN_FLIGHT)
        boundary = sorted({a for s, o in delivered if (a := self.model[s].records[o].attempts)})  # redriven: 0
        self.configure_group(data.draw(st.sampled_from([None, 1, 2, 3, 4, *boundary])), vt_ms)

    @precondition(lambda self: any(self.model[s].records[o].attempts for s, o in self.where(State.OWED, due=True)))
    @rule(data=st.data())
    @step
    def lower_max_attempts_to_a_due_record(self, data: st.DataObject) -> None:
        """group_configure sets max attempts to the attempts of a record owed and due:
        the next poll that meets it makes it a dead letter instead of delivering it."""
        due = [(s, o) for s, o in self.where(State.OWED, due=True) if self.model[s].records[o].attempts]
        s, o = data.draw(st.sampled_from(due))
        self.configure_group(self.model[s].records[o].attempts, None)

    def configure_group(self, max_attempts: int | None, vt_ms: int | None) -> None:
        leases = [self.raw.zrange(self.key(s, LEASE), 0, -1, withscores=True) for s in range(len(self.model))]
        self.client.group_configure(T, N, S, G, visibility_timeout_ms=vt_ms, max_attempts=max_attempts)
        assert [self.raw.zrange(self.key(s, LEASE), 0, -1, withscores=True) for s in range(len(self.model))] == leases
        if max_attempts is not None:
            lowered = max_attempts < self.model[0].max_attempts
            event(f"configure: max_attempts {'lowered' if lowered else 'kept or raised'}")
            for m in self.model:
                m.max_attempts = max_attempts
        if vt_ms is not None:
            self.vt_ms = vt_ms
        info = self.client.group_describe(T, N, S, G)
        assert (info.visibility_timeout_ms, info.max_attempts) == (self.vt_ms, self.model[0].max_attempts)

    @precondition(lambda self: not self.settled and any(m.tail for m in self.model))
    @rule()
    @step
    def settle_everything(self) -> None:
        """Once per example mid-way (teardown settles again); carries on from there."""
        self.settled = True
        self.settle()

    # -- invariants

    @invariant()
    def agrees(self) -> None:
        if self.model:
            self.check_agrees()
        self.sound = True

    def check_agrees(self) -> None:
        info = self.client.group_describe(T, N, S, G)
        assert len(info.shards) == len(self.model)
        firsts = self.client.stream_describe(T, N, S).firsts
        assert firsts == [m.first for m in self.model], f"first offsets kept {firsts}, the model's retention says"
        for s, (shard, m) in enumerate(zip(info.shards, self.model, strict=True)):
            want = m.describe()
            got = {k: getattr(shard, k) for k in want}
            assert got == want, f"shard {s}: describe says {got}, the model {want}"
            assert shard.trimmed == 0, f"shard {s}: retention trimmed {shard.trimmed} unfinished record(s)"
            assert (shard.oldest_unfinished_age_ms is None) == (m.position == m.tail)
            # the stored position and the runs of finished records above it (the done
            # key and the group hash's top run) hold exactly the model's finished records
            keys = dict(zip(GROUP_ROLES, self.name.group_key_list(s, G), strict=True))
            pos = int(self.raw.hget(keys["group"], "pos"))
            runs = finished_runs(self.raw, keys)
            assert all(a[1] + 1 < b[0] for a, b in itertools.pairwise(runs)), f"shard {s}: runs touch: {runs}"
            assert pos == m.tail or not m.records[pos].finished, f"shard {s}: stored position {pos} is finished"
            above = [o for first, last in runs for o in range(first, last + 1)]
            want_above = [o for o in range(pos + 1, m.tail) if m.records[o].finished]
            assert above == want_above, f"shard {s}: finished runs {runs} above {pos}, the model {want_above}"
            letters = self.client.group_dead_letters(T, N, S, s, G)
            assert [(d.offset, d.attempts) for d in letters] == m.dead_letters(), f"shard {s} dead letters"
            reasons = [(d.offset, d.reason) for d in letters]
            assert reasons == [(o, m.records[o].reason) for o, _ in m.dead_letters()], f"shard {s} dead-letter reasons"


def run(url: str, examples: int, steps: int) -> None:
    run_state_machine_as_test(
        lambda: GroupMachine(url),
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


_memory_names = itertools.count()


@pytest.fixture(params=["redis", "memory"])
def url(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    return f"memory://model-{os.getpid()}-{next(_memory_names)}"


def test_group_semantics_match_the_model(url: str) -> None:
    run(url, examples=100 if url.startswith("redis") else 40, steps=50)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # 2000 examples of 100 steps
def test_group_semantics_match_the_model_long(url: str, request: pytest.FixtureRequest) -> None:
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("long form: run with -m slow")
    run(url, examples=2000 if url.startswith("redis") else 500, steps=100)
