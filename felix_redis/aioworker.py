"""The asyncio worker: :class:`felix_redis.worker.Worker` for ``async def`` handlers.

Jobs run as tasks, at most ``concurrency`` at once. Unlike threads, a task can be
cancelled: a handler that runs past ``hard_limit_s`` is cancelled and retried, and at
the end of the shutdown grace period unfinished handlers are cancelled and handed back.
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

from felix_redis.asyncio import AsyncShardedGroup
from felix_redis.errors import FelixError, InvalidArgument, StaleClaim
from felix_redis.models import Record
from felix_redis.worker import (
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
        self._acks: asyncio.Queue[tuple[Job, float] | None] = asyncio.Queue()
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

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # -- the loop, step by step

    async def _startup(self) -> None:
        self._configure(await self.client.group_describe(self.tenant, self.namespace, self.stream, self.group))
        self._acks = asyncio.Queue()
        self._helpers = [asyncio.create_task(self._heartbeat_task()), asyncio.create_task(self._settle_task())]
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            self._install_signal_handlers()
        log.info("async worker started stream=%s group=%s consumer=%s concurrency=%d visibility_timeout_s=%g",
                 self._where, self.group, self.consumer or "-", self.concurrency, self.visibility_timeout_s)

    async def _poll_iteration(self) -> None:
        """Waits for a free slot, polls up to the free slots, starts a task per record."""
        free = await self._wait_for_free_slot(self.poll_wait_s)
        if free == 0 or self._stopping.is_set():
            return
        try:
            items = await self._source.poll(free, None if self.burst else self.poll_wait_s)
        except FelixError as exc:
            log.error("poll failed stream=%s group=%s: %s", self._where, self.group, exc)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), min(self.poll_wait_s, 1.0))
            return
        for item in items:
            self._dispatch(Job(item))
        if not items and self.burst:
            if not self._jobs:
                log.info("burst: nothing due, stopping stream=%s group=%s", self._where, self.group)
                self._stopping.set()
            else:
                await self._wait_changed(self.poll_wait_s)

    async def _wait_changed(self, timeout: float) -> None:
        self._changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    async def _wait_for_free_slot(self, timeout: float) -> int:
        if len(self._jobs) >= self.concurrency and not self._stopping.is_set():
            await self._wait_changed(timeout)
        return max(0, self.concurrency - len(self._jobs))

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
            job.settle("finished", lambda: self._acks.put_nowait((job, duration)))

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

    # -- acks, batched

    async def _settle_task(self) -> None:
        while True:
            first = await self._acks.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while len(batch) < 1000 and not self._acks.empty():
                nxt = self._acks.get_nowait()
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            await self._ack_batch(batch)
            if stop:
                return

    async def _ack_batch(self, batch: list[tuple[Job, float]]) -> None:
        outcome, detail = STALE, "ack_failed=true"
        for attempt in range(3):
            try:
                await self._group.ack_many(job.item for job, _ in batch)
                outcome, detail = "acked", ""
                break
            except FelixError as exc:
                log.error("ack of %d record(s) failed (try %d of 3): %s", len(batch), attempt + 1, exc)
                await asyncio.sleep(0.2 * (attempt + 1))
        for job, duration in batch:
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
        self._acks.put_nowait(None)
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
