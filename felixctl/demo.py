"""``felixctl demo``: the checkout story, end to end, in a few seconds.

Orders come in; each becomes six follow-up jobs on a sharded queue. A pool of worker
threads shares them through one group. Some jobs fail once and succeed on retry, one
worker stalls and its lease lapses, a declined card is dead-lettered on purpose, and a
bug makes one job fail until it becomes a dead letter. The demo then fixes the bug,
redrives that job, discards the declined card and shows that nothing is owed.
"""

from __future__ import annotations

import json
import random
import secrets
import socket
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import click

import felix_redis
from felix_redis import FelixError, GroupInfo, Item, ShardedGroup, StaleClaim
from felix_redis.errors import redact_url
from felix_redis.keys import registry_key, tenants_key
from felix_redis.scripts import library, other_libraries
from felix_redis.testing.server import RedisServer, redis_server_binary
from felixctl.common import Ctl, OperationError, examples, pass_ctl, table
from felixctl.groups import describe_text

LOCAL_URL = "redis://localhost:6379/0"

#: The six things a checkout does after answering the customer, and what "done" says.
TASKS: dict[str, str] = {
    "charge-card": "charged the card",
    "reserve-stock": "reserved the stock",
    "send-receipt": "sent the receipt",
    "notify-warehouse": "told the warehouse",
    "update-search-index": "updated the search index",
    "post-to-accounting": "posted to accounting",
}

#: What a transient failure of each task looks like.
GLITCHES: dict[str, str] = {
    "charge-card": "payment gateway answered 503",
    "reserve-stock": "inventory service timed out",
    "send-receipt": "mail relay refused the connection",
    "notify-warehouse": "warehouse API timed out",
    "update-search-index": "search cluster is rebalancing",
    "post-to-accounting": "accounting API rate limit",
}

POISON_ERROR = "KeyError: 'currency' (accounting mapping has no entry for CHF)"
DECLINED = "card declined by the issuer: do not retry"

STREAM, GROUP, NAMESPACE = "orders", "workers", "checkout"
VISIBILITY_TIMEOUT_MS = 600
MAX_ATTEMPTS = 3
RETRY_DELAY_S = 0.1


# -- where the demo runs


@dataclass
class Backend:
    """The Redis the demo uses, how it was chosen, and what to stop afterwards."""

    url: str
    description: str
    server: RedisServer | None = None
    shared: bool = False

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


def answers(url: str) -> bool:
    """True if a Redis answers at ``url`` (a TCP check first, so a closed port costs nothing)."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "localhost", parts.port or 6379), timeout=0.5):
            pass
    except OSError:
        return False
    try:
        client = felix_redis.connect(f"{url}?socket_connect_timeout=0.5&socket_timeout=2")
    except FelixError:
        return False
    try:
        client.stream_list()
    except felix_redis.ConnectionFailed:
        return False
    except FelixError:
        return True
    finally:
        client.close()
    return True


def choose_backend(url: str | None, local_url: str = LOCAL_URL) -> Backend:
    """The given URL; else a Redis on localhost if one answers; else a throwaway
    redis-server; else the in-process memory:// backend."""
    if url and url.startswith("memory://"):
        return Backend(url, f"the in-process {url} backend (--redis-url / $FELIX_REDIS_URL)")
    if url:
        return Backend(url, f"the Redis at {redact_url(url)} (--redis-url / $FELIX_REDIS_URL)", shared=True)
    if answers(local_url):
        return Backend(local_url, f"the Redis that answered at {local_url}", shared=True)
    if redis_server_binary():
        server = RedisServer().start()
        return Backend(
            server.url, f"a throwaway redis-server at {server.url} (in {server.dir}; stopped at the end)", server
        )
    name = f"memory://demo-{secrets.token_hex(3)}"
    return Backend(name, f"the in-process {name} backend (no Redis answered and no redis-server binary found)")


# -- the story


@dataclass
class Mishaps:
    """Which jobs misbehave, chosen from the seed so a run can be repeated."""

    poison: tuple[int, str]
    declined: tuple[int, str]
    stall: tuple[int, str]
    glitches: set[tuple[int, str]]

    @classmethod
    def make(cls, orders: list[int], seed: int) -> Mishaps:
        rng = random.Random(seed)
        poison = (rng.choice(orders), "post-to-accounting")
        declined = (rng.choice(orders), "charge-card")
        jobs = [(o, t) for o in orders for t in TASKS if (o, t) not in (poison, declined)]
        stall = rng.choice([j for j in jobs if j[1] in ("reserve-stock", "update-search-index")])
        rest = [j for j in jobs if j != stall]
        glitches = set(rng.sample(rest, max(1, len(rest) // 5)))
        return cls(poison, declined, stall, glitches)


@dataclass
class Stats:
    done: int = 0
    retries: int = 0
    nacks: int = 0
    lapses: int = 0


@dataclass
class Demo:
    """One run: the client, the mishaps, the worker pool and the live account."""

    client: felix_redis.Client
    tenant: str
    orders: list[int]
    workers: int
    mishaps: Mishaps
    started: float = field(default_factory=time.monotonic)
    bug_fixed: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stats: Stats = field(default_factory=Stats)
    errors: list[BaseException] = field(default_factory=list)

    @property
    def where(self) -> tuple[str, str, str]:
        return self.tenant, NAMESPACE, STREAM

    def say(self, text: str = "") -> None:
        with self.lock:
            click.echo(text)

    def event(self, worker: str, item: Item, text: str) -> None:
        order, task = job_of(item)
        stamp = f"+{time.monotonic() - self.started:5.2f}s"
        self.say(f"{stamp}  {worker}  {item.claim:<7} order {order} {task:<20} attempt {item.attempts}  {text}")

    # -- setup

    def create(self) -> None:
        self.client.stream_create(*self.where, kind="queue", shards=2)
        self.client.group_create(
            *self.where, GROUP, start="earliest", visibility_timeout_ms=VISIBILITY_TIMEOUT_MS,
            max_attempts=MAX_ATTEMPTS,
        )
        self.say(f"Created stream {'/'.join(self.where)} (a queue, 2 shards) and group {GROUP!r}: "
                 f"visibility timeout {VISIBILITY_TIMEOUT_MS} ms, at most {MAX_ATTEMPTS} attempts.")

    def publish(self) -> None:
        self.say(f"\nCheckout accepts {len(self.orders)} orders; each one's {len(TASKS)} follow-up jobs are "
                 "published as one atomic batch, keyed by order so they share a shard:")
        for order in self.orders:
            payloads = [json.dumps({"order": order, "task": task}) for task in TASKS]
            published = self.client.publish_batch(*self.where, payloads, key=f"order-{order}")
            self.say(f"  order {order} -> shard {published[0].shard}, offsets "
                     f"{published[0].offset}..{published[-1].offset}")

    # -- workers

    def work(self, name: str) -> None:
        group = self.client.group_sharded(*self.where[:3], GROUP)
        try:
            while not self.stop.is_set():
                for item in group.poll(2, wait=0.05):
                    self.handle(name, group, item)
        except BaseException as exc:  # reported by the main thread
            self.errors.append(exc)
            self.stop.set()

    def handle(self, worker: str, group: ShardedGroup, item: Item) -> None:
        job = job_of(item)
        time.sleep(0.005 + zlib.crc32(item.payload) % 20 / 1000)
        try:
            if job == self.mishaps.poison and not self.bug_fixed.is_set():
                self.nack(worker, group, item, f"FAILED: {POISON_ERROR}")
            elif job == self.mishaps.declined:
                group.dead_letter(item, reason=DECLINED)
                self.event(worker, item, "card declined -> dead-lettered at once (retrying cannot help)")
            elif job == self.mishaps.stall and item.attempts == 1:
                with self.lock:
                    self.stats.lapses += 1
                self.event(worker, item, f"worker stalls and never settles it; the lease lapses after "
                                         f"{VISIBILITY_TIMEOUT_MS} ms")
            elif job in self.mishaps.glitches and item.attempts == 1:
                self.nack(worker, group, item, f"failed: {GLITCHES[job[1]]} -> nack, retry in "
                                               f"{int(RETRY_DELAY_S * 1000)} ms")
            else:
                group.ack(item)
                with self.lock:
                    self.stats.done += 1
                    self.stats.retries += item.attempts > 1
                note = ""
                if job == self.mishaps.poison:
                    note = " (after the redrive, with the fix)"
                elif item.attempts > 1:
                    note = " (a retry: attempts > 1)"
                self.event(worker, item, f"ok, {TASKS[job[1]]}{note}")
        except StaleClaim:
            self.event(worker, item, "lease had lapsed before it was settled; it will be redelivered")

    def nack(self, worker: str, group: ShardedGroup, item: Item, text: str) -> None:
        with self.lock:
            self.stats.nacks += 1
        if group.nack_after(item, RETRY_DELAY_S):
            self.event(worker, item, f"{text.split(' -> ')[0]} -> now a dead letter: {MAX_ATTEMPTS} attempts "
                                     "used up, the group moves past it")
        else:
            self.event(worker, item, text if " -> " in text else f"{text} -> nack, retry in "
                       f"{int(RETRY_DELAY_S * 1000)} ms")

    # -- waiting

    def wait_for(self, what: str, settled: Callable[[GroupInfo], bool], timeout_s: float = 20.0) -> GroupInfo:
        """Polls group_describe until ``settled`` (or a worker failed, or time ran out)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.errors:
                raise self.errors[0]
            info = self.client.group_describe(*self.where, GROUP)
            if settled(info):
                return info
            if time.monotonic() > deadline:
                raise OperationError(f"the demo did not reach '{what}' within {timeout_s:.0f} s")
            time.sleep(0.03)

    # -- the run

    def run(self) -> None:
        self.create()
        self.publish()
        self.say(f"\nStarting {self.workers} workers; they share the group, each job goes to one of them:")
        threads = [threading.Thread(target=self.work, args=(f"w{i + 1}",), daemon=True)
                   for i in range(self.workers)]
        for thread in threads:
            thread.start()
        try:
            self.wait_for("every job settled", lambda i: i.lag == 0 and i.dead >= 2)
            self.dead_letters_and_redrive()
            info = self.wait_for("nothing owed", lambda i: i.lag == 0 and i.dead == 0 and i.in_flight == 0)
        finally:
            self.stop.set()
            for thread in threads:
                thread.join(timeout=5)
        self.finish(info)

    def dead_letters_and_redrive(self) -> None:
        letters = []
        for shard in range(2):
            letters += self.client.group_dead_letters(*self.where, shard, GROUP)
        self.say("\nEvery job is settled; the group moved past the failures. Dead letters "
                 "(pointers to records still in the log):")
        rows = [(d.claim, d.attempts, d.reason) for d in letters]
        self.say("  " + table(["RECORD", "ATTEMPTS", "REASON"], rows).replace("\n", "\n  "))
        poison = self.find(letters, self.mishaps.poison)
        declined = self.find(letters, self.mishaps.declined)
        self.say(f"\nFixing the bug (adding CHF to the accounting mapping) and redriving {poison}: "
                 "it is owed again, attempts start over.")
        self.bug_fixed.set()
        self.client.group_redrive(*self.where, int(poison.split(":")[0]), GROUP, [int(poison.split(":")[1])])
        self.say(f"Discarding {declined}: nobody retries a declined card; the customer is asked for another.")
        self.client.group_discard(*self.where, int(declined.split(":")[0]), GROUP, [int(declined.split(":")[1])])

    def find(self, letters: list[Any], job: tuple[int, str]) -> str:
        """The SHARD:OFFSET of the dead letter for ``job`` (read back from the log)."""
        for d in letters:
            record = self.client.read(*self.where, d.shard, d.offset, 1)[0]
            if job_of_payload(record.payload) == job:
                return str(d.claim)
        raise OperationError(f"no dead letter found for order {job[0]} {job[1]}")

    def finish(self, info: GroupInfo) -> None:
        s = self.stats
        self.say("\nFinal state, as `felixctl group describe` shows it:")
        self.say(describe_text(info))
        total = len(self.orders) * len(TASKS)
        self.say(
            f"\n{s.done} of {total} jobs done ({s.retries} on a retry after {s.nacks} nacks and {s.lapses} "
            f"lapsed lease); 1 dead letter redriven and done, 1 discarded. Nothing owed, nothing in flight."
        )


def felix_libraries(client: felix_redis.Client) -> list[str] | None:
    """The felix-redis function libraries on the server (``felix_<digest>``), or None when
    it cannot tell (no Functions, or a user who may not list them)."""
    try:
        return other_libraries(client.redis.function_list(library="felix_*"), current="")
    except Exception:
        return None


def remove_own_library(client: felix_redis.Client, before: list[str] | None, keep: bool) -> str | None:
    """What to say about the function library, once the demo is done: removed when the
    server had no felix-redis library before the demo (and the stream is not kept), so a
    server found empty is left empty; else left as it is."""
    name = library().name
    if before is None or before or name not in (felix_libraries(client) or []):
        return None
    if keep:
        return (f"Kept the function library {name} the demo loaded (the server had none before): "
                f"the kept stream needs it. Remove both with: felixctl stream delete ... and "
                f"redis-cli FUNCTION DELETE {name}")
    try:
        client.redis.function_delete(name)
    except Exception as exc:
        return f"Could not remove the function library {name} the demo loaded: {exc}"
    return f"Removed the function library {name} the demo loaded (the server had none before)."


def forget_tenant(client: felix_redis.Client, tenant: str) -> None:
    """Takes the demo's own tenant (random, made for this run) out of the tenants set
    once its last stream is gone: stream_delete leaves the set alone (a tenant admin may
    only add to it), and each demo run would leave one name there for good. Where the
    user may not (an ACL role user), the name stays; nothing else depends on it."""
    prefix = client.core.prefix
    try:
        if not client.redis.exists(registry_key(prefix, tenant)):
            client.redis.srem(tenants_key(prefix), tenant)
    except Exception:
        pass


def job_of_payload(payload: bytes) -> tuple[int, str]:
    data = json.loads(payload)
    return int(data["order"]), str(data["task"])


def job_of(item: Item) -> tuple[int, str]:
    return job_of_payload(item.payload)


@click.command("demo", short_help="Run the checkout story: retries, a dead letter, a redrive.", epilog=examples(
    "felixctl demo",
    "felixctl demo --orders 10 --workers 4 --seed 7",
    "felixctl --redis-url redis://localhost:6379/0 demo --keep",
    note="Uses --redis-url / $FELIX_REDIS_URL if given; else a Redis on localhost:6379 if one answers (in a "
    "fresh tenant demo-XXXXXX, touching no other key); else a throwaway redis-server; else memory://. "
    "The demo stream is deleted at the end unless --keep, and so is the function library the demo "
    "loaded on a server that had no felix-redis library before.",
))
@click.option("--orders", type=click.IntRange(1, 200), default=5, show_default=True, help="Orders to check out.")
@click.option("--workers", type=click.IntRange(1, 16), default=3, show_default=True, help="Worker threads.")
@click.option("--seed", type=int, default=1, show_default=True, help="Chooses which jobs fail, and how.")
@click.option("--keep", is_flag=True, help="Keep the demo stream (on a Redis that outlives the demo).")
@pass_ctl
def demo(ctl: Ctl, orders: int, workers: int, seed: int, keep: bool) -> None:
    """Run the checkout story: a work queue with retries, a dead letter and a redrive."""
    backend = choose_backend(ctl.url)
    tenant = f"demo-{secrets.token_hex(3)}"
    click.echo("felixctl demo: checkout follow-up jobs on a felix-redis work queue")
    click.echo(f"Using {backend.description}.")
    try:
        client = felix_redis.connect(backend.url)
        libraries_before = felix_libraries(client) if backend.shared else None
        run = Demo(client, tenant, [1001 + i for i in range(orders)], workers, Mishaps.make(
            [1001 + i for i in range(orders)], seed))
        try:
            run.run()
        finally:
            if keep and backend.shared:
                click.echo(f"\nKept it: felixctl --redis-url {redact_url(backend.url)} --tenant {tenant} "
                           f"--namespace {NAMESPACE} group describe {STREAM} {GROUP}")
            else:
                try:
                    client.stream_delete(*run.where)
                    click.echo(f"\nDeleted the demo stream {'/'.join(run.where)}.")
                    forget_tenant(client, tenant)
                except FelixError:
                    pass
            if backend.shared:
                said = remove_own_library(client, libraries_before, keep)
                if said:
                    click.echo(said)
            client.close()
    finally:
        backend.close()
