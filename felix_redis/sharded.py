"""One poll of a group across several shards, and across several streams, in plain steps
(:class:`ShardedPoll`).

A round asks every chosen shard of a stream for a quota in one round trip (pass 1),
then asks the shards that had more, or that pass 1 left out, one at a time for what is
still wanted (pass 2). Over several streams a round takes them in turn, each only for
what the streams before it could not fill: in the order given (strict), or, with
weights, led by each stream in turn for as many polls as its weight (so that with every
stream busy the hand-outs follow the weights, none starves, and one poll's acks ride on
the next poll of the same stream, not on a call of their own). With
nothing handed out and time left it blocks on every shard's wake points, of every
stream, at once, then runs another round. The rotating start keeps each stream fair
across its shards: with every shard busy, each is first in turn.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from felix_redis.caches import Caches, StreamSettings
from felix_redis.constants import POLL_AGAIN_MAX
from felix_redis.errors import ConnectionFailed, FelixError, NotReplicated
from felix_redis.keys import StreamName
from felix_redis.models import Record
from felix_redis.plans import Batch, BlockAny, Eval, Plan, wake_points
from felix_redis.replies import parse_delivered

log = logging.getLogger("felix_redis")

#: Failures after which a shard's calls may or may not have run: the poll hands out
#: what other shards leased (rather than let those leases lapse), or raises.
LOST = (ConnectionFailed, NotReplicated)


class PollState:
    """What a group keeps from one poll to the next: per stream (by index), the shard
    that goes first and the shards this consumer took its own in-flight records back
    from; for the weighted order, the stream that leads and the polls it has left."""

    __slots__ = ("cursors", "lead", "left", "reclaimed")

    def __init__(self, streams: int) -> None:
        self.cursors = [0] * streams
        self.reclaimed: list[set[int]] = [set() for _ in range(streams)]
        self.lead = -1
        self.left = 0


class Source:
    """One stream of a poll: its index in the group's list, name, settings, the shards
    to poll, and the offsets to ack first, by shard (each rides on its shard's first
    call; the rest go with the poll's first round trip)."""

    __slots__ = ("acks", "chosen", "index", "name", "settings")

    def __init__(
        self, index: int, name: StreamName, settings: StreamSettings, chosen: list[int], acks: dict[int, list[int]],
    ) -> None:
        self.index, self.name, self.settings, self.chosen, self.acks = index, name, settings, chosen, acks


class ShardedPoll:
    """The poll of ``group`` on ``sources`` (streams, in priority order), its arguments
    checked (:meth:`felix_redis.protocol.Core.sharded_poll`). ``weights``: None for
    strict order, else one positive weight per source. ``state``: the group's
    :class:`PollState`, updated."""

    def __init__(
        self, cache: Caches, group: str, sources: list[Source], max_records: int, wait_ms: int,
        consumer: str | None, reclaim: bool, state: PollState, weights: list[int] | None = None,
    ) -> None:
        self.cache, self.group, self.sources = cache, group, sources
        self.max_records, self.wait_ms = max_records, wait_ms
        self.consumer, self.reclaim, self.state, self.weights = consumer, reclaim, state, weights
        paths = ", ".join(source.name.path for source in sources)
        self.context = f"group {group} on stream{'s' if len(sources) > 1 else ''} {paths}"
        # what the current round gathered: records per source (by index), how many
        self.out: list[list[Record]] = [[] for _ in sources]
        self.count = 0
        self.points: dict[str, str] = {}
        self.block_ms = -1
        #: a shard handed out less than asked while something there is due now
        self.due_now = False

    def run(self) -> Plan[list[list[Record]]]:
        """The records, per source (by index)."""
        deadline = time.monotonic() + self.wait_ms / 1000
        again = 0
        while True:
            self.out, self.count = [[] for _ in self.sources], 0
            self.points, self.block_ms = {}, -1
            due_now = False
            order = self.order()
            for turn, source in enumerate(order):
                ended = yield from self.take_from(source, turn, last=turn == len(order) - 1)
                due_now = due_now or self.due_now
                if turn == 0 and not self.out[source.index] and self.weights is not None:
                    self.state.left = 0  # a lead with nothing to hand out gives up the rest of its run
                if ended:
                    break
            if self.count:
                return self.out
            if due_now and again < POLL_AGAIN_MAX:
                # a shard said something is due now (its scan stopped at its bound in a
                # long run of delayed records): another round at once, a bounded number
                again += 1
                continue
            if self.wait_ms <= 0:
                return self.out
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return self.out
            block_ms = left_ms if self.block_ms < 0 else min(self.block_ms, left_ms)
            yield BlockAny(list(self.points.items()), block_ms, self.context)

    def take_from(self, source: Source, turn: int, last: bool) -> Plan[bool]:
        """What is still wanted, from ``source`` (the ``turn``-th of the round): its
        first pass, then its second. A stream that said something is due now (its scan
        stopped at its bound in a long run of delayed records) is asked again, a bounded
        number of times, before a later stream (``last``: there is none) gets anything.
        Returns True when the round ends: enough, or a call failed with records in hand.
        A failure of a later stream while earlier ones' records are leased (its group
        missing, a permission denied) ends the round with those records, logged: it is
        raised by a poll that has nothing else to hand out."""
        for again in range(POLL_AGAIN_MAX + 1):
            want = self.max_records - self.count
            if want <= 0:
                return True
            self.due_now = False
            shards = self.rotate(source)
            first = shards[: min(len(shards), want)]
            quota = max(1, want // len(source.chosen))
            try:
                more = yield from self.first_pass(source, first, quota, carry_all=turn == 0 and again == 0)
                if more is None:
                    return True  # a call failed and others handed out records: the round ends with those
                yield from self.second_pass(source, shards[len(first):] + more)
            except FelixError as exc:
                if turn == 0 or not self.count:
                    raise
                log.warning("%s: stream %s failed, handing out what the streams before it gave: %s",
                            self.context, source.name.path, exc)
                return True
            if last or not self.due_now or self.count >= self.max_records:
                return False
        return False

    def order(self) -> list[Source]:
        """The sources in this round's order: as given (strict), or led by each stream
        in turn for as many rounds as its weight (a run; it ends early when the lead
        has nothing to hand out), the others after the lead by weight. So any
        ``sum(weights)`` rounds in a row with every stream busy are led by each stream
        exactly its weight's number of times."""
        weights = self.weights
        if weights is None or len(self.sources) == 1:
            return self.sources
        state = self.state
        if state.left <= 0:
            state.lead = (state.lead + 1) % len(weights)
            state.left = weights[state.lead]
        state.left -= 1
        lead = state.lead
        rest = sorted((s for s in self.sources if s.index != lead), key=lambda s: -weights[s.index])
        return [self.sources[lead], *rest]

    def rotate(self, source: Source) -> list[int]:
        """The source's shards from its cursor on; the cursor moves one on."""
        chosen, cursors = source.chosen, self.state.cursors
        cursor = cursors[source.index]
        cursors[source.index] = (cursor + 1) % len(chosen)
        return [chosen[(cursor + i) % len(chosen)] for i in range(len(chosen))]

    def first_pass(self, source: Source, shards: list[int], quota: int, carry_all: bool) -> Plan[list[int] | None]:
        """A quota from each of ``shards`` and the acks of shards it does not poll (of
        every source, when ``carry_all``), all in one round trip. Returns the shards
        that may have more, or None when a shard's call failed and records were handed
        out (the round ends with those). Raises a failure of a call that carried acks
        (they may not have been applied), a failure with nothing handed out, and any
        other error."""
        calls = [self.poll_call(source, shard, quota) for shard in shards]
        carried = [len(c.args) > 3 for c in calls]
        for other in (self.sources if carry_all else (source,)):
            calls += [self.ack_call(other, shard, offsets) for shard, offsets in other.acks.items()]
            carried += [True] * len(other.acks)
            other.acks.clear()
        replies = yield Batch(calls)
        failure: FelixError | None = None
        ack_failure: FelixError | None = None
        error: FelixError | None = None
        more = []
        for i, reply in enumerate(replies):
            if isinstance(reply, FelixError):
                if isinstance(reply, LOST):
                    failure = failure or reply
                else:
                    error = error or reply
                if carried[i]:
                    ack_failure = ack_failure or reply
            elif i < len(shards) and self.take(source, shards[i], quota, reply):
                more.append(shards[i])
        if error is not None:
            raise error  # after every reply was taken: the caller decides what the records in hand become
        if ack_failure is not None:
            raise ack_failure
        if failure is not None:
            if self.count:
                return None
            raise failure
        return more

    def second_pass(self, source: Source, shards: list[int]) -> Plan[None]:
        """What is still wanted, from ``shards`` one at a time, until enough. A failed
        call ends the pass when records were handed out, else raises."""
        for shard in shards:
            want = self.max_records - self.count
            if want <= 0:
                return
            try:
                self.take(source, shard, want, (yield self.poll_call(source, shard, want)))
            except LOST:
                if self.count:
                    return
                raise

    def poll_call(self, source: Source, shard: int, want: int) -> Eval:
        """A group_poll of ``want`` records on ``shard``, with its acks, reclaiming the
        consumer's own records on its first poll of the shard."""
        reclaimed = self.state.reclaimed[source.index]
        first = self.reclaim and self.consumer is not None and shard not in reclaimed
        if first:
            reclaimed.add(shard)
        keys, context = self.cache.group_shard_keys(source.name, shard, self.group)
        args: list[Any] = [want, self.consumer or "", 1 if first else 0]
        if shard in source.acks:
            args += source.acks.pop(shard)
        return Eval("group_poll", keys, args, context, source.settings.replicas)

    def ack_call(self, source: Source, shard: int, offsets: list[int]) -> Eval:
        keys, context = self.cache.group_shard_keys(source.name, shard, self.group)
        return Eval("group_ack", keys, offsets, context, source.settings.replicas)

    def take(self, source: Source, shard: int, want: int, reply: list[Any]) -> bool:
        """Adds a poll reply's records and wake points; True when the shard may have more."""
        count = int(reply[4])
        self.out[source.index].extend(parse_delivered(reply, 5, count, shard))
        self.count += count
        self.points.update(wake_points(self.cache.group_shard_keys(source.name, shard, self.group)[0], reply))
        due = int(reply[1])
        if due >= 0:
            until = max(1, due - int(reply[0]) + 1)
            self.block_ms = until if self.block_ms < 0 else min(self.block_ms, until)
            if count < want and due <= int(reply[0]):
                self.due_now = True
                return True
        return count == want
