"""NATS JetStream (127.0.0.1:4222) through nats-py.

A work-queue stream (``retention=workqueue``) in memory storage (the private Redis
runs without persistence too), one durable pull consumer with explicit acks shared by
the worker processes, each fetching ``concurrency`` messages at a time. ``js.publish``
waits for the stream's ack. Stream and consumer names are unique per run and deleted
afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Any

from bench.core import AsyncDriver, System, Unavailable, WorkerContext, job

URL = "nats://127.0.0.1:4222"
PACK = struct.Struct("!d")
DURABLE = "workers"


class NatsJetStream(AsyncDriver, System):
    """JetStream work queue: ``js.publish`` and a pull consumer with ``msg.ack()``."""

    name = "nats"
    requires = ("nats",)

    @property
    def stream(self) -> str:
        return f"{self.cfg.run_id}-jobs".replace("-", "_").upper()

    @property
    def subject(self) -> str:
        return f"{self.cfg.run_id}.jobs"

    def setup(self) -> None:
        super().setup()
        import nats

        try:
            self.nc = self.arun(nats.connect(URL, connect_timeout=5, max_reconnect_attempts=1))
        except Exception as exc:
            raise Unavailable(f"no NATS at {URL}: {exc!r}") from None
        self.js = self.nc.jetstream()

    async def _reset(self) -> None:
        from nats.js.api import ConsumerConfig, RetentionPolicy, StorageType

        with contextlib.suppress(Exception):
            await self.js.delete_stream(self.stream)
        await self.js.add_stream(
            name=self.stream,
            subjects=[self.subject],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.MEMORY,
        )
        await self.js.add_consumer(
            self.stream,
            ConsumerConfig(durable_name=DURABLE, ack_wait=30, max_ack_pending=-1),
        )

    def reset(self) -> None:
        self.arun(self._reset())

    async def apublish(self, sent: float) -> None:
        await self.js.publish(self.subject, PACK.pack(sent))

    def close(self) -> None:
        async def shut() -> None:
            with contextlib.suppress(Exception):
                await self.js.delete_stream(self.stream)
            await self.nc.close()

        self.arun(shut())
        self.close_loop()

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        import nats
        from nats.errors import TimeoutError as NatsTimeout

        async def main() -> None:
            nc = await nats.connect(URL)
            sub: Any = await nc.jetstream().pull_subscribe_bind(DURABLE, stream=self.stream)
            ctx.wait_go()
            while not ctx.stopping:
                try:
                    msgs = await sub.fetch(self.cfg.concurrency, timeout=0.1)
                except (NatsTimeout, asyncio.TimeoutError):
                    continue
                for msg in msgs:
                    job(PACK.unpack(msg.data)[0])
                    await msg.ack()
            await nc.close()

        asyncio.run(main())
