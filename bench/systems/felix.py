"""felix-redis itself, written against the public contract (shared/CONTRACT.md).

Nine registered systems share this module:

- ``felix``: the sync client. Publish one call per job (the client's default: each
  publish carries its producer sequence, so a retried publish lands once), the same
  without producer state (``idempotent_publish=False``), the idempotent producer, batch
  publish, and a drain of ``group_poll(max_records=concurrency, ack=last batch)``: each
  batch's acks ride on the next poll, one round trip per batch.
- ``felix-async``: the same through ``felix_redis.asyncio``.
- ``felix-sharded``: a stream of ``SHARDS`` shards drained through ``group_sharded``.
- ``felix-readme``: the README's loop on that stream (``prefetch=4 * concurrency``,
  ``ack(item, wait=False)`` per item); ``felix-readme-plain`` the same without prefetch.
- ``felix-worker``: the ``felix_redis.Worker`` runtime (handler threads).
- ``felix-async-worker``: ``felix_redis.aioworker.AsyncWorker`` (async handlers).
- ``felix-worker-prefetch``, ``felix-async-worker-prefetch``: the two with
  ``prefetch=4 * concurrency``.

Anything the client does not have yet is reported as unavailable, never as a crash.
"""

from __future__ import annotations

import asyncio
import inspect
import struct
import time
from typing import Any, ClassVar

from bench.core import (
    AsyncDriver,
    Budget,
    RedisSystem,
    Sample,
    Scenario,
    Unavailable,
    WorkerContext,
    job,
    require,
    serve,
)

TENANT, NAMESPACE, STREAM, GROUP = "bench", "bench", "jobs", "workers"
NAME = (TENANT, NAMESPACE, STREAM)
PACK = struct.Struct("!d")
SHARDS = 4
#: Calls per slice of the paired enqueue (publish and XADD take turns slice by slice).
PAIRED_SLICE = 250
#: Long-poll of an idle worker; short enough to notice the stop flag promptly.
WAIT_S = 0.2


def _connect(url: str, **options: Any) -> Any:
    require("felix_redis")
    import felix_redis

    try:
        return felix_redis.connect(url, **options)
    except AttributeError as exc:
        raise Unavailable(f"felix_redis has no connect(): {exc}") from None


async def _aconnect(url: str) -> Any:
    require("felix_redis.asyncio")
    import felix_redis.asyncio as fa

    client = fa.connect(url)
    return await client if inspect.isawaitable(client) else client


def _need(obj: Any, *names: str) -> None:
    """Raise :class:`Unavailable` unless ``obj`` has every attribute in ``names``."""
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        owner = getattr(obj, "__name__", type(obj).__name__)
        raise Unavailable(f"{owner} has no {', '.join(missing)} yet")


def _sent(item: Any) -> float:
    """The publish time packed in a record's (or sharded item's) payload."""
    payload = getattr(item, "payload", None)
    if payload is None:
        payload = item.record.payload
    return float(PACK.unpack(payload)[0])


class Felix(RedisSystem):
    """The sync client with a one-shard stream and ``group_poll`` + ``group_ack_many``."""

    name = "felix"
    shards: ClassVar[int] = 1
    uses: ClassVar[tuple[str, ...]] = ("group_poll", "group_ack_many", "publish_batch")

    def setup(self) -> None:
        super().setup()
        self.sync = self.client = _connect(self.cfg.redis_url)
        _need(self.sync, "stream_create", "group_create", "publish", *self.uses)

    def reset(self) -> None:
        super().reset()
        self.sync.stream_create(*NAME, shards=self.shards)
        self.sync.group_create(*NAME, GROUP, start="earliest")

    def close(self) -> None:
        closer = getattr(self.sync, "close", None)
        if closer is not None:
            closer()
        super().close()

    def publish(self, sent: float) -> None:
        self.client.publish(*NAME, PACK.pack(sent))

    def enqueue_batch(self, n: int, budget: Budget) -> None:
        """``publish_batch`` of ``cfg.batch`` payloads per call, spread over the shards."""
        batch = self.cfg.batch
        for i in budget.range((n + batch - 1) // batch):
            payloads = [PACK.pack(time.monotonic()) for _ in range(min(batch, n - i * batch))]
            self.sync.publish_batch(*NAME, payloads, shard=i % self.shards)

    def enqueue_plain(self, n: int, budget: Budget) -> None:
        """``publish``, one call per job, on a client made with ``idempotent_publish=False``:
        no producer state is read or written (a publish retried after a lost reply may land
        twice)."""
        plain = _connect(self.cfg.redis_url, idempotent_publish=False)
        try:
            for _ in budget.range(n):
                plain.publish(*NAME, PACK.pack(time.monotonic()))
        finally:
            plain.close()

    def enqueue_idempotent(self, n: int, budget: Budget) -> None:
        """The idempotent producer's ``publish_keyed``, one call per job."""
        producer = self.sync.idempotent_producer()
        for i in budget.range(n):
            producer.publish_keyed(*NAME, f"k{i}", PACK.pack(time.monotonic()))

    def fill(self, n: int, budget: Budget) -> None:
        self.enqueue_batch(n, budget)

    def measure_paired(self) -> Sample:
        """``publish`` (as in ``enqueue``) and the raw floor's own call (redis-py's
        ``xadd`` of one field, ``bench/systems/raw_streams.py``) in one process, taking
        turns in slices of ``PAIRED_SLICE`` calls (which goes first alternates), ``jobs``
        calls each rounded down to whole slices (two slices at least): the machine's
        changes of speed fall on both alike, where the ``enqueue`` scenarios of two
        systems run seconds apart. The sample's rate is the publishes';
        ``paired_floor_rate``, the XADDs' of the same slices, is what the ratio is taken
        against."""
        import redis

        r = redis.Redis.from_url(self.cfg.redis_url)
        key = "bench:paired-xadd"
        slices = max(2, self.cfg.jobs // PAIRED_SLICE)
        budget = Budget(self.cfg.timeout_s, f"{self.name} enqueue-paired")
        publish = self.sync.publish
        spent = {"publish": 0.0, "xadd": 0.0}

        def xadds() -> None:
            for _ in range(PAIRED_SLICE):
                r.xadd(key, {"ts": repr(time.monotonic())})

        def publishes() -> None:
            for _ in range(PAIRED_SLICE):
                publish(*NAME, PACK.pack(time.monotonic()))

        try:
            for i in range(slices):
                budget.check(i, slices)  # every slice: a slice is hundreds of calls
                for what, run in (("xadd", xadds), ("publish", publishes))[:: 1 if i % 2 else -1]:
                    start = time.monotonic()
                    run()
                    spent[what] += time.monotonic() - start
        finally:
            r.delete(key)
            r.close()
        calls = slices * PAIRED_SLICE
        return Sample(jobs=calls, seconds=spent["publish"],
                      info={"paired_floor_rate": round(calls / spent["xadd"], 1) if spent["xadd"] else 0.0})

    def scenarios(self) -> list[Scenario]:
        enqueue, drain1, drain2, latency = super().scenarios()
        return [
            enqueue,
            Scenario("enqueue-paired", "enqueue", self.measure_paired, floor="enqueue"),
            Scenario(
                "enqueue-plain",
                "enqueue",
                lambda: self.measure_enqueue(self.enqueue_plain),
                floor="enqueue",
            ),
            Scenario(
                "enqueue-idempotent",
                "enqueue",
                lambda: self.measure_enqueue(self.enqueue_idempotent),
                floor="enqueue",
            ),
            Scenario(
                "enqueue-batch",
                "enqueue",
                lambda: self.measure_enqueue(self.enqueue_batch),
                floor="enqueue-pipelined",
            ),
            drain1,
            drain2,
            latency,
        ]

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        client = _connect(self.cfg.redis_url)
        shard, batch = 0, self.cfg.concurrency
        records: list[Any] = []
        ctx.wait_go()
        while not ctx.stopping:
            # the acks of the last batch ride on the next poll: one round trip per batch
            records = client.group_poll(*NAME, shard, GROUP, max_records=batch, wait=WAIT_S, ack=records)
            for record in records:
                job(_sent(record))
        if records:
            client.group_ack_many(*NAME, shard, GROUP, records)


class FelixAsync(AsyncDriver, Felix):
    """``felix_redis.asyncio``: the same names as coroutines."""

    name = "felix-async"

    def setup(self) -> None:
        super().setup()
        require("felix_redis.asyncio")
        self.client = self.arun(_aconnect(self.cfg.redis_url))
        _need(self.client, "publish", "group_poll", "group_ack_many")

    async def apublish(self, sent: float) -> None:
        await self.client.publish(*NAME, PACK.pack(sent))

    def close(self) -> None:
        closer = getattr(self.client, "close", None)
        if closer is not None:
            result = closer()
            if inspect.isawaitable(result):
                self.arun(result)
        self.close_loop()
        super().close()

    def measure_paired(self) -> Sample:
        """The asyncio ``publish`` against issue 23's floor for it, redis.asyncio's
        ``xadd`` of one field, awaited one after the other on the driver's one event loop,
        taking turns in slices of ``PAIRED_SLICE`` calls as :meth:`Felix.measure_paired`
        does (which goes first alternates). The sample's rate is the publishes';
        ``paired_floor_rate`` the XADDs' of the same slices."""
        import redis.asyncio as aioredis

        slices = max(2, self.cfg.jobs // PAIRED_SLICE)
        budget = Budget(self.cfg.timeout_s, f"{self.name} enqueue-paired")
        spent = {"publish": 0.0, "xadd": 0.0}
        key = "bench:paired-async-xadd"

        async def run() -> None:
            r = aioredis.Redis.from_url(self.cfg.redis_url)
            publish = self.client.publish

            async def xadds() -> None:
                for _ in range(PAIRED_SLICE):
                    await r.xadd(key, {"ts": repr(time.monotonic())})

            async def publishes() -> None:
                for _ in range(PAIRED_SLICE):
                    await publish(*NAME, PACK.pack(time.monotonic()))

            try:
                for i in range(slices):
                    budget.check(i, slices)
                    for what, part in (("xadd", xadds), ("publish", publishes))[:: 1 if i % 2 else -1]:
                        start = time.monotonic()
                        await part()
                        spent[what] += time.monotonic() - start
            finally:
                await r.delete(key)
                await r.aclose()

        self.arun(run())
        calls = slices * PAIRED_SLICE
        return Sample(jobs=calls, seconds=spent["publish"],
                      info={"paired_floor_rate": round(calls / spent["xadd"], 1) if spent["xadd"] else 0.0})

    def scenarios(self) -> list[Scenario]:
        enqueue, *rest = RedisSystem.scenarios(self)
        # the paired row's ratio is to redis.asyncio's XADD in the same slices (issue 23)
        return [enqueue, Scenario("enqueue-paired", "enqueue", self.measure_paired, floor="enqueue"), *rest]

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        async def main() -> None:
            client = await _aconnect(self.cfg.redis_url)
            batch = self.cfg.concurrency
            records: list[Any] = []
            ctx.wait_go()
            while not ctx.stopping:
                records = await client.group_poll(*NAME, 0, GROUP, max_records=batch, wait=WAIT_S, ack=records)
                for record in records:
                    job(_sent(record))
            if records:
                await client.group_ack_many(*NAME, 0, GROUP, records)

        asyncio.run(main())


class FelixSharded(Felix):
    """A ``SHARDS``-shard stream drained through ``group_sharded(...).poll`` + ``ack_many``."""

    name = "felix-sharded"
    shards = SHARDS
    uses = ("group_sharded", "publish_batch")

    def scenarios(self) -> list[Scenario]:
        return RedisSystem.scenarios(self)[1:4]

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        client = _connect(self.cfg.redis_url)
        group = client.group_sharded(*NAME, GROUP)
        batch = self.cfg.concurrency
        items: list[Any] = []
        ctx.wait_go()
        while not ctx.stopping:
            items = group.poll(batch, wait=WAIT_S, ack=items)
            for item in items:
                job(_sent(item))
        if items:
            group.ack_many(items)


class FelixReadme(FelixSharded):
    """The README's loop as a user copies it: ``group_sharded(..., prefetch=64)`` over
    ``SHARDS`` shards, ``poll(16, wait=...)``, handle, ``group.ack(item, wait=False)``
    per item (the acks ride on the next poll). The README's prefetch is 4x its poll:
    ``4 * concurrency`` here."""

    name = "felix-readme"
    prefetch_per_poll = 4

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        client = _connect(self.cfg.redis_url)
        group = client.group_sharded(*NAME, GROUP, prefetch=self.prefetch_per_poll * self.cfg.concurrency)
        ctx.wait_go()
        while not ctx.stopping:
            for item in group.poll(self.cfg.concurrency, wait=WAIT_S):
                job(_sent(item))
                group.ack(item, wait=False)
        group.close()


class FelixReadmePlain(FelixReadme):
    """The README's loop without prefetch: each ``poll(16)`` a round trip of 16 records."""

    name = "felix-readme-plain"
    prefetch_per_poll = 0


class FelixWorker(Felix):
    """The ``felix_redis.Worker`` runtime: ``concurrency`` handler threads per process."""

    name = "felix-worker"
    uses = ("publish_batch",)
    #: the runtime's prefetch, in multiples of its concurrency (0: none)
    prefetch_per_slot = 0

    def scenarios(self) -> list[Scenario]:
        return RedisSystem.scenarios(self)[1:4]

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        client = _connect(self.cfg.redis_url)

        from felix_redis import Worker

        def handler(record: Any) -> None:
            job(_sent(record))

        runtime = Worker(
            client,
            *NAME,
            GROUP,
            handler,
            concurrency=self.cfg.concurrency,
            poll_wait_s=WAIT_S,
            handle_signals=False,
            **self.prefetch(),
        )
        ctx.wait_go()
        ctx.on_stop(runtime.stop)
        runtime.run()

    def prefetch(self) -> dict[str, int]:
        """The runtime's ``prefetch=`` (none when 0: a client without it still runs)."""
        n = self.prefetch_per_slot * self.cfg.concurrency
        return {"prefetch": n} if n else {}


class FelixAsyncWorker(FelixWorker):
    """``felix_redis.aioworker.AsyncWorker``: ``concurrency`` handler coroutines per process."""

    name = "felix-async-worker"

    def setup(self) -> None:
        Felix.setup(self)
        require("felix_redis.aioworker")

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        from felix_redis.aioworker import AsyncWorker

        async def handler(record: Any) -> None:
            job(_sent(record))

        async def main() -> None:
            runtime = AsyncWorker(
                await _aconnect(self.cfg.redis_url),
                *NAME,
                GROUP,
                handler,
                concurrency=self.cfg.concurrency,
                poll_wait_s=WAIT_S,
                handle_signals=False,
                **self.prefetch(),
            )

            async def stop() -> None:
                runtime.stop()

            ctx.wait_go()
            await serve(ctx, runtime.run(), stop)

        asyncio.run(main())


class FelixWorkerPrefetch(FelixWorker):
    """The ``Worker`` with ``prefetch=4 * concurrency``."""

    name = "felix-worker-prefetch"
    prefetch_per_slot = 4


class FelixAsyncWorkerPrefetch(FelixAsyncWorker):
    """The ``AsyncWorker`` with ``prefetch=4 * concurrency``."""

    name = "felix-async-worker-prefetch"
    prefetch_per_slot = 4
