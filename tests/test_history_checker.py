"""The history checker (tests/support/history.py) on hand-made histories: a clean one passes,
and each kind of violation is flagged under the invariant it breaks. No Redis needed."""

from __future__ import annotations

import pytest

import felix_redis
from felix_redis.models import ShardState
from tests.support.history import CheckReport, Delivered, FinalState, History, check, classify

VT = 5.0  # visibility timeout, s
MAX = 3  # max attempts


def shard(s: int, tail: int, position: int | None = None, in_flight: int = 0, owed: int = 0) -> ShardState:
    position = tail if position is None else position
    return ShardState(s, position, tail, tail - position, 0, owed, in_flight, 0, None)


def final(records: dict[int, list[bytes]], *, positions: dict[int, int] | None = None,
          dead: dict[tuple[int, int], int] | None = None, subscribed: bool = True) -> FinalState:
    rows = {s: list(enumerate(payloads)) for s, payloads in records.items()}
    describe = [shard(s, len(p), (positions or {}).get(s)) for s, p in records.items()]
    return FinalState(describe, rows, {s: list(r) for s, r in rows.items()} if subscribed else None, dead or {})


def base() -> History:
    """Two records on shard 0, published, delivered, acked, and a position sample."""
    h = History()
    h.add("publish", invoked=0.0, completed=0.1, shard=0, payload=b"a", offset=0)
    h.add("publish", invoked=0.2, completed=0.3, shard=0, payload=b"b", offset=1)
    h.add("poll", invoked=0.4, completed=0.5, shard=0,
          records=(Delivered(0, 0, 1, b"a"), Delivered(0, 1, 1, b"b")))
    h.add("ack", invoked=0.6, completed=0.7, shard=0, claims=((0, 0, 1), (0, 1, 1)))
    h.add("describe", process="sampler", invoked=0.8, completed=0.9, positions=(2,))
    return h


def run(h: History, f: FinalState, **kwargs: object) -> CheckReport:
    return check(h, f, visibility_timeout=VT, max_attempts=MAX, **kwargs)  # type: ignore[arg-type]


def kinds(report: CheckReport) -> set[str]:
    return {f"{a.check}:{a.kind}" for a in report.violations()}


def test_a_clean_history_passes() -> None:
    report = run(base(), final({0: [b"a", b"b"]}))
    assert report.anomalies == []
    assert (report.acknowledged, report.lost, report.missing, report.deliveries, report.samples) == (2, 0, 0, 2, 1)
    assert report.lease_pairs == 0


def test_lost_acknowledged_publish_is_flagged_and_counted() -> None:
    h = base()
    h.add("publish", invoked=1.0, completed=1.1, shard=0, payload=b"c", offset=2)
    report = run(h, final({0: [b"a", b"b"]}))
    assert report.lost == 1 and report.missing == 1
    assert kinds(report) == {"a:lost", "a:missing from log"}


def test_acknowledged_publish_in_the_log_but_never_delivered_is_lost() -> None:
    h = base()
    h.add("publish", invoked=1.0, completed=1.1, shard=0, payload=b"c", offset=2)
    report = run(h, final({0: [b"a", b"b", b"c"]}, positions={0: 2}))
    assert report.lost == 1 and report.missing == 0
    assert kinds(report) == {"a:lost", "e:not drained"}


def test_delivered_then_rolled_back_is_missing_not_lost() -> None:
    h = base()
    h.add("publish", invoked=1.0, completed=1.01, shard=0, payload=b"c", offset=2)
    h.add("poll", invoked=1.02, completed=1.03, shard=0, records=(Delivered(0, 2, 1, b"c"),))
    h.add("ack", invoked=1.04, completed=1.05, shard=0, claims=((0, 2, 1),))
    report = run(h, final({0: [b"a", b"b"]}))
    assert (report.lost, report.missing) == (0, 1)
    assert kinds(report) == {"a:missing from log"}
    # the same under leader consistency with the publish inside a rollback window: explained
    explained = run(h, final({0: [b"a", b"b"]}), rollback_windows=[(0.9, 2.0)])
    assert explained.violations() == [] and explained.missing == 1
    # a window that does not cover the publish explains nothing
    assert kinds(run(h, final({0: [b"a", b"b"]}), rollback_windows=[(5.0, 6.0)])) == {"a:missing from log"}


def test_unknown_outcome_publishes_are_counted_apart() -> None:
    h = base()
    h.add("publish", invoked=1.0, completed=2.0, outcome="info", shard=0, payload=b"c",
          error="ConnectionFailed: lost")
    h.add("publish", invoked=1.0, completed=2.0, outcome="info", shard=0, payload=b"d", error="NotReplicated: 0")
    h.add("publish", invoked=1.0, outcome="pending", shard=0, payload=b"e")
    h.add("poll", invoked=2.1, completed=2.2, shard=0, records=(Delivered(0, 2, 1, b"c"),))
    h.add("ack", invoked=2.3, completed=2.4, shard=0, claims=((0, 2, 1),))
    report = run(h, final({0: [b"a", b"b", b"c"]}))
    assert report.anomalies == []
    assert (report.unknown, report.unknown_landed, report.unknown_absent) == (3, 1, 2)


def test_dead_lettered_publish_is_not_lost() -> None:
    h = base()
    h.add("publish", invoked=1.0, completed=1.1, shard=0, payload=b"c", offset=2)
    report = run(h, final({0: [b"a", b"b", b"c"]}, dead={(0, 2): 3}))
    assert report.anomalies == [] and report.lost == 0


def test_failed_publish_that_landed_and_unexpected_records() -> None:
    h = base()
    h.add("publish", invoked=1.0, completed=1.1, outcome="fail", shard=0, payload=b"c",
          error="InvalidArgument: too big")
    h.add("poll", invoked=1.2, completed=1.3, shard=0,
          records=(Delivered(0, 2, 1, b"c"), Delivered(0, 3, 1, b"zz")))
    h.add("ack", invoked=1.4, completed=1.5, shard=0, claims=((0, 2, 1), (0, 3, 1)))
    report = run(h, final({0: [b"a", b"b", b"c", b"zz"]}))
    assert kinds(report) == {"a:failed publish landed", "a:unexpected record"}


def test_b_an_offset_with_two_payloads() -> None:
    h = base()
    h.add("publish", invoked=1.0, completed=1.1, outcome="info", shard=0, payload=b"x", error="ConnectionFailed")
    h.add("poll", invoked=1.2, completed=1.3, shard=0, records=(Delivered(0, 1, 2, b"x"),))
    report = run(h, final({0: [b"a", b"b"]}))
    assert "b:offset holds two payloads" in kinds(report)
    # under leader consistency, the other payload (absent from the final log) was rolled back
    leader = run(h, final({0: [b"a", b"b"]}), rollback_windows=[(0.5, 2.0)])
    assert "b:offset holds two payloads" not in kinds(leader)
    assert "b:offset holds two payloads" in {f"{a.check}:{a.kind}" for a in leader.explained()}


def test_b_an_acknowledged_offset_holding_another_payload() -> None:
    h = base()
    h.add("publish", invoked=1.0, completed=1.1, shard=0, payload=b"c", offset=1)  # told offset 1 again
    report = run(h, final({0: [b"a", b"b", b"c"]}, positions={0: 2}))
    assert {"b:offset holds two payloads", "b:payload at two offsets"} <= kinds(report)


def test_b_a_payload_stored_twice() -> None:
    h = base()
    report = run(h, final({0: [b"a", b"b", b"b"]}, positions={0: 2}))
    assert "b:payload stored twice" in kinds(report)


def test_c_a_gap_in_the_offsets() -> None:
    h = base()
    f = final({0: [b"a", b"b"]})
    f.records[0] = [(0, b"a")]
    f.subscribed = {0: [(0, b"a")]}
    report = run(h, f)
    assert "c:gap" in kinds(report)


def test_c_past_the_tail_and_read_subscribe_disagree() -> None:
    h = base()
    f = final({0: [b"a", b"b"]})
    f.describe = [shard(0, 1)]
    f.subscribed = {0: [(0, b"a")]}
    assert {"c:past tail", "c:read/subscribe differ"} <= kinds(run(h, f))


def _two_deliveries(second_at: float, *, settle: tuple[str, float] | None = None, attempts: tuple[int, int] = (1, 2),
                    ) -> History:
    h = History()
    h.add("publish", invoked=0.0, completed=0.01, shard=0, payload=b"a", offset=0)
    h.add("poll", process="w1", invoked=1.0, completed=1.01, shard=0, records=(Delivered(0, 0, attempts[0], b"a"),))
    if settle is not None:
        kind, at = settle
        h.add(kind, process="w1", invoked=at, completed=at + 0.01, shard=0, claims=((0, 0, attempts[0]),))
    h.add("poll", process="w2", invoked=second_at - 0.01, completed=second_at, shard=0,
          records=(Delivered(0, 0, attempts[1], b"a"),))
    h.add("ack", process="w2", invoked=second_at + 0.01, completed=second_at + 0.02, shard=0,
          claims=((0, 0, attempts[1]),))
    return h


def test_d_a_second_lease_while_the_first_is_valid() -> None:
    report = run(_two_deliveries(3.0), final({0: [b"a"]}))
    assert kinds(report) == {"d:two valid leases"}
    assert report.lease_pairs == 1 and report.min_lease_gap is not None and report.min_lease_gap < 0


@pytest.mark.parametrize("settle", [("nack", 2.0), ("ack", 2.0)])
def test_d_a_second_lease_after_a_nack_or_ack(settle: tuple[str, float]) -> None:
    assert run(_two_deliveries(3.0, settle=settle), final({0: [b"a"]})).anomalies == []


def test_d_a_second_lease_after_the_first_lapsed() -> None:
    assert run(_two_deliveries(1.0 + VT + 0.1), final({0: [b"a"]})).anomalies == []


def test_d_a_reclaim_by_the_same_named_consumer_ends_the_lease() -> None:
    h = _two_deliveries(3.0)
    h.ops[1].consumer = h.ops[2].consumer = "c1"
    h.ops[2].reclaim = True
    assert run(h, final({0: [b"a"]})).anomalies == []
    h.ops[2].consumer = "c2"  # another consumer's poll reclaims only its own
    assert kinds(run(h, final({0: [b"a"]}))) == {"d:two valid leases"}


def test_d_a_nack_of_another_attempt_does_not_end_the_lease() -> None:
    h = _two_deliveries(3.0, settle=("nack", 2.0))
    h.ops[2].claims = ((0, 0, 7),)
    assert kinds(run(h, final({0: [b"a"]}))) == {"d:two valid leases"}


def test_d_the_same_attempt_twice_and_attempts_out_of_order() -> None:
    twice = run(_two_deliveries(1.0 + VT + 1, attempts=(1, 1)), final({0: [b"a"]}))
    assert kinds(twice) == {"d:attempt handed out twice"}
    backwards = _two_deliveries(0.5, attempts=(2, 1))  # attempt 1 returned before attempt 2 was asked for?
    backwards.ops[1].records = (Delivered(0, 0, 2, b"a"),)
    backwards.ops[2].records = (Delivered(0, 0, 3, b"a"),)
    backwards.ops[2].invoked, backwards.ops[2].completed = 0.3, 0.4
    assert "d:attempts out of order" in kinds(run(backwards, final({0: [b"a"]})))
    # explained when one of the hand-outs lies in a rollback window (leader consistency)
    assert run(_two_deliveries(3.0), final({0: [b"a"]}), rollback_windows=[(0.0, 1.5)]).violations() == []


def test_d_more_deliveries_than_max_attempts() -> None:
    h = _two_deliveries(1.0 + VT + 1, attempts=(3, 4))
    assert kinds(run(h, final({0: [b"a"]}))) == {"d:attempts out of range"}


def test_e_a_sampled_position_above_an_unacked_record() -> None:
    h = base()
    h.ops[4].invoked, h.ops[4].completed = 0.42, 0.5  # read before the ack was even sent
    report = run(h, final({0: [b"a", b"b"]}))
    assert kinds(report) == {"e:position passed an unfinished record"}


def test_e_a_sampled_position_above_every_record_published() -> None:
    h = base()
    h.ops[4].positions = (3,)
    assert kinds(run(h, final({0: [b"a", b"b"]}))) == {"e:position passed an unfinished record"}


def test_e_a_position_may_pass_a_record_that_could_have_lapsed_to_a_dead_letter() -> None:
    h = History()
    h.add("publish", invoked=0.0, completed=0.01, shard=0, payload=b"a", offset=0)
    h.add("poll", invoked=0.02, completed=0.03, shard=0, records=(Delivered(0, 0, 1, b"a"),))
    h.add("describe", process="sampler", invoked=MAX * VT + 0.1, completed=MAX * VT + 0.2, positions=(1,))
    report = run(h, final({0: [b"a"]}, dead={(0, 0): MAX}))
    assert report.anomalies == []
    h.ops[2].invoked, h.ops[2].completed = VT, VT + 0.1  # too early for MAX lapses
    assert kinds(run(h, final({0: [b"a"]}, dead={(0, 0): MAX}))) == {"e:position passed an unfinished record"}


def test_e_final_position_passed_a_record_never_delivered_or_never_acked() -> None:
    h = base()
    h.add("publish", invoked=1.0, completed=1.1, shard=0, payload=b"c", offset=2)
    assert "e:finished without a delivery" in kinds(run(h, final({0: [b"a", b"b", b"c"]})))
    h.add("poll", invoked=1.2, completed=1.3, shard=0, records=(Delivered(0, 2, 1, b"c"),))
    assert kinds(run(h, final({0: [b"a", b"b", b"c"]}))) == {"e:finished without an ack"}


def test_e_not_drained() -> None:
    f = final({0: [b"a", b"b"]})
    f.describe = [ShardState(0, 2, 2, 0, 0, 1, 0, 0, None)]
    assert kinds(run(base(), f)) == {"e:not drained"}


def test_recorder_ops_and_classification() -> None:
    h = History()
    op = h.invoke("w0", "publish", shard=0, payload=b"x")
    assert op.outcome == "pending" and op.end == float("inf")
    op.failed(felix_redis.NotReplicated("0 of 1"))
    assert (op.outcome, op.error) == ("info", "NotReplicated: 0 of 1") and op.completed >= op.invoked
    assert classify(felix_redis.ConnectionFailed("gone")) == "info"
    assert classify(TimeoutError()) == "info"  # anything unexpected: unknown outcome
    assert classify(felix_redis.StaleClaim("lapsed")) == "fail"
    assert classify(felix_redis.NotFound("no group")) == "fail"
    with pytest.raises(ValueError, match="published twice"):
        h.add("publish", payload=b"x", shard=0)
        run(h, final({0: []}))
