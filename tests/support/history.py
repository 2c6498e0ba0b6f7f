"""A history checker for fault tests, in the spirit of Jepsen's total-queue checker.

``tests/support/invariants.py`` checks the state a fault leaves behind. This module checks the
*history*: what every client asked for, when, and what it was told. It has three parts.

**The recorder** (:class:`Recorder`): threads, each with its own ``felix_redis.connect``
client made before the fault and kept through it, publish unique payloads and poll,
ack, nack or drop (let the lease lapse) what they get; a sampler thread reads the
group's positions. Every call is an :class:`Op` in a :class:`History` with its
``time.monotonic()`` invocation and completion and its outcome, as Jepsen words it:

- ``ok``: the call returned (publish: shard and offset; poll: the records with their
  claims and payloads; describe: the positions);
- ``fail``: a definite failure, the call was refused before anything was written
  (``StaleClaim``, ``NotFound``, ``InvalidArgument``, ...);
- ``info``: the outcome is unknown, it may or may not have been applied: a lost
  connection or a timeout mid-call (``ConnectionFailed``), ``NotReplicated`` (applied
  on the primary, maybe not on the replica that takes over), or any exception the
  client should not have let through (those are listed apart as client misbehaviour);
- ``pending``: the call never returned (a thread stuck at the end of the run).

**The final read** (:func:`read_final`): once the fault is over and the group drained,
a fresh client reads every shard (``read`` and ``subscribe``), the group's
``describe`` and its dead letters.

**The checker** (:func:`check`) takes the history and the final read, needs no Redis,
and reports every :class:`Anomaly` under the invariant it breaks:

a. every acknowledged publish (outcome ok) was delivered to the group (some poll
   returned its payload) or is a dead letter; otherwise it is **lost**. Separately, an
   acknowledged publish whose payload is not in the final read is **missing** (it was
   delivered, then a failover rolled the log back). Unknown-outcome publishes may or may
   not be there and are only counted (landed / absent). A publish that failed
   definitely must not be there; every record of the final read must come from a publish.
b. no offset holds two payloads, across the final ``read``, the final ``subscribe``,
   every delivery and every acknowledged publish; no payload sits at two offsets.
c. the final read of each shard is dense: offsets ``0 .. tail-1``, no gap, nothing
   past the tail, and ``read`` and ``subscribe`` agree.
d. one holder: no record was handed out under two valid leases at once. Delivery n of a
   record was handed out at some instant within its poll's [invoked, completed]; its
   lease lasts at least until ``invoked + visibility timeout``, or until an ack (any
   attempts), a nack or dead-letter of that attempt, or a reclaiming poll of the same
   named consumer on that shard was invoked. A later delivery (higher attempts)
   completed before that is an **overlap**. The same attempt number
   twice, or a higher attempt handed out before a lower one, is a forgotten hand-out.
   No delivery says more than ``max_attempts``.
e. the position never passed an unfinished record. For each sampled ``describe``, the
   record at any offset ``o`` below the position must have been able to finish before
   the sample completed: its earliest possible finish is the first ack of ``o`` that
   was invoked, a nack of ``o`` at ``max_attempts``, or ``max_attempts`` lapsed leases
   after its earliest possible publish (the (o+1)-th publish invoked on that shard).
   That bound holds on any server's branch of history, also one a failover discarded.
   In the final state every shard is drained (position == tail, nothing in flight or
   owed) and every offset below the position was delivered with its final payload and
   acked, or is a dead letter.

Every bound is conservative (an instant is taken at the end of its interval that makes
a violation least likely, plus ``slack`` for clock granularity), so a reported
violation proves the invariant broke.

**Rollback windows.** Under ``leader`` consistency Redis' asynchronous replication can
lose writes it acknowledged: an acknowledged publish, a hand-out or an ack vanish, an
offset is handed to another payload, a record is handed out twice. The runner passes
the intervals in which that can happen (from a second before the fault until the new
primary serves alone: the failover for a kill, the old primary's demotion for a pause)
as ``rollback_windows``; an anomaly whose cause lies in one is reported as
``explained`` (counted, not a violation). Under ``quorum`` no window is passed and
every anomaly is a violation.

:func:`run_trial` runs one trial on a Sentinel topology (``tests/test_history.py``,
``bench/failover_history.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import felix_redis
from felix_redis.models import ShardState
from tests.support.invariants import _read_all, wait_drained

T, N, S, G = "acme", "hist", "orders", "workers"
FAST_SYNC = ("--repl-diskless-sync-delay", "0")

#: Exceptions that say the call was refused before anything was written.
DEFINITE = (
    felix_redis.StaleClaim,
    felix_redis.NotFound,
    felix_redis.InvalidArgument,  # SequenceError included
    felix_redis.PermissionDenied,
    felix_redis.GroupExists,
    felix_redis.StreamExists,
    felix_redis.WrongKeyType,
)


# ------------------------------------------------------------------------------ history


class Delivered(NamedTuple):
    """One record a poll returned."""

    shard: int
    offset: int
    attempts: int
    payload: bytes


INF = float("inf")


@dataclass(slots=True)
class Op:
    """One call: its invocation, and once it returned, its completion and outcome."""

    index: int
    process: str
    kind: str  # publish | poll | ack | nack | describe
    invoked: float
    shard: int | None = None
    payload: bytes | None = None  # publish
    claims: tuple[tuple[int, int, int], ...] = ()  # ack / nack: (shard, offset, attempts)
    completed: float | None = None
    outcome: str = "pending"  # ok | fail | info | pending
    error: str | None = None  # exception type name: message
    offset: int | None = None  # publish ok
    records: tuple[Delivered, ...] = ()  # poll ok
    positions: tuple[int, ...] = ()  # describe ok
    consumer: str | None = None  # poll as a named consumer (group_poll_as)
    reclaim: bool = False  # ... that takes its own in-flight records back

    @property
    def end(self) -> float:
        """When the call ended, or +inf if it never returned."""
        return INF if self.completed is None else self.completed

    def ok(self, **fields: Any) -> Op:
        for name, value in fields.items():
            setattr(self, name, value)
        self.completed = time.monotonic()
        self.outcome = "ok"
        return self

    def failed(self, exc: BaseException) -> Op:
        self.completed = time.monotonic()
        self.outcome = classify(exc)
        self.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        return self


def classify(exc: BaseException) -> str:
    """``fail`` when the call certainly did nothing, else ``info`` (unknown outcome)."""
    return "fail" if isinstance(exc, DEFINITE) else "info"


class History:
    """The list of every call; thread-safe to append to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ops: list[Op] = []

    def invoke(self, process: str, kind: str, **fields: Any) -> Op:
        with self._lock:
            op = Op(len(self.ops), process, kind, time.monotonic(), **fields)
            self.ops.append(op)
            return op

    def add(self, kind: str, process: str = "p", invoked: float = 0.0, completed: float | None = None,
            outcome: str = "ok", **fields: Any) -> Op:
        """A hand-made op (unit tests of the checker)."""
        with self._lock:
            op = Op(len(self.ops), process, kind, invoked, completed=completed, outcome=outcome, **fields)
            if op.completed is None and outcome != "pending":
                op.completed = invoked
            self.ops.append(op)
            return op

    def snapshot(self) -> list[Op]:
        with self._lock:
            return list(self.ops)

    def __len__(self) -> int:
        return len(self.ops)


# ---------------------------------------------------------------------------- final read


@dataclass
class FinalState:
    """What a fresh client reads once the fault is over and the group drained."""

    describe: list[ShardState]
    records: dict[int, list[tuple[int, bytes]]]  # shard -> (offset, payload) as ``read`` returned them
    subscribed: dict[int, list[tuple[int, bytes]]] | None = None  # the same through ``subscribe``
    dead: dict[tuple[int, int], int] = field(default_factory=dict)  # (shard, offset) -> attempts


def read_final(client: felix_redis.Client, tenant: str, namespace: str, stream: str, group: str,
               *, timeout: float = 30.0) -> FinalState:
    info = client.group_describe(tenant, namespace, stream, group)
    records: dict[int, list[tuple[int, bytes]]] = {}
    dead: dict[tuple[int, int], int] = {}
    for s in info.shards:
        records[s.shard] = [(r.offset, r.payload) for r in _read_all(client, tenant, namespace, stream, s.shard,
                                                                     s.tail)]
        for d in client.group_dead_letters(tenant, namespace, stream, s.shard, group):
            dead[(s.shard, d.offset)] = d.attempts
    subscribed: dict[int, list[tuple[int, bytes]]] = {s.shard: [] for s in info.shards}
    tails = {s.shard: s.tail for s in info.shards}
    sub = client.subscribe(tenant, namespace, stream, start="earliest", batch=500, block=0.05)
    deadline = time.monotonic() + timeout
    while any(sub.positions[s] < tails[s] for s in tails) and time.monotonic() < deadline:
        for r in sub.poll():
            subscribed[r.shard].append((r.offset, r.payload))
    sub.close()
    return FinalState(list(info.shards), records, subscribed, dead)


# ------------------------------------------------------------------------------- checker


@dataclass
class Anomaly:
    check: str  # a .. e
    kind: str
    detail: str
    explained: bool = False  # caused by a write lost in a rollback window (leader consistency)

    def __str__(self) -> str:
        return f"({self.check}) {self.kind}{' [explained by rollback]' if self.explained else ''}: {self.detail}"


@dataclass
class CheckReport:
    acknowledged: int = 0  # publishes that returned ok
    unknown: int = 0  # publishes with an unknown outcome (info or pending)
    failed: int = 0  # publishes that failed definitely
    unknown_landed: int = 0
    unknown_absent: int = 0
    lost: int = 0  # acknowledged, never delivered nor dead-lettered
    missing: int = 0  # acknowledged, not in the final read
    records: int = 0  # records in the final read
    deliveries: int = 0
    redeliveries: int = 0
    dead_letters: int = 0
    lease_pairs: int = 0  # pairs of deliveries of one record compared for (d)
    min_lease_gap: float | None = None  # smallest (next hand-out - earliest end of the previous lease), s
    samples: int = 0  # describe samples checked for (e)
    min_sample_margin: float | None = None  # smallest (sample - latest earliest-finish below its position), s
    anomalies: list[Anomaly] = field(default_factory=list)

    def violations(self) -> list[Anomaly]:
        return [a for a in self.anomalies if not a.explained]

    def explained(self) -> list[Anomaly]:
        return [a for a in self.anomalies if a.explained]

    def kinds(self, explained: bool | None = None) -> Counter[str]:
        return Counter(f"{a.check}:{a.kind}" for a in self.anomalies
                       if explained is None or a.explained == explained)

    def summary(self) -> str:
        return (f"publishes ok={self.acknowledged} unknown={self.unknown} (landed {self.unknown_landed}, "
                f"absent {self.unknown_absent}) failed={self.failed}; LOST={self.lost} "
                f"missing from log={self.missing}; records={self.records} deliveries={self.deliveries} "
                f"redeliveries={self.redeliveries} dead={self.dead_letters}; lease pairs={self.lease_pairs} "
                f"samples={self.samples}; violations={dict(self.kinds(False))} "
                f"explained={dict(self.kinds(True))}")


def _in_windows(start: float, end: float, windows: Sequence[tuple[float, float]]) -> bool:
    return any(start <= b and end >= a for a, b in windows)


def check(
    history: History | Sequence[Op],
    final: FinalState,
    *,
    visibility_timeout: float,
    max_attempts: int,
    rollback_windows: Sequence[tuple[float, float]] = (),
    slack: float = 0.05,
) -> CheckReport:
    """Checks invariants (a)-(e) of the module docstring; returns every anomaly found.

    ``visibility_timeout`` in seconds (the group's); times in the history are
    ``time.monotonic()`` seconds; ``rollback_windows`` as described above."""
    ops = history.snapshot() if isinstance(history, History) else list(history)
    windows = list(rollback_windows)
    report = CheckReport()
    add = report.anomalies.append
    vt = visibility_timeout

    publishes: dict[bytes, Op] = {}
    for op in ops:
        if op.kind == "publish":
            assert op.payload is not None, f"publish without a payload: {op}"
            if op.payload in publishes:
                raise ValueError(f"payload {op.payload!r} published twice: the recorder must make them unique")
            publishes[op.payload] = op
    polls = [op for op in ops if op.kind == "poll" and op.outcome == "ok"]
    settles: dict[tuple[int, int], list[tuple[str, int, Op]]] = {}
    for op in ops:
        if op.kind in ("ack", "nack", "dead_letter"):
            for shard, offset, attempts in op.claims:
                settles.setdefault((shard, offset), []).append((op.kind, attempts, op))

    # -- the final read
    final_at: dict[tuple[int, int], bytes] = {}
    final_where: dict[bytes, list[tuple[int, int]]] = {}
    for shard, rows in final.records.items():
        for offset, payload in rows:
            if (shard, offset) in final_at:
                add(Anomaly("c", "offset read twice", f"shard {shard} offset {offset} came twice from read"))
            final_at[(shard, offset)] = payload
            final_where.setdefault(payload, []).append((shard, offset))
    report.records = len(final_at)
    report.dead_letters = len(final.dead)

    # -- (c) dense offsets, read and subscribe agree
    for s in final.describe:
        offsets = sorted(o for (sh, o) in final_at if sh == s.shard)
        have = set(offsets)
        gaps = [o for o in range(s.tail) if o not in have]
        beyond = [o for o in offsets if o >= s.tail]
        if gaps:
            add(Anomaly("c", "gap", f"shard {s.shard}: {len(gaps)} offsets below the tail {s.tail} missing "
                                    f"from the final read: {gaps[:10]}"))
        if beyond:
            add(Anomaly("c", "past tail", f"shard {s.shard}: offsets at or past the tail {s.tail}: {beyond[:10]}"))
        if final.subscribed is not None:
            got = final.subscribed.get(s.shard, [])
            if got != final.records.get(s.shard, []):
                diff = next((i for i, (x, y) in enumerate(zip(got, final.records.get(s.shard, []), strict=False))
                             if x != y), min(len(got), len(final.records.get(s.shard, []))))
                add(Anomaly("c", "read/subscribe differ", f"shard {s.shard}: subscribe returned {len(got)} "
                                                          f"records, read {len(final.records.get(s.shard, []))}; "
                                                          f"first difference at index {diff}"))
    # -- deliveries
    deliveries: dict[tuple[int, int, bytes], list[tuple[Delivered, Op]]] = {}
    delivered_payloads: set[bytes] = set()
    for op in polls:
        for d in op.records:
            deliveries.setdefault((d.shard, d.offset, d.payload), []).append((d, op))
            delivered_payloads.add(d.payload)
            report.deliveries += 1
    report.redeliveries = report.deliveries - len(deliveries)

    # -- (a) acknowledged publishes delivered or dead-lettered; unknown ones counted
    for payload, op in publishes.items():
        where = final_where.get(payload, [])
        if op.outcome == "ok":
            report.acknowledged += 1
            dead = any(final.dead.get(w) is not None for w in where)
            explained = bool(windows) and _in_windows(op.invoked, op.end, windows)
            if payload not in delivered_payloads and not dead:
                report.lost += 1
                add(Anomaly("a", "lost", f"{payload!r} acknowledged at {op.shard}:{op.offset} "
                                         f"(t={op.invoked:.3f}..{op.end:.3f}) was never delivered nor "
                                         f"dead-lettered", explained))
            if not where:
                report.missing += 1
                add(Anomaly("a", "missing from log", f"{payload!r} acknowledged at {op.shard}:{op.offset} "
                                                     f"(t={op.invoked:.3f}..{op.end:.3f}) is not in the final "
                                                     f"read", explained))
        elif op.outcome == "fail":
            report.failed += 1
            if where:
                add(Anomaly("a", "failed publish landed", f"{payload!r} failed with {op.error} but is at {where}"))
        else:
            report.unknown += 1
            if where:
                report.unknown_landed += 1
            else:
                report.unknown_absent += 1
    for payload, where in final_where.items():
        if payload not in publishes:
            add(Anomaly("a", "unexpected record", f"{payload!r} at {where} was never published"))

    # -- (b) one payload per offset, one offset per payload
    seen_at: dict[tuple[int, int], set[bytes]] = {}
    seen_where: dict[bytes, set[tuple[int, int]]] = {}
    for (shard, offset, payload) in deliveries:
        seen_at.setdefault((shard, offset), set()).add(payload)
        seen_where.setdefault(payload, set()).add((shard, offset))
    for payload, op in publishes.items():
        if op.outcome == "ok" and op.offset is not None and op.shard is not None:
            seen_at.setdefault((op.shard, op.offset), set()).add(payload)
            seen_where.setdefault(payload, set()).add((op.shard, op.offset))
    for where, payload in final_at.items():
        seen_at.setdefault(where, set()).add(payload)
        seen_where.setdefault(payload, set()).add(where)
    for shard, rows in (final.subscribed or {}).items():
        for offset, payload in rows:
            seen_at.setdefault((shard, offset), set()).add(payload)
            seen_where.setdefault(payload, set()).add((shard, offset))
    reused: set[tuple[int, int]] = set()
    for where, payloads in sorted(seen_at.items()):
        if len(payloads) > 1:
            reused.add(where)
            final_payload = final_at.get(where)
            others = payloads - {final_payload}
            explained = bool(windows) and all(p not in final_where for p in others)
            add(Anomaly("b", "offset holds two payloads",
                        f"{where[0]}:{where[1]} held {sorted(payloads)[:4]} (final read: {final_payload!r})",
                        explained))
    for payload, wheres in seen_where.items():
        if len(final_where.get(payload, [])) > 1:
            add(Anomaly("b", "payload stored twice", f"{payload!r} is at {final_where[payload]} in the final read"))
        elif len(wheres) > 1:
            explained = bool(windows) and len(final_where.get(payload, [])) <= 1
            add(Anomaly("b", "payload at two offsets", f"{payload!r} seen at {sorted(wheres)} (final read: "
                                                       f"{final_where.get(payload)})", explained))

    # -- (d) one holder, attempts
    gaps_seen: list[float] = []
    reclaims: dict[tuple[str, int | None], list[Op]] = {}
    for op in ops:
        if op.kind == "poll" and op.consumer is not None and op.reclaim:
            reclaims.setdefault((op.consumer, op.shard), []).append(op)
    for (shard, offset, payload), ds in deliveries.items():
        ordered = sorted(ds, key=lambda x: (x[0].attempts, x[1].invoked))
        for d, _ in ordered:
            if d.attempts > max_attempts or d.attempts < 1:
                add(Anomaly("d", "attempts out of range", f"{shard}:{offset}:{d.attempts} delivered "
                                                          f"(max_attempts {max_attempts})"))
        for (d1, op1), (d2, op2) in itertools.combinations(ordered, 2):
            explained = bool(windows) and (_in_windows(op1.invoked, op1.end, windows)
                                           or _in_windows(op2.invoked, op2.end, windows))
            where = f"{shard}:{offset} ({payload!r})"
            if d1.attempts == d2.attempts:
                add(Anomaly("d", "attempt handed out twice",
                            f"{where} attempt {d1.attempts} by poll #{op1.index} ({op1.process}, "
                            f"t={op1.invoked:.3f}..{op1.end:.3f}) and #{op2.index} ({op2.process}, "
                            f"t={op2.invoked:.3f}..{op2.end:.3f})", explained))
                continue
            if op2.end < op1.invoked - slack:
                add(Anomaly("d", "attempts out of order",
                            f"{where} attempt {d2.attempts} handed out by t={op2.end:.3f}, before attempt "
                            f"{d1.attempts} was polled at t={op1.invoked:.3f}", explained))
                continue
            floor = op1.invoked + vt
            for kind, attempts, settle in settles.get((shard, offset), ()):
                if settle.end <= op1.invoked or settle.invoked >= op2.end:
                    continue  # over before the first hand-out, or begun after the second
                if kind == "ack" or attempts == d1.attempts:
                    floor = min(floor, max(settle.invoked, op1.invoked))
            if op1.consumer is not None:  # its holder's next poll with reclaim hands it back
                for poll in reclaims.get((op1.consumer, shard), ()):
                    if poll.index != op1.index and poll.end > op1.invoked and poll.invoked < op2.end:
                        floor = min(floor, max(poll.invoked, op1.invoked))
            report.lease_pairs += 1
            gap = op2.end - floor
            gaps_seen.append(gap)
            if gap < -slack:
                add(Anomaly("d", "two valid leases",
                            f"{where} attempt {d2.attempts} handed out by t={op2.end:.3f} (poll #{op2.index}, "
                            f"{op2.process}) while attempt {d1.attempts} (poll #{op1.index}, {op1.process}, "
                            f"t={op1.invoked:.3f}) was leased until at least t={floor:.3f}", explained))
    report.min_lease_gap = min(gaps_seen) if gaps_seen else None

    # -- (e) position samples: never above a record that could not have finished yet
    shards = sorted({s.shard for s in final.describe} | {op.shard for op in publishes.values()
                                                          if op.shard is not None})
    publish_times = {s: sorted(op.invoked for op in publishes.values() if op.shard == s) for s in shards}
    first_ack: dict[tuple[int, int], float] = {}
    nacks: Counter[tuple[int, int]] = Counter()
    final_nack: dict[tuple[int, int], float] = {}
    for where, rows in settles.items():
        for kind, attempts, op in rows:
            if kind == "ack":
                first_ack[where] = min(first_ack.get(where, INF), op.invoked)
            else:
                nacks[where] += 1
                if kind == "dead_letter" or attempts >= max_attempts:
                    final_nack[where] = min(final_nack.get(where, INF), op.invoked)

    def finish_floor(shard: int, offset: int) -> float:
        times = publish_times.get(shard, [])
        appended = times[offset] if offset < len(times) else INF  # the (offset+1)-th publish on the shard
        lapses = max(1, max_attempts - nacks[(shard, offset)])
        return min(first_ack.get((shard, offset), INF), final_nack.get((shard, offset), INF),
                   appended + lapses * vt)

    prefix_max: dict[int, list[float]] = {}  # shard -> running max of the floors of offsets 0..o

    def latest_floor_below(shard: int, position: int) -> float:
        run = prefix_max.setdefault(shard, [])
        while len(run) < position:
            f = finish_floor(shard, len(run))
            run.append(max(run[-1], f) if run else f)
        return run[position - 1] if position > 0 else -INF

    margins: list[float] = []
    for op in ops:
        if op.kind != "describe" or op.outcome != "ok" or op.completed is None:
            continue
        report.samples += 1
        for shard, position in enumerate(op.positions):
            floor = latest_floor_below(shard, position)
            if floor == -INF:
                continue
            margins.append(op.completed - floor)
            if op.completed < floor - slack:
                offset = next(o for o in range(position) if finish_floor(shard, o) > op.completed + slack)
                add(Anomaly("e", "position passed an unfinished record",
                            f"shard {shard}: position {position} read by t={op.completed:.3f} (describe "
                            f"#{op.index}) although record {offset} could not finish before "
                            f"t={finish_floor(shard, offset):.3f}"))
    report.min_sample_margin = min(margins) if margins else None

    # -- (e) final state: drained, and everything below the position delivered and settled
    acked_at = {where for where, rows in settles.items() if any(kind == "ack" for kind, _, _ in rows)}
    for s in final.describe:
        if s.position != s.tail or s.in_flight or s.owed:
            add(Anomaly("e", "not drained", f"shard {s.shard}: position {s.position} tail {s.tail} "
                                            f"in flight {s.in_flight} owed {s.owed}"))
        for offset in range(min(s.position, s.tail)):
            where = (s.shard, offset)
            if where in final.dead:
                continue
            payload = final_at.get(where)
            if payload is None:
                continue  # a gap, reported under (c)
            explained = bool(windows) and where in reused
            if (s.shard, offset, payload) not in deliveries:
                add(Anomaly("e", "finished without a delivery",
                            f"{s.shard}:{offset} ({payload!r}) is below the position {s.position} but no poll "
                            f"returned it and it is no dead letter", explained))
            elif where not in acked_at:
                add(Anomaly("e", "finished without an ack",
                            f"{s.shard}:{offset} ({payload!r}) is below the position {s.position} but nobody "
                            f"acked it and it is no dead letter", explained))
    return report


# ------------------------------------------------------------------------------ recorder


class Recorder:
    """Worker threads that publish, poll and settle, and a sampler of positions, every
    call logged in :attr:`history`.

    Each thread has its own client, made in :meth:`start` (before any fault) and used
    until :meth:`stop`; it is never replaced. A thread loops: publish one unique payload
    (``NAME-I``) to a random shard (while publishing is on), poll one shard (round-robin,
    ``batch`` records, long-poll ``poll_wait``), then per record: drop it (its lease
    lapses) with ``drop_rate``, nack it with ``nack_rate``, else ack it with the others
    in one ``group_ack_many``. In drain mode every record is acked.
    """

    def __init__(
        self,
        url: str,
        where: tuple[str, str, str],
        group: str,
        shards: int,
        *,
        processes: int = 4,
        batch: int = 8,
        poll_wait: float = 0.2,
        publish_pause: float = 0.01,
        nack_rate: float = 0.05,
        drop_rate: float = 0.02,
        sample_every: float = 0.1,
        seed: int = 0,
        client_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.url = url
        self.where = where
        self.group = group
        self.shards = shards
        self.batch = batch
        self.poll_wait = poll_wait
        self.publish_pause = publish_pause
        self.nack_rate = nack_rate
        self.drop_rate = drop_rate
        self.sample_every = sample_every
        self.seed = seed
        self.client_kwargs = client_kwargs or {}
        self.history = History()
        self.names = [f"w{i}" for i in range(processes)]
        self.leaked: list[str] = []  # exceptions that are no FelixError (client misbehaviour)
        self._leak_lock = threading.Lock()
        self._publishing = threading.Event()
        self._publishing.set()
        self._draining = threading.Event()
        self._stop = threading.Event()
        self._clients: list[felix_redis.Client] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> Recorder:
        clients = [felix_redis.connect(self.url, **self.client_kwargs) for _ in range(len(self.names) + 1)]
        self._clients = clients
        for i, name in enumerate(self.names):
            self._threads.append(threading.Thread(target=self._work, args=(name, clients[i], i), daemon=True))
        self._threads.append(threading.Thread(target=self._sample, args=(clients[-1],), daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def _call(self, op: Op, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``; an exception completes ``op`` as failed and gives None."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            op.failed(exc)
            if not isinstance(exc, felix_redis.FelixError):
                with self._leak_lock:
                    self.leaked.append(f"{op.kind} #{op.index} at t={op.invoked:.3f}: {type(exc).__module__}."
                                       f"{type(exc).__name__}: {str(exc)[:200]}")
            return None

    def _work(self, name: str, client: felix_redis.Client, index: int) -> None:
        rng = random.Random(f"{self.seed}-{name}")
        where, group = self.where, self.group
        i = 0
        while not self._stop.is_set():
            if self._publishing.is_set():
                payload = f"{name}-{i}".encode()
                shard = rng.randrange(self.shards)
                op = self.history.invoke(name, "publish", shard=shard, payload=payload)
                published = self._call(op, client.publish, *where, payload, shard=shard)
                if published is not None:
                    op.ok(offset=published.offset)
                    if published.shard != shard:
                        with self._leak_lock:
                            self.leaked.append(f"publish #{op.index} to shard {shard} landed on {published}")
            shard = (index + i) % self.shards
            op = self.history.invoke(name, "poll", shard=shard)
            records = self._call(op, client.group_poll, *where, shard, group, max_records=self.batch,
                                 wait=self.poll_wait)
            if records is None:
                self._stop.wait(0.02)
            else:
                op.ok(records=tuple(Delivered(r.shard, r.offset, r.attempts, r.payload) for r in records))
                done = []
                for r in records:
                    roll = rng.random()
                    if self._draining.is_set() or roll >= self.drop_rate + self.nack_rate:
                        done.append(r)
                    elif roll >= self.drop_rate:
                        nack = self.history.invoke(name, "nack", shard=shard, claims=((r.shard, r.offset, r.attempts),))
                        if self._call(nack, client.group_nack, *where, shard, group, r) is not None:
                            nack.ok()
                    # else dropped: its lease lapses
                if done:
                    ack = self.history.invoke(name, "ack", shard=shard,
                                              claims=tuple((r.shard, r.offset, r.attempts) for r in done))
                    if self._call(ack, client.group_ack_many, *where, shard, group, done) is not None:
                        ack.ok()
            i += 1
            if self.publish_pause:
                self._stop.wait(self.publish_pause)

    def _sample(self, client: felix_redis.Client) -> None:
        while not self._stop.wait(self.sample_every):
            op = self.history.invoke("sampler", "describe")
            info = self._call(op, client.group_describe, *self.where, self.group)
            if info is not None:
                op.ok(positions=tuple(s.position for s in sorted(info.shards, key=lambda s: s.shard)))

    # -- phases

    def published_ok(self, since: float = -INF) -> int:
        return sum(1 for op in self.history.snapshot()
                   if op.kind == "publish" and op.outcome == "ok" and op.invoked >= since)

    def wait_published(self, count: int, timeout: float, since: float = -INF) -> None:
        deadline = time.monotonic() + timeout
        while self.published_ok(since) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {self.published_ok(since)} of {count} publishes returned ok within "
                                     f"{timeout:.0f}s")
            time.sleep(0.05)

    def recovery(self, since: float) -> dict[str, float | None]:
        """Per thread: seconds from ``since`` until both a publish and a poll invoked at
        or after ``since`` had returned ok on that thread's client (None: not yet)."""
        first: dict[tuple[str, str], float] = {}
        for op in self.history.snapshot():
            if op.outcome == "ok" and op.kind in ("publish", "poll") and op.invoked >= since:
                key = (op.process, op.kind)
                first[key] = min(first.get(key, INF), op.end)
        out: dict[str, float | None] = {}
        for name in self.names:
            done = max(first.get((name, "publish"), INF), first.get((name, "poll"), INF))
            out[name] = None if done == INF else done - since
        return out

    def stop_publishing(self) -> None:
        self._publishing.clear()

    def drain_mode(self) -> None:
        """Stop publishing; ack every record from now on."""
        self._publishing.clear()
        self._draining.set()

    def stop(self, timeout: float = 20.0) -> list[str]:
        """Stops every thread; returns the threads still stuck in a call after ``timeout``
        (with that call), and closes the clients of the others."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = []
        for thread, name in zip(self._threads, [*self.names, "sampler"], strict=True):
            if thread.is_alive():
                pending = [op for op in self.history.snapshot() if op.process == name and op.outcome == "pending"]
                stuck.append(f"{name}: stuck in {pending[-1] if pending else 'no call'}")
        if not stuck:
            for client in self._clients:
                with contextlib.suppress(Exception):
                    client.close()
        return stuck

    def errors(self) -> Counter[str]:
        """``kind outcome ErrorType`` counts."""
        return Counter(f"{op.kind} {op.outcome} {op.error.split(':', 1)[0]}" for op in self.history.snapshot()
                       if op.error is not None)


# ---------------------------------------------------------------------------- the faults


class IsolationObserver:
    """Watches a paused-then-resumed old primary directly (a raw redis-py connection of
    the checker, not a workload client) until the sentinels demote it: when that
    happened, and which records its log held while it still acted as a primary."""

    def __init__(self, port: int, log_keys: Sequence[str]) -> None:
        self.port = port
        self.log_keys = list(log_keys)
        self.payloads: dict[bytes, tuple[int, int]] = {}  # payload -> (shard, offset) on the old primary
        self.demoted_at: float | None = None
        self.repl_offsets: list[int] = []  # master_repl_offset while it was a primary
        self.first_read_at: float | None = None  # the first complete read of its logs
        self.errors: list[str] = []

    def watch(self, timeout: float) -> None:
        import redis

        last = ["-"] * len(self.log_keys)
        deadline = time.monotonic() + timeout
        with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2) as conn:
            while time.monotonic() < deadline:
                try:
                    info = conn.info("replication")
                    if info.get("role") != "master":
                        self.demoted_at = time.monotonic()
                        return
                    self.repl_offsets.append(int(info.get("master_repl_offset", 0)))
                    for shard, key in enumerate(self.log_keys):
                        for _ in range(100):
                            start = last[shard] if last[shard] == "-" else f"({last[shard]}"
                            entries = conn.xrange(key, start, "+", count=1000)
                            for entry_id, fields in entries:
                                offset = int(entry_id.split(b"-")[0])
                                self.payloads[fields[b"p"]] = (shard, offset)
                            if entries:
                                last[shard] = entries[-1][0].decode()
                            if len(entries) < 1000:
                                break
                    if self.first_read_at is None:
                        self.first_read_at = time.monotonic()
                except redis.RedisError as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.05)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


@dataclass
class TrialResult:
    consistency: str
    fault: str
    seed: int
    report: CheckReport
    recovery: dict[str, float | None]
    failover_after: float  # s from the fault until the sentinels reported the new primary
    resumed_after: float | None  # pause: s from the fault to SIGCONT
    demoted_after: float | None  # pause: s from the fault until the old primary was a replica
    isolated_records: int  # pause: records the old primary held while isolated that the final read lacks
    isolated_acknowledged: list[str]  # ... of those, publishes the client was told were ok
    isolated_outcomes: Counter[str]  # ... outcomes of those publishes
    missing_unseen: int  # pause: acknowledged publishes missing from the final log the observer never saw there
    observer_errors: list[str]
    observer_first_read: float | None  # s from the fault to the observer's first complete read of the old primary
    missing_by_phase: Counter[str]  # acknowledged publishes missing from the final log, by when they were sent
    missing_last_after_resume: float | None  # pause: the last of those sent after SIGCONT, s after SIGCONT
    errors: Counter[str]
    leaked: list[str]
    stuck: list[str]
    ops: int
    duration: float
    fault_at: float = 0.0  # time.monotonic() of the fault
    history: History | None = None
    notes: list[str] = field(default_factory=list)

    def timeline(self, before: float = 0.5, after: float = 20.0, slow: float = 0.3) -> list[str]:
        """The calls around the fault that failed, never returned or took over ``slow``
        seconds, one line each, times relative to the fault."""
        out = []
        for op in self.history.snapshot() if self.history else []:
            if op.end < self.fault_at - before or op.invoked > self.fault_at + after:
                continue
            if op.outcome == "ok" and op.end - op.invoked < slow:
                continue
            took = "never returned" if op.completed is None else f"{op.end - op.invoked:.2f}s"
            out.append(f"{op.invoked - self.fault_at:+8.3f} {op.process:8} {op.kind:8} {op.outcome:5} {took:>8} "
                       f"{op.error or ''}"[:220])
        return out

    def line(self) -> str:
        rec = [v for v in self.recovery.values() if v is not None]
        return (f"[{self.consistency}/{self.fault} seed {self.seed}] {self.report.summary()}; recovery "
                f"{[round(v, 2) for v in rec]} (not recovered: {sum(v is None for v in self.recovery.values())}); "
                f"failover after {self.failover_after:.2f}s"
                + (f", SIGCONT after {self.resumed_after:.2f}s" if self.resumed_after is not None else "")
                + (f", demoted after {self.demoted_after:.2f}s" if self.demoted_after is not None else "")
                + (f"; old primary took {self.isolated_records} records while isolated, "
                   f"{len(self.isolated_acknowledged)} acknowledged (outcomes {dict(self.isolated_outcomes)}), "
                   f"{self.missing_unseen} missing acknowledged publishes not seen on it (first read after "
                   f"{self.observer_first_read}s, errors {self.observer_errors[:3]})"
                   if self.fault == "pause" else "")
                + (f"; missing by phase {dict(self.missing_by_phase)}" if self.missing_by_phase else "")
                + (f" (the last sent {self.missing_last_after_resume:.2f}s after SIGCONT)"
                   if self.missing_last_after_resume is not None else "")
                + f"; errors {dict(self.errors)}; leaked {len(self.leaked)}; stuck {self.stuck}; ops {self.ops}; "
                  f"{self.duration:.1f}s")


def run_trial(
    consistency: str,
    fault: str,
    *,
    seed: int = 0,
    shards: int = 2,
    processes: int = 4,
    visibility_timeout_ms: int = 2000,
    max_attempts: int = 3,
    before: int = 300,
    after: int = 200,
    hold: float = 0.5,
    url_query: str = "",
    server_args: Sequence[str] = (),
    keep_logs: str | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> TrialResult:
    """One trial: a Sentinel topology (primary, 2 replicas, 3 sentinels), a stream of
    ``shards`` shards with replication 3 and ``consistency``, the recorder running;
    ``before`` publishes, the fault, then until every thread has published and polled
    again, the old primary (pause) is a replica, and ``after`` more publishes returned
    ok; then drain (recorder threads ack everything), stop, read with a fresh client
    and check.

    ``fault``: ``kill`` (SIGKILL the primary; it is not restarted) or ``pause`` (SIGSTOP
    the primary until the sentinels promoted a replica, ``hold`` seconds more, SIGCONT).
    ``url_query`` is appended to the clients' URL (``?socket_timeout=5``), ``server_args``
    to every data server's command line (``--min-replicas-to-write 1``). With
    ``keep_logs`` (a directory), every server's and sentinel's log is copied there
    before the topology is stopped."""
    from felix_redis.testing.topology import SentinelTopology

    if fault not in ("kill", "pause"):
        raise ValueError(f"unknown fault {fault!r}")
    started = time.monotonic()
    # the launcher's down-after 2 s: at 1 s the sentinels sometimes fail over a second
    # time right after the first (see SETTINGS); that second fault is not the trial's
    topology = SentinelTopology(replicas=2, sentinels=3, extra=[*FAST_SYNC, *server_args])
    recorder: Recorder | None = None
    stopped_pid: int | None = None
    notes: list[str] = []
    try:
        topology.start()
        url = topology.url + url_query
        with felix_redis.connect(url) as admin:
            admin.stream_create(T, N, S, shards=shards, replication=3, consistency=consistency)
            admin.group_create(T, N, S, G, visibility_timeout_ms=visibility_timeout_ms, max_attempts=max_attempts)
            log_keys = [admin.core.name(T, N, S).shard_keys(shard)[1] for shard in range(shards)]
        recorder = Recorder(url, (T, N, S), G, shards, processes=processes, seed=seed).start()
        recorder.wait_published(before, 30)

        old = topology.primary
        assert old.process is not None
        observer: IsolationObserver | None = None
        resumed_at: float | None = None
        fault_at = time.monotonic()
        if fault == "kill":
            topology.kill_primary()
            topology.wait_for_failover(timeout=30)
            failover_at = time.monotonic()
            log(f"killed 127.0.0.1:{old.port}; failover after {failover_at - fault_at:.2f}s")
        else:
            stopped_pid = old.process.pid
            os.kill(stopped_pid, signal.SIGSTOP)
            try:
                topology.wait_for_failover(timeout=30)
                failover_at = time.monotonic()
                time.sleep(hold)
            finally:
                _signal(stopped_pid, signal.SIGCONT)
                stopped_pid = None
            resumed_at = time.monotonic()
            log(f"paused 127.0.0.1:{old.port}; failover after {failover_at - fault_at:.2f}s, "
                f"SIGCONT after {resumed_at - fault_at:.2f}s")
            observer = IsolationObserver(old.port, log_keys)
            observer.watch(timeout=60)
            if observer.demoted_at is None:
                notes.append("the old primary was not demoted within 60 s of SIGCONT")
            else:
                log(f"old primary demoted {observer.demoted_at - fault_at:.2f}s after the fault")
        fault_over = observer.demoted_at if observer and observer.demoted_at else failover_at

        # run on until every thread recovered and `after` more publishes returned ok
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(v is not None for v in recorder.recovery(fault_at).values()) \
                    and recorder.published_ok(since=fault_over) >= after:
                break
            time.sleep(0.05)
        else:
            notes.append(f"after 60 s: recovery {recorder.recovery(fault_at)}, "
                         f"{recorder.published_ok(since=fault_over)} publishes since the fault ended")
        recovery = recorder.recovery(fault_at)
        try:  # the fault's failover, and no other (a second one is a fault of its own)
            failovers = topology.failovers()
        except Exception as exc:  # reported as a note; the trial goes on
            notes.append(f"the sentinels could not be asked how often they failed over: {exc}")
        else:
            if failovers != 1:
                notes.append(f"the sentinels failed over {failovers} times (config-epoch), not once")

        recorder.drain_mode()
        with felix_redis.connect(url) as fresh:  # the final read's own client, made after the fault
            try:
                wait_drained(fresh, T, N, S, G, timeout=40)
            except AssertionError as exc:
                notes.append(str(exc))
            stuck = recorder.stop()
            final = read_final(fresh, T, N, S, G)

        windows: list[tuple[float, float]] = []
        if consistency == "leader":
            windows = [(fault_at - 1.0, fault_over + 1.0)]
        report = check(recorder.history, final, visibility_timeout=visibility_timeout_ms / 1000,
                       max_attempts=max_attempts, rollback_windows=windows)

        isolated: list[bytes] = []
        ops = {op.payload: op for op in recorder.history.snapshot() if op.kind == "publish"}
        final_payloads = {p for rows in final.records.values() for _, p in rows}
        unseen = 0
        if observer is not None:
            isolated = [p for p in observer.payloads if p not in final_payloads]
            unseen = sum(1 for p, op in ops.items() if op.outcome == "ok" and p not in final_payloads
                         and p not in observer.payloads)
        outcomes = Counter((ops[p].outcome + " " + (ops[p].error or "").split(":", 1)[0]).strip()
                           if p in ops else "not published by the recorder" for p in isolated)
        acknowledged = [f"{p!r} ok at {ops[p].shard}:{ops[p].offset}" for p in isolated
                        if p in ops and ops[p].outcome == "ok"]
        phases: Counter[str] = Counter()
        after_resume: list[float] = []
        for p, op in ops.items():
            if op.outcome != "ok" or p in final_payloads:
                continue
            if op.invoked < fault_at + 0.05:
                phases["sent before the fault" if op.end < fault_at else "in flight at the fault"] += 1
            elif resumed_at is not None and op.invoked >= resumed_at:
                phases["sent after SIGCONT"] += 1
                after_resume.append(op.invoked - resumed_at)
            else:
                phases["sent during the fault"] += 1
        return TrialResult(
            consistency, fault, seed, report, recovery,
            failover_after=failover_at - fault_at,
            resumed_after=None if resumed_at is None else resumed_at - fault_at,
            demoted_after=None if observer is None or observer.demoted_at is None else observer.demoted_at - fault_at,
            isolated_records=len(isolated), isolated_acknowledged=acknowledged, isolated_outcomes=outcomes,
            missing_unseen=unseen, observer_errors=observer.errors if observer else [],
            observer_first_read=None if observer is None or observer.first_read_at is None
            else round(observer.first_read_at - fault_at, 2),
            missing_by_phase=phases, missing_last_after_resume=max(after_resume) if after_resume else None,
            errors=recorder.errors(), leaked=list(recorder.leaked), stuck=stuck, ops=len(recorder.history),
            duration=time.monotonic() - started, fault_at=fault_at, history=recorder.history, notes=notes,
        )
    finally:
        if stopped_pid is not None:
            _signal(stopped_pid, signal.SIGCONT)
        if recorder is not None:
            recorder.stop(timeout=10)
        if keep_logs is not None:
            _copy_logs(topology, keep_logs)
        topology.stop()


def _copy_logs(topology: Any, directory: str) -> None:
    import shutil

    os.makedirs(directory, exist_ok=True)
    for server in [*topology.servers, *topology.sentinels]:
        role = "sentinel" if server in topology.sentinels else "redis"
        with contextlib.suppress(OSError):
            shutil.copy(server.logfile, os.path.join(directory, f"{role}-{server.port}.log"))


# ------------------------------------------------------------------------------- summary


@dataclass
class Cell:
    """The trials of one (consistency, fault), for the table."""

    trials: int = 0
    acknowledged: int = 0
    lost: int = 0
    missing: int = 0
    unknown: int = 0
    unknown_landed: int = 0
    violations: int = 0  # unexplained anomalies of (b)-(e)
    explained: int = 0  # anomalies of (b)-(e) explained by a rollback window
    recoveries: list[float] = field(default_factory=list)
    not_recovered: int = 0
    isolated_acknowledged: int = 0
    isolated: int = 0

    def add(self, result: TrialResult) -> None:
        r = result.report
        self.trials += 1
        self.acknowledged += r.acknowledged
        self.lost += r.lost
        self.missing += r.missing
        self.unknown += r.unknown
        self.unknown_landed += r.unknown_landed
        losses = ("lost", "missing from log")
        self.violations += sum(1 for a in r.violations() if a.check != "a" or a.kind not in losses)
        self.explained += sum(1 for a in r.explained() if a.check != "a")
        self.recoveries += [v for v in result.recovery.values() if v is not None]
        self.not_recovered += sum(v is None for v in result.recovery.values())
        self.isolated_acknowledged += len(result.isolated_acknowledged)
        self.isolated += result.isolated_records

    def recovery_text(self) -> str:
        if not self.recoveries:
            return "-"
        text = f"{statistics.median(self.recoveries):.1f} s / {max(self.recoveries):.1f} s"
        return text + (f" ({self.not_recovered} clients never)" if self.not_recovered else "")


def table(cells: dict[tuple[str, str], Cell]) -> str:
    """The Markdown table of bench/failover_history.py and docs/operations.md."""
    rows = ["| consistency | fault | trials | acknowledged publishes lost (never delivered) | "
            "acknowledged, missing from the final log | unknown-outcome publishes (landed) | "
            "records the isolated old primary took (acknowledged) | other anomalies: violations (explained) | "
            "recovery per client, median / max |",
            "|---|---|---|---|---|---|---|---|---|"]
    for (consistency, fault), c in sorted(cells.items()):
        isolated = f"{c.isolated} ({c.isolated_acknowledged})" if fault == "pause" else "-"
        rows.append(f"| `{consistency}` | {fault} | {c.trials} | {c.lost} of {c.acknowledged} | "
                    f"{c.missing} of {c.acknowledged} | {c.unknown} ({c.unknown_landed}) | {isolated} | "
                    f"{c.violations} ({c.explained}) | {c.recovery_text()} |")
    return "\n".join(rows)


__all__ = [
    "Anomaly",
    "Cell",
    "CheckReport",
    "Delivered",
    "FinalState",
    "History",
    "IsolationObserver",
    "Op",
    "Recorder",
    "TrialResult",
    "check",
    "classify",
    "read_final",
    "run_trial",
    "table",
]

