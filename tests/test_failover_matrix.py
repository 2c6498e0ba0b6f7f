"""The failover matrix: every public operation, on the SAME client objects, after each
fault the docs promise to survive.

Faults (one deployment each): a Sentinel primary killed (SIGKILL), paused past
down-after-milliseconds and resumed (SIGSTOP/SIGCONT), handed over (``SENTINEL
FAILOVER``); a Cluster primary killed, handed over (``CLUSTER FAILOVER``); a standalone
primary killed and restarted with its AOF.

Operations: every public call of :class:`felix_redis.Client`, the same on
:class:`felix_redis.asyncio.AsyncClient`, :class:`~felix_redis.ShardedGroup`, the
idempotent producer, ``subscribe``, a running :class:`~felix_redis.Worker` and
:class:`~felix_redis.AsyncWorker`, and ``felixctl`` commands.

What each cell keeps of the user's situation: the clients, groups, producers,
subscriptions and workers are made before the fault and used after it; the dead node
stays dead (only the standalone AOF case restarts its server, that restart being the
fault); the URL still names the dead node (a Cluster URL lists it first). The
operations start as soon as the fault is injected (during the failover), so the client
has to ride it out; each must succeed, with its result checked, within
:data:`BOUND_S` of the moment the deployment recovered (the promotion, once every
sentinel names the new primary with the failover over and the surviving replicas follow
it; the sentinels must not fail over a second time). ``felixctl``
commands are new processes with that same URL; each must succeed within
:data:`BOUND_S` of its start.

Each client's first call after the fault, and its first after the recovery, have a
rule of their own. A quorum write the promoted primary cannot confirm yet, or one sent
to an old primary that is still running (handed over, or paused and resumed: it takes
itself for the primary until the sentinels turn it into a replica, and the replicas
follow the new one) before the client heard of the switch, fails with NotReplicated,
the documented answer, and the client asks the sentinels again. Those calls are tried
again on NotReplicated (the answers are counted); every other operation must succeed
at its first call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

import felix_redis
import felix_redis.asyncio as felix_async
from felix_redis.testing.server import RedisServer, redis_server_binary
from felix_redis.testing.topology import ClusterTopology, SentinelTopology

pytestmark = pytest.mark.skipif(
    redis_server_binary() is None or shutil.which("redis-cli") is None,
    reason="redis-server and redis-cli are needed (apt install redis-server)",
)

ROOT = Path(__file__).resolve().parent.parent
FELIXCTL = [sys.executable, "-m", "felixctl"]
T, N = "acme", "prod"
S, G = "orders", "workers"
#: An operation must succeed within this long of the deployment's recovery.
BOUND_S = 10.0
#: How long a failover may take (down-after 2 s, node-timeout 1 s).
FAILOVER_S = 30.0
FAST_SYNC = ("--repl-diskless-sync-delay", "0")
VISIBILITY_MS = 120_000  # claims made before the fault stay valid through it
#: A directory: every run's server and sentinel logs are kept there (a failed run's are
#: kept anyway, in a temporary directory the failure names).
KEEP_LOGS_ENV = "FELIX_KEEP_LOGS"


# ------------------------------------------------------------------------ deployments


class Deployment:
    """One fault on one deployment: ``start`` it, ``inject`` the fault, ``recovered``
    returns when it is served again (the monotonic time of that moment)."""

    name = ""
    #: stream settings for this deployment
    stream_kwargs: dict[str, Any] = {}
    url = ""

    def start(self) -> None:
        raise NotImplementedError

    def settle(self) -> None:
        """Waits until replicas hold everything written so far (before the fault)."""

    def inject(self) -> None:
        raise NotImplementedError

    def recovered(self) -> float:
        raise NotImplementedError

    def after(self) -> None:
        """Checks once the operations ran (e.g. the old primary is a replica now)."""

    def copy_logs(self, directory: Path) -> list[Path]:
        """Copies the servers' (and sentinels') logs into ``directory``, before stop."""
        return []

    def state(self) -> str:
        """What a failure message adds about the deployment now (never raises)."""
        return ""

    def stop(self) -> None:
        raise NotImplementedError


class SentinelDeployment(Deployment):
    stream_kwargs = {"replication": 2, "consistency": "quorum"}

    def __init__(self, how: str) -> None:
        self.name = f"sentinel-{how}"
        self.how = how
        # the launcher's down-after 2 s: at 1 s the sentinels sometimes fail over a second
        # time right after the first (see SETTINGS), which no client can ride out within
        # the bound (the new primary has no replica for 10 s and more)
        self.topology = SentinelTopology(replicas=2, sentinels=3, extra=FAST_SYNC)
        self.old: Any = None
        self.paused = False

    def start(self) -> None:
        self.topology.start()
        self.url = self.topology.url

    def copy_logs(self, directory: Path) -> list[Path]:
        return self.topology.copy_logs(directory)

    def settle(self) -> None:
        self.topology.wait_replicas_synced()

    def inject(self) -> None:
        self.old = self.topology.primary
        if self.how == "kill":
            self.topology.kill_primary()
        elif self.how == "pause":
            assert self.old.process is not None
            os.kill(self.old.process.pid, signal.SIGSTOP)
            self.paused = True
        else:
            host, port = self.topology.sentinel_addresses[0]
            with redis.Redis(host=host, port=port, socket_timeout=5) as sentinel:
                sentinel.execute_command("SENTINEL", "FAILOVER", self.topology.service_name)

    def recovered(self) -> float:
        """The promotion, once the failover is over: every sentinel names the new
        primary with no failover in progress, and every replica that survived follows it
        (online at the primary), so quorum writes can be confirmed. The old primary is not waited for (dead, paused, or
        converted by the sentinels later)."""
        self.topology.wait_for_failover(timeout=FAILOVER_S)
        self.topology.wait_failover_settled(timeout=FAILOVER_S)
        at = time.monotonic()
        if self.how == "pause":
            self._resume()
        return at

    def _resume(self) -> None:
        if self.paused:
            self.paused = False
            os.kill(self.old.process.pid, signal.SIGCONT)

    def state(self) -> str:
        try:
            states = self.topology.sentinel_states()
        except Exception as exc:  # the message it adds to must not be lost
            return f"(sentinels not asked: {exc})"
        seen = sorted({(s.get("port"), s.get("config-epoch"), s.get("flags")) for s in states})
        return "(sentinels now: " + "; ".join(f"primary port {p}, config-epoch {e}, flags {f}"
                                              for p, e, f in seen) + ")"

    def after(self) -> None:
        # One failover, the fault's: a second one (config-epoch 2) is a fault of its own.
        assert self.topology.failovers() == 1, f"[{self.name}] the sentinels failed over again: {self.state()}"
        if self.how == "kill":
            return
        # The old primary (resumed, or handed over) follows the new one, and the client
        # never took it for the primary again (the operations above succeeded there).
        new_port = self.topology.primary.port

        def follows() -> bool:
            with redis.Redis(port=self.old.port, socket_timeout=2) as conn:
                info = conn.info("replication")
            return info.get("role") == "slave" and int(info.get("master_port", 0)) == new_port

        _wait(f"127.0.0.1:{self.old.port} to follow the new primary", follows, 40.0)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._resume()
        self.topology.stop()


class ClusterDeployment(Deployment):
    """Three primaries with two replicas each, so a promoted replica still has one to
    confirm quorum writes. The primary that fails is the one holding slot 0, redis-py's
    default node, and the URL names it first."""

    stream_kwargs = {"replication": 2, "consistency": "quorum"}

    def __init__(self, how: str) -> None:
        self.name = f"cluster-{how}"
        self.how = how
        self.topology = ClusterTopology(primaries=3, replicas_per_primary=2, extra=FAST_SYNC)
        self.victim = 0

    def start(self) -> None:
        self.topology.start()
        rows = self.topology.cluster_nodes()
        self.victim = next(int(r["port"]) for r in rows if r["role"] == "primary" and r["slots"].startswith("0-"))
        ports = [self.victim] + [p for p in self.topology.ports if p != self.victim]
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)

    def settle(self) -> None:
        self.topology.wait_replicas_synced()

    def copy_logs(self, directory: Path) -> list[Path]:
        return self.topology.copy_logs(directory)

    def inject(self) -> None:
        if self.how == "kill":
            self.topology.kill_node(self.victim)
        else:
            replica = self.topology.replica_ports(self.victim)[0]
            self.topology._replicas_of[self.victim] = self.topology.replica_ports(self.victim)
            with redis.Redis(port=replica, socket_timeout=5) as conn:
                conn.execute_command("CLUSTER FAILOVER")

    def recovered(self) -> float:
        """As SentinelDeployment.recovered: the promotion, and a replica following it."""
        new = self.topology.wait_for_promotion(self.victim, timeout=FAILOVER_S)
        _wait("a replica of the new primary", lambda: _replicas_online(new) >= 1, FAILOVER_S)
        return time.monotonic()

    def stop(self) -> None:
        self.topology.stop()


class RestartDeployment(Deployment):
    """A standalone primary with AOF, killed and started again on its port: the restart
    is the fault (nothing else could serve)."""

    name = "standalone-restart-aof"

    def __init__(self) -> None:
        self.server = RedisServer(persistence=True, extra=["--appendonly", "yes", "--appendfsync", "everysec"])
        self.restarter: threading.Thread | None = None
        self.back_at = 0.0

    def start(self) -> None:
        self.server.start()
        self.url = self.server.url

    def copy_logs(self, directory: Path) -> list[Path]:
        directory.mkdir(parents=True, exist_ok=True)
        copy = directory / f"redis-{self.server.port}.log"
        with contextlib.suppress(OSError):
            shutil.copyfile(self.server.logfile, copy)
            return [copy]
        return []

    def inject(self) -> None:
        # while no AOF fsync runs: everysec loses what it answered during one (kill's doc)
        self.server.kill(between_fsyncs=True)

        def restart() -> None:
            time.sleep(0.5)  # down for a while, with calls arriving
            self.server.stop(cleanup=False)
            self.server.start()
            self.back_at = time.monotonic()

        self.restarter = threading.Thread(target=restart, daemon=True)
        self.restarter.start()

    def recovered(self) -> float:
        assert self.restarter is not None
        self.restarter.join(FAILOVER_S)
        assert self.back_at, "the server did not come back"
        return self.back_at

    def stop(self) -> None:
        if self.restarter is not None:
            self.restarter.join(FAILOVER_S)
        self.server.stop()


def _replicas_online(port: int) -> int:
    with redis.Redis(port=port, socket_timeout=2) as conn:
        info = conn.info("replication")
    return sum(1 for key, value in info.items()
               if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online")


def _wait(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            if check():
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


# ---------------------------------------------------------------------------- state


@dataclass
class Prepared:
    """What the operations after the fault work on, made before it."""

    shards: int
    claims: list[str] = field(default_factory=list)  # leased records of shard 0
    dead: list[int] = field(default_factory=list)  # dead-lettered offsets of shard 0
    items: list[Any] = field(default_factory=list)  # ShardedGroup items under lease
    scratch_groups: list[str] = field(default_factory=list)
    scratch_streams: list[str] = field(default_factory=list)
    new_streams: list[str] = field(default_factory=list)
    new_groups: list[str] = field(default_factory=list)


def _prepare(client: felix_redis.Client, tag: str, stream_kwargs: dict[str, Any], shards: int) -> Prepared:
    """Records, claims, dead letters and scratch streams/groups for one client's cells
    (``tag`` keeps the sync, asyncio and CLI sets apart)."""
    p = Prepared(shards)
    for i in range(3):
        client.group_create(T, N, S, f"{tag}-scratch{i}")
        p.scratch_groups.append(f"{tag}-scratch{i}")
        client.stream_create(T, N, f"{tag}-gone{i}", shards=shards, **stream_kwargs)
        p.scratch_streams.append(f"{tag}-gone{i}")
        p.new_streams.append(f"{tag}-new{i}")
        p.new_groups.append(f"{tag}-new{i}")
    records = client.group_poll(T, N, S, 0, G, max_records=12)
    assert len(records) == 12, "each cell set needs 12 records of shard 0"
    for record in records[:4]:
        client.group_dead_letter(T, N, S, 0, G, record, reason=f"{tag} before the fault")
        p.dead.append(record.offset)
    p.claims = [r.claim for r in records[4:]]
    return p


# ------------------------------------------------------------------------ the cells


Outcome = tuple[str, float, int]  # operation, seconds from the recovery, tolerated errors


class Cells:
    """Runs named operations one after the other, each until it succeeds (only the
    deployment's tolerated errors are tried again, and counted) or the deadline."""

    def __init__(self, deployment: Deployment, fault_at: float) -> None:
        self.deployment = deployment
        self.fault_at = fault_at
        self.recovered_at: float | None = None
        self.outcomes: list[tuple[str, float, int]] = []

    def deadline(self) -> float:
        # Until the recovery is known, operations may wait for it (FAILOVER_S) plus the bound.
        base = self.recovered_at if self.recovered_at is not None else self.fault_at + FAILOVER_S
        return base + BOUND_S

    def run(self, name: str, call: Callable[[], Any], check: Callable[[Any], None] | None = None,
            *, own_start: bool = False, tolerate: tuple[type[Exception], ...] = ()) -> Any:
        """``own_start``: bounded from this call's start (a new process, a new client);
        ``tolerate``: errors that are tried again (and counted) until the deadline."""
        if own_start:
            self.recovered_at = time.monotonic()
        tolerated = 0
        while True:
            try:
                result = call()
            except tolerate:
                tolerated += 1
                self._again()
                time.sleep(0.2)
                continue
            except Exception as exc:
                raise self._failed(name, exc) from exc
            return self._settled(name, result, check, tolerated)

    async def arun(self, name: str, call: Callable[[], Awaitable[Any]],
                   check: Callable[[Any], None] | None = None, *, tolerate: tuple[type[Exception], ...] = ()) -> Any:
        """As :meth:`run`, for the asyncio client's calls."""
        tolerated = 0
        while True:
            try:
                result = await call()
            except tolerate:
                tolerated += 1
                self._again()
                await asyncio.sleep(0.2)
                continue
            except Exception as exc:
                raise self._failed(f"async {name}", exc) from exc
            return self._settled(f"async {name}", result, check, tolerated)

    def _again(self) -> None:
        """A tolerated error: tried again unless the deadline passed (then it goes up)."""
        if time.monotonic() > self.deadline():
            raise

    def _failed(self, name: str, exc: Exception) -> AssertionError:
        return AssertionError(f"[{self.deployment.name}] {name} failed {time.monotonic() - self.fault_at:.1f}s "
                              f"after the fault: {type(exc).__name__}: {exc} {self.deployment.state()}".rstrip())

    def _settled(self, name: str, result: Any, check: Callable[[Any], None] | None, tolerated: int) -> Any:
        done = time.monotonic()
        assert done <= self.deadline(), (
            f"[{self.deployment.name}] {name} took until {done - self.fault_at:.1f}s after the fault")
        if check is not None:
            check(result)
        self.outcomes.append((name, done - self.fault_at, tolerated))
        return result


def _sync_cells(cells: Cells, c: felix_redis.Client, p: Prepared, ctx: dict[str, Any]) -> None:
    """Every public operation of the synchronous client, its sharded group, producer and
    subscription, each result checked."""
    run = cells.run
    shards = p.shards
    published: list[felix_redis.Published] = []

    def is_published(result: Any) -> None:
        assert isinstance(result, felix_redis.Published) and 0 <= result.shard < shards
        published.append(result)

    # this client's first call after the recovery: it may still meet the old primary
    # (see the module's docstring), as the asyncio client's first call below
    run("publish", lambda: c.publish(T, N, S, b"sync-after-1"), is_published, tolerate=(felix_redis.NotReplicated,))
    run("publish_keyed", lambda: c.publish_keyed(T, N, S, "order-1", b"sync-after-2"), is_published)
    run("publish_batch", lambda: c.publish_batch(T, N, S, [b"sync-after-3", b"sync-after-4"], shard=0),
        lambda r: _all(*[is_published(x) for x in r]))
    producer = ctx["producer"]
    first = run("producer.publish", lambda: producer.publish(T, N, S, b"sync-after-5", shard=1), is_published)
    run("producer.publish_keyed", lambda: producer.publish_keyed(T, N, S, "k", b"sync-after-6"), is_published)
    run("producer.publish_batch", lambda: producer.publish_batch(T, N, S, [b"sync-after-7"], shard=1),
        lambda r: _all(*[is_published(x) for x in r]))
    assert published[-1].offset > first.offset
    run("stream_describe", lambda: c.stream_describe(T, N, S), lambda r: _eq(r.shards, shards))
    run("stream_list", lambda: c.stream_list(T, N), lambda r: _has((T, N, S), r))
    run("stream_create (exists)", lambda: c.stream_create(T, N, S, shards=shards, **ctx["stream_kwargs"]),
        lambda r: _eq(r, False))
    run("stream_create", lambda: c.stream_create(T, N, p.new_streams[0], shards=shards, **ctx["stream_kwargs"]),
        lambda r: _eq(r, True))
    run("stream_trim", lambda: c.stream_trim(T, N, S), lambda r: _eq(r, 0))
    run("stream_delete", lambda: c.stream_delete(T, N, p.scratch_streams[0]))
    run("stream_describe (deleted)", lambda: _raises(felix_redis.NotFound, c.stream_describe, T, N,
                                                     p.scratch_streams[0]))
    run("group_create", lambda: c.group_create(T, N, S, p.new_groups[0], visibility_timeout_ms=VISIBILITY_MS))
    run("group_configure", lambda: c.group_configure(T, N, S, p.new_groups[0], max_attempts=7))
    run("group_list", lambda: c.group_list(T, N, S), lambda r: _has(p.new_groups[0], r))
    run("group_delete", lambda: c.group_delete(T, N, S, p.scratch_groups[0]))
    run("group_list (deleted)", lambda: c.group_list(T, N, S), lambda r: _eq(p.scratch_groups[0] in r, False))
    run("group_describe", lambda: c.group_describe(T, N, S, p.new_groups[0]),
        lambda r: _all(_eq(r.max_attempts, 7), _eq(len(r.shards), shards)))
    run("group_poll", lambda: c.group_poll(T, N, S, 1, G, max_records=3),
        lambda r: _eq([x.shard for x in r], [1, 1, 1]))
    run("group_poll_as", lambda: c.group_poll_as(T, N, S, 1, G, "matrix-1", max_records=2),
        lambda r: _eq(len(r), 2))
    claims = p.claims
    run("group_ack", lambda: c.group_ack(T, N, S, 0, G, claims[0]), lambda r: _eq(r, True))
    run("group_ack_many", lambda: c.group_ack_many(T, N, S, 0, G, claims[1:3]), lambda r: _eq(r, [True, True]))
    run("group_nack", lambda: c.group_nack(T, N, S, 0, G, claims[3], delay=60), lambda r: _eq(r, False))
    run("group_extend", lambda: c.group_extend(T, N, S, 0, G, claims[4], by=60),
        lambda r: _eq(r > time.time() * 1000 + 30_000, True))
    run("group_dead_letter", lambda: c.group_dead_letter(T, N, S, 0, G, claims[5], reason="after"))
    run("group_dead_letters", lambda: c.group_dead_letters(T, N, S, 0, G),
        lambda r: _has(felix_redis.parse_claim(claims[5]).offset, [d.offset for d in r]))
    run("group_redrive", lambda: c.group_redrive(T, N, S, 0, G, [p.dead[0]]), lambda r: _eq(r, 1))
    run("group_discard", lambda: c.group_discard(T, N, S, 0, G, [p.dead[1]]), lambda r: _eq(r, 1))
    run("group_keys", lambda: c.group_keys(T, N, S, G, shard=0), lambda r: _eq(list(r), [0]))
    run("read", lambda: c.read(T, N, S, 0, 0, 5), lambda r: _eq([x.offset for x in r], [0, 1, 2, 3, 4]))
    sub = ctx["subscription"]
    run("subscribe.poll", lambda: _drain_sub(sub), lambda r: _has(b"sync-after-1", r))
    group = ctx["sharded"]
    items = p.items
    run("ShardedGroup.poll", lambda: group.poll(2), lambda r: _eq(len(r), 2))
    run("ShardedGroup.ack", lambda: group.ack(items[0]), lambda r: _eq(r, True))
    run("ShardedGroup.nack", lambda: group.nack_after(items[1], 60), lambda r: _eq(r, False))
    run("ShardedGroup.extend", lambda: group.extend(items[2], 60),
        lambda r: _eq(r > time.time() * 1000 + 30_000, True))
    run("ShardedGroup.dead_letter", lambda: group.dead_letter(items[3], "after"))


async def _async_cells(cells: Cells, a: Any, p: Prepared, ctx: dict[str, Any]) -> None:
    """The same, on the asyncio client."""
    run = cells.arun
    shards = p.shards

    def is_published(result: Any) -> None:
        assert isinstance(result, felix_redis.Published) and 0 <= result.shard < shards

    # this client's first call, which may meet the old primary (see _sync_cells' first)
    await run("publish", lambda: a.publish(T, N, S, b"async-after-1"), is_published,
              tolerate=(felix_redis.NotReplicated,))
    await run("publish_keyed", lambda: a.publish_keyed(T, N, S, "order-2", b"async-after-2"), is_published)
    await run("publish_batch", lambda: a.publish_batch(T, N, S, [b"async-after-3"], shard=1),
              lambda r: _all(*[is_published(x) for x in r]))
    producer = ctx["aproducer"]
    await run("producer.publish", lambda: producer.publish(T, N, S, b"async-after-4", shard=1), is_published)
    await run("producer.publish_keyed", lambda: producer.publish_keyed(T, N, S, "k2", b"async-after-5"),
              is_published)
    await run("stream_describe", lambda: a.stream_describe(T, N, S), lambda r: _eq(r.shards, shards))
    await run("stream_list", lambda: a.stream_list(T, N), lambda r: _has((T, N, S), r))
    await run("stream_create", lambda: a.stream_create(T, N, p.new_streams[0], shards=shards,
                                                       **ctx["stream_kwargs"]), lambda r: _eq(r, True))
    await run("stream_trim", lambda: a.stream_trim(T, N, S), lambda r: _eq(r, 0))
    await run("stream_delete", lambda: a.stream_delete(T, N, p.scratch_streams[0]))
    await run("group_create", lambda: a.group_create(T, N, S, p.new_groups[0]))
    await run("group_configure", lambda: a.group_configure(T, N, S, p.new_groups[0], max_attempts=8))
    await run("group_delete", lambda: a.group_delete(T, N, S, p.scratch_groups[0]))
    await run("group_list", lambda: a.group_list(T, N, S),
              lambda r: _all(_has(p.new_groups[0], r), _eq(p.scratch_groups[0] in r, False)))
    await run("group_describe", lambda: a.group_describe(T, N, S, p.new_groups[0]),
              lambda r: _eq(r.max_attempts, 8))
    await run("group_poll", lambda: a.group_poll(T, N, S, 1, G, max_records=2), lambda r: _eq(len(r), 2))
    await run("group_poll_as", lambda: a.group_poll_as(T, N, S, 1, G, "matrix-2", max_records=2),
              lambda r: _eq(len(r), 2))
    claims = p.claims
    await run("group_ack", lambda: a.group_ack(T, N, S, 0, G, claims[0]), lambda r: _eq(r, True))
    await run("group_ack_many", lambda: a.group_ack_many(T, N, S, 0, G, claims[1:3]),
              lambda r: _eq(r, [True, True]))
    await run("group_nack", lambda: a.group_nack(T, N, S, 0, G, claims[3], delay=60), lambda r: _eq(r, False))
    await run("group_extend", lambda: a.group_extend(T, N, S, 0, G, claims[4], by=60),
              lambda r: _eq(r > time.time() * 1000 + 30_000, True))
    await run("group_dead_letter", lambda: a.group_dead_letter(T, N, S, 0, G, claims[5], reason="after"))
    await run("group_dead_letters", lambda: a.group_dead_letters(T, N, S, 0, G),
              lambda r: _has(felix_redis.parse_claim(claims[5]).offset, [d.offset for d in r]))
    await run("group_redrive", lambda: a.group_redrive(T, N, S, 0, G, [p.dead[0]]), lambda r: _eq(r, 1))
    await run("group_discard", lambda: a.group_discard(T, N, S, 0, G, [p.dead[1]]), lambda r: _eq(r, 1))
    await run("read", lambda: a.read(T, N, S, 0, 0, 3), lambda r: _eq([x.offset for x in r], [0, 1, 2]))
    sub = ctx["asubscription"]
    await run("subscribe.poll", lambda: _adrain_sub(sub), lambda r: _has(b"async-after-1", r))
    group = ctx["asharded"]
    items = p.items
    await run("ShardedGroup.poll", lambda: group.poll(2), lambda r: _eq(len(r), 2))
    await run("ShardedGroup.ack", lambda: group.ack(items[0]), lambda r: _eq(r, True))
    await run("ShardedGroup.nack", lambda: group.nack_after(items[1], 60), lambda r: _eq(r, False))
    await run("ShardedGroup.extend", lambda: group.extend(items[2], 60),
              lambda r: _eq(r > time.time() * 1000 + 30_000, True))
    await run("ShardedGroup.dead_letter", lambda: group.dead_letter(items[3], "after"))


def _cli_cells(cells: Cells, deployment: Deployment, p: Prepared) -> None:
    """felixctl commands: new processes, the URL naming the dead node; each within the
    bound of its own start."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FELIX_REDIS_URL": deployment.url,
           "FELIX_TENANT": T, "FELIX_NAMESPACE": N}
    env.pop("FELIX_REDIS_URL_FILE", None)

    def cli(*args: str) -> Callable[[], str]:
        def call() -> str:
            started = time.monotonic()
            done = subprocess.run([*FELIXCTL, *args], capture_output=True, text=True, env=env,
                                  timeout=BOUND_S + 20, stdin=subprocess.DEVNULL)
            took = time.monotonic() - started
            assert done.returncode == 0, f"felixctl {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}"
            assert took <= BOUND_S + 3, f"felixctl {' '.join(args)} took {took:.1f}s"  # + interpreter start
            return done.stdout
        return call

    def run(name: str, call: Callable[[], Any], check: Callable[[Any], None] | None = None) -> Any:
        return cells.run(name, call, check, own_start=True)

    claims = p.claims
    run("felixctl pub", cli("pub", S, "--shard", "0", "cli-after"), lambda out: _eq(out.startswith("0:"), True))
    run("felixctl stream describe", cli("stream", "describe", S), lambda out: _has(S, out))
    run("felixctl stream list", cli("stream", "list"), lambda out: _has(S, out))
    run("felixctl stream create", cli("stream", "create", p.new_streams[0], "--shards", "1"))
    run("felixctl stream delete", cli("stream", "delete", p.scratch_streams[0], "--yes"))
    run("felixctl stream trim", cli("stream", "trim", S))
    run("felixctl group create", cli("group", "create", S, p.new_groups[0]))
    run("felixctl group configure", cli("group", "configure", S, p.new_groups[0], "--max-attempts", "9"))
    run("felixctl group list", cli("group", "list", S), lambda out: _has(p.new_groups[0], out))
    run("felixctl group keys", cli("group", "keys", S, G, "--shard", "0"), lambda out: _has(":g:" + G, out))
    run("felixctl group delete", cli("group", "delete", S, p.scratch_groups[0], "--yes"))
    run("felixctl group describe", cli("group", "describe", S, G), lambda out: _has("shard", out.lower()))
    run("felixctl group poll", cli("group", "poll", S, G, "--max", "1"), lambda out: _eq(out.count("\t"), 1))
    run("felixctl group ack", cli("group", "ack", S, G, claims[0]))
    run("felixctl group nack", cli("group", "nack", S, G, claims[1], "--delay-ms", "60000"))
    run("felixctl group extend", cli("group", "extend", S, G, claims[2]))
    run("felixctl group dead-letter", cli("group", "dead-letter", S, G, claims[3], "--reason", "cli"))
    run("felixctl group dead-letters", cli("group", "dead-letters", S, G, "-o", "json"),
        lambda out: _has(str(felix_redis.parse_claim(claims[3]).offset), out))
    run("felixctl group redrive", cli("group", "redrive", S, G, f"0:{p.dead[0]}"))
    run("felixctl group discard", cli("group", "discard", S, G, f"0:{p.dead[1]}"))
    run("felixctl sub", cli("sub", S, "--shard", "0", "--max", "2"), lambda out: _eq(len(out.splitlines()), 2))
    run("felixctl worker --burst", cli("worker", S, p.new_groups[0], "builtins:repr", "--burst",
                                       "--poll-wait", "0.2"))


# --------------------------------------------------------------------------- checks


def _all(*checks: None) -> None:
    """Several checks in one lambda (each has raised already if it failed)."""


def _eq(got: Any, want: Any) -> None:
    assert got == want, f"got {got!r}, want {want!r}"


def _has(want: Any, got: Any) -> None:
    assert want in got, f"{want!r} not in {got!r}"


def _raises(kind: type[Exception], call: Callable[..., Any], *args: Any) -> bool:
    with pytest.raises(kind):
        call(*args)
    return True


def _drain_sub(sub: Any) -> list[bytes]:
    seen: list[bytes] = []
    while batch := sub.poll(block=0.05):
        seen += [r.payload for r in batch]
    return seen


async def _adrain_sub(sub: Any) -> list[bytes]:
    seen: list[bytes] = []
    while batch := await sub.poll(block=0.05):
        seen += [r.payload for r in batch]
    return seen


# ----------------------------------------------------------------------- the workers


class Workers:
    """A Worker and an AsyncWorker (each with its own client, made before the fault)
    consuming their own streams through the fault."""

    def __init__(self, url: str, stream_kwargs: dict[str, Any], shards: int) -> None:
        self.url = url
        self.handled: dict[str, set[bytes]] = {"w": set(), "aw": set()}
        self.setup = felix_redis.connect(url)
        for stream in ("w", "aw"):
            self.setup.stream_create(T, N, stream, shards=shards, **stream_kwargs)
            self.setup.group_create(T, N, stream, "wg", visibility_timeout_ms=10_000)
        self.client = felix_redis.connect(url)
        self.worker = felix_redis.Worker(self.client, T, N, "w", "wg", self._handle("w"), concurrency=2,
                                         poll_wait_s=0.5, handle_signals=False)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.loop = asyncio.new_event_loop()
        self.aclient: Any = None
        self.aworker: Any = None
        self.athread = threading.Thread(target=self._run_async, daemon=True)
        self.astarted = threading.Event()

    def _handle(self, stream: str) -> Callable[[felix_redis.Record], None]:
        def handle(record: felix_redis.Record) -> None:
            self.handled[stream].add(record.payload)
        return handle

    def _run_async(self) -> None:
        async def main() -> None:
            self.aclient = await felix_async.connect(self.url)
            handle = self._handle("aw")

            async def ahandle(record: felix_redis.Record) -> None:
                handle(record)

            self.aworker = felix_redis.AsyncWorker(self.aclient, T, N, "aw", "wg", ahandle, concurrency=2,
                                                   poll_wait_s=0.5, handle_signals=False)
            self.astarted.set()
            try:
                await self.aworker.run()
            finally:
                await self.aclient.close()

        self.loop.run_until_complete(main())

    def start(self) -> None:
        self.thread.start()
        self.athread.start()
        assert self.astarted.wait(10)
        self.publish("before")
        self.wait_handled("before", deadline=time.monotonic() + 15)

    def publish(self, tag: str) -> None:
        for stream in ("w", "aw"):
            self.setup.publish_batch(T, N, stream, [f"{tag}-{i}".encode() for i in range(6)])

    def wait_handled(self, tag: str, deadline: float) -> None:
        want = {f"{tag}-{i}".encode() for i in range(6)}
        while not all(want <= self.handled[s] for s in ("w", "aw")):
            if time.monotonic() > deadline:
                missing = {s: sorted(want - self.handled[s]) for s in ("w", "aw")}
                raise AssertionError(f"the workers did not handle {missing} in time")
            time.sleep(0.05)

    def stop(self) -> None:
        self.worker.stop()
        if self.aworker is not None:
            self.loop.call_soon_threadsafe(self.aworker.stop)
        self.thread.join(40)
        self.athread.join(40)
        self.client.close()
        self.setup.close()


# ------------------------------------------------------------------------ the matrix


DEPLOYMENTS: dict[str, Callable[[], Deployment]] = {
    "sentinel-kill": lambda: SentinelDeployment("kill"),
    "sentinel-pause": lambda: SentinelDeployment("pause"),
    "sentinel-failover": lambda: SentinelDeployment("failover"),
    "cluster-kill": lambda: ClusterDeployment("kill"),
    "cluster-failover": lambda: ClusterDeployment("failover"),
    "standalone-restart-aof": RestartDeployment,
}


@pytest.fixture
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    made = DEPLOYMENTS[request.param]()
    try:
        made.start()
        yield made
    finally:
        made.stop()


@pytest.mark.parametrize("deployment", list(DEPLOYMENTS), indirect=True)
def test_every_operation_on_the_same_clients_survives(deployment: Deployment, record_property: Any) -> None:
    shards = 2
    kwargs = deployment.stream_kwargs
    c = felix_redis.connect(deployment.url)
    loop = asyncio.new_event_loop()
    a = loop.run_until_complete(felix_async.connect(deployment.url))
    workers: Workers | None = None
    cells: Cells | None = None
    fault_wall: float | None = None
    recovered: list[float] = []
    failed = True
    try:
        # -- before the fault: the stream, records, claims, dead letters, and the
        # objects users keep (producers, sharded groups, subscriptions, workers)
        c.stream_create(T, N, S, shards=shards, **kwargs)
        c.group_create(T, N, S, G, visibility_timeout_ms=VISIBILITY_MS)
        for shard in range(shards):
            c.publish_batch(T, N, S, [f"before-{shard}-{i}".encode() for i in range(60)], shard=shard)
        prepared = {tag: _prepare(c, tag, kwargs, shards) for tag in ("sync", "async", "cli")}
        sharded, asharded = c.group_sharded(T, N, S, G), a.group_sharded(T, N, S, G)
        prepared["sync"].items = _poll_items(sharded, 4)
        prepared["async"].items = loop.run_until_complete(_apoll_items(asharded, 4))
        ctx = {
            "stream_kwargs": kwargs,
            "producer": c.idempotent_producer(),
            "aproducer": loop.run_until_complete(a.idempotent_producer()),
            "sharded": sharded,
            "asharded": asharded,
            "subscription": c.subscribe(T, N, S, start="latest"),
            "asubscription": loop.run_until_complete(a.subscribe(T, N, S, start="latest")),
        }
        ctx["producer"].publish(T, N, S, b"producer-before", shard=1)
        loop.run_until_complete(ctx["aproducer"].publish(T, N, S, b"aproducer-before", shard=1))
        workers = Workers(deployment.url, kwargs, shards)
        workers.start()
        deployment.settle()

        # -- the fault; the operations start at once and must ride it out
        fault_at = time.monotonic()
        fault_wall = time.time()
        deployment.inject()
        cells = Cells(deployment, fault_at)
        watcher = threading.Thread(target=lambda: recovered.append(deployment.recovered()), daemon=True)
        watcher.start()
        if isinstance(deployment, SentinelDeployment) and deployment.how == "pause":
            # calls sent to a paused server wait on it (the socket timeout); the cells
            # start once it is resumed, see the module's docstring
            watcher.join(FAILOVER_S + 5)
        # The first call meets the failover itself: sent to the dead primary it waits
        # for the promotion; a quorum write the promoted primary cannot confirm yet (no
        # replica follows it) or one taken by a resumed old primary fails with
        # NotReplicated, the documented answer, and is tried again here.
        cells.run("publish (first call)", lambda: c.publish(T, N, S, b"first-after"),
                  lambda r: _eq(isinstance(r, felix_redis.Published), True), tolerate=(felix_redis.NotReplicated,))
        watcher.join(FAILOVER_S + 5)
        assert recovered, f"[{deployment.name}] the deployment did not recover within {FAILOVER_S}s"
        cells.recovered_at = recovered[0]

        _sync_cells(cells, c, prepared["sync"], ctx)
        loop.run_until_complete(_async_cells(cells, a, prepared["async"], ctx))
        workers.publish("after")
        workers.wait_handled("after", deadline=cells.deadline())
        cells.outcomes.append(("Worker and AsyncWorker", time.monotonic() - fault_at, 0))
        _cli_cells(cells, deployment, prepared["cli"])
        deployment.after()

        # -- report: seconds from the fault to each success; the recovery time
        first = cells.outcomes[0][1]
        lib = [t for name, t, _ in cells.outcomes if not name.startswith("felixctl")]
        tolerated = sum(n for _, _, n in cells.outcomes)
        line = (f"[{deployment.name}] recovered (promotion) {recovered[0] - fault_at:.2f}s after the fault; "
                f"first publish on the same client {first:.2f}s; {len(cells.outcomes)} operations, the library's "
                f"done by {max(lib):.2f}s (median {statistics.median(lib):.2f}s); tolerated NotReplicated: {tolerated}")
        print("\n" + line)
        for name, took, n in cells.outcomes:
            print(f"  {name:32s} {took:6.2f}s" + (f"  ({n} NotReplicated first)" if n else ""))
        record_property("promotion_s", round(recovered[0] - fault_at, 3))
        record_property("first_publish_s", round(first, 3))
        record_property("library_done_s", round(max(lib), 3))
        record_property("summary", line)
        failed = False
    finally:
        if failed or os.environ.get(KEEP_LOGS_ENV):
            _keep_logs(deployment, cells, fault_wall, recovered)
        if workers is not None:
            workers.stop()
        c.close()
        with contextlib.suppress(Exception):
            loop.run_until_complete(a.close())
        loop.close()


def _keep_logs(deployment: Deployment, cells: Cells | None, fault_wall: float | None,
               recovered: list[float]) -> None:
    """Keeps the deployment's logs (a failed run's always, every run's with
    ``$FELIX_KEEP_LOGS``) with a timeline naming the fault's wall-clock time, the
    recovery and each operation's success, in ``$FELIX_KEEP_LOGS/<deployment>-<time>``
    or a new temporary directory; prints where."""
    stamp = time.strftime("%H%M%S") + f"-{os.getpid()}"
    parent = os.environ.get(KEEP_LOGS_ENV)
    if parent:
        directory = Path(parent) / f"{deployment.name}-{stamp}"
    else:
        directory = Path(tempfile.mkdtemp(prefix=f"felix-failover-{deployment.name}-"))
    with contextlib.suppress(Exception):
        deployment.copy_logs(directory)
        lines = []
        if fault_wall is not None and cells is not None:
            lines.append(f"fault {time.strftime('%H:%M:%S', time.localtime(fault_wall))}"
                         f".{int(fault_wall * 1000) % 1000:03d} (monotonic {cells.fault_at:.3f})")
            if recovered:
                lines.append(f"recovered +{recovered[0] - cells.fault_at:.3f}s")
            lines += [f"{name} ok +{took:.3f}s" + (f" ({n} tolerated)" if n else "")
                      for name, took, n in cells.outcomes]
        (directory / "timeline.txt").write_text("\n".join(lines) + "\n")
        print(f"\n[{deployment.name}] logs kept in {directory}")


def _poll_items(group: Any, n: int) -> list[Any]:
    items: list[Any] = []
    deadline = time.monotonic() + 10
    while len(items) < n and time.monotonic() < deadline:
        items += group.poll(n - len(items))
    assert len(items) == n
    return items


async def _apoll_items(group: Any, n: int) -> list[Any]:
    items: list[Any] = []
    deadline = time.monotonic() + 10
    while len(items) < n and time.monotonic() < deadline:
        items += await group.poll(n - len(items))
    assert len(items) == n
    return items
