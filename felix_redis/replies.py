"""Reading the scripts' replies: records, flat field lists, text."""

from __future__ import annotations

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


def parse_delivered(reply: list[Any], start: int, count: int, shard: int) -> list[Record]:
    """Records from a poll reply: [entry ID 'OFFSET-MS', attempts, key, payload]*."""
    out: list[Record] = []
    for i in range(start, start + 4 * count, 4):
        off, ms = reply[i].split(b"-")
        key = reply[i + 2]
        out.append(Record(shard, int(off), reply[i + 1], reply[i + 3],
                          None if key is None else key.decode("utf-8", "surrogateescape"), int(ms)))
    return out


def parse_records(reply: list[Any], start: int, count: int, shard: int) -> list[Record]:
    """Records from a read reply: [offset, publish ms, key, payload]* (attempts 0)."""
    out: list[Record] = []
    for i in range(start, start + 4 * count, 4):
        off, ms, key, payload = reply[i : i + 4]
        out.append(Record(shard, int(off), 0, payload, key_text(key), int(ms)))
    return out


def flat_dict(flat: list[Any]) -> dict[str, Any]:
    """A flat reply [field, value, ...] (HGETALL's shape) as a dict by field name."""
    return {as_text(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}


def stream_tails(reply: list[Any]) -> tuple[int, int]:
    """(first offset kept, tail) from a stream_info reply."""
    meta = flat_dict(reply[0])
    return int(meta["first"]), int(meta["tail"])
