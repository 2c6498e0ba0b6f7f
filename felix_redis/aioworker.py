"""The asyncio worker: :class:`felix_redis.worker.Worker` for ``async def`` handlers.

Jobs run as tasks, at most ``concurrency`` at once. Unlike threads, a task can be
cancelled: a handler that runs past ``hard_limit_s`` is cancelled and retried, and at
the end of the shutdown grace period unfinished handlers are cancelled and handed back.

As in the sync worker, a finished job frees its slot for the next poll, which acks it in
the same round trip (``poll(..., ack=...)``); the settle task acks those no poll took
within ``felix_redis.worker.ACK_LINGER_S`` (the loop waits in a long poll), and all of
them at once on shutdown. What the worker decides about a record is written once, in
``felix_redis._runtime``; this module holds the tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from felix_redis import _tracing
from felix_redis import worker as _worker
from felix_redis._runtime import Finished, Job, WorkerBase, drive_async, is_async_handler
from felix_redis.errors import FelixError, InvalidArgument
from felix_redis.models import Record

if TYPE_CHECKING:
    from felix_redis.asyncio import AsyncShardedGroup

__all__ = ["AsyncWorker"]

log = logging.getLogger("felix_redis.worker")


class HardLimitExceeded(Exception):
    """The handler ran longer than the worker's hard limit and was cancelled."""


class AsyncWorker(WorkerBase):
    """Runs ``await handler(record)`` for every record of a group, ``concurrency`` at once.

    Takes the arguments of :class:`felix_redis.worker.Worker`, with an
    :class:`~felix_redis.asyncio.AsyncClient` and an ``async def`` handler;
    ``await worker.run()``.
    """

    cancels_at_hard_limit = True

    _group: AsyncShardedGroup
    _source: AsyncShardedGroup

    def _check_handler(self, handler: Any) -> None:
        if not callable(handler):
            raise InvalidArgument(f"the handler must be callable, got {type(handler).__name__}")
        if not is_async_handler(handler):
            raise TypeError("the handler is not an async def; run a plain function with felix_redis.worker.Worker")

    def _init_runtime(self) -> None:
        self._stopping = asyncio.Event()
        self._changed = asyncio.Event()
        self._jobs: dict[Job, asyncio.Task[float] | None] = {}  # None: run on the loop's own task
        # Jobs whose handler returned, to ack. The next poll takes them along (ack=);
        # the settle task acks those no poll took within ACK_LINGER_S (the loop waits in
        # a long poll), and all of them on shutdown. _settle_wake rouses the settle task.
        self._finished = []
        self._settle_wake = asyncio.Event()
        self._settle_stop = False
        #: handlers are awaited on the loop's own task (QUICK_HANDLER_S): the settle task
        #: looks for finished jobs every ACK_LINGER_S rather than being woken for each
        self._inline = False
        self._helpers: list[asyncio.Task[None]] = []
        self._scheduler: asyncio.Task[None] | None = None
        self._signals: list[int] = []

    # -- public

    async def run(self) -> None:
        """Works until :meth:`stop` (or SIGTERM/SIGINT), then shuts down gracefully."""
        await self._startup()
        try:
            while not self._stopping.is_set():
                await drive_async(self._poll_plan(*await self._wait_for_free_slot(self.poll_wait_s)))
        finally:
            await self._shutdown()

    def stop(self) -> None:
        """Stops polling; running handlers get ``grace_s`` to finish. Call on the loop's thread."""
        self._stopping.set()
        self._changed.set()
        self._settle_wake.set()  # no poll will take the finished jobs along now

    # -- the loop, step by step

    async def _startup(self) -> None:
        self._configure([await self.client.group_describe(self.tenant, self.namespace, stream, self.group)
                         for stream in self.streams])
        self._finished = []
        self._settle_wake = asyncio.Event()
        self._settle_stop = False
        self._helpers = [asyncio.create_task(self._heartbeat_task()), asyncio.create_task(self._settle_task())]
        self._scheduler = asyncio.create_task(self._scheduler_task()) if self.ticks_schedules else None
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            self._install_signal_handlers()
        log.info("async worker started stream=%s group=%s consumer=%s concurrency=%d visibility_timeout_s=%g",
                 self._where, self.group, self.consumer or "-", self.concurrency, self.visibility_timeout_s)

    async def _wait(self, event: asyncio.Event, timeout: float | None) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    async def _wait_changed(self, timeout: float) -> None:
        self._changed.clear()
        await self._wait(self._changed, timeout)

    async def _wait_for_free_slot(self, timeout: float) -> tuple[int, list[Finished]]:
        """Free slots, counting those of finished jobs, and those jobs (taken: their acks
        go with the next poll)."""
        if len(self._jobs) - len(self._finished) >= self.concurrency and not self._stopping.is_set():
            await self._wait_changed(timeout)
        finished, self._finished = self._finished, []
        return max(0, self.concurrency - len(self._jobs) + len(finished)), finished

    async def _idle(self, seconds: float) -> None:
        await self._wait(self._stopping, seconds)

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def _burst_check(self) -> None:
        if not self._jobs:
            self._burst_stop()
        elif len(self._jobs) > len(self._finished):
            await self._wait_changed(self.poll_wait_s)
        # else: every job left has finished; the next poll acks them, then stops

    def _dispatch(self, job: Job) -> None:
        self._jobs[job] = asyncio.create_task(self._run_job(job))
        self.stats.in_flight = len(self._jobs)
        if self._metrics:
            self._metrics[job.item.stream].started()

    async def _dispatch_many(self, jobs: list[Job]) -> None:  # type: ignore[override]
        """Starts a task per job, or (a quick handler: felix_redis.worker.QUICK_HANDLER_S)
        awaits the handler on the loop's own task, job after job, until one runs longer
        than INLINE_MAX_S or the worker stops; the rest get tasks. Such a job has no task
        (None in ``_jobs``): a cancellation of run() while it runs leaves it to the
        shutdown, which hands it back."""
        done = 0
        if self._handler_runs >= _worker.QUICK_RUNS and self._handler_avg < _worker.QUICK_HANDLER_S:
            if not self._inline:
                self._inline = True
                self._settle_wake.set()  # it looks every ACK_LINGER_S while runs are inline
            if _tracing.process is None and self.hard_limit_s is None and not self._metrics:
                done = await self._run_inline(jobs)
            else:
                for job in jobs:
                    if self._stopping.is_set():
                        break
                    self._jobs[job] = None
                    self.stats.in_flight = len(self._jobs)
                    if self._metrics:
                        self._metrics[job.item.stream].started()
                    done += 1
                    try:
                        took = await self._run_job(job, inline=True)
                    except BaseException:  # a cancellation: the shutdown hands this job back
                        for rest in jobs[done:]:
                            self._dispatch(rest)
                        raise
                    if took > _worker.INLINE_MAX_S:
                        self._handler_runs = 0
                        self._inline = False
                        break
        for job in jobs[done:]:
            self._dispatch(job)

    async def _run_inline(self, jobs: list[Job]) -> int:
        """The usual case of the loop above (no tracing, no hard limit, no metrics) with
        :meth:`_run_job` unrolled: the handler awaited here, one clock reading a job (its
        end is the next one's start), the average kept in locals; returns how many ran.
        The state moves without the job's lock: everything runs on the event loop's
        thread, and nothing awaits between looking at the state and moving it."""
        handler, stopping, running, stats = self.handler, self._stopping, self._jobs, self.stats
        avg, runs = self._handler_avg, self._handler_runs
        ran, took = 0, 0.0
        try:
            started = time.monotonic()
            for job in jobs:
                if stopping.is_set():
                    break
                running[job] = None
                stats.in_flight = len(running)
                ran += 1
                try:
                    await handler(job.item.record)
                except Exception as exc:  # a cancellation (shutdown hands the record back) goes on
                    self._handler_avg, self._handler_runs = avg, runs
                    took = self._timed(started)
                    avg, runs = self._handler_avg, self._handler_runs
                    await drive_async(self._failed_plan(job, exc))
                    started = time.monotonic()
                else:
                    now = time.monotonic()
                    took, started = now - started, now
                    avg += (took - avg) / 16
                    runs += 1
                    if job.state == "running":
                        job.state = "finished"
                        # for the loop's next poll; the settle task looks every ACK_LINGER_S
                        # while runs are inline (it acks this one if a slow run holds it up)
                        self._finished.append((job, now - job.started, now))
                if took > _worker.INLINE_MAX_S:
                    runs = 0  # back to tasks until runs are quick again
                    self._inline = False
                    break
        except BaseException:  # a cancellation: the shutdown hands the job it was in back
            self._handler_avg, self._handler_runs = avg, runs
            for rest in jobs[ran:]:
                self._dispatch(rest)
            raise
        self._handler_avg, self._handler_runs = avg, runs
        return ran

    def _release(self, job: Job) -> None:
        self._release_many([job])

    def _release_many(self, jobs: list[Job]) -> None:
        pop = self._jobs.pop
        for job in jobs:
            pop(job, None)
        self.stats.in_flight = len(self._jobs)
        self._changed.set()
        if self._metrics:
            for job in jobs:
                self._metrics[job.item.stream].released()

    # -- jobs

    async def _run_job(self, job: Job, inline: bool = False) -> float:
        """Runs the handler on a job and settles it; returns how long the handler took.
        ``inline``: on the loop's own task, whose next poll takes the finished job along:
        no event is set for it (the settle task looks every ACK_LINGER_S meanwhile)."""
        record = job.item.record
        started = time.monotonic()
        try:
            if _tracing.process is None:
                if self.hard_limit_s is None:
                    await self.handler(record)  # (what _call does then, one coroutine less)
                else:
                    await self._call(record)
            else:
                with _tracing.process(self, job.item):
                    await self._call(record)
        except Exception as exc:  # a cancellation (shutdown hands the record back) goes on
            took = self._timed(started)
            await drive_async(self._failed_plan(job, exc))
        else:
            took = self._timed(started)
            if not inline:
                self._succeeded(job)
            elif job.settle("finished"):
                # for the loop's next poll; the settle task looks every ACK_LINGER_S while
                # runs are inline (it acks this one if a slow run holds up that poll)
                now = time.monotonic()
                self._finished.append((job, now - job.started, now))
        return took

    async def _call(self, record: Record) -> None:
        if self.hard_limit_s is None:
            await self.handler(record)
            return
        try:
            await asyncio.wait_for(self.handler(record), self.hard_limit_s)
        except asyncio.TimeoutError:
            raise HardLimitExceeded(f"handler ran past the hard limit of {self.hard_limit_s:g}s") from None

    def _add_finished(self, job: Job, duration: float) -> None:
        self._finished.append((job, duration, time.monotonic()))
        if len(self._finished) == 1:
            self._settle_wake.set()  # starts the settle task's linger
        self._changed.set()  # its slot is free for the next poll

    # -- acks, batched: with the next poll, or by the settle task

    def _requeue(self, finished: list[Finished]) -> None:
        self._finished[:0] = finished
        self._settle_wake.set()

    async def _settle_task(self) -> None:
        """Acks the finished jobs no poll took along in time, until shutdown."""
        # ACK_LINGER_S read at each turn, so one monkeypatch of felix_redis.worker covers both workers
        while (turn := self._settle_turn(_worker.ACK_LINGER_S)) is not None:
            batch, wait = turn
            if batch:
                await drive_async(self._ack_plan(batch))
            else:
                self._settle_wake.clear()
                await self._wait(self._settle_wake, wait if wait is not None or not self._inline
                                 else _worker.ACK_LINGER_S)

    # -- leases

    async def _heartbeat_task(self) -> None:
        every, tick = self._heartbeat_timing()
        while True:
            await asyncio.sleep(tick)
            await drive_async(self._heartbeat_plan(list(self._jobs), every))

    # -- recurring schedules

    async def _scheduler_task(self) -> None:
        off: set[str] = set()
        me = asyncio.current_task()
        # until stopped, or shut down (a cancelled run() does not set _stopping)
        while not self._stopping.is_set() and self._scheduler is me:
            await drive_async(self._schedule_plan(off))

    async def _schedule_idle(self, seconds: float) -> None:
        await self._wait(self._stopping, seconds)

    # -- shutdown

    async def _shutdown(self) -> None:
        """Releases the records fetched ahead, lets running handlers finish within the
        grace period, cancels and hands back the rest. Cut short (run() cancelled again,
        as cancel scopes do at each await): nothing of the worker goes on running, and
        what it held is left to its leases (due again once they lapse)."""
        try:
            await self._shut_down()
        except BaseException:
            self._cut_short()
            raise

    def _cut_short(self) -> None:
        """What a shutdown that did not finish leaves: the heartbeat (which would extend
        the leases of the jobs given up for as long as the loop runs), the scheduler and
        the handlers' tasks, cancelled; the settle task acks what finished and ends; the
        jobs forgotten."""
        heartbeat = self._helpers[0] if self._helpers else None
        for task in [heartbeat, self._scheduler, *self._jobs.values()]:
            if task is not None:
                task.cancel()
        self._settle_stop = True
        self._settle_wake.set()
        left = len(self._jobs)
        if self._metrics:
            for job in self._jobs:
                self._metrics[job.item.stream].released()
        self._jobs.clear()
        self.stats.in_flight = 0
        self._scheduler = None
        self._stopping.clear()
        self._restore_signal_handlers()
        log.warning("async worker of group %s: shutdown cut short; %d record(s) left to their leases", self.group, left)

    async def _shut_down(self) -> None:
        deadline = time.monotonic() + self.grace_s
        if self.prefetch:
            try:  # never run: due again at once for the other workers
                await self._source._release_buffer()
            except FelixError as exc:
                log.warning("records fetched ahead by worker of group %s not released: %s", self.group, exc)
        tasks = [task for task in self._jobs.values() if task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for job, task in list(self._jobs.items()):
            if job.settle("handed_back"):
                if task is not None:
                    task.cancel()
                await drive_async(self._hand_back_plan(job))
        self._settle_stop = True  # the settle task acks every finished job at once, then ends
        self._settle_wake.set()
        heartbeat, settle = self._helpers
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(settle), max(1.0, self.grace_s))
        heartbeat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await heartbeat
        if self._scheduler is not None:  # a tick cut short publishes each due time once all the same
            scheduler, self._scheduler = self._scheduler, None
            scheduler.cancel()
            await asyncio.wait([scheduler], timeout=1.0)
        self._stopping.clear()  # run() may be called again
        self._restore_signal_handlers()
        self._log_stopped("async worker")

    # -- signals

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
            self._signals.append(sig)

    def _restore_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.remove_signal_handler(sig)
        self._signals.clear()
