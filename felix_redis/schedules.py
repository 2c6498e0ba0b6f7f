"""Recurring schedules: a payload published to a stream on a cron expression or every N
seconds (docs/schedules.md).

A schedule lives on the shard its records go to (that of its key, else of its name), in
two keys beside the log (``sched``, ``schedules``: docs/schedules.md). A *tick* publishes
what is due: per shard one script call reads the schedules due now (``schedule_due``),
the client works out each one's latest due time at or before now and its next one after
(cron in Python, :func:`cron_next_ms` / :func:`cron_latest_ms`), and one more call
publishes them (``schedule_fire``), each due time once however many tickers send it.

What this module holds: the cron and period arithmetic (pure functions of a time, so
they can be tested at any instant), the checks of a schedule's arguments, the values
handed back (:class:`Schedule`, :class:`Ticked`), and the plans both drivers run
(:func:`set_plan`, :func:`list_plan`, :func:`delete_plan`, :func:`tick_plan`), written as
:mod:`felix_redis.protocol` writes the others.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from functools import lru_cache
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from felix_redis.checks import as_bytes, check_headers
from felix_redis.errors import FelixError, InvalidArgument, NotFound
from felix_redis.keys import StreamName, check_name, check_record_key, shard_for_key
from felix_redis.models import Published
from felix_redis.plans import Batch, Eval, Plan
from felix_redis.replies import as_text

if TYPE_CHECKING:
    from felix_redis.protocol import Core

__all__ = [
    "MAX_EVERY_S",
    "TICK_MAX_S",
    "TICK_MIN_S",
    "Schedule",
    "Ticked",
    "check_cron",
    "check_timezone",
    "cron_latest_ms",
    "cron_next_ms",
    "cron_times",
    "delete_plan",
    "due_and_next",
    "list_plan",
    "schedule_keys",
    "set_plan",
    "tick_plan",
]

log = logging.getLogger(__name__)

#: The longest period of an every-schedule: 366 days, in seconds.
MAX_EVERY_S = 366 * 24 * 3600
#: Most schedules one schedule_due call returns; a tick of a shard with more due at once
#: takes another pair of calls per this many.
DUE_LIMIT = 2500
#: Most schedules one listing call returns (a shard with more is read in one call anyway:
#: the script's limit).
LIST_LIMIT = 10000
#: A worker's ticker (felix_redis._runtime) and ``felixctl scheduler`` look again after
#: the earliest next due time the last tick saw, but at least this long after it ...
TICK_MIN_S = 1.0
#: ... and at most this long after it (a schedule set meanwhile elsewhere is seen then).
TICK_MAX_S = 5.0
#: Rounds of a tick over a shard with more schedules due at once than DUE_LIMIT.
MAX_ROUNDS = 100
_UTC = dt_timezone.utc


# --------------------------------------------------------------------------- time


@lru_cache(maxsize=256)
def _zone(name: str) -> ZoneInfo:
    return ZoneInfo(name)


def check_timezone(value: object) -> str:
    """``value`` if it names an IANA time zone this machine knows (zoneinfo)."""
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"timezone must be an IANA time zone name such as 'Europe/Zurich', got {value!r}")
    try:
        _zone(value)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise InvalidArgument(f"timezone {value!r} is not a known IANA time zone (e.g. 'UTC', "
                              "'Europe/Zurich', 'America/New_York')") from None
    return value


def check_cron(value: object) -> str:
    """``value`` if it is a 5-field cron expression (minute hour day-of-month month
    day-of-week, as cronsim reads them) that fires at least once."""
    if not isinstance(value, str):
        raise InvalidArgument(f"cron must be a 5-field cron expression such as '0 3 * * *', got {value!r}")
    fields = value.split()
    if len(fields) != 5:
        raise InvalidArgument(
            f"cron must have 5 fields (minute hour day-of-month month day-of-week), got {len(fields)}: {value!r}")
    expr = " ".join(fields)
    try:
        it = CronSim(expr, datetime(2000, 1, 1))
        next(it)
    except CronSimError as exc:
        raise InvalidArgument(f"cron {value!r} is not a valid cron expression: {exc}") from None
    except StopIteration:
        raise InvalidArgument(f"cron {value!r} never fires") from None
    return expr


def _to_ms(local: datetime) -> int | None:
    """The instant (ms since the epoch) of a naive wall-clock time in ``local``'s zone
    (``local.tzinfo``), or None when the zone skips it (spring forward). A wall-clock
    time that occurs twice (fall back) is its first occurrence (fold=0)."""
    instant = local.replace(fold=0)
    back = instant.astimezone(_UTC).astimezone(instant.tzinfo)
    if back.replace(tzinfo=None) != instant.replace(tzinfo=None):
        return None  # does not exist on that day
    return int(instant.timestamp()) * 1000


def _wall(ms: int, zone: ZoneInfo) -> datetime:
    """The wall-clock time of an instant in ``zone`` (aware, with its fold)."""
    return datetime.fromtimestamp(ms // 1000, tz=_UTC).astimezone(zone)


def _candidates(expr: str, start: datetime, reverse: bool) -> Iterator[datetime]:
    """Naive wall-clock times cron ``expr`` names, strictly after (or, reversed, at or
    before) the naive ``start``; DST plays no part here."""
    naive = start.replace(tzinfo=None, fold=0, microsecond=0)
    if reverse:
        naive += timedelta(seconds=1)  # cronsim's reverse is strictly before its start
    try:
        yield from CronSim(expr, naive, reverse=reverse)
    except (CronSimError, StopIteration):
        return


def cron_next_ms(expr: str, timezone: str, after_ms: int) -> int | None:
    """The first time cron ``expr`` fires strictly after ``after_ms`` (ms since the epoch),
    evaluated in ``timezone``; None when it never fires again.

    The expression names wall-clock times. One that the zone skips (spring forward) does
    not fire; one that occurs twice (fall back) fires once, at its first occurrence."""
    zone = _zone(timezone)
    wall = _wall(after_ms, zone)
    for naive in _candidates(expr, wall, reverse=False):
        ms = _to_ms(naive.replace(tzinfo=zone))
        if ms is not None and ms > after_ms:
            return ms
    return None


def cron_latest_ms(expr: str, timezone: str, at_ms: int) -> int | None:
    """The last time cron ``expr`` fired at or before ``at_ms`` (ms since the epoch) in
    ``timezone``, by the rules of :func:`cron_next_ms`; None when it never did."""
    zone = _zone(timezone)
    wall = _wall(at_ms, zone)
    # The wall-clock times that map (first occurrence) to instants at or before at_ms are
    # those up to this one: in a repeated hour's second pass, the end of that hour.
    start = wall.replace(tzinfo=None)
    if wall.fold:
        first = wall.replace(fold=0)
        start += (first.utcoffset() or timedelta()) - (wall.utcoffset() or timedelta())
    for naive in _candidates(expr, start, reverse=True):
        ms = _to_ms(naive.replace(tzinfo=zone))
        if ms is not None and ms <= at_ms:
            return ms
    return None


def cron_times(expr: str, timezone: str, start: datetime, end: datetime) -> list[datetime]:
    """Every time cron ``expr`` fires in ``timezone`` after ``start`` and at or before
    ``end`` (timezone-aware datetimes), as aware datetimes in that zone: what a ticker
    running through that span publishes."""
    for when in (start, end):
        if when.tzinfo is None or when.utcoffset() is None:
            raise InvalidArgument("start and end must be timezone-aware datetimes")
    expr, zone = check_cron(expr), _zone(check_timezone(timezone))
    out: list[datetime] = []
    at, stop = math.floor(start.timestamp() * 1000), math.floor(end.timestamp() * 1000)
    while (nxt := cron_next_ms(expr, timezone, at)) is not None and nxt <= stop:
        out.append(_wall(nxt, zone))
        at = nxt
    return out


def due_and_next(
    *, cron: str | None, every_ms: int | None, timezone: str, set_ms: int, now_ms: int,
) -> tuple[int | None, int | None]:
    """The latest due time at or before ``now_ms`` and after ``set_ms`` (None: none) and
    the first due time after ``now_ms`` (None: never), for a schedule set at ``set_ms``:
    a cron expression in ``timezone``, or every ``every_ms`` from ``set_ms`` on. A tick
    that missed several due times publishes only the latest (the gap rule)."""
    if every_ms is not None:
        if now_ms < set_ms + every_ms:
            return None, set_ms + every_ms
        k = (now_ms - set_ms) // every_ms
        return set_ms + k * every_ms, set_ms + (k + 1) * every_ms
    assert cron is not None
    latest = cron_latest_ms(cron, timezone, now_ms)
    return (latest if latest is not None and latest > set_ms else None), cron_next_ms(cron, timezone, now_ms)


# --------------------------------------------------------------------------- values


def _ms_datetime(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=_UTC)


@dataclass(frozen=True)
class Schedule:
    """One recurring schedule, as :meth:`Client.schedule_list` reads it.

    ``cron`` (a 5-field expression evaluated in ``timezone``) or ``every`` (seconds) is
    set, the other None. ``next_at``: its next due time (None: the expression never fires
    again); ``last_at``: the last due time published and ``last_offset`` that record's
    offset on ``shard`` (None before the first). Times are timezone-aware (UTC)."""

    name: str
    cron: str | None
    every: float | None
    timezone: str
    next_at: datetime | None
    last_at: datetime | None
    last_offset: int | None
    shard: int = 0
    key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    payload: bytes = b""


class Ticked(list[Published]):
    """What :meth:`Client.schedule_tick` returns: the records it published (a list of
    :class:`Published`), and ``next_at``, the earliest due time after the tick among the
    stream's schedules (None: none), with ``wait_s``, how long from the tick that is by
    the server's clock (for a ticker deciding when to look again)."""

    next_at: datetime | None = None
    wait_s: float | None = None


@dataclass
class _Spec:
    """A schedule's arguments, checked, as the set script takes them."""

    name: str
    payload: bytes
    cron: str | None
    every_ms: int | None
    timezone: str
    key: bytes | None
    headers: bytes
    spec: str


def check_schedule(
    name: object, payload: object, cron: object, every: object, timezone: object, key: object, headers: object,
) -> _Spec:
    """The checked arguments of schedule_set; InvalidArgument naming the bad one."""
    check_name(name, "schedule")
    assert isinstance(name, str)
    raw = as_bytes(payload)
    if (cron is None) == (every is None):
        raise InvalidArgument("give exactly one of cron and every")
    zone = check_timezone(timezone)
    every_ms: int | None = None
    every_value: float | None = None
    expr: str | None = None
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, (int, float)):
            raise InvalidArgument(f"every must be a number of seconds (>= 1), got {every!r}")
        if not math.isfinite(every):
            raise InvalidArgument(f"every must be a finite number of seconds, got {every}")
        if not 1 <= every <= MAX_EVERY_S:
            raise InvalidArgument(f"every must be between 1 and {MAX_EVERY_S} seconds (366 days), got {every}")
        every_ms = round(every * 1000)
        every_value = int(every) if float(every).is_integer() else float(every)
    else:
        expr = check_cron(cron)
    raw_key = None if key is None else check_record_key(key)
    header_bytes = check_headers(headers)
    spec = json.dumps({
        "cron": expr, "every": every_value, "timezone": zone,
        "key": None if raw_key is None else raw_key.decode("utf-8", "replace"),
        "headers": json.loads(header_bytes) if header_bytes else None,
    }, separators=(",", ":"))
    if len(spec.encode()) > 4096:
        raise InvalidArgument("the schedule's spec (cron, timezone, key and headers) is over 4096 bytes as JSON; "
                              "use fewer or shorter headers")
    return _Spec(name, raw, expr, every_ms, zone, raw_key, header_bytes, spec)


def schedule_keys(name: StreamName, shard: int) -> list[str]:
    """``[sched, schedules]`` of one shard (docs/schedules.md)."""
    base = name.base(shard)
    return [f"{base}:sched", f"{base}:schedules"]


def _fire_keys(name: StreamName, shard: int) -> list[str]:
    base = name.base(shard)
    return [f"{base}:sched", f"{base}:schedules", f"{base}:meta", f"{base}:log", f"{base}:conf"]


def _home(spec_name: str, key: bytes | None, shards: int) -> int:
    """The shard a schedule and its records live on: its key's, else its name's."""
    return shard_for_key(key if key is not None else spec_name.encode(), shards)


def _state(text: Any) -> tuple[int, int, int | None, int | None] | None:
    """V, A, LAST, OFFSET of a state 'V A LAST OFFSET' (lua/includes/schedules.lua)."""
    if text is None:
        return None
    parts = as_text(text).split(" ")
    if len(parts) != 4 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    last = int(parts[2]) if parts[2].isdigit() else None
    offset = int(parts[3]) if parts[3].isdigit() else None
    return int(parts[0]), int(parts[1]), last, offset


def _score(text: Any) -> int | None:
    value = float(as_text(text))
    return None if math.isinf(value) else int(value)


# --------------------------------------------------------------------------- plans


def set_plan(
    core: Core, tenant: str, namespace: str, stream: str, name: str, payload: object, *,
    cron: object, every: object, timezone: object, key: object, headers: object,
) -> Plan[None]:
    """Creates or replaces schedule ``name``: checked in full, then written on the shard
    its records go to; a schedule of that name on another shard (set with another key)
    is removed first."""
    sname = core.cache.name(tenant, namespace, stream)
    spec = check_schedule(name, payload, cron, every, timezone, key, headers)
    settings = core.cache.fresh_settings(sname.path) or (yield from core.settings(sname))
    sname = core.cache.laid(sname, settings)
    if len(spec.payload) > settings.max_payload:
        raise InvalidArgument(f"stream {sname.path}: the payload is {len(spec.payload)} bytes; this stream "
                              f"accepts at most {settings.max_payload}")
    home = _home(spec.name, spec.key, settings.shards)
    context = f"stream {sname.path} schedule {spec.name}"
    first = b""
    if spec.cron is not None:
        # the first due time after the server's now (read on the schedule's shard)
        reply = yield Eval("schedule_due", schedule_keys(sname, home), ["none", 1], context)
        now = int(reply[0])
        nxt = cron_next_ms(spec.cron, spec.timezone, now)
        if nxt is None:
            raise InvalidArgument(f"cron {spec.cron!r} never fires again")
        first = str(nxt).encode()
    for shard in range(settings.shards):
        if shard != home:
            yield Eval("schedule_delete", schedule_keys(sname, shard), [spec.name], context, settings.replicas)
    every_arg = b"" if spec.every_ms is None else str(spec.every_ms).encode()
    yield Eval(
        "schedule_set", [*schedule_keys(sname, home), sname.conf_key(home)],
        [spec.name, spec.spec, every_arg, first, spec.key or b"", spec.headers, spec.payload],
        context, settings.replicas,
    )


def delete_plan(core: Core, tenant: str, namespace: str, stream: str, name: str) -> Plan[None]:
    """Removes schedule ``name`` from every shard; NotFound when no shard held it."""
    sname = core.cache.name(tenant, namespace, stream)
    check_name(name, "schedule")
    settings = yield from core.settings(sname)
    sname = core.cache.laid(sname, settings)
    context = f"stream {sname.path} schedule {name}"
    removed = 0
    for shard in range(settings.shards):
        removed += int((yield Eval("schedule_delete", schedule_keys(sname, shard), [name], context,
                                   settings.replicas)))
    if not removed:
        raise NotFound(f"stream {sname.path} has no schedule {name}")


def list_plan(core: Core, tenant: str, namespace: str, stream: str) -> Plan[list[Schedule]]:
    """Every schedule of the stream, by name."""
    sname = core.cache.name(tenant, namespace, stream)
    settings = yield from core.settings(sname)
    sname = core.cache.laid(sname, settings)
    out: list[Schedule] = []
    for shard in range(settings.shards):
        reply = yield Eval("schedule_due", schedule_keys(sname, shard), ["all", LIST_LIMIT],
                           f"stream {sname.path} shard {shard}")
        rows = reply[3:]
        for i in range(0, len(rows), 7):
            schedule = _listed(shard, rows[i:i + 7])
            if schedule is not None:
                out.append(schedule)
    return sorted(out, key=lambda s: s.name)


def _listed(shard: int, row: list[Any]) -> Schedule | None:
    name, score, spec_text, state_text, payload, key, headers = row
    state = _state(state_text)
    if spec_text is None or state is None:
        return None  # a schedule half written by hand
    try:
        spec = json.loads(as_text(spec_text))
    except ValueError:
        return None
    _, _, last, offset = state
    return Schedule(
        name=as_text(name), cron=spec.get("cron"), every=spec.get("every"), timezone=spec.get("timezone", "UTC"),
        next_at=_ms_datetime(_score(score)), last_at=_ms_datetime(last), last_offset=offset, shard=shard,
        key=None if key is None else as_text(key),
        headers=json.loads(as_text(headers)) if headers else {},
        payload=bytes(payload) if payload is not None else b"",
    )


def _quad(row: list[Any], now: int) -> list[Any] | None:
    """The schedule_fire quad (name, version, due, next) of one due schedule, or None
    when its spec cannot be read (written by hand, or a zone this machine lacks)."""
    name, _score_text, spec_text, state_text = row
    state = _state(state_text)
    if spec_text is None or state is None:
        return None
    version, set_ms, _, _ = state
    try:
        spec = json.loads(as_text(spec_text))
        every = spec.get("every")
        due, nxt = due_and_next(
            cron=spec.get("cron"), every_ms=None if every is None else round(float(every) * 1000),
            timezone=spec.get("timezone") or "UTC", set_ms=set_ms, now_ms=now)
    except (ValueError, TypeError, AssertionError, ZoneInfoNotFoundError, OSError) as exc:
        log.warning("schedule %s cannot be evaluated here, left as it is: %s", as_text(name), exc)
        return None
    return [name, version, due or 0, "inf" if nxt is None else nxt]


def _maybe_trim(core: Core, sname: StreamName, shard: int) -> Plan[None]:
    """After a tick published on a shard of a stream with retention: its trim, at most once
    a second per shard by this client (best effort, as after a publish)."""
    slot = (sname.path, shard)
    now = time.monotonic()
    if now - core.retention.last_trim.get(slot, 0.0) < 1.0:
        return
    core.retention.last_trim[slot] = now
    with contextlib.suppress(FelixError):
        yield from core.retention.trim_shard(sname, shard)


def tick_plan(core: Core, tenant: str, namespace: str, stream: str) -> Plan[Ticked]:
    """Publishes every due time of the stream's schedules that is due now: per round one
    schedule_due call per shard, then one schedule_fire call per shard that has some due,
    each round a Batch (one round trip where the deployment allows). Safe to run any
    number of times at once. On a stream with retention, a shard it published on is
    trimmed too (at most once a second), as a publish would."""
    sname = core.cache.name(tenant, namespace, stream)
    settings = core.cache.fresh_settings(sname.path) or (yield from core.settings(sname))
    sname = core.cache.laid(sname, settings)
    published = Ticked()
    earliest: int | None = None
    wait_ms: int | None = None
    pending = list(range(settings.shards))
    for _ in range(MAX_ROUNDS):
        if not pending:
            break
        replies = yield Batch([
            Eval("schedule_due", schedule_keys(sname, shard), ["due", DUE_LIMIT], f"stream {sname.path} shard {shard}")
            for shard in pending])
        fires: list[tuple[int, Eval, list[list[Any]]]] = []
        more: list[int] = []
        for shard, reply in zip(pending, replies, strict=True):
            if isinstance(reply, FelixError):
                raise reply
            now = int(reply[0])
            if reply[1]:
                after = _score(reply[1])
                if after is not None and (earliest is None or after < earliest):
                    earliest, wait_ms = after, after - now
            if int(reply[2]):
                more.append(shard)
            rows = reply[3:]
            quads = [q for i in range(0, len(rows), 4) if (q := _quad(rows[i:i + 4], now)) is not None]
            for q in quads:
                if q[3] != "inf" and (earliest is None or q[3] < earliest):
                    earliest, wait_ms = q[3], q[3] - now
            if quads:
                args = [x for q in quads for x in q]
                fires.append((shard, Eval("schedule_fire", _fire_keys(sname, shard), args,
                                          f"stream {sname.path} shard {shard}", settings.replicas), quads))
        if fires:
            results = yield Batch([op for _, op, _ in fires])
            failed: FelixError | None = None
            trims: list[int] = []
            for (shard, _, _), result in zip(fires, results, strict=True):
                if isinstance(result, FelixError):
                    failed = failed or result
                    continue
                new = [Published(shard, int(x)) for x in result if int(x) >= 0]
                published.extend(new)
                if new and (settings.max_len or settings.max_age):
                    trims.append(shard)
            for shard in trims:
                yield from _maybe_trim(core, sname, shard)
            if failed is not None:
                raise failed
        pending = more
    published.next_at = _ms_datetime(earliest)
    published.wait_s = None if wait_ms is None else max(0.0, wait_ms / 1000)
    return published
