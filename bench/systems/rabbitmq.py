"""RabbitMQ (127.0.0.1:5672, guest/guest) through pika.

Publisher confirms on (each publish waits for the broker, like an acknowledged
``XADD``); transient messages on a non-durable classic queue (the private Redis runs
without persistence too); consumers use manual acks with ``basic_qos(prefetch_count =
concurrency)``. The queue name is unique per run and deleted afterwards.
"""

from __future__ import annotations

import struct
from typing import Any

from bench.core import System, Unavailable, WorkerContext, job

HOST, PORT = "127.0.0.1", 5672
PACK = struct.Struct("!d")


def _connect() -> Any:
    import pika

    params = pika.ConnectionParameters(
        host=HOST,
        port=PORT,
        credentials=pika.PlainCredentials("guest", "guest"),
        connection_attempts=1,
        socket_timeout=5,
        blocked_connection_timeout=30,
    )
    return pika.BlockingConnection(params)


class RabbitMQ(System):
    """A RabbitMQ work queue: ``basic_publish`` with confirms, ``basic_consume`` + ``basic_ack``."""

    name = "rabbitmq"
    requires = ("pika",)

    @property
    def queue(self) -> str:
        return f"{self.cfg.run_id}-jobs"

    def setup(self) -> None:
        super().setup()
        try:
            self.conn = _connect()
        except Exception as exc:
            raise Unavailable(f"no RabbitMQ at {HOST}:{PORT}: {exc!r}") from None
        self.channel = self.conn.channel()
        self.channel.confirm_delivery()

    def reset(self) -> None:
        self.channel.queue_delete(self.queue)
        self.channel.queue_declare(self.queue, durable=False, auto_delete=False)

    def publish(self, sent: float) -> None:
        self.channel.basic_publish("", self.queue, PACK.pack(sent))

    def close(self) -> None:
        self.channel.queue_delete(self.queue)
        self.conn.close()

    def worker(self, ctx: WorkerContext, variant: str) -> None:
        conn = _connect()
        channel = conn.channel()
        channel.basic_qos(prefetch_count=self.cfg.concurrency)

        def on_message(ch: Any, method: Any, props: Any, body: bytes) -> None:
            job(PACK.unpack(body)[0])
            ch.basic_ack(method.delivery_tag)

        channel.basic_consume(self.queue, on_message, auto_ack=False)
        ctx.wait_go()
        while not ctx.stopping:
            conn.process_data_events(time_limit=0.1)
        conn.close()
