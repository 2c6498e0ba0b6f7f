"""Follow the sentinels' announcements of a new primary.

redis-py's Sentinel pool asks the sentinels where the primary is only when it makes a
connection: a connection already open to the old primary stays open. After a crash that
is harmless (the connection fails and the next one asks), but an old primary that is
still running keeps taking writes on those connections: one handed over by ``SENTINEL
FAILOVER`` until the sentinels turn it into a replica (up to 10 s later), one that was
paused or cut off when it comes back. Those writes are lost when it becomes a replica
(a quorum write is refused with NotReplicated, its replicas having moved on).

The sentinels announce each new primary on their ``+switch-master`` channel: the leader
of a failover at once, the others when they hear of it (up to their 2 s hello period
later). A watch subscribes to it on every sentinel, and when an announcement names its
service it has redis-py's pool ask the sentinels again (``get_master_address``) until
they give the announced address (bounded by :data:`LOOK_S`); a sentinel that has not
heard yet still names the old primary, and the client's Sentinel manager passes over
that answer for a while (``felix_redis.connection._ReplacedPrimaries``), so neither
the watch nor a connection made meanwhile goes back to it. The pool then drops its
idle connections to the old primary, and a client's lane drops its own before its next
call (:func:`felix_redis.lane._stale_primary`). So no address is kept outside
redis-py's own machinery; the watch tells it when to look, until when, and which
answer is out of date. After (re)subscribing
it looks once, for an announcement it may have missed while it was not listening.

One watch per Sentinel client: a daemon thread for the synchronous client, tasks of the
client's event loop for the asyncio one. Both stop when the client is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from typing import Any

__all__ = ["AsyncSentinelWatch", "SentinelWatch", "announced", "sentinel_pool", "switch"]

log = logging.getLogger("felix_redis.sentinel")

CHANNEL = "+switch-master"
#: How long one read of the channels waits; bounds how long close() takes to be seen.
POLL_S = 0.5
#: Pause before a sentinel that failed is subscribed to again.
RETRY_S = 1.0
#: How long after an announcement the pool is asked again until the sentinels agree.
LOOK_S = 3.0
LOOK_EVERY_S = 0.1


def sentinel_pool(raw: Any) -> Any:
    """The Sentinel-managed pool (sync or asyncio) of the primary behind ``raw``, or None."""
    pool = getattr(raw, "connection_pool", None)
    if pool is None or not getattr(pool, "is_master", False):
        return None
    if getattr(pool, "sentinel_manager", None) is None or not getattr(pool, "service_name", None):
        return None
    return pool


def switch(message: Any, service: str) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """The old and the new primary's addresses if ``message`` (a pub/sub message dict)
    announces a new one for ``service``:
    ``+switch-master <name> <old ip> <old port> <new ip> <new port>``."""
    if not isinstance(message, dict) or message.get("type") != "message":
        return None
    data = message.get("data")
    if isinstance(data, bytes):
        data = data.decode("utf-8", "replace")
    parts = data.split() if isinstance(data, str) else []
    if len(parts) != 5 or parts[0] != service or not parts[2].isdigit() or not parts[4].isdigit():
        return None
    return (parts[1], int(parts[2])), (parts[3], int(parts[4]))


def announced(message: Any, service: str) -> tuple[str, int] | None:
    """The new primary's address if ``message`` announces one for ``service``."""
    pair = switch(message, service)
    return None if pair is None else pair[1]


def _note(pool: Any, service: str, pair: tuple[tuple[str, int], tuple[str, int]]) -> None:
    """Tells the pool's Sentinel manager (felix_redis.connection's) that ``pair[0]`` was
    replaced, so it passes over a sentinel that has not heard yet; a manager of the
    caller's own (``Sentinel.master_for``) has no such memory."""
    note = getattr(getattr(pool, "sentinel_manager", None), "note_switch", None)
    if note is not None:
        note(service, *pair)


def _same(address: Any, want: tuple[str, int] | None) -> bool:
    return want is None or (address is not None and (str(address[0]), int(address[1])) == want)


class SentinelWatch:
    """The watch of a synchronous Sentinel client's pool (see the module's docstring):
    one daemon thread reading the channel of every sentinel."""

    def __init__(self, pool: Any) -> None:
        self.service: str = pool.service_name
        self.switches = 0
        self._sentinels: list[Any] = list(pool.sentinel_manager.sentinels)
        self._pool = weakref.ref(pool)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"felix-sentinel-watch-{self.service}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops the watch (its thread ends within about :data:`POLL_S`)."""
        self._stop.set()

    def _run(self) -> None:
        subs: list[Any] = [None] * len(self._sentinels)
        retry_at = [0.0] * len(self._sentinels)
        wait = POLL_S / max(1, len(self._sentinels))
        try:
            while not self._stop.is_set():
                for i, sentinel in enumerate(self._sentinels):
                    if self._stop.is_set():
                        return
                    if subs[i] is None:
                        if time.monotonic() < retry_at[i]:
                            continue
                        subs[i] = self._subscribe(sentinel)
                        if subs[i] is None:
                            retry_at[i] = time.monotonic() + RETRY_S
                        else:
                            self._look(None)  # what was announced while nobody listened
                        continue
                    try:
                        pair = switch(subs[i].get_message(timeout=wait), self.service)
                    except Exception as exc:  # that sentinel failed: subscribe again later
                        log.debug("sentinel watch of %s: %s", self.service, exc)
                        _close(subs[i])
                        subs[i], retry_at[i] = None, time.monotonic() + RETRY_S
                        continue
                    if pair is not None:
                        self.heard(pair)
                if all(sub is None for sub in subs):
                    self._stop.wait(wait)
        finally:
            for sub in subs:
                _close(sub)

    def heard(self, pair: tuple[tuple[str, int], tuple[str, int]]) -> None:
        """An announcement that the primary moved from ``pair[0]`` to ``pair[1]``."""
        self.switches += 1
        pool = self._pool()
        if pool is not None:
            _note(pool, self.service, pair)
        del pool
        self._look(pair[1])

    def _subscribe(self, sentinel: Any) -> Any:
        try:
            pubsub = sentinel.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(CHANNEL)
            return pubsub
        except Exception as exc:
            log.debug("sentinel watch of %s: %s", self.service, exc)
            return None

    def _look(self, want: tuple[str, int] | None) -> None:
        """Has the pool ask the sentinels for the primary, until they name ``want``."""
        deadline = time.monotonic() + LOOK_S
        while not self._stop.is_set():
            pool = self._pool()
            if pool is None:  # the client is gone
                self._stop.set()
                return
            address = None
            with contextlib.suppress(Exception):
                address = pool.get_master_address()
            del pool
            if _same(address, want) or time.monotonic() >= deadline:
                return
            self._stop.wait(LOOK_EVERY_S)


def _close(pubsub: Any) -> None:
    if pubsub is not None:
        with contextlib.suppress(Exception):
            pubsub.close()


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
        await asyncio.gather(*(self._follow(sentinel) for sentinel in self._sentinels))

    async def _follow(self, sentinel: Any) -> None:
        """Reads one sentinel's channel, subscribing again after a failure."""
        while True:
            pubsub = sentinel.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(CHANNEL)
                await self._look(None)
                while True:
                    pair = switch(await pubsub.get_message(timeout=POLL_S), self.service)
                    if pair is not None:
                        await self.heard(pair)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("sentinel watch of %s: %s", self.service, exc)
            finally:
                with contextlib.suppress(Exception):
                    closer = getattr(pubsub, "aclose", None) or pubsub.close
                    await closer()
            await asyncio.sleep(RETRY_S)

    async def heard(self, pair: tuple[tuple[str, int], tuple[str, int]]) -> None:
        """As :meth:`SentinelWatch.heard`."""
        self.switches += 1
        pool = self._pool()
        if pool is not None:
            _note(pool, self.service, pair)
        del pool
        await self._look(pair[1])

    async def _look(self, want: tuple[str, int] | None) -> None:
        deadline = time.monotonic() + LOOK_S
        while True:
            pool = self._pool()
            if pool is None:
                raise asyncio.CancelledError
            address = None
            with contextlib.suppress(Exception):
                address = await pool.get_master_address()
            del pool
            if _same(address, want) or time.monotonic() >= deadline:
                return
            await asyncio.sleep(LOOK_EVERY_S)
