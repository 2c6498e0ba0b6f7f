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
