"""BullMQ for Python: ``Queue.add`` and ``bullmq.Worker`` with ``concurrency`` per process.

Completed jobs are removed (``removeOnComplete``), as production set-ups usually do.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bench.core import AsyncDriver, RedisSystem, WorkerContext, job, serve

QUEUE = "bench"


async def _process(task: Any, token: str) -> None:
    job(task.data["sent"])


class BullMQ(AsyncDriver, RedisSystem):
    """BullMQ (Python) on the private Redis."""

    name = "bullmq"
    requires = ("bullmq",)

    def setup(self) -> None:
        super().setup()
        import bullmq

        self.queue = bullmq.Queue(QUEUE, {"connection": self.cfg.redis_url})

    async def apublish(self, sent: float) -> None:
        await self.queue.add("noop", {"sent": sent}, {"removeOnComplete": True})

    def close(self) -> None:
        self.arun(self.queue.close())
        self.close_loop()
        super().close()

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        import bullmq

        async def main() -> None:
            opts = {
                "connection": self.cfg.redis_url,
                "concurrency": self.cfg.concurrency,
                "autorun": False,
            }
            worker = bullmq.Worker(QUEUE, _process, opts)
            ctx.wait_go()
            await serve(ctx, worker.run(), worker.close)

        asyncio.run(main())
