"""Connection faults at the transport, for every public operation (CONTRACT.md, "a
connection failure"; docs/reliability.md, "Faults at the transport").

A TCP proxy (tests/support/faultproxy.py) sits between the client and Redis and, on the call
that runs the operation's script, cuts the connection

- ``before`` forwarding the call (Redis never saw it),
- ``after`` Redis answered, before the answer is passed on (it took effect, the reply
  was lost),
- in the ``mid``\\ dle of the answer,

or answers for Redis with an error that means the call did not run (``LOADING``,
``READONLY``, ...), or cuts every connection and refuses new ones for a moment
(``refused``: the call cannot be sent at all).

What each operation must do:

- an operation safe to repeat is sent again and takes effect exactly once;
- any other operation never takes effect twice: when the call may have run it raises
  ``OutcomeUnknown`` (and took effect once or not at all, as the fault says);
- a call that certainly did not run (refused connection, refusal reply) is sent again,
  whatever the operation does, and takes effect once.

Each case checks that its fault fired on the call it names, and what the operation
did by reading Redis directly (not through the proxy). Both the sync and the asyncio
client go through every case.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

import felix_redis
import felix_redis.asyncio as fa
from felix_redis import OutcomeUnknown
from felix_redis.testing.server import redis_server_binary
from tests.support.faultproxy import FaultProxy, script_call

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")

T, N, S, G = "acme", "prod", "jobs", "workers"
META0 = "felix:{acme/prod/jobs/0}:meta"
GROUP0 = f"felix:{{acme/prod/jobs/0}}:g:{G}"

LOST = ("before", "after", "mid")  # the connection is cut around the call
#: error replies that say the server did not run the call (felix_redis.protocol.TRANSIENT_ERRORS)
REFUSALS = {
    "LOADING": b"-LOADING Redis is loading the dataset in memory",
    "READONLY": b"-READONLY You can't write against a read only replica.",
    "MASTERDOWN": b"-MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "TRYAGAIN": b"-TRYAGAIN Multiple keys request during rehashing of slot",
    "CLUSTERDOWN": b"-CLUSTERDOWN The cluster is down",
    "NOREPLICAS": b"-NOREPLICAS Not enough good replicas to write.",
}
MODES = [*LOST, "refused", "LOADING", "READONLY"]

#: Bugs these tests found, fixed since: a LOADING reply (redis-py's BusyLoadingError, a
#: ConnectionError) was taken for a lost connection, so an unsafe call raised
#: OutcomeUnknown though it never ran; group_discard with offsets was sent again after a
#: lost reply and then refused them as no longer dead letters (it is not safe to repeat);
#: a refusal reply to one call of a pipeline became that call's result instead of being
#: sent again; a refused connect on the lane's first call was not taken for "not sent".


# ----------------------------------------------------------------------- the world


@dataclass
class Env:
    """One case's world: ``c`` the client under test (through the proxy), ``d`` a
    client straight to Redis, ``raw`` redis-py straight to Redis."""

    c: Any
    d: felix_redis.Client
    raw: redis.Redis
    proxy: FaultProxy
    loop: asyncio.AbstractEventLoop | None

    def run(self, value: Any) -> Any:
        """The value, or the coroutine's result (asyncio client)."""
        if asyncio.iscoroutine(value):
            assert self.loop is not None
            return self.loop.run_until_complete(asyncio.wait_for(value, 30))
        return value

    def shard(self, s: int = 0) -> felix_redis.ShardState:
        return self.d.group_describe(T, N, S, G).shards[s]

    def count(self, payload: bytes) -> int:
        """How many records of the stream (every shard) carry ``payload``."""
        shards = self.d.stream_describe(T, N, S).shards
        return sum(r.payload == payload for s in range(shards) for r in self.d.read(T, N, S, s, 0, 1000))

    def server_ms(self) -> int:
        sec, usec = self.raw.time()
        return int(sec) * 1000 + int(usec) // 1000


def base(env: Env, records: int = 4, shards: int = 1, **group: Any) -> None:
    env.d.stream_create(T, N, S, shards=shards)
    env.d.group_create(T, N, S, G, **group)
    for i in range(records):
        env.d.publish(T, N, S, b"r%d" % i, shard=i % shards)


def held(env: Env, n: int = 1, **group: Any) -> list[felix_redis.Record]:
    """A stream of 4 records, ``n`` of them in flight (leased by ``d``)."""
    base(env, **group)
    return env.d.group_poll(T, N, S, 0, G, max_records=n)


def dead(env: Env) -> felix_redis.Record:
    (r,) = held(env)
    env.d.group_dead_letter(T, N, S, 0, G, r, reason="poison")
    return r


def argv(args: list[bytes]) -> list[bytes]:
    """The ARGV of an FCALL/EVALSHA request."""
    return args[3 + int(args[2]):]


def writes_at(index: int) -> Callable[[list[bytes]], bool]:
    """The writing call (check flag '0', ARGV[index + 1]) of a validate-then-write
    operation: group_create's ARGV[6], group_configure's ARGV[3], group_delete's last."""
    return lambda args: argv(args)[index] == b"0"


writes = writes_at(-1)


# ----------------------------------------------------------------------- the cases


@dataclass
class Case:
    name: str
    #: the script whose call gets the fault; None: the plain command ``cmd``
    script: str | None
    #: safe to repeat (sent again after a lost reply)
    safe: bool
    setup: Callable[[Env], Any]
    act: Callable[[Env, Any], Any]
    #: how many times the operation took effect, read from Redis; None for reads
    effect: Callable[[Env, Any], int] | None = None
    #: checks the operation's result (reads, and safe operations that were sent again)
    result: Callable[[Env, Any, Any], None] | None = None
    #: checks everything itself instead: (env, ctx, mode, result or exception)
    verify: Callable[[Env, Any, str, Any], None] | None = None
    where: Callable[[list[bytes]], bool] | None = None
    cmd: bytes | None = None
    plain_publish: bool = False  # the client is made with idempotent_publish=False


def poll_verify(env: Env, ctx: Any, mode: str, got: Any, shards: int = 1) -> None:
    """A poll sent again after its reply was lost: the records the lost call leased are
    in flight (they lapse and come back, see test_guarantees 1), the others were handed
    out once, nothing is pending twice or missing."""
    records = [getattr(r, "record", r) for r in got]
    assert records, "the poll returned nothing"
    assert len({(r.shard, r.offset) for r in records}) == len(records)
    assert all(r.attempts == 1 for r in records)
    states = env.d.group_describe(T, N, S, G).shards[:shards]
    in_flight = sum(s.in_flight for s in states)
    assert sum(s.in_flight + s.pending + s.owed for s in states) == 4
    if mode in ("after", "mid"):
        assert in_flight > len(records), "the lost call's leases should show: it ran, then the poll ran again"
    elif shards > 1 and mode in REFUSALS:
        # one call of the pipeline was refused, the other ran: a LOADING reply drops the
        # connection and the whole Batch is sent again (its first leases lapse later)
        assert in_flight >= len(records)
    else:
        assert in_flight == len(records), "the poll ran once"


def reclaim_verify(env: Env, ctx: Any, mode: str, got: Any) -> None:
    """A named consumer's poll (reclaim on) sent again after its reply was lost takes
    back what the lost call leased to it: the same records, attempts + 1."""
    s = env.shard()
    assert (s.in_flight, s.pending) == (2, 2)
    if mode in ("after", "mid"):
        assert [(r.offset, r.attempts) for r in got] == [(0, 2), (1, 2)]
    else:
        assert [(r.offset, r.attempts) for r in got] == [(0, 1), (1, 1)]


def poll_with_acks_verify(env: Env, ctx: Any, mode: str, got: Any) -> None:
    s = env.shard()
    assert s.position == 2, "the acks carried by the poll took effect"
    assert s.in_flight == 2 and s.pending == 0
    if mode in ("after", "mid"):
        assert got == [], "the lost call leased 2 and 3; the poll sent again found nothing"
    else:
        assert [r.offset for r in got] == [2, 3]


def stream_exists(env: Env, ctx: Any) -> int:
    return int(env.raw.exists(META0))


def group_exists(env: Env, ctx: Any) -> int:
    return int(env.raw.exists(GROUP0))


def published(payload: bytes) -> Callable[[Env, Any], int]:
    return lambda env, ctx: env.count(payload)


def producer(env: Env) -> Any:
    base(env, records=0)
    return env.run(env.c.idempotent_producer())


def published_before(env: Env) -> None:
    """The client has published before (a producer borrowed with an id): a publish
    takes the quick path."""
    base(env, records=0)
    env.run(env.c.publish(T, N, S, b"warm"))


def warm(env: Env) -> None:
    """The client's connections are open (a refusal cuts them) and it knows the stream
    and group (cached), so the operation's own call is the first it makes: a fault hits
    that call, not a read before it."""
    env.run(env.c.stream_list())
    if env.raw.exists(GROUP0):
        for shard in range(env.d.stream_describe(T, N, S).shards):
            env.run(env.c.group_dead_letters(T, N, S, shard, G))
    elif env.raw.exists(META0):
        env.run(env.c.read(T, N, S, 0, 0, 1))


def sharded(env: Env, n: int = 4) -> tuple[Any, list[str]]:
    """A 2-shard stream of 4 records, ``n`` of them in flight (leased by ``d``); the
    client's sharded group and the claims."""
    base(env, shards=2)
    items = env.d.group_sharded(T, N, S, G).poll(n) if n else []
    return env.c.group_sharded(T, N, S, G), sorted(i.claim for i in items)


CASES = [
    # -- streams
    Case("stream_create", "stream_create", True, lambda env: None,
         lambda env, ctx: env.c.stream_create(T, N, S),
         effect=stream_exists, where=lambda a: argv(a)[9] == b"0"),
    Case("stream_describe", "stream_info", True, base,
         lambda env, ctx: env.c.stream_describe(T, N, S),
         result=lambda env, ctx, got: got.tails == [4] or pytest.fail(f"tails {got.tails}")),
    Case("stream_list", None, True, base, lambda env, ctx: env.c.stream_list(), cmd=b"ZRANGE",
         result=lambda env, ctx, got: got == [(T, N, S)] or pytest.fail(str(got))),
    Case("stream_trim", "stream_trim", True,
         lambda env: (env.d.stream_create(T, N, S, retention_max_len=10),
                      env.d.publish_batch(T, N, S, [b"x"] * 11)),
         lambda env, ctx: env.c.stream_trim(T, N, S),
         effect=lambda env, ctx: int(env.d.stream_describe(T, N, S).firsts == [1])),
    Case("stream_delete", "stream_delete", False, base,
         lambda env, ctx: env.c.stream_delete(T, N, S),
         effect=lambda env, ctx: 1 - stream_exists(env, ctx)),
    # -- publishing without producer state (idempotent_publish=False): not safe to repeat
    Case("publish (plain)", "publish", False, lambda env: base(env, records=0),
         lambda env, ctx: env.c.publish(T, N, S, b"X"), effect=published(b"X"), plain_publish=True),
    Case("publish_keyed (plain)", "publish", False, lambda env: base(env, records=0),
         lambda env, ctx: env.c.publish_keyed(T, N, S, "k", b"X"), effect=published(b"X"), plain_publish=True),
    Case("publish_batch (plain)", "publish", False, lambda env: base(env, records=0),
         lambda env, ctx: env.c.publish_batch(T, N, S, [b"X", b"Y"]), effect=published(b"X"),
         plain_publish=True),
    # -- publishing with a borrowed producer (the default) or an idempotent producer
    Case("publish", "publish", True, lambda env: base(env, records=0),
         lambda env, ctx: env.c.publish(T, N, S, b"X"), effect=published(b"X")),
    Case("publish (warm)", "publish", True, published_before,
         lambda env, ctx: env.c.publish(T, N, S, b"X"), effect=published(b"X")),
    Case("publish_keyed", "publish", True, lambda env: base(env, records=0),
         lambda env, ctx: env.c.publish_keyed(T, N, S, "k", b"X"), effect=published(b"X")),
    Case("publish_batch", "publish", True, lambda env: base(env, records=0),
         lambda env, ctx: env.c.publish_batch(T, N, S, [b"X", b"Y"]), effect=published(b"X")),
    Case("producer.publish", "publish", True, producer,
         lambda env, p: p.publish(T, N, S, b"X"), effect=published(b"X")),
    Case("producer.publish_keyed", "publish", True, producer,
         lambda env, p: p.publish_keyed(T, N, S, "k", b"X"), effect=published(b"X")),
    Case("producer.publish_batch", "publish", True, producer,
         lambda env, p: p.publish_batch(T, N, S, [b"X", b"Y"]), effect=published(b"X")),
    # -- groups
    Case("group_create", "group_create", False, lambda env: env.d.stream_create(T, N, S),
         lambda env, ctx: env.c.group_create(T, N, S, G), effect=group_exists, where=writes_at(5)),
    Case("group_configure", "group_configure", True, base,
         lambda env, ctx: env.c.group_configure(T, N, S, G, visibility_timeout_ms=45_000, max_attempts=3),
         effect=lambda env, ctx: int(env.raw.hmget(GROUP0, "vt", "max") == [b"45000", b"3"]),
         where=writes_at(2)),
    Case("group_list", "stream_info", True, base, lambda env, ctx: env.c.group_list(T, N, S),
         result=lambda env, ctx, got: got == [G] or pytest.fail(str(got))),
    Case("group_delete", "group_delete", False, base,
         lambda env, ctx: env.c.group_delete(T, N, S, G),
         effect=lambda env, ctx: 1 - group_exists(env, ctx), where=writes),
    Case("group_describe", "group_describe", True, lambda env: held(env, 2),
         lambda env, ctx: env.c.group_describe(T, N, S, G),
         result=lambda env, ctx, got: (got.shards[0].in_flight, got.shards[0].pending) == (2, 2)
         or pytest.fail(str(got))),
    # -- records in a group
    Case("group_poll", "group_poll", True, base,
         lambda env, ctx: env.c.group_poll(T, N, S, 0, G, max_records=2), verify=poll_verify),
    Case("group_poll_as", "group_poll", True, base,
         lambda env, ctx: env.c.group_poll_as(T, N, S, 0, G, consumer="w1", max_records=2),
         verify=reclaim_verify),
    Case("group_poll(ack=)", "group_poll", True, lambda env: held(env, 2),
         lambda env, rs: env.c.group_poll(T, N, S, 0, G, max_records=2, ack=rs), verify=poll_with_acks_verify),
    Case("group_ack", "group_ack", True, held,
         lambda env, rs: env.c.group_ack(T, N, S, 0, G, rs[0]),
         effect=lambda env, rs: int(env.shard().position == 1)),
    Case("group_ack_many", "group_ack", True, lambda env: held(env, 2),
         lambda env, rs: env.c.group_ack_many(T, N, S, 0, G, rs),
         effect=lambda env, rs: int(env.shard().position == 2)),
    Case("group_nack", "group_nack", False, held,
         lambda env, rs: env.c.group_nack(T, N, S, 0, G, rs[0]),
         effect=lambda env, rs: env.shard().owed),
    Case("group_extend", "group_extend", False, held,
         lambda env, rs: env.c.group_extend(T, N, S, 0, G, rs[0], by=3600),
         effect=lambda env, rs: int(float(env.raw.zscore(f"{GROUP0}:lease", "0") or 0) > env.server_ms() + 600_000)),
    Case("group_dead_letter", "group_dead_letter", False, held,
         lambda env, rs: env.c.group_dead_letter(T, N, S, 0, G, rs[0], reason="bad"),
         effect=lambda env, rs: env.shard().dead),
    Case("group_dead_letters", "group_dead_letters", True, dead,
         lambda env, r: env.c.group_dead_letters(T, N, S, 0, G),
         result=lambda env, r, got: [(d.offset, d.reason) for d in got] == [(0, "poison")] or pytest.fail(str(got))),
    Case("group_redrive", "group_redrive", False, dead,
         lambda env, r: env.c.group_redrive(T, N, S, 0, G, [0]),
         effect=lambda env, r: env.shard().owed),
    Case("group_redrive(all)", "group_redrive", False, dead,
         lambda env, r: env.c.group_redrive(T, N, S, 0, G),
         effect=lambda env, r: env.shard().owed),
    Case("group_discard", "group_discard", False, dead,
         lambda env, r: env.c.group_discard(T, N, S, 0, G, [0]),
         effect=lambda env, r: 1 - env.shard().dead),
    Case("group_discard(all)", "group_discard", False, dead,
         lambda env, r: env.c.group_discard(T, N, S, 0, G),
         effect=lambda env, r: 1 - env.shard().dead),
    # -- reading the log
    Case("read", "stream_read", True, base, lambda env, ctx: env.c.read(T, N, S, 0, 1),
         result=lambda env, ctx, got: [r.payload for r in got] == [b"r1", b"r2", b"r3"] or pytest.fail(str(got))),
    Case("subscribe", "stream_read", True, base,
         lambda env, ctx: env.run(env.run(env.c.subscribe(T, N, S, block=0.1)).poll()),
         result=lambda env, ctx, got: [r.offset for r in got] == [0, 1, 2, 3] or pytest.fail(str(got))),
    # -- a sharded group (every shard's poll in one pipeline)
    Case("sharded poll", "group_poll", True, lambda env: sharded(env, 0)[0],
         lambda env, g: g.poll(2), verify=lambda env, g, mode, got: poll_verify(env, g, mode, got, shards=2)),
    Case("sharded ack", "group_ack", True, lambda env: sharded(env),
         lambda env, gc: gc[0].ack(gc[1][0]), effect=lambda env, gc: int(env.shard(0).position == 1)),
    Case("sharded ack_many", "group_ack", True, lambda env: sharded(env),
         lambda env, gc: gc[0].ack_many(gc[1]),
         effect=lambda env, gc: int([env.shard(0).position, env.shard(1).position] == [2, 2])),
    Case("sharded nack", "group_nack", False, lambda env: sharded(env),
         lambda env, gc: gc[0].nack(gc[1][0]), effect=lambda env, gc: env.shard(0).owed),
    Case("sharded nack_after", "group_nack", False, lambda env: sharded(env),
         lambda env, gc: gc[0].nack_after(gc[1][0], 60), effect=lambda env, gc: env.shard(0).owed),
    Case("sharded extend", "group_extend", False, lambda env: sharded(env),
         lambda env, gc: gc[0].extend(gc[1][0], 3600),
         effect=lambda env, gc: int(float(env.raw.zscore(f"{GROUP0}:lease", "0") or 0) > env.server_ms() + 600_000)),
    Case("sharded dead_letter", "group_dead_letter", False, lambda env: sharded(env),
         lambda env, gc: gc[0].dead_letter(gc[1][0], "bad"), effect=lambda env, gc: env.shard(0).dead),
]


def _cases() -> Iterator[Any]:
    for flavour in ("sync", "async"):
        for case in CASES:
            for mode in MODES:
                yield pytest.param(flavour, case, mode, id=f"{flavour}-{case.name}-{mode}")


# ----------------------------------------------------------------------- the runner


@pytest.fixture
def direct(raw: redis.Redis, redis_url: str) -> Iterator[tuple[felix_redis.Client, redis.Redis, str]]:
    d = felix_redis.connect(redis_url)
    try:
        yield d, raw, redis_url
    finally:
        d.close()


@contextlib.contextmanager
def make_env(direct: tuple[felix_redis.Client, redis.Redis, str], flavour: str,
             **client_kwargs: Any) -> Iterator[Env]:
    """A proxy to the test Redis and a client of ``flavour`` through it; all closed at
    the end."""
    d, raw, url = direct
    where = urlsplit(url)
    proxy = FaultProxy(where.port or 6379, where.hostname or "127.0.0.1")
    loop = None
    c: Any = None
    try:
        if flavour == "sync":
            c = felix_redis.connect(proxy.url, **client_kwargs)
        else:
            loop = asyncio.new_event_loop()
            c = fa.connect(proxy.url, **client_kwargs)
        yield Env(c, d, raw, proxy, loop)
    finally:
        try:
            if c is not None:
                if loop is not None:
                    loop.run_until_complete(asyncio.wait_for(c.close(), 10))
                else:
                    c.close()
        finally:
            if loop is not None:
                loop.close()
            proxy.close()


def target(env: Env, case: Case) -> Callable[[list[bytes]], bool]:
    if case.script is None:
        return lambda args: args[:1] == [case.cmd]
    runner = env.c._runner
    return script_call(runner.library.functions, runner.shas, case.script, case.where)


@pytest.mark.parametrize(("flavour", "case", "mode"), list(_cases()))
def test_every_operation_under_every_fault(
    direct: tuple[felix_redis.Client, redis.Redis, str], flavour: str, case: Case, mode: str
) -> None:
    kwargs = {"idempotent_publish": False} if case.plain_publish else {}
    with make_env(direct, flavour, **kwargs) as env:
        if not env.raw.function_list(library=env.d._runner.library.name):
            env.d.load_library()
        ctx = case.setup(env)
        warm(env)
        match = target(env, case)
        before = env.proxy.seen(match)
        relisten = None
        if mode == "refused":
            accepted = env.proxy.accepted
            relisten = env.proxy.refuse(0.1)
        else:
            fault = env.proxy.arm("error" if mode in REFUSALS else mode, match, error=REFUSALS.get(mode))
        unknown = mode in LOST and not case.safe
        try:
            if unknown:
                with pytest.raises(OutcomeUnknown, match="may or may not have taken effect"):
                    env.run(case.act(env, ctx))
                got = None
            else:
                got = env.run(case.act(env, ctx))  # sent again; OutcomeUnknown fails the case
        finally:
            if relisten is not None:
                relisten.join(5)
        if mode == "refused":
            assert env.proxy.accepted > accepted, "the client never connected again"
        else:
            assert len(fault.fired) == 1, f"the fault never fired on {case.script or case.cmd}"
        if unknown:
            assert env.proxy.seen(match) - before == 1, "a call that is not safe to repeat was sent again"
        if case.verify is not None:
            case.verify(env, ctx, mode, got)
        if case.effect is not None:
            want = 0 if unknown and mode == "before" else 1
            assert case.effect(env, ctx) == want, f"took effect {case.effect(env, ctx)} times, want {want}"
        if case.result is not None and not unknown:
            case.result(env, ctx, got)


# ------------------------------------------------------------- faults that persist


def plain_publish(env: Env) -> Any:
    return env.c.publish(T, N, S, b"X")


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_safe_call_lost_every_time_fails_after_retry_for(
    direct: tuple[felix_redis.Client, redis.Redis, str], flavour: str
) -> None:
    """Every reply of a safe call lost: it is sent again for ``retry_for`` seconds, then
    raises ConnectionFailed (the outcome is unknown, so OutcomeUnknown: it did run)."""
    with make_env(direct, flavour, retry_for=0.5) as env:
        (r,) = held(env)
        warm(env)
        match = target(env, next(c for c in CASES if c.name == "group_ack"))
        fault = env.proxy.arm("after", match, times=1000)
        start = time.monotonic()
        with pytest.raises(felix_redis.ConnectionFailed):
            env.run(env.c.group_ack(T, N, S, 0, G, r))
        elapsed = time.monotonic() - start
        assert len(fault.fired) >= 2, "sent again at least once"
        assert 0.4 <= elapsed < 10, elapsed
        assert env.shard().position == 1, "the ack took effect (once: acks are idempotent)"


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_an_unsafe_call_is_sent_once_whatever_happens(
    direct: tuple[felix_redis.Client, redis.Redis, str], flavour: str
) -> None:
    with make_env(direct, flavour, idempotent_publish=False, retry_for=5) as env:
        base(env, records=0)
        warm(env)
        match = target(env, next(c for c in CASES if c.name == "publish (plain)"))
        fault = env.proxy.arm("after", match, times=1000)
        with pytest.raises(OutcomeUnknown):
            env.run(plain_publish(env))
        assert len(fault.fired) == 1 and env.proxy.seen(match) == 1
        assert env.count(b"X") == 1


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_refusal_longer_than_retry_for_says_the_call_was_not_sent(
    direct: tuple[felix_redis.Client, redis.Redis, str], flavour: str
) -> None:
    with make_env(direct, flavour, idempotent_publish=False, retry_for=0.5) as env:
        base(env, records=0)
        env.run(env.c.stream_describe(T, N, S))
        start = time.monotonic()
        with env.proxy.refusing(), pytest.raises(felix_redis.ConnectionFailed) as info:
            env.run(plain_publish(env))
        assert not isinstance(info.value, OutcomeUnknown)
        assert info.value.unsent, "nothing could be sent: the error says so"
        assert 0.4 <= time.monotonic() - start < 10
        assert env.count(b"X") == 0


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("code", list(REFUSALS))
@pytest.mark.parametrize("name", ["publish (plain)", "group_nack", "group_redrive"])
def test_every_refusal_reply_sends_an_unsafe_call_again(
    direct: tuple[felix_redis.Client, redis.Redis, str], flavour: str, code: str, name: str
) -> None:
    """Each error reply that says the server did not run the call (a failover, restart
    or re-sharding under way) has an unsafe call sent again: it takes effect once."""
    case = next(c for c in CASES if c.name == name)
    with make_env(direct, flavour, idempotent_publish=not case.plain_publish) as env:
        ctx = case.setup(env)
        warm(env)
        match = target(env, case)
        fault = env.proxy.arm("error", match, error=REFUSALS[code])
        env.run(case.act(env, ctx))
        assert len(fault.fired) == 1 and env.proxy.seen(match) == 2
        assert case.effect is not None and case.effect(env, ctx) == 1


def test_a_refused_first_call_on_the_lane_is_sent_again(direct: tuple[felix_redis.Client, redis.Redis, str]) -> None:
    """The lane (the sync client's own connection) borrows a connection on its first
    call, and again in a forked child; closing it stands for that here. Redis is
    unreachable for a moment: the nack was not sent, so it is sent again."""
    with make_env(direct, "sync") as env:
        (r,) = held(env)
        env.c.group_describe(T, N, S, G)  # settings cached: the nack is the first call
        env.c._lane.close()
        relisten = env.proxy.refuse(0.1)
        try:
            env.c.group_nack(T, N, S, 0, G, r)
        finally:
            relisten.join(5)
        assert env.shard().owed == 1
