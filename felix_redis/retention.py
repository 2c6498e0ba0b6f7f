"""Bounded retention: when a publish trims its shard, and the trim itself."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from felix_redis.caches import StreamSettings
from felix_redis.errors import Conflict, FelixError
from felix_redis.keys import GROUP_ROLES, StreamName
from felix_redis.plans import Cmd, Eval, Plan
from felix_redis.replies import as_text

#: Seconds between two prunes of a shard's due index by one client (maybe_prune).
PRUNE_EVERY_S = 60.0

#: The keys of a group stream_trim takes: the group hash and its redo set (owed records).
TRIM_ROLES = ("group", "redo")


def trim_keys(name: StreamName, shard: int, group: str) -> list[str]:
    """The keys of ``group`` on ``shard`` that stream_trim takes (:data:`TRIM_ROLES`)."""
    keys = name.group_key_list(shard, group)
    return [keys[GROUP_ROLES.index(role)] for role in TRIM_ROLES]


class Retention:
    """When publishes trim a shard with bounded retention (``maybe_trim``: after the
    log outgrew the limit by a slack, or once a second for an age limit), and the trim
    (``trim_shard``). Remembers when it last trimmed each shard."""

    def __init__(self) -> None:
        #: (stream path, shard) -> monotonic time of its last trim by this client
        self.last_trim: dict[tuple[str, int], float] = {}
        #: (stream path, shard) -> monotonic time of its last due index prune
        self.last_prune: dict[tuple[str, int], float] = {}

    def maybe_trim(self, name: StreamName, settings: StreamSettings, shard: int, reply: list[Any]) -> Plan[None]:
        """After a publish: trim the shard once it outgrew its retention by a slack of
        10 % (at most 1000 records), or, for an age limit, at most once a second."""
        if not (settings.max_len or settings.max_age):
            return
        # reply[4]: meta's 'first', a hint a publisher may have deleted or garbled by
        # hand; then the trim (which reads the first record kept from the log) is due
        hint = "" if reply[4] is None else as_text(reply[4])
        first = int(hint) if hint.isascii() and hint.isdigit() else 0
        kept = int(reply[0]) + int(reply[1]) - first
        due = settings.max_len and kept > settings.max_len + max(1, min(1000, settings.max_len // 10))
        if settings.max_age and not due:
            last = self.last_trim.get((name.path, shard), 0.0)
            due = time.monotonic() - last >= 1.0
        if due:
            self.last_trim[(name.path, shard)] = time.monotonic()
            # best effort: the next publish (or stream_trim) tries again
            with contextlib.suppress(FelixError):
                yield from self.trim_shard(name, shard)

    def maybe_prune(self, name: StreamName, shard: int) -> Plan[None]:
        """After a delayed publish: at most once a minute per shard, a trim, which also
        prunes the shard's due index of what every group has passed (so a stream without
        retention does not keep its delayed records' index entries for ever)."""
        last = self.last_prune.get((name.path, shard))
        now = time.monotonic()
        if last is not None and now - last < PRUNE_EVERY_S:
            return
        self.last_prune[(name.path, shard)] = now
        if last is None:
            return  # the first delayed publish seen: prune from the next one a minute on
        with contextlib.suppress(FelixError):
            yield from self.trim_shard(name, shard)

    def trim_shard(self, name: StreamName, shard: int) -> Plan[int]:
        groups_key = name.groups_key(shard)
        for attempt in range(10):
            groups = sorted(as_text(g) for g in (yield Cmd("SMEMBERS", groups_key, key=groups_key)))
            keys = name.info_keys(shard)
            for group in groups:
                keys += trim_keys(name, shard, group)
            keys.append(name.due_key(shard))
            try:
                reply = yield Eval("stream_trim", keys, [len(groups), *groups], f"stream {name.path} shard {shard}")
                return int(reply[0])
            except Conflict:
                if attempt == 9:
                    raise
        return 0
