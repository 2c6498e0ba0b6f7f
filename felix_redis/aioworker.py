"""The asyncio worker: :class:`felix_redis.worker.Worker` for ``async def`` handlers.

Jobs run as tasks, at most ``concurrency`` at once. Unlike threads, a task can be
cancelled: a handler that runs past ``hard_limit_s`` is cancelled and retried, and at
the end of the shutdown grace period unfinished handlers are cancelled and handed back.

As in the sync worker, a finished job frees its slot for the next poll, which acks it in
the same round trip (``poll(..., ack=...)``); the settle task acks those no poll took
within ``felix_redis.worker.ACK_LINGER_S`` (the loop waits in a long poll), and all of
them at once on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from felix_redis import worker as _worker
from felix_redis.asyncio import AsyncShardedGroup
from felix_redis.errors import FelixError, InvalidArgument, StaleClaim
from felix_redis.models import Record
from felix_redis.worker import (
    ACKED,
    DEAD,
    HANDED_BACK,
    RETRIED,
    STALE,
    Fatal,
    Job,
    Retry,
    WorkerBase,
    decide,
    report_outcome,
)

if TYPE_CHECKING:
    pass

__all__ = ["AsyncWorker"]

log = logging.getLogger("felix_redis.worker")

AsyncHandler = Callable[[Record], Awaitable[object]]

#: A finished job: (job, how long its handler ran, time.monotonic() when it finished).
Finished = tuple[Job, float, float]


class HardLimitExceeded(Exception):
    """The handler ran longer than the worker's hard limit and was cancelled."""


class AsyncWorker(WorkerBase):
    """Runs ``await handler(record)`` for every record of a group, ``concurrency`` at once.

    Takes the arguments of :class:`felix_redis.worker.Worker`, with an
    :class:`~felix_redis.asyncio.AsyncClient`; ``await worker.run()``.
    """

    _group: AsyncShardedGroup
    _source: AsyncShardedGroup

    def _check_handler(self, handler: Any) -> None:
        if not (inspect.iscoroutinefunction(handler) or callable(handler)):
            raise InvalidArgument(f"the handler must be callable, got {type(handler).__name__}")

    def _init_runtime(self) -> None:
        self._stopping = asyncio.Event()
        self._changed = asyncio.Event()
        self._jobs: dict[Job, asyncio.Task[None]] = {}
        # Jobs whose handler returned, to ack. The next poll takes them along (ack=);
        # the settle task acks those no poll took within ACK_LINGER_S (the loop waits in
        # a long poll), and all of them on shutdown. _settle_wake rouses the settle task.
        self._finished: list[Finished] = []
        self._settle_wake = asyncio.Event()
        self._settle_stop = False
        self._helpers: list[asyncio.Task[None]] = []
        self._signals: list[int] = []

    # -- public

    async def run(self) -> None:
        """Works until :meth:`stop` (or SIGTERM/SIGINT), then shuts down gracefully."""
        await self._startup()
        try:
            while not self._stopping.is_set():
                await self._poll_iteration()
        finally:
            await self._shutdown()

    def stop(self) -> None:
        """Stops polling; running handlers get ``grace_s`` to finish. Call on the loop's thread."""
        self._stopping.set()
        self._changed.set()
        self._settle_wake.set()  # no poll will take the finished jobs along now

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # -- the loop, step by step

    async def _startup(self) -> None:
        self._configure(await self.client.group_describe(self.tenant, self.namespace, self.stream, self.group))
        self._finished = []
        self._settle_wake = asyncio.Event()
        self._settle_stop = False
        self._helpers = [asyncio.create_task(self._heartbeat_task()), asyncio.create_task(self._settle_task())]
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            self._install_signal_handlers()
        log.info("async worker started stream=%s group=%s consumer=%s concurrency=%d visibility_timeout_s=%g",
                 self._where, self.group, self.consumer or "-", self.concurrency, self.visibility_timeout_s)

    async def _poll_iteration(self) -> None:
        """Waits for a free slot, polls up to the free slots (acking the finished jobs in
        the same round trip), starts a task per record."""
        free, finished = await self._wait_for_free_slot(self.poll_wait_s)
        if free == 0 or self._stopping.is_set():
            if finished:
                await self._ack_batch(finished)
            return
        try:
            items = await self._source.poll(
                free, None if self.burst else self.poll_wait_s, ack=[job.item for job, _, _ in finished])
        except FelixError as exc:
            log.error("poll failed stream=%s group=%s: %s", self._where, self.group, exc)
            if finished:
                await self._ack_batch(finished)  # the acks it carried may not have been applied
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), min(self.poll_wait_s, 1.0))
            return
        except BaseException:
            # Cancelled (or a bug) mid-poll: give the jobs back to the settle task, which
            # acks them again on shutdown (acks are idempotent).
            self._requeue(finished)
            raise
        if finished:
            self._acked(finished, ACKED)
        for item in items:
            self._dispatch(Job(item))
        if not items and self.burst:
            if not self._jobs:
                log.info("burst: nothing due, stopping stream=%s group=%s", self._where, self.group)
                self._stopping.set()
            elif len(self._jobs) > len(self._finished):
                await self._wait_changed(self.poll_wait_s)
            # else: every job left has finished; the next poll acks them, then stops

    async def _wait_changed(self, timeout: float) -> None:
        self._changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    async def _wait_for_free_slot(self, timeout: float) -> tuple[int, list[Finished]]:
        """Free slots, counting those of finished jobs, and those jobs (taken: their acks
        go with the next poll)."""
        if len(self._jobs) - len(self._finished) >= self.concurrency and not self._stopping.is_set():
            await self._wait_changed(timeout)
        finished, self._finished = self._finished, []
        return max(0, self.concurrency - len(self._jobs) + len(finished)), finished

    def _dispatch(self, job: Job) -> None:
        self._jobs[job] = asyncio.create_task(self._run_job(job))
        self.stats.in_flight = len(self._jobs)
        if self._metrics:
            self._metrics.started()

    def _release(self, job: Job) -> None:
        self._jobs.pop(job, None)
        self.stats.in_flight = len(self._jobs)
        self._changed.set()
        if self._metrics:
            self._metrics.released()

    # -- jobs

    async def _run_job(self, job: Job) -> None:
        record = job.item.record
        try:
            if self.hard_limit_s is None:
                await self.handler(record)
            else:
                try:
                    await asyncio.wait_for(self.handler(record), self.hard_limit_s)
                except asyncio.TimeoutError:
                    raise HardLimitExceeded(f"handler ran past the hard limit of {self.hard_limit_s:g}s") from None
        except Exception as exc:
            duration = time.monotonic() - job.started
            if job.settle("finished"):
                if not isinstance(exc, (Retry, Fatal)):
                    log.debug("handler raised for %s", record.claim, exc_info=True)
                await self._fail(job, exc, duration)
                self._release(job)
        else:
            duration = time.monotonic() - job.started
            job.settle("finished", lambda: self._add_finished(job, duration))

    def _add_finished(self, job: Job, duration: float) -> None:
        self._finished.append((job, duration, time.monotonic()))
        if len(self._finished) == 1:
            self._settle_wake.set()  # starts the settle task's linger
        self._changed.set()  # its slot is free for the next poll

    async def _fail(self, job: Job, exc: Exception, duration: float) -> None:
        record = job.item.record
        self.stats.failed += 1
        decision = decide(exc, record.attempts, self.max_attempts, self.backoff, self.dead_letter_on)
        detail = f"error={decision.reason!r}"
        try:
            if decision.dead:
                await self._group.dead_letter(job.item, decision.reason)
                outcome = DEAD
            else:
                dead = await self._group.nack(job.item, decision.delay_s)
                outcome = DEAD if dead else RETRIED
                if not dead:
                    detail = f"retry_in_s={decision.delay_s:.3f} {detail}"
        except StaleClaim:
            outcome = STALE
        except FelixError as exc2:
            outcome = STALE
            detail += f" settle_error={exc2!r}"
        report_outcome(self.stats, self._metrics, self._where, record, outcome, duration, detail, failed=True)

    # -- acks, batched: with the next poll, or by the settle task

    def _requeue(self, finished: list[Finished]) -> None:
        """Puts taken finished jobs back in front, for the settle task."""
        if finished:
            self._finished[:0] = finished
            self._settle_wake.set()

    async def _settle_task(self) -> None:
        """Acks the finished jobs no poll took along within ACK_LINGER_S (the loop waits
        in a long poll, or is stopping), at most 1000 per call."""
        while True:
            if self._finished:
                # read at call time, so one monkeypatch of felix_redis.worker covers both workers
                wait = self._finished[0][2] + _worker.ACK_LINGER_S - time.monotonic()
                if wait <= 0 or self._stopping.is_set() or self._settle_stop:
                    batch, self._finished = self._finished[:1000], self._finished[1000:]
                    await self._ack_batch(batch)
                    continue
                self._settle_wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._settle_wake.wait(), wait)
            elif self._settle_stop:
                return
            else:
                self._settle_wake.clear()
                await self._settle_wake.wait()

    async def _ack_batch(self, batch: list[Finished]) -> None:
        outcome, detail = STALE, "ack_failed=true"
        for attempt in range(3):
            try:
                await self._group.ack_many(job.item for job, _, _ in batch)
                outcome, detail = ACKED, ""
                break
            except FelixError as exc:
                log.error("ack of %d record(s) failed (try %d of 3): %s", len(batch), attempt + 1, exc)
                await asyncio.sleep(0.2 * (attempt + 1))
        self._acked(batch, outcome, detail)

    def _acked(self, batch: list[Finished], outcome: str, detail: str = "") -> None:
        """Reports the outcome of finished jobs whose ack was sent, and frees their slots."""
        for job, duration, _ in batch:
            report_outcome(self.stats, self._metrics, self._where, job.item.record, outcome, duration, detail)
            self._release(job)

    # -- leases

    async def _heartbeat_task(self) -> None:
        every = self.visibility_timeout_s * self.heartbeat_fraction
        tick = max(0.01, min(every / 4, 1.0))
        while True:
            await asyncio.sleep(tick)
            await self._heartbeat(every)

    async def _heartbeat(self, every: float) -> None:
        now = time.monotonic()
        for job in list(self._jobs):
            if job.state != "running" or job.abandoned or now - job.renewed < every:
                continue
            job.renewed = now
            try:
                await self._group.extend(job.item)
            except StaleClaim:
                job.abandoned = True
                log.warning("job stream=%s claim=%s lost its lease", self._where, job.item.claim)
            except FelixError as exc:
                log.error("extend of %s failed: %s", job.item.claim, exc)

    # -- shutdown

    async def _shutdown(self) -> None:
        """Lets running handlers finish within the grace period, cancels and hands back the rest."""
        if self._jobs:
            await asyncio.wait(list(self._jobs.values()), timeout=self.grace_s)
        for job, task in list(self._jobs.items()):
            if job.settle("handed_back"):
                task.cancel()
                await self._hand_back(job)
        self._settle_stop = True  # the settle task acks every finished job at once, then ends
        self._settle_wake.set()
        heartbeat, settle = self._helpers
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(settle), max(1.0, self.grace_s))
        heartbeat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await heartbeat
        self._stopping.clear()  # run() may be called again
        self._restore_signal_handlers()
        log.info("async worker stopped stream=%s group=%s %s", self._where, self.group,
                 " ".join(f"{k}={v}" for k, v in self.stats.as_dict().items()))

    async def _hand_back(self, job: Job) -> None:
        duration = time.monotonic() - job.started
        try:
            dead = await self._group.nack(job.item, 0.0)
            outcome = DEAD if dead else HANDED_BACK  # dead: it was the last allowed attempt
        except FelixError:
            outcome = STALE
        report_outcome(self.stats, self._metrics, self._where, job.item.record, outcome, duration, "reason=shutdown")
        self._release(job)

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

    def _on_signal(self, signum: int) -> None:
        if self._stopping.is_set():
            log.warning("received %s again: exiting now; unfinished leases will lapse", signal.Signals(signum).name)
            logging.shutdown()
            os._exit(128 + signum)
        log.info("received %s: stopping, running handlers have %gs to finish (again to exit now)",
                 signal.Signals(signum).name, self.grace_s)
        self.stop()
