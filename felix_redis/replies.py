"""Reading the scripts' replies: records, flat field lists, text."""

from __future__ import annotations

import json
from typing import Any

from felix_redis.models import Record


def as_text(value: Any) -> str:
    """A reply value as text (bytes decoded, bad UTF-8 replaced)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def key_text(value: Any) -> str | None:
    """A record key from a reply (None: no key); bytes that are no UTF-8 survive."""
    if value is None:
        return None
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


def decode_headers(raw: Any) -> dict[str, str] | None:
    """A record's headers from its h field (a JSON object of strings, as the publish
    script checked it); a value that is no such object (written by hand) is kept whole
    under the name ``"_raw"`` rather than lost or raised."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return value
    return {"_raw": as_text(raw)}


def _ms(raw: Any) -> int | None:
    """A due or expiry time; None when absent (the script passes only plain decimals)."""
    return int(raw) if isinstance(raw, (bytes, str)) and raw.isdigit() else None


def _extended(shard: int, off: int, attempts: int, payload: bytes, slot: list[Any], ms: int) -> Record:
    """A record whose reply carries {key, headers, due ms, expiry ms} in the key's place."""
    if len(slot) == 4:
        key, h, d, x = slot
    else:
        key, h, d, x = (list(slot) + [None] * 4)[:4]
    return Record(shard, off, attempts, payload, None if key is None else key_text(key), ms,
                  None if h is None else decode_headers(h), None if d is None else _ms(d),
                  None if x is None else _ms(x))


def parse_delivered(reply: list[Any], start: int, count: int, shard: int) -> list[Record]:
    """Records from a poll reply: [entry ID 'OFFSET-MS', attempts, key, payload]* (the key's
    place holds [key, headers, due, expiry] for a record with any of the last three, or
    only the due ms, an integer, for a delayed record with none of the others), where
    a plain record's first delivery is only [entry ID, payload]: its second slot is bytes,
    not an integer (lua/group_poll.lua)."""
    out: list[Record] = []
    append = out.append
    i = start
    for _ in range(count):
        off, ms = reply[i].split(b"-")
        second = reply[i + 1]
        if type(second) is bytes:
            append(Record(shard, int(off), 1, second, None, int(ms)))
            i += 2
            continue
        key = reply[i + 2]
        if type(key) is list:
            append(_extended(shard, int(off), second, reply[i + 3], key, int(ms)))
        elif type(key) is int:  # a delayed record with no key, headers nor expiry: its due ms
            append(Record(shard, int(off), second, reply[i + 3], None, int(ms), None, key))
        else:
            append(Record(shard, int(off), second, reply[i + 3],
                          None if key is None else key.decode("utf-8", "surrogateescape"), int(ms)))
        i += 4
    return out


def parse_records(reply: list[Any], start: int, count: int, shard: int) -> list[Record]:
    """Records from a read reply: [offset, publish ms, key, payload]* (attempts 0; the
    key's place as in :func:`parse_delivered`)."""
    out: list[Record] = []
    for i in range(start, start + 4 * count, 4):
        off, ms, key, payload = reply[i : i + 4]
        if type(key) is list:
            out.append(_extended(shard, int(off), 0, payload, key, int(ms)))
            continue
        out.append(Record(shard, int(off), 0, payload, key_text(key), int(ms)))
    return out


def flat_dict(flat: list[Any]) -> dict[str, Any]:
    """A flat reply [field, value, ...] (HGETALL's shape) as a dict by field name."""
    return {as_text(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}


def stream_tails(reply: list[Any]) -> tuple[int, int]:
    """(first offset kept, tail) from a stream_info reply."""
    meta = flat_dict(reply[0])
    return int(meta["first"]), int(meta["tail"])
