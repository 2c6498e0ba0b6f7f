"""Plans stepped by hand: canned replies in, the ops they yield out, no Redis (h11's way).

A plan (felix_redis.protocol) yields ops and gets their replies; these tests play the
driver, so every branch a server can only reach by a fault (a shard's call lost while
another's records were leased, an ack that may not have been applied, a producer whose
sequences a failover lost) is stepped exactly, with nothing but Python running.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Generator
from typing import Any

import pytest

import felix_redis.constants as C
import felix_redis.sharded as sharded_module
from felix_redis.constants import LEAD_RUN
from felix_redis.errors import (
    ConnectionFailed,
    FelixError,
    NotFound,
    NotReplicated,
    PermissionDenied,
    SequenceError,
)
from felix_redis.keys import GROUP_ROLES, SHARD_ROLES
from felix_redis.models import Published, Record
from felix_redis.plans import Batch, BlockAny, Cmd, Eval, Sleep, wake_points
from felix_redis.producers import ProducerState
from felix_redis.protocol import Core
from felix_redis.sharded import PollState

T, N, S, G = "acme", "prod", "jobs", "workers"
Answer = Callable[[Any], Any]


@pytest.fixture(autouse=True)
def _first_lead_zero(first_lead_zero: None) -> None:
    """The plans here are checked against replies scripted for a known order of leads:
    a sharded group's first lead is shard 0 (it is drawn at random otherwise)."""


def drive(plan: Generator[Any, Any, Any], answer: Answer) -> tuple[Any, list[Any]]:
    """Runs ``plan`` as a driver would, ``answer(op)`` giving each op's reply (an
    exception it returns is thrown into the plan, as a driver throws a FelixError; in a
    Batch's reply list it stays a value). Returns (result, the ops yielded)."""
    ops: list[Any] = []
    try:
        op = next(plan)
    except StopIteration as stop:
        return stop.value, ops
    while True:
        ops.append(op)
        reply = answer(op)
        try:
            op = plan.throw(reply) if isinstance(reply, BaseException) else plan.send(reply)
        except StopIteration as stop:
            return stop.value, ops


def info(shards: int, max_len: int = 0) -> list[Any]:
    """A stream_info reply: shard 0's settings, no groups."""
    meta = {"shards": shards, "replication": 1, "consistency": "leader", "max_payload": 1024, "max_len": max_len,
            "max_age": 0, "spread": 0, "tail": 0, "first": 0, "kind": "queue", "created": 1}
    return [[x for k, v in meta.items() for x in (k.encode(), str(v).encode())], []]


def polled(offsets: list[int], *, due: int = -1, now: int = 1000, tail: int = 50,
           wake: int = 3, watch: tuple[int, int] | None = None) -> list[Any]:
    """A group_poll reply handing out ``offsets`` (first deliveries of plain records):
    [now, due, tail, wake sequence, count, (ID, payload)*], then for a long poll the
    waiter's role in the watch and the watch's expiry (``watch``)."""
    reply: list[Any] = [now, due, tail, wake, len(offsets)]
    for off in offsets:
        reply += [b"%d-%d" % (off, now), b"p%d" % off]
    return reply + list(watch or ())


def calls(op: Any) -> list[Any]:
    """The calls of one round trip: a Batch's, or the one call sent as itself."""
    return list(op.ops) if type(op) is Batch else [op]


def shard_of(op: Eval) -> int:
    """The shard an Eval is for, from its context ('... shard N')."""
    return int(op.context.rsplit(" ", 1)[1])


def answering(**by_script: Callable[[Eval], Any]) -> Answer:
    """An answer that reads settings for a stream of the shards given in
    ``stream_info`` and answers each script (and each call of a Batch) by name."""
    def answer(op: Any) -> Any:
        if type(op) is Batch:
            return [answer(e) for e in op.ops]
        if type(op) is Eval:
            return by_script[op.script](op)
        if type(op) is BlockAny:
            return None
        if type(op) is Cmd and op.args[0] == "XREAD":
            return None  # a look: nothing moved
        raise AssertionError(f"unexpected op {op!r}")
    return answer


def core_with(shards: int) -> Core:
    """A Core whose settings cache already holds a stream of ``shards`` shards."""
    core = Core()
    _result, ops = drive(core.settings(core.name(T, N, S)), lambda op: info(shards))
    assert [op.script for op in ops] == ["stream_info"]
    return core


# ---------------------------------------------------------------------- settings and keys


def test_settings_are_read_once_then_cached() -> None:
    core = Core()
    settings, ops = drive(core.settings(core.name(T, N, S)), lambda op: info(3, max_len=7))
    assert (settings.shards, settings.max_len, settings.max_payload, settings.replicas) == (3, 7, 1024, 0)
    assert len(ops) == 1
    again, ops = drive(core.group_op(T, N, S, 2, G), lambda op: pytest.fail("no call while the settings are fresh"))
    _name, cached, shard, keys, context = again
    assert cached is settings and shard == 2 and context.endswith("shard 2")
    assert len(keys) == len(SHARD_ROLES) + len(GROUP_ROLES) + 1  # and the shard's due index


def test_a_shard_the_stream_lacks_is_refused_before_any_call() -> None:
    core = core_with(2)
    with pytest.raises(NotFound, match="shard 5 does not exist"):
        drive(core.group_op(T, N, S, 5, G), lambda op: pytest.fail("nothing is sent"))


# ---------------------------------------------------------------------- group_poll


def test_long_poll_blocks_on_the_log_and_wake_stream_until_the_first_due_time() -> None:
    core = core_with(1)
    # the waiter is the group's watcher (role 1): it blocks on the log and wake stream
    replies = iter([polled([], due=1250, now=1000, tail=41, wake=9, watch=(1, 7000)), polled([41], watch=(0, 0))])

    def answer(op: Any) -> Any:
        return None if type(op) is BlockAny else next(replies)

    records, ops = drive(core.group_poll(T, N, S, 0, G, 4, wait=5.0, ack=[3, 4]), answer)
    first, block, second = ops
    # the acks ride on the first call only (consecutive: as one run); each call names the
    # waiter and its watch's TTL
    assert first.args[:2] == [4, ""] and first.args[3:] == ["3-4"]
    assert re.fullmatch(r"0 [0-9a-f.]+ (\d+)", first.args[2])
    assert 5000 < int(first.args[2].split()[2]) <= 5000 + C.WATCH_MARGIN_MS
    assert second.args[:2] == [4, ""] and len(second.args) == 3
    assert second.args[2].split()[:2] == first.args[2].split()[:2]  # the same waiter
    keys = first.keys
    assert keys[-1] == keys[2] + ":bell"
    assert block.streams == [(keys[SHARD_ROLES.index("log")], "41-0"),
                             (keys[len(SHARD_ROLES) + GROUP_ROLES.index("wake")], "9-1")]
    assert block.block_ms == 251  # until the record falls due, not the whole wait
    assert [r.offset for r in records] == [41]


def test_a_follower_waits_on_the_bell_until_its_due_time() -> None:
    core = core_with(1)
    # another waiter watches (role 2): this one waits on the bell until what it saw is due
    replies = iter([polled([], now=1000, due=1300, watch=(2, 1200)), polled([7], watch=(0, 0))])

    def answer(op: Any) -> Any:
        return None if type(op) is BlockAny else next(replies)

    records, ops = drive(core.group_poll(T, N, S, 0, G, 4, wait=5.0), answer)
    first, block, _second = ops
    assert block.bell == first.keys[-1] and block.streams == []
    assert block.block_ms == 301
    assert [r.offset for r in records] == [7]


def test_a_user_without_bzpopmin_falls_back_to_watching() -> None:
    core = core_with(1)
    replies = iter([polled([], now=1000, watch=(2, 1300)), polled([], now=1001), polled([7])])

    def answer(op: Any) -> Any:
        if type(op) is BlockAny:
            if op.bell is not None:
                return PermissionDenied("NOPERM this user has no permissions to run the 'bzpopmin' command")
            return None
        return next(replies)

    records, ops = drive(core.group_poll(T, N, S, 0, G, 4, wait=5.0), answer)
    assert [type(op).__name__ for op in ops] == ["Eval", "BlockAny", "Eval", "BlockAny", "Eval"]
    assert ops[3].bell is None and ops[3].streams  # the log and wake stream, as before
    assert ops[2].args == [4, "", 0] and ops[2].keys[-1].endswith(":due")  # no waiter, no bell
    assert not core.bells and [r.offset for r in records] == [7]


@pytest.mark.parametrize("due_in", [0, 500])
@pytest.mark.parametrize("mode", ["group_poll", "sharded"])
def test_a_follower_names_the_ring_it_popped_in_its_next_poll(mode: str, due_in: int) -> None:
    # the ring hands this follower the watch: it watches from the ring's points until the
    # ring's due time (DUEIN 0: it polls at once) and its next poll names the ring, which
    # takes over the watch the ring holds (else that watch lapses with nobody on it)
    core = core_with(1)
    replies = iter([polled([], now=1000, watch=(2, 1300)), polled([41], watch=(0, 0))])

    def answer(op: Any) -> Any:
        if type(op) is BlockAny:
            if op.bell:
                return [op.bell, f"1000.41 41 9 {due_in}".encode(), b"0"]
            return [[op.streams[0][0], [[b"41-1000", [b"p", b"x"]]]]]  # the next record came
        if type(op) is Batch:
            return [next(replies) for _ in op.ops]
        return next(replies)

    plan = core.group_poll(T, N, S, 0, G, 4, wait=5.0) if mode == "group_poll" else sharded(core, wait=5.0)
    result, ops = drive(plan, answer)
    records = result if mode == "group_poll" else result[0]
    evals = [e for op in ops if type(op) in (Eval, Batch) for e in calls(op)]
    blocks = [op for op in ops if type(op) is BlockAny]
    assert len(evals) == 2 and blocks[0].bell == evals[0].keys[-1]
    assert not evals[0].args[2].endswith("@1000.41") and evals[1].args[2].endswith(" @1000.41")
    keys = evals[0].keys
    points = [(keys[SHARD_ROLES.index("log")], "41-0"), (keys[len(SHARD_ROLES) + GROUP_ROLES.index("wake")], "9-1")]
    if due_in == 0:
        assert len(blocks) == 1  # polled at once
    else:
        assert len(blocks) == 2 and blocks[1].bell is None
        assert sorted(blocks[1].streams) == sorted(points) and 1 <= blocks[1].block_ms <= due_in + 1
    assert [r.offset for r in records] == [41]


def test_poll_without_wait_returns_at_once() -> None:
    core = core_with(1)
    records, ops = drive(core.group_poll(T, N, S, 0, G, 4), lambda op: polled([]))
    assert records == [] and len(ops) == 1


# ---------------------------------------------------------------------- sharded_poll


def sharded(core: Core, *, max_records: int = 4, wait: float | None = None, ack: dict[int, list[Any]] | None = None,
            cursor: int = 0, consumer: str | None = None) -> Generator[Any, Any, tuple[list[Record], int]]:
    """A poll of one stream's shards: (records, the cursor after it)."""
    state = PollState(1)
    state.cursors[0] = cursor
    per_stream = yield from core.sharded_poll(
        T, N, [S], G, max_records, wait, consumer, state,
        ack=None if ack is None else {(0, shard): refs for shard, refs in ack.items()})
    return per_stream[0], state.cursors[0]


def with_streams(core: Core, shards: dict[str, int]) -> Core:
    """``core`` with the settings of more streams cached (name: shards)."""
    for stream, count in shards.items():
        drive(core.settings(core.name(T, N, stream)), lambda op, count=count: info(count))
    return core


def stream_of(op: Eval | Cmd) -> str:
    key = op.keys[0] if type(op) is Eval else str(op.key)
    return key.split("}")[0].split("/")[2]


def test_strict_order_takes_from_a_stream_only_what_the_streams_before_it_could_not_fill() -> None:
    core = with_streams(core_with(1), {"bulk": 1})
    state = PollState(2)
    have = {S: [1, 2, 3], "bulk": [7, 8, 9, 10]}

    def poll(op: Eval) -> Any:
        taken = have[stream_of(op)][: op.args[0]]
        del have[stream_of(op)][: len(taken)]
        return polled(taken)

    def ack(op: Eval) -> Any:
        return [1] * len(op.args)

    # 2 wanted, the first stream holds 3: the second is not polled, but its acks go along
    per_stream, ops = drive(core.sharded_poll(T, N, [S, "bulk"], G, 2, None, None, state, ack={(1, 0): [4]}),
                            answering(group_poll=poll, group_ack=ack))
    assert [[r.offset for r in records] for records in per_stream] == [[1, 2], []]
    assert len(ops) == 1 and [(e.script, stream_of(e)) for e in calls(ops[0])] == [
        ("group_poll", S), ("group_ack", "bulk")]
    # 4 wanted: 1 left in the first, the other 3 from the second, in a round trip of its own
    per_stream, ops = drive(core.sharded_poll(T, N, [S, "bulk"], G, 4, None, None, state),
                            answering(group_poll=poll))
    assert [[r.offset for r in records] for records in per_stream] == [[3], [7, 8, 9]]
    assert [[(stream_of(e), e.args[0]) for e in calls(op)] for op in ops] == [[(S, 4)], [("bulk", 3)]]


def test_weights_share_the_hand_outs_of_busy_streams_and_starve_none() -> None:
    core = with_streams(core_with(1), {"default": 1, "bulk": 1})
    state = PollState(3)
    led: list[str] = []

    def poll(op: Eval) -> Any:
        return polled([1] * op.args[0])  # every stream busy

    for _ in range(20):
        _per_stream, ops = drive(core.sharded_poll(T, N, [S, "default", "bulk"], G, 4, None, None, state,
                                                   weights=[6, 3, 1]), answering(group_poll=poll))
        (batch,) = ops
        led.append(stream_of(calls(batch)[0]))
    assert [led.count(s) for s in (S, "default", "bulk")] == [12, 6, 2]
    assert all("bulk" in led[i:i + 10] for i in range(0, 20, 10))  # every run of 10 polls serves it


def test_a_weighted_poll_fills_from_the_other_streams_by_weight_when_its_lead_is_empty() -> None:
    core = with_streams(core_with(1), {"default": 1, "bulk": 1})
    state = PollState(3)
    state.lead, state.left = 2, 1  # "bulk" leads this poll
    have = {S: [1], "default": [5, 6, 7], "bulk": []}

    def poll(op: Eval) -> Any:
        taken = have[stream_of(op)][: op.args[0]]
        del have[stream_of(op)][: len(taken)]
        return polled(taken)

    per_stream, ops = drive(core.sharded_poll(T, N, [S, "default", "bulk"], G, 3, None, None, state,
                                              weights=[1, 5, 2]), answering(group_poll=poll))
    assert [stream_of(calls(op)[0]) for op in ops] == ["bulk", "default"]
    assert [[r.offset for r in records] for records in per_stream] == [[], [5, 6, 7], []]


def test_a_lead_with_nothing_to_hand_out_gives_up_the_rest_of_its_run() -> None:
    core = with_streams(core_with(1), {"bulk": 1})
    state = PollState(2)
    have = {S: [], "bulk": list(range(100))}

    def poll(op: Eval) -> Any:
        taken = have[stream_of(op)][: op.args[0]]
        del have[stream_of(op)][: len(taken)]
        return polled(taken)

    leads = []
    for _ in range(4):
        _per_stream, ops = drive(core.sharded_poll(T, N, [S, "bulk"], G, 2, None, None, state, weights=[5, 1]),
                                 answering(group_poll=poll))
        leads.append(stream_of(calls(ops[0])[0]))
    # the first stream leads once, finds nothing, and its run of 5 ends: "bulk" leads
    # its run of 1, then the first stream again (known idle by then: it costs a look, a
    # plain XREAD of its wake points, in the same round trip)
    assert leads == [S, "bulk", S, "bulk"]


def test_an_empty_long_poll_over_several_streams_blocks_on_all_of_them_at_once() -> None:
    core = with_streams(core_with(2), {"bulk": 1})
    state = PollState(2)
    first = {(S, 0): polled([], tail=3, wake=1), (S, 1): polled([], tail=4, wake=2),
             ("bulk", 0): polled([], due=1050, tail=9, wake=5)}
    blocks: list[BlockAny] = []

    def answer(op: Any) -> Any:
        if type(op) is Batch:
            return [answer(e) for e in op.ops]
        if type(op) is BlockAny:
            blocks.append(op)
            bulk_log = next(key for key, last in op.streams if last == "9-0")
            return [[bulk_log.encode(), [[b"9-1", [b"p", b"x"]]]]]  # bulk's log moved
        if type(op) is Cmd:
            return None
        return polled([11]) if blocks else first[(stream_of(op), shard_of(op))]

    per_stream, ops = drive(core.sharded_poll(T, N, [S, "bulk"], G, 4, 10.0, None, state), answer)
    (block,) = blocks
    assert sorted(last for _key, last in block.streams) == ["1-1", "2-1", "3-0", "4-0", "5-1", "9-0"]
    assert len({key.split("}")[0] for key, _last in block.streams}) == 3  # 2 shards of one stream, 1 of the other
    assert 1 <= block.block_ms <= 51  # the second stream's record falls due first
    assert [[r.offset for r in records] for records in per_stream] == [[], [11]]
    # after the block only the stream whose points moved is asked
    after = [e for op in ops[ops.index(block) + 1:] for e in (op.ops if type(op) is Batch else [op])]
    assert [(stream_of(e), type(e)) for e in after if type(e) is Eval] == [("bulk", Eval)]


def test_a_lost_call_of_a_later_stream_hands_out_what_the_earlier_ones_leased() -> None:
    core = with_streams(core_with(1), {"bulk": 1})

    def poll(op: Eval) -> Any:
        return ConnectionFailed("lost") if stream_of(op) == "bulk" else polled([1])

    per_stream, _ops = drive(core.sharded_poll(T, N, [S, "bulk"], G, 4, None, None, PollState(2)),
                             answering(group_poll=poll))
    assert [[r.offset for r in records] for records in per_stream] == [[1], []]


def looked(op: Any) -> set[str]:
    """The keys a look (a plain XREAD in a Batch) reads."""
    args = list(op.args)
    keys = args[args.index("STREAMS") + 1:]
    return set(keys[: len(keys) // 2])


def test_the_lead_is_asked_for_the_whole_batch_and_keeps_its_run() -> None:
    core = core_with(4)
    state = PollState(1)
    leads = []
    for _ in range(2 * LEAD_RUN + 1):
        per_stream, ops = drive(core.sharded_poll(T, N, [S], G, 8, None, None, state),
                                answering(group_poll=lambda op: polled(list(range(op.args[0])))))
        (batch,) = ops  # every shard busy: one round trip, one script call
        assert len(calls(batch)) == 1 and calls(batch)[0].args[0] == 8
        leads.append(shard_of(calls(batch)[0]))
        assert len(per_stream[0]) == 8
    assert leads == [0] * LEAD_RUN + [1] * LEAD_RUN + [2]


def test_a_lead_that_runs_dry_hands_over_then_the_rest_get_a_quota_then_fill_up() -> None:
    core = core_with(4)
    have = {0: [10], 1: [20], 2: [30, 31, 32], 3: [40]}

    def poll(op: Eval) -> Any:
        taken = have[shard_of(op)][: op.args[0]]
        del have[shard_of(op)][: len(taken)]
        return polled(taken)

    (records, cursor), ops = drive(sharded(core, max_records=5, cursor=-1), answering(group_poll=poll))
    assert [[(shard_of(e), e.args[0]) for e in op.ops] if type(op) is Batch else [(shard_of(op), op.args[0])]
            for op in ops] == [[(0, 5)], [(1, 4)], [(2, 1), (3, 1)], [(2, 1)]]
    assert [(r.shard, r.offset) for r in records] == [(0, 10), (1, 20), (2, 30), (3, 40), (2, 31)]
    assert cursor == 1  # shard 1 took over the lead


def test_idle_shards_cost_one_look_until_their_points_move() -> None:
    core = core_with(2)
    state = PollState(1)
    empty = answering(group_poll=lambda op: polled([], tail=5 + shard_of(op), wake=1))
    _result, ops = drive(core.sharded_poll(T, N, [S], G, 4, None, None, state), empty)
    assert sum(len(op.ops) if type(op) is Batch else 1 for op in ops) == 2  # each shard asked once
    # now both are known idle: a poll is one plain XREAD of their points, no script
    name = core.name(T, N, S)
    log1 = name.shard_keys(1)[1]

    def nothing(op: Any) -> Any:
        assert type(op) is Cmd, op
        return None

    per_stream, ops = drive(core.sharded_poll(T, N, [S], G, 4, None, None, state), nothing)
    (batch,) = ops
    assert per_stream == [[]]
    assert looked(batch) == {name.shard_keys(0)[1], log1} | {
        name.group_key_list(s, G)[GROUP_ROLES.index("wake")] for s in (0, 1)}
    assert list(batch.args[-4:]) == ["5-0", "1-1", "6-0", "1-1"]  # where each shard's last reply left off

    # shard 1's log moved: the same round asks it (and only it)
    def moved(op: Any) -> Any:
        if type(op) is Cmd:
            return [[log1.encode(), [[b"6-1", [b"p", b"x"]]]]]
        if type(op) is Batch:
            return [polled([60]) for _ in op.ops]
        return polled([60])

    per_stream, ops = drive(core.sharded_poll(T, N, [S], G, 4, None, None, state), moved)
    assert [r.offset for r in per_stream[0]] == [60]
    polls = [e for op in ops for e in (op.ops if type(op) is Batch else [op]) if type(e) is Eval]
    assert [shard_of(e) for e in polls] == [1]


def test_an_idle_shard_is_asked_again_when_its_due_time_comes() -> None:
    core = core_with(2)
    state = PollState(1)
    drive(core.sharded_poll(T, N, [S], G, 4, None, None, state),
          answering(group_poll=lambda op: polled([], due=1030 if shard_of(op) == 0 else -1, now=1000)))

    def answer(op: Any) -> Any:
        if type(op) is Batch:
            return [answer(e) for e in op.ops]
        return None if type(op) is Cmd else polled([])

    _result, ops = drive(core.sharded_poll(T, N, [S], G, 4, None, None, state), answer)
    assert not [e for op in ops for e in calls(op) if type(e) is Eval]  # not yet due: not asked
    time.sleep(0.05)
    _result, ops = drive(core.sharded_poll(T, N, [S], G, 4, None, None, state), answer)
    assert [shard_of(e) for op in ops for e in calls(op) if type(e) is Eval] == [0]


def test_a_shard_known_idle_too_long_is_asked_again_one_per_round(monkeypatch: pytest.MonkeyPatch) -> None:
    core = core_with(3)
    state = PollState(1)
    empty = answering(group_poll=lambda op: polled([]))
    drive(core.sharded_poll(T, N, [S], G, 4, None, None, state), empty)
    monkeypatch.setattr(sharded_module, "KNOWN_IDLE_S", 0.0)

    def answer(op: Any) -> Any:
        if type(op) is Batch:
            return [answer(e) for e in op.ops]
        return None if type(op) is Cmd else polled([])

    asked = []
    for _ in range(3):
        _result, ops = drive(core.sharded_poll(T, N, [S], G, 4, None, None, state), answer)
        asked.append([shard_of(e) for op in ops for e in (op.ops if type(op) is Batch else [op]) if type(e) is Eval])
    assert [len(a) for a in asked] == [1, 1, 1] and sorted(a[0] for a in asked) == [0, 1, 2]


def test_an_idle_long_poll_blocks_at_once_and_a_failed_block_forgets() -> None:
    core = core_with(2)
    core.bells = False  # outside the group's watch (in it, shard 0 is asked first for the role)
    state = PollState(1)
    drive(core.sharded_poll(T, N, [S], G, 4, None, None, state), answering(group_poll=lambda op: polled([])))
    blocks = []

    def answer(op: Any) -> Any:
        if type(op) is BlockAny:
            blocks.append(op)
            return BlockAny.FAILED if len(blocks) == 1 else None
        if type(op) is Batch:
            return [answer(e) for e in op.ops]
        return None if type(op) is Cmd else polled([7])

    per_stream, ops = drive(core.sharded_poll(T, N, [S], G, 4, 10.0, None, state), answer)
    assert type(ops[0]) is BlockAny and len(ops[0].streams) == 4  # no script first: the block looks
    # the block failed: nothing is known any more, every shard is asked again
    assert [shard_of(e) for op in ops[1:] for e in (op.ops if type(op) is Batch else [op]) if type(e) is Eval] \
        == [0, 1]
    assert [r.offset for r in per_stream[0]] == [7, 7]


def test_the_lead_after_a_failure_or_at_first_is_the_shard_after_the_cursor() -> None:
    core = core_with(3)
    _result, ops = drive(sharded(core, max_records=3, cursor=1), answering(group_poll=lambda op: polled([])))
    assert [shard_of(e) for op in ops for e in (op.ops if type(op) is Batch else [op])] == [2, 0, 1]


def test_a_lost_shard_call_hands_out_what_the_other_shards_leased() -> None:
    core = core_with(2)
    state = PollState(1)

    def poll(op: Eval) -> Any:
        return ConnectionFailed("lost") if shard_of(op) == 1 else polled([10])

    per_stream, ops = drive(core.sharded_poll(T, N, [S], G, 4, None, None, state), answering(group_poll=poll))
    assert [(r.shard, r.offset) for r in per_stream[0]] == [(0, 10)]
    assert len(ops) == 2  # the lead, its follower (lost): no more after a failure
    assert state.idle == [{}]  # and nothing is known idle any more


def test_a_round_trip_the_driver_gave_up_on_keeps_the_records_in_hand() -> None:
    """The lead handed out a record and ran dry; the rest's round trip (a Batch) is lost
    for good (the driver raises it): the poll hands out the lead's record, forgets what
    it knew, and the record is not left to lapse."""
    core = core_with(4)
    state = PollState(1)

    def answer(op: Any) -> Any:
        if type(op) is Batch:
            return ConnectionFailed("lost")  # thrown into the plan, as a driver raises it
        return polled([10]) if shard_of(op) == 0 else polled([])

    per_stream, ops = drive(core.sharded_poll(T, N, [S], G, 6, None, None, state), answer)
    assert [r.offset for r in per_stream[0]] == [10]
    assert type(ops[-1]) is Batch and state.idle == [{}]


@pytest.mark.parametrize("lost", [ConnectionFailed("lost"), NotReplicated("one of two replicas")])
def test_a_lost_shard_call_with_nothing_handed_out_raises(lost: FelixError) -> None:
    core = core_with(2)

    def poll(op: Eval) -> Any:
        return lost if shard_of(op) == 0 else polled([])

    with pytest.raises(type(lost)):
        drive(sharded(core, cursor=-1), answering(group_poll=poll))


def test_a_lost_call_that_carried_acks_raises_even_with_records() -> None:
    """The acks may not have been applied: the caller must learn it and ack again."""
    core = core_with(2)

    lost = answering(group_poll=lambda op: polled([10]), group_ack=lambda op: ConnectionFailed("lost"))
    with pytest.raises(ConnectionFailed):  # shard 1's acks in a call of their own beside the lead's poll
        drive(sharded(core, ack={1: [7]}, cursor=-1), lost)
    riding = answering(group_poll=lambda op: ConnectionFailed("lost") if len(op.args) > 3 else polled([10]))
    with pytest.raises(ConnectionFailed):  # shard 1 leads, its acks ride on its poll, shard 0 gave a record
        drive(sharded(core, ack={1: [7]}, cursor=0), riding)


def test_acks_of_shards_the_lead_is_not_go_in_its_round_trip() -> None:
    core = core_with(4)
    acked: list[Any] = []

    def ack(op: Eval) -> Any:
        acked.append((shard_of(op), op.args))
        return ConnectionFailed("lost")

    with pytest.raises(ConnectionFailed) as raised:  # a lost ack raises, whatever was handed out
        drive(sharded(core, max_records=2, ack={3: [5, 6]}, cursor=-1),
              answering(group_poll=lambda op: polled([op.args[0]] * op.args[0]), group_ack=ack))
    assert acked == [(3, [5, 6])]
    assert raised.traceback  # (the lead's records lapse and come again)


def test_any_other_error_of_a_shard_raises() -> None:
    core = core_with(2)

    def poll(op: Eval) -> Any:
        return NotFound("group gone") if shard_of(op) == 1 else polled([10])

    with pytest.raises(NotFound):
        drive(sharded(core, cursor=-1), answering(group_poll=poll))


def test_a_lost_call_in_the_second_pass_ends_it_with_what_was_handed_out() -> None:
    core = core_with(4)
    have = {0: [10], 1: [], 2: [20, 21, 22, 23, 24], 3: []}

    def poll(op: Eval) -> Any:
        if shard_of(op) == 2 and len(have[2]) < 5 and op.args[0] != 3:
            raise ConnectionFailed("lost")  # the second pass's own call: a driver raises it
        taken = have[shard_of(op)][: op.args[0]]
        del have[shard_of(op)][: len(taken)]
        return polled(taken)

    def answer(op: Any) -> Any:
        if type(op) is Batch:
            return [poll(e) for e in op.ops]
        try:
            return poll(op)
        except ConnectionFailed as exc:
            return exc

    # lead 0 gives 1 of 8, its follower 1 nothing; 2 and 3 a quota of 3 each (2 fills
    # it); the second pass asks 2 for the 4 still wanted: lost
    (records, _cursor), ops = drive(sharded(core, max_records=8, cursor=-1), answer)
    assert [r.offset for r in records] == [10, 20, 21, 22]
    assert type(ops[-1]) is Eval and shard_of(ops[-1]) == 2 and ops[-1].args[0] == 4


def test_a_lost_call_in_the_second_pass_with_nothing_handed_out_raises() -> None:
    core = core_with(4)

    # lead 0 and follower 1 run dry in their round trips; of the rest (2, 3, a quota
    # each) 3 says something is due now, so the second pass asks it again alone: lost
    def due_now(op: Any) -> Any:
        if type(op) is Batch:
            return [polled([], due=1000, now=1000) if type(e) is Eval and shard_of(e) == 3 else polled([])
                    for e in op.ops]
        return ConnectionFailed("lost")

    with pytest.raises(ConnectionFailed):
        drive(sharded(core, max_records=2, cursor=-1), due_now)


def test_an_empty_long_poll_blocks_once_on_every_shard_until_the_first_due_time() -> None:
    core = core_with(2)
    first = {0: polled([], due=1400, now=1000, tail=5, wake=1), 1: polled([], due=1100, now=1000, tail=8, wake=2)}
    blocks: list[BlockAny] = []

    def answer(op: Any) -> Any:
        if type(op) is Batch:
            return [answer(e) for e in op.ops]
        if type(op) is BlockAny:
            blocks.append(op)
            log0 = next(key for key, last in op.streams if last == "5-0")
            return [[log0.encode(), [[b"5-1", [b"p", b"x"]]]]]  # shard 0's log moved
        if type(op) is Cmd:
            return None
        return polled([5]) if blocks else first[shard_of(op)]

    (records, _cursor), _ops = drive(sharded(core, wait=10.0, cursor=-1), answer)
    (block,) = blocks
    assert 90 <= block.block_ms <= 101  # shard 1's record falls due first
    assert sorted(last for _key, last in block.streams) == ["1-1", "2-1", "5-0", "8-0"]
    assert [r.offset for r in records] == [5]


# ---------------------------------------------------------------------- publishing


def publish_by(path: str, core: Core, answer: Answer, producer: ProducerState | None = None) -> tuple[Any, list[Any]]:
    """One payload published by the checked plan, or by the drivers' quick path."""
    if path == "quick":
        return send_quick(core, answer, producer)
    if producer is None:
        return drive(core.publish_single(T, N, S, b"x", None, None), answer)
    return drive(core.publish_one(T, N, S, b"x", None, None, producer), answer)


@pytest.mark.parametrize("path", ["plan", "quick"])
def test_a_lost_idempotent_publish_is_sent_again_with_the_same_sequence(path: str) -> None:
    core = core_with(1)
    producer = ProducerState("s" * 32)
    sends: list[Eval] = []

    def answer(op: Any) -> Any:
        if type(op) is Sleep:
            return None
        sends.append(op)
        return ConnectionFailed("lost") if len(sends) == 1 else [7, 1, 0, 0, None]

    published, ops = publish_by(path, core, answer, producer)
    assert published == Published(0, 7)
    assert [type(op) for op in ops] == [Eval, Sleep, Eval]
    assert sends[0].args == sends[1].args and sends[0].args[2] == 1
    assert producer.sequences == {(core.name(T, N, S).path, 0): 1}


@pytest.mark.parametrize("path", ["plan", "quick"])
def test_a_borrowed_producer_the_shard_forgot_starts_over_once(path: str) -> None:
    core = core_with(1)
    sends: list[list[Any]] = []

    def answer(op: Any) -> Any:
        sends.append(list(op.args))
        return SequenceError("gap") if len(sends) == 1 else [3, 1, 0, 0, None]

    pooled = core.producers.acquire()
    pooled.sequences[(core.name(T, N, S).path, 0)] = 41  # sequences a failover lost
    core.producers.release(pooled)
    published, _ops = publish_by(path, core, answer)
    assert published == Published(0, 3)
    (secret1, seq1), (secret2, seq2) = [(a[1], a[2]) for a in sends]
    assert (seq1, seq2) == (42, 1) and secret1 != secret2  # a new producer, from sequence 1
    assert core.producers.acquire() is pooled  # given back


def test_a_second_sequence_error_is_raised() -> None:
    core = core_with(1)
    with pytest.raises(SequenceError):
        drive(core.publish_single(T, N, S, b"x", None, None), lambda op: SequenceError("gap"))


def test_a_publish_without_producer_state_is_sent_once() -> None:
    core = Core(idempotent_publish=False)
    drive(core.settings(core.name(T, N, S)), lambda op: info(1))
    published, ops = drive(core.publish_single(T, N, S, b"x", None, None), lambda op: [9, 1, 0, 0, None])
    assert published == Published(0, 9) and ops[0].args[1] == b""


def send_quick(core: Core, answer: Answer, producer: ProducerState | None = None) -> tuple[Any, list[Any]]:
    """One payload by the drivers' quick path (Client._publish_single's steps): the
    script call :meth:`Core.quick_single` built, then ``single_sent`` or the plan of
    ``single_failed``."""
    send = core.quick_single(T, N, S, b"x", None, None, producer)
    assert send is not None, "the caches should allow the quick path"
    ops: list[Any] = [send[1]]
    try:
        reply = answer(send[1])
        if isinstance(reply, BaseException):
            raise reply
    except BaseException as exc:
        result, more = drive(core.single_failed(send, exc, T, N, S, b"x", None, None), answer)
        return result, ops + more
    return core.single_sent(send, reply), ops


def test_the_quick_path_sends_what_the_plan_sends_and_gives_the_producer_back() -> None:
    core = core_with(1)
    pooled = core.producers.acquire()
    core.producers.release(pooled)
    published, ops = send_quick(core, lambda op: [5, 1, 0, 0, None])
    assert published == Published(0, 5) and ops[0].script == "publish" and ops[0].args[2] == 1
    assert pooled.sequences == {(core.name(T, N, S).path, 0): 1}
    assert core.producers.acquire() is pooled  # back in the pool


def test_the_quick_path_is_refused_with_nothing_borrowed_while_the_caches_are_cold() -> None:
    core = Core()
    pooled = core.producers.acquire()
    core.producers.release(pooled)
    assert core.quick_single(T, N, S, b"x", None, None) is None
    assert core.producers.acquire() is pooled
    assert Core(idempotent_publish=False).quick_single(T, N, S, b"x", None, None) is None


def test_a_quick_publish_without_producer_state_is_sent_once() -> None:
    core = Core(idempotent_publish=False)
    drive(core.settings(core.name(T, N, S)), lambda op: info(1))
    published, ops = send_quick(core, lambda op: [9, 1, 0, 0, None])
    assert published == Published(0, 9) and ops[0].args[1:3] == [b"", 0]
    with pytest.raises(ConnectionFailed):  # no sequence to send again under: the caller decides
        send_quick(core, lambda op: ConnectionFailed("lost"))


def test_a_held_producer_the_shard_forgot_raises_on_the_quick_path() -> None:
    core = core_with(1)
    producer = ProducerState("s" * 32)
    producer.sequences[(core.name(T, N, S).path, 0)] = 41
    with pytest.raises(SequenceError):
        send_quick(core, lambda op: SequenceError("gap"), producer)
    assert producer.producer_id is None and producer.sequences == {}  # starts over next time


def test_a_quick_publish_interrupted_forgets_its_producer_and_gives_it_back() -> None:
    core = core_with(1)
    pooled = core.producers.acquire()
    pooled.sequences[(core.name(T, N, S).path, 0)] = 9
    secret = pooled.producer_id
    core.producers.release(pooled)
    with pytest.raises(KeyboardInterrupt):
        send_quick(core, lambda op: KeyboardInterrupt())
    assert core.producers.acquire() is pooled
    assert pooled.producer_id != secret and pooled.sequences == {}  # outcome unknown: a new producer


# ---------------------------------------------------------------------- retention


def test_a_publish_past_the_slack_trims_its_shard() -> None:
    core = core_with(1)
    name = core.name(T, N, S)
    settings = core.cache.fresh_settings(name.path)
    assert settings is not None
    settings.max_len = 100

    def answer(op: Any) -> Any:
        if type(op) is Cmd:
            return [b"workers"]
        return [5]

    # 100 kept + 10 % slack: 110 records are still within it
    _none, ops = drive(core.retention.maybe_trim(name, settings, 0, [100, 10, 0, 0, b"0"]), answer)
    assert ops == []
    _none, ops = drive(core.retention.maybe_trim(name, settings, 0, [101, 10, 0, 0, b"0"]), answer)
    smembers, trim = ops
    assert smembers.args[0] == "SMEMBERS" and trim.script == "stream_trim" and trim.args == [1, "workers"]
    # the group's hash and redo set, by role
    group_keys = name.group_key_list(0, "workers")
    assert trim.keys[-3:] == [group_keys[GROUP_ROLES.index("group")], group_keys[GROUP_ROLES.index("redo")],
                              name.due_key(0)]


def test_a_sharded_rings_shards_read_back_and_forms_it_does_not_take() -> None:
    """What a sharded group's watcher passes on in its ring (plans.shards_points) reads
    back as written; any other form reads as nothing to take (the popper then watches
    from its own points)."""
    from felix_redis.plans import read_ring, read_shards_points, shards_points

    text = shards_points(1500, [(7, 1_796_610_000_123, -1), None, (0, 5, 250)])
    assert text == "1500:7.1796610000123.-1,?,0.5.250"
    assert read_shards_points(text, 3) == (1500, [(7, 1_796_610_000_123, -1), None, (0, 5, 250)])
    for bad in ["", "1500", "1500:7.1.-1,?", "x:?,?,?", "1500:7.1,?,?", "1500:7.1.a,?,?", "1500:?,?,?,?",
                # numbers a stream ID cannot hold (a forged ring must not make the block fail)
                "1500:99999999999999999999.1.-1,?,?", "1500:7.1234567890123456789.-1,?,?", "1500:7.1.-5,?,?",
                "99999999999999999999:?,?,?", "1500:\uff17.1.-1,?,?"]:
        assert read_shards_points(bad, 3) is None, bad
    for member in [b"12.3 99999999999999999999 5 -1", b"12.3 4 1234567890123456789 -1", b"12.3 4 5 -7",
                   b"12.3 -1 5 -1", b"12.3 4 -1 -1", "\u0661.3 4 5 -1".encode()]:
        assert read_ring([b"bell", member, 0]) is None, member
    ring = read_ring([b"bell", b"12.3 4 5 -1 " + text.encode(), 0])
    assert ring is not None and ring.shards == text and ring.next_offset == 4
    assert read_ring([b"bell", b"12.3 4 5 -1", 0]).shards == ""  # type: ignore[union-attr]
    assert read_ring([b"bell", b"12.3 4 5 -1 a b", 0]) is None


def test_a_ring_too_long_for_the_script_goes_without_the_shards() -> None:
    """With hundreds of shards the ring's SHARDS would pass what lua/group_poll.lua takes
    (MAX_RING_SHARDS): the watcher's call of the watch carries none (its ring's popper
    watches from its own points) rather than fail."""
    core = Core()
    state = PollState(1)
    name = core.name(T, N, S)
    poll = sharded_module.ShardedPoll.__new__(sharded_module.ShardedPoll)
    poll.cache, poll.group, poll.state, poll.shards = core.cache, G, state, 1024
    source = sharded_module.Source(0, name, None, list(range(1024)), {})  # type: ignore[arg-type]
    keys = [core.cache.group_shard_keys(name, shard, G)[0] for shard in range(1024)]
    now = time.monotonic()
    for shard in range(1, 1024):
        state.idle[0][shard] = (wake_points(keys[shard], [0, 0, 123456789, 1796610000123]), now + 5, now)
    assert poll.other_shards(source, 1500) == ""
    poll.shards = 4
    assert poll.other_shards(source, 1500).startswith("1500:123456789.")
