"""Shared timing, process and result code for every system under test.

A system (``bench/systems/*.py``) subclasses :class:`System` and fills in a few hooks:
``publish`` (one job, one call), ``worker`` (the consumer loop that runs in a worker
process) and, when it is not a plain Redis peer, ``setup``/``reset``/``close``. Everything
that times, spawns, gates and counts lives here, once.

Every job carries one float, the ``time.monotonic()`` at which it was sent (the clock is
system-wide on Linux, so worker processes can compare it). Every handler calls
:func:`job` with it; the shared counter tells the driver when a drain is complete and the
latency scenario reads the publish-to-handler time from it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from multiprocessing.context import SpawnProcess
from pathlib import Path
from typing import Any, ClassVar

CTX = multiprocessing.get_context("spawn")

#: Samples sent before the latency measurement starts (worker warm-up, not reported).
LATENCY_WARMUP = 5


class Unavailable(Exception):
    """The system or scenario cannot run here; the message says why."""


class BenchFailure(Exception):
    """A scenario ran but did not complete (timeout, worker crash)."""


@dataclass
class Config:
    """Everything a system needs to know, picklable for worker processes."""

    redis_url: str
    jobs: int
    concurrency: int = 16
    timeout_s: float = 120.0
    latency_samples: int = 500
    latency_budget_s: float = 15.0
    batch: int = 100
    run_id: str = "bench"
    log_dir: str = ""


@dataclass
class Sample:
    """One timed repetition of one scenario."""

    jobs: int
    seconds: float
    latencies_ms: list[float] = field(default_factory=list)
    info: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Scenario:
    """A named measurement of one system.

    ``group`` is the chart panel (``enqueue``, ``drain-1p``, ``drain-2p``, ``latency``);
    ``floor`` names the raw-Streams scenario this one's ratio is taken against.
    """

    name: str
    group: str
    run: Callable[[], Sample]
    floor: str = ""

    @property
    def kind(self) -> str:
        return "latency" if self.group == "latency" else "rate"

    @property
    def floor_name(self) -> str:
        return self.floor or self.group


class Budget:
    """A deadline for one bounded loop."""

    def __init__(self, seconds: float, what: str = "loop") -> None:
        self.seconds = seconds
        self.what = what
        self.deadline = time.monotonic() + seconds

    def check(self, done: int, total: int) -> None:
        if time.monotonic() > self.deadline:
            raise BenchFailure(f"timeout: {self.what} did {done}/{total} in {self.seconds:.0f}s")

    def range(self, n: int) -> Iterator[int]:
        """``range(n)`` that raises :class:`BenchFailure` once the deadline passed."""
        for i in range(n):
            if not i & 255:
                self.check(i, n)
            yield i

    @property
    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


#: Worker processes one measurement may start.
MAX_WORKERS = 64
#: Jobs before the target from which every handler call counts under the shared lock.
EXACT_TAIL = 1000


class Shared:
    """State shared by the driver and its worker processes for one run."""

    def __init__(self, target: int, latency_slots: int = 0) -> None:
        self.target = target
        self.count = CTX.Value("q", 0)
        #: jobs handled per worker process, each written by its own process only
        self.slots = CTX.Array("q", MAX_WORKERS, lock=False)
        self.first = CTX.Value("d", 0.0, lock=False)
        self.end = CTX.Value("d", 0.0, lock=False)
        self.ready = CTX.Value("i", 0)
        self.go = CTX.Event()
        self.done = CTX.Event()
        self.stop = CTX.Event()
        self.tick = CTX.Event()
        self.latency = CTX.Array("d", latency_slots, lock=False) if latency_slots else None
        self.workers = 1  # set by WorkerPool before its processes start

    def handled(self) -> int:
        """Jobs handled so far."""
        return self.count.value if self.latency is not None else sum(self.slots[: self.workers])


class WorkerContext:
    """What a worker process sees: the go gate, the stop flag and the job counter."""

    def __init__(self, shared: Shared, cfg: Config, index: int) -> None:
        self.shared = shared
        self.cfg = cfg
        self.index = index

    def wait_go(self) -> None:
        """Report ready, then block until the driver starts the clock."""
        with self.shared.ready.get_lock():
            self.shared.ready.value += 1
        if not self.shared.go.wait(self.cfg.timeout_s):
            raise SystemExit("never got the go signal")

    @property
    def stopping(self) -> bool:
        return self.shared.stop.is_set()

    def on_stop(self, callback: Callable[[], Any]) -> None:
        """Call ``callback`` from a helper thread once the driver says stop."""
        import threading

        def watch() -> None:
            self.shared.stop.wait()
            callback()

        threading.Thread(target=watch, name="bench-stop", daemon=True).start()

    def job(self, sent: float) -> None:
        """One job handled; ``sent`` is its publish time.

        A drain counts each process's jobs in its own slot, without a lock: a lock shared
        by the processes, taken on every handler call, cost the fastest systems a fifth of
        their two-process rate. From ``EXACT_TAIL`` jobs before the target on (by this
        process's reading of the other slots, which lags by nanoseconds, not by a thousand
        jobs) every call takes the lock, so the call that completes the target sees it."""
        now = time.monotonic()
        s = self.shared
        if s.latency is None:
            slots = s.slots
            if s.first.value == 0.0:
                with s.count.get_lock():
                    if s.first.value == 0.0:
                        s.first.value = now
            if sum(slots[: s.workers]) + 1 < s.target - EXACT_TAIL:
                slots[self.index] += 1
                return
            with s.count.get_lock():
                slots[self.index] += 1
                if sum(slots[: s.workers]) == s.target and s.end.value == 0.0:
                    s.end.value = now
                    s.done.set()
            return
        with s.count.get_lock():
            before = s.count.value
            s.count.value = before + 1
            if before == 0:
                s.first.value = now
            if s.latency is not None and before < len(s.latency):
                s.latency[before] = now - sent
            if before + 1 == s.target:
                s.end.value = now
                s.done.set()
        if s.latency is not None:
            s.tick.set()


_current: WorkerContext | None = None


def job(sent: float) -> None:
    """Called by every handler in a worker process: one job done."""
    if _current is None:
        raise RuntimeError("bench.core.job() called outside a worker process")
    _current.job(float(sent))


def current() -> WorkerContext:
    """The worker context of this process."""
    if _current is None:
        raise RuntimeError("not in a bench worker process")
    return _current


class System:
    """One queue system under test. Subclasses set ``name`` and fill in the hooks."""

    name: ClassVar[str] = ""
    #: Python modules the system needs; a missing one makes it "unavailable".
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    # -- hooks -------------------------------------------------------------------
    def setup(self) -> None:
        """Connect (untimed). Raise :class:`Unavailable` when the system cannot run."""
        require(*self.requires)

    def close(self) -> None:
        """Release connections and anything ``setup`` created on shared servers."""

    def reset(self) -> None:
        """Forget every job and queue before a scenario (untimed)."""

    def publish(self, sent: float) -> None:
        """Enqueue one job with one call."""
        raise NotImplementedError

    def enqueue(self, n: int, budget: Budget) -> None:
        """Enqueue ``n`` jobs, one call each."""
        for _ in budget.range(n):
            self.publish(time.monotonic())

    def fill(self, n: int, budget: Budget) -> None:
        """Put ``n`` jobs in the queue before a drain (untimed); default: :meth:`enqueue`."""
        self.enqueue(n, budget)

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        """Consume jobs in a worker process: set up, ``ctx.wait_go()``, then loop."""
        raise NotImplementedError

    def scenarios(self) -> list[Scenario]:
        """The standard set; systems with more variants extend it."""
        return [
            Scenario("enqueue", "enqueue", self.measure_enqueue),
            Scenario("drain-1p", "drain-1p", lambda: self.measure_drain(1)),
            Scenario("drain-2p", "drain-2p", lambda: self.measure_drain(2)),
            Scenario("latency", "latency", self.measure_latency),
        ]

    # -- measurements --------------------------------------------------------------
    def measure_enqueue(self, enqueue: Callable[[int, Budget], None] | None = None) -> Sample:
        """Time ``enqueue(n)`` in this process."""
        n = self.cfg.jobs
        run = enqueue or self.enqueue
        budget = Budget(self.cfg.timeout_s, f"{self.name} enqueue")
        start = time.monotonic()
        run(n, budget)
        return Sample(jobs=n, seconds=time.monotonic() - start)

    def measure_drain(self, processes: int, variant: str = "") -> Sample:
        """Fill the queue, then time ``processes`` workers draining it."""
        n = self.cfg.jobs
        self.fill(n, Budget(self.cfg.timeout_s, f"{self.name} fill"))
        shared = Shared(n)
        with WorkerPool(self, shared, processes, variant) as pool:
            start = pool.start_clock()
            pool.wait_done()
        info = {"first_job_s": max(0.0, shared.first.value - start)}
        return Sample(jobs=n, seconds=shared.end.value - start, info=info)

    def measure_latency(self, variant: str = "") -> Sample:
        """Publish one job at a time to one idle worker; record publish-to-handler time."""
        total = self.cfg.latency_samples + LATENCY_WARMUP
        shared = Shared(total, latency_slots=total)
        budget = Budget(self.cfg.latency_budget_s, f"{self.name} latency")
        sent = 0
        with WorkerPool(self, shared, 1, variant) as pool:
            pool.start_clock()
            while sent < total and budget.left > 0:
                shared.tick.clear()
                self.publish(time.monotonic())
                sent += 1
                while not shared.tick.wait(min(0.5, budget.left) or 0.001):
                    pool.check_alive()
                    if budget.left <= 0:
                        break
        assert shared.latency is not None
        got = min(shared.count.value, total)
        lat = [v * 1000.0 for v in shared.latency[LATENCY_WARMUP:got]]
        if not lat:
            raise BenchFailure("no latency sample within the time budget")
        return Sample(jobs=len(lat), seconds=0.0, latencies_ms=lat)


def require(*modules: str) -> None:
    """Import ``modules`` or raise :class:`Unavailable` naming the missing one."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise Unavailable(f"cannot import {name}: {exc}") from None


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))
    return ordered[rank]


def system_class(name: str) -> type[System]:
    """Resolve a registered system name (see :mod:`bench.systems`)."""
    from bench.systems import load

    return load(name)


def _worker_main(name: str, cfg: Config, variant: str, shared: Shared, index: int) -> None:
    """Entry point of a worker process."""
    global _current
    if cfg.log_dir:
        log = Path(cfg.log_dir) / f"{name}-{variant or 'main'}-{index}.log"
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    import logging

    logging.basicConfig(level=logging.WARNING)
    _current = WorkerContext(shared, cfg, index)
    system = system_class(name)(cfg)
    system.worker(_current, variant)


class WorkerPool:
    """``processes`` worker processes of one system, gated to start together."""

    def __init__(self, system: System, shared: Shared, processes: int, variant: str) -> None:
        self.system = system
        self.shared = shared
        self.variant = variant
        self.timeout_s = system.cfg.timeout_s
        if processes > MAX_WORKERS:
            raise BenchFailure(f"at most {MAX_WORKERS} worker processes")
        shared.workers = processes
        self.procs: list[SpawnProcess] = [
            CTX.Process(
                target=_worker_main,
                args=(system.name, system.cfg, variant, shared, i),
                name=f"bench-{system.name}-{i}",
                daemon=True,
            )
            for i in range(processes)
        ]

    def __enter__(self) -> WorkerPool:
        for proc in self.procs:
            proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shared.stop.set()
        deadline = time.monotonic() + 2.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def check_alive(self) -> None:
        """Raise when every worker died (a crash, a refused connection)."""
        if all(not p.is_alive() for p in self.procs):
            codes = ",".join(str(p.exitcode) for p in self.procs)
            raise BenchFailure(f"workers exited ({codes}) {self.log_tail()}".strip())

    def log_tail(self, chars: int = 300) -> str:
        """The end of the workers' captured output, for failure reasons."""
        if not self.system.cfg.log_dir:
            return ""
        tails = []
        for path in sorted(Path(self.system.cfg.log_dir).glob(f"{self.system.name}-*.log")):
            text = path.read_text(errors="replace").strip()
            if text:
                tails.append(text[-chars:].replace("\n", " | "))
        return ("log: " + " || ".join(tails))[: chars * 2] if tails else ""

    def start_clock(self) -> float:
        """Wait until every worker is ready, then open the gate; returns the start time."""
        budget = Budget(self.timeout_s, "worker start")
        while self.shared.ready.value < len(self.procs):
            self.check_alive()
            if budget.left <= 0:
                raise BenchFailure(f"timeout: workers not ready in {self.timeout_s:.0f}s")
            time.sleep(0.01)
        start = time.monotonic()
        self.shared.go.set()
        return start

    def wait_done(self) -> None:
        """Block until the shared counter reached the target, bounded by the timeout."""
        budget = Budget(self.timeout_s, "drain")
        while not self.shared.done.wait(min(0.25, budget.left) or 0.001):
            self.check_alive()
            if budget.left <= 0:
                got = self.shared.handled()
                raise BenchFailure(f"timeout: {got}/{self.shared.target} jobs handled in {self.timeout_s:.0f}s")


def kill_group(pid: int) -> None:
    """SIGKILL a driver's whole process group (it and its workers)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


Json = dict[str, Any]


class RedisSystem(System):
    """A system that lives in the private Redis: ``reset`` flushes it."""

    def setup(self) -> None:
        super().setup()
        import redis

        self.redis = redis.Redis.from_url(self.cfg.redis_url, socket_timeout=30)

    def reset(self) -> None:
        self.redis.flushall()

    def close(self) -> None:
        self.redis.close()


class AsyncDriver:
    """Mixin for asyncio peers: ``apublish`` is the hook; the driver keeps one event loop
    for its life so async clients stay connected between calls."""

    _loop: Any = None
    _hold: Any = None
    _closing: Any = None

    def session(self) -> AbstractAsyncContextManager[Any] | None:
        """A client context that must stay entered in one task while the driver lives."""
        return None

    def arun(self, coro: Any) -> Any:
        """Run ``coro`` to completion on the driver's loop."""
        import asyncio

        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            cm = self.session()
            if cm is not None:
                opened = asyncio.Event()
                self._closing = asyncio.Event()

                async def hold() -> None:
                    async with cm:
                        opened.set()
                        await self._closing.wait()

                self._hold = self._loop.create_task(hold())
                self._loop.run_until_complete(asyncio.wait_for(opened.wait(), 30))
        return self._loop.run_until_complete(coro)

    async def apublish(self, sent: float) -> None:
        """Enqueue one job with one awaited call."""
        raise NotImplementedError

    async def _enqueue(self, n: int, budget: Budget) -> None:
        for _ in budget.range(n):
            await self.apublish(time.monotonic())

    def enqueue(self, n: int, budget: Budget) -> None:
        self.arun(self._enqueue(n, budget))

    def publish(self, sent: float) -> None:
        self.arun(self.apublish(sent))

    def close_loop(self) -> None:
        if self._loop is not None:
            if self._hold is not None:
                self._closing.set()
                self._loop.run_until_complete(self._hold)
            self._loop.close()
            self._loop = None


async def serve(ctx: WorkerContext, run: Awaitable[Any], stop: Callable[[], Awaitable[Any]] | None = None) -> None:
    """Run a peer's worker coroutine (after the go gate) until the driver says stop."""
    import asyncio

    task = asyncio.ensure_future(run)
    while not ctx.stopping and not task.done():
        await asyncio.sleep(0.05)
    if task.done():
        task.result()
    if stop is not None:
        await asyncio.wait_for(stop(), 5)
    task.cancel()
