"""Dramatiq with its Redis broker; one worker process runs ``concurrency`` threads."""

from __future__ import annotations

import time
from typing import Any

from bench.core import RedisSystem, WorkerContext, job

QUEUE = "bench"


def _actor(url: str) -> Any:
    """The no-op actor, bound to a fresh Redis broker (same name in driver and workers)."""
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url=url)
    dramatiq.set_broker(broker)

    return dramatiq.actor(actor_name="noop", queue_name=QUEUE, max_retries=0)(job)


class Dramatiq(RedisSystem):
    """Dramatiq ``actor.send`` and ``dramatiq.Worker``."""

    name = "dramatiq"
    requires = ("dramatiq", "dramatiq.brokers.redis")

    def setup(self) -> None:
        super().setup()
        self.actor = _actor(self.cfg.redis_url)

    def publish(self, sent: float) -> None:
        self.actor.send(sent)

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        import dramatiq

        actor = _actor(self.cfg.redis_url)
        worker = dramatiq.Worker(actor.broker, worker_threads=self.cfg.concurrency, worker_timeout=100)
        ctx.wait_go()
        worker.start()
        while not ctx.stopping:
            time.sleep(0.05)
        worker.stop()
