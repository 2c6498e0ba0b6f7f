"""Handlers of the receipts example: one plain function, one coroutine.

Run a worker over them with::

    felixctl worker receipts senders tasks:send_receipt --concurrency 8 --consumer "$(hostname)-1"
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

from felix_redis import Record
from felix_redis.worker import Fatal, Retry

log = logging.getLogger("receipts")


class MailServerBusy(Exception):
    """The (pretend) mail server asked us to come back later."""


def send_receipt(record: Record) -> None:
    """Sends one receipt. Returning acks the record; raising decides what happens next."""
    try:
        order = json.loads(record.payload)
    except ValueError:
        raise Fatal(f"not JSON: {record.payload[:40]!r}") from None  # retrying cannot help
    if "email" not in order:
        raise Fatal("order has no email address")
    if random.random() < 0.1:
        raise MailServerBusy("421 try again later")  # retried with exponential backoff
    if random.random() < 0.05:
        raise Retry(after=10, reason="rate limited")  # retried in 10 s, whatever the backoff says
    time.sleep(order.get("work_s", 0.05))  # a long job's lease is extended while it runs
    log.info("receipt for order %s sent to %s (attempt %d)", order["order"], order["email"], record.attempts)


async def send_receipt_async(record: Record) -> None:
    """The same job for an asyncio worker (felixctl picks AsyncWorker for an async def)."""
    order = json.loads(record.payload)
    await asyncio.sleep(order.get("work_s", 0.05))
    log.info("receipt for order %s sent (async)", order["order"])
