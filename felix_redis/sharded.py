"""One poll of a group across several shards, in plain steps (:class:`ShardedPoll`).

A round asks every chosen shard for a quota in one round trip (pass 1), then asks the
shards that had more, or that pass 1 left out, one at a time for what is still wanted
(pass 2). With nothing handed out and time left it blocks on every shard's wake points
at once, then runs another round. The rotating start keeps it fair: with every shard
busy, each is first in turn.
"""

from __future__ import annotations

import time
from typing import Any

from felix_redis.caches import Caches, StreamSettings
from felix_redis.constants import POLL_AGAIN_MAX
from felix_redis.errors import ConnectionFailed, FelixError, NotReplicated
from felix_redis.keys import StreamName
from felix_redis.models import Record
from felix_redis.plans import Batch, BlockAny, Eval, Plan, wake_points
from felix_redis.replies import parse_delivered

#: Failures after which a shard's calls may or may not have run: the poll hands out
#: what other shards leased (rather than let those leases lapse), or raises.
LOST = (ConnectionFailed, NotReplicated)


class ShardedPoll:
    """The poll of ``group`` on the ``chosen`` shards of stream ``name``, its arguments
    checked (:meth:`felix_redis.protocol.Core.sharded_poll`). ``reclaimed``: the shards
    this consumer took its own in-flight records back from already (the caller's set,
    updated); ``acks``: offsets to ack first, by shard (each rides on its shard's first
    call)."""

    def __init__(
        self, cache: Caches, name: StreamName, settings: StreamSettings, group: str, chosen: list[int],
        max_records: int, wait_ms: int, consumer: str | None, reclaim: bool, reclaimed: set[int],
        acks: dict[int, list[int]],
    ) -> None:
        self.cache, self.name, self.settings, self.group = cache, name, settings, group
        self.chosen, self.max_records, self.wait_ms = chosen, max_records, wait_ms
        self.consumer, self.reclaim, self.reclaimed, self.acks = consumer, reclaim, reclaimed, acks
        self.quota = max(1, max_records // len(chosen))
        self.context = f"group {group} on stream {name.path}"
        # what the current round gathered
        self.out: list[Record] = []
        self.points: dict[str, str] = {}
        self.block_ms = -1
        #: a shard handed out less than asked while something there is due now
        self.due_now = False

    def run(self, cursor: int) -> Plan[tuple[list[Record], int]]:
        """The records, and the cursor for the next poll (the shard that goes first)."""
        deadline = time.monotonic() + self.wait_ms / 1000
        shards = len(self.chosen)
        again = 0
        while True:
            order = [self.chosen[(cursor + i) % shards] for i in range(shards)]
            cursor = (cursor + 1) % shards
            self.out, self.points, self.block_ms, self.due_now = [], {}, -1, False
            first = order[: min(shards, self.max_records)]
            more = yield from self.first_pass(first)
            if more is not None:
                yield from self.second_pass(order[len(first):] + more)
            if self.out:
                return self.out, cursor
            if self.due_now and again < POLL_AGAIN_MAX:
                # a shard said something is due now (its scan stopped at its bound in a
                # long run of delayed records): another round at once, a bounded number
                again += 1
                continue
            if self.wait_ms <= 0:
                return self.out, cursor
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return [], cursor
            block_ms = left_ms if self.block_ms < 0 else min(self.block_ms, left_ms)
            yield BlockAny(list(self.points.items()), block_ms, self.context)

    def first_pass(self, shards: list[int]) -> Plan[list[int] | None]:
        """A quota from each of ``shards`` and the acks of shards it does not poll, all
        in one round trip. Returns the shards that may have more, or None when a shard's
        call failed and other shards handed out records (the round ends with those).
        Raises a failure of a call that carried acks (they may not have been applied),
        a failure with nothing handed out, and any other error."""
        calls = [self.poll_call(shard, self.quota) for shard in shards]
        carried = [len(c.args) > 3 for c in calls]
        calls += [self.ack_call(shard, offsets) for shard, offsets in self.acks.items()]
        carried += [True] * len(self.acks)
        self.acks.clear()
        replies = yield Batch(calls)
        failure: FelixError | None = None
        ack_failure: FelixError | None = None
        more = []
        for i, reply in enumerate(replies):
            if isinstance(reply, LOST):
                failure = failure or reply
                if carried[i]:
                    ack_failure = ack_failure or reply
            elif isinstance(reply, FelixError):
                raise reply
            elif i < len(shards) and self.take(shards[i], self.quota, reply):
                more.append(shards[i])
        if ack_failure is not None:
            raise ack_failure
        if failure is not None:
            if self.out:
                return None
            raise failure
        return more

    def second_pass(self, shards: list[int]) -> Plan[None]:
        """What is still wanted, from ``shards`` one at a time, until enough. A failed
        call ends the pass when records were handed out, else raises."""
        for shard in shards:
            want = self.max_records - len(self.out)
            if want <= 0:
                return
            try:
                self.take(shard, want, (yield self.poll_call(shard, want)))
            except LOST:
                if self.out:
                    return
                raise

    def poll_call(self, shard: int, want: int) -> Eval:
        """A group_poll of ``want`` records on ``shard``, with its acks, reclaiming the
        consumer's own records on its first poll of the shard."""
        first = self.reclaim and self.consumer is not None and shard not in self.reclaimed
        if first:
            self.reclaimed.add(shard)
        keys, context = self.cache.group_shard_keys(self.name, shard, self.group)
        args: list[Any] = [want, self.consumer or "", 1 if first else 0]
        if shard in self.acks:
            args += self.acks.pop(shard)
        return Eval("group_poll", keys, args, context, self.settings.replicas)

    def ack_call(self, shard: int, offsets: list[int]) -> Eval:
        keys, context = self.cache.group_shard_keys(self.name, shard, self.group)
        return Eval("group_ack", keys, offsets, context, self.settings.replicas)

    def take(self, shard: int, want: int, reply: list[Any]) -> bool:
        """Adds a poll reply's records and wake points; True when the shard may have more."""
        count = int(reply[4])
        self.out.extend(parse_delivered(reply, 5, count, shard))
        self.points.update(wake_points(self.cache.group_shard_keys(self.name, shard, self.group)[0], reply))
        due = int(reply[1])
        if due >= 0:
            until = max(1, due - int(reply[0]) + 1)
            self.block_ms = until if self.block_ms < 0 else min(self.block_ms, until)
            if count < want and due <= int(reply[0]):
                self.due_now = True
                return True
        return count == want
