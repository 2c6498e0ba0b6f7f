"""Celery with the Redis broker; one worker process runs the ``threads`` pool."""

from __future__ import annotations

from typing import Any

from bench.core import RedisSystem, WorkerContext, job


def _app(url: str) -> tuple[Any, Any]:
    """A Celery app on ``url`` with the no-op task; results are ignored."""
    import celery

    app = celery.Celery("bench", broker=url)
    app.conf.update(
        task_ignore_result=True,
        task_default_queue="bench",
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )

    return app, app.task(name="noop")(job)


class Celery(RedisSystem):
    """Celery ``task.delay`` and ``app.Worker(pool="threads")``."""

    name = "celery"
    requires = ("celery",)

    def setup(self) -> None:
        super().setup()
        self.app, self.task = _app(self.cfg.redis_url)

    def publish(self, sent: float) -> None:
        self.task.delay(sent)

    def close(self) -> None:
        self.app.close()
        super().close()

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        app, _ = _app(self.cfg.redis_url)
        worker = app.Worker(
            pool="threads",
            concurrency=self.cfg.concurrency,
            loglevel="WARNING",
            quiet=True,
            without_heartbeat=True,
            without_gossip=True,
            without_mingle=True,
        )
        ctx.wait_go()
        worker.start()
