"""What the dashboard shows, read through :mod:`felix_redis.asyncio`: the streams the
Redis user may see, their groups' describes (sampled every few seconds into an
in-memory history for the charts), dead letters with payload previews, and a shard's
log. Nothing here knows HTTP; :mod:`felix_redis.dashboard.app` renders it."""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from felix_redis.asyncio import AsyncClient
from felix_redis.errors import ConnectionFailed, FelixError, NotFound, PermissionDenied
from felix_redis.models import DeadLetter, GroupInfo, Record, StreamInfo

log = logging.getLogger("felix_redis.dashboard")

T = TypeVar("T")
Where = tuple[str, str, str]

#: How many describes run at once while the overview is sampled (each one round trip
#: per stream and per group, the shards pipelined).
CONCURRENCY = 64
#: A sweep and the wait after it take at least this many times the sweep: sampling
#: spends at most 1/DUTY of the time (and of the Redis time it costs).
DUTY = 10
#: Bytes of a payload the pages show.
PREVIEW_BYTES = 4096
#: Dead letters one page lists (the count says how many there are).
DEAD_PAGE = 500
#: Records one page of a shard's log shows.
RECORDS_PAGE = 50
#: The series the group page charts, sampled from describe.
SERIES = ("lag", "unfinished", "in_flight", "dead", "oldest_unfinished_age_s")


def preview(payload: bytes, limit: int = PREVIEW_BYTES) -> tuple[str, bool, bool]:
    """(text, is_hex, cut): the first ``limit`` bytes as text when they are UTF-8, else
    as hex; the page escapes the text."""
    head, cut = payload[:limit], len(payload) > limit
    try:
        return head.decode("utf-8"), False, cut
    except UnicodeDecodeError as exc:
        if cut and exc.start >= len(head) - 3:  # a character split by the cut
            try:
                return head[:exc.start].decode("utf-8"), False, cut
            except UnicodeDecodeError:
                pass
        return head.hex(" "), True, cut


def error_text(exc: BaseException) -> str:
    """One line for the page: what failed, without the URL's password (the client's
    errors never carry one)."""
    if isinstance(exc, FelixError) or type(exc).__name__ == "ApiError":
        return " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


class History:
    """The last ``keep`` samples of one group's numbers: timestamps (float64) and one
    float32 array per series (exact up to 2**24, close enough for a chart above): 28
    bytes a sample, ~20 KB a group for an hour at 5 s."""

    __slots__ = ("keep", "series", "times")

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.times = array("d")
        self.series = {name: array("f") for name in SERIES}

    def add(self, at: float, info: GroupInfo) -> None:
        age = info.oldest_unfinished_age_ms
        values = {"lag": info.lag, "unfinished": info.unfinished, "in_flight": info.in_flight, "dead": info.dead,
                  "oldest_unfinished_age_s": (age or 0) / 1000}
        self.times.append(at)
        for name in SERIES:
            self.series[name].append(float(values[name]))
        if len(self.times) > self.keep:
            del self.times[0]
            for a in self.series.values():
                del a[0]

    def points(self, name: str) -> list[tuple[float, float]]:
        return list(zip(self.times, self.series[name], strict=True))


@dataclass
class GroupRow:
    group: str
    info: GroupInfo | None = None
    error: str | None = None


@dataclass
class StreamRow:
    where: Where
    info: StreamInfo | None = None
    groups: list[GroupRow] = field(default_factory=list)
    error: str | None = None


@dataclass
class Snapshot:
    """One sweep over every visible stream."""

    at: float  # time.time() when it was taken
    rows: list[StreamRow]
    error: str | None = None  # the listing itself failed
    took_s: float = 0.0


class Board:
    """The dashboard's view of Redis through one AsyncClient.

    ``streams``: the streams to show (None: every stream the user may list: every
    tenant's, else the ``tenant``'s registry, which is all a tenant's admin may read)."""

    def __init__(
        self, client: AsyncClient, *, tenant: str = "default", streams: Sequence[Where] | None = None,
        interval: float = 5.0, history_s: float = 3600.0,
    ) -> None:
        self.client = client
        self.tenant = tenant
        self.fixed = list(streams) if streams else None
        self.interval = interval
        self.history_s = history_s
        self.histories: dict[tuple[str, str, str, str], History] = {}
        self.snapshot: Snapshot | None = None
        self._sweeping: asyncio.Task[Snapshot] | None = None
        self._limit = asyncio.Semaphore(CONCURRENCY)
        self._roles: dict[tuple[str, str, str, str], tuple[float, bool]] = {}

    # -- listing and the overview

    async def streams(self) -> list[Where]:
        if self.fixed is not None:
            return self.fixed
        try:
            return await self.client.stream_list()
        except PermissionDenied:  # a tenant's user may read its own registry only
            return await self.client.stream_list(self.tenant)

    async def _limited(self, make: Callable[[], Awaitable[T]]) -> T:
        async with self._limit:
            return await make()

    async def _stream_row(self, where: Where) -> StreamRow:
        """The stream and its groups in two round trips (``stream_overview``)."""
        row = StreamRow(where)
        try:
            row.info, groups = await self._limited(lambda: self.client.stream_overview(*where))
        except (FelixError, OSError) as exc:
            row.error = error_text(exc)
            return row
        for name, got in groups.items():
            row.groups.append(GroupRow(name, error=error_text(got)) if isinstance(got, BaseException)
                              else GroupRow(name, got))
        return row

    async def sweep(self) -> Snapshot:
        """Describes every visible stream and group now (concurrently: the client
        pipelines what is in flight at once) and records each group's numbers."""
        started = time.monotonic()
        try:
            found = await self.streams()
        except (FelixError, OSError) as exc:
            snap = Snapshot(time.time(), [], error_text(exc), time.monotonic() - started)
        else:
            rows = list(await asyncio.gather(*(self._stream_row(w) for w in found)))
            snap = Snapshot(time.time(), rows, None, time.monotonic() - started)
            keep = max(2, int(self.history_s / self.interval))
            seen = set()
            for row in rows:
                for g in row.groups:
                    if g.info is not None:
                        key = (*row.where, g.group)
                        seen.add(key)
                        self.histories.setdefault(key, History(keep)).add(snap.at, g.info)
            for key in [k for k in self.histories if k not in seen and k[:3] not in {r.where for r in rows}]:
                del self.histories[key]  # the stream is gone
        self.snapshot = snap
        return snap

    async def overview(self, max_age: float | None = None) -> Snapshot:
        """The latest sweep if it is younger than ``max_age`` (default: the sampling
        interval), else a new one (concurrent callers share it)."""
        limit = self.interval if max_age is None else max_age
        snap = self.snapshot
        if snap is not None and time.time() - snap.at < limit:
            return snap
        if self._sweeping is None or self._sweeping.done():
            self._sweeping = asyncio.ensure_future(self.sweep())
        return await asyncio.shield(self._sweeping)

    async def sample_forever(self) -> None:
        """Sweeps every ``interval`` seconds (the charts' history) until cancelled; when a
        sweep takes long (many streams), it waits :data:`DUTY` times as long before the
        next, so sampling keeps to a tenth of the time (and of Redis' time it costs)."""
        while True:
            started = time.monotonic()
            try:
                await self.overview(max_age=self.interval / 2)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the sampler die: the pages report errors in place
                log.exception("dashboard: sampling failed")
            took = time.monotonic() - started
            await asyncio.sleep(max(0.5, self.interval - took, (DUTY - 1) * took))

    # -- one stream, one group

    async def stream(self, where: Where) -> StreamInfo:
        return await self.client.stream_describe(*where)

    async def stream_groups(self, where: Where) -> tuple[StreamInfo, dict[str, GroupInfo | FelixError]]:
        """The stream and its groups' describes (two round trips)."""
        return await self.client.stream_overview(*where)

    async def group(self, where: Where, group: str) -> GroupInfo:
        info = await self.client.group_describe(*where, group)
        key = (*where, group)
        history = self.histories.setdefault(key, History(max(2, int(self.history_s / self.interval))))
        if not history.times or time.time() - history.times[-1] >= self.interval / 2:
            history.add(time.time(), info)
        return info

    def history(self, where: Where, group: str) -> History | None:
        return self.histories.get((*where, group))

    async def consumers(self, where: Where, group: str) -> dict[str, list[str]]:
        return await self.client.group_consumers(*where, group)

    async def may_manage(self, where: Where, group: str) -> bool:
        """Whether this Redis user may redrive or discard the group's dead letters
        (the group.manage role); remembered for a minute."""
        key = (*where, group)
        known = self._roles.get(key)
        if known is not None and time.monotonic() - known[0] < 60:
            return known[1]
        try:
            held = await self.client.has_role(*where, "group.manage", group)
        except PermissionDenied:
            held = False
        self._roles[key] = (time.monotonic(), held)
        return held

    async def dead_letters(
        self, where: Where, group: str, *, reason: str | None = None, payloads: bool = True,
    ) -> tuple[list[tuple[DeadLetter, Record | None]], int]:
        """(dead letters with their records, how many there are in all); at most
        :data:`DEAD_PAGE`, only those whose reason starts with ``reason`` when given."""
        letters = [d for d in await self.client.group_dead_letters_all(*where, group)
                   if reason is None or d.reason.startswith(reason)]
        letters.sort(key=lambda d: (-d.dead_ms, d.shard, d.offset))
        total, letters = len(letters), letters[:DEAD_PAGE]
        records: list[Record | None] = [None] * len(letters)
        if payloads and letters:
            records = await self.client.read_at(*where, [(d.shard, d.offset) for d in letters])
        return list(zip(letters, records, strict=True)), total

    async def settle(self, where: Where, group: str, verb: str, claims: list[tuple[int, int]] | None) -> int:
        """Redrive or discard the given (shard, offset)s, or every dead letter (None):
        one script call per shard, each all-or-nothing for its shard."""
        act = self.client.group_redrive if verb == "redrive" else self.client.group_discard
        await self.client.group_describe(*where, group)  # an unknown group: NotFound before anything
        if claims is None:
            info = await self.client.stream_describe(*where)
            return sum([await act(*where, s, group, None) for s in range(info.shards)])
        by_shard: dict[int, list[int]] = {}
        for shard, offset in claims:
            by_shard.setdefault(shard, []).append(offset)
        info = await self.client.stream_describe(*where)
        for shard in by_shard:
            if shard >= info.shards:
                raise NotFound(f"stream {'/'.join(where)} has {info.shards} shard(s); shard {shard} does not exist")
        return sum([await act(*where, s, group, offsets) for s, offsets in sorted(by_shard.items())])

    async def records(self, where: Where, shard: int, start: int | None) -> tuple[StreamInfo, list[Record], int]:
        """(stream, up to :data:`RECORDS_PAGE` records of ``shard`` from ``start`` on,
        the start used): the log as subscribers see it; None starts at the last page."""
        info = await self.client.stream_describe(*where)
        if not 0 <= shard < info.shards:
            raise NotFound(f"stream {'/'.join(where)} has {info.shards} shard(s); shard {shard} does not exist")
        first, tail = info.firsts[shard], info.tails[shard]
        if start is None:
            start = max(first, tail - RECORDS_PAGE)
        start = max(start, first)
        found = await self.client.read(*where, shard, start, RECORDS_PAGE) if start < tail else []
        return info, found, start

    async def probe(self) -> Any:
        """PING through the client's connection (the health endpoint)."""
        try:
            return await self.client.redis.ping()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise ConnectionFailed(f"cannot reach Redis: {exc}") from None
