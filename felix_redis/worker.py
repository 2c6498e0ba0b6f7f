"""Workers: register a handler, run a worker; the poll loop is not yours to write.

:class:`Worker` runs a plain function on a pool of threads; :class:`felix_redis.aioworker.AsyncWorker`
runs an ``async def`` on asyncio tasks. Both long-poll a group through all (or some) shards
of a stream, keep at most ``concurrency`` records in flight, ack on success and nack with a
backoff delay on failure, extend leases while a handler runs, and shut down gracefully.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import queue
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from felix_redis.client import Item, ShardedGroup
from felix_redis.constants import MAX_REASON_BYTES
from felix_redis.errors import FelixError, InvalidArgument, StaleClaim
from felix_redis.models import GroupInfo, Record

if TYPE_CHECKING:
    from felix_redis.metrics import BoundWorkerMetrics, WorkerMetrics

__all__ = [
    "Backoff",
    "Decision",
    "Fatal",
    "Retry",
    "Worker",
    "WorkerStats",
    "decide",
    "import_handler",
    "parse_shards",
]

log = logging.getLogger("felix_redis.worker")

Handler = Callable[[Record], object]

# Job outcomes, as logged and counted.
ACKED = "acked"
RETRIED = "retried"
DEAD = "dead"
HANDED_BACK = "handed_back"
STALE = "stale"
#: How long a finished job's ack may wait for the worker's next poll to carry it (one
#: round trip for both) before the settle thread acks it alone.
ACK_LINGER_S = 0.02


class Retry(Exception):
    """Raise from a handler to retry the record after ``after`` seconds (None: the backoff)."""

    def __init__(self, after: float | None = None, reason: str = "") -> None:
        super().__init__(reason or (f"retry after {after:g}s" if after is not None else "retry"))
        self.after = after


class Fatal(Exception):
    """Raise from a handler to dead-letter the record at once; the message is the reason."""


@dataclass(frozen=True)
class Backoff:
    """Retry delays: ``base_s * factor ** (attempts - 1)``, capped at ``max_s``, then
    shortened by up to ``jitter`` (a fraction, 0..1) at random so retries spread out."""

    base_s: float = 1.0
    factor: float = 2.0
    max_s: float = 300.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.max_s < 0 or self.factor < 1 or not 0 <= self.jitter <= 1:
            raise ValueError(f"bad backoff {self}: need base_s, max_s >= 0, factor >= 1, 0 <= jitter <= 1")

    def delay(self, attempts: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before the delivery after ``attempts`` failed ones."""
        exponent = max(0, attempts - 1)
        # Cap the exponent first so a high attempt count cannot overflow the float.
        raw = self.max_s if exponent > 200 else min(self.max_s, self.base_s * self.factor**exponent)
        if self.jitter:
            raw *= 1 - self.jitter * (rng or random).random()
        return raw


@dataclass(frozen=True)
class Decision:
    """What to do with a record whose handler raised."""

    dead: bool
    delay_s: float
    reason: str


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _fit(reason: str) -> str:
    """``reason`` cut to the longest dead-letter reason Redis accepts."""
    raw = reason.encode()
    return raw[:MAX_REASON_BYTES].decode(errors="ignore") if len(raw) > MAX_REASON_BYTES else reason


def decide(
    exc: BaseException,
    attempts: int,
    max_attempts: int,
    backoff: Backoff,
    dead_letter_on: tuple[type[BaseException], ...] = (),
    rng: random.Random | None = None,
) -> Decision:
    """Retry or dead-letter: ``Fatal`` and ``dead_letter_on`` types die at once, the last
    allowed delivery dies with the error as reason, anything else retries with a delay."""
    if isinstance(exc, Fatal):
        return Decision(True, 0.0, _fit(str(exc) or "Fatal"))
    if dead_letter_on and isinstance(exc, dead_letter_on):
        return Decision(True, 0.0, _fit(_reason(exc)))
    if attempts >= max_attempts:
        return Decision(True, 0.0, _fit(f"failed {attempts} of {max_attempts} attempts: {_reason(exc)}"))
    if isinstance(exc, Retry) and exc.after is not None:
        return Decision(False, max(0.0, exc.after), _reason(exc))
    return Decision(False, backoff.delay(attempts, rng), _reason(exc))


@dataclass
class WorkerStats:
    """Counters of one worker since it started."""

    processed: int = 0
    failed: int = 0
    retried: int = 0
    dead_lettered: int = 0
    handed_back: int = 0
    stale: int = 0
    in_flight: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def import_handler(spec: str) -> Callable[..., Any]:
    """The callable named by ``package.module:function`` (or ``package.module.function``)."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"handler must look like package.module:function, got {spec!r}")
    module = importlib.import_module(module_name)
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{spec} is not callable")
    return target  # type: ignore[no-any-return]


def parse_shards(text: str) -> list[int]:
    """``"0,2,5-7"`` -> ``[0, 2, 5, 6, 7]``."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"bad shard list {text!r}: use numbers and ranges like 0,2,5-7")
        out.extend(range(int(lo), int(hi) + 1) if dash else [int(lo)])
    if not out:
        raise ValueError("empty shard list")
    return sorted(set(out))


def job_line(where: str, record: Record, outcome: str, duration_s: float, detail: str = "") -> str:
    """The one log line per job outcome, as ``key=value`` pairs."""
    line = (
        f"job stream={where} shard={record.shard} offset={record.offset} attempts={record.attempts} "
        f"outcome={outcome} duration_ms={duration_s * 1000:.1f}"
    )
    return f"{line} {detail}" if detail else line


OUTCOME_LEVELS = {ACKED: logging.DEBUG, RETRIED: logging.INFO, HANDED_BACK: logging.INFO,
                  DEAD: logging.WARNING, STALE: logging.WARNING}


_STAT_FIELDS = {ACKED: "processed", RETRIED: "retried", DEAD: "dead_lettered",
                HANDED_BACK: "handed_back", STALE: "stale"}


def report_outcome(
    stats: WorkerStats, metrics: BoundWorkerMetrics | None, where: str, record: Record, outcome: str,
    duration: float, detail: str = "", failed: bool = False,
) -> None:
    """Counts a job outcome in ``stats`` and ``metrics`` and logs its one line."""
    field = _STAT_FIELDS[outcome]
    setattr(stats, field, getattr(stats, field) + 1)
    if metrics is not None:
        metrics.finished(outcome, duration, failed)
    extra = {"felix_job": {"stream": where, "shard": record.shard, "offset": record.offset,
                           "attempts": record.attempts, "outcome": outcome, "duration_s": round(duration, 6)}}
    log.log(OUTCOME_LEVELS[outcome], job_line(where, record, outcome, duration, detail), extra=extra)


class Job:
    """One record in a worker's hands: running, finished, or handed back."""

    __slots__ = ("abandoned", "item", "lock", "renewed", "started", "state")

    def __init__(self, item: Item) -> None:
        self.item = item
        self.started = self.renewed = time.monotonic()
        self.state = "running"
        self.abandoned = False
        self.lock = threading.Lock()

    def settle(self, state: str, then: Callable[[], None] | None = None) -> bool:
        """Moves a running job to ``state`` and runs ``then`` under the job's lock; False
        if something else settled it first."""
        with self.lock:
            if self.state != "running":
                return False
            self.state = state
            if then is not None:
                then()
            return True


class WorkerBase:
    """What the sync :class:`Worker` and the asyncio ``AsyncWorker`` share: settings,
    their checks, and the sharded group the records come from."""

    def __init__(
        self,
        client: Any,
        tenant: str,
        namespace: str,
        stream: str,
        group: str,
        handler: Any,
        *,
        concurrency: int = 1,
        consumer: str | None = None,
        shards: Iterable[int] | None = None,
        backoff: Backoff | None = None,
        dead_letter_on: tuple[type[BaseException], ...] = (),
        poll_wait_s: float = 1.0,
        grace_s: float = 30.0,
        heartbeat_fraction: float = 1 / 3,
        hard_limit_s: float | None = None,
        burst: bool = False,
        metrics: WorkerMetrics | None = None,
        handle_signals: bool = True,
    ) -> None:
        """
        :param client: the connection.
        :param tenant, namespace, stream, group: where the records come from.
        :param handler: called with each :class:`Record`, on a worker thread.
        :param concurrency: most records in flight (and handler threads) at once.
        :param consumer: a stable consumer name; a restarted worker reclaims its own records.
        :param shards: poll only these shards (default: all).
        :param backoff: retry delays for failures (default ``Backoff()``).
        :param dead_letter_on: exception types that dead-letter at once, like ``Fatal``.
        :param poll_wait_s: how long one poll waits for records; bounds shutdown latency.
        :param grace_s: how long running handlers may finish after a stop.
        :param heartbeat_fraction: extend a lease after this fraction of the visibility timeout.
        :param hard_limit_s: stop extending a handler's lease after this long (None: never).
        :param burst: exit once nothing is due and nothing is in flight.
        :param metrics: Prometheus metrics to update (:class:`felix_redis.metrics.WorkerMetrics`).
        :param handle_signals: install SIGTERM/SIGINT handlers in ``run()`` (main thread only).
        """
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise InvalidArgument(f"concurrency must be a whole number of at least 1, got {concurrency!r}")
        if not 0 < heartbeat_fraction < 1:
            raise InvalidArgument(f"heartbeat_fraction must be between 0 and 1, got {heartbeat_fraction!r}")
        if poll_wait_s <= 0:
            raise InvalidArgument(f"poll_wait_s must be positive, got {poll_wait_s!r}")
        self._check_handler(handler)
        self.client = client
        self.tenant, self.namespace, self.stream, self.group = tenant, namespace, stream, group
        self.handler = handler
        self.concurrency = concurrency
        self.consumer = consumer
        self.shards = sorted(set(shards)) if shards is not None else None
        self.backoff = backoff or Backoff()
        self.dead_letter_on = dead_letter_on
        self.poll_wait_s = poll_wait_s
        self.grace_s = grace_s
        self.heartbeat_fraction = heartbeat_fraction
        self.hard_limit_s = hard_limit_s
        self.burst = burst
        self.handle_signals = handle_signals
        self.stats = WorkerStats()
        self.visibility_timeout_s = 30.0
        self.max_attempts = 5
        self._metrics: BoundWorkerMetrics | None = (
            metrics.bind(tenant, namespace, stream, group) if metrics is not None else None)
        self._group = client.group_sharded(tenant, namespace, stream, group, consumer)
        self._source = self._group
        self._where = f"{tenant}/{namespace}/{stream}"
        self._init_runtime()

    def _configure(self, info: GroupInfo) -> None:
        """Takes the group's visibility timeout and max attempts (stored in Redis) and
        checks the shard subset against the stream."""
        self.visibility_timeout_s = info.visibility_timeout_ms / 1000
        self.max_attempts = info.max_attempts
        if self.shards is not None:
            bad = [s for s in self.shards if not 0 <= s < len(info.shards)]
            if bad:
                raise InvalidArgument(f"stream {self._where} has {len(info.shards)} shard(s); no shard {bad}")
            self._source = self.client.group_sharded(
                self.tenant, self.namespace, self.stream, self.group, self.consumer, shards=self.shards)

    def _check_handler(self, handler: Any) -> None:
        """Refuses a handler this kind of worker cannot run."""

    def _init_runtime(self) -> None:
        """Sets up the worker's own events, queues and bookkeeping."""


class Worker(WorkerBase):
    """Runs ``handler(record)`` for every record of a group, on ``concurrency`` threads.

    The handler returns normally to ack, raises :class:`Retry` to choose the retry delay,
    :class:`Fatal` (or a type in ``dead_letter_on``) to dead-letter at once, or any other
    exception to retry after the ``backoff`` delay; the last allowed delivery that fails
    becomes a dead letter with the error as reason.
    """

    _group: ShardedGroup
    _source: ShardedGroup

    def _check_handler(self, handler: Any) -> None:
        if inspect.iscoroutinefunction(handler):
            raise TypeError("the handler is an async def; run it with felix_redis.aioworker.AsyncWorker")

    def _init_runtime(self) -> None:
        self._stats_lock = threading.Lock()
        self._stopping = threading.Event()
        self._done = threading.Event()
        # One lock for the slots and the finished jobs: the poll loop waits on _slots,
        # the settle thread on _settle.
        lock = threading.RLock()
        self._slots = threading.Condition(lock)
        self._settle = threading.Condition(lock)
        self._jobs: set[Job] = set()
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        # Jobs whose handler returned, to ack: (job, duration, when it finished). The
        # next poll takes them along (ack=); the settle thread acks those no poll took
        # within ACK_LINGER_S (the loop is waiting in a long poll), and all at shutdown.
        self._finished: list[tuple[Job, float, float]] = []
        self._settle_stop = False
        self._threads: list[threading.Thread] = []
        self._old_handlers: dict[int, Any] = {}

    # -- public

    def run(self) -> None:
        """Works until :meth:`stop` (or SIGTERM/SIGINT), then shuts down gracefully."""
        self._startup()
        try:
            while not self._stopping.is_set():
                self._poll_iteration()
        finally:
            self._shutdown()

    def stop(self) -> None:
        """Stops polling; running handlers get ``grace_s`` to finish. Safe from any thread."""
        self._stopping.set()
        with self._slots:
            self._slots.notify_all()
            self._settle.notify_all()  # no poll will take the finished jobs along now

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # -- the loop, step by step

    def _startup(self) -> None:
        self._configure(self.client.group_describe(self.tenant, self.namespace, self.stream, self.group))
        self._done.clear()
        self._queue = queue.SimpleQueue()
        self._finished = []
        self._settle_stop = False
        self._start_threads()
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            self._install_signal_handlers()
        log.info(
            "worker started stream=%s group=%s consumer=%s concurrency=%d visibility_timeout_s=%g shards=%s",
            self._where, self.group, self.consumer or "-", self.concurrency, self.visibility_timeout_s,
            ",".join(map(str, self.shards)) if self.shards is not None else "all",
        )

    def _start_threads(self) -> None:
        targets: list[tuple[str, Callable[[], None]]] = [
            (f"felix-handler-{i}", self._handler_thread) for i in range(self.concurrency)]
        targets += [("felix-heartbeat", self._heartbeat_thread), ("felix-settle", self._settle_thread)]
        self._threads = [threading.Thread(target=fn, name=name, daemon=True) for name, fn in targets]
        for thread in self._threads:
            thread.start()

    def _poll_iteration(self) -> None:
        """Waits for a free slot, polls up to the free slots (acking the finished jobs in
        the same round trip), hands the records out."""
        free, finished = self._wait_for_free_slot(self.poll_wait_s)
        if free == 0 or self._stopping.is_set():
            if finished:
                self._ack_batch(finished)
            return
        try:
            items = self._source.poll(
                free, None if self.burst else self.poll_wait_s, ack=[job.item for job, _, _ in finished])
        except FelixError as exc:
            log.error("poll failed stream=%s group=%s: %s", self._where, self.group, exc)
            if finished:
                self._ack_batch(finished)  # the acks it carried may not have been applied
            self._stopping.wait(min(self.poll_wait_s, 1.0))
            return
        except BaseException:
            # KeyboardInterrupt or a bug mid-poll: the settle thread acks those jobs (again:
            # acks are idempotent) while run() shuts down.
            with self._slots:
                self._finished[:0] = finished
                self._settle.notify_all()
            raise
        if finished:
            self._acked(finished, ACKED)
        for item in items:
            self._dispatch(Job(item))
        if not items and self.burst:
            self._burst_check()

    def _wait_for_free_slot(self, timeout: float) -> tuple[int, list[tuple[Job, float, float]]]:
        """Free slots, counting those of finished jobs, and those jobs (taken: their
        acks go with the next poll)."""
        with self._slots:
            self._slots.wait_for(
                lambda: len(self._jobs) - len(self._finished) < self.concurrency or self._stopping.is_set(), timeout)
            finished, self._finished = self._finished, []
            return self.concurrency - len(self._jobs) + len(finished), finished

    def _burst_check(self) -> None:
        """In burst mode: stop once nothing is due and nothing is in flight."""
        with self._slots:
            if not self._jobs:
                log.info("burst: nothing due, stopping stream=%s group=%s", self._where, self.group)
                self._stopping.set()
                return
            # Jobs still run; one of them may hand its record back, due at once.
            self._slots.wait(self.poll_wait_s)

    def _dispatch(self, job: Job) -> None:
        with self._slots:
            self._jobs.add(job)
            self.stats.in_flight = len(self._jobs)
        if self._metrics:
            self._metrics.started()
        self._queue.put(job)

    def _release(self, job: Job) -> None:
        with self._slots:
            self._jobs.discard(job)
            self.stats.in_flight = len(self._jobs)
            self._slots.notify_all()
        if self._metrics:
            self._metrics.released()

    # -- handler threads

    def _handler_thread(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._run_job(job)

    def _run_job(self, job: Job) -> None:
        record = job.item.record
        try:
            self.handler(record)
        except BaseException as exc:  # a thread has no one above it to catch SystemExit
            duration = time.monotonic() - job.started
            if job.settle("finished"):
                if not isinstance(exc, (Retry, Fatal)):
                    log.debug("handler raised for %s", record.claim, exc_info=True)
                self._fail(job, exc, duration)
                self._release(job)
        else:
            duration = time.monotonic() - job.started
            job.settle("finished", lambda: self._add_finished(job, duration))

    def _add_finished(self, job: Job, duration: float) -> None:
        with self._slots:
            self._finished.append((job, duration, time.monotonic()))
            if len(self._finished) == 1:
                self._settle.notify()  # starts the settle thread's linger
            self._slots.notify_all()

    def _fail(self, job: Job, exc: BaseException, duration: float) -> None:
        record = job.item.record
        with self._stats_lock:
            self.stats.failed += 1
        decision = decide(exc, record.attempts, self.max_attempts, self.backoff, self.dead_letter_on)
        detail = f"error={decision.reason!r}"
        try:
            if decision.dead:
                self._group.dead_letter(job.item, decision.reason)
                outcome = DEAD
            else:
                dead = self._group.nack(job.item, decision.delay_s)
                outcome = DEAD if dead else RETRIED
                if not dead:
                    detail = f"retry_in_s={decision.delay_s:.3f} {detail}"
        except StaleClaim:
            outcome = STALE
        except FelixError as exc2:
            outcome = STALE
            detail += f" settle_error={exc2!r}"
        self._outcome(record, outcome, duration, detail, failed=True)

    def _outcome(self, record: Record, outcome: str, duration: float, detail: str = "", failed: bool = False) -> None:
        with self._stats_lock:
            report_outcome(self.stats, self._metrics, self._where, record, outcome, duration, detail, failed)

    # -- acks, batched: with the next poll, or by the settle thread

    def _settle_thread(self) -> None:
        """Acks the finished jobs no poll took along within ACK_LINGER_S (the loop waits
        in a long poll, or is stopping), at most 1000 per call."""
        while True:
            with self._settle:
                while True:
                    if self._finished:
                        wait = self._finished[0][2] + ACK_LINGER_S - time.monotonic()
                        if wait <= 0 or self._stopping.is_set() or self._settle_stop:
                            batch, self._finished = self._finished[:1000], self._finished[1000:]
                            break
                        self._settle.wait(wait)
                    elif self._settle_stop:
                        return
                    else:
                        self._settle.wait()
            self._ack_batch(batch)

    def _ack_batch(self, batch: list[tuple[Job, float, float]]) -> None:
        outcome, detail = STALE, "ack_failed=true"
        for attempt in range(3):
            try:
                self._group.ack_many(job.item for job, _, _ in batch)
                outcome, detail = ACKED, ""
                break
            except FelixError as exc:
                log.error("ack of %d record(s) failed (try %d of 3): %s", len(batch), attempt + 1, exc)
                time.sleep(0.2 * (attempt + 1))
        self._acked(batch, outcome, detail)

    def _acked(self, batch: list[tuple[Job, float, float]], outcome: str, detail: str = "") -> None:
        for job, duration, _ in batch:
            self._outcome(job.item.record, outcome, duration, detail)
            self._release(job)

    # -- leases

    def _heartbeat_thread(self) -> None:
        every = self.visibility_timeout_s * self.heartbeat_fraction
        tick = max(0.01, min(every / 4, 1.0))
        while not self._done.wait(tick):
            self._heartbeat(every)

    def _heartbeat(self, every: float) -> None:
        """Extends every running job's lease once ``every`` seconds have passed since the
        last extension, until it runs past the hard limit."""
        now = time.monotonic()
        with self._slots:
            jobs = list(self._jobs)
        for job in jobs:
            if job.state != "running" or job.abandoned or now - job.renewed < every:
                continue
            if self.hard_limit_s is not None and now - job.started > self.hard_limit_s:
                job.abandoned = True
                log.warning("job stream=%s claim=%s ran past the hard limit of %gs; its lease will lapse",
                            self._where, job.item.claim, self.hard_limit_s)
                continue
            job.renewed = now
            try:
                self._group.extend(job.item)
            except StaleClaim:
                job.abandoned = True
                log.warning("job stream=%s claim=%s lost its lease", self._where, job.item.claim)
            except FelixError as exc:
                log.error("extend of %s failed: %s", job.item.claim, exc)

    # -- shutdown

    def _shutdown(self) -> None:
        """Lets running handlers finish within the grace period, hands back the rest."""
        deadline = time.monotonic() + self.grace_s
        with self._slots:
            self._slots.wait_for(lambda: not self._jobs, self.grace_s)
            left = list(self._jobs)
        for job in left:
            if job.settle("handed_back"):
                self._hand_back(job)
        for _ in range(self.concurrency):
            self._queue.put(None)
        with self._settle:
            self._settle_stop = True
            self._settle.notify_all()
        settle = next(t for t in self._threads if t.name == "felix-settle")
        settle.join(max(1.0, deadline - time.monotonic()))
        self._done.set()
        self._stopping.clear()  # run() may be called again
        self._restore_signal_handlers()
        log.info("worker stopped stream=%s group=%s %s", self._where, self.group,
                 " ".join(f"{k}={v}" for k, v in self.stats.as_dict().items()))

    def _hand_back(self, job: Job) -> None:
        duration = time.monotonic() - job.started
        try:
            dead = self._group.nack(job.item, 0.0)
            outcome = DEAD if dead else HANDED_BACK  # dead: it was the last allowed attempt
        except FelixError:
            outcome = STALE
        self._outcome(job.item.record, outcome, duration, "reason=shutdown")
        self._release(job)

    # -- signals

    def _install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stopping.is_set():
            self._exit_now(signum)
        log.info("received %s: stopping, running handlers have %gs to finish (again to exit now)",
                 signal.Signals(signum).name, self.grace_s)
        self.stop()

    def _exit_now(self, signum: int) -> None:
        log.warning("received %s again: exiting now; unfinished leases will lapse", signal.Signals(signum).name)
        logging.shutdown()
        sys.stderr.flush()
        os._exit(128 + signum)
