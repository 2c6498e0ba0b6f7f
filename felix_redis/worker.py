"""Workers: register a handler, run a worker; the poll loop is not yours to write.

:class:`Worker` runs a plain function on a pool of threads; :class:`felix_redis.aioworker.AsyncWorker`
runs an ``async def`` on asyncio tasks. Both long-poll a group through all (or some) shards
of a stream, keep at most ``concurrency`` records in flight, ack on success and nack with a
backoff delay on failure, extend leases while a handler runs, and shut down gracefully.
What they decide about a record is written once, in ``felix_redis._runtime``; this
module holds the threads.
"""

from __future__ import annotations

import importlib
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from felix_redis import _tracing
from felix_redis._runtime import (
    Backoff,
    Decision,
    Fatal,
    Finished,
    Job,
    Retry,
    WorkerBase,
    WorkerStats,
    decide,
    drive,
    is_async_handler,
)
from felix_redis.errors import FelixError

if TYPE_CHECKING:
    from felix_redis.client import ShardedGroup

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

#: How long a finished job's ack may wait for the worker's next poll to carry it (one
#: round trip for both) before the settle thread acks it alone. Both workers read it
#: here, when they use it.
ACK_LINGER_S = 0.02

#: A handler whose recent runs took less than this on average (an exponential average
#: over the last ~16 runs, after at least ``QUICK_RUNS`` runs) runs on the poll loop's
#: own thread, record after record, instead of being handed to a handler thread per
#: record: for a handler this quick the hand-over (a queue, a thread woken, the loop
#: woken back) costs more than the handler. A run longer than ``INLINE_MAX_S`` sends the
#: rest of the batch, and what follows, back to the handler threads until the average
#: is low again. Records in flight stay at most ``concurrency`` either way.
QUICK_HANDLER_S = 0.0005
INLINE_MAX_S = 0.005
QUICK_RUNS = 64


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
        if is_async_handler(handler):
            raise TypeError("the handler is an async def; run it with felix_redis.aioworker.AsyncWorker")

    def _init_runtime(self) -> None:
        self._stopping = threading.Event()
        self._done = threading.Event()
        # One lock for the slots and the finished jobs: the poll loop waits on _slots,
        # the settle thread on _settle.
        lock = threading.RLock()
        self._lock = lock  # (taken on its own where nothing waits or is woken: cheaper than the Condition)
        self._slots = threading.Condition(lock)
        self._settle = threading.Condition(lock)
        self._jobs: set[Job] = set()
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        # Jobs whose handler returned, to ack. The next poll takes them along (ack=); the
        # settle thread acks those no poll took within ACK_LINGER_S (the loop is waiting
        # in a long poll), and all at shutdown.
        self._finished = []
        self._settle_stop = False
        self._threads: list[threading.Thread] = []
        self._old_handlers: dict[int, Any] = {}
        self._scheduler_stop = threading.Event()
        #: handlers run on the poll loop's thread (QUICK_HANDLER_S): the settle thread
        #: looks for finished jobs every ACK_LINGER_S rather than being woken for each
        self._inline = False

    # -- public

    def run(self) -> None:
        """Works until :meth:`stop` (or SIGTERM/SIGINT), then shuts down gracefully."""
        self._startup()
        try:
            while not self._stopping.is_set():
                drive(self._poll_plan(*self._wait_for_free_slot(self.poll_wait_s)))
        finally:
            self._shutdown()

    def stop(self) -> None:
        """Stops polling; running handlers get ``grace_s`` to finish. Safe from any thread."""
        self._stopping.set()
        self._scheduler_stop.set()
        with self._slots:
            self._slots.notify_all()
            self._settle.notify_all()  # no poll will take the finished jobs along now

    # -- the loop, step by step

    def _startup(self) -> None:
        self._configure([self.client.group_describe(self.tenant, self.namespace, stream, self.group)
                         for stream in self.streams])
        # each run its own: threads of an earlier run cut short never take this run's part
        self._done = threading.Event()
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
        jobs, done = self._queue, self._done
        targets: list[tuple[str, Callable[[], None]]] = [
            (f"felix-handler-{i}", lambda: self._handler_thread(jobs)) for i in range(self.concurrency)]
        targets += [("felix-heartbeat", lambda: self._heartbeat_thread(done)), ("felix-settle", self._settle_thread)]
        if self.ticks_schedules:
            self._scheduler_stop = threading.Event()  # one per run: set by stop() and at shutdown
            targets.append(("felix-scheduler", self._scheduler_thread))
        self._threads = [threading.Thread(target=fn, name=name, daemon=True) for name, fn in targets]
        for thread in self._threads:
            thread.start()

    def _wait_for_free_slot(self, timeout: float) -> tuple[int, list[Finished]]:
        """Free slots, counting those of finished jobs, and those jobs (taken: their
        acks go with the next poll)."""
        with self._slots:
            self._slots.wait_for(
                lambda: len(self._jobs) - len(self._finished) < self.concurrency or self._stopping.is_set(), timeout)
            finished, self._finished = self._finished, []
            # (never below 0: finished jobs the settle thread acks still hold their slots)
            return max(0, self.concurrency - len(self._jobs) + len(finished)), finished

    def _idle(self, seconds: float) -> None:
        self._stopping.wait(seconds)

    def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def _burst_check(self) -> None:
        with self._slots:
            if not self._jobs:
                self._burst_stop()
                return
            # Jobs still run; one of them may hand its record back, due at once.
            self._slots.wait(self.poll_wait_s)

    def _dispatch(self, job: Job) -> None:
        self._dispatch_many([job])

    def _dispatch_many(self, jobs: list[Job]) -> None:
        with self._slots:
            self._jobs.update(jobs)
            self.stats.in_flight = len(self._jobs)
        if self._metrics:
            for job in jobs:
                self._metrics[job.item.stream].started()
        done = 0
        if self._handler_runs >= QUICK_RUNS and self._handler_avg < QUICK_HANDLER_S:
            done = self._run_inline(jobs)
        for job in jobs[done:]:
            self._queue.put(job)

    def _run_inline(self, jobs: list[Job]) -> int:
        """Runs the handler on ``jobs`` on this (the poll loop's) thread, one after
        another, until one runs longer than ``INLINE_MAX_S`` or the worker stops; returns
        how many ran (the caller hands the rest to the handler threads). An interrupt
        raised by the handler (KeyboardInterrupt, SystemExit) hands its record back, the
        rest to the handler threads (for the shutdown's grace period), and goes on up.

        Each job that returned is kept for the next poll's acks as soon as it returned
        (the settle thread acks it if a slow run holds that poll up). The loop is
        :meth:`_run` unrolled for the usual case (no tracing, the handler returns): one
        clock reading a job (its end is the next one's start), the average kept in
        locals, the state moved without the job's lock: nothing else settles a job run
        here (the handler threads settle only the jobs queued to them, the shutdown runs
        on this thread after the loop, the heartbeat only reads the state)."""
        if not self._inline:
            with self._slots:
                self._inline = True
                self._settle.notify()  # it looks every ACK_LINGER_S while runs are inline
        handler, stopping, lock = self.handler, self._stopping, self._lock
        avg, runs = self._handler_avg, self._handler_runs
        ran, took = 0, 0.0
        try:
            started = time.monotonic()
            for job in jobs:
                if stopping.is_set():
                    break
                if _tracing.process is not None:
                    self._handler_avg, self._handler_runs = avg, runs
                    took = self._run(job, inline=True)
                    avg, runs = self._handler_avg, self._handler_runs
                    started = time.monotonic()
                else:
                    try:
                        handler(job.item.record)
                    except Exception as exc:
                        self._handler_avg, self._handler_runs = avg, runs
                        took = self._timed(started)
                        avg, runs = self._handler_avg, self._handler_runs
                        drive(self._failed_plan(job, exc))
                        started = time.monotonic()
                    else:
                        now = time.monotonic()
                        took, started = now - started, now
                        avg += (took - avg) / 16
                        runs += 1
                        if job.state == "running":
                            job.state = "finished"
                            with lock:
                                self._finished.append((job, now - job.started, now))
                ran += 1
                if took > INLINE_MAX_S:
                    runs = 0  # back to the threads until runs are quick again
                    self._inline = False
                    break
        except BaseException:
            self._handler_avg, self._handler_runs = avg, runs
            for rest in jobs[ran + 1:]:
                self._queue.put(rest)
            # (the job it stopped in; one that returned already is acked as usual)
            if ran < len(jobs) and jobs[ran].settle("handed_back"):
                drive(self._hand_back_plan(jobs[ran]))
            raise
        self._handler_avg, self._handler_runs = avg, runs
        return ran

    def _run(self, job: Job, inline: bool = False) -> float:
        """Runs the handler on a job and settles it; returns how long the handler took.
        ``inline``: on the poll loop's thread, which takes an interrupt up."""
        started = time.monotonic()
        try:
            if _tracing.process is None:
                self.handler(job.item.record)
            else:
                with _tracing.process(self, job.item):
                    self.handler(job.item.record)
        except Exception as exc:
            took = self._timed(started)
            drive(self._failed_plan(job, exc))
        except BaseException as exc:
            if inline:
                raise  # (an interrupt on the loop's thread stops the worker, as it would between polls)
            took = self._timed(started)
            drive(self._failed_plan(job, exc))  # a thread has no one above it to catch SystemExit
        else:
            took = self._timed(started)
            if not inline:
                self._succeeded(job)
            elif job.settle("finished"):
                # kept for the loop's next poll, which takes it along; nobody is woken (the
                # loop is this thread; the settle thread looks every ACK_LINGER_S while runs
                # are inline, and acks it if a slow run holds up that poll)
                now = time.monotonic()
                with self._slots:
                    self._finished.append((job, now - job.started, now))
        return took

    def _release(self, job: Job) -> None:
        self._release_many([job])

    def _release_many(self, jobs: list[Job]) -> None:
        with self._slots:
            self._jobs.difference_update(jobs)
            self.stats.in_flight = len(self._jobs)
            self._slots.notify_all()
        if self._metrics:
            for job in jobs:
                self._metrics[job.item.stream].released()

    # -- handler threads

    def _handler_thread(self, jobs: queue.SimpleQueue[Job | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            self._run(job)

    def _add_finished(self, job: Job, duration: float) -> None:
        with self._slots:
            self._finished.append((job, duration, time.monotonic()))
            if len(self._finished) == 1:
                self._settle.notify()  # starts the settle thread's linger
            self._slots.notify_all()

    # -- acks, batched: with the next poll, or by the settle thread

    def _requeue(self, finished: list[Finished]) -> None:
        with self._slots:
            self._finished[:0] = finished
            self._settle.notify_all()

    def _settle_thread(self) -> None:
        """Acks the finished jobs no poll took along in time, until shutdown."""
        while True:
            with self._settle:
                while (turn := self._settle_turn(ACK_LINGER_S)) is not None and not turn[0]:
                    # (while runs are inline nobody wakes it for their finished jobs: it looks)
                    self._settle.wait(turn[1] if turn[1] is not None or not self._inline else ACK_LINGER_S)
            if turn is None:
                return
            drive(self._ack_plan(turn[0]))

    # -- leases

    def _heartbeat_thread(self, done: threading.Event) -> None:
        every, tick = self._heartbeat_timing()
        while not done.wait(tick):
            with self._slots:
                jobs = list(self._jobs)
            drive(self._heartbeat_plan(jobs, every))

    # -- recurring schedules

    def _scheduler_thread(self) -> None:
        off: set[str] = set()
        while not self._stopping.is_set() and not self._scheduler_stop.is_set():
            drive(self._schedule_plan(off))

    def _schedule_idle(self, seconds: float) -> None:
        self._scheduler_stop.wait(seconds)

    # -- shutdown

    def _shutdown(self) -> None:
        """Releases the records fetched ahead, lets running handlers finish within the
        grace period, hands back the rest. Cut short (a second KeyboardInterrupt, signals
        not handled by the worker): the heartbeat and scheduler threads stop, the settle
        thread acks what finished and ends, and the jobs still running are left to their
        leases (due again once they lapse) rather than kept for as long as the process
        lives."""
        try:
            self._shut_down()
        except BaseException:
            self._cut_short()
            raise

    def _cut_short(self) -> None:
        with self._slots:
            left = list(self._jobs)
        # given up: a handler that returns later queues no ack (its record comes back once
        # the lease lapses); finished ones wait in _finished for the settle thread's ack
        given_up = [job for job in left if job.settle("given_up")]
        self._release_many(given_up)
        self._done.set()
        self._scheduler_stop.set()
        with self._settle:
            self._settle_stop = True
            self._settle.notify_all()
        for _ in range(self.concurrency):
            self._queue.put(None)
        self._stopping.clear()
        self._restore_signal_handlers()
        log.warning("worker of group %s: shutdown cut short; %d record(s) left to their leases", self.group,
                    len(given_up))

    def _shut_down(self) -> None:
        deadline = time.monotonic() + self.grace_s
        if self.prefetch:
            try:  # never run: due again at once for the other workers
                self._source._release_buffer()
            except FelixError as exc:
                log.warning("records fetched ahead by worker of group %s not released: %s", self.group, exc)
        with self._slots:
            self._settle.notify_all()  # finished jobs no poll takes along now (acked: stopping, or their linger)
            self._slots.wait_for(lambda: not self._jobs, max(0.0, deadline - time.monotonic()))
            left = list(self._jobs)
        for job in left:
            if job.settle("handed_back"):
                drive(self._hand_back_plan(job))
        for _ in range(self.concurrency):
            self._queue.put(None)
        with self._settle:
            self._settle_stop = True
            self._settle.notify_all()
        settle = next(t for t in self._threads if t.name == "felix-settle")
        settle.join(max(1.0, deadline - time.monotonic()))
        self._scheduler_stop.set()
        for thread in self._threads:
            if thread.name == "felix-scheduler":  # ends its tick, if one is under way
                thread.join(max(1.0, deadline - time.monotonic()))
        self._done.set()
        self._stopping.clear()  # run() may be called again
        self._restore_signal_handlers()
        self._log_stopped("worker")

    # -- signals

    def _install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()
