"""streaq: ``task.enqueue`` and ``streaq.Worker`` with ``concurrency`` slots per process."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from typing import Any

from bench.core import AsyncDriver, RedisSystem, WorkerContext, job, serve

QUEUE = "bench"


def _worker(url: str, concurrency: int) -> tuple[Any, Any]:
    """A streaq worker object (also the producer's client) and its no-op task."""
    import streaq

    worker = streaq.Worker(redis_url=url, queue_name=QUEUE, concurrency=concurrency, handle_signals=False)

    return worker, worker.task(name="noop", max_tries=1)(_noop)


async def _noop(sent: float) -> None:
    job(sent)


class Streaq(AsyncDriver, RedisSystem):
    """streaq on the private Redis."""

    name = "streaq"
    requires = ("streaq",)

    def setup(self) -> None:
        super().setup()
        self.client, self.task = _worker(self.cfg.redis_url, self.cfg.concurrency)

    def session(self) -> AbstractAsyncContextManager[Any]:
        return self.client  # type: ignore[no-any-return]

    async def apublish(self, sent: float) -> None:
        await self.task.enqueue(sent)

    def close(self) -> None:
        self.close_loop()
        super().close()

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        async def main() -> None:
            worker, _ = _worker(self.cfg.redis_url, self.cfg.concurrency)
            ctx.wait_go()
            await serve(ctx, worker.run_async())

        asyncio.run(main())
