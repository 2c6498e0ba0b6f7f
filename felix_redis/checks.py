"""Checks of what callers pass (payloads, lists, numbers, seconds) and of the record
references settles take (a Record, an Item, a claim string or a bare offset): each
refuses bad input with an InvalidArgument naming it, before anything is sent."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from felix_redis import constants as C
from felix_redis.errors import InvalidArgument
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


def check_int(value: object, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{what} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidArgument(f"{what} must be between {lo} and {hi}, got {value}")
    return value


def seconds_to_ms(value: object, what: str, lo_ms: int, hi_ms: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{what} must be a number of seconds, got {value!r}")
    if not math.isfinite(value):
        raise InvalidArgument(f"{what} must be a finite number of seconds, got {value}")
    if value < 0:
        raise InvalidArgument(f"{what} must not be negative, got {value}")
    ms = round(value * 1000) if value <= hi_ms else hi_ms + 1
    if not lo_ms <= ms <= hi_ms:
        raise InvalidArgument(
            f"{what} must be between {lo_ms / 1000:g} and {hi_ms / 1000:g} seconds, got {value}"
        )
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
