"""One poll of a group across several shards, and across several streams, in plain steps
(:class:`ShardedPoll`).

A group keeps, between polls, what the shards' last replies said (:class:`PollState`):
which shards had nothing to hand out, where to watch for a wake-up on each (its log's
tail, its wake stream's sequence) and when its next due time or lease falls due. A
poll asks only the shards that may have work: one shard leads (is asked for the whole
batch, with its acks) for up to ``LEAD_RUN`` polls while it fills them, then the next
such shard in turn; when the lead cannot fill the batch, the other shards that may have
work are asked for a quota each in one round trip, then those that had more one at a
time. Whether an idle shard has woken is read from its wake points with one plain XREAD
(no script) at the start of each lead's run and before a poll settles for less than it
wanted; with nothing handed out and time left the poll blocks on every idle shard's
wake points, of every stream, at once. So a busy shard costs one script call per
batch, an idle one nothing but its share of that XREAD, and an idle long-poller one
blocking read per wait period (and, every ``KNOWN_IDLE_S``, one shard asked again in
case something changed that no wake-up reports, such as a group made again).

Over several streams a round takes them in turn, each only for what the streams before
it could not fill: in the order given (strict), or, with weights, led by each stream in
turn for as many polls as its weight (so that with every stream busy the hand-outs
follow the weights, none starves, and one poll's acks ride on the next poll of the same
stream, not on a call of their own).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

from felix_redis.caches import Caches, StreamSettings
from felix_redis.checks import poll_ack_args
from felix_redis.constants import KNOWN_IDLE_S, LEAD_RUN, MAX_RING_SHARDS, POLL_AGAIN_MAX, WATCH_MARGIN_MS
from felix_redis.errors import ConnectionFailed, FelixError, NotReplicated
from felix_redis.keys import StreamName
from felix_redis.models import Record
from felix_redis.plans import (
    Batch,
    BlockAny,
    Cmd,
    Eval,
    Plan,
    Ring,
    ShardPoints,
    Sleep,
    follow_bell,
    moved_keys,
    read_shards_points,
    read_wake_points,
    shards_points,
    waiter_name,
    wake_points,
)
from felix_redis.replies import parse_delivered

log = logging.getLogger("felix_redis")

#: Failures after which a shard's calls may or may not have run: the poll hands out
#: what other shards leased (rather than let those leases lapse), or raises.
LOST = (ConnectionFailed, NotReplicated)

#: A shard with nothing to hand out, as its last reply said: its wake points, when (on
#: the monotonic clock) its next due time or lease falls due (inf: none), when learned.
Idle = tuple[list[tuple[str, str]], float, float]


def first_lead(shards: int) -> int:
    """Where a group's first run starts among its ``shards`` shards: drawn at random, not
    the first, so that the consumers of a fleet, started together, do not all lead on
    the same shard at once."""
    return random.randrange(shards)


class PollState:
    """What a group keeps from one poll to the next, per stream (by index): the shard
    that leads (its place in the stream's shard list) and the polls its run has left,
    the idle shards, and the shards this consumer took its own in-flight records back
    from; for the weighted order, the stream that leads and the polls it has left."""

    __slots__ = ("cursors", "epoch", "follow", "follow_until", "idle", "lead", "left", "look_due", "looked", "quiet",
                 "reclaimed", "ring", "runs", "urgent", "watching")

    def __init__(self, streams: int) -> None:
        self.cursors = [-1] * streams
        self.runs = [0] * streams
        self.idle: list[dict[int, Idle]] = [{} for _ in range(streams)]
        #: shards a look found moved: asked beside the next lead, not after its run
        self.urgent: list[set[int]] = [set() for _ in range(streams)]
        #: the client's connection epoch (Core.epoch) the idle shards were learned in
        self.epoch = 0
        self.reclaimed: list[set[int]] = [set() for _ in range(streams)]
        self.lead = -1
        self.left = 0
        #: a long poll that another waiter watches for: it waits on the group's bell
        #: (lua/group_poll.lua); the ring it popped, to name in its next poll
        self.follow = False
        #: when the watch this waiter follows lapses, as shard 0 said (time.monotonic()):
        #: a poll that starts later asks shard 0 again (the watcher may have died since)
        self.follow_until = 0.0
        self.ring = ""
        #: this waiter holds the group's watch (shard 0's last reply said so, or it
        #: popped a ring): over several shards, it gives the watch up when it takes records
        self.watching = False
        #: a follower's wait on the bell ended with no ring: its next call of the watch
        #: goes without a look at the other shards (the watcher watches them) ...
        self.quiet = False
        #: ... unless this consumer has not looked at them for KNOWN_IDLE_S (the watch
        #: may be held by a waiter that watches shard 0 only, a group_poll of shard 0,
        #: or be forged): then its next call of the watch goes with a look
        self.look_due = False
        #: when this consumer last looked at its idle shards' wake points (time.monotonic())
        self.looked = 0.0

    def forget(self) -> None:
        """After a failure (a lost connection, a failover, an error): nothing is known
        idle any more, so the next poll asks every shard again."""
        for idle in self.idle:
            idle.clear()
        for urgent in self.urgent:
            urgent.clear()
        self.runs = [0] * len(self.runs)
        self.follow = False
        self.watching = False
        self.quiet = False
        self.look_due = False


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
    :class:`PollState`, updated. ``cluster``: keys of different shards may not share
    a command (Redis Cluster). ``core``: whose ``bells`` says whether a long poll of
    one stream takes part in its group's watch (as ``group_poll`` does: one waiter
    watches, the others wait on the group's bell); None: it does not. Over several
    shards the watch is held on shard 0 and its watcher blocks on every shard's wake
    points; it gives the watch up when it takes records anywhere, ringing with its
    points of the other shards (lua/group_poll.lua, ``SHARDS``). (Groups of several
    streams, a consumer of some of the shards, and Redis Cluster do not: each idle
    consumer blocks on its shards' wake points.)"""

    def __init__(
        self, cache: Caches, group: str, sources: list[Source], max_records: int, wait_ms: int,
        consumer: str | None, reclaim: bool, state: PollState, weights: list[int] | None = None,
        cluster: bool = False, epoch: Callable[[], int] | None = None, core: Any = None,
    ) -> None:
        self.cache, self.group, self.sources = cache, group, sources
        self.max_records, self.wait_ms = max_records, wait_ms
        self.consumer, self.reclaim, self.state, self.weights = consumer, reclaim, state, weights
        self.cluster, self.epoch = cluster, epoch or (lambda: 0)
        self.core = core
        self.bell: str | None = None
        self.waiter = ""
        #: the shards of the group's watch: 1, or all of the stream's (held on shard 0)
        self.shards = 1
        if core is not None and core.bells and wait_ms > 0 and len(sources) == 1:
            shards, chosen = sources[0].settings.shards, sources[0].chosen
            # a one-shard stream; or all shards of one (not on Cluster, where a block
            # cannot span the shards' slots)
            whole = chosen == [0] if shards == 1 else not cluster and sorted(chosen) == list(range(shards))
            if whole:
                self.bell = f"{cache.group_shard_keys(sources[0].name, 0, group)[0][2]}:bell"
                self.waiter = waiter_name()
                self.shards = shards
        self.deadline = 0.0
        # what the current round gathered: records per source (by index), how many
        self.out: list[list[Record]] = [[] for _ in sources]
        self.count = 0
        #: per source, the shards that may have work this round
        self.cands: list[set[int]] = [set() for _ in sources]
        #: the wake points the round's replies gave, and the shard (source index, shard) of each key
        self.points: dict[str, str] = {}
        self.where: dict[str, tuple[int, int]] = {}
        self.block_ms = -1
        #: a shard handed out less than asked while something there is due now
        self.due_now = False
        #: this round asks shard 0 only for the group's watch, without a look at the
        #: other shards (:meth:`candidates`)
        self.learning = False
        #: shard 0's call of the watch handed records out this round: that call gave the
        #: watch up already (lua/group_poll.lua), so no call of its own does it again
        self.gave_up = False

    @property
    def context(self) -> str:
        """What a block or an error names: the group and its streams (made when needed:
        a poll that hands records out at once needs none)."""
        paths = ", ".join(source.name.path for source in self.sources)
        return f"group {self.group} on stream{'s' if len(self.sources) > 1 else ''} {paths}"

    def run(self) -> Plan[list[list[Record]]]:
        """The records, per source (by index)."""
        try:
            return (yield from self.rounds())
        except BaseException:
            self.state.forget()
            raise

    def rounds(self) -> Plan[list[list[Record]]]:
        start = time.monotonic()
        deadline = self.deadline = start + self.wait_ms / 1000
        again = 0
        state = self.state
        if state.follow and self.wait_ms > 0 and start >= state.follow_until:
            # the watch the last poll learned it follows has lapsed since (the caller was
            # busy): shard 0 says again who watches before this poll waits on the bell
            # (a watcher that died meanwhile is replaced at once, and a ring left on the
            # bell is cleared). While that watch lives, a loop's polls go to the bell at
            # once, however long the caller took between them
            state.follow = False
            state.idle[0].pop(0, None)
        while True:
            self.out, self.count = [[] for _ in self.sources], 0
            self.points, self.where, self.block_ms = {}, {}, -1
            self.gave_up = False
            self.check_epoch()
            # (a lost connection in the round forgets the role: the watch is given up
            # all the same when this consumer held it)
            watched = self.state.watching
            now = time.monotonic()
            self.cands = [self.candidates(source, now) for source in self.sources]
            if self.wait_ms > 0 and not any(self.cands) and not any(source.acks for source in self.sources):
                # no shard may have work, as far as wake-ups and due times say: the block
                # itself looks (it returns at once for anything after the points)
                left_ms = int((deadline - now) * 1000)
                if left_ms <= 0:
                    return self.out
                yield from self.block(left_ms)
                continue
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
                # (a later call of shard 0 in the round may have taken the watch back:
                # watching again, it gives it up)
                if self.shards > 1 and self.core.bells and (self.state.watching or (watched and not self.gave_up)):
                    yield from self.give_up_watch()
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
            yield from self.block(left_ms)

    def check_epoch(self) -> bool:
        """Forgets the idle shards when the client met a lost connection, a failover or
        a restart since they were learned (the driver may have retried through it unseen:
        the server may have rolled back below their points). True when it forgot."""
        epoch = self.epoch()
        if epoch == self.state.epoch:
            return False
        self.state.forget()
        self.state.epoch = epoch
        return True

    def candidates(self, source: Source, now: float) -> set[int]:
        """The shards of ``source`` that may have work: not known idle, or due by now;
        and the one known idle longest, when that is over ``KNOWN_IDLE_S``."""
        idle = self.state.idle[source.index]
        if not idle:
            return set(source.chosen)
        out, stale, since = set(), -1, now - KNOWN_IDLE_S
        learn = self.shards > 1 and self.core.bells and not self.state.watching and not self.state.follow
        # a follower of the group's watch over several shards asks no shard again for
        # being known idle long: the watcher does (and is the one that blocks on them)
        if self.shards > 1 and self.core.bells and (self.state.follow or self.state.quiet or self.state.look_due):
            since = -float("inf")
        for shard in source.chosen:
            known = idle.get(shard)
            if known is None:
                out.add(shard)
            elif known[1] <= now:
                out.add(shard)
                self.state.urgent[source.index].add(shard)  # its due time came
            elif known[2] < since:
                stale, since = shard, known[2]
        if stale >= 0:
            del idle[stale]
            out.add(stale)
        # the group's watch over several shards: shard 0 says who watches (this waiter,
        # or another: then it waits on the bell) before it blocks, asked when no other
        # shard may have work (else by :meth:`block`, if they had none). Then the
        # watcher renewing its watch, or a follower after its wait on the bell, calls it
        # without a look at the other shards: the watcher's block looks (a follower's
        # old points would find them moved, and ask them for records the watcher took)
        self.learning = self.shards > 1 and self.core.bells and out <= {0} \
            and (self.state.watching or (learn and self.state.quiet))
        self.state.quiet = self.state.look_due = False
        if learn and not out:
            out.add(0)
        return out

    def block(self, left_ms: int) -> Plan[None]:
        """Blocks on the wake points of every shard, of every source, until the first
        due time (or ``left_ms``); the shards whose points moved are no longer idle. Not
        when the client met a failure during the round (the next round asks again)."""
        if self.check_epoch():
            return
        if self.shards > 1 and self.core.bells and not self.state.watching and not self.state.follow \
                and 0 in self.state.idle[0] and (0, 0) not in set(self.where.values()):
            # the round asked other shards, which had nothing: shard 0 says who watches
            # before this consumer blocks (the next round asks it). (Asked this round
            # and still no role: it blocks on every shard, as outside the watch.)
            self.state.idle[0].pop(0, None)
            return
        points, where, block_ms = dict(self.points), dict(self.where), self.block_ms
        asked = set(where.values())
        now = time.monotonic()
        for source in self.sources:
            idle = self.state.idle[source.index]
            for shard in source.chosen:
                known = idle.get(shard)
                if known is None:
                    if (source.index, shard) not in asked:
                        block_ms = 1  # not asked this round (cannot happen with nothing handed out): look again soon
                    continue
                for key, last in known[0]:
                    points[key], where[key] = last, (source.index, shard)
                if known[1] != float("inf"):
                    until = max(1, int((known[1] - now) * 1000) + 1)
                    block_ms = until if block_ms < 0 else min(block_ms, until)
        block_ms = left_ms if block_ms < 0 else min(block_ms, left_ms)
        if self.bell is not None and self.state.follow and self.core.bells and 0 in self.state.idle[0]:
            # another waiter watches the group: wait on its bell (until the wait ends or
            # the shard's due time); then the shard is asked again (a ring: records
            # came; else this poll may take over a watch that lapsed)
            self.state.follow = False
            _popped, rang = yield from follow_bell(self.core, self.bell, block_ms, self.context)
            if rang is None:
                self.state.idle[0].pop(0, None)  # the shard is asked again at once
                if self.shards > 1:
                    # without a look at the other shards (the watcher watches them),
                    # but for one every KNOWN_IDLE_S: a watch held by a waiter that
                    # watches shard 0 only (or forged) leaves a record on another shard
                    # late by that at most, not for as long as it is renewed
                    looked_long_ago = time.monotonic() - self.state.looked >= KNOWN_IDLE_S
                    self.state.look_due = looked_long_ago
                    self.state.quiet = not looked_long_ago
                return
            # the ring handed this consumer the watch: it names the ring when it polls
            self.state.ring = rang.claim
            since = time.monotonic()
            renew = self.take_ring(rang, since) if self.shards > 1 else float("inf")
            if rang.due_in == 0:
                self.state.idle[0].pop(0, None)  # the shard is asked again at once
                return
            # ... and watches from the ring's points (the rest of a burst wakes it at once)
            keys = self.cache.group_shard_keys(self.sources[0].name, 0, self.group)[0]
            due = float("inf") if rang.due_in < 0 else since + rang.due_in / 1000
            self.state.idle[0][0] = (rang.points(keys), min(due, renew), since)
            return
        if not points:
            yield Sleep(block_ms / 1000)  # nothing to watch (no shard answered yet): look again after
            return
        reply = yield BlockAny(list(points.items()), block_ms, self.context)
        if reply is BlockAny.FAILED:
            self.state.forget()
            return
        for key in moved_keys(reply):
            if (at := where.get(key)) is not None:
                self.state.idle[at[0]].pop(at[1], None)

    def take_ring(self, rang: Ring, since: float) -> float:
        """A ring popped in the group's watch over several shards: this consumer is the
        watcher now, and watches the other shards from the ring's points (those the
        ringer knew idle; the others are asked at once), or from its own where the ring
        has none (a ring of another form). Returns when it asks shard 0 again, naming
        the ring (the watch is then its own), half a margin before the ring's lapses."""
        self.state.watching = True
        told = read_shards_points(rang.shards, self.shards - 1)
        if told is None:
            return since + WATCH_MARGIN_MS / 2000
        ttl_ms, shards = told
        source, idle = self.sources[0], self.state.idle[0]
        for shard, entry in enumerate(shards, start=1):
            if entry is None:
                idle.pop(shard, None)
                continue
            keys = self.cache.group_shard_keys(source.name, shard, self.group)[0]
            next_offset, wake_seq, due_in = entry
            due = float("inf") if due_in < 0 else since + due_in / 1000
            idle[shard] = (wake_points(keys, [0, 0, next_offset, wake_seq]), due, since)
        return since + max(0, ttl_ms - WATCH_MARGIN_MS / 2) / 1000

    def take_from(self, source: Source, turn: int, last: bool) -> Plan[bool]:
        """What is still wanted, from ``source`` (the ``turn``-th of the round): its
        lead, then the others that may have work. A stream that said something is due
        now (its scan stopped at its bound in a long run of delayed records) is asked
        again, a bounded number of times, before a later stream (``last``: there is
        none) gets anything. Returns True when the round ends: enough, or a call failed
        with records in hand. A failure of a later stream while earlier ones' records
        are leased (its group missing, a permission denied) ends the round with those
        records, logged: it is raised by a poll that has nothing else to hand out."""
        for again in range(POLL_AGAIN_MAX + 1):
            want = self.max_records - self.count
            if want <= 0:
                return True
            self.due_now = False
            try:
                if (yield from self.passes(source, want, carry_all=turn == 0 and again == 0)):
                    return True
            except FelixError as exc:
                if turn == 0 or not self.count:
                    raise
                log.warning("%s: stream %s failed, handing out what the streams before it gave: %s",
                            self.context, source.name.path, exc)
                return True
            if last or not self.due_now or self.count >= self.max_records:
                return False
        return False

    def passes(self, source: Source, want: int, carry_all: bool) -> Plan[bool]:
        """The lead for ``want`` (with the acks, and a look at the idle shards' wake
        points when its run starts); while more is wanted, the next shard that may have
        work takes over the lead for what is left (with the look, if not made yet); then
        the others that may, a quota each in one round trip, then one at a time those
        that had more. True when a call failed and records were handed out (the round
        ends with those)."""
        cands, index = self.cands[source.index], source.index
        lead, looked = self.pick_lead(source, cands)
        look = looked and not self.learning
        looked = looked or self.learning
        # shards a look found moved, or whose due time came, are asked beside the lead
        # (a quota each), so that what woke on a quiet shard does not wait for its turn
        # to lead while busy shards take theirs
        urgent = self.state.urgent[index]
        if urgent:
            beside = [shard for shard in self.after_lead(source) if shard in urgent and shard in cands
                      and shard != lead][: want - 1 if lead is not None else want]
            urgent.difference_update(beside)
            quota = max(1, want // max(1, len(beside) + (lead is not None)))
            asks = [(shard, quota) for shard in beside]
            if lead is not None:
                asks.insert(0, (lead, want - quota * len(beside)))
        else:
            asks = [] if lead is None else [(lead, want)]
        more = yield from self.trip(source, asks, carry_all, look)
        if more is None:
            return True
        tried = [shard for shard, _ in asks]
        if self.count < self.max_records and (lead is not None or not looked):
            # the lead ran dry: the next shard that may have work leads from here on
            follow, _ = self.pick_lead(source, cands.difference(tried), fresh=True)
            if follow is not None or not looked:
                got = yield from self.trip(
                    source, [] if follow is None else [(follow, self.max_records - self.count)], False, not looked)
                if got is None:
                    return True
                more += got
                looked = True
                if follow is not None:
                    tried.append(follow)
        want = self.max_records - self.count
        if want <= 0:
            return False
        rest = [shard for shard in self.after_lead(source) if shard in cands and shard not in tried]
        first = rest[:want]
        quota = max(1, want // max(1, len(rest)))
        again = yield from self.trip(source, [(shard, quota) for shard in first], False, False)
        if again is None:
            return True
        more = [shard for shard in more if shard not in first]
        yield from self.second_pass(source, list(dict.fromkeys(rest[len(first):] + more + again)))
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

    def pick_lead(self, source: Source, cands: set[int], fresh: bool = False) -> tuple[int | None, bool]:
        """The shard that leads this poll of ``source``, and whether its run starts now
        (the poll then looks at the idle shards' wake points too). The lead keeps its
        run while it may have work; then the next shard (in the stream's order, after
        it) that may, for ``LEAD_RUN`` polls (``fresh``: that one now). None when no
        shard may have work."""
        state, index, chosen = self.state, source.index, source.chosen
        at = state.cursors[index]
        if at < 0:
            at = first_lead(len(chosen)) - 1
        if not fresh and state.runs[index] > 0 and 0 <= at < len(chosen) and chosen[at] in cands:
            state.runs[index] -= 1
            return chosen[at], False
        for step in range(1, len(chosen) + 1):
            pos = (at + step) % len(chosen)
            if chosen[pos] in cands:
                state.cursors[index], state.runs[index] = pos, LEAD_RUN - 1
                return chosen[pos], True
        state.runs[index] = 0
        return None, True

    def after_lead(self, source: Source) -> list[int]:
        """The source's shards after its lead, in the stream's order (the lead last)."""
        chosen, at = source.chosen, self.state.cursors[source.index]
        return [chosen[(at + step) % len(chosen)] for step in range(1, len(chosen) + 1)]

    def trip(self, source: Source, asks: list[tuple[int, int]], carry_all: bool, look: bool) -> Plan[list[int] | None]:
        """One round trip: from each shard of ``asks`` (shard, records wanted) what it
        wants, the acks of shards it does not poll (of every source, when ``carry_all``), and (``look``) an XREAD
        of the idle shards' wake points. Returns the shards that may have more (those
        whose points moved among them), or None when a shard's call failed and records
        were handed out (the round ends with those). Raises a failure of a call that
        carried acks (they may not have been applied), a failure with nothing handed
        out, and any other error."""
        calls: list[Eval | Cmd] = [self.poll_call(source, shard, want) for shard, want in asks]
        carried = [len(c.args) > 3 for c in calls]
        acked: list[tuple[int, list[int]]] = []  # what the ack calls settle, in order
        for other in (self.sources if carry_all else (source,)):
            if other.acks:
                calls += [self.ack_call(other, shard, offsets) for shard, offsets in other.acks.items()]
                carried += [True] * len(other.acks)
                acked += other.acks.items()
                other.acks = {}
        looks, where = (self.looks(source) if look else ([], {}))
        if looks:
            self.state.looked = time.monotonic()
        calls += looks
        carried += [False] * len(looks)
        if not calls:
            return []
        if len(calls) == 1:
            # alone, it goes as itself: the driver retries it through a lost connection
            # (a Batch of one would come back with the failure in its list)
            try:
                replies = [(yield calls[0])]
            except FelixError as exc:
                replies = [exc]
        else:
            try:
                replies = yield Batch(calls)
            except FelixError as exc:  # the driver gave up on the whole round trip
                replies = [exc] * len(calls)
        failure: FelixError | None = None
        ack_failure: FelixError | None = None
        error: FelixError | None = None
        more = []
        statuses: list[int] = []
        for i, reply in enumerate(replies):
            if i >= len(calls) - len(looks):
                more += self.woken(source, reply, where)
            elif i >= len(asks) and not isinstance(reply, FelixError):
                statuses += [int(x) for x in reply]
            elif isinstance(reply, FelixError):
                if isinstance(reply, LOST):
                    failure = failure or reply
                else:
                    error = error or reply
                if carried[i]:
                    ack_failure = ack_failure or reply
            elif i < len(asks) and self.take(source, asks[i][0], asks[i][1], reply):
                more.append(asks[i][0])
        if error is not None:
            raise error  # after every reply was taken: the caller decides what the records in hand become
        if ack_failure is not None:
            raise ack_failure
        claims = [f"{shard}:{offset}" for shard, offsets in acked for offset in offsets] if -1 in statuses else []
        if claims and len(statuses) == len(claims):
            from felix_redis.protocol import not_delivered  # (protocol imports this module)

            refused = not_delivered(self.context, claims, statuses)
            if not self.count:
                raise refused  # the caller learns it (the others were settled)
            # records are leased: they are handed out (raising would let them lapse and
            # spend an attempt); the acks of records never delivered are dropped, said
            log.warning("%s", refused)
        if failure is not None:
            if self.count:
                self.state.forget()
                return None
            raise failure
        return more

    def looks(self, source: Source) -> tuple[list[Eval | Cmd], dict[str, int]]:
        """Plain XREADs (no block) of the wake points of ``source``'s idle shards: one,
        or on Redis Cluster one per shard (its keys share the shard's slot); and the
        shard of each key."""
        idle, cands, index = self.state.idle[source.index], self.cands[source.index], source.index
        asked = set(self.where.values())  # (not the shards this round asked: their points are fresh)
        points = [(shard, known[0]) for shard, known in idle.items()
                  if shard not in cands and (index, shard) not in asked]
        if not points:
            return [], {}
        where = {key: shard for shard, keys in points for key, _ in keys}
        groups = [keys for _, keys in points] if self.cluster else [[p for _, keys in points for p in keys]]
        return [Cmd("XREAD", "COUNT", 1, "STREAMS", *[k for k, _ in keys], *[i for _, i in keys],
                    key=keys[0][0], context=self.context) for keys in groups], where

    def woken(self, source: Source, reply: Any, where: dict[str, int]) -> list[int]:
        """The shards a look found moved (all it looked at when it failed): no longer
        idle, they may have work this round."""
        moved = set(where.values()) if isinstance(reply, FelixError) else \
            {where[key] for key in moved_keys(reply) if key in where}
        idle, cands = self.state.idle[source.index], self.cands[source.index]
        for shard in moved:
            idle.pop(shard, None)
            cands.add(shard)
        self.state.urgent[source.index].update(moved)
        return sorted(moved)

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
                    self.state.forget()
                    return
                raise

    def poll_call(self, source: Source, shard: int, want: int, busy: bool = False) -> Eval:
        """A group_poll of ``want`` records on ``shard``, with its acks, reclaiming the
        consumer's own records on its first poll of the shard. ``busy``: the call of
        the group's watch (shard 0, no records, no acks) by which a watcher that took
        records on other shards gives the watch up."""
        reclaimed = self.state.reclaimed[source.index]
        first = self.reclaim and self.consumer is not None and shard not in reclaimed and not busy
        if first:
            reclaimed.add(shard)
        keys, context = self.cache.group_shard_keys(source.name, shard, self.group)
        args: list[Any] = [want, self.consumer or "", 1 if first else 0]
        if self.bell is not None and self.core.bells and shard == 0:
            # a call of the group's watch (lua/group_poll.lua), for the wait left, naming
            # a ring this consumer popped; over several shards, with what a ring it rings
            # tells of the others
            ttl = max(1, int((self.deadline - time.monotonic()) * 1000)) + WATCH_MARGIN_MS
            args[2] = f"{args[2]} {self.waiter} {ttl}{self.state.ring}"
            if self.shards > 1:
                args[2] += f" {'!' if busy else '+'}{self.other_shards(source, ttl)}"
            self.state.ring = ""
            keys = [*keys, self.bell]
        if shard in source.acks and not busy:
            args += poll_ack_args(source.acks.pop(shard))
        return Eval("group_poll", keys, args, context, source.settings.replicas)

    def other_shards(self, source: Source, ttl: int) -> str:
        """What a ring of this consumer's tells its popper of the shards but 0
        (:func:`shards_points`): where it knows each idle (its points, its due time),
        or that it does not (the popper asks that shard at once)."""
        idle, now = self.state.idle[source.index], time.monotonic()
        keys = [self.cache.group_shard_keys(source.name, shard, self.group)[0] for shard in range(1, self.shards)]
        out: list[ShardPoints] = []
        for shard, shard_keys in zip(range(1, self.shards), keys, strict=True):
            known = idle.get(shard)
            if known is None:
                out.append(None)
                continue
            ids = read_wake_points(shard_keys, known[0])
            if ids is None:
                out.append(None)
                continue
            due_in = -1 if known[1] == float("inf") else max(0, int((known[1] - now) * 1000))
            out.append((*ids, due_in))
        text = shards_points(ttl, out)
        # (too long for the script, with hundreds of shards: a ring without them, whose
        # popper watches from its own points)
        return text if len(text) <= MAX_RING_SHARDS else ""

    def give_up_watch(self) -> Plan[None]:
        """The watcher of the group's watch over several shards took records: it gives
        the watch up (shard 0 rings the bell when nobody watches, and the ring tells its
        popper what this consumer knows of the other shards), so that a record on any
        shard wakes an idle waiter while this one is busy. A failure is logged: the
        records are leased and go to the caller; the watch then lapses."""
        self.state.watching = False
        source = self.sources[0]
        try:
            reply = yield self.poll_call(source, 0, 0, busy=True)
        except FelixError as exc:
            log.info("%s: giving up the group's watch failed (it lapses): %s", self.context, exc)
            return
        if len(reply) > 5 and type(reply[-1]) is int:
            self.learn_role(reply)

    def learn_role(self, reply: list[Any]) -> int:
        """This waiter's role in the group's watch (0 none, 1 the watcher, 2 a follower)
        as a call of the watch replied (its last fields: the role, then the watch's
        expiry on the server clock), kept in the state."""
        role = int(reply[-2])
        self.state.follow, self.state.watching = role == 2, role == 1
        self.state.follow_until = time.monotonic() + (int(reply[-1]) - int(reply[0])) / 1000
        return role

    def ack_call(self, source: Source, shard: int, offsets: list[int]) -> Eval:
        keys, context = self.cache.group_shard_keys(source.name, shard, self.group)
        return Eval("group_ack", keys, offsets, context, source.settings.replicas)

    def take(self, source: Source, shard: int, want: int, reply: list[Any]) -> bool:
        """Adds a poll reply's records and wake points, and what it says of the shard:
        True when it may have more (it filled the ask, or something there is due now),
        else the shard is idle until its points move or its next due time."""
        count = int(reply[4])
        # (a reply ends with the waiter's role and watch expiry, integers, when it has
        # them; else with a payload, or with the count when nothing was handed out)
        role = -1
        if self.bell is not None and shard == 0 and len(reply) > 5 and type(reply[-1]) is int:
            # the group's watch: a follower waits on the bell (below)
            role = self.learn_role(reply)
            self.gave_up = self.gave_up or count > 0
        self.state.urgent[source.index].discard(shard)
        self.out[source.index].extend(parse_delivered(reply, 5, count, shard))
        self.count += count
        if count >= want:
            # a full batch: the shard may have more. Its wake points are not kept: they
            # serve a block (a round that handed records out makes none) and an idle
            # shard's watch (this one is not idle)
            self.state.idle[source.index].pop(shard, None)
            self.cands[source.index].add(shard)
            return True
        points = wake_points(self.cache.group_shard_keys(source.name, shard, self.group)[0], reply)
        for key, last in points:
            self.points[key], self.where[key] = last, (source.index, shard)
        due, now = int(reply[1]), int(reply[0])
        if due >= 0:
            until = max(1, due - now + 1)
            self.block_ms = until if self.block_ms < 0 else min(self.block_ms, until)
            if due <= now:
                self.due_now = True
                self.state.idle[source.index].pop(shard, None)
                self.cands[source.index].add(shard)
                return True
        at = time.monotonic()
        due_at = float("inf") if due < 0 else at + (due - now) / 1000
        if role == 1:
            # the watcher asks the shard again (keeping the watch) half a margin before
            # the watch would lapse
            due_at = min(due_at, at + (int(reply[-1]) - now) / 1000 - WATCH_MARGIN_MS / 2000)
        self.state.idle[source.index][shard] = (points, due_at, at)
        self.cands[source.index].discard(shard)
        return False
