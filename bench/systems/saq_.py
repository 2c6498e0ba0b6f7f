"""SAQ: ``Queue.enqueue`` and ``saq.Worker`` with ``concurrency`` slots per process."""

from __future__ import annotations

import asyncio
from typing import Any

from bench.core import AsyncDriver, RedisSystem, WorkerContext, job, serve

QUEUE = "bench"


async def noop(ctx: Any, *, sent: float) -> None:
    """The job function SAQ calls by name."""
    job(sent)


class Saq(AsyncDriver, RedisSystem):
    """SAQ on the private Redis."""

    name = "saq"
    requires = ("saq",)

    def setup(self) -> None:
        super().setup()
        import saq

        self.queue = saq.Queue.from_url(self.cfg.redis_url, name=QUEUE)
        self.arun(self.queue.connect())

    async def apublish(self, sent: float) -> None:
        await self.queue.enqueue("noop", sent=sent)

    def close(self) -> None:
        self.arun(self.queue.disconnect())
        self.close_loop()
        super().close()

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        import saq

        async def main() -> None:
            queue = saq.Queue.from_url(self.cfg.redis_url, name=QUEUE)
            worker = saq.Worker(queue, functions=[noop], concurrency=self.cfg.concurrency)
            ctx.wait_go()
            await serve(ctx, worker.start(), worker.stop)

        asyncio.run(main())
