"""taskiq with taskiq-redis's ``RedisStreamBroker`` (Streams, consumer group, acks).

One worker process runs taskiq's ``Receiver`` with ``max_async_tasks = concurrency``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bench.core import AsyncDriver, RedisSystem, WorkerContext, job, serve

QUEUE = "bench"


def _broker(url: str) -> tuple[Any, Any]:
    """A stream broker whose group starts at the beginning, and the no-op task."""
    from taskiq_redis import RedisStreamBroker

    broker = RedisStreamBroker(url, queue_name=QUEUE, consumer_id="0")

    return broker, broker.task(task_name="noop")(_noop)


async def _noop(sent: float) -> None:
    job(sent)


class Taskiq(AsyncDriver, RedisSystem):
    """taskiq ``task.kiq`` and ``Receiver.listen``."""

    name = "taskiq"
    requires = ("taskiq", "taskiq_redis")

    def setup(self) -> None:
        super().setup()
        self.broker, self.task = _broker(self.cfg.redis_url)
        self.arun(self.broker.startup())

    def reset(self) -> None:
        super().reset()
        self.arun(self.broker.startup())

    async def apublish(self, sent: float) -> None:
        await self.task.kiq(sent)

    def close(self) -> None:
        self.arun(self.broker.shutdown())
        self.close_loop()
        super().close()

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        from taskiq.receiver import Receiver

        async def main() -> None:
            broker, _ = _broker(self.cfg.redis_url)
            broker.is_worker_process = True
            await broker.startup()
            receiver = Receiver(broker, max_async_tasks=self.cfg.concurrency, run_startup=False)
            ctx.wait_go()
            await serve(ctx, receiver.listen(asyncio.Event()), broker.shutdown)

        asyncio.run(main())
