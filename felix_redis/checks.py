"""Checks of what callers pass (payloads, lists, numbers, seconds) and of the record
references settles take (a Record, an Item, a claim string or a bare offset): each
refuses bad input with an InvalidArgument naming it, before anything is sent."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from felix_redis import constants as C
from felix_redis.errors import InvalidArgument
from felix_redis.keys import check_name
from felix_redis.models import DeadLetter, Published, Record, parse_claim

#: The largest offset a shard hands out (2**52: exact in a Lua number, a double).
MAX_OFFSET = 2**52


def as_bytes(payload: object, what: str = "payload") -> bytes:
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, str):
        return payload.encode("utf-8")
    if isinstance(payload, (bytearray, memoryview)):
        return bytes(payload)
    raise InvalidArgument(f"{what} must be bytes or str, got {type(payload).__name__}")


def check_list(value: object, what: str) -> list[Any]:
    """``value`` as a list, refusing str/bytes and Published (iterable, but never meant
    as a list: a Published would pass for the offsets (shard, offset))."""
    if isinstance(value, (str, bytes, bytearray, memoryview, Published)) or not isinstance(value, Iterable):
        raise InvalidArgument(f"{what} must be a list, got {type(value).__name__}")
    return list(value)


def check_streams(streams: object, weights: object = None) -> tuple[list[str], list[int] | None]:
    """The stream names of a group that polls one stream, or several in priority order
    (a list), and their ``weights`` (None: strict order; else one whole number from 1
    to ``MAX_STREAM_WEIGHT`` per stream)."""
    if isinstance(streams, str):
        names = [check_name(streams, "stream")]
    elif isinstance(streams, (list, tuple)):
        names = [check_name(s, "stream") for s in streams]
        if not names:
            raise InvalidArgument("streams must name at least one stream")
        if len(names) > C.MAX_PRIORITY_STREAMS:
            raise InvalidArgument(f"a group polls at most {C.MAX_PRIORITY_STREAMS} streams, got {len(names)}")
        if len(set(names)) != len(names):
            raise InvalidArgument(f"streams names a stream twice: {names}")
    else:
        raise InvalidArgument(f"stream name must be a string, or a list of them, got {type(streams).__name__}")
    if weights is None:
        return names, None
    if not isinstance(weights, (list, tuple)):
        raise InvalidArgument(f"weights must be a list of whole numbers, got {type(weights).__name__}")
    checked = [check_int(w, "weight", 1, C.MAX_STREAM_WEIGHT) for w in weights]
    if len(checked) != len(names):
        raise InvalidArgument(f"weights needs one weight per stream: {len(names)} stream(s), {len(checked)} weight(s)")
    return names, checked


def check_int(value: object, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{what} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidArgument(f"{what} must be between {lo} and {hi}, got {value}")
    return value


def seconds_to_ms(value: object, what: str, lo_ms: int, hi_ms: int, *, up: bool = False,
                  hi_text: str | None = None) -> int:
    """Seconds as whole ms in lo_ms..hi_ms (rounded, or with ``up`` rounded up: a delay
    never ends early); ``hi_text`` names the upper bound in the error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{what} must be a number of seconds, got {value!r}")
    if not math.isfinite(value):
        raise InvalidArgument(f"{what} must be a finite number of seconds, got {value}")
    if value < 0:
        raise InvalidArgument(f"{what} must not be negative, got {value}")
    ms = (math.ceil(value * 1000) if up else round(value * 1000)) if value <= hi_ms else hi_ms + 1
    if not lo_ms <= ms <= hi_ms:
        bounds = (f"{lo_ms / 1000:g} seconds and {hi_text}" if hi_text
                  else f"{lo_ms / 1000:g} and {hi_ms / 1000:g} seconds")
        raise InvalidArgument(f"{what} must be between {bounds}, got {value}")
    return ms


class Target:
    """A resolved record reference: shard, offset and (for claims) attempts."""

    __slots__ = ("attempts", "offset", "shard")

    def __init__(self, shard: int, offset: int, attempts: int | None) -> None:
        self.shard = shard
        self.offset = offset
        self.attempts = attempts


def resolve(ref: object, shard: int | None, *, need_attempts: bool) -> Target:
    """A Record, Item, claim string ``S:O:A`` or bare offset, checked against ``shard``."""
    record = getattr(ref, "record", ref)
    if isinstance(record, Record):
        target = Target(record.shard, record.offset, record.attempts or None)
    elif isinstance(ref, DeadLetter):
        target = Target(ref.shard, ref.offset, None)
    elif isinstance(ref, str):
        claim = parse_claim(ref, attempts_required=need_attempts)
        target = Target(claim.shard, claim.offset, claim.attempts)
    elif isinstance(ref, int) and not isinstance(ref, bool):
        if need_attempts:
            raise InvalidArgument(
                "this operation needs the claim (a Record or 'SHARD:OFFSET:ATTEMPTS'), "
                f"not a bare offset {ref}"
            )
        target = Target(shard if shard is not None else 0, check_int(ref, "offset", 0, MAX_OFFSET), None)
    else:
        raise InvalidArgument(f"expected a Record, claim string or offset, got {type(ref).__name__}")
    if shard is not None and target.shard != shard:
        raise InvalidArgument(f"record is from shard {target.shard}, not shard {shard}")
    if need_attempts and target.attempts is None:
        raise InvalidArgument("this operation needs the claim's attempts (SHARD:OFFSET:ATTEMPTS)")
    return target


def offsets_of(refs: Iterable[Any], shard: int) -> list[int]:
    """The offsets of ``refs`` on ``shard``, as :func:`resolve` would give them: plain
    ints and Records of that shard are taken as they are; anything else goes through
    resolve (which also gives the error for bad input)."""
    out: list[int] = []
    add = out.append
    for ref in refs:
        kind = type(ref)
        if kind is int and 0 <= ref <= MAX_OFFSET:
            add(ref)
        elif kind is Record and ref.shard == shard:
            add(ref.offset)
        else:
            add(resolve(ref, shard, need_attempts=False).offset)
    return out


def ack_offsets(refs: Iterable[Any], shard: int) -> list[int]:
    """The offsets of the records a poll acks (``ack=``): those of ``shard``, at most
    ``MAX_BATCH`` of them."""
    offsets = offsets_of(refs if type(refs) is list else check_list(refs, "ack"), shard)
    if len(offsets) > C.MAX_BATCH:
        raise InvalidArgument(f"a poll acks at most {C.MAX_BATCH} records at once, got {len(offsets)}")
    return offsets


def poll_ack_args(offsets: list[int]) -> list[Any]:
    """A poll's acks as the poll script takes them: consecutive offsets in order (a
    batch acked whole, the usual case) as one run ``'FIRST-LAST'``, which the script
    settles without a string or table per record; anything else one by one."""
    if len(offsets) > 1 and offsets == list(range(offsets[0], offsets[0] + len(offsets))):
        return [f"{offsets[0]}-{offsets[-1]}"]
    return offsets


#: 366 days, the longest delay or expiry a publish takes (ms).
MAX_TIME_AHEAD_MS = 366 * 24 * 3600 * 1000
#: Header limits (docs/concepts.md): names, count, bytes of names and values in all.
MAX_HEADERS = 64
MAX_HEADER_BYTES = 16384
_HEADER_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


@dataclass(frozen=True, slots=True)
class Extras:
    """A publish's delivery time, expiry and headers, as the publish script takes them
    (ARGV[5..7] of lua/publish.lua): ``deliver`` '' (at once), '+MS' (after the publish,
    server clock) or '@MS' (ms since the epoch); ``expires`` '' or MS after the publish;
    ``headers`` b'' or a JSON object."""

    deliver: str = ""
    expires: str = ""
    headers: bytes = b""

    @property
    def delayed(self) -> bool:
        return self.deliver != ""


def _ahead_ms(value: object, what: str, lo_ms: int) -> int:
    """Seconds ahead (a delay or an expiry) as whole ms, rounded up (never early)."""
    return seconds_to_ms(value, what, lo_ms, MAX_TIME_AHEAD_MS, up=True, hi_text="366 days")


def check_headers(headers: object) -> bytes:
    """Headers (a dict of str to str) as the JSON object a record stores; b'' for none."""
    if headers is None:
        return b""
    if not isinstance(headers, dict):
        raise InvalidArgument(f"headers must be a dict of str to str, got {type(headers).__name__}")
    if not headers:
        return b""
    if len(headers) > MAX_HEADERS:
        raise InvalidArgument(f"headers: at most {MAX_HEADERS} headers, got {len(headers)}")
    size = 0
    for name, value in headers.items():
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            raise InvalidArgument(
                f"header name {name!r} must be 1 to 128 characters of A-Z a-z 0-9 . _ -")
        if not isinstance(value, str):
            raise InvalidArgument(f"header {name!r} must have a str value, got {type(value).__name__}")
        try:
            size += len(name) + len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidArgument(f"header {name!r}: the value is not valid Unicode text") from None
    if size > MAX_HEADER_BYTES:
        raise InvalidArgument(f"headers hold at most {MAX_HEADER_BYTES} bytes of names and values, got {size}")
    return json.dumps(headers, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def publish_extras(delay: object, deliver_at: object, expires_in: object, headers: object) -> Extras | None:
    """The checked ``delay``/``deliver_at``/``expires_in``/``headers`` of a publish call;
    None when it has none (a plain publish)."""
    if delay is None and deliver_at is None and expires_in is None and not headers:
        if headers is not None and not isinstance(headers, dict):
            check_headers(headers)
        return None
    deliver = ""
    if delay is not None and deliver_at is not None:
        raise InvalidArgument("give either delay or deliver_at, not both")
    if delay is not None:
        deliver = f"+{_ahead_ms(delay, 'delay', 0)}"
    elif deliver_at is not None:
        if not isinstance(deliver_at, datetime):
            raise InvalidArgument(f"deliver_at must be a timezone-aware datetime, got {type(deliver_at).__name__}")
        if deliver_at.tzinfo is None or deliver_at.utcoffset() is None:
            raise InvalidArgument("deliver_at must be timezone-aware (a naive datetime has no definite time)")
        at_ms = math.ceil(deliver_at.timestamp() * 1000)
        # the server checks the 366 days against its own clock; far beyond is refused here
        if at_ms > time.time() * 1000 + MAX_TIME_AHEAD_MS + 86_400_000:
            raise InvalidArgument(f"deliver_at must be at most 366 days ahead, got {deliver_at.isoformat()}")
        deliver = f"@{max(0, at_ms)}"
    expires = "" if expires_in is None else str(_ahead_ms(expires_in, "expires_in", 1))
    return Extras(deliver, expires, check_headers(headers))


class _Keep:
    """The default of a setting ``group_configure`` leaves as it is."""

    def __repr__(self) -> str:
        return "KEEP"


#: ``group_configure(..., rate_limit=KEEP)``: the rate limit stays as it is.
KEEP: Any = _Keep()


def check_rate_limit(value: object) -> str:
    """A rate limit ``(count, per_seconds)`` as the scripts take it ('COUNT PER_MS');
    '' for none (None or (0, 0))."""
    if value is None:
        return ""
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or len(value) != 2:
        raise InvalidArgument(f"rate_limit must be (count, per_seconds) or None, got {value!r}")
    count, per = value
    if isinstance(count, bool) or not isinstance(count, int):
        raise InvalidArgument(f"rate_limit count must be an integer, got {count!r}")
    if count == 0 and per == 0:
        return ""
    if not 1 <= count <= 1_000_000:
        raise InvalidArgument(f"rate_limit count must be between 1 and 1000000, got {count}")
    if isinstance(per, bool) or not isinstance(per, (int, float)) or not math.isfinite(per):
        raise InvalidArgument(f"rate_limit per_seconds must be a finite number of seconds, got {per!r}")
    per_ms = round(per * 1000)
    if not 1 <= per_ms <= 86_400_000:
        raise InvalidArgument(f"rate_limit per_seconds must be between 0.001 and 86400 seconds, got {per}")
    return f"{count} {per_ms}"
