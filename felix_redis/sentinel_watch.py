"""Follow the sentinels' announcements of a new primary.

redis-py's Sentinel pool asks the sentinels where the primary is only when it makes a
connection: a connection already open to the old primary stays open. After a crash that
is harmless (the connection fails and the next one asks), but an old primary that is
still running keeps taking writes on those connections: one handed over by ``SENTINEL
FAILOVER`` until the sentinels turn it into a replica (up to 10 s later), one that was
paused or cut off when it comes back. Those writes are lost when it becomes a replica
(a quorum write is refused with NotReplicated, its replicas having moved on).

The sentinels announce each new primary on their ``+switch-master`` channel. A watch
subscribes to it on one sentinel (the next one when that fails) and, when the
announcement names its service, has redis-py's pool ask the sentinels again
(``get_master_address``): the pool then drops its idle connections to the old primary,
and a client's lane drops its own before its next call
(:func:`felix_redis.lane._stale_primary`). So no address is kept outside redis-py's own
machinery; the watch only tells it when to look. After (re)subscribing it looks once,
for an announcement it may have missed while it was not listening.

One watch per Sentinel client: a daemon thread for the synchronous client, a task of the
client's event loop for the asyncio one. Both stop when the client is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from typing import Any

__all__ = ["AsyncSentinelWatch", "SentinelWatch", "sentinel_pool"]

log = logging.getLogger("felix_redis.sentinel")

CHANNEL = "+switch-master"
#: How long one read of the channel waits; bounds how long close() takes to be seen.
POLL_S = 0.5
#: Pause after every sentinel failed to answer, before trying them again.
RETRY_S = 1.0


def sentinel_pool(raw: Any) -> Any:
    """The Sentinel-managed pool (sync or asyncio) of the primary behind ``raw``, or None."""
    pool = getattr(raw, "connection_pool", None)
    if pool is None or not getattr(pool, "is_master", False):
        return None
    if getattr(pool, "sentinel_manager", None) is None or not getattr(pool, "service_name", None):
        return None
    return pool


def _names(message: Any, service: str) -> bool:
    """True if ``message`` (a pub/sub message dict) announces a new primary of ``service``:
    ``+switch-master <name> <old ip> <old port> <new ip> <new port>``."""
    if not isinstance(message, dict) or message.get("type") != "message":
        return False
    data = message.get("data")
    if isinstance(data, bytes):
        data = data.decode("utf-8", "replace")
    return isinstance(data, str) and data.split(" ", 1)[0] == service


class SentinelWatch:
    """The watch of a synchronous Sentinel client's pool (see the module's docstring)."""

    def __init__(self, pool: Any) -> None:
        self.service: str = pool.service_name
        self.switches = 0
        self._sentinels: list[Any] = list(pool.sentinel_manager.sentinels)
        self._pool = weakref.ref(pool)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"felix-sentinel-watch-{self.service}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops the watch (its thread ends within :data:`POLL_S`)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            for sentinel in self._sentinels:
                if self._stop.is_set():
                    return
                try:
                    self._follow(sentinel)
                except Exception as exc:  # that sentinel failed: the next one
                    log.debug("sentinel watch of %s: %s", self.service, exc)
            self._stop.wait(RETRY_S)

    def _follow(self, sentinel: Any) -> None:
        pubsub = sentinel.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(CHANNEL)
            self._look()  # what was announced while nobody listened
            while not self._stop.is_set():
                if _names(pubsub.get_message(timeout=POLL_S), self.service):
                    self.switches += 1
                    self._look()
        finally:
            with contextlib.suppress(Exception):
                pubsub.close()

    def _look(self) -> None:
        pool = self._pool()
        if pool is None:  # the client is gone
            self._stop.set()
            return
        with contextlib.suppress(Exception):
            pool.get_master_address()


class AsyncSentinelWatch:
    """The watch of an asyncio Sentinel client's pool: a task of the loop that first
    calls :meth:`start` (from a coroutine)."""

    def __init__(self, pool: Any) -> None:
        self.service: str = pool.service_name
        self.switches = 0
        self._sentinels: list[Any] = list(pool.sentinel_manager.sentinels)
        self._pool = weakref.ref(pool)
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        """Starts the task on the running loop, once."""
        if self._task is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._run(), name=f"felix-sentinel-watch-{self.service}")

    async def close(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def _run(self) -> None:
        while True:
            for sentinel in self._sentinels:
                try:
                    await self._follow(sentinel)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.debug("sentinel watch of %s: %s", self.service, exc)
            await asyncio.sleep(RETRY_S)

    async def _follow(self, sentinel: Any) -> None:
        pubsub = sentinel.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(CHANNEL)
            await self._look()
            while True:
                if _names(await pubsub.get_message(timeout=POLL_S), self.service):
                    self.switches += 1
                    await self._look()
        finally:
            with contextlib.suppress(Exception):
                closer = getattr(pubsub, "aclose", None) or pubsub.close
                await closer()

    async def _look(self) -> None:
        pool = self._pool()
        if pool is None:
            raise asyncio.CancelledError
        with contextlib.suppress(Exception):
            await pool.get_master_address()
