"""The synchronous client. All logic lives in :mod:`felix_redis.protocol`; this module
executes its plans on a redis-py connection."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any, TypeVar

from redis.exceptions import (
    AskError,
    ReadOnlyError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from felix_redis import schedules, scripts
from felix_redis._driver import (
    UNAVAILABLE,
    BatchRun,
    Item,
    Ref,
    ShardedGroupBase,
    by_node,
    check_raw_client,
    describe_server,
    max_block_ms,
    not_replicated,
    outcome,
    took,
    translate,
    with_nodes,
)
from felix_redis.checks import KEEP, Extras, publish_extras
from felix_redis.connection import default_retry_for, resolve_url, sync_client, watch_connects
from felix_redis.constants import ACK_LINGER_S, QUEUED_ACKS_MAX
from felix_redis.errors import (
    ConnectionFailed,
    FelixError,
    NotReplicated,
    redact_url,
)
from felix_redis.keys import check_record_key, producer_public_id
from felix_redis.lane import Lane, borrow, ensure_connected, lane_pool, pool_call, pool_call_many, read_reply
from felix_redis.models import DeadLetter, GroupInfo, Published, Record, StreamInfo
from felix_redis.protocol import (
    Batch,
    BlockAny,
    Cmd,
    Core,
    Eval,
    Op,
    Plan,
    ProducerState,
    Retrying,
    as_bytes,
    check_list,
    new_producer_secret,
    xread_calls,
)
from felix_redis.sentinel_watch import SentinelWatch, sentinel_pool

__all__ = ["Client", "IdempotentProducer", "Item", "ShardedGroup", "Subscription", "connect"]

T = TypeVar("T")

log = logging.getLogger("felix_redis")


class AckFlusher:
    """Sends the queued acks of a client's sharded groups ``ACK_LINGER_S`` after the
    first of them was queued, on a daemon thread started on first use; and all of them
    at once on :meth:`flush_all` (before the client describes a group, at close, at
    interpreter exit), after waiting for a flush the thread has under way."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[ShardedGroup, float] = {}
        self._flushing = 0
        self._thread: threading.Thread | None = None
        #: every group that queued an ack (flush_all sends what any of them holds)
        self.groups: weakref.WeakSet[ShardedGroup] = weakref.WeakSet()
        #: the groups holding records fetched ahead, held on to (:meth:`track`)
        self.holding: set[ShardedGroup] = set()
        _flushers.add(self)

    def defer(self, group: ShardedGroup, after: float | None = None) -> None:
        with self._cond:
            self.groups.add(group)
            if group in self._due:
                return
            due = time.monotonic() + (ACK_LINGER_S if after is None else after)
            sooner = not self._due or due < min(self._due.values())
            self._due[group] = due
            if self._thread is None or not self._thread.is_alive():  # first use, or a forked child
                self._thread = threading.Thread(target=self._run, name="felix-ack-flusher", daemon=True)
                self._thread.start()
            elif sooner:
                self._cond.notify_all()  # else it wakes for an earlier one, and sees this one then

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if not self._due:
                        if not self._cond.wait(60.0) and not self._due:
                            self._thread = None  # idle a minute: the next defer starts another
                            return
                        continue
                    wait = min(self._due.values()) - time.monotonic()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                now = time.monotonic()
                ready = []
                for group in [g for g, at in self._due.items() if at <= now]:
                    # (a poll took the acks this wait was for: those queued since wait their own)
                    if (left := group._linger_left(ACK_LINGER_S)) > 0:
                        self._due[group] = now + left
                    else:
                        del self._due[group]
                        ready.append(group)
                self._flushing += len(ready)
            for group in ready:
                try:
                    group._flush_in_background()
                except Exception:  # a bug must not stop the thread: the others still go
                    log.exception("queued acks of group %s", group.group)
                finally:
                    with self._cond:
                        self._flushing -= 1
                        self._cond.notify_all()

    def flush_all(self, timeout: float = 5.0) -> None:
        """Sends every queued ack now, once a flush the thread has under way is done
        (at most ``timeout`` seconds); errors are logged: those records come again."""
        with self._cond:
            self._due.clear()
            deadline = time.monotonic() + timeout
            while self._flushing and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            groups = [g for g in self.groups if g._queued]
        for group in groups:
            group._flush_in_background(again=False)

    def track(self, group: ShardedGroup) -> None:
        """Holds on to ``group`` while it holds records fetched ahead (a group the
        caller dropped is still released at :meth:`release_all`); groups whose buffer
        emptied are let go."""
        with self._cond:
            self.holding = {g for g in self.holding if g._buffer}
            self.holding.add(group)

    def release_all(self) -> None:
        """At the client's close and at interpreter exit: the records the groups fetched
        ahead and did not hand out are released, then every queued ack is sent."""
        with self._cond:
            holding, self.holding = [g for g in self.holding if g._buffer], set()
        for group in holding:
            try:
                group._release_buffer()
            except Exception:  # one group's failure must not keep the others' releases and acks
                log.exception("records fetched ahead by group %s", group.group)
        self.flush_all()

    def _after_fork(self) -> None:
        """In a forked child: new locks (a thread of the parent may have held them), no
        thread, nothing scheduled (the queued acks stay with their groups)."""
        self._cond = threading.Condition()
        self._due, self._flushing, self._thread = {}, 0, None
        for group in list(self.groups):
            group._queue_lock = threading.Lock()
        # records fetched ahead are the parent's: the child neither hands them out nor
        # releases them at its exit (each group drops them at its first use in the child:
        # ShardedGroupBase._own_buffer; their lock is new, a parent thread may have held it)
        for group in self.holding:
            group._buffer_lock = threading.Lock()
        self.holding = set()


_flushers: weakref.WeakSet[AckFlusher] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """Acks still queued when the interpreter exits normally are sent, and records
    fetched ahead released (a process that is killed loses both: their records are
    delivered again after their lease, never lost)."""
    for flusher in list(_flushers):
        flusher.release_all()


def _after_fork_in_child() -> None:
    for flusher in list(_flushers):
        flusher._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Client:
    """Streams, groups and records on one Redis deployment.

    ``Client(redis_client)`` wraps an existing redis-py client (``Redis``, a client from
    ``Sentinel.master_for``, or ``RedisCluster``); :func:`connect` builds one from a URL.
    """

    def __init__(
        self,
        redis_client: Any,
        *,
        prefix: str = "felix",
        idempotent_publish: bool = True,
        retry_for: float = 2.0,
        url: str | None = None,
    ) -> None:
        check_raw_client(redis_client)
        self.redis = redis_client
        self._cluster = hasattr(redis_client, "get_node_from_key")
        self._max_block_ms = max_block_ms(redis_client)
        self.core = Core(prefix=prefix, idempotent_publish=idempotent_publish, retry_for=retry_for)
        self.core.cluster = self._cluster
        self.core.block_cap_ms = self._max_block_ms
        watch_connects(redis_client, self._connected)
        self.url = redact_url(url) if url else describe_server(redis_client)
        self._runner = scripts.Runner()
        #: redis-py's pool, where script calls may borrow connections one call at a time
        #: (:func:`felix_redis.lane.pool_call`); None: through execute_command
        self._pool = lane_pool(redis_client)
        self._lane = Lane(self._pool) if self._pool is not None else None
        #: Sentinel: follows the announcements of a new primary (felix_redis.sentinel_watch)
        spool = sentinel_pool(redis_client)
        self._watch = SentinelWatch(spool) if spool is not None else None
        if self._watch is not None:
            weakref.finalize(self, self._watch.close)
        #: the queued acks of this client's sharded groups (ShardedGroup.ack)
        self._acks = AckFlusher()

    # -- driver

    def _drive(self, plan: Plan[T]) -> T:
        try:
            op = next(plan)
            while True:
                try:
                    result = self._execute(op)
                except FelixError as exc:
                    op = plan.throw(exc)
                else:
                    op = plan.send(result)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        finally:
            # a plan left behind (an error, a cancelled task) runs its cleanup now
            plan.close()

    def _connected(self, _conn: Any) -> None:
        """A connection of the client's pool was made or made again (a restart, a
        failover, a server that closed it): what sharded groups know may be stale."""
        self.core.epoch += 1

    def _execute(self, op: Op) -> Any:
        """Runs one op; retries it through a failover when it is safe to repeat."""
        retrying = None
        while True:
            try:
                return self._execute_once(op)
            except ConnectionFailed as exc:
                self.core.epoch += 1
                retrying = retrying or Retrying(op, self.core.retry_for)
                time.sleep(retrying.pause(exc))
                if type(op) is BlockAny:
                    return BlockAny.FAILED

    def _execute_once(self, op: Op) -> Any:
        try:
            if type(op) is Eval:
                if op.replicas:
                    return self._eval_and_wait(op)
                return self._eval(op)
            if type(op) is Cmd:
                if self._cluster and op.key is not None:
                    return self._node(op.key).execute_command(*op.args)
                return self.redis.execute_command(*op.args)
            if type(op) is BlockAny:
                return self._block(op)
            if type(op) is Batch:
                return self._batch(op)
            time.sleep(op.seconds)  # type: ignore[union-attr]
            return None
        except (ResponseError, RedisConnectionError, RedisTimeoutError, *UNAVAILABLE) as exc:
            if self._cluster and (not isinstance(exc, ResponseError) or isinstance(exc, AskError)):
                self._refresh_slots()  # a node failed or a slot moved: read the slot map again
            raise translate(exc, op, self.url) from None

    def _node(self, key: str) -> Any:
        """Redis Cluster: the client of the node that serves ``key``'s slot, by redis-py's
        slot map. Keyed calls go there directly: redis-py would first ask its default node
        for the keys of an FCALL or XREAD (``COMMAND GETKEYS``), a round trip more, and
        one that fails for good when the default node is the one that died."""
        return self.redis.get_redis_connection(self.redis.get_node_from_key(key))

    def _eval(self, op: Eval) -> Any:
        """FCALL (or EVALSHA) on the client's lane (:mod:`felix_redis.lane`) when it is
        free, else on a connection borrowed for it from the pool (on Redis Cluster, the
        pool of the node serving the key's slot), else (memory://, a pool the lane does
        not suit) through execute_command. One attempt: :meth:`_execute` decides what is
        sent again. A server that does not hold the library (or the script) gets it
        loaded and the call again (see :class:`scripts.Runner`); MOVED/ASK reads the slot
        map again and sends the call to the node it names."""
        runner, lane = self._runner, self._lane
        for _ in range(3):
            command = runner.command(op.script, op.keys, op.args)
            pool = self._node(op.keys[0]).connection_pool if self._cluster else self._pool
            try:
                if lane is not None and lane.lock.acquire(False):
                    try:
                        return lane.call(command)
                    finally:
                        lane.lock.release()
                if pool is not None:
                    return pool_call(pool, command)
                return self.redis.execute_command(*command)
            except ResponseError as exc:
                if runner.missing(exc):
                    self._load(op.script, pool)
                elif isinstance(exc, AskError) and self._cluster:
                    self._refresh_slots()  # MOVED or ASK: the script did not run there
                elif not runner.switch_to_evalsha(exc):
                    raise
        raise ConnectionFailed(f"{op.context}: Redis at {self.url} keeps forgetting the scripts (FLUSH?) "
                               "or redirecting the call", unsent=True)

    def _load(self, name: str, pool: Any = None) -> None:
        """Loads the library, or the one script, on the server of ``pool`` (on Redis
        Cluster the node that lacked it), else through execute_command (every primary of
        a Cluster)."""
        command = self._runner.load(name)
        try:
            if pool is not None:
                pool_call(pool, command)
            else:
                self.redis.execute_command(*command)
        except ResponseError as exc:
            if not self._runner.switch_to_evalsha(exc):
                raise

    def _batch(self, op: Batch) -> list[Any]:
        """The calls in one pipeline (see :class:`BatchRun`); on Redis Cluster one
        pipeline per node (:meth:`_cluster_batch`); one by one with WAIT."""
        if len(op.ops) == 1:
            return [outcome(self._execute_once, op.ops[0])]
        if self._cluster:
            return self._cluster_batch(op)
        if any(type(e) is Eval and e.replicas for e in op.ops):
            return [outcome(self._execute_once, e) for e in op.ops]
        run = BatchRun(op, self._runner, self.url, self.core.retry_for)
        lane = self._lane
        while (commands := run.commands()) is not None:
            if run.pause:
                self.core.epoch += 1  # a call was refused: a failover or restart is under way
                time.sleep(run.pause)
            replies = None
            if lane is not None and lane.lock.acquire(False):
                try:
                    replies = lane.call_many(commands)  # one write on the lane, when it is free
                finally:
                    lane.lock.release()
            if replies is None:
                pipe = self.redis.pipeline(transaction=False)
                for command in commands:
                    pipe.execute_command(*command)
                replies = pipe.execute(raise_on_error=False)
            for name in run.take(replies):
                self._load(name)
        return run.results

    def _cluster_batch(self, op: Batch) -> list[Any]:
        """Redis Cluster: the calls of each node in one pipeline on that node's
        connection (:meth:`_node_batch`), a node after the other: a round trip per node
        rather than per call. Calls :func:`by_node` leaves alone, and those a node
        answered MOVED or ASK (they did not run there), go one by one through
        :meth:`_execute_once`, which follows the redirection. The replies are in the
        calls' order, each the reply or the FelixError of its call."""
        results: list[Any] = [None] * len(op.ops)
        alone, nodes = by_node(op, self.redis.get_node_from_key)
        refresh = False
        for node, indices in nodes:
            pool = self.redis.get_redis_connection(node).connection_pool
            run = self._node_batch(Batch([op.ops[i] for i in indices]), pool)
            for i, result in zip(indices, run.results, strict=True):
                results[i] = result
            alone += [indices[j] for j in run.redirected]
            refresh = refresh or bool(run.redirected) or run.failed
        if refresh:
            self._refresh_slots()  # a node failed or slots moved: read the slot map again
        for i in sorted(alone):
            results[i] = outcome(self._execute_once, op.ops[i])
        return results

    def _node_batch(self, op: Batch, pool: Any) -> BatchRun:
        """``op``'s calls (all of one Redis Cluster node) in one pipeline on a connection
        of that node's ``pool``, as :meth:`_batch` runs a batch elsewhere: the library is
        loaded on that node when it lacks it. The run's results hold each call's reply or
        FelixError; those answered MOVED or ASK are in its ``redirected``, not run. A
        lost connection (or a refused load) is every call's error that had no reply yet,
        and sets the run's ``failed``: the caller reads the slot map again."""
        run = BatchRun(op, self._runner, self.url, self.core.retry_for, redirects=True)
        try:
            while (commands := run.commands()) is not None:
                if run.pause:
                    self.core.epoch += 1  # a call was refused: a failover or restart is under way
                    time.sleep(run.pause)
                for name in run.take(pool_call_many(pool, commands)):
                    self._load(name, pool)
        except (ResponseError, RedisConnectionError, RedisTimeoutError, *UNAVAILABLE) as exc:
            run.failed = not isinstance(exc, ResponseError) or isinstance(exc, AskError)
            for i in run.todo:
                run.results[i] = translate(exc, op.ops[i], self.url)
        except FelixError as exc:  # it keeps forgetting the scripts
            for i in run.todo:
                run.results[i] = exc
        return run

    def _block(self, op: BlockAny) -> Any:
        calls = xread_calls(op, getattr(self.redis, "keyslot", None), self._max_block_ms)
        if not self._cluster:
            if op.then is not None and self._pool is not None:
                return took(op, pool_call_many(self._pool, [tuple(calls[0]), self._runner.command(
                    op.then.script, op.then.keys, op.then.args)]))
            return self.redis.execute_command(*calls[0])
        # Redis Cluster: one blocking read per slot, each on its node, at once; the
        # first answer wins.
        if op.bell is not None:
            return self._node(op.bell).execute_command(*calls[0])
        targets = [self._node(args[6]).execute_command for args in calls]
        if len(calls) == 1:
            return targets[0](*calls[0])
        pool = _block_pool()
        futures = [pool.submit(target, *args) for target, args in zip(targets, calls, strict=True)]
        done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
        return next(iter(done)).result()

    def _eval_and_wait(self, op: Eval) -> Any:
        """The script and ``WAIT`` in one round trip on one connection, so WAIT counts
        the replicas of the node that took the write.

        A server without the library or script (restarted, newly promoted) gets it
        loaded on that connection and the call again; on Redis Cluster a MOVED or ASK reply (the script
        did not run there) refreshes the slot map and runs it again on the right node.
        A lost connection refreshes the slot map before the error goes up to
        :meth:`_execute`, which retries only operations that are safe to repeat."""
        timeout = self.core.wait_timeout_ms
        runner = self._runner
        for _ in range(4):
            pool = self._node(op.keys[0]).connection_pool if self._cluster else self.redis.connection_pool
            conn = borrow(pool)
            try:
                ensure_connected(conn)
                conn.send_packed_command(conn.pack_commands([
                    runner.command(op.script, op.keys, op.args),
                    ("WAIT", op.replicas, timeout),
                ]))
                result, acked = _reply(conn), _reply(conn)
                if isinstance(result, ReadOnlyError):
                    conn.disconnect()  # a demoted primary: the next connection asks the sentinels
                if runner.missing(result):
                    conn.send_command(*runner.load(op.script))
                    loaded = _reply(conn)
                    if isinstance(loaded, Exception) and not runner.switch_to_evalsha(loaded):
                        raise loaded
            except BaseException:
                conn.disconnect()  # a reply may still be on its way
                raise
            finally:
                pool.release(conn)
            if runner.missing(result) or runner.switch_to_evalsha(result):
                continue
            if isinstance(result, AskError) and self._cluster:
                self._refresh_slots()
                continue
            if isinstance(result, Exception):
                raise result
            if isinstance(acked, Exception):
                raise acked
            if int(acked) < op.replicas:
                self._refresh_primary()
                raise not_replicated(op, int(acked), timeout)
            return result
        raise ConnectionFailed(f"{op.context}: Redis at {self.url} kept redirecting the call", unsent=True)

    def _refresh_slots(self) -> None:
        """Re-reads the cluster's slot map (after a failover, a lost node, a redirect; what
        sharded groups knew of their shards is forgotten too); a no-op elsewhere."""
        if self._cluster:
            self.core.epoch += 1
            with contextlib.suppress(Exception):
                self.redis.nodes_manager.initialize()

    def _refresh_primary(self) -> None:
        """After too few replicas confirmed a write: the server may be a primary the
        others have left behind (isolated, then failed over). Asks the sentinels (or the
        cluster) where the primary is now, so the next call goes there (a Sentinel pool
        that learns of a new primary drops its connections to the old one; the lane
        drops its own, :func:`felix_redis.lane._stale_primary`)."""
        if self._cluster:
            self._refresh_slots()
        elif hasattr(self.redis.connection_pool, "get_master_address"):
            with contextlib.suppress(Exception):
                self.redis.connection_pool.get_master_address()

    def load_library(self) -> str:
        """Installs the scripts as a Redis function library on the server now (on every
        primary of a Cluster) and returns its name (``felixctl install``). Clients load
        it themselves where their user may (``FUNCTION LOAD``); users holding felix-redis
        roles may not, and get :class:`NotInstalled` until an administrator ran this
        (docs/security.md)."""
        lib = self._runner.library
        try:
            self.redis.function_load(lib.code, replace=True)
        except (ResponseError, RedisConnectionError, RedisTimeoutError) as exc:
            raise translate(exc, Cmd("FUNCTION", "LOAD", context=f"loading library {lib.name}"), self.url) from None
        return lib.name

    def prune_libraries(self) -> list[str]:
        """Deletes the function libraries other felix-redis versions loaded
        (``felix_<digest>`` other than this client's; about 1 MB of server memory each)
        from the server, on every primary of a Cluster; returns their names. Clients of
        those versions still running load theirs again on their next call where their
        user may, else fail with NotInstalled until it is installed again. Libraries with other names
        are left alone. Needs ``FUNCTION LIST`` and ``FUNCTION DELETE`` (an administrator)."""
        nodes = self.redis.get_primaries() if self._cluster else [None]
        steps = scripts.prune_steps(self._runner.library.name, [{"target_nodes": n} if n else {} for n in nodes])
        reply = None
        try:
            while True:
                command, target = steps.send(reply)
                reply = self.redis.execute_command(*command, **target)
        except StopIteration as done:
            return list(done.value)
        except (ResponseError, RedisConnectionError, RedisTimeoutError) as exc:
            op = Cmd("FUNCTION", "DELETE", context="pruning old function libraries")
            raise translate(exc, op, self.url) from None

    def close(self) -> None:
        self._acks.release_all()
        if self._watch is not None:
            self._watch.close()
        if self._lane is not None:
            self._lane.close()
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- streams

    def stream_create(
        self,
        tenant: str,
        namespace: str,
        stream: str,
        kind: str = "queue",
        shards: int = 1,
        replication: int = 1,
        consistency: str = "leader",
        retention_max_len: int | None = None,
        retention_max_age: int | None = None,
        max_payload: int | None = None,
        retention_mode: str = "safe",
        force: bool = False,
    ) -> bool:
        """Creates a stream; True if created, False if it existed with the same settings.

        ``replication`` greater than the copies a shard's primary has now (itself and its
        connected replicas) is refused (InvalidArgument) before anything is written, unless
        ``force`` (then a warning). On a quorum/all stream the shards' writes WAIT like
        every other write; a NotReplicated comes after every shard was written, and a
        call that stopped part-way is completed by making the same call again."""
        return self._drive(self.core.stream_create(
            tenant, namespace, stream, kind, shards, replication, consistency,
            retention_max_len, retention_max_age, max_payload, retention_mode, force,
        ))

    def stream_describe(self, tenant: str, namespace: str, stream: str) -> StreamInfo:
        info = self._drive(self.core.stream_describe(tenant, namespace, stream))
        return with_nodes(info, self.redis) if self._cluster else info

    def stream_overview(
        self, tenant: str, namespace: str, stream: str
    ) -> tuple[StreamInfo, dict[str, GroupInfo | FelixError]]:
        """``stream_describe`` and every group's ``group_describe`` at once, in two round
        trips whatever the shard and group counts (one pipeline after shard 0's info; on
        Redis Cluster one pipeline per node). A group whose describe failed maps to its
        error, the others still show (the dashboard's overview)."""
        info, groups = self._drive(self.core.stream_overview(tenant, namespace, stream))
        return (with_nodes(info, self.redis) if self._cluster else info), groups

    def has_role(
        self, tenant: str, namespace: str, stream: str, role: str, group: str | None = None
    ) -> bool:
        """Whether this Redis user holds ``role`` (``group.consume``, ``group.manage``: name
        the group; ``stream.publish``, ``stream.admin``) on the stream: what the scripts
        check before they act (docs/security.md). True on a Redis without ACL."""
        return self._drive(self.core.has_role(tenant, namespace, stream, role, group))

    def stream_list(
        self, tenant: str | None = None, namespace: str | None = None
    ) -> list[tuple[str, str, str]]:
        """``(tenant, namespace, stream)`` of every stream, optionally filtered."""
        return self._drive(self.core.stream_list(tenant, namespace))

    def stream_trim(self, tenant: str, namespace: str, stream: str) -> int:
        """Applies the stream's retention now (publishes also do, as the log grows);
        returns how many records were trimmed."""
        return self._drive(self.core.stream_trim(tenant, namespace, stream))

    def stream_delete(self, tenant: str, namespace: str, stream: str) -> None:
        """Deletes a stream, its records and all its groups."""
        self._drive(self.core.stream_delete(tenant, namespace, stream))

    # -- publishing

    def publish(
        self,
        tenant: str,
        namespace: str,
        stream: str,
        payload: bytes | str,
        shard: int | None = None,
        key: str | bytes | None = None,
        *,
        delay: float | None = None,
        deliver_at: datetime | None = None,
        expires_in: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Published:
        """Appends one record. Routed by ``shard``, else by ``key``, else round-robin.
        ``delay`` (seconds) or ``deliver_at`` (a timezone-aware datetime): no group
        hands it out before then (server clock); ``expires_in`` (seconds): never handed
        out after that (a group dead-letters it, reason ``expired``); ``headers``:
        str to str, returned on the record (docs/concepts.md)."""
        if type(payload) is not bytes:
            payload = as_bytes(payload)
        extras = publish_extras(delay, deliver_at, expires_in, headers)
        return self._publish_single(tenant, namespace, stream, payload, shard, key, extras, None)

    def _publish_single(
        self, tenant: str, namespace: str, stream: str, payload: bytes, shard: int | None, key: object,
        extras: Extras | None, producer: ProducerState | None,
    ) -> Published:
        """One payload with ``producer`` (held by the caller; None: one from the pool):
        the script call straight away when the caches allow, else the plan."""
        core = self.core
        send = None if extras is not None else core.quick_single(
            tenant, namespace, stream, payload, shard, key, producer)
        if send is None:
            if producer is None:
                return self._drive(core.publish_single(tenant, namespace, stream, payload, shard, key, extras))
            return self._drive(core.publish_one(tenant, namespace, stream, payload, shard, key, producer, extras))
        try:
            reply = self._execute(send[1])
        except BaseException as exc:
            return self._drive(core.single_failed(send, exc, tenant, namespace, stream, payload, shard, key))
        return core.single_sent(send, reply)

    def publish_keyed(
        self, tenant: str, namespace: str, stream: str, key: str | bytes, payload: bytes | str, *,
        delay: float | None = None, deliver_at: datetime | None = None, expires_in: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Published:
        """Appends one record to the shard ``crc32(key) % shards``."""
        return self.publish_batch(tenant, namespace, stream, [payload], key=check_record_key(key), delay=delay,
                                  deliver_at=deliver_at, expires_in=expires_in, headers=headers)[0]

    def publish_batch(
        self,
        tenant: str,
        namespace: str,
        stream: str,
        payloads: Sequence[bytes | str],
        shard: int | None = None,
        key: str | bytes | None = None,
        *,
        delay: float | None = None,
        deliver_at: datetime | None = None,
        expires_in: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> list[Published]:
        """Appends many records to one shard atomically (one script call); ``delay``,
        ``deliver_at``, ``expires_in`` and ``headers`` apply to each."""
        raw = [as_bytes(p) for p in check_list(payloads, "payloads")]
        extras = publish_extras(delay, deliver_at, expires_in, headers)
        s, first, count = self._drive(self.core.publish_plain(tenant, namespace, stream, raw, shard, key, extras))
        return [Published(s, first + i) for i in range(count)]

    def idempotent_producer(self) -> IdempotentProducer:
        """A producer whose re-sends land once. It holds a random secret that never
        leaves the client except in its publishes; shards know it by a digest
        (:attr:`IdempotentProducer.id`), so no other client can act as it."""
        state = ProducerState()
        state.producer_id = new_producer_secret()
        return IdempotentProducer(self, state)

    # -- groups

    def group_create(
        self,
        tenant: str,
        namespace: str,
        stream: str,
        group: str,
        start: str | int = "earliest",
        visibility_timeout_ms: int | None = None,
        max_attempts: int | None = None,
        *,
        rate_limit: tuple[int, float] | None = None,
    ) -> None:
        """Creates a group on every shard; ``GroupExists`` if it exists. ``rate_limit``:
        (count, per_seconds), at most count hand-outs per window on each shard."""
        self._drive(self.core.group_create(
            tenant, namespace, stream, group, start, visibility_timeout_ms, max_attempts, rate_limit))

    def group_configure(
        self,
        tenant: str,
        namespace: str,
        stream: str,
        group: str,
        visibility_timeout_ms: int | None = None,
        max_attempts: int | None = None,
        *,
        rate_limit: tuple[int, float] | None = KEEP,
    ) -> None:
        """Changes the settings given; ``rate_limit=None`` (or (0, 0)) removes the limit,
        leaving it out keeps it."""
        self._drive(self.core.group_configure(
            tenant, namespace, stream, group, visibility_timeout_ms, max_attempts, rate_limit))

    def group_list(self, tenant: str, namespace: str, stream: str) -> list[str]:
        return self._drive(self.core.group_list(tenant, namespace, stream))

    def group_delete(self, tenant: str, namespace: str, stream: str, group: str) -> None:
        self._drive(self.core.group_delete(tenant, namespace, stream, group))

    def group_poll(
        self,
        tenant: str,
        namespace: str,
        stream: str,
        shard: int,
        group: str,
        max_records: int = 16,
        wait: float | None = None,
        *,
        ack: Iterable[int | Record | Item | str] | None = None,
    ) -> list[Record]:
        """Up to ``max_records`` records under a lease: due redeliveries first, then new
        records in offset order. ``wait``: seconds to block when nothing is due.
        ``ack``: records of this shard to ack first, in the same script call (one round
        trip for a worker's ack and its next poll; see :meth:`group_ack_many`)."""
        return self._drive(self.core.group_poll(
            tenant, namespace, stream, shard, group, max_records, wait, ack=ack))

    def group_poll_as(
        self,
        tenant: str,
        namespace: str,
        stream: str,
        shard: int,
        group: str,
        consumer: str,
        reclaim: bool = True,
        max_records: int = 16,
        wait: float | None = None,
        *,
        ack: Iterable[int | Record | Item | str] | None = None,
    ) -> list[Record]:
        """Like group_poll, as a named consumer; ``reclaim`` takes back its own in-flight
        records at once (attempts + 1) instead of after the visibility timeout; the
        records in ``ack`` are acked before that."""
        return self._drive(self.core.group_poll(
            tenant, namespace, stream, shard, group, max_records, wait, consumer, reclaim, ack))

    def group_ack(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        offset: int | Record | Item | str,
    ) -> bool:
        """Finishes a record; False if it was finished already (a no-op). NotFound if it
        was never delivered to the group."""
        return self._drive(self.core.group_ack(tenant, namespace, stream, shard, group, [offset]))[0]

    def group_ack_many(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        offsets: Iterable[int | Record | Item | str],
    ) -> list[bool]:
        """Finishes many records of one shard in one script call, each on its own: per
        offset, True acked now, False finished already. When some were never delivered,
        the others are acked all the same and :class:`~felix_redis.errors.NotDelivered`
        (a NotFound) is raised, its ``outcomes`` holding None for those. References
        that cannot be read (a malformed claim, another shard's record) are reported the
        same way, by :class:`~felix_redis.errors.MalformedClaims` (an InvalidArgument);
        when none can be read, nothing is written."""
        return self._drive(self.core.group_ack(tenant, namespace, stream, shard, group, offsets))

    def group_nack(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        record: Record | Item | str, delay: float = 0.0,
    ) -> bool:
        """Hands a record back, redelivered after ``delay`` seconds. True if it became a
        dead letter instead (its deliveries reached max_attempts)."""
        return self._drive(self.core.group_nack(tenant, namespace, stream, shard, group, record, delay))

    def group_extend(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        record: Record | Item | str, by: float | None = None,
    ) -> int:
        """Sets the lease to expire ``by`` seconds from now (default: the visibility
        timeout); returns the new expiry in ms since the epoch (server time)."""
        return self._drive(self.core.group_extend(tenant, namespace, stream, shard, group, record, by))

    def group_dead_letter(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        record: Record | Item | str, reason: str = "",
    ) -> None:
        self._drive(self.core.group_dead_letter(
            tenant, namespace, stream, shard, group, record, reason))

    def group_consumers(self, tenant: str, namespace: str, stream: str, group: str) -> dict[str, list[str]]:
        """Named consumers (``group_poll_as``) and the claims (``SHARD:OFFSET``) of the
        leases each holds now."""
        return self._drive(self.core.group_consumers(tenant, namespace, stream, group))

    def group_dead_letters(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str
    ) -> list[DeadLetter]:
        return self._drive(self.core.group_dead_letters(tenant, namespace, stream, shard, group))

    def group_dead_letters_all(self, tenant: str, namespace: str, stream: str, group: str) -> list[DeadLetter]:
        """Every shard's dead letters (by shard and offset) in one round trip."""
        return self._drive(self.core.group_dead_letters_all(tenant, namespace, stream, group))

    def group_redrive(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        offsets: Iterable[int | str] | None = None,
    ) -> int:
        """Makes dead letters owed again with attempts starting over (None: all)."""
        return self._drive(self.core.group_redrive(tenant, namespace, stream, shard, group, offsets))

    def group_discard(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        offsets: Iterable[int | str] | None = None,
    ) -> int:
        """Drops dead letters for good (None: all)."""
        return self._drive(self.core.group_discard(tenant, namespace, stream, shard, group, offsets))

    def group_describe(self, tenant: str, namespace: str, stream: str, group: str) -> GroupInfo:
        """The group's numbers, per shard. Acks this client's sharded groups queued
        (``ShardedGroup.ack``) are sent first, so they count as settled."""
        self._acks.flush_all()
        return self._drive(self.core.group_describe(tenant, namespace, stream, group))

    def group_sharded(
        self, tenant: str, namespace: str, stream: str | Sequence[str], group: str, consumer: str | None = None,
        reclaim: bool = True, shards: Iterable[int] | None = None, weights: Sequence[int] | None = None,
        prefetch: int = 0,
    ) -> ShardedGroup:
        """The group across every shard (or ``shards``), for workers (see ShardedGroup).
        ``stream``: a name, or a list of names in priority order (``weights``: None for
        strict order, else one weight per stream). ``prefetch``: records a poll fetches
        in one round trip, handed out ``max_records`` at a time (docs/concepts.md,
        "Prefetch"); 0: what each poll asks for."""
        return ShardedGroup(self, tenant, namespace, stream, group, consumer, reclaim, shards, weights, prefetch)

    def group_keys(
        self, tenant: str, namespace: str, stream: str, group: str, shard: int | None = None
    ) -> dict[int, dict[str, str]]:
        """The Redis keys of a group, per shard and role (docs/keys.md), for redis-cli."""
        return self._drive(self.core.group_keys(tenant, namespace, stream, group, shard))

    # -- reading

    def read(
        self, tenant: str, namespace: str, stream: str, shard: int, start: int, count: int = 100
    ) -> list[Record]:
        """Records of one shard from offset ``start`` on (attempts 0); group-independent."""
        return self._drive(self.core.read(tenant, namespace, stream, shard, start, count))[0]

    def read_at(
        self, tenant: str, namespace: str, stream: str, where: Sequence[tuple[int, int]]
    ) -> list[Record | None]:
        """The records at the given (shard, offset)s in one round trip; None where
        retention trimmed the record (e.g. the payloads of dead letters)."""
        return self._drive(self.core.read_at(tenant, namespace, stream, where))

    def subscribe(
        self,
        tenant: str,
        namespace: str,
        stream: str,
        start: str | int | dict[int, int] = "earliest",
        shards: Iterable[int] | None = None,
        *,
        batch: int = 100,
        block: float = 5.0,
    ) -> Subscription:
        """Iterates the stream's records in offset order per shard and blocks for new
        ones; independent of groups (an audit trail, a replay, a second consumer).
        ``start``: 'earliest', 'latest', one offset for every shard, or {shard: offset}."""
        return Subscription(self, tenant, namespace, stream, start, shards, batch, block)

    # -- recurring schedules (felix_redis.schedules, docs/schedules.md)

    def schedule_set(
        self, tenant: str, namespace: str, stream: str, name: str, payload: bytes | str, *,
        cron: str | None = None, every: float | None = None, timezone: str = "UTC",
        key: str | bytes | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        """Publishes ``payload`` to the stream on a 5-field ``cron`` expression (evaluated
        in ``timezone``) or ``every`` seconds (>= 1), once per due time; the first due time
        is the first one after now. A schedule of that name is replaced."""
        self._drive(schedules.set_plan(self.core, tenant, namespace, stream, name, payload, cron=cron,
                                       every=every, timezone=timezone, key=key, headers=headers))

    def schedule_list(self, tenant: str, namespace: str, stream: str) -> list[schedules.Schedule]:
        """The stream's schedules, by name."""
        return self._drive(schedules.list_plan(self.core, tenant, namespace, stream))

    def schedule_delete(self, tenant: str, namespace: str, stream: str, name: str) -> None:
        """Removes a schedule (unknown: NotFound)."""
        self._drive(schedules.delete_plan(self.core, tenant, namespace, stream, name))

    def schedule_tick(self, tenant: str, namespace: str, stream: str) -> schedules.Ticked:
        """Publishes what the stream's schedules have due now, each due time once however
        many tickers run; returns the records published (a list of Published)."""
        return self._drive(schedules.tick_plan(self.core, tenant, namespace, stream))


def _reply(conn: Any) -> Any:
    """One reply from ``conn``; an error reply is returned, not raised."""
    try:
        return read_reply(conn)
    except ResponseError as exc:
        return exc


_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _block_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="felix-block")
    return _pool


class Subscription:
    """An iterator over a stream's records; ``positions`` says where it stands."""

    def __init__(
        self, client: Client, tenant: str, namespace: str, stream: str, start: object,
        shards: Iterable[int] | None, batch: int, block: float,
    ) -> None:
        self._client = client
        self._where = (tenant, namespace, stream)
        self._batch = batch
        self._block_ms = max(1, int(block * 1000))
        self._closed = False
        self.positions: dict[int, int] = client._drive(
            client.core.subscribe_start(tenant, namespace, stream, start, shards))

    def poll(self, block: float | None = None) -> list[Record]:
        """The next records, waiting up to ``block`` seconds (default: the subscription's)."""
        block_ms = self._block_ms if block is None else int(block * 1000)
        return self._client._drive(self._client.core.subscribe_step(
            *self._where, self.positions, self._batch, block_ms))

    def __iter__(self) -> Iterator[Record]:
        while not self._closed:
            yield from self.poll()

    def close(self) -> None:
        self._closed = True


class IdempotentProducer:
    """Publishes with (producer id, per-shard sequence): a re-send of a sequence the
    shard holds returns the original offsets and appends nothing. Thread-safe; calls are
    serialised (use one producer per thread for parallel publishing)."""

    def __init__(self, client: Client, state: ProducerState) -> None:
        self._client = client
        self._state = state

    @property
    def id(self) -> str | None:
        """The producer's public id (:func:`felix_redis.keys.producer_public_id`; its
        state on a shard is meta's field ``producer:ID``); None after an unknown outcome
        made it start over, until its next publish. The secret itself is never shown."""
        secret = self._state.producer_id
        return None if secret is None else producer_public_id(secret)

    def publish_batch(
        self, tenant: str, namespace: str, stream: str, payloads: Sequence[bytes | str],
        shard: int | None = None, key: str | bytes | None = None, *,
        delay: float | None = None, deliver_at: datetime | None = None, expires_in: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> list[Published]:
        raw = [as_bytes(p) for p in check_list(payloads, "payloads")]
        extras = publish_extras(delay, deliver_at, expires_in, headers)
        with self._state.lock:
            s, first, count = self._client._drive(self._client.core.publish(
                tenant, namespace, stream, raw, shard, key, self._state, extras))
        return [Published(s, first + i) for i in range(count)]

    def publish(
        self, tenant: str, namespace: str, stream: str, payload: bytes | str,
        shard: int | None = None, key: str | bytes | None = None, *,
        delay: float | None = None, deliver_at: datetime | None = None, expires_in: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Published:
        if type(payload) is not bytes:
            payload = as_bytes(payload)
        extras = publish_extras(delay, deliver_at, expires_in, headers)
        with self._state.lock:
            return self._client._publish_single(tenant, namespace, stream, payload, shard, key, extras, self._state)

    def publish_keyed(
        self, tenant: str, namespace: str, stream: str, key: str | bytes, payload: bytes | str, *,
        delay: float | None = None, deliver_at: datetime | None = None, expires_in: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Published:
        return self.publish(tenant, namespace, stream, payload, key=check_record_key(key), delay=delay,
                            deliver_at=deliver_at, expires_in=expires_in, headers=headers)


class ShardedGroup(ShardedGroupBase):
    """One group across all shards of a stream, or of several streams in priority order:
    fair polling, settles routed to the item's stream and shard. ``consumer``: poll as
    that consumer; ``reclaim``: take back its own in-flight records on the first poll of
    each shard; ``shards``: only these shards (of a single stream); ``weights``: with
    several streams, None takes from a stream only what the streams before it could not
    fill, weights share the hand-outs in that proportion while all are busy."""

    def __init__(
        self, client: Client, tenant: str, namespace: str, stream: str | Sequence[str], group: str,
        consumer: str | None = None, reclaim: bool = True, shards: Iterable[int] | None = None,
        weights: Sequence[int] | None = None, prefetch: int = 0,
    ) -> None:
        super().__init__(client.core, tenant, namespace, stream, group, consumer, reclaim, shards, weights,
                         prefetch)
        self._client = client

    def poll(
        self, max_records: int = 16, wait: float | None = None, *, ack: Iterable[Ref] | None = None
    ) -> list[Item]:
        """Up to ``max_records`` items, taken fairly from all shards (of the streams in
        their order); ``wait``: seconds to block (on every shard of every stream at once)
        when nothing is due. ``ack``: items to ack first, in the same round trip (each
        with its shard's poll), as the acks ``ack(item, wait=False)`` queued are. If the poll raises,
        those given may not have been applied: ack them again (acks are idempotent); the
        queued ones stay queued. With ``prefetch``, the records fetched ahead come first,
        without a round trip (``ack`` is then queued, as ``ack(item, wait=False)``)."""
        if not self.prefetch:
            return self._poll_now(max_records, wait, ack)
        self._check_poll(max_records, wait)
        if self._buffer:
            for ref in self._checked_refs(ack):
                self.ack(ref, wait=False)
            if taken := self._from_buffer(max_records):
                return taken
            ack = None  # another poll took the last of them (or a forked child's): fetch, the acks queued
        sent = time.monotonic()
        items = self._fetched(self._poll_now(max(max_records, self.prefetch), wait, ack), max_records, sent)
        if self._buffer:
            self._client._acks.track(self)
        return items

    def _poll_now(self, max_records: int, wait: float | None, ack: Iterable[Ref] | None) -> list[Item]:
        queued, acks = self._with_queued(ack)
        try:
            return self._client._drive(self._poll_plan(max_records, wait, acks))
        except BaseException:
            if queued:
                self._requeue(queued)
                self._client._acks.defer(self)
            raise

    def ack(self, item: Ref, wait: bool = True) -> bool | None:
        """Acks ``item`` at once; returns whether this call acked it (False: it was
        finished already). ``wait=False`` queues the ack instead and returns None: it
        rides on this group's next poll (one round trip for a whole batch), or goes
        ``ACK_LINGER_S`` (5 ms) after the first queued ack, at :meth:`flush`, at
        :meth:`close`, before this client describes a group, or at interpreter exit. A
        process killed before then loses its queued acks: their records are delivered
        again after their lease, never lost (docs/concepts.md, "Queued acks")."""
        if wait:
            return self._client.group_ack(*self._where(item), item)
        if self._queue_ack(item):
            self._client._acks.defer(self)
        elif len(self._queued) >= QUEUED_ACKS_MAX:
            self._flush_in_background()
        return None

    def flush(self) -> int:
        """Sends the queued acks now, one round trip; returns how many were acked now.
        Records never delivered raise NotDelivered once the others were acked; a lost
        connection raises with the acks queued again."""
        refs = self._take_queued()
        if not refs:
            return 0
        try:
            acked = self._client._drive(self._ack_plan(refs))
        except (ConnectionFailed, NotReplicated):
            self._requeue(refs)
            self._client._acks.defer(self, after=0.2)
            raise
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._requeue(refs)  # interrupted: they may not have gone (acks are idempotent)
            raise
        self._flush_failures = 0
        return acked

    def _flush_in_background(self, again: bool = True) -> None:
        """The flusher's flush (errors logged; a lost connection tries again later)."""
        try:
            self.flush()
        except FelixError as exc:
            if self._flush_failed(exc, again):
                self._client._acks.defer(self, after=0.2)

    def close(self) -> None:
        """Sends the queued acks (the group stays usable). With ``prefetch``, the records
        fetched ahead and not handed out are released first: due again at once, the
        delivery that fetched them not counted (they never reached the caller)."""
        self._release_buffer()
        self.flush()

    def _release_buffer(self) -> None:
        """Releases the records fetched ahead."""
        if held := self._take_buffer():
            self._client._drive(self._release_plan(held))

    def _release(self, items: list[Item]) -> None:
        """Releases ``items``, taken from what was fetched ahead and never handed out."""
        self._client._drive(self._release_plan(items))

    def __enter__(self) -> ShardedGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ack_many(self, items: Iterable[Ref]) -> int:
        """Acks items, one script call per shard, all in one round trip; returns how
        many were acked now (the others were finished already). Items never delivered
        raise NotDelivered (a NotFound) once the others were acked."""
        return self._client._drive(self._ack_plan(items))

    def nack(self, item: Ref, delay: float = 0.0) -> bool:
        return self._client.group_nack(*self._where(item), item, delay)

    def nack_after(self, item: Ref, seconds: float) -> bool:
        return self.nack(item, seconds)

    def extend(self, item: Ref, by: float | None = None) -> int:
        return self._client.group_extend(*self._where(item), item, by)

    def dead_letter(self, item: Ref, reason: str = "") -> None:
        self._client.group_dead_letter(*self._where(item), item, reason)


def connect(url: str | None = None, *, prefix: str = "felix", **kwargs: Any) -> Client:
    """A Client for ``url`` (None: ``$FELIX_REDIS_URL``, else redis://localhost:6379/0).

    ``retry_for``: seconds an operation that is safe to repeat is retried through
    connection failures (default 20 for Sentinel and Cluster URLs, so a failover is
    ridden out, else 2). ``idempotent_publish=False`` publishes without producer state.
    """
    url = resolve_url(url)
    kwargs.setdefault("retry_for", default_retry_for(url))
    return Client(sync_client(url), prefix=prefix, url=url, **kwargs)

