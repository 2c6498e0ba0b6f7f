"""An invariant checker over a delivery log, for fault and chaos tests.

A fault test runs producers and workers while it breaks Redis, and keeps two lists:

- :class:`PublishLog`: every publish that *returned* an offset, with its payload, and
  a count of publishes whose outcome is unknown (they raised during the fault);
- :class:`DeliveryLog`: every record a worker received (claim, attempts, time).

After the fault the test lets the workers drain the stream and calls :func:`check`,
which asserts the guarantees that must survive a crash, a restart or a failover
(CONTRACT guarantees 1, 6 and 10) and returns a :class:`Report` with the numbers:

1. no successful publish is missing: its (shard, offset) still holds its payload
   (an offset that was given to a publish never goes to another record);
2. every record of every shard ended acked or dead-lettered: the group's position
   equals the shard's tail, lag, in-flight and owed are 0;
3. nothing was skipped: every offset below the tail was delivered to a worker at least
   once or is a dead letter, so the position never passed a record nobody finished;
4. no attempt number of a record is handed out twice (the group never forgets a
   hand-out it confirmed), and no delivery says more than ``max_attempts``;

and counts redeliveries (deliveries beyond the first of each record), which a fault
causes: lapsed leases of records whose ack or poll reply was lost.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import felix_redis


@dataclass(frozen=True)
class Delivery:
    shard: int
    offset: int
    attempts: int
    at: float  # time.monotonic() when the worker got it
    worker: str


class DeliveryLog:
    """Thread-safe list of deliveries a worker saw."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.deliveries: list[Delivery] = []

    def record(self, item: Any, worker: str = "") -> None:
        with self._lock:
            self.deliveries.append(Delivery(item.shard, item.offset, item.attempts, time.monotonic(), worker))

    def by_record(self) -> dict[tuple[int, int], list[Delivery]]:
        with self._lock:
            out: dict[tuple[int, int], list[Delivery]] = {}
            for d in self.deliveries:
                out.setdefault((d.shard, d.offset), []).append(d)
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self.deliveries)


class PublishLog:
    """Thread-safe record of publishes: successful ones with their payloads, and the
    number whose outcome is unknown (the call raised while Redis was failing)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ok: dict[tuple[int, int], bytes] = {}
        self.duplicates: list[tuple[int, int]] = []  # an offset returned to two publishes
        self.unknown = 0
        self.errors: Counter[str] = Counter()

    def success(self, published: Any, payload: bytes) -> None:
        with self._lock:
            where = (published.shard, published.offset)
            if where in self.ok and self.ok[where] != payload:
                self.duplicates.append(where)
            self.ok[where] = payload

    def failure(self, exc: BaseException) -> None:
        with self._lock:
            self.unknown += 1
            self.errors[type(exc).__name__] += 1

    def __len__(self) -> int:
        with self._lock:
            return len(self.ok)


@dataclass
class Report:
    published: int
    unknown_publishes: int
    records: int  # records in the stream (published + unknown ones that landed)
    delivered: int  # deliveries seen by workers
    redeliveries: int  # deliveries beyond the first per record
    redelivered_records: int  # records delivered more than once
    lost_handouts: int  # records first seen with attempts > 1: an earlier hand-out never arrived
    late_deliveries: int  # deliveries that arrived after a later attempt of the same record
    dead_letters: int
    max_attempts_seen: int
    tails: list[int] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"published ok={self.published} unknown={self.unknown_publishes} records={self.records} "
            f"deliveries={self.delivered} redeliveries={self.redeliveries} "
            f"(records redelivered: {self.redelivered_records}) lost hand-outs={self.lost_handouts} "
            f"late={self.late_deliveries} "
            f"dead={self.dead_letters} "
            f"max attempts={self.max_attempts_seen} tails={self.tails}"
        )


def wait_drained(
    client: felix_redis.Client, tenant: str, namespace: str, stream: str, group: str, timeout: float
) -> Any:
    """Wait until the group's lag is 0 on every shard; return the last describe."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = client.group_describe(tenant, namespace, stream, group)
            if all(s.lag == 0 for s in info.shards):
                return info
        except felix_redis.FelixError:
            info = None
        if time.monotonic() > deadline:
            raise AssertionError(f"the group did not drain within {timeout:.0f}s: {info}")
        time.sleep(0.2)


def check(
    client: felix_redis.Client,
    tenant: str,
    namespace: str,
    stream: str,
    group: str,
    published: PublishLog,
    deliveries: DeliveryLog,
    *,
    max_attempts: int | None = None,
) -> Report:
    """Asserts the invariants listed in the module docstring; returns the numbers."""
    info = client.group_describe(tenant, namespace, stream, group)
    shards = {s.shard: s for s in info.shards}
    problems: list[str] = []

    # 2. everything finished: position == tail, nothing in flight or owed.
    for s in info.shards:
        if s.position != s.tail or s.lag != 0 or s.in_flight != 0 or s.owed != 0:
            problems.append(f"shard {s.shard} not drained: {s}")

    dead: dict[tuple[int, int], Any] = {}
    for shard in shards:
        for d in client.group_dead_letters(tenant, namespace, stream, shard, group):
            dead[(shard, d.offset)] = d

    # 1. every successful publish is still there, with its payload.
    if published.duplicates:
        problems.append(f"offsets returned to two different publishes: {published.duplicates[:10]}")
    by_shard: dict[int, list[int]] = {}
    for shard, offset in published.ok:
        by_shard.setdefault(shard, []).append(offset)
    for shard, offsets in sorted(by_shard.items()):
        tail = shards[shard].tail if shard in shards else -1
        beyond = [o for o in offsets if o >= tail]
        if beyond:
            problems.append(f"shard {shard}: published offsets at or past the tail {tail}: {beyond[:10]}")
        stored = {r.offset: r.payload for r in _read_all(client, tenant, namespace, stream, shard, tail)}
        missing = [o for o in offsets if o not in stored]
        changed = [o for o in offsets if o in stored and stored[o] != published.ok[(shard, o)]]
        if missing:
            problems.append(f"shard {shard}: {len(missing)} acknowledged publishes missing: {missing[:10]}")
        if changed:
            problems.append(f"shard {shard}: {len(changed)} offsets hold another payload: {changed[:10]}")

    # 3. nothing skipped: every offset below the tail was delivered or dead-lettered.
    seen = deliveries.by_record()
    for s in info.shards:
        never = [o for o in range(s.tail) if (s.shard, o) not in seen and (s.shard, o) not in dead]
        if never:
            problems.append(f"shard {s.shard}: {len(never)} records finished without a delivery: {never[:10]}")
        unpublished = [o for (sh, o) in published.ok if sh == s.shard and (sh, o) not in seen and (sh, o) not in dead]
        if unpublished:
            problems.append(f"shard {s.shard}: published records never delivered: {unpublished[:10]}")

    # 4. a record's deliveries carry distinct attempt numbers (a repeated one means the
    # group forgot a hand-out it had confirmed), never above max_attempts. Arrival order
    # may differ from hand-out order: a poll that sat in retries past the visibility
    # timeout returns a lease that already lapsed and was handed out again ("late").
    max_seen = 0
    late = 0
    for where, ds in seen.items():
        attempts = [d.attempts for d in sorted(ds, key=lambda d: d.at)]
        max_seen = max(max_seen, *attempts)
        if len(set(attempts)) != len(attempts):
            problems.append(f"record {where}: an attempt number was handed out twice: {attempts}")
        late += sum(1 for a, b in itertools.pairwise(attempts) if b < a)
        if max_attempts is not None and max(attempts) > max_attempts:
            problems.append(f"record {where}: delivered {max(attempts)} times, max_attempts is {max_attempts}")

    assert not problems, "invariants violated:\n  " + "\n  ".join(problems)
    counts = [len(ds) for ds in seen.values()]
    return Report(
        published=len(published.ok),
        unknown_publishes=published.unknown,
        records=sum(s.tail for s in info.shards),
        delivered=sum(counts),
        redeliveries=sum(c - 1 for c in counts),
        redelivered_records=sum(1 for c in counts if c > 1),
        lost_handouts=sum(1 for ds in seen.values() if min(d.attempts for d in ds) > 1),
        late_deliveries=late,
        dead_letters=len(dead),
        max_attempts_seen=max_seen,
        tails=[s.tail for s in info.shards],
    )


def _read_all(
    client: felix_redis.Client, tenant: str, namespace: str, stream: str, shard: int, tail: int
) -> Iterable[Any]:
    start = 0
    while start < tail:
        batch = client.read(tenant, namespace, stream, shard, start, 1000)
        if not batch:
            return
        yield from batch
        start = batch[-1].offset + 1


class Workload:
    """Producers and workers as threads, each with its own felix Client.

    Producers publish ``publish_keyed`` through an idempotent producer until
    :meth:`stop_producers`; a publish that raises is counted as unknown (it may or may
    not have landed) and the producer is replaced by a new one. Workers poll
    ``group_sharded(...).poll(batch, wait=...)``, log each delivery and ack it; an
    error (the fault) is counted and the worker polls again after a short pause.
    """

    def __init__(
        self,
        url: str,
        tenant: str,
        namespace: str,
        stream: str,
        group: str,
        *,
        producers: int = 2,
        workers: int = 3,
        keys: int = 64,
        batch: int = 16,
        poll_wait: float = 0.5,
        publish_pause: float = 0.002,
        client_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.url = url
        self.where = (tenant, namespace, stream)
        self.group = group
        self.keys = keys
        self.batch = batch
        self.poll_wait = poll_wait
        self.publish_pause = publish_pause
        self.client_kwargs = client_kwargs or {}
        self.published = PublishLog()
        self.deliveries = DeliveryLog()
        self.worker_errors: Counter[str] = Counter()
        self._errors_lock = threading.Lock()
        self._stop_producing = threading.Event()
        self._stop_working = threading.Event()
        self._producers = [
            threading.Thread(target=self._produce, args=(f"p{i}",), daemon=True) for i in range(producers)
        ]
        self._workers = [
            threading.Thread(target=self._work, args=(f"w{i}",), daemon=True) for i in range(workers)
        ]

    def start(self) -> Workload:
        for thread in self._producers + self._workers:
            thread.start()
        return self

    def _client(self) -> felix_redis.Client:
        return felix_redis.connect(self.url, **self.client_kwargs)

    def _error(self, exc: BaseException) -> None:
        with self._errors_lock:
            self.worker_errors[type(exc).__name__] += 1

    def _produce(self, name: str) -> None:
        client = self._client()
        producer: Any = None
        i = 0
        try:
            while not self._stop_producing.is_set():
                if producer is None:
                    try:
                        producer = client.idempotent_producer()
                    except felix_redis.FelixError:
                        time.sleep(0.1)
                        continue
                payload = f"{name}-{i}".encode()
                try:
                    published = producer.publish_keyed(*self.where, f"k{i % self.keys}", payload)
                except felix_redis.FelixError as exc:
                    self.published.failure(exc)
                    # A raised publish may have landed. Continue under a new producer id,
                    # as a careful application would: nothing it sends next can be
                    # taken for a re-send of that one, or hit a sequence gap if the
                    # failover lost it.
                    producer = None
                else:
                    self.published.success(published, payload)
                i += 1
                if self.publish_pause:
                    time.sleep(self.publish_pause)
        finally:
            client.close()

    def _work(self, name: str) -> None:
        client = self._client()
        group = client.group_sharded(*self.where, self.group)
        try:
            while not self._stop_working.is_set():
                try:
                    items = group.poll(self.batch, wait=self.poll_wait)
                except felix_redis.FelixError as exc:
                    self._error(exc)
                    time.sleep(0.05)
                    continue
                for item in items:
                    self.deliveries.record(item, name)
                if items:
                    try:
                        group.ack_many(items)
                    except felix_redis.FelixError as exc:
                        self._error(exc)  # not acked: the leases lapse, redelivered
        finally:
            client.close()

    def wait_published(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.published) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(self.published)} of {count} publishes within {timeout}s")
            time.sleep(0.02)

    def stop_producers(self) -> None:
        self._stop_producing.set()
        for thread in self._producers:
            thread.join(timeout=30)

    def stop(self) -> None:
        self._stop_producing.set()
        self._stop_working.set()
        for thread in self._producers + self._workers:
            thread.join(timeout=30)


# ---------------------------------------------------------------- chaos: leases, positions, kills
#
# The chaos test (tests/test_chaos.py) runs worker *processes* that it SIGKILLs, so
# their deliveries are written to per-process files (tests/support/chaos_jobs.py) with the Redis
# server's clock (TIME, microseconds) around each event. The functions below read those
# files and check, with bounds that only use what the log proves (no timing guesses):
#
# - one holder: the lease of delivery n+1 of a record did not start while the lease of
#   delivery n was valid (server time);
# - positions: a sampled position never moved back and was never above a record that
#   was certainly unfinished when it was sampled;
# - how many deliveries a kill caused.


@dataclass
class Lease:
    """One delivery of one record, from a worker's event log (times: server, us)."""

    shard: int
    offset: int
    attempts: int
    consumer: str
    pid: int
    before: int  # TIME before the poll call: <= the lease start
    after: int  # TIME after the poll returned: >= the lease start
    started: int | None = None  # handler start
    ended: int | None = None  # handler end (written before any ack or nack)
    ok: bool | None = None  # handler returned (True) or raised (False)
    outcome: str | None = None  # the worker's settle outcome (acked, retried, dead, stale, ...)


@dataclass(frozen=True)
class Kill:
    pid: int
    consumer: str
    at: int  # TIME after the killed process was reaped (us)
    reused: bool = False  # the replacement took the same consumer name (it reclaims)


@dataclass
class EventLogs:
    """Every delivery the worker processes logged, by (shard, offset) then attempts."""

    leases: dict[tuple[int, int], dict[int, Lease]]
    torn_lines: int  # partial last lines of killed processes
    orphan_events: int  # start/end/settle lines whose poll line is missing

    def deliveries(self) -> DeliveryLog:
        """The same deliveries as a :class:`DeliveryLog`, for :func:`check`."""
        log = DeliveryLog()
        for ds in self.leases.values():
            for lease in ds.values():
                log.deliveries.append(
                    Delivery(lease.shard, lease.offset, lease.attempts, lease.after / 1e6, lease.consumer))
        return log

    def __len__(self) -> int:
        return sum(len(ds) for ds in self.leases.values())


def read_event_logs(paths: Iterable[Any]) -> EventLogs:
    """Parses the ``worker-*.jsonl`` files written by tests/support/chaos_jobs.py."""
    import json

    leases: dict[tuple[int, int], dict[int, Lease]] = {}
    later: list[dict[str, Any]] = []
    torn = 0
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    ev = json.loads(line)
                except ValueError:
                    torn += 1
                    continue
                if ev["e"] == "poll":
                    ds = leases.setdefault((ev["s"], ev["o"]), {})
                    if ev["a"] in ds:
                        raise AssertionError(f"attempt {ev['a']} of record {ev['s']}:{ev['o']} handed out twice: "
                                             f"{ds[ev['a']]} and {ev}")
                    ds[ev["a"]] = Lease(ev["s"], ev["o"], ev["a"], ev["c"], ev["pid"], ev["tb"], ev["ta"])
                else:
                    later.append(ev)
    orphans = 0
    for ev in later:
        lease = leases.get((ev["s"], ev["o"]), {}).get(ev["a"])
        if lease is None or lease.pid != ev["pid"]:
            orphans += 1
            continue
        if ev["e"] == "start":
            lease.started = ev["t"]
        elif ev["e"] == "end":
            lease.ended, lease.ok = ev["t"], ev["ok"]
        elif ev["e"] == "settle":
            lease.outcome = ev["outcome"]
    return EventLogs(leases, torn, orphans)


def _expiry_floor_us(lease: Lease, visibility_ms: int) -> int:
    """A lower bound of the lease's expiry: scripts stamp ``now_ms + vt`` at the poll,
    which ran after ``before``; heartbeats only push it later."""
    return (lease.before // 1000 + visibility_ms) * 1000


def lease_end_floor(lease: Lease, visibility_ms: int, kill: Kill | None) -> int:
    """A lower bound of the server time the lease of ``lease`` stopped being valid.

    A lease ends when its holder settles it, when it expires, or (named consumers) when a
    new process with the same consumer name reclaims it. A settle follows the handler's
    logged end; the expiry is at least ``before + vt``; a reclaim by the successor comes
    after the kill. The bound is the earliest of those that apply. (The reclaimed record
    is owed at once: the successor, or any other consumer, may get it next.)"""
    floor = _expiry_floor_us(lease, visibility_ms)
    if lease.ended is not None:
        floor = min(floor, lease.ended)
    if kill is not None and kill.reused:
        floor = min(floor, kill.at)
    return floor


@dataclass
class LeaseReport:
    pairs: int  # consecutive deliveries of a record compared
    min_gap_ms: float  # smallest (next hand-out - lower bound of previous lease end)
    gaps: int  # attempt numbers missing from the log (a kill between poll and log line)


def check_leases(logs: EventLogs, kills: Iterable[Kill], visibility_ms: int) -> LeaseReport:
    """One holder (CONTRACT 2, server time): for consecutive logged deliveries n < m of a
    record, the hand-out of m (at most its ``after``) is not earlier than the lower bound
    of the end of n's lease. Sound: a violation proves two valid leases overlapped."""
    killed = {k.pid: k for k in kills}
    problems: list[str] = []
    pairs = gaps = 0
    min_gap = float("inf")
    for where, ds in sorted(logs.leases.items()):
        attempts = sorted(ds)
        gaps += attempts[-1] - len(attempts)
        for a, b in itertools.pairwise(attempts):
            prev, nxt = ds[a], ds[b]
            floor = lease_end_floor(prev, visibility_ms, killed.get(prev.pid))
            gap = (nxt.after - floor) / 1000
            pairs += 1
            min_gap = min(min_gap, gap)
            if gap < 0:
                problems.append(f"record {where}: attempt {b} handed out by {nxt.after} while attempt {a} "
                                f"held a valid lease until at least {floor} ({prev}, {nxt})")
    assert not problems, "two valid leases overlapped:\n  " + "\n  ".join(problems[:20])
    return LeaseReport(pairs, min_gap if pairs else 0.0, gaps)


@dataclass(frozen=True)
class PositionSample:
    before: int  # TIME before group_describe (us)
    after: int  # TIME after it returned (us)
    positions: tuple[int, ...]  # per shard


def sample_positions(client: felix_redis.Client, raw: Any, where: tuple[str, str, str], group: str) -> PositionSample:
    """One position sample with the server times around it (``raw``: a redis-py client)."""
    s, us = raw.time()
    before = int(s) * 1_000_000 + int(us)
    info = client.group_describe(*where, group)
    s, us = raw.time()
    return PositionSample(before, int(s) * 1_000_000 + int(us), tuple(x.position for x in info.shards))


def finish_floor(ds: dict[int, Lease], max_attempts: int, visibility_ms: int) -> int | None:
    """A lower bound of the server time a record was finished, or None when the log is
    incomplete for it. It can be finished by an ack or a dead-letter settle (after a
    handler's logged end) or, on its last allowed delivery, by a lapse or a reclaim (after
    that lease's expiry; a hand-back at shutdown any time after the poll)."""
    floor: int | None = None
    for lease in ds.values():
        candidates = []
        if lease.ended is not None:
            candidates.append(lease.ended)
        if lease.attempts >= max_attempts:
            candidates.append(_expiry_floor_us(lease, visibility_ms) if lease.ended is not None else lease.before)
        for c in candidates:
            floor = c if floor is None else min(floor, c)
    return floor


@dataclass
class PositionReport:
    samples: int
    checked_records: int  # records whose log was complete enough to bound their finish
    binding: int  # samples where a certainly-unfinished record bounded the position


def check_positions(
    samples: list[PositionSample],
    logs: EventLogs,
    dead: dict[tuple[int, int], Any],
    max_attempts: int,
    visibility_ms: int,
) -> PositionReport:
    """CONTRACT 6 on samples taken while the chaos ran (no redrive meanwhile): per shard
    the position never moved back, and never stood above a record that was certainly
    unfinished during the sample (its earliest possible finish came after the sample).

    A record counts only when its log is complete: every attempt from 1 up to the last
    logged, and, if it is a dead letter, the dead letter's attempts equal the last logged
    attempt (a hand-out lost with a killed process could otherwise have finished it)."""
    problems: list[str] = []
    ordered = sorted(samples, key=lambda s: s.before)
    for a, b in itertools.pairwise(ordered):
        if b.before >= a.after:  # samples that did not overlap in time
            for shard, (p, q) in enumerate(zip(a.positions, b.positions, strict=True)):
                if q < p:
                    problems.append(f"shard {shard}: position moved back from {p} to {q}")
    floors: dict[int, list[tuple[int, int]]] = {}
    checked = 0
    for (shard, offset), ds in logs.leases.items():
        attempts = sorted(ds)
        if attempts != list(range(1, attempts[-1] + 1)):
            continue
        d = dead.get((shard, offset))
        if d is not None and d.attempts != attempts[-1]:
            continue
        floor = finish_floor(ds, max_attempts, visibility_ms)
        if floor is None:
            continue
        checked += 1
        floors.setdefault(shard, []).append((offset, floor))
    binding = 0
    for shard in floors:
        floors[shard].sort()
    for sample in ordered:
        bound = False
        for shard, recs in floors.items():
            for offset, floor in recs:
                if floor > sample.after:  # unfinished from before the sample to after it
                    bound = True
                    if sample.positions[shard] > offset:
                        problems.append(f"shard {shard}: position {sample.positions[shard]} sampled at "
                                        f"[{sample.before}, {sample.after}] passed record {offset}, which was "
                                        f"not finished before {floor}")
                    break
        binding += bound
    assert not problems, "position invariant violated:\n  " + "\n  ".join(problems[:20])
    return PositionReport(len(samples), checked, binding)


@dataclass
class KillReport:
    kills: int
    after_kill: int  # deliveries that repeat one held by a killed process
    completed_not_acked: int  # ... whose handler had returned ok: the side effect ran twice
    interrupted: int  # ... whose handler was running when the process died
    not_started: int  # ... that the killed process had polled but not started
    other_redeliveries: int  # deliveries beyond the first not caused by a kill or a failure

    def summary(self) -> str:
        return (f"kills={self.kills} duplicates by kills={self.after_kill} (handler had finished, ack lost: "
                f"{self.completed_not_acked}; handler interrupted: {self.interrupted}; polled, not started: "
                f"{self.not_started}) other redeliveries={self.other_redeliveries}")


def duplicates_by_kills(logs: EventLogs, kills: Iterable[Kill]) -> KillReport:
    """Deliveries with attempts > 1 whose previous delivery was held by a killed process
    and did not fail in its handler (a failure is a planned retry, not a duplicate)."""
    kill_list = list(kills)
    killed = {k.pid for k in kill_list}
    done = interrupted = not_started = other = 0
    for ds in logs.leases.values():
        for a in sorted(ds)[:-1]:  # every delivery that has a successor
            prev = ds[a]
            if prev.ok is False:
                continue
            if prev.pid not in killed:
                other += 1
            elif prev.ok:
                done += 1
            elif prev.started is not None:
                interrupted += 1
            else:
                not_started += 1
    return KillReport(len(kill_list), done + interrupted + not_started, done, interrupted, not_started, other)


def check_unique_payloads(
    client: felix_redis.Client, tenant: str, namespace: str, stream: str, tails: list[int],
    ident: Any = lambda payload: payload,
) -> int:
    """The idempotent producer left no duplicate: no two records of the stream carry the
    same ``ident(payload)``. Returns the number of records read."""
    seen: dict[Any, tuple[int, int]] = {}
    dups: list[str] = []
    for shard, tail in enumerate(tails):
        for record in _read_all(client, tenant, namespace, stream, shard, tail):
            key = ident(record.payload)
            if key in seen:
                dups.append(f"{key!r} at {seen[key]} and {(shard, record.offset)}")
            seen[key] = (shard, record.offset)
    assert not dups, f"{len(dups)} payloads landed twice: {dups[:10]}"
    return len(seen)
