"""The asyncio client: the names of :class:`felix_redis.Client`, as coroutines.

It runs the very plans of :mod:`felix_redis.protocol` on ``redis.asyncio``; only the
driver differs from the sync client.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import weakref
from collections.abc import AsyncIterator, Coroutine, Generator, Iterable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from redis.exceptions import AskError, ReadOnlyError, ResponseError
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
    took,
    translate,
    with_nodes,
)
from felix_redis.checks import KEEP, Extras, publish_extras
from felix_redis.connection import (
    async_client,
    default_retry_for,
    resolve_url,
    watch_connects,
)
from felix_redis.constants import ACK_LINGER_S, QUEUED_ACKS_MAX
from felix_redis.errors import ConnectionFailed, FelixError, NotReplicated, redact_url
from felix_redis.keys import check_record_key, producer_public_id
from felix_redis.lane import (
    AsyncLane,
    NotSent,
    async_borrow,
    async_ensure_connected,
    async_node_call,
    async_node_call_many,
    async_pool_call,
    async_pool_call_many,
    lane_pool,
    read_reply,
)
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
from felix_redis.sentinel_watch import AsyncSentinelWatch, sentinel_pool

__all__ = [
    "AsyncClient", "AsyncIdempotentProducer", "AsyncShardedGroup", "AsyncSubscription", "Client", "Item", "connect",
]

T = TypeVar("T")

log = logging.getLogger("felix_redis")


async def _areply(conn: Any) -> Any:
    """One reply from ``conn``; an error reply is returned, not raised (as
    :func:`felix_redis.lane.read_reply`: a Sentinel connection's READONLY stays a reply)."""
    try:
        return await read_reply(conn)
    except ResponseError as exc:
        return exc


async def _to_its_end(client: AsyncClient, release: Coroutine[Any, Any, None], group: str) -> None:
    """Runs ``release`` (a release of records fetched ahead) to its end even when the
    task awaiting it is cancelled meanwhile (a worker's stop cancelled again, a task
    group's cancel scope): they are out of the buffer already, so a release cut off
    before its call went would leave them leased until their lease lapsed, and their
    next delivery counted. The cancellation is raised at once; the release goes on in
    its own task, and its failure is logged; the client's close waits for it (its
    connection is closed with the others)."""
    task = asyncio.ensure_future(release)
    client._releases.add(task)
    task.add_done_callback(client._releases.discard)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(functools.partial(_log_release_failure, group))
        raise


def _log_release_failure(group: str, task: asyncio.Future[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("records fetched ahead by group %s and not handed out were not released: %s", group, exc)


_Self = TypeVar("_Self", bound="_AwaitsToItself")


class _AwaitsToItself:
    """``await obj`` gives ``obj``: what the asyncio client hands out at once can be
    awaited like every other call (``await connect(url)``, ``await client.group_sharded(...)``)."""

    def __await__(self: _Self) -> Generator[Any, None, _Self]:
        return self._itself().__await__()

    async def _itself(self: _Self) -> _Self:
        return self


class AsyncClient(_AwaitsToItself):
    """Streams, groups and records on one Redis deployment, for asyncio code.

    ``AsyncClient(redis_asyncio_client)`` wraps an existing ``redis.asyncio`` client;
    :func:`connect` builds one from a URL.
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
        check_raw_client(redis_client, asyncio=True)
        self.redis = redis_client
        self._cluster = hasattr(redis_client, "get_node_from_key")
        self._max_block_ms = max_block_ms(redis_client)
        self.core = Core(prefix=prefix, idempotent_publish=idempotent_publish, retry_for=retry_for)
        self.core.cluster = self._cluster
        self.core.block_cap_ms = self._max_block_ms
        watch_connects(redis_client, self._connected)
        self.url = redact_url(url) if url else describe_server(redis_client)
        self._runner = scripts.Runner()
        self._pool = lane_pool(redis_client)  # as Client._pool
        self._lane = AsyncLane(self._pool) if self._pool is not None else None
        spool = sentinel_pool(redis_client)  # as Client._watch, started by the first call
        self._watch = AsyncSentinelWatch(spool) if spool is not None else None
        #: as Client._acks: the timers of groups with queued acks, the tasks sending
        #: them, and every group that queued an ack
        self._ack_timers: dict[AsyncShardedGroup, tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle]] = {}
        self._ack_tasks: set[asyncio.Task[None]] = set()
        #: releases of records fetched ahead whose caller was cancelled (_to_its_end)
        self._releases: set[asyncio.Future[None]] = set()
        self._ack_all: weakref.WeakSet[AsyncShardedGroup] = weakref.WeakSet()
        #: the groups holding records fetched ahead, held on to (:meth:`_hold`)
        self._holding: set[AsyncShardedGroup] = set()

    def _defer_acks(self, group: AsyncShardedGroup, after: float | None = None) -> None:
        """Sends ``group``'s queued acks ``after`` seconds from now (None: ACK_LINGER_S)."""
        self._ack_all.add(group)
        loop = asyncio.get_running_loop()
        timer = self._ack_timers.get(group)
        if timer is None or timer[0] is not loop or timer[1].cancelled():  # none, or of a loop now closed
            self._ack_timers[group] = (loop, loop.call_later(ACK_LINGER_S if after is None else after,
                                                             self._flush_later, group))

    def _flush_later(self, group: AsyncShardedGroup) -> None:
        self._ack_timers.pop(group, None)
        if (left := group._linger_left(ACK_LINGER_S)) > 0:
            # a poll took the acks this timer was for: those queued since wait their own linger
            loop = asyncio.get_running_loop()
            self._ack_timers[group] = (loop, loop.call_later(left, self._flush_later, group))
            return
        task = asyncio.ensure_future(group._flush_in_background())
        self._ack_tasks.add(task)
        task.add_done_callback(self._ack_tasks.discard)

    async def _flush_acks(self) -> None:
        """Sends every queued ack now, once the sends under way are done (errors are
        logged: those records are delivered again)."""
        for _loop, timer in self._ack_timers.values():
            timer.cancel()
        self._ack_timers.clear()
        if self._ack_tasks:
            await asyncio.gather(*list(self._ack_tasks), return_exceptions=True)
        for group in [g for g in self._ack_all if g._queued]:
            await group._flush_in_background(again=False)

    def _hold(self, group: AsyncShardedGroup) -> None:
        """Holds on to ``group`` while it holds records fetched ahead, so that a group
        the caller dropped is still released at close; groups whose buffer emptied are
        let go."""
        self._holding = {g for g in self._holding if g._buffer}
        self._holding.add(group)

    async def _release_fetched(self) -> None:
        """At close: the records the groups fetched ahead and did not hand out are
        released (nacked, one round trip a group)."""
        holding, self._holding = [g for g in self._holding if g._buffer], set()
        for group in holding:
            try:
                await group._release_buffer()
            except Exception:  # one group's failure must not keep the others' releases and acks
                log.exception("records fetched ahead by group %s", group.group)

    # -- driver

    async def _drive(self, plan: Plan[T]) -> T:
        if self._watch is not None:
            self._watch.start()
        try:
            op = next(plan)
            while True:
                try:
                    result = await self._execute(op)
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
        """As :meth:`felix_redis.Client._connected`."""
        self.core.epoch += 1

    async def _execute(self, op: Op) -> Any:
        """Runs one op; retries it through a failover when it is safe to repeat."""
        retrying = None
        while True:
            try:
                return await self._execute_once(op)
            except ConnectionFailed as exc:
                self.core.epoch += 1
                retrying = retrying or Retrying(op, self.core.retry_for)
                await asyncio.sleep(retrying.pause(exc))
                if type(op) is BlockAny:
                    return BlockAny.FAILED

    async def _execute_once(self, op: Op) -> Any:
        try:
            if self._cluster and getattr(self.redis, "_initialize", False):
                # Read the slot map before the first call, under redis-py's own lock: when
                # many tasks start on a fresh RedisCluster at once, the ones that do not
                # wait for it can be handed a connection that is being reset (redis-py
                # 8.1 then fails with AttributeError on the connection's writer).
                await self.redis.initialize()
            if type(op) is Eval:
                if op.replicas:
                    return await self._eval_and_wait(op)
                return await self._eval(op)
            if type(op) is Cmd:
                if self._cluster and op.key is not None:
                    return await self.redis.get_node_from_key(op.key).execute_command(*op.args)
                return await self.redis.execute_command(*op.args)
            if type(op) is BlockAny:
                return await self._block(op)
            if type(op) is Batch:
                return await self._batch(op)
            await asyncio.sleep(op.seconds)  # type: ignore[union-attr]
            return None
        except (ResponseError, RedisConnectionError, RedisTimeoutError, *UNAVAILABLE) as exc:
            if self._cluster and (not isinstance(exc, ResponseError) or isinstance(exc, AskError)):
                await self._refresh_slots()  # as Client._execute_once
            raise translate(exc, op, self.url) from None

    async def _eval(self, op: Eval) -> Any:
        """As :meth:`felix_redis.Client._eval`, on redis.asyncio."""
        runner, lane = self._runner, self._lane
        for _ in range(3):
            command = runner.command(op.script, op.keys, op.args)
            node = self.redis.get_node_from_key(op.keys[0]) if self._cluster else None
            try:
                if lane is not None and not lane.in_use:
                    lane.in_use = True
                    try:
                        return await lane.call(command)
                    finally:
                        lane.in_use = False
                return await self._call(command, node)
            except ResponseError as exc:
                if runner.missing(exc):
                    await self._load(op.script, node)
                elif isinstance(exc, AskError) and self._cluster:
                    await self._refresh_slots()  # MOVED or ASK: the script did not run there
                elif not runner.switch_to_evalsha(exc):
                    raise
        raise ConnectionFailed(f"{op.context}: Redis at {self.url} keeps forgetting the scripts (FLUSH?) "
                               "or redirecting the call", unsent=True)

    async def _call(self, command: tuple[Any, ...], node: Any) -> Any:
        """One script call off the lane: on ``node`` of a Redis Cluster (redis-py would
        first ask its default node for the keys, see :meth:`felix_redis.Client._node`), on
        a connection borrowed from the pool for it, else through execute_command."""
        if node is not None:
            return await async_node_call(node, command)
        if self._pool is not None:
            return await async_pool_call(self._pool, command)
        return await self.redis.execute_command(*command)

    async def _load(self, name: str, node: Any = None) -> None:
        """As :meth:`felix_redis.Client._load`, on redis.asyncio."""
        command = self._runner.load(name)
        try:
            if node is not None:
                await async_node_call(node, command)
            else:
                await self.redis.execute_command(*command)
        except ResponseError as exc:
            if not self._runner.switch_to_evalsha(exc):
                raise

    async def _outcome(self, op: Eval | Cmd) -> Any:
        """``op``'s reply, or the FelixError it raised (as :func:`felix_redis._driver.outcome`)."""
        try:
            return await self._execute_once(op)
        except FelixError as exc:
            return exc

    async def _batch(self, op: Batch) -> list[Any]:
        """As :meth:`felix_redis.Client._batch`, on redis.asyncio."""
        if len(op.ops) == 1:
            return [await self._outcome(op.ops[0])]
        if self._cluster:
            return await self._cluster_batch(op)
        if any(type(e) is Eval and e.replicas for e in op.ops):
            return [await self._outcome(e) for e in op.ops]
        run = BatchRun(op, self._runner, self.url, self.core.retry_for)
        lane = self._lane
        while (commands := run.commands()) is not None:
            if run.pause:
                self.core.epoch += 1  # a call was refused: a failover or restart is under way
                await asyncio.sleep(run.pause)
            if lane is not None and not lane.in_use:
                lane.in_use = True  # one write on the lane, as the sync client's batches
                try:
                    replies = await lane.call_many(commands)
                finally:
                    lane.in_use = False
            else:
                pipe = self.redis.pipeline(transaction=False)
                for command in commands:
                    pipe.execute_command(*command)
                replies = await pipe.execute(raise_on_error=False)
            for name in run.take(replies):
                await self._load(name)
        return run.results

    async def _cluster_batch(self, op: Batch) -> list[Any]:
        """As :meth:`felix_redis.Client._cluster_batch`, the nodes' pipelines at once."""
        results: list[Any] = [None] * len(op.ops)
        alone, nodes = by_node(op, self.redis.get_node_from_key)
        runs = await asyncio.gather(*(self._node_batch(Batch([op.ops[i] for i in indices]), node)
                                      for node, indices in nodes))
        refresh = False
        for (_node, indices), run in zip(nodes, runs, strict=True):
            for i, result in zip(indices, run.results, strict=True):
                results[i] = result
            alone += [indices[j] for j in run.redirected]
            refresh = refresh or bool(run.redirected) or run.failed
        if refresh:
            await self._refresh_slots()  # once, after every node's pipeline is done
        for i in sorted(alone):
            results[i] = await self._outcome(op.ops[i])
        return results

    async def _node_batch(self, op: Batch, node: Any) -> BatchRun:
        """As :meth:`felix_redis.Client._node_batch`, on a redis.asyncio cluster ``node``."""
        run = BatchRun(op, self._runner, self.url, self.core.retry_for, redirects=True)
        try:
            while (commands := run.commands()) is not None:
                if run.pause:
                    self.core.epoch += 1  # a call was refused: a failover or restart is under way
                    await asyncio.sleep(run.pause)
                for name in run.take(await async_node_call_many(node, commands)):
                    await self._load(name, node)
        except (ResponseError, RedisConnectionError, RedisTimeoutError, *UNAVAILABLE) as exc:
            run.failed = not isinstance(exc, ResponseError) or isinstance(exc, AskError)
            for i in run.todo:
                run.results[i] = translate(exc, op.ops[i], self.url)
        except FelixError as exc:  # it keeps forgetting the scripts
            for i in run.todo:
                run.results[i] = exc
        return run

    async def _block(self, op: BlockAny) -> Any:
        calls = xread_calls(op, getattr(self.redis, "keyslot", None), self._max_block_ms)
        if not self._cluster:
            if op.then is not None and self._pool is not None:
                return took(op, await async_pool_call_many(self._pool, [calls[0], self._runner.command(
                    op.then.script, op.then.keys, op.then.args)]))
            return await self.redis.execute_command(*calls[0])
        # Redis Cluster: one blocking read per slot, each on its node, at once; the
        # first answer wins.
        if op.bell is not None:
            return await self.redis.get_node_from_key(op.bell).execute_command(*calls[0])
        nodes = [self.redis.get_node_from_key(args[6]) for args in calls]
        if len(calls) == 1:
            return await nodes[0].execute_command(*calls[0])
        tasks = [asyncio.ensure_future(node.execute_command(*args)) for node, args in zip(nodes, calls, strict=True)]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(BaseException):
                await task
        return next(iter(done)).result()

    async def _eval_and_wait(self, op: Eval) -> Any:
        """The script and ``WAIT`` in one round trip on one connection (on Redis Cluster
        a connection of the node that owns the key), so WAIT counts the replicas of the
        node that took the write. A server without the library or script gets it loaded
        there and the call again;
        MOVED/ASK (the script did not run) refreshes the slot map and runs it again."""
        timeout = self.core.wait_timeout_ms
        runner = self._runner
        for _ in range(4):
            commands = [runner.command(op.script, op.keys, op.args), ("WAIT", op.replicas, timeout)]
            node = self.redis.get_node_from_key(op.keys[0]) if self._cluster else None
            if node is not None:
                try:
                    conn = node.acquire_connection()
                except (RedisConnectionError, RedisTimeoutError) as exc:  # none free (max_connections)
                    raise NotSent(exc) from None
            else:
                conn = await async_borrow(self.redis.connection_pool)
            try:
                await async_ensure_connected(conn)
                await conn.send_packed_command(conn.pack_commands(commands))
                result, acked = await _areply(conn), await _areply(conn)
                if isinstance(result, ReadOnlyError):
                    await conn.disconnect()  # a demoted primary: the next connection asks the sentinels
                if runner.missing(result):
                    await conn.send_command(*runner.load(op.script))
                    loaded = await _areply(conn)
                    if isinstance(loaded, Exception) and not runner.switch_to_evalsha(loaded):
                        raise loaded
            except BaseException:
                # A connection left mid-reply must not go back to the pool as it is.
                await conn.disconnect()
                raise
            finally:
                if node is not None:
                    node.release(conn)
                else:
                    await self.redis.connection_pool.release(conn)
            if runner.missing(result) or runner.switch_to_evalsha(result):
                continue
            if isinstance(result, AskError) and self._cluster:
                await self._refresh_slots()
                continue
            if isinstance(result, Exception):
                raise result
            if isinstance(acked, Exception):
                raise acked
            if int(acked) < op.replicas:
                await self._refresh_primary()
                raise not_replicated(op, int(acked), timeout)
            return result
        raise ConnectionFailed(f"{op.context}: Redis at {self.url} kept redirecting the call", unsent=True)

    async def _refresh_slots(self) -> None:
        """Re-reads the cluster's slot map (after a failover, a lost node, a redirect; what
        sharded groups knew of their shards is forgotten too); a no-op elsewhere."""
        if self._cluster:
            self.core.epoch += 1
            with contextlib.suppress(Exception):
                await self.redis.nodes_manager.initialize()

    async def _refresh_primary(self) -> None:
        """As :meth:`felix_redis.Client._refresh_primary`."""
        if self._cluster:
            await self._refresh_slots()
        elif hasattr(self.redis.connection_pool, "get_master_address"):
            with contextlib.suppress(Exception):
                await self.redis.connection_pool.get_master_address()

    async def load_library(self) -> str:
        """As :meth:`felix_redis.Client.load_library`."""
        lib = self._runner.library
        try:
            await self.redis.function_load(lib.code, replace=True)
        except (ResponseError, RedisConnectionError, RedisTimeoutError) as exc:
            raise translate(exc, Cmd("FUNCTION", "LOAD", context=f"loading library {lib.name}"), self.url) from None
        return lib.name

    async def prune_libraries(self) -> list[str]:
        """As :meth:`felix_redis.Client.prune_libraries`."""
        nodes = self.redis.get_primaries() if self._cluster else [None]
        steps = scripts.prune_steps(self._runner.library.name, [{"target_nodes": n} if n else {} for n in nodes])
        reply = None
        try:
            while True:
                command, target = steps.send(reply)
                reply = await self.redis.execute_command(*command, **target)
        except StopIteration as done:
            return list(done.value)
        except (ResponseError, RedisConnectionError, RedisTimeoutError) as exc:
            op = Cmd("FUNCTION", "DELETE", context="pruning old function libraries")
            raise translate(exc, op, self.url) from None

    async def close(self) -> None:
        await self._release_fetched()
        if self._releases:  # cut off from their callers: they end before the connections close
            await asyncio.wait(list(self._releases), timeout=5.0)
        await self._flush_acks()
        if self._watch is not None:
            await self._watch.close()
        if self._lane is not None:
            await self._lane.close()
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- streams

    async def stream_create(
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
        return await self._drive(self.core.stream_create(
            tenant, namespace, stream, kind, shards, replication, consistency,
            retention_max_len, retention_max_age, max_payload, retention_mode, force,
        ))

    async def stream_describe(self, tenant: str, namespace: str, stream: str) -> StreamInfo:
        info = await self._drive(self.core.stream_describe(tenant, namespace, stream))
        return with_nodes(info, self.redis) if self._cluster else info

    async def stream_overview(
        self, tenant: str, namespace: str, stream: str
    ) -> tuple[StreamInfo, dict[str, GroupInfo | FelixError]]:
        """``stream_describe`` and every group's ``group_describe`` at once, in two round
        trips whatever the shard and group counts (one pipeline after shard 0's info; on
        Redis Cluster one pipeline per node). A group whose describe failed maps to its
        error, the others still show (the dashboard's overview)."""
        info, groups = await self._drive(self.core.stream_overview(tenant, namespace, stream))
        return (with_nodes(info, self.redis) if self._cluster else info), groups

    async def has_role(
        self, tenant: str, namespace: str, stream: str, role: str, group: str | None = None
    ) -> bool:
        """Whether this Redis user holds ``role`` (``group.consume``, ``group.manage``: name
        the group; ``stream.publish``, ``stream.admin``) on the stream: what the scripts
        check before they act (docs/security.md). True on a Redis without ACL."""
        return await self._drive(self.core.has_role(tenant, namespace, stream, role, group))

    async def stream_list(
        self, tenant: str | None = None, namespace: str | None = None
    ) -> list[tuple[str, str, str]]:
        return await self._drive(self.core.stream_list(tenant, namespace))

    async def stream_trim(self, tenant: str, namespace: str, stream: str) -> int:
        """Applies the stream's retention now (publishes also do, as the log grows);
        returns how many records were trimmed."""
        return await self._drive(self.core.stream_trim(tenant, namespace, stream))

    async def stream_delete(self, tenant: str, namespace: str, stream: str) -> None:
        await self._drive(self.core.stream_delete(tenant, namespace, stream))

    # -- publishing

    async def publish(
        self, tenant: str, namespace: str, stream: str, payload: bytes | str,
        shard: int | None = None, key: str | bytes | None = None, *,
        delay: float | None = None, deliver_at: datetime | None = None, expires_in: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Published:
        if type(payload) is not bytes:
            payload = as_bytes(payload)
        extras = publish_extras(delay, deliver_at, expires_in, headers)
        return await self._publish_single(tenant, namespace, stream, payload, shard, key, extras, None)

    async def _publish_single(
        self, tenant: str, namespace: str, stream: str, payload: bytes, shard: int | None, key: object,
        extras: Extras | None, producer: ProducerState | None,
    ) -> Published:
        """As the sync client's: the script call straight away when the caches allow."""
        core = self.core
        send = None if extras is not None else core.quick_single(
            tenant, namespace, stream, payload, shard, key, producer)
        if send is None:
            if producer is None:
                return await self._drive(core.publish_single(tenant, namespace, stream, payload, shard, key, extras))
            return await self._drive(core.publish_one(
                tenant, namespace, stream, payload, shard, key, producer, extras))
        try:
            reply = await self._execute(send[1])
        except BaseException as exc:
            return await self._drive(core.single_failed(send, exc, tenant, namespace, stream, payload, shard, key))
        return core.single_sent(send, reply)

    async def publish_keyed(
        self, tenant: str, namespace: str, stream: str, key: str | bytes, payload: bytes | str, *,
        delay: float | None = None, deliver_at: datetime | None = None, expires_in: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Published:
        return (await self.publish_batch(
            tenant, namespace, stream, [payload], key=check_record_key(key), delay=delay, deliver_at=deliver_at,
            expires_in=expires_in, headers=headers))[0]

    async def publish_batch(
        self, tenant: str, namespace: str, stream: str, payloads: Sequence[bytes | str],
        shard: int | None = None, key: str | bytes | None = None, *,
        delay: float | None = None, deliver_at: datetime | None = None, expires_in: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> list[Published]:
        raw = [as_bytes(p) for p in check_list(payloads, "payloads")]
        extras = publish_extras(delay, deliver_at, expires_in, headers)
        s, first, count = await self._drive(
            self.core.publish_plain(tenant, namespace, stream, raw, shard, key, extras))
        return [Published(s, first + i) for i in range(count)]

    async def idempotent_producer(self) -> AsyncIdempotentProducer:
        state = ProducerState()
        state.producer_id = new_producer_secret()
        return AsyncIdempotentProducer(self, state)

    # -- groups

    async def group_create(
        self, tenant: str, namespace: str, stream: str, group: str, start: str | int = "earliest",
        visibility_timeout_ms: int | None = None, max_attempts: int | None = None, *,
        rate_limit: tuple[int, float] | None = None,
    ) -> None:
        await self._drive(self.core.group_create(
            tenant, namespace, stream, group, start, visibility_timeout_ms, max_attempts, rate_limit))

    async def group_configure(
        self, tenant: str, namespace: str, stream: str, group: str,
        visibility_timeout_ms: int | None = None, max_attempts: int | None = None, *,
        rate_limit: tuple[int, float] | None = KEEP,
    ) -> None:
        await self._drive(self.core.group_configure(
            tenant, namespace, stream, group, visibility_timeout_ms, max_attempts, rate_limit))

    async def group_list(self, tenant: str, namespace: str, stream: str) -> list[str]:
        return await self._drive(self.core.group_list(tenant, namespace, stream))

    async def group_delete(self, tenant: str, namespace: str, stream: str, group: str) -> None:
        await self._drive(self.core.group_delete(tenant, namespace, stream, group))

    async def group_poll(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        max_records: int = 16, wait: float | None = None,
        *, ack: Iterable[int | Record | Item | str] | None = None,
    ) -> list[Record]:
        return await self._drive(self.core.group_poll(
            tenant, namespace, stream, shard, group, max_records, wait, ack=ack))

    async def group_poll_as(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str, consumer: str,
        reclaim: bool = True, max_records: int = 16, wait: float | None = None,
        *, ack: Iterable[int | Record | Item | str] | None = None,
    ) -> list[Record]:
        return await self._drive(self.core.group_poll(
            tenant, namespace, stream, shard, group, max_records, wait, consumer, reclaim, ack))

    async def group_ack(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        offset: int | Record | Item | str,
    ) -> bool:
        return (await self._drive(self.core.group_ack(tenant, namespace, stream, shard, group, [offset])))[0]

    async def group_ack_many(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        offsets: Iterable[int | Record | Item | str],
    ) -> list[bool]:
        """As :meth:`felix_redis.Client.group_ack_many`: each offset settled on its own."""
        return await self._drive(self.core.group_ack(tenant, namespace, stream, shard, group, offsets))

    async def group_nack(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        record: Record | Item | str, delay: float = 0.0,
    ) -> bool:
        return await self._drive(self.core.group_nack(tenant, namespace, stream, shard, group, record, delay))

    async def group_extend(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        record: Record | Item | str, by: float | None = None,
    ) -> int:
        return await self._drive(self.core.group_extend(tenant, namespace, stream, shard, group, record, by))

    async def group_dead_letter(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        record: Record | Item | str, reason: str = "",
    ) -> None:
        await self._drive(self.core.group_dead_letter(tenant, namespace, stream, shard, group, record, reason))

    async def group_consumers(self, tenant: str, namespace: str, stream: str, group: str) -> dict[str, list[str]]:
        """Named consumers (``group_poll_as``) and the claims (``SHARD:OFFSET``) of the
        leases each holds now."""
        return await self._drive(self.core.group_consumers(tenant, namespace, stream, group))

    async def group_dead_letters(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str
    ) -> list[DeadLetter]:
        return await self._drive(self.core.group_dead_letters(tenant, namespace, stream, shard, group))

    async def group_dead_letters_all(self, tenant: str, namespace: str, stream: str, group: str) -> list[DeadLetter]:
        """Every shard's dead letters (by shard and offset) in one round trip."""
        return await self._drive(self.core.group_dead_letters_all(tenant, namespace, stream, group))

    async def group_redrive(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        offsets: Iterable[int | str] | None = None,
    ) -> int:
        return await self._drive(self.core.group_redrive(tenant, namespace, stream, shard, group, offsets))

    async def group_discard(
        self, tenant: str, namespace: str, stream: str, shard: int, group: str,
        offsets: Iterable[int | str] | None = None,
    ) -> int:
        return await self._drive(self.core.group_discard(tenant, namespace, stream, shard, group, offsets))

    async def group_describe(self, tenant: str, namespace: str, stream: str, group: str) -> GroupInfo:
        await self._flush_acks()  # as the sync client's: queued acks count as settled
        return await self._drive(self.core.group_describe(tenant, namespace, stream, group))

    def group_sharded(
        self, tenant: str, namespace: str, stream: str | Sequence[str], group: str, consumer: str | None = None,
        reclaim: bool = True, shards: Iterable[int] | None = None, weights: Sequence[int] | None = None,
        prefetch: int = 0,
    ) -> AsyncShardedGroup:
        return AsyncShardedGroup(self, tenant, namespace, stream, group, consumer, reclaim, shards, weights,
                                 prefetch)

    async def group_keys(
        self, tenant: str, namespace: str, stream: str, group: str, shard: int | None = None
    ) -> dict[int, dict[str, str]]:
        return await self._drive(self.core.group_keys(tenant, namespace, stream, group, shard))

    # -- reading

    async def read(
        self, tenant: str, namespace: str, stream: str, shard: int, start: int, count: int = 100
    ) -> list[Record]:
        return (await self._drive(self.core.read(tenant, namespace, stream, shard, start, count)))[0]

    async def read_at(
        self, tenant: str, namespace: str, stream: str, where: Sequence[tuple[int, int]]
    ) -> list[Record | None]:
        """The records at the given (shard, offset)s in one round trip; None where
        retention trimmed the record (e.g. the payloads of dead letters)."""
        return await self._drive(self.core.read_at(tenant, namespace, stream, where))

    async def subscribe(
        self, tenant: str, namespace: str, stream: str,
        start: str | int | dict[int, int] = "earliest", shards: Iterable[int] | None = None,
        *, batch: int = 100, block: float = 5.0,
    ) -> AsyncSubscription:
        positions = await self._drive(self.core.subscribe_start(tenant, namespace, stream, start, shards))
        return AsyncSubscription(self, (tenant, namespace, stream), positions, batch, block)

    # -- recurring schedules (felix_redis.schedules, docs/schedules.md)

    async def schedule_set(
        self, tenant: str, namespace: str, stream: str, name: str, payload: bytes | str, *,
        cron: str | None = None, every: float | None = None, timezone: str = "UTC",
        key: str | bytes | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        await self._drive(schedules.set_plan(self.core, tenant, namespace, stream, name, payload, cron=cron,
                                             every=every, timezone=timezone, key=key, headers=headers))

    async def schedule_list(self, tenant: str, namespace: str, stream: str) -> list[schedules.Schedule]:
        return await self._drive(schedules.list_plan(self.core, tenant, namespace, stream))

    async def schedule_delete(self, tenant: str, namespace: str, stream: str, name: str) -> None:
        await self._drive(schedules.delete_plan(self.core, tenant, namespace, stream, name))

    async def schedule_tick(self, tenant: str, namespace: str, stream: str) -> schedules.Ticked:
        return await self._drive(schedules.tick_plan(self.core, tenant, namespace, stream))


class AsyncSubscription:
    """An async iterator over a stream's records; ``positions`` says where it stands."""

    def __init__(
        self, client: AsyncClient, where: tuple[str, str, str], positions: dict[int, int],
        batch: int, block: float,
    ) -> None:
        self._client = client
        self._where = where
        self.positions = positions
        self._batch = batch
        self._block_ms = max(1, int(block * 1000))
        self._closed = False

    async def poll(self, block: float | None = None) -> list[Record]:
        block_ms = self._block_ms if block is None else int(block * 1000)
        return await self._client._drive(self._client.core.subscribe_step(
            *self._where, self.positions, self._batch, block_ms))

    async def __aiter__(self) -> AsyncIterator[Record]:
        while not self._closed:
            for record in await self.poll():
                yield record

    def close(self) -> None:
        self._closed = True


class AsyncIdempotentProducer:
    """The asyncio twin of :class:`felix_redis.IdempotentProducer`."""

    def __init__(self, client: AsyncClient, state: ProducerState) -> None:
        self._client = client
        self._state = state
        self._lock = asyncio.Lock()

    @property
    def id(self) -> str | None:
        """The producer's public id (:func:`felix_redis.keys.producer_public_id`; its
        state on a shard is meta's field ``producer:ID``); None after an unknown outcome
        made it start over, until its next publish. The secret itself is never shown."""
        secret = self._state.producer_id
        return None if secret is None else producer_public_id(secret)

    async def publish_batch(
        self, tenant: str, namespace: str, stream: str, payloads: Sequence[bytes | str],
        shard: int | None = None, key: str | bytes | None = None, *,
        delay: float | None = None, deliver_at: datetime | None = None, expires_in: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> list[Published]:
        raw = [as_bytes(p) for p in check_list(payloads, "payloads")]
        extras = publish_extras(delay, deliver_at, expires_in, headers)
        async with self._lock:
            s, first, count = await self._client._drive(self._client.core.publish(
                tenant, namespace, stream, raw, shard, key, self._state, extras))
        return [Published(s, first + i) for i in range(count)]

    async def publish(
        self, tenant: str, namespace: str, stream: str, payload: bytes | str,
        shard: int | None = None, key: str | bytes | None = None, *,
        delay: float | None = None, deliver_at: datetime | None = None, expires_in: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Published:
        if type(payload) is not bytes:
            payload = as_bytes(payload)
        extras = publish_extras(delay, deliver_at, expires_in, headers)
        async with self._lock:
            return await self._client._publish_single(
                tenant, namespace, stream, payload, shard, key, extras, self._state)

    async def publish_keyed(
        self, tenant: str, namespace: str, stream: str, key: str | bytes, payload: bytes | str, *,
        delay: float | None = None, deliver_at: datetime | None = None, expires_in: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Published:
        return await self.publish(tenant, namespace, stream, payload, key=check_record_key(key), delay=delay,
                                  deliver_at=deliver_at, expires_in=expires_in, headers=headers)


class AsyncShardedGroup(ShardedGroupBase, _AwaitsToItself):
    """The asyncio twin of :class:`felix_redis.ShardedGroup`. ``client.group_sharded(...)``
    returns it at once; ``await client.group_sharded(...)`` works too (it resolves to the
    group itself), like every other call of the asyncio client."""

    def __init__(
        self, client: AsyncClient, tenant: str, namespace: str, stream: str | Sequence[str], group: str,
        consumer: str | None = None, reclaim: bool = True, shards: Iterable[int] | None = None,
        weights: Sequence[int] | None = None, prefetch: int = 0,
    ) -> None:
        super().__init__(client.core, tenant, namespace, stream, group, consumer, reclaim, shards, weights,
                         prefetch)
        self._client = client

    async def poll(
        self, max_records: int = 16, wait: float | None = None, *, ack: Iterable[Ref] | None = None
    ) -> list[Item]:
        if not self.prefetch:
            return await self._poll_now(max_records, wait, ack)
        self._check_poll(max_records, wait)
        if self._buffer:
            for ref in self._checked_refs(ack):
                await self.ack(ref, wait=False)
            if taken := self._from_buffer(max_records):
                return taken
            ack = None  # another poll took the last of them (or a forked child's): fetch, the acks queued
        sent = time.monotonic()
        items = self._fetched(await self._poll_now(max(max_records, self.prefetch), wait, ack), max_records, sent)
        if self._buffer:
            self._client._hold(self)
        return items

    async def _poll_now(self, max_records: int, wait: float | None, ack: Iterable[Ref] | None) -> list[Item]:
        queued, acks = self._with_queued(ack)
        try:
            return await self._client._drive(self._poll_plan(max_records, wait, acks))
        except BaseException:
            if queued:
                self._requeue(queued)
                with contextlib.suppress(RuntimeError):  # (no running loop: at close)
                    self._client._defer_acks(self)
            raise

    async def ack(self, item: Ref, wait: bool = True) -> bool | None:
        """As :meth:`felix_redis.ShardedGroup.ack` (with ``wait=False``, no sending at
        interpreter exit: close the group or the client)."""
        if wait:
            return await self._client.group_ack(*self._where(item), item)
        if self._queue_ack(item):
            self._client._defer_acks(self)
        elif len(self._queued) >= QUEUED_ACKS_MAX:
            await self._flush_in_background()
        return None

    async def flush(self) -> int:
        refs = self._take_queued()
        if not refs:
            return 0
        try:
            acked = await self._client._drive(self._ack_plan(refs))
        except (ConnectionFailed, NotReplicated):
            self._requeue(refs)
            self._client._defer_acks(self, after=0.2)
            raise
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._requeue(refs)  # cancelled: they may not have gone (acks are idempotent)
            raise
        self._flush_failures = 0
        return acked

    async def _flush_in_background(self, again: bool = True) -> None:
        try:
            await self.flush()
        except FelixError as exc:
            if self._flush_failed(exc, again):
                self._client._defer_acks(self, after=0.2)

    async def close(self) -> None:
        """As :meth:`felix_redis.ShardedGroup.close`: the records fetched ahead are
        released (due at once, not counted), then the queued acks sent."""
        await self._release_buffer()
        await self.flush()

    async def _release_buffer(self) -> None:
        """Releases the records fetched ahead (to its end even if the caller is
        cancelled meanwhile: :func:`_to_its_end`)."""
        if held := self._take_buffer():
            await _to_its_end(self._client, self._client._drive(self._release_plan(held)), self.group)

    async def _release(self, items: list[Item]) -> None:
        """Releases ``items``, taken from what was fetched ahead and never handed out
        (to its end even if the caller is cancelled meanwhile)."""
        await _to_its_end(self._client, self._client._drive(self._release_plan(items)), self.group)

    async def __aenter__(self) -> AsyncShardedGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def ack_many(self, items: Iterable[Ref]) -> int:
        return await self._client._drive(self._ack_plan(items))

    async def nack(self, item: Ref, delay: float = 0.0) -> bool:
        return await self._client.group_nack(*self._where(item), item, delay)

    async def nack_after(self, item: Ref, seconds: float) -> bool:
        return await self.nack(item, seconds)

    async def extend(self, item: Ref, by: float | None = None) -> int:
        return await self._client.group_extend(*self._where(item), item, by)

    async def dead_letter(self, item: Ref, reason: str = "") -> None:
        await self._client.group_dead_letter(*self._where(item), item, reason)


#: The contract's name: ``felix_redis.asyncio`` has the same names as ``felix_redis``.
Client = AsyncClient


def connect(url: str | None = None, *, prefix: str = "felix", **kwargs: Any) -> AsyncClient:
    """An AsyncClient for ``url`` (None: ``$FELIX_REDIS_URL``, else redis://localhost:6379/0).
    Connecting happens lazily, on the first call; ``await connect(url)`` gives the same
    client."""
    url = resolve_url(url)
    kwargs.setdefault("retry_for", default_retry_for(url))
    return AsyncClient(async_client(url), prefix=prefix, url=url, **kwargs)
