"""Bad input is refused with a named felix_redis error, before anything is written.

CONTRACT guarantee 9 and the Errors paragraph: every public call of the Python API, given a
bad name, claim, number, payload, an unknown stream/group/shard, or a felix key that holds
another Redis type, raises InvalidArgument / NotFound / StaleClaim / WrongKeyType /
GroupExists / StreamExists with a message naming what was wrong, and leaves the keyspace
exactly as it was (``unchanged()``). Runs on the real Redis and on memory://.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import felix_redis
from felix_redis import (
    FelixError,
    InvalidArgument,
    NotFound,
    Record,
    StaleClaim,
    StreamExists,
    WrongKeyType,
)
from felix_redis.keys import GROUP_ROLES, SHARD_ROLES

T, N, S, G = "acme", "prod", "jobs", "workers"
PATH = f"{T}/{N}/{S}"

Call = Callable[[str, str, str, str], Any]
HYPO = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=40, deadline=None)
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


def rec(shard: int = 0, offset: int = 0, attempts: int = 1) -> Record:
    return Record(shard, offset, attempts, b"x", None, 0)


def operations(c: felix_redis.Client, producer: felix_redis.IdempotentProducer) -> dict[str, Call]:
    """Every public call that names a stream, as a function of (tenant, namespace, stream,
    group). Calls whose label starts with ``group`` or ``sharded`` also name the group."""
    return {
        "stream_create": lambda t, n, s, g: c.stream_create(t, n, s),
        "stream_describe": lambda t, n, s, g: c.stream_describe(t, n, s),
        "stream_delete": lambda t, n, s, g: c.stream_delete(t, n, s),
        "publish": lambda t, n, s, g: c.publish(t, n, s, b"x"),
        "publish_shard": lambda t, n, s, g: c.publish(t, n, s, b"x", shard=0),
        "publish_batch": lambda t, n, s, g: c.publish_batch(t, n, s, [b"x", "y"]),
        "publish_keyed": lambda t, n, s, g: c.publish_keyed(t, n, s, "k", b"x"),
        "producer.publish": lambda t, n, s, g: producer.publish(t, n, s, b"x"),
        "producer.publish_batch": lambda t, n, s, g: producer.publish_batch(t, n, s, [b"x"]),
        "producer.publish_keyed": lambda t, n, s, g: producer.publish_keyed(t, n, s, "k", b"x"),
        "read": lambda t, n, s, g: c.read(t, n, s, 0, 0),
        "list_groups": lambda t, n, s, g: c.group_list(t, n, s),
        "group_create": lambda t, n, s, g: c.group_create(t, n, s, g),
        "group_configure": lambda t, n, s, g: c.group_configure(t, n, s, g, visibility_timeout_ms=1000),
        "group_delete": lambda t, n, s, g: c.group_delete(t, n, s, g),
        "group_poll": lambda t, n, s, g: c.group_poll(t, n, s, 0, g),
        "group_poll_as": lambda t, n, s, g: c.group_poll_as(t, n, s, 0, g, "w-1"),
        "group_ack": lambda t, n, s, g: c.group_ack(t, n, s, 0, g, 0),
        "group_ack_claim": lambda t, n, s, g: c.group_ack(t, n, s, 0, g, "0:0:1"),
        "group_ack_many": lambda t, n, s, g: c.group_ack_many(t, n, s, 0, g, [0, "0:0"]),
        "group_nack": lambda t, n, s, g: c.group_nack(t, n, s, 0, g, "0:0:1"),
        "group_nack_delay": lambda t, n, s, g: c.group_nack(t, n, s, 0, g, rec(), delay=1.5),
        "group_extend": lambda t, n, s, g: c.group_extend(t, n, s, 0, g, "0:0:1"),
        "group_extend_by": lambda t, n, s, g: c.group_extend(t, n, s, 0, g, rec(), by=2),
        "group_dead_letter": lambda t, n, s, g: c.group_dead_letter(t, n, s, 0, g, "0:0:1", reason="r"),
        "group_dead_letters": lambda t, n, s, g: c.group_dead_letters(t, n, s, 0, g),
        "group_redrive_all": lambda t, n, s, g: c.group_redrive(t, n, s, 0, g),
        "group_redrive_list": lambda t, n, s, g: c.group_redrive(t, n, s, 0, g, [0]),
        "group_discard_all": lambda t, n, s, g: c.group_discard(t, n, s, 0, g),
        "group_discard_list": lambda t, n, s, g: c.group_discard(t, n, s, 0, g, ["0:0"]),
        "group_describe": lambda t, n, s, g: c.group_describe(t, n, s, g),
        "sharded.poll": lambda t, n, s, g: c.group_sharded(t, n, s, g).poll(),
        "sharded.poll_consumer": lambda t, n, s, g: c.group_sharded(t, n, s, g, consumer="w-1").poll(4),
        "sharded.ack": lambda t, n, s, g: c.group_sharded(t, n, s, g).ack(rec()),
        "sharded.ack_many": lambda t, n, s, g: c.group_sharded(t, n, s, g).ack_many([rec()]),
        "sharded.nack": lambda t, n, s, g: c.group_sharded(t, n, s, g).nack(rec()),
        "sharded.nack_after": lambda t, n, s, g: c.group_sharded(t, n, s, g).nack_after(rec(), 1),
        "sharded.extend": lambda t, n, s, g: c.group_sharded(t, n, s, g).extend(rec()),
        "sharded.dead_letter": lambda t, n, s, g: c.group_sharded(t, n, s, g).dead_letter(rec(), "r"),
    }


def names_group(label: str) -> bool:
    return label.startswith(("group_", "sharded."))


def _labels() -> list[str]:
    class _Dummy:
        def __getattr__(self, name: str) -> Any:
            return None

    return list(operations(_Dummy(), _Dummy()))  # type: ignore[arg-type]


LABELS = _labels()
GROUP_LABELS = [label for label in LABELS if names_group(label)]
#: Calls on an existing stream that do not create anything when the group is unknown.
SETTLE_LABELS = [label for label in GROUP_LABELS if label != "group_create"]


def refused(exc: type[BaseException], call: Callable[[], Any], *words: str) -> BaseException:
    """``call()`` raises ``exc`` (a felix_redis error) whose message holds every word."""
    with pytest.raises(exc) as info:
        call()
    assert isinstance(info.value, FelixError), f"{type(info.value)!r} is not a FelixError"
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in message {message!r}"
    return info.value


@pytest.fixture
def producer(client: felix_redis.Client) -> felix_redis.IdempotentProducer:
    return client.idempotent_producer()


@pytest.fixture
def ops(stream: felix_redis.Client, producer: felix_redis.IdempotentProducer) -> dict[str, Call]:
    """The operations on a client whose stream acme/prod/jobs with group workers exists and
    whose producers hold an id (so a refused publish has nothing left to write)."""
    stream.stream_create(T, N, "warmup")
    stream.publish(T, N, "warmup", b"x")
    return operations(stream, producer)


@pytest.fixture
def store(backend: tuple[str, Any]) -> Any:
    """The raw client on the backend under test (to plant keys)."""
    return backend[1]


# ----------------------------------------------------------------------------- names

BAD_NAMES: list[Any] = [
    "", "a{b", "a}b", "{jobs}", "a:b", "a/b", "a b", " a", "a ", "a\tb", "a\nb", "a\x00b", "a\x7f",
    "a|b", "a*b", "a?b", "é", "jöbs", "名前", "\u200b", "a\u0301", "-a", ".a", "_a", "x" * 65,
    # (a list of good names is a group's streams in priority order: a list with a bad one)
    "x" * 10_240, None, 5, 0, True, b"jobs", 1.5, ["jobs", "a b"], {"a": 1},
]
SLOTS = ("tenant", "namespace", "stream", "group")


def _names_with(slot: str, bad: Any) -> list[Any]:
    good = [T, N, S, G]
    good[SLOTS.index(slot)] = bad
    return good


@pytest.mark.parametrize("label", LABELS)
def test_bad_names_are_refused(label: str, ops: dict[str, Call], unchanged: Callable[[], Any]) -> None:
    slots = SLOTS if names_group(label) else SLOTS[:3]
    with unchanged():
        for slot in slots:
            for bad in BAD_NAMES:
                err = refused(InvalidArgument, lambda s=slot, b=bad: ops[label](*_names_with(s, b)), slot)
                assert isinstance(err, ValueError)
                assert len(str(err)) < 400, "the message repeats a huge input"


def test_bad_names_in_stream_list(client: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    with unchanged():
        for bad in BAD_NAMES:
            if bad is None:
                continue  # None: any tenant / namespace
            refused(InvalidArgument, lambda b=bad: client.stream_list(b), "tenant")
            refused(InvalidArgument, lambda b=bad: client.stream_list(T, b), "namespace")


def test_bad_consumer_names(stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    with unchanged():
        for bad in BAD_NAMES:
            refused(InvalidArgument, lambda b=bad: stream.group_poll_as(T, N, S, 0, G, b), "consumer")
            if bad is not None:  # None: an anonymous sharded consumer
                refused(InvalidArgument, lambda b=bad: stream.group_sharded(T, N, S, G, consumer=b).poll(), "consumer")


@HYPO
@given(name=st.text(max_size=80))
def test_any_text_as_stream_name(name: str, stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    """A name is either refused (InvalidArgument) or valid and unknown (NotFound)."""
    expected = NotFound if NAME_RE.fullmatch(name) and name != S else InvalidArgument
    if name == S:
        return
    with unchanged():
        refused(expected, lambda: stream.publish(T, N, name, b"x"), "stream")
        refused(expected, lambda: stream.group_poll(T, N, name, 0, G), "stream")
        refused(expected, lambda: stream.stream_describe(T, N, name), "stream")


@HYPO
@given(name=st.text(max_size=80))
def test_any_text_as_group_name(name: str, stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    if name == G:
        return
    expected = NotFound if NAME_RE.fullmatch(name) else InvalidArgument
    with unchanged():
        refused(expected, lambda: stream.group_poll(T, N, S, 0, name), "group")
        refused(expected, lambda: stream.group_ack(T, N, S, 0, name, 0), "group")
        refused(expected, lambda: stream.group_describe(T, N, S, name), "group")


# ---------------------------------------------------------------- unknown stream, group, shard


@pytest.mark.parametrize("label", [label for label in LABELS if label != "stream_create"])
def test_unknown_stream(label: str, ops: dict[str, Call], unchanged: Callable[[], Any]) -> None:
    with unchanged():
        refused(NotFound, lambda: ops[label](T, N, "nope", G), f"{T}/{N}/nope")
        refused(NotFound, lambda: ops[label]("other", N, S, G), f"other/{N}/{S}")


@pytest.mark.parametrize("label", SETTLE_LABELS)
def test_unknown_group(label: str, ops: dict[str, Call], unchanged: Callable[[], Any]) -> None:
    with unchanged():
        refused(NotFound, lambda: ops[label](T, N, S, "ghost"), "ghost")


def shard_calls(c: felix_redis.Client, shard: Any) -> dict[str, Callable[[], Any]]:
    r = rec(shard) if isinstance(shard, int) and not isinstance(shard, bool) else rec()
    claim = f"{shard}:0:1"
    return {
        "publish": lambda: c.publish(T, N, S, b"x", shard=shard),
        "publish_batch": lambda: c.publish_batch(T, N, S, [b"x"], shard=shard),
        "read": lambda: c.read(T, N, S, shard, 0),
        "group_poll": lambda: c.group_poll(T, N, S, shard, G),
        "group_poll_as": lambda: c.group_poll_as(T, N, S, shard, G, "w-1"),
        "group_ack": lambda: c.group_ack(T, N, S, shard, G, 0),
        "group_ack_many": lambda: c.group_ack_many(T, N, S, shard, G, [0]),
        "group_nack": lambda: c.group_nack(T, N, S, shard, G, claim),
        "group_extend": lambda: c.group_extend(T, N, S, shard, G, claim),
        "group_dead_letter": lambda: c.group_dead_letter(T, N, S, shard, G, claim),
        "group_dead_letters": lambda: c.group_dead_letters(T, N, S, shard, G),
        "group_redrive": lambda: c.group_redrive(T, N, S, shard, G),
        "group_discard": lambda: c.group_discard(T, N, S, shard, G, [0]),
        "sharded.ack": lambda: c.group_sharded(T, N, S, G).ack(r),
        "sharded.nack": lambda: c.group_sharded(T, N, S, G).nack(r),
        "sharded.extend": lambda: c.group_sharded(T, N, S, G).extend(r),
        "sharded.dead_letter": lambda: c.group_sharded(T, N, S, G).dead_letter(r),
    }


def test_unknown_shard(stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    with unchanged():
        for label, call in shard_calls(stream, 5).items():
            err = refused(NotFound, call, "shard 5")
            assert "1 shard" in str(err), label
        for call in shard_calls(stream, 1024).values():
            refused(InvalidArgument, call, "shard")
        for shard in (-1, 2**63, True, "0", 0.0, None, [0]):
            for label, call in shard_calls(stream, shard).items():
                if label.startswith("sharded.") or (shard is None and label.startswith("publish")):
                    continue  # routed by the item's shard / None means "any shard"
                refused(InvalidArgument, call, "shard")


def test_sharded_item_of_negative_shard(stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    group = stream.group_sharded(T, N, S, G)
    with unchanged():
        for call in (group.ack, group.nack, group.extend, group.dead_letter):
            refused(InvalidArgument, lambda c=call: c(rec(-1)), "shard")


# ------------------------------------------------------------------------------ claims

MALFORMED_CLAIMS = [
    "", " ", "0", "0:1", ":", "::", "a:b:c", "0:1:0", "-1:2:3", "0:-1:1", "0:1:-1", "0:1:2:3", " 0:1:1x",
    "0:1:1x", "0x1:1:1", "0:1.0:1", "0:1:1.0", "0::1", ":0:1", "0:0:", "0:0:1 0", "0;0;1", "0-0-1",
    "+0:1:1", "0:1e3:1", "99999999999999999999:0:1", "0:99999999999999999999:1", "0:0:99999999999999999999",
    "0:0:1" + "1" * 200, "x" * 10_000,
]


@pytest.mark.parametrize("op", ["nack", "extend", "dead_letter"])
def test_malformed_claims(op: str, stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    call = getattr(stream, f"group_{op}")
    with unchanged():
        for claim in MALFORMED_CLAIMS:
            err = refused(InvalidArgument, lambda c=claim: call(T, N, S, 0, G, c), "claim")
            assert len(str(err)) < 400


def test_malformed_offsets_for_ack_redrive_discard(stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    bad: list[Any] = [c for c in MALFORMED_CLAIMS if c not in ("0:1",)]
    bad += [-1, 2**53, 2**64, True, False, 1.0, None, b"0", [0], object()]
    with unchanged():
        for ref in bad:
            refused(InvalidArgument, lambda r=ref: stream.group_ack(T, N, S, 0, G, r))
            refused(InvalidArgument, lambda r=ref: stream.group_ack_many(T, N, S, 0, G, [0, r]))
            refused(InvalidArgument, lambda r=ref: stream.group_redrive(T, N, S, 0, G, [r]))
            refused(InvalidArgument, lambda r=ref: stream.group_discard(T, N, S, 0, G, [r]))


def test_claim_numbers_out_of_range(stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    """Well-formed claims whose numbers no record can have: refused, nothing written."""
    with unchanged():
        refused(InvalidArgument, lambda: stream.group_nack(T, N, S, 0, G, "0:9999999999999999:1"), "offset")
        refused(InvalidArgument, lambda: stream.group_extend(T, N, S, 0, G, "0:0:9999999999999999"), "attempts")
        refused(InvalidArgument, lambda: stream.group_ack(T, N, S, 0, G, "0:9999999999999999"), "offset")
        refused(InvalidArgument, lambda: stream.group_nack(T, N, S, 0, G, "1:0:1"), "shard 1")
        refused(InvalidArgument, lambda: stream.group_nack(T, N, S, 0, G, "999999999:0:1"), "shard")
        refused(InvalidArgument, lambda: stream.group_nack(T, N, S, 0, G, 0), "claim")
        refused(InvalidArgument, lambda: stream.group_nack(T, N, S, 0, G, rec(attempts=0)), "attempts")
        refused(InvalidArgument, lambda: stream.group_ack(T, N, S, 0, G, rec(shard=1)), "shard 1")


def test_claims_of_records_not_held(stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    """Claims beyond the tail: NotFound; never delivered, stale or finished: StaleClaim."""
    stream.publish(T, N, S, b"a")
    stream.publish(T, N, S, b"b")
    [first] = stream.group_poll(T, N, S, 0, G, max_records=1)
    stream.group_ack(T, N, S, 0, G, first)
    [second] = stream.group_poll(T, N, S, 0, G, max_records=1)
    stream.group_nack(T, N, S, 0, G, second)
    stream.publish(T, N, S, b"c")
    with unchanged():
        for op in (stream.group_nack, stream.group_extend, stream.group_dead_letter):
            refused(NotFound, lambda o=op: o(T, N, S, 0, G, "0:3:1"), "offset 3")
            refused(NotFound, lambda o=op: o(T, N, S, 0, G, "0:4503599627370496:1"), "does not exist")
            refused(StaleClaim, lambda o=op: o(T, N, S, 0, G, "0:2:1"), "not been delivered")
            refused(StaleClaim, lambda o=op: o(T, N, S, 0, G, first), "finished")
            refused(StaleClaim, lambda o=op: o(T, N, S, 0, G, second), "not in flight")
        refused(NotFound, lambda: stream.group_ack(T, N, S, 0, G, 2), "not been delivered")
        refused(NotFound, lambda: stream.group_ack_many(T, N, S, 0, G, [2, 3]), "records 2, 3")
        refused(NotFound, lambda: stream.group_redrive(T, N, S, 0, G, [0]), "not a dead letter")
        refused(NotFound, lambda: stream.group_discard(T, N, S, 0, G, [1]), "not a dead letter")


def test_stale_attempts(stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    stream.publish(T, N, S, b"a")
    [held] = stream.group_poll(T, N, S, 0, G)
    with unchanged():
        for op in (stream.group_nack, stream.group_extend, stream.group_dead_letter):
            # attempts 2 of a record delivered once: no delivery said so (issue 25), not "stale"
            refused(StaleClaim, lambda o=op: o(T, N, S, 0, G, "0:0:2"), "does not match any delivery")
    assert held.attempts == 1


@HYPO
@given(text=st.text(max_size=40))
def test_any_text_as_claim(text: str, stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    """Any string given as a claim raises a named error and writes nothing."""
    with unchanged():
        for op in (stream.group_nack, stream.group_extend, stream.group_dead_letter, stream.group_ack):
            with pytest.raises((InvalidArgument, NotFound, StaleClaim)):
                op(T, N, S, 0, G, text)


@given(text=st.text(alphabet="0123456789:- x\n", max_size=30))
def test_parse_claim_accepts_only_claims(text: str) -> None:
    try:
        claim = felix_redis.parse_claim(text)
    except InvalidArgument as err:
        assert "claim" in str(err)
        return
    assert re.fullmatch(r"[0-9]+:[0-9]+:[0-9]+", text.strip())
    assert claim.attempts is not None and claim.attempts >= 1


@given(shard=st.integers(), offset=st.integers(), attempts=st.integers())
def test_parse_claim_integers(shard: int, offset: int, attempts: int) -> None:
    text = f"{shard}:{offset}:{attempts}"
    try:
        claim = felix_redis.parse_claim(text)
    except InvalidArgument:
        assert shard < 0 or offset < 0 or attempts < 1 or len(str(shard)) > 9 or max(offset, attempts) >= 10**16
        return
    assert (claim.shard, claim.offset, claim.attempts) == (shard, offset, attempts)


# ----------------------------------------------------------------------------- numbers

NOT_COUNTS: list[Any] = [0, -1, 1e9, 10_001, True, False, "5", 5.0, None, 2**64, [5]]


def test_bad_max_records(stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    group = stream.group_sharded(T, N, S, G)
    with unchanged():
        for bad in NOT_COUNTS:
            refused(InvalidArgument, lambda b=bad: stream.group_poll(T, N, S, 0, G, max_records=b), "max_records")
            refused(InvalidArgument, lambda b=bad: stream.group_poll_as(T, N, S, 0, G, "w", max_records=b),
                    "max_records")
            refused(InvalidArgument, lambda b=bad: group.poll(b), "max_records")
            refused(InvalidArgument, lambda b=bad: stream.read(T, N, S, 0, 0, count=b), "count")


NOT_SECONDS: list[Any] = [-1, -0.001, math.nan, 1e9, 604_801, True, "5", [1], 10**30]


def test_bad_durations(stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    group = stream.group_sharded(T, N, S, G)
    with unchanged():
        for bad in NOT_SECONDS:
            refused(InvalidArgument, lambda b=bad: stream.group_nack(T, N, S, 0, G, "0:0:1", delay=b), "delay")
            refused(InvalidArgument, lambda b=bad: stream.group_extend(T, N, S, 0, G, "0:0:1", by=b), "by")
            refused(InvalidArgument, lambda b=bad: stream.group_poll(T, N, S, 0, G, wait=b), "wait")
            refused(InvalidArgument, lambda b=bad: group.poll(1, wait=b), "wait")
            refused(InvalidArgument, lambda b=bad: group.nack(rec(), b), "delay")
            refused(InvalidArgument, lambda b=bad: group.nack_after(rec(), b), "delay")
            refused(InvalidArgument, lambda b=bad: group.extend(rec(), b), "by")
        refused(InvalidArgument, lambda: stream.group_nack(T, N, S, 0, G, "0:0:1", delay=None), "delay")
        for by in (0, 0.0001):
            refused(InvalidArgument, lambda b=by: stream.group_extend(T, N, S, 0, G, "0:0:1", by=b), "by")


@HYPO
@given(seconds=st.floats(min_value=-1e300, max_value=1e300))
def test_any_float_as_delay(seconds: float, stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    """A finite delay/wait/by is either refused (InvalidArgument) or accepted; the claim of a
    record that does not exist then says NotFound. Nothing is written either way."""
    valid = seconds >= 0 and round(seconds * 1000) <= 604_800_000
    with unchanged():
        refused(NotFound if valid else InvalidArgument,
                lambda: stream.group_nack(T, N, S, 0, G, "0:0:1", delay=seconds))
        refused(NotFound if valid and round(seconds * 1000) >= 1 else InvalidArgument,
                lambda: stream.group_extend(T, N, S, 0, G, "0:0:1", by=seconds))
        if not valid:
            refused(InvalidArgument, lambda: stream.group_poll(T, N, S, 0, G, wait=seconds), "wait")


@HYPO
@given(count=st.integers())
def test_any_integer_as_max_records(count: int, stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    if 1 <= count <= 10_000:
        assert stream.group_poll(T, N, S, 0, G, max_records=count) == []  # nothing published
        return
    with unchanged():
        refused(InvalidArgument, lambda: stream.group_poll(T, N, S, 0, G, max_records=count), "max_records")
        refused(InvalidArgument, lambda: stream.read(T, N, S, 0, 0, count=count), "count")


@HYPO
@given(offset=st.integers(max_value=-1) | st.integers(min_value=2**52 + 1))
def test_any_bad_integer_as_offset(offset: int, stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    with unchanged():
        refused(InvalidArgument, lambda: stream.group_ack(T, N, S, 0, G, offset), "offset")
        refused(InvalidArgument, lambda: stream.read(T, N, S, 0, offset), "offset")
        refused(InvalidArgument, lambda: stream.group_create(T, N, S, "g2", start=offset), "offset")


STREAM_SETTINGS: list[tuple[str, Any]] = [
    ("shards", 0), ("shards", 1025), ("shards", -1), ("shards", True), ("shards", "2"), ("shards", 2.0),
    ("shards", None), ("replication", 0), ("replication", 17), ("replication", True), ("replication", "1"),
    ("kind", "bogus"), ("kind", None), ("kind", 1), ("kind", ["queue"]),
    ("consistency", "strong"), ("consistency", None), ("retention_max_len", 0), ("retention_max_len", -1),
    ("retention_max_len", True), ("retention_max_len", 1.5), ("retention_max_len", 2**53),
    ("retention_max_age", 0), ("retention_max_age", -5), ("retention_max_age", "60"),
    ("max_payload", 0), ("max_payload", 512 * 1024 * 1024 + 1), ("max_payload", 16.0),
]


def test_bad_stream_settings(client: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    with unchanged():
        for field, value in STREAM_SETTINGS:
            refused(InvalidArgument, lambda f=field, v=value: client.stream_create(T, N, S, **{f: v}), field)


def test_replication_beyond_the_deployment_is_refused_unless_forced(
    redis_client: felix_redis.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """A lone redis-server holds one copy. replication=2 is refused, whatever the
    consistency, naming both numbers, before anything is written; force=True makes the
    stream with a warning, and then a quorum stream's writes (its creation included)
    raise NotReplicated until a replica is there."""
    for consistency in ("leader", "quorum"):
        with pytest.raises(InvalidArgument, match=r"replication=2 asks for 2 copies .* has 1 now"):
            redis_client.stream_create(T, N, S, replication=2, consistency=consistency)
    with pytest.raises(felix_redis.NotFound):
        redis_client.stream_describe(T, N, S)
    with caplog.at_level(logging.WARNING, logger="felix_redis"):
        assert redis_client.stream_create(T, N, S, replication=2, force=True)
        with pytest.raises(felix_redis.NotReplicated):
            redis_client.stream_create(T, N, "q", replication=2, consistency="quorum", force=True)
    assert caplog.text.count("created anyway (force)") == 2
    assert redis_client.publish(T, N, S, b"x").offset == 0
    with pytest.raises(felix_redis.NotReplicated):
        redis_client.publish(T, N, "q", b"x")


GROUP_SETTINGS: list[tuple[str, Any]] = [
    ("visibility_timeout_ms", 0), ("visibility_timeout_ms", -1), ("visibility_timeout_ms", 1e9),
    ("visibility_timeout_ms", 604_800_001), ("visibility_timeout_ms", True), ("visibility_timeout_ms", "5"),
    ("visibility_timeout_ms", 1000.0), ("max_attempts", 0), ("max_attempts", -1), ("max_attempts", 1_000_001),
    ("max_attempts", True), ("max_attempts", "5"), ("max_attempts", 5.0),
]


def test_bad_group_settings(stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    with unchanged():
        for field, value in GROUP_SETTINGS:
            refused(InvalidArgument, lambda f=field, v=value: stream.group_create(T, N, S, "g2", **{f: v}), field)
            refused(InvalidArgument, lambda f=field, v=value: stream.group_configure(T, N, S, G, **{f: v}), field)
        for start in ("middle", "EARLIEST", "", -1, 1.5, True, None, 2**53):
            refused(InvalidArgument, lambda s=start: stream.group_create(T, N, S, "g2", start=s), "start")


def test_bad_group_settings_from_environment(stream: felix_redis.Client, unchanged: Callable[[], Any],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with unchanged():
        monkeypatch.setenv("FELIX_GROUP_VISIBILITY_TIMEOUT_MS", "soon")
        refused(InvalidArgument, lambda: stream.group_create(T, N, S, "g2"), "FELIX_GROUP_VISIBILITY_TIMEOUT_MS")
        monkeypatch.setenv("FELIX_GROUP_VISIBILITY_TIMEOUT_MS", "0")
        refused(InvalidArgument, lambda: stream.group_create(T, N, S, "g2"),
                "visibility_timeout_ms ($FELIX_GROUP_VISIBILITY_TIMEOUT_MS)")
        monkeypatch.delenv("FELIX_GROUP_VISIBILITY_TIMEOUT_MS")
        monkeypatch.setenv("FELIX_GROUP_MAX_ATTEMPTS", "-3")
        refused(InvalidArgument, lambda: stream.group_create(T, N, S, "g2"), "max_attempts ($FELIX_GROUP_MAX_ATTEMPTS)")
        # given in the call, the environment is not consulted nor named
        refused(InvalidArgument, lambda: stream.group_create(T, N, S, "g2", max_attempts=0), "max_attempts must")


def test_start_beyond_the_tail(stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    stream.publish(T, N, S, b"a")
    stream.publish(T, N, S, b"b")
    with unchanged():
        refused(InvalidArgument, lambda: stream.group_create(T, N, S, "g2", start=3), "beyond the tail")
        refused(InvalidArgument, lambda: stream.group_create(T, N, S, "g2", start=2**52), "start offset")
        # A subscriber reading past the tail gets nothing (it waits for records), not an error.
        assert stream.read(T, N, S, 0, 2) == []
        assert stream.read(T, N, S, 0, 2**52) == []


def test_other_bad_arguments(stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    with unchanged():
        refused(InvalidArgument, lambda: stream.group_dead_letter(T, N, S, 0, G, "0:0:1", reason=5), "reason")
        refused(InvalidArgument, lambda: stream.group_dead_letter(T, N, S, 0, G, "0:0:1", reason=b"r"), "reason")
        refused(InvalidArgument, lambda: stream.group_dead_letter(T, N, S, 0, G, "0:0:1", reason="é" * 2049),
                "reason")
        refused(InvalidArgument, lambda: stream.group_poll_as(T, N, S, 0, G, None), "consumer")
        refused(InvalidArgument, lambda: stream.group_ack_many(T, N, S, 0, G, [0] * 10_001), "10000")
        refused(InvalidArgument, lambda: stream.group_redrive(T, N, S, 0, G, [0] * 10_001), "10000")
        refused(InvalidArgument, lambda: stream.group_discard(T, N, S, 0, G, [0] * 10_001), "10000")
        assert stream.group_ack_many(T, N, S, 0, G, []) == []
        assert stream.group_redrive(T, N, S, 0, G, []) == 0
        assert stream.group_discard(T, N, S, 0, G, ()) == 0


# ----------------------------------------------------------------------------- payloads


@pytest.fixture
def small(stream: felix_redis.Client, producer: felix_redis.IdempotentProducer) -> felix_redis.Client:
    """A stream acme/prod/small (max_payload=16, 2 shards); the client and producer have
    published once, so their producer ids exist before the test looks."""
    stream.stream_create(T, N, "small", shards=2, max_payload=16)
    stream.publish(T, N, "small", b"warm-up", shard=0)
    stream.publish(T, N, "small", b"warm-up", shard=1)
    producer.publish(T, N, "small", b"warm-up", shard=0)
    producer.publish(T, N, "small", b"warm-up", shard=1)
    return stream


def test_oversize_payloads(small: felix_redis.Client, producer: felix_redis.IdempotentProducer,
                           unchanged: Callable[[], Any]) -> None:
    c = small
    big, fits = b"x" * 17, b"x" * 16
    with unchanged():
        for shard in (0, 1, None):
            refused(InvalidArgument, lambda s=shard: c.publish(T, N, "small", big, shard=s), "17 bytes", "16")
            refused(InvalidArgument, lambda s=shard: c.publish(T, N, "small", "é" * 9, shard=s), "18 bytes")
            refused(InvalidArgument, lambda s=shard: c.publish_batch(T, N, "small", [fits, fits, big], shard=s),
                    "payload 2", "17 bytes")
            refused(InvalidArgument, lambda s=shard: producer.publish(T, N, "small", big, shard=s), "17 bytes")
            refused(InvalidArgument, lambda s=shard: producer.publish_batch(T, N, "small", [fits, big], shard=s),
                    "payload 1")
        refused(InvalidArgument, lambda: c.publish_keyed(T, N, "small", "k", big), "17 bytes")
        refused(InvalidArgument, lambda: producer.publish_keyed(T, N, "small", "k", big), "17 bytes")
    # the producer's sequence is intact: the next publish lands once
    assert producer.publish(T, N, "small", fits, shard=0).offset == 2
    assert c.publish(T, N, "small", fits, shard=1).offset == 2


BAD_PAYLOADS: list[Any] = [5, None, {"a": 1}, 1.5, True, ["x"], object()]


def test_payloads_of_the_wrong_type(stream: felix_redis.Client, producer: felix_redis.IdempotentProducer,
                                    unchanged: Callable[[], Any]) -> None:
    with unchanged():
        for bad in BAD_PAYLOADS:
            name = type(bad).__name__
            refused(InvalidArgument, lambda b=bad: stream.publish(T, N, S, b), "payload", name)
            refused(InvalidArgument, lambda b=bad: stream.publish_keyed(T, N, S, "k", b), "payload", name)
            refused(InvalidArgument, lambda b=bad: stream.publish_batch(T, N, S, [b"ok", b]), "payload", name)
            refused(InvalidArgument, lambda b=bad: producer.publish(T, N, S, b), "payload", name)
            refused(InvalidArgument, lambda b=bad: producer.publish_keyed(T, N, S, "k", b), "payload", name)
            refused(InvalidArgument, lambda b=bad: producer.publish_batch(T, N, S, [b]), "payload", name)
        refused(InvalidArgument, lambda: stream.publish_batch(T, N, S, []), "empty")
        refused(InvalidArgument, lambda: producer.publish_batch(T, N, S, []), "empty")
        refused(InvalidArgument, lambda: stream.publish_batch(T, N, S, [b"x"] * 10_001), "10000")


BAD_KEYS: list[Any] = ["", b"", 5, None, 1.5, ["k"], "k" * 1025, b"k" * 1025, "é" * 513]


def test_bad_record_keys(stream: felix_redis.Client, producer: felix_redis.IdempotentProducer,
                         unchanged: Callable[[], Any]) -> None:
    with unchanged():
        for bad in BAD_KEYS:
            if bad is None:
                continue  # publish(key=None) means "no key"
            refused(InvalidArgument, lambda b=bad: stream.publish_keyed(T, N, S, b, b"x"), "key")
            refused(InvalidArgument, lambda b=bad: producer.publish_keyed(T, N, S, b, b"x"), "key")
            refused(InvalidArgument, lambda b=bad: stream.publish(T, N, S, b"x", key=b), "key")


# ------------------------------------------------------------------ keys of the wrong type


def role_key(c: felix_redis.Client, role: str, group: str = G, shard: int = 0, stream: str = S) -> str:
    name = c.core.name(T, N, stream)
    if role in SHARD_ROLES:
        return name.shard_keys(shard)[SHARD_ROLES.index(role)]
    if role == "groups":
        return name.groups_key(shard)
    return name.group_key_list(shard, group)[GROUP_ROLES.index(role)]


def plant(r: Any, key: str) -> None:
    """Overwrites ``key`` with a value of a type felix-redis never keeps there."""
    r.delete(key)
    r.set(key, b"planted by another application")


@pytest.fixture
def fresh(backend: tuple[str, Any]) -> Iterator[felix_redis.Client]:
    """A second client with nothing cached (its first call reads the stream's settings)."""
    c = felix_redis.connect(backend[0])
    yield c
    c.close()


@pytest.mark.parametrize("role", SHARD_ROLES)
def test_wrong_type_shard_keys(role: str, ops: dict[str, Call], stream: felix_redis.Client, store: Any,
                               fresh: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    """meta or log holds another type: every call on the stream, from a client that has the
    settings cached and from one that has not, raises WrongKeyType naming the key."""
    stream.publish(T, N, S, b"a")
    key = role_key(stream, role)
    plant(store, key)
    fresh_ops = operations(fresh, fresh.idempotent_producer())
    with unchanged():
        for label in LABELS:
            if label in ("stream_delete", "group_create"):
                continue  # below, with a group that does not exist yet / the whole keyspace
            refused(WrongKeyType, lambda lb=label: ops[lb](T, N, S, G), key)
            refused(WrongKeyType, lambda lb=label: fresh_ops[lb](T, N, S, G), key)
        refused(WrongKeyType, lambda: stream.group_create(T, N, S, "g2"), key)
        refused(WrongKeyType, lambda: fresh.group_create(T, N, S, "g2"), key)
        refused(WrongKeyType, lambda: stream.stream_delete(T, N, S), key)
        refused(WrongKeyType, lambda: fresh.stream_delete(T, N, S), key)


def test_wrong_type_groups_set(ops: dict[str, Call], stream: felix_redis.Client, store: Any,
                               fresh: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    key = role_key(stream, "groups")
    plant(store, key)
    fresh_ops = operations(fresh, fresh.idempotent_producer())
    with unchanged():
        for label in LABELS:
            if label in ("stream_create",):
                continue  # does not read the group set
            refused(WrongKeyType, lambda lb=label: fresh_ops[lb](T, N, S, G), key)
        for label in ("stream_describe", "list_groups", "group_delete"):
            refused(WrongKeyType, lambda lb=label: ops[lb](T, N, S, G), key)
        refused(WrongKeyType, lambda: stream.group_create(T, N, S, "g2"), key)
        refused(WrongKeyType, lambda: stream.stream_delete(T, N, S))


GROUP_STATE_ROLES = list(GROUP_ROLES)


@pytest.mark.parametrize("role", GROUP_STATE_ROLES)
def test_wrong_type_group_keys(role: str, ops: dict[str, Call], stream: felix_redis.Client, store: Any,
                               unchanged: Callable[[], Any]) -> None:
    """A key of group workers holds another type: every call on that group raises
    WrongKeyType naming the key; calls that do not touch the group still work."""
    stream.publish(T, N, S, b"a")
    key = role_key(stream, role)
    plant(store, key)
    with unchanged():
        for label in SETTLE_LABELS:
            refused(WrongKeyType, lambda lb=label: ops[lb](T, N, S, G), key)
        assert stream.stream_describe(T, N, S).groups == [G]
        assert [r.payload for r in stream.read(T, N, S, 0, 0)] == [b"a"]


@pytest.mark.parametrize("role", [r for r in GROUP_STATE_ROLES if r != "group"])
def test_wrong_type_keys_of_a_new_group(role: str, stream: felix_redis.Client, store: Any,
                                        unchanged: Callable[[], Any]) -> None:
    key = role_key(stream, role, group="g2")
    plant(store, key)
    with unchanged():
        refused(WrongKeyType, lambda: stream.group_create(T, N, S, "g2"), key)
        refused(WrongKeyType, lambda: stream.group_delete(T, N, S, "g2"), key)


def test_wrong_type_registry(stream: felix_redis.Client, store: Any, unchanged: Callable[[], Any]) -> None:
    plant(store, "felix:streams:acme")  # the tenant's registry
    with unchanged():
        refused(WrongKeyType, lambda: stream.stream_list(), "felix:streams:acme")
        refused(WrongKeyType, lambda: stream.stream_list(T, N), "felix:streams:acme")
        refused(WrongKeyType, lambda: stream.stream_list(T), "felix:streams:acme")
    assert stream.stream_list("other") == []  # another tenant's registry is its own


def test_wrong_type_tenants_set(stream: felix_redis.Client, store: Any, unchanged: Callable[[], Any]) -> None:
    plant(store, "felix:tenants")
    with unchanged():
        refused(WrongKeyType, lambda: stream.stream_list(), "felix:tenants")
    assert stream.stream_list(T) == [(T, N, S)]  # one tenant's listing reads its registry only


# -------------------------------------------------------------- connections and clients


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret@127.0.0.1:1/0",
        "redis://bob:s3cret@127.0.0.1:1/0",
    ],
)
def test_connection_failure_names_the_server_not_the_password(url: str) -> None:
    c = felix_redis.connect(url)
    calls: list[Callable[[], Any]] = [
        c.stream_list,
        lambda: c.publish(T, N, S, b"x"),
        # a new producer makes its secret without a round trip: its first publish connects
        lambda: c.idempotent_producer().publish(T, N, S, b"x"),
    ]
    for call in calls:
        with pytest.raises(felix_redis.ConnectionFailed) as info:
            call()
        err = info.value
        assert isinstance(err, ConnectionError) and isinstance(err, FelixError)
        assert "127.0.0.1:1" in str(err)
        assert "s3cret" not in str(err) and "s3cret" not in repr(err.args)
        assert err.__cause__ is None or "s3cret" not in str(err.__cause__)


def test_connection_failure_on_a_socket() -> None:
    c = felix_redis.connect("unix:///nonexistent/felix-test.sock")
    refused(felix_redis.ConnectionFailed, c.stream_list, "/nonexistent/felix-test.sock")


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:6379", "localhost:6379", "redis+bogus://h:1", "mongodb://:s3cret@h/0", "memcache://h"],
)
def test_unsupported_urls(url: Any) -> None:
    err = refused(InvalidArgument, lambda: felix_redis.connect(url), "URL")
    assert "s3cret" not in str(err)


def test_bad_sentinel_and_cluster_urls() -> None:
    for url in ("redis+sentinel://:s3cret@/mymaster/0", "redis+sentinel://h:notaport/m",
                "redis+sentinel://h:1/m/notadb", "redis+cluster://"):
        err = refused(InvalidArgument, lambda u=url: felix_redis.connect(u))
        assert "s3cret" not in str(err)


def test_client_needs_bytes_responses(redis_url: str, backend: tuple[str, Any]) -> None:
    import fakeredis

    refused(InvalidArgument, lambda: felix_redis.Client(redis.Redis.from_url(redis_url, decode_responses=True)),
            "decode_responses")
    refused(InvalidArgument, lambda: felix_redis.Client(redis.Redis(decode_responses=True)), "decode_responses")
    refused(InvalidArgument, lambda: felix_redis.Client(fakeredis.FakeRedis(decode_responses=True)),
            "decode_responses")


def test_bad_prefix(backend: tuple[str, Any]) -> None:
    for prefix in ("", "a b", "{x}", "a\n", None, 5):
        refused(InvalidArgument, lambda p=prefix: felix_redis.connect(backend[0], prefix=p), "prefix")


def test_sharded_settle_with_other_things(stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    """ShardedGroup settles take an Item, Record or claim string; anything else is refused."""
    group = stream.group_sharded(T, N, S, G)
    with unchanged():
        for call in (group.ack, group.nack, group.extend, group.dead_letter):
            for bad in (None, 0, b"0:0:1", 1.5, object()):
                refused(InvalidArgument, lambda c=call, b=bad: c(b))
            refused(NotFound, lambda c=call: c("0:0:1"), "0")
            if call != group.ack:  # ack takes SHARD:OFFSET; the others need the attempts
                refused(InvalidArgument, lambda c=call: c("0:0"), "claim")


def test_stream_delete_wrong_type_on_shard_0_of_two(client: felix_redis.Client, store: Any,
                                                    unchanged: Callable[[], Any]) -> None:
    """Shard 1 is not deleted when shard 0's log holds another type (settings cached)."""
    client.stream_create(T, N, S, shards=2)
    client.stream_describe(T, N, S)
    key = role_key(client, "log", shard=0)
    plant(store, key)
    with unchanged():
        refused(WrongKeyType, lambda: client.stream_delete(T, N, S), key)


# ------------------------------------------------ leaks found in review, fixed since


# --- 1. seconds_to_ms overflows on inf / huge floats
@HYPO
@given(seconds=st.sampled_from([math.inf, -math.inf, 1e306, 1.7976931348623157e308]) | st.floats(min_value=1e306))
def test_infinite_durations(seconds: float, stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    group = stream.group_sharded(T, N, S, G)
    with unchanged():
        refused(InvalidArgument, lambda: stream.group_nack(T, N, S, 0, G, "0:0:1", delay=seconds), "delay")
        refused(InvalidArgument, lambda: stream.group_extend(T, N, S, 0, G, "0:0:1", by=seconds), "by")
        refused(InvalidArgument, lambda: stream.group_poll(T, N, S, 0, G, wait=seconds), "wait")
        refused(InvalidArgument, lambda: group.poll(1, wait=seconds), "wait")
        refused(InvalidArgument, lambda: group.nack_after(rec(), seconds), "delay")


# --- 2. collections that are not collections
def test_batches_that_are_not_lists(stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    producer = stream.idempotent_producer()
    with unchanged():
        for bad in (None, 5, 5.0, "hello", b"hello"):
            refused(InvalidArgument, lambda b=bad: stream.publish_batch(T, N, S, b), "payloads")
            refused(InvalidArgument, lambda b=bad: producer.publish_batch(T, N, S, b), "payloads")
        for bad in (5, 5.0, "0:0:1", b"0"):
            refused(InvalidArgument, lambda b=bad: stream.group_ack_many(T, N, S, 0, G, b), "offsets")
            refused(InvalidArgument, lambda b=bad: stream.group_redrive(T, N, S, 0, G, b), "offsets")
            refused(InvalidArgument, lambda b=bad: stream.group_discard(T, N, S, 0, G, b), "offsets")
            refused(InvalidArgument, lambda b=bad: stream.group_sharded(T, N, S, G).ack_many(b), "items")


# --- 4. publish_keyed(key=None) publishes an unkeyed record instead of refusing
def test_publish_keyed_needs_a_key(stream: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    producer = stream.idempotent_producer()
    with unchanged():
        refused(InvalidArgument, lambda: stream.publish_keyed(T, N, S, None, b"x"), "key")
        refused(InvalidArgument, lambda: producer.publish_keyed(T, N, S, None, b"x"), "key")


# --- 5. claims with non-ASCII digits are accepted
def test_claims_are_ascii() -> None:
    for text in ("\u0660:\u0660:\u0661", "\uff10:\uff10:\uff11", "0:\u0967\u096b:1"):
        refused(InvalidArgument, lambda t=text: felix_redis.parse_claim(t), "claim")


# --- 6. clients and URLs
def test_client_of_something_that_is_not_a_redis_client() -> None:
    for bad in (None, "redis://localhost:6379/0", 5, object()):
        refused(InvalidArgument, lambda b=bad: felix_redis.Client(b), "Redis client")


def test_url_that_is_not_a_string() -> None:
    for bad in (123, b"redis://localhost", ["redis://localhost"]):
        refused(InvalidArgument, lambda b=bad: felix_redis.connect(b), "URL")


def test_bad_port_and_db_in_plain_urls() -> None:
    for url in ("redis://:s3cret@127.0.0.1:notaport/0", "redis://127.0.0.1:99999/0", "redis://127.0.0.1:1/notadb"):
        err = refused(InvalidArgument, lambda u=url: felix_redis.connect(u))
        assert "s3cret" not in str(err)


def test_unreachable_cluster_is_a_connection_failure() -> None:
    with pytest.raises(felix_redis.ConnectionFailed) as info:
        felix_redis.connect("redis+cluster://:s3cret@127.0.0.1:1").stream_list()
    assert "127.0.0.1:1" in str(info.value) and "s3cret" not in str(info.value)


# --- 7. replication=2 on memory://
def test_replication_on_memory(backend: tuple[str, Any], client: felix_redis.Client,
                               unchanged: Callable[[], Any]) -> None:
    """memory:// can never have a replica: replication=2 is refused, nothing written, even
    with force. A real server only lacks one now: refused too, unless forced (see the test
    above)."""
    if backend[0].startswith("memory://"):
        with unchanged():
            refused(InvalidArgument, lambda: client.stream_create(T, N, S, replication=2, force=True),
                    "replication=2", "single copy")
    else:
        with unchanged():
            refused(InvalidArgument, lambda: client.stream_create(T, N, S, replication=2), "replication=2",
                    "has 1 now")
        assert client.stream_create(T, N, S, replication=2, force=True)


def test_stream_create_with_wrong_type_registry(client: felix_redis.Client, store: Any,
                                                unchanged: Callable[[], Any]) -> None:
    plant(store, "felix:streams:acme")
    with unchanged():
        refused(WrongKeyType, lambda: client.stream_create(T, N, S), "felix:streams:acme")


def test_stream_delete_with_wrong_type_registry(stream: felix_redis.Client, store: Any,
                                                unchanged: Callable[[], Any]) -> None:
    plant(store, "felix:streams:acme")
    with unchanged():
        refused(WrongKeyType, lambda: stream.stream_delete(T, N, S), "felix:streams:acme")


# --- 9. wrong class / silent deletes for wrong-type group keys
def test_group_create_over_a_wrong_type_group_hash(stream: felix_redis.Client, store: Any,
                                                   unchanged: Callable[[], Any]) -> None:
    key = role_key(stream, "group", group="g2")
    plant(store, key)
    with unchanged():
        refused(WrongKeyType, lambda: stream.group_create(T, N, S, "g2"), key)


# --- 10. foreign data inside felix keys of the right type
def test_stream_list_with_a_foreign_registry_member(stream: felix_redis.Client, store: Any,
                                                    unchanged: Callable[[], Any]) -> None:
    # foreign members, and a path of another tenant planted in this tenant's registry
    store.zadd("felix:streams:acme", {"not-a-stream-path": 0, "beta/prod/jobs": 0})
    with unchanged():
        assert stream.stream_list() == [(T, N, S)]  # foreign members are passed over
        assert stream.stream_list(T) == [(T, N, S)]


def test_dead_letters_with_a_foreign_entry(stream: felix_redis.Client, store: Any,
                                           unchanged: Callable[[], Any]) -> None:
    store.hset(role_key(stream, "dead"), "0", "garbage")
    with unchanged(), pytest.raises(FelixError):
        stream.group_dead_letters(T, N, S, 0, G)

@pytest.mark.parametrize("op", ["group_configure", "group_delete"])
def test_group_change_wrong_type_on_shard_1(op: str, client: felix_redis.Client, store: Any,
                                            unchanged: Callable[[], Any]) -> None:
    client.stream_create(T, N, S, shards=2)
    client.group_create(T, N, S, G)
    key = role_key(client, "lease", shard=1)
    plant(store, key)
    kwargs = {"visibility_timeout_ms": 1000} if op == "group_configure" else {}
    with unchanged():
        refused(WrongKeyType, lambda: getattr(client, op)(T, N, S, G, **kwargs), key)



def test_group_create_start_beyond_one_shards_tail(client: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    client.stream_create(T, N, S, shards=2)
    for _ in range(5):
        client.publish(T, N, S, b"x", shard=1)
    with unchanged():
        refused(InvalidArgument, lambda: client.group_create(T, N, S, G, start=3), "beyond the tail")



def test_group_create_wrong_type_on_shard_0(client: felix_redis.Client, store: Any,
                                            unchanged: Callable[[], Any]) -> None:
    client.stream_create(T, N, S, shards=2)
    key = role_key(client, "lease", shard=0)
    plant(store, key)
    with unchanged():
        refused(WrongKeyType, lambda: client.group_create(T, N, S, G), key)



# --- 8. writes before the error on multi-shard streams
def test_stream_create_with_other_shard_count(client: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    client.stream_create(T, N, S)
    with unchanged():
        refused(StreamExists, lambda: client.stream_create(T, N, S, shards=2), "shards")



@pytest.mark.parametrize("role", ["group", "lease", "dead"])
def test_stream_delete_over_wrong_type_group_keys(role: str, stream: felix_redis.Client, store: Any,
                                                  unchanged: Callable[[], Any]) -> None:
    key = role_key(stream, role)
    plant(store, key)
    with unchanged():
        refused(WrongKeyType, lambda: stream.stream_delete(T, N, S), key)




def test_a_published_is_not_a_list_of_offsets(client: felix_redis.Client, unchanged: Callable[[], Any]) -> None:
    """Published is a tuple (shard, offset); passed where a list of offsets goes it would
    name offsets 'shard' and 'offset': refused, nothing changed."""
    client.stream_create(T, N, S)
    client.group_create(T, N, S, "g")
    published = client.publish(T, N, S, b"x")
    with unchanged():
        for call in (lambda: client.group_discard(T, N, S, 0, "g", published),
                     lambda: client.group_redrive(T, N, S, 0, "g", published),
                     lambda: client.group_ack_many(T, N, S, 0, "g", published)):
            refused(InvalidArgument, call, "must be a list", "Published")
