"""RQ: ``Queue.enqueue`` and a ``SimpleWorker`` (no fork per job) per worker process."""

from __future__ import annotations

from bench.core import RedisSystem, WorkerContext, job

QUEUE = "bench"


def noop(sent: float) -> None:
    """The job RQ imports by name in the worker."""
    job(sent)


class RQ(RedisSystem):
    """RQ runs one job at a time per worker; results are not kept (``result_ttl=0``)."""

    name = "rq"
    requires = ("rq",)

    def setup(self) -> None:
        super().setup()
        import rq

        self.queue = rq.Queue(QUEUE, connection=self.redis)

    def publish(self, sent: float) -> None:
        self.queue.enqueue(noop, sent, result_ttl=0)

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        import redis
        import rq

        conn = redis.Redis.from_url(self.cfg.redis_url)
        worker = rq.SimpleWorker([rq.Queue(QUEUE, connection=conn)], connection=conn)
        ctx.wait_go()
        worker.work(logging_level="WARNING")
