"""The idempotent producer and idempotent plain publishes: a re-send of a (producer
secret, sequence) the shard holds returns the original offsets and appends nothing."""

from __future__ import annotations

import hashlib
import re
import threading
import time
from typing import Any

import pytest
import redis

import felix_redis
from felix_redis.errors import from_response
from felix_redis.keys import producer_field, producer_public_id
from felix_redis.protocol import Eval, ProducerState, Sleep, new_producer_secret
from tests.support.scripts import run_script

T, N, S = "acme", "prod", "jobs"


def tail(client: felix_redis.Client, shard: int = 0) -> int:
    return client.stream_describe(T, N, S).tails[shard]


def lose_replies(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch, times: int = 1,
                 land: bool = True) -> list[Any]:
    """The next ``times`` publish scripts run for real (if ``land``) and then their reply
    is lost: the client sees ConnectionFailed. Returns every op executed.

    This patches ``Client._execute``, above the driver's retry loop: it tests the
    publish plans (a producer's re-send with the same sequence), on memory:// too. The
    driver's own retries after a lost connection are tested through a proxy that cuts
    real connections (tests/test_transport_faults.py)."""
    real = client._execute
    ops: list[Any] = []
    left = [times]

    def lossy(op: Any) -> Any:
        ops.append(op)
        if type(op) is Eval and op.script == "publish" and left[0] > 0:
            left[0] -= 1
            if land:
                real(op)
            raise felix_redis.ConnectionFailed("simulated: connection reset before the reply")
        return real(op)

    monkeypatch.setattr(client, "_execute", lossy)
    return ops


def meta_key(client: felix_redis.Client, shard: int = 0) -> str:
    return client.core.name(T, N, S).shard_keys(shard)[0]


def producer_fields(client: felix_redis.Client, shard: int = 0) -> dict[bytes, bytes]:
    """The producer states in a shard's meta hash, by field."""
    meta = client.redis.hgetall(meta_key(client, shard))
    return {f: v for f, v in meta.items() if f.startswith(b"producer:")}


def secret_of(producer: felix_redis.IdempotentProducer) -> str:
    """The producer's secret (what publish.lua takes as ARGV[2]); ``producer.id`` is its
    public id, the digest naming its meta field."""
    secret = producer._state.producer_id
    assert secret is not None
    return secret


def state_mac(secret: str, five: str) -> str:
    """The MAC publish.lua puts after a state's five numbers (lua/includes/producer.lua)."""
    return hashlib.sha1(f"{secret} {five}".encode()).hexdigest()[:16]


def run_publish_script(client: felix_redis.Client, secret: str, seq: int, *payloads: bytes,
                       idle_ms: int = 3_600_000) -> list[Any]:
    keys = client.core.name(T, N, S).publish_keys(0)
    return run_script(client, "publish", keys, [b"", secret, seq, idle_ms, b"", b"", b"", *(payloads or [b"payload"])])


def script_error(client: felix_redis.Client, secret: str, seq: int, *payloads: bytes) -> Exception | None:
    try:
        run_publish_script(client, secret, seq, *payloads)
    except redis.exceptions.ResponseError as exc:
        return from_response(str(exc))
    return None


# ----------------------------------------------------------------------- ids


def test_producers_get_distinct_secrets_and_ids(client: felix_redis.Client, backend: tuple[str, Any]) -> None:
    """Each producer holds a random secret (32 hex digits) made without a round trip to
    Redis; its public id is the digest of that secret, never the secret itself."""
    before = set(client.redis.keys("*"))
    a = client.idempotent_producer()
    b = client.idempotent_producer()
    other = felix_redis.connect(backend[0])  # another process, same Redis
    try:
        c = other.idempotent_producer()
    finally:
        other.close()
    assert set(client.redis.keys("*")) == before  # no counter, no key written
    secrets = [secret_of(p) for p in (a, b, c)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", s) for s in secrets)
    assert len(set(secrets)) == 3
    ids = [a.id, b.id, c.id]
    assert ids == [producer_public_id(s) for s in secrets]
    assert all(isinstance(i, str) and re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == 3
    assert not set(ids) & set(secrets)
    assert len({new_producer_secret() for _ in range(100)}) == 100


def test_producer_publishes_dense_offsets(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S, shards=2)
    producer = client.idempotent_producer()
    assert [producer.publish(T, N, S, b"%d" % i, shard=1).offset for i in range(5)] == [0, 1, 2, 3, 4]
    batch = producer.publish_batch(T, N, S, [b"a", b"b", b"c"], shard=1)
    assert [(p.shard, p.offset) for p in batch] == [(1, 5), (1, 6), (1, 7)]
    keyed = producer.publish_keyed(T, N, S, "order-42", b"k")
    assert keyed.shard == felix_redis.shard_for_key(b"order-42", 2)
    assert [r.payload for r in client.read(T, N, S, 1, 0)][:8] == [b"0", b"1", b"2", b"3", b"4", b"a", b"b", b"c"]


# --------------------------------------------------------------- lost replies


def test_lost_reply_is_resent_and_lands_once(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    client.stream_create(T, N, S)
    producer = client.idempotent_producer()
    assert producer.publish(T, N, S, b"before").offset == 0
    ops = lose_replies(client, monkeypatch)
    published = producer.publish(T, N, S, b"once")
    assert published.offset == 1  # the offset of the first (landed) send
    assert sum(type(op) is Eval and op.script == "publish" for op in ops) == 2  # one re-send
    assert any(type(op) is Sleep for op in ops)
    assert tail(client) == 2
    assert [r.payload for r in client.read(T, N, S, 0, 0)] == [b"before", b"once"]
    # the sequence moves on normally afterwards
    assert producer.publish(T, N, S, b"after").offset == 2
    assert tail(client) == 3


def test_lost_reply_of_a_batch_lands_once(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    client.stream_create(T, N, S)
    producer = client.idempotent_producer()
    lose_replies(client, monkeypatch)
    batch = producer.publish_batch(T, N, S, [b"a", b"b", b"c"])
    assert [p.offset for p in batch] == [0, 1, 2]
    assert tail(client) == 3


def test_send_that_never_landed_is_sent_again(client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    client.stream_create(T, N, S)
    producer = client.idempotent_producer()
    lose_replies(client, monkeypatch, land=False)
    assert producer.publish(T, N, S, b"x").offset == 0
    assert tail(client) == 1


def test_two_lost_replies_raise_and_the_producer_starts_over(
    client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.stream_create(T, N, S)
    producer = client.idempotent_producer()
    first_id = producer.id
    lose_replies(client, monkeypatch, times=2)
    with pytest.raises(felix_redis.ConnectionFailed):
        producer.publish(T, N, S, b"x")
    assert tail(client) == 1  # it landed, once
    # the next publish cannot hit a sequence gap: it goes out as a new producer
    assert producer.publish(T, N, S, b"y").offset == 1
    assert producer.id != first_id
    assert tail(client) == 2


def test_plain_publish_is_idempotent_under_a_lost_reply(
    client: felix_redis.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.stream_create(T, N, S)
    client.publish(T, N, S, b"before")
    lose_replies(client, monkeypatch)
    assert client.publish(T, N, S, b"once").offset == 1
    assert tail(client) == 2
    lose_replies(client, monkeypatch)
    assert [p.offset for p in client.publish_batch(T, N, S, [b"a", b"b"])] == [2, 3]
    assert tail(client) == 4
    lose_replies(client, monkeypatch)
    keyed = client.publish_keyed(T, N, S, "k", b"keyed")
    assert keyed.offset == 4
    assert tail(client) == 5
    assert client.publish(T, N, S, b"after").offset == 5


def test_plain_publish_without_idempotence_can_duplicate(
    backend: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """idempotent_publish=False: no producer, so a lost reply surfaces to the caller."""
    client = felix_redis.connect(backend[0], idempotent_publish=False)
    try:
        client.stream_create(T, N, S)
        lose_replies(client, monkeypatch)
        with pytest.raises(felix_redis.ConnectionFailed):
            client.publish(T, N, S, b"x")
        assert tail(client) == 1
        assert not client.redis.keys("*producer*")
        assert producer_fields(client) == {}
    finally:
        client.close()


# ---------------------------------------------------------- sequence checks


def test_resend_of_held_sequence_returns_original_offsets(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    pid = secret_of(client.idempotent_producer())
    first, count, _ms, dup, _kept = run_publish_script(client, pid, 1, b"a", b"b")
    assert (first, count, dup) == (0, 2, 0)
    again = run_publish_script(client, pid, 1, b"a", b"b")
    assert (again[0], again[1], again[3]) == (0, 2, 1)
    assert tail(client) == 2


def test_sequence_gap_and_older_sequence_are_refused(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    pid = secret_of(client.idempotent_producer())
    run_publish_script(client, pid, 1)
    run_publish_script(client, pid, 2)
    before = tail(client)
    gap = script_error(client, pid, 4)
    assert isinstance(gap, felix_redis.SequenceError), gap
    assert "gap" in str(gap)
    older = script_error(client, pid, 1)
    assert isinstance(older, felix_redis.SequenceError), older
    assert "older" in str(older)
    # a re-send of the held sequence with another batch size is not a re-send
    resized = script_error(client, pid, 2, b"x", b"y")
    assert isinstance(resized, felix_redis.SequenceError), resized
    assert isinstance(script_error(client, pid, 0), felix_redis.InvalidArgument)
    assert tail(client) == before
    assert script_error(client, pid, 3) is None
    assert tail(client) == before + 1


def test_state_of_another_format_counts_as_none(client: felix_redis.Client) -> None:
    """publish.lua reads the next sequence with a plain find and matches the whole state
    only for a re-send or a refusal: a state it did not write is no state, whatever
    sequence comes."""
    client.stream_create(T, N, S)
    pid = secret_of(client.idempotent_producer())
    meta, field = meta_key(client), producer_field(producer_public_id(pid))
    run_publish_script(client, pid, 1)
    seq, first, count, ms, idle, mac = client.redis.hget(meta, field).decode().split()
    assert (seq, first, count, idle) == ("1", "0", "1", "3600000")
    assert mac == state_mac(pid, f"1 0 1 {ms} 3600000")
    five = "7 0 1 1700000000000 3600000"
    for state in [five.encode(),  # the MAC missing
                  f"{five} {state_mac(pid, five)} 9".encode(),  # a field too many
                  f"{five} {state_mac(new_producer_secret(), five)}".encode(),  # another secret's MAC
                  f"{five} {'0' * 16}".encode(),  # a MAC made up
                  f"7 0 1 1700000000000 3600001 {state_mac(pid, five)}".encode(),  # numbers not the MAC's
                  f"0x7 0 1 1700000000000 3600000 {state_mac(pid, '0x7 0 1 1700000000000 3600000')}".encode(),
                  b"7", b"junk", b""]:
        client.redis.hset(meta, field, state)
        before = tail(client)
        assert run_publish_script(client, pid, 7)[3] == 0, state  # appended, not a re-send
        assert tail(client) == before + 1
        client.redis.hset(meta, field, state)
        assert script_error(client, pid, 9) is None, state  # no refusal either: appended
        assert tail(client) == before + 2
        client.redis.hset(meta, field, state)
        assert script_error(client, pid, 6) is None, state
        assert tail(client) == before + 3
    # and a state it wrote still refuses what it must
    client.redis.hset(meta, field, f"{five} {state_mac(pid, five)}".encode())
    assert isinstance(script_error(client, pid, 9), felix_redis.SequenceError)
    assert isinstance(script_error(client, pid, 6), felix_redis.SequenceError)
    assert run_publish_script(client, pid, 7)[3] == 1
    assert run_publish_script(client, pid, 8)[3] == 0


def test_deleting_the_stream_deletes_its_producer_states(client: felix_redis.Client) -> None:
    """A stream deleted and created again under the same name starts with no producer
    state: a producer's next sequence is taken as its first."""
    client.stream_create(T, N, S)
    producer = client.idempotent_producer()
    producer.publish(T, N, S, b"a", shard=0)
    producer.publish(T, N, S, b"b", shard=0)
    assert list(producer_fields(client)) == [producer_field(producer.id or "").encode()]
    client.stream_delete(T, N, S)
    client.stream_create(T, N, S)
    assert producer_fields(client) == {}
    assert producer.publish(T, N, S, b"c", shard=0).offset == 0
    assert [r.payload for r in client.read(T, N, S, 0, 0)] == [b"c"]


def test_sequence_error_through_the_client(client: felix_redis.Client) -> None:
    """The client raises felix_redis.SequenceError (an InvalidArgument) and forgets the
    producer id, so its next publish starts over cleanly."""
    client.stream_create(T, N, S)
    state = ProducerState()
    assert client._drive(client.core.publish(T, N, S, [b"a"], 0, None, state))[1] == 0
    pid = state.producer_id
    state.sequences[(client.core.name(T, N, S).path, 0)] = 5  # as if sequences 2..5 got lost
    with pytest.raises(felix_redis.SequenceError) as caught:
        client._drive(client.core.publish(T, N, S, [b"b"], 0, None, state))
    assert isinstance(caught.value, felix_redis.InvalidArgument)
    assert "gap" in str(caught.value)
    assert state.producer_id is None
    assert tail(client) == 1
    assert client._drive(client.core.publish(T, N, S, [b"c"], 0, None, state))[1] == 1
    assert state.producer_id not in (None, pid)


def test_producer_state_expires_after_idle_time(client: felix_redis.Client) -> None:
    """A state past its idle time is pruned by the publish of a producer new to the
    shard; its own producer, back later, starts over as a new one."""
    client.stream_create(T, N, S)
    client.core.producer_idle_ms = 200
    producer = client.idempotent_producer()
    producer.publish(T, N, S, b"a")
    assert producer.id is not None
    field = producer_field(producer.id).encode()
    assert producer_fields(client)[field].split()[4] == b"200"
    time.sleep(0.3)
    other = client.idempotent_producer()
    other.publish(T, N, S, b"b")
    assert list(producer_fields(client)) == [producer_field(other.id or "").encode()]
    # the producer keeps going after its state was pruned
    assert producer.publish(T, N, S, b"c").offset == 2
    assert set(producer_fields(client)) == {field, producer_field(other.id or "").encode()}


def test_a_state_past_its_idle_time_but_not_yet_pruned_still_answers(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    pid = secret_of(client.idempotent_producer())
    assert run_publish_script(client, pid, 1, idle_ms=1)[3] == 0
    time.sleep(0.01)
    assert run_publish_script(client, pid, 1, idle_ms=1)[3] == 1  # a re-send, still known
    assert isinstance(script_error(client, pid, 3), felix_redis.SequenceError)
    assert tail(client) == 1


@pytest.mark.parametrize("planted", [40, 3000])
def test_pruning_takes_bounded_steps_and_keeps_what_is_live(client: felix_redis.Client, planted: int) -> None:
    """Expired states are pruned a step (HSCAN COUNT 64) per publish of a producer new to
    the shard, resuming where the last step stopped: on a small (listpack) hash one step
    sees every field, on a large one a few dozen steps see them all. Live states and
    values that are no state are kept."""
    client.stream_create(T, N, S)
    meta = meta_key(client)
    now = int(time.time() * 1000)
    expired = {f"producer:{10**6 + i}": f"1 {i} 1 {now - 10_000} 5000 {'0' * 16}" for i in range(planted)}
    live = {f"producer:{2 * 10**6 + i}": f"1 {i} 1 {now - 10_000} 3600000 {'0' * 16}" for i in range(5)}
    # junk stays, a MAC-less five numbers too
    odd = {"producer:junk": "junk", "producer:old": f"1 0 1 {now - 10_000} 5000"}
    client.redis.hset(meta, mapping={**expired, **live, **odd})
    steps = 0
    while len(producer_fields(client)) > len(live) + len(odd) + steps and steps < 200:
        steps += 1
        pid = secret_of(client.idempotent_producer())
        assert run_publish_script(client, pid, 1)[3] == 0
    fields = {f.decode() for f in producer_fields(client)}
    assert not fields & set(expired)
    assert set(live) | set(odd) <= fields
    assert len(fields) == len(live) + len(odd) + steps  # the new producers' own states
    assert steps == 1 if planted < 64 else 1 < steps < 200
    assert tail(client) == steps


def test_state_is_per_shard(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S, shards=3)
    producer = client.idempotent_producer()
    for i in range(6):
        producer.publish(T, N, S, b"%d" % i, shard=i % 3)
    assert producer.id is not None
    for shard in range(3):
        seq, *_ = producer_fields(client, shard)[producer_field(producer.id).encode()].split()
        assert seq == b"2"
    assert client.stream_describe(T, N, S).tails == [2, 2, 2]


# ------------------------------------------------------------------ concurrency


def test_concurrent_plain_publishes_from_threads(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S, shards=2)
    results: list[felix_redis.Published] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def publisher(n: int) -> None:
        try:
            barrier.wait(5)
            for i in range(40):
                p = client.publish(T, N, S, b"%d-%d" % (n, i))
                with lock:
                    results.append(p)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=publisher, args=(n,), daemon=True) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a publisher hung"
    assert not errors, errors
    assert len(results) == 320
    assert len(set(results)) == 320
    tails = client.stream_describe(T, N, S).tails
    assert sum(tails) == 320
    for shard in range(2):
        assert sorted(p.offset for p in results if p.shard == shard) == list(range(tails[shard]))
    # every payload landed exactly once
    payloads = [r.payload for shard in range(2) for r in client.read(T, N, S, shard, 0, 1000)]
    assert sorted(payloads) == sorted(b"%d-%d" % (n, i) for n in range(8) for i in range(40))


def test_one_producer_shared_by_threads(client: felix_redis.Client) -> None:
    client.stream_create(T, N, S)
    producer = client.idempotent_producer()
    offsets: list[int] = []
    lock = threading.Lock()

    def publisher() -> None:
        for _ in range(25):
            offset = producer.publish(T, N, S, b"x").offset
            with lock:
                offsets.append(offset)

    threads = [threading.Thread(target=publisher, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a publisher hung"
    assert sorted(offsets) == list(range(100))


@pytest.mark.parametrize("call", ["publish", "publish_batch", "publish_keyed"])
def test_plain_publish_survives_a_shard_that_forgot_its_sequences(
    client: felix_redis.Client, backend: tuple[str, Any], call: str
) -> None:
    """A failover that drops a shard's latest writes takes the producer state with them.
    The client's own publishes (no sequence of the caller's) then start over as a new
    producer instead of raising SequenceError: the record is written once."""
    client.stream_create(T, N, S)
    raw = backend[1]
    client.publish(T, N, S, b"a", shard=0)
    meta = meta_key(client)
    ((field, saved),) = producer_fields(client).items()
    client.publish(T, N, S, b"b", shard=0)
    client.publish(T, N, S, b"c", shard=0)
    raw.hset(meta, field, saved)  # the state as it was after "a"

    if call == "publish":
        offset = client.publish(T, N, S, b"d", shard=0).offset
    elif call == "publish_batch":
        offset = client.publish_batch(T, N, S, [b"d"], shard=0)[0].offset
    else:
        offset = client.publish_keyed(T, N, S, "k", b"d").offset
    assert offset == 3
    assert [r.payload for r in client.read(T, N, S, 0, 0)] == [b"a", b"b", b"c", b"d"]
    assert client.publish(T, N, S, b"e", shard=0).offset == 4


@pytest.mark.parametrize("cursor", [b"x", b"99999999999999999999999", b"-1", b""])
def test_a_pruning_cursor_it_did_not_write_starts_over_and_changes_nothing_else(
    client: felix_redis.Client, cursor: bytes
) -> None:
    """HSCAN refuses a malformed cursor: the publish of a new producer must not fail
    after appending (offsets would repeat); it scans from 0 instead."""
    client.stream_create(T, N, S)
    meta = meta_key(client)
    assert client.publish(T, N, S, b"a", shard=0).offset == 0
    client.redis.hset(meta, "producer_scan", cursor)
    for i in range(1, 4):
        producer = client.idempotent_producer()
        assert producer.publish(T, N, S, b"%d" % i, shard=0).offset == i
    assert [r.offset for r in client.read(T, N, S, 0, 0)] == [0, 1, 2, 3]
    assert client.redis.hget(meta, "producer_scan") == b"0"


# A publish whose outcome was unknown (NotReplicated, or cancelled after its script ran)
# leaves no producer a sequence behind: the next publish is not taken for a duplicate.

def _land_then_raise(client, monkeypatch, exc):
    real = client._execute
    left = [1]

    def lossy(op):
        if type(op).__name__ == "Eval" and op.script == "publish" and left[0]:
            left[0] -= 1
            real(op)
            raise exc
        return real(op)

    monkeypatch.setattr(client, "_execute", lossy)


def test_producer_after_not_replicated_does_not_drop_the_next_record(client, monkeypatch) -> None:
    """NotReplicated (the script ran on the primary) leaves the producer's sequence
    behind; the next publish re-uses it and is answered as a duplicate: silently dropped."""
    client.stream_create(T, N, S)
    producer = client.idempotent_producer()
    _land_then_raise(client, monkeypatch, felix_redis.NotReplicated("simulated: 0 of 1 replicas"))
    with pytest.raises(felix_redis.NotReplicated):
        producer.publish(T, N, S, b"first")
    second = producer.publish(T, N, S, b"second")
    payloads = [r.payload for r in client.read(T, N, S, 0, 0)]
    assert payloads == [b"first", b"second"], payloads
    assert second.offset == 1


def test_plain_publish_after_not_replicated_does_not_drop_the_next_record(client, monkeypatch) -> None:
    """the pooled producer goes back to the pool one sequence behind."""
    client.stream_create(T, N, S)
    _land_then_raise(client, monkeypatch, felix_redis.NotReplicated("simulated: 0 of 1 replicas"))
    with pytest.raises(felix_redis.NotReplicated):
        client.publish(T, N, S, b"first")
    second = client.publish(T, N, S, b"second")
    payloads = [r.payload for r in client.read(T, N, S, 0, 0)]
    assert payloads == [b"first", b"second"], payloads
    assert second.offset == 1


def test_async_publish_cancelled_after_landing_does_not_drop_the_next_record(backend, monkeypatch) -> None:
    """a plain publish cancelled (asyncio.wait_for timeout) after its script ran
    returns its pooled producer to the pool one sequence behind; the next publish is
    answered as a duplicate of the cancelled one and silently dropped."""
    import asyncio

    import felix_redis.asyncio as fa

    async def main() -> None:
        c = fa.connect(backend[0])
        await c.stream_create(T, N, S)
        real = c._execute
        left = [1]

        async def slow_reply(op):
            result = await real(op)
            if type(op).__name__ == "Eval" and op.script == "publish" and left[0]:
                left[0] -= 1
                await asyncio.sleep(10)  # the reply is slow to come back
            return result

        monkeypatch.setattr(c, "_execute", slow_reply)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(c.publish(T, N, S, b"first"), 0.2)
        import gc
        gc.collect()
        second = await c.publish(T, N, S, b"second")
        payloads = [r.payload for r in await c.read(T, N, S, 0, 0)]
        await c.close()
        assert payloads == [b"first", b"second"], payloads
        assert second.offset == 1

    asyncio.run(main())


def test_async_idempotent_producer_cancelled_after_landing(backend, monkeypatch) -> None:
    """same with AsyncIdempotentProducer."""
    import asyncio

    import felix_redis.asyncio as fa

    async def main() -> None:
        c = fa.connect(backend[0])
        await c.stream_create(T, N, S)
        producer = await c.idempotent_producer()
        real = c._execute
        left = [1]

        async def slow_reply(op):
            result = await real(op)
            if type(op).__name__ == "Eval" and op.script == "publish" and left[0]:
                left[0] -= 1
                await asyncio.sleep(10)
            return result

        monkeypatch.setattr(c, "_execute", slow_reply)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(producer.publish(T, N, S, b"first"), 0.2)
        second = await producer.publish(T, N, S, b"second")
        payloads = [r.payload for r in await c.read(T, N, S, 0, 0)]
        await c.close()
        assert payloads == [b"first", b"second"], payloads
        assert second.offset == 1

    asyncio.run(main())
