"""What the two workers share: the settings and their checks, the bookkeeping of a job,
and every decision about a record, written once.

The decisions are *plans*, as :mod:`felix_redis.protocol` writes the clients'
operations: a plan is a generator that yields :class:`Call` (a method of the group, or
one of the runtime's own waits) and gets back what it returned, or has what it raised
thrown in. :class:`felix_redis.worker.Worker` makes the calls on its threads
(:func:`drive`), :class:`felix_redis.aioworker.AsyncWorker` awaits them in its tasks
(:func:`drive_async`). So what a failed handler's record becomes, how an ack is tried
again, what a poll takes along and what a shutdown reports exist once; each runtime
keeps its own concurrency: threads, locks and conditions, or tasks and events.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from felix_redis.checks import check_int, check_streams
from felix_redis.constants import (
    DEFAULT_GRACE_S,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_POLL_WAIT_S,
    DEFAULT_VISIBILITY_TIMEOUT_MS,
    MAX_REASON_BYTES,
    MAX_RECORDS_PER_POLL,
)
from felix_redis.errors import FelixError, InvalidArgument, PermissionDenied, StaleClaim
from felix_redis.models import GroupInfo, Record
from felix_redis.schedules import TICK_MAX_S, TICK_MIN_S

if TYPE_CHECKING:
    from felix_redis._driver import Item
    from felix_redis.metrics import BoundWorkerMetrics, WorkerMetrics

log = logging.getLogger("felix_redis.worker")

# Job outcomes, as logged and counted.
ACKED = "acked"
RETRIED = "retried"
DEAD = "dead"
HANDED_BACK = "handed_back"
#: The record's lease was lost before the worker could settle it (StaleClaim).
STALE = "stale"
#: The worker could not settle the record (a lost connection, another error): its
#: lease lapses and the record is delivered again.
UNSETTLED = "unsettled"

#: Tries of one ack call before its jobs are reported unsettled.
ACK_TRIES = 3
#: Records fetched ahead that waited in the buffer until this little of their lease was
#: left (a fraction of the visibility timeout; at least two heartbeat ticks) are released,
#: not run (:meth:`WorkerBase._late_after`)
LATE_MARGIN = 0.2
#: Most finished jobs one ack call carries.
ACK_BATCH = 1000


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


def is_async_handler(handler: object) -> bool:
    """``handler`` is an ``async def`` (or an object whose ``__call__`` is one)."""
    if inspect.iscoroutinefunction(handler):
        return True
    return callable(handler) and not inspect.isroutine(handler) and inspect.iscoroutinefunction(
        type(handler).__call__)


@dataclass
class WorkerStats:
    """Counters of one worker since it started."""

    processed: int = 0
    failed: int = 0
    retried: int = 0
    dead_lettered: int = 0
    handed_back: int = 0
    stale: int = 0
    unsettled: int = 0
    in_flight: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def job_line(where: str, record: Record, outcome: str, duration_s: float, detail: str = "") -> str:
    """The one log line per job outcome, as ``key=value`` pairs."""
    line = (
        f"job stream={where} shard={record.shard} offset={record.offset} attempts={record.attempts} "
        f"outcome={outcome} duration_ms={duration_s * 1000:.1f}"
    )
    return f"{line} {detail}" if detail else line


OUTCOME_LEVELS = {ACKED: logging.DEBUG, RETRIED: logging.INFO, HANDED_BACK: logging.INFO,
                  DEAD: logging.WARNING, STALE: logging.WARNING, UNSETTLED: logging.WARNING}


_STAT_FIELDS = {ACKED: "processed", RETRIED: "retried", DEAD: "dead_lettered",
                HANDED_BACK: "handed_back", STALE: "stale", UNSETTLED: "unsettled"}


def report_outcome(
    stats: WorkerStats, metrics: BoundWorkerMetrics | None, where: str, record: Record, outcome: str,
    duration: float, detail: str = "", failed: bool = False,
) -> None:
    """Counts a job outcome in ``stats`` and ``metrics`` and logs its one line."""
    field = _STAT_FIELDS[outcome]
    setattr(stats, field, getattr(stats, field) + 1)
    if metrics is not None:
        metrics.finished(outcome, duration, failed)
    level = OUTCOME_LEVELS[outcome]
    if not log.isEnabledFor(level):
        return  # (the line and its fields cost more than the rest: acks log at DEBUG)
    extra = {"felix_job": {"stream": where, "shard": record.shard, "offset": record.offset,
                           "attempts": record.attempts, "outcome": outcome, "duration_s": round(duration, 6)}}
    log.log(level, job_line(where, record, outcome, duration, detail), extra=extra)


class Job:
    """One record in a worker's hands: running, finished, or handed back."""

    __slots__ = ("abandoned", "item", "lock", "renewed", "started", "state")

    def __init__(self, item: Item, started: float | None = None, lock: threading.Lock | None = None) -> None:
        self.item = item
        # (a poll's jobs share one start time and, where given, their worker's lock:
        # settling holds it only to move the state, nothing waits under it for long)
        self.started = self.renewed = time.monotonic() if started is None else started
        self.state = "running"
        self.abandoned = False
        self.lock = threading.Lock() if lock is None else lock

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


#: A finished job: (job, how long its handler ran, time.monotonic() when it finished).
Finished = tuple[Job, float, float]


# -- plans and their two drivers


class Call:
    """One step of a plan: ``fn(*args, **kwargs)``, made by :func:`drive` or awaited by
    :func:`drive_async`."""

    __slots__ = ("args", "fn", "kwargs")

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs


Plan = Generator[Call, Any, None]


class Steps:
    """A plan under way: :attr:`call` is the call to make next, None once it is done."""

    __slots__ = ("_plan", "call")

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self.call: Call | None = None
        self._resume(plan.send, None)

    def answer(self, reply: Any, error: BaseException | None) -> None:
        """Sends what the call returned in, or throws what it raised in (what the plan
        does not catch, an interrupt or a cancellation, goes on up from here)."""
        if error is None:
            self._resume(self._plan.send, reply)
        else:
            self._resume(self._plan.throw, error)

    def _resume(self, how: Callable[[Any], Call], value: Any) -> None:
        try:
            self.call = how(value)
        except StopIteration:
            self.call = None


def _made(call: Call) -> tuple[Any, BaseException | None]:
    try:
        return call.fn(*call.args, **call.kwargs), None
    except BaseException as exc:  # thrown into the plan, which may catch it
        return None, exc


async def _awaited(call: Call) -> tuple[Any, BaseException | None]:
    try:
        return await call.fn(*call.args, **call.kwargs), None
    except BaseException as exc:  # thrown into the plan; a cancellation goes on from there
        return None, exc


def drive(plan: Plan) -> None:
    """Runs ``plan`` on this thread: makes each call it yields."""
    steps = Steps(plan)
    while (call := steps.call) is not None:
        steps.answer(*_made(call))


async def drive_async(plan: Plan) -> None:
    """Runs ``plan`` in this task: awaits each call it yields."""
    steps = Steps(plan)
    while (call := steps.call) is not None:
        steps.answer(*await _awaited(call))


# -- the worker


class WorkerBase:
    """What the sync :class:`~felix_redis.worker.Worker` and the asyncio
    :class:`~felix_redis.aioworker.AsyncWorker` share: settings, their checks, the
    sharded group the records come from, and the plans of every step that decides about
    a record. A runtime supplies its waits and its bookkeeping of jobs and slots (the
    methods below that raise NotImplementedError)."""

    #: The handler of a job past ``hard_limit_s`` is cancelled (asyncio) rather than left
    #: running while its lease lapses (threads).
    cancels_at_hard_limit: ClassVar[bool] = False
    #: The worker ticks the recurring schedules of the streams it consumes, beside its
    #: poll loop (docs/schedules.md); a subclass may set False.
    ticks_schedules: ClassVar[bool] = True

    _stopping: Any  # a threading.Event, or an asyncio.Event
    _jobs: Iterable[Job]
    _finished: list[Finished]
    _settle_stop: bool

    def __init__(
        self,
        client: Any,
        tenant: str,
        namespace: str,
        stream: str | Sequence[str],
        group: str,
        handler: Any,
        *,
        weights: Sequence[int] | None = None,
        concurrency: int = 1,
        consumer: str | None = None,
        shards: Iterable[int] | None = None,
        backoff: Backoff | None = None,
        dead_letter_on: tuple[type[BaseException], ...] = (),
        poll_wait_s: float = DEFAULT_POLL_WAIT_S,
        grace_s: float = DEFAULT_GRACE_S,
        heartbeat_fraction: float = 1 / 3,
        hard_limit_s: float | None = None,
        burst: bool = False,
        prefetch: int = 0,
        metrics: WorkerMetrics | None = None,
        handle_signals: bool = True,
    ) -> None:
        """
        :param client: the connection.
        :param tenant, namespace, stream, group: where the records come from; ``stream``
            may be a list of streams in priority order (docs/worker.md, "Priorities").
        :param weights: with several streams, None for strict order, else one weight per
            stream: the share of hand-outs each gets while all are busy.
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
        :param prefetch: 0, or how many records a poll fetches in one round trip when the
            worker holds none fetched ahead; those beyond the free slots wait, leased, for
            the next slots (docs/worker.md, "Prefetch"). Released at shutdown.
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
        self.streams, self.weights = check_streams(stream, weights)
        if shards is not None and len(self.streams) > 1:
            raise InvalidArgument("shards= picks shards of one stream; a worker over several streams polls them all")
        self.client = client
        self.tenant, self.namespace, self.group = tenant, namespace, group
        #: the stream's name; for a worker over several streams, the first (see ``streams``)
        self.stream = self.streams[0]
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
        self.prefetch = 0 if prefetch == 0 and type(prefetch) is int else check_int(
            prefetch, "prefetch", 1, MAX_RECORDS_PER_POLL)
        self.handle_signals = handle_signals
        self.stats = WorkerStats()
        # the group's own settings, read from Redis when run() starts (_configure); over
        # several streams the shortest visibility timeout paces the heartbeat, and each
        # stream's group keeps its own max attempts
        self.visibility_timeout_s = DEFAULT_VISIBILITY_TIMEOUT_MS / 1000
        self.max_attempts = DEFAULT_MAX_ATTEMPTS
        self._max_attempts = {name: DEFAULT_MAX_ATTEMPTS for name in self.streams}
        self._metrics: dict[str, BoundWorkerMetrics] | None = None if metrics is None else {
            name: metrics.bind(tenant, namespace, name, group) for name in self.streams}
        self._stats_lock = threading.Lock()  # handler threads report at once; uncontended in asyncio
        #: the lock every job of this worker settles under (Job.settle): one for all, not
        #: one made per job; held only to move a job's state (and, for a handler thread's
        #: job, to queue it for its ack), never while taking it again
        self._job_lock = threading.Lock()
        # the handler's recent run time (seconds, exponential average) and how many runs
        # it is made of since the last slow inline run: whether a batch runs inline
        # (felix_redis.worker.QUICK_HANDLER_S)
        self._handler_avg = 0.0
        self._handler_runs = 0
        # one stream's name as given, and weights only when there are: a client of one's
        # own with the older group_sharded signature keeps working
        where = self.stream if len(self.streams) == 1 else self.streams
        extra: dict[str, Any] = {} if self.weights is None else {"weights": self.weights}
        if self.prefetch:
            extra["prefetch"] = self.prefetch
        self._group = client.group_sharded(tenant, namespace, where, group, consumer, **extra)
        self._source = self._group
        self._wheres = {name: f"{tenant}/{namespace}/{name}" for name in self.streams}
        self._where = f"{tenant}/{namespace}/{','.join(self.streams)}"
        self._init_runtime()

    @property
    def stopping(self) -> bool:
        return bool(self._stopping.is_set())

    def max_attempts_of(self, item: Item) -> int:
        """The max attempts of the group on the stream ``item`` came from."""
        return self._max_attempts.get(item.stream, self.max_attempts)

    def _configure(self, infos: list[GroupInfo]) -> None:
        """Takes the group's visibility timeout and max attempts (stored in Redis, per
        stream: ``infos`` in the order of ``streams``) and checks the shard subset
        against the stream."""
        self.visibility_timeout_s = min(info.visibility_timeout_ms for info in infos) / 1000
        self._max_attempts = {name: info.max_attempts for name, info in zip(self.streams, infos, strict=True)}
        self.max_attempts = infos[0].max_attempts
        info = infos[0]
        if self.shards is not None:
            bad = [s for s in self.shards if not 0 <= s < len(info.shards)]
            if bad:
                raise InvalidArgument(f"stream {self._where} has {len(info.shards)} shard(s); no shard {bad}")
            extra = {"prefetch": self.prefetch} if self.prefetch else {}
            self._source = self.client.group_sharded(
                self.tenant, self.namespace, self.stream, self.group, self.consumer, shards=self.shards, **extra)

    # -- what a runtime supplies

    def _check_handler(self, handler: Any) -> None:
        """Refuses a handler this kind of worker cannot run."""

    def _init_runtime(self) -> None:
        """Sets up the worker's own events, queues and bookkeeping."""

    def _dispatch(self, job: Job) -> None:
        """Starts a handler on the job's record."""
        raise NotImplementedError

    def _timed(self, started: float) -> float:
        """How long since ``started``, counted in the handler's average run time."""
        took = time.monotonic() - started
        self._handler_avg += (took - self._handler_avg) / 16
        self._handler_runs += 1
        return took

    def _dispatch_many(self, jobs: list[Job]) -> None:
        """:meth:`_dispatch` for several jobs (a runtime may do it in one step)."""
        for job in jobs:
            self._dispatch(job)

    def _release(self, job: Job) -> None:
        """Forgets a settled job and frees its slot."""
        raise NotImplementedError

    def _release_many(self, jobs: list[Job]) -> None:
        """:meth:`_release` for several jobs (a runtime may do it in one step)."""
        for job in jobs:
            self._release(job)

    def _add_finished(self, job: Job, duration: float) -> None:
        """Keeps a job whose handler returned for the next ack."""
        raise NotImplementedError

    def _requeue(self, finished: list[Finished]) -> None:
        """Puts finished jobs a poll took back in front, for the settle thread or task."""
        raise NotImplementedError

    def _sleep(self, seconds: float) -> Any:
        """Waits ``seconds`` (a Call: may return an awaitable)."""
        raise NotImplementedError

    def _idle(self, seconds: float) -> Any:
        """Waits ``seconds`` or until the worker stops (a Call)."""
        raise NotImplementedError

    def _schedule_idle(self, seconds: float) -> Any:
        """The schedule ticker's wait: ``seconds``, or until the worker stops or shuts
        down (a Call)."""
        raise NotImplementedError

    def _burst_check(self) -> Any:
        """In burst mode, after a poll found nothing: stop (:meth:`_burst_stop`) if no job
        is in flight, else wait a while for one to settle (a Call)."""
        raise NotImplementedError

    # -- the plans

    def _poll_plan(self, free: int, finished: list[Finished]) -> Plan:
        """One turn of the loop once ``free`` slots are free: polls up to them, acking
        the ``finished`` jobs in the same round trip, and hands the records out."""
        if free <= 0 or self._stopping.is_set():
            if finished:
                yield from self._ack_plan(finished)
            return
        # the lease of a record fetched ahead runs from its fetch: the heartbeat counts from there
        leased_at = self._source.fetched_at if self.prefetch and self._source.fetched_ahead else None
        if leased_at is not None and time.monotonic() - leased_at >= self._late_after():
            # waited too long (the heartbeat, which releases them, held up): released, not run
            yield from self._release_late()
            leased_at = None
        if finished and leased_at is not None:
            # the poll hands out records fetched ahead, without a round trip for these
            # acks to ride on: the settle thread (or task) acks them, beside this loop, and
            # reports them acked once that call returned
            self._requeue(finished)
            finished = []
        try:
            items = yield Call(self._source.poll, free, None if self.burst else self.poll_wait_s,
                               ack=[job.item for job, _, _ in finished])
        except FelixError as exc:
            log.error("poll failed stream=%s group=%s: %s", self._where, self.group, exc)
            if finished:
                yield from self._ack_plan(finished)  # the acks it carried may not have been applied
            yield Call(self._idle, min(self.poll_wait_s, 1.0))
            return
        except BaseException:
            # an interrupt, a cancellation or a bug mid-poll: the settle thread or task
            # acks those jobs (again: acks are idempotent) while run() shuts down
            if finished:
                self._requeue(finished)
            raise
        if finished:
            self._acked(finished, ACKED)
        if items:
            now, lock = time.monotonic(), self._job_lock
            jobs = [Job(item, now, lock) for item in items]
            if leased_at is not None:
                for job in jobs:
                    job.renewed = leased_at
            yield Call(self._dispatch_many, jobs)
        if not items and self.burst:
            yield Call(self._burst_check)

    def _release_late(self) -> Plan:
        """Releases the records fetched ahead that waited too long (:meth:`_late_after`),
        by the heartbeat or, should it be held up, by the loop before it hands one out."""
        if late := self._source._take_buffer():
            log.warning("%d record(s) fetched ahead by worker of group %s waited in its buffer for most of their "
                        "lease: released, not run (a smaller prefetch or a longer visibility timeout avoids it)",
                        len(late), self.group)
            try:
                yield Call(self._source._release, late)
            except FelixError as exc:
                log.warning("records fetched ahead by worker of group %s not released: %s", self.group, exc)

    def _late_after(self) -> float:
        """How long records fetched ahead may wait in the buffer (counted from before
        the fetch was sent: their leases began later): all but ``LATE_MARGIN`` of the
        group's visibility timeout (the shortest of its streams'), or two heartbeat
        ticks. A record handed out before that has at least two ticks of its lease left,
        and the heartbeat extends it within one (it counts the lease from the fetch)."""
        lease_s = self.visibility_timeout_s
        return lease_s - max(LATE_MARGIN * lease_s, 2 * self._heartbeat_timing()[1])

    def _burst_stop(self) -> None:
        log.info("burst: nothing due, stopping stream=%s group=%s", self._where, self.group)
        self._stopping.set()

    def _succeeded(self, job: Job) -> None:
        """The handler returned: the job waits for its ack, unless shutdown handed it back."""
        duration = time.monotonic() - job.started
        job.settle("finished", lambda: self._add_finished(job, duration))

    def _failed_plan(self, job: Job, exc: BaseException) -> Plan:
        """The handler raised: unless shutdown handed the job back first, the record is
        retried or dead-lettered as :func:`decide` says, and its slot freed."""
        duration = time.monotonic() - job.started
        if not job.settle("finished"):
            return
        record = job.item.record
        if not isinstance(exc, (Retry, Fatal)):
            log.debug("handler raised for %s", record.claim, exc_info=exc)
        with self._stats_lock:
            self.stats.failed += 1
        decision = decide(exc, record.attempts, self.max_attempts_of(job.item), self.backoff, self.dead_letter_on)
        detail = f"error={decision.reason!r}"
        try:
            if decision.dead:
                yield Call(self._group.dead_letter, job.item, decision.reason)
                outcome = DEAD
            else:
                dead = yield Call(self._group.nack, job.item, decision.delay_s)
                outcome = DEAD if dead else RETRIED
                if not dead:
                    detail = f"retry_in_s={decision.delay_s:.3f} {detail}"
        except StaleClaim:
            outcome = STALE
        except FelixError as error:
            outcome = UNSETTLED
            detail += f" settle_error={error!r}"
        self._outcome(job.item, outcome, duration, detail, failed=True)
        self._release(job)

    def _settle_turn(self, linger: float) -> tuple[list[Finished], float | None] | None:
        """What the settle thread or task does next, with the finished jobs no poll took
        along within ``linger`` seconds (the loop waits in a long poll, or is stopping):
        ack a batch of them (``(batch, 0.0)``); wait (``([], seconds)``, None: until
        woken); or end (None: stopped with nothing left)."""
        if self._finished:
            wait = self._finished[0][2] + linger - time.monotonic()
            if wait <= 0 or self._stopping.is_set() or self._settle_stop:
                batch, self._finished = self._finished[:ACK_BATCH], self._finished[ACK_BATCH:]
                return batch, 0.0
            return [], wait
        return None if self._settle_stop else ([], None)

    def _ack_plan(self, batch: list[Finished]) -> Plan:
        """Acks finished jobs in one call (tried again after a failure), reports them and
        frees their slots."""
        outcome, detail = UNSETTLED, "ack_failed=true"
        for attempt in range(ACK_TRIES):
            try:
                yield Call(self._group.ack_many, [job.item for job, _, _ in batch])
                outcome, detail = ACKED, ""
                break
            except FelixError as exc:
                log.error("ack of %d record(s) failed (try %d of %d): %s", len(batch), attempt + 1, ACK_TRIES, exc)
                yield Call(self._sleep, 0.2 * (attempt + 1))
        self._acked(batch, outcome, detail)

    def _acked(self, batch: list[Finished], outcome: str, detail: str = "") -> None:
        """Reports the outcome of finished jobs whose ack was sent, and frees their slots."""
        wheres = self._wheres
        with self._stats_lock:
            if self._metrics is None and not log.isEnabledFor(OUTCOME_LEVELS[outcome]):
                # no metrics and no line to log: counting them is all there is to report
                field = _STAT_FIELDS[outcome]
                setattr(self.stats, field, getattr(self.stats, field) + len(batch))
            else:
                for job, duration, _ in batch:
                    item = job.item
                    metrics = None if self._metrics is None else self._metrics[item.stream]
                    report_outcome(self.stats, metrics, wheres[item.stream], item.record, outcome, duration, detail)
        self._release_many([job for job, _, _ in batch])

    def _heartbeat_timing(self) -> tuple[float, float]:
        """How often a lease is extended, and how often the heartbeat looks."""
        every = self.visibility_timeout_s * self.heartbeat_fraction
        return every, max(0.01, min(every / 4, 1.0))

    def _heartbeat_plan(self, jobs: Iterable[Job], every: float) -> Plan:
        """Extends the lease of each running job once ``every`` seconds have passed since
        the last extension; a thread past the hard limit is left to lapse. Releases the
        records fetched ahead once they waited most of their lease in the buffer
        (:meth:`_late_after`): not run, since a lease could lapse before the heartbeat's
        first extension and another consumer run the record too; due at once for any
        consumer instead, not counted."""
        now = time.monotonic()
        if self.prefetch and self._source.fetched_ahead and now - self._source.fetched_at >= self._late_after():
            yield from self._release_late()
        for job in jobs:
            if job.state != "running" or job.abandoned or now - job.renewed < every:
                continue
            if (not self.cancels_at_hard_limit and self.hard_limit_s is not None
                    and now - job.started > self.hard_limit_s):
                job.abandoned = True
                log.warning("job stream=%s claim=%s ran past the hard limit of %gs; its lease will lapse",
                            self._wheres[job.item.stream], job.item.claim, self.hard_limit_s)
                continue
            job.renewed = now
            try:
                yield Call(self._group.extend, job.item)
            except StaleClaim:
                job.abandoned = True
                log.warning("job stream=%s claim=%s lost its lease", self._wheres[job.item.stream], job.item.claim)
            except FelixError as exc:
                log.error("extend of %s failed: %s", job.item.claim, exc)

    def _hand_back_plan(self, job: Job) -> Plan:
        """Gives the record of a job still running at the end of the grace period back,
        due at once."""
        duration = time.monotonic() - job.started
        detail = "reason=shutdown"
        try:
            dead = yield Call(self._group.nack, job.item, 0.0)
            outcome = DEAD if dead else HANDED_BACK  # dead: it was the last allowed attempt
        except StaleClaim:
            outcome = STALE
        except FelixError as error:
            outcome = UNSETTLED
            detail += f" settle_error={error!r}"
        self._outcome(job.item, outcome, duration, detail)
        self._release(job)

    def _schedule_plan(self, off: set[str]) -> Plan:
        """One turn of the schedule ticker, off the poll loop: ticks each stream the worker
        consumes (but those in ``off``), then waits until the earliest next due time the
        ticks saw, at least TICK_MIN_S and at most TICK_MAX_S, or until the worker stops.
        A stream this Redis user may not tick (no stream.publish role) goes into ``off``."""
        wait = TICK_MAX_S
        for stream in self.streams:
            if stream in off:
                continue
            try:
                ticked = yield Call(self.client.schedule_tick, self.tenant, self.namespace, stream)
            except PermissionDenied as exc:
                off.add(stream)
                log.warning("not ticking the schedules of stream %s/%s/%s (this Redis user lacks the "
                            "stream.publish role): %s", self.tenant, self.namespace, stream, exc)
                continue
            except FelixError as exc:
                log.error("schedule tick failed stream=%s/%s/%s: %s", self.tenant, self.namespace, stream, exc)
                continue
            if ticked:
                log.info("schedules published %d record(s) stream=%s/%s/%s", len(ticked), self.tenant,
                         self.namespace, stream)
            if ticked.wait_s is not None:
                wait = min(wait, ticked.wait_s)
        yield Call(self._schedule_idle, max(TICK_MIN_S, wait))

    def _outcome(self, item: Item, outcome: str, duration: float, detail: str = "", failed: bool = False) -> None:
        metrics = None if self._metrics is None else self._metrics[item.stream]
        with self._stats_lock:
            report_outcome(self.stats, metrics, self._wheres[item.stream], item.record, outcome, duration, detail,
                           failed)

    # -- logs and signals

    def _log_stopped(self, kind: str) -> None:
        log.info("%s stopped stream=%s group=%s %s", kind, self._where, self.group,
                 " ".join(f"{k}={v}" for k, v in self.stats.as_dict().items()))

    def _on_signal(self, signum: int, frame: object = None) -> None:
        """SIGTERM/SIGINT: stop gracefully; a second one exits at once."""
        name = signal.Signals(signum).name
        if self._stopping.is_set():
            log.warning("received %s again: exiting now; unfinished leases will lapse", name)
            logging.shutdown()
            sys.stderr.flush()
            os._exit(128 + signum)
        log.info("received %s: stopping, running handlers have %gs to finish (again to exit now)", name, self.grace_s)
        self.stop()

    def stop(self) -> None:
        raise NotImplementedError
