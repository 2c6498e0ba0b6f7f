"""arq: ``enqueue_job`` and ``arq.Worker`` with ``max_jobs = concurrency`` per process.

arq sleeps ``poll_delay`` (0.5 s by default) between reads of its queue; the harness
sets 0.01 s, since the default would measure the sleep, not the queue.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bench.core import AsyncDriver, RedisSystem, WorkerContext, job, serve

QUEUE = "bench"
POLL_DELAY_S = 0.01


async def noop(ctx: Any, sent: float) -> None:
    """The job function arq calls by name."""
    job(sent)


class Arq(AsyncDriver, RedisSystem):
    """arq on the private Redis; results are not kept."""

    name = "arq"
    requires = ("arq",)

    def setup(self) -> None:
        super().setup()
        from arq.connections import RedisSettings, create_pool

        self.settings = RedisSettings.from_dsn(self.cfg.redis_url)
        self.pool = self.arun(create_pool(self.settings, default_queue_name=QUEUE))

    async def apublish(self, sent: float) -> None:
        await self.pool.enqueue_job("noop", sent)

    def close(self) -> None:
        self.arun(self.pool.aclose())
        self.close_loop()
        super().close()

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        from arq.connections import RedisSettings
        from arq.worker import Worker

        async def main() -> None:
            worker = Worker(
                functions=[noop],
                queue_name=QUEUE,
                redis_settings=RedisSettings.from_dsn(self.cfg.redis_url),
                max_jobs=self.cfg.concurrency,
                poll_delay=POLL_DELAY_S,
                keep_result=0,
                handle_signals=False,
                log_results=False,
            )
            ctx.wait_go()
            await serve(ctx, worker.main(), worker.close)

        asyncio.run(main())
