"""The floor: plain Redis Streams commands with no queue semantics on top.

``XADD`` one call per job, ``XADD`` pipelined in batches, and a consumer-group drain of
``XREADGROUP COUNT <concurrency> BLOCK`` followed by one ``XACK`` per batch. Every other
system's ratio is taken against these numbers from the same run.
"""

from __future__ import annotations

import time
from typing import Any

from bench.core import Budget, RedisSystem, Scenario, WorkerContext

KEY = "bench:raw"
GROUP = "g"


class RawStreams(RedisSystem):
    """Redis Streams through redis-py, the lower bound for any Streams-based queue."""

    name = "raw"
    requires = ("redis",)

    def reset(self) -> None:
        super().reset()
        self.redis.xgroup_create(KEY, GROUP, id="0", mkstream=True)

    def publish(self, sent: float) -> None:
        self.redis.xadd(KEY, {"ts": repr(sent)})

    def enqueue_pipelined(self, n: int, budget: Budget) -> None:
        """``XADD`` in pipelines of ``cfg.batch`` commands (one round trip each)."""
        batch = self.cfg.batch
        for start in budget.range((n + batch - 1) // batch):
            pipe = self.redis.pipeline(transaction=False)
            for _ in range(min(batch, n - start * batch)):
                pipe.xadd(KEY, {"ts": repr(time.monotonic())})
            pipe.execute()

    def fill(self, n: int, budget: Budget) -> None:
        self.enqueue_pipelined(n, budget)

    def scenarios(self) -> list[Scenario]:
        extra = Scenario(
            "enqueue-pipelined",
            "enqueue",
            lambda: self.measure_enqueue(self.enqueue_pipelined),
            floor="enqueue-pipelined",
        )
        base = super().scenarios()
        return [base[0], extra, *base[1:]]

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        import redis

        r = redis.Redis.from_url(self.cfg.redis_url)
        consumer = f"c{ctx.index}"
        count = self.cfg.concurrency
        ctx.wait_go()
        while not ctx.stopping:
            reply: Any = r.xreadgroup(GROUP, consumer, {KEY: ">"}, count=count, block=100)
            for _stream, entries in reply:
                for _id, fields in entries:
                    ctx.job(float(fields[b"ts"]))
                if entries:
                    r.xack(KEY, GROUP, *[entry_id for entry_id, _ in entries])
