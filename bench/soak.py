"""Soak and memory run (issue 7): push a million jobs through one group with retention
on, then check that Redis memory comes back to where it started.

    python bench/soak.py --jobs 1000000 --workers 4 --shards 4

Starts a private ``redis-server`` on 127.0.0.1 (or uses ``--redis-url``, which it
FLUSHES), creates a stream with ``retention_max_len`` and a group, and runs producer
and worker processes:

- producers publish batches through idempotent producers, starting a new producer (a
  new id, so new per-shard producer state) every ``--producer-every`` batches, so
  producer bookkeeping must be pruned rather than grow (``FELIX_PRODUCER_IDLE_MS``,
  ``--producer-idle-ms``; the publish of a producer new to a shard prunes the states
  past their idle time);
- workers poll the sharded group (``poll(N)``) and ``ack_many`` what they got; a
  share of the jobs is nacked once (``--fail-rate``) and a few are dead-lettered
  (``--poison-rate``); all dead letters are discarded at the end.

It measures ``INFO memory`` and ``MEMORY USAGE`` of every felix key, by role, after
the stream and group were created (start), during the run (peak) and after the drain,
the discards and the producer-state expiry (end), and prints a JSON summary. The group
state (every group key of every shard) must come back to its start size; the log is
reported separately (its length is bounded by retention, when retention trims).
Every process it starts is stopped in ``finally``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter
from typing import Any

import redis

T, N, S, G = "soak", "bench", "jobs", "workers"
PAYLOAD_PAD = b"x" * 48


def _producer(
    url: str,
    jobs: int,
    batch: int,
    shards: int,
    every: int,
    index: int,
    idle_ms: int,
    fail_rate: float,
    poison_rate: float,
) -> None:
    os.environ["FELIX_PRODUCER_IDLE_MS"] = str(idle_ms)
    import felix_redis

    client = felix_redis.connect(url, retry_for=10)
    producer = client.idempotent_producer()
    sent = batches = 0
    fail_every = int(1 / fail_rate) if fail_rate > 0 else 0
    poison_every = int(1 / poison_rate) if poison_rate > 0 else 0
    while sent < jobs:
        n = min(batch, jobs - sent)
        payloads = []
        for i in range(sent, sent + n):
            kind = (
                b"P"
                if poison_every and i % poison_every == poison_every - 1
                else b"F"
                if fail_every and i % fail_every == fail_every - 1
                else b"O"
            )
            payloads.append(b"%s %d %d %s" % (kind, index, i, PAYLOAD_PAD))
        producer.publish_batch(T, N, S, payloads, shard=(index + batches) % shards)
        sent += n
        batches += 1
        if every and batches % every == 0:
            producer = client.idempotent_producer()
    client.close()


def _worker(url: str, batch: int, stop: Any, counts: Any) -> None:
    import felix_redis

    client = felix_redis.connect(url, retry_for=10)
    group = client.group_sharded(T, N, S, G)
    acked = nacked = dead = 0
    try:
        while not stop.is_set():
            items = group.poll(batch, wait=0.5)
            ok = []
            for item in items:
                kind = item.payload[:1]
                if kind == b"P":
                    group.dead_letter(item, "poison")
                    dead += 1
                elif kind == b"F" and item.attempts == 1:
                    group.nack(item)
                    nacked += 1
                else:
                    ok.append(item)
            if ok:
                acked += group.ack_many(ok)
    finally:
        with counts.get_lock():
            counts[0] += acked
            counts[1] += nacked
            counts[2] += dead
        client.close()


def memory(raw: redis.Redis) -> dict[str, int]:
    info = raw.info("memory")
    keys = (
        "used_memory",
        "used_memory_dataset",
        "used_memory_overhead",
        "used_memory_scripts",
        "used_memory_scripts_eval",
        "mem_clients_normal",
    )
    return {k: int(info[k]) for k in keys if k in info}


def _producer_states(raw: redis.Redis, client: Any, shards: int) -> int:
    """Idempotent producer states (``producer:*`` fields of the meta hashes) of all shards."""
    name = client.core.name(T, N, S)
    return sum(sum(1 for _ in raw.hscan_iter(name.shard_keys(shard)[0], match="producer:*", count=1000))
               for shard in range(shards))


def key_usage(raw: redis.Redis, prefix: str = "felix") -> dict[str, Any]:
    """MEMORY USAGE of every felix key, summed by role (the part after the hash tag)."""
    by_role: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for key in raw.scan_iter(match=f"{prefix}:*", count=1000):
        text = key.decode()
        role = text.rsplit("}:", 1)[1] if "}:" in text else text.split(":", 1)[1]
        if role.startswith("producer:"):
            role = "producer"
        elif role.startswith("g:"):
            parts = role.split(":")
            role = "group" if len(parts) == 2 else f"group:{parts[2]}"
        usage = raw.memory_usage(key, samples=0) or 0
        by_role[role] += usage
        count[role] += 1
    group_bytes = sum(v for k, v in by_role.items() if k == "group" or k.startswith("group:"))
    return {
        "bytes_by_role": dict(sorted(by_role.items())),
        "keys_by_role": dict(sorted(count.items())),
        "group_state_bytes": group_bytes,
        "group_per_record_keys": sum(v for k, v in count.items() if k.startswith("group:") and k != "group:wake"),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import felix_redis
    from felix_redis.testing.server import RedisServer

    server = None
    procs: list[mp.process.BaseProcess] = []
    url = args.redis_url
    try:
        if url is None:
            server = RedisServer().start()
            url = server.url
        raw = redis.Redis.from_url(url)
        raw.flushall()
        client = felix_redis.connect(url)
        empty = memory(raw)
        client.stream_create(T, N, S, shards=args.shards, retention_max_len=args.retention)
        client.group_create(T, N, S, G, visibility_timeout_ms=60_000, max_attempts=3)
        # load every script once so the start figure includes the script cache
        producer = client.idempotent_producer()
        producer.publish(T, N, S, b"O warm-up", shard=0)
        warm = client.group_poll(T, N, S, 0, G, 1)
        client.group_ack(T, N, S, 0, G, warm[0])
        client.group_describe(T, N, S, G)
        client.group_discard(T, N, S, 0, G)
        client.group_dead_letters(T, N, S, 0, G)
        time.sleep(0.2)
        start_mem, start_keys = memory(raw), key_usage(raw)

        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        counts = ctx.Array("q", 3)
        per = [
            args.jobs // args.producers + (1 if i < args.jobs % args.producers else 0) for i in range(args.producers)
        ]
        began = time.monotonic()
        workers = [ctx.Process(target=_worker, args=(url, args.poll, stop, counts)) for _ in range(args.workers)]
        producers = [
            ctx.Process(
                target=_producer,
                args=(
                    url,
                    per[i],
                    args.batch,
                    args.shards,
                    args.producer_every,
                    i,
                    args.producer_idle_ms,
                    args.fail_rate,
                    args.poison_rate,
                ),
            )
            for i in range(args.producers)
        ]
        procs = [*workers, *producers]
        for p in procs:
            p.start()
        peak = dict(start_mem)
        samples = 0
        deadline = began + args.timeout
        while True:
            info = client.group_describe(T, N, S, G)
            mem = memory(raw)
            peak = {k: max(v, mem.get(k, 0)) for k, v in peak.items()}
            samples += 1
            published = sum(s.tail for s in info.shards)
            if (
                all(not p.is_alive() for p in producers)
                and published >= args.jobs + 1
                and all(s.lag == 0 for s in info.shards)
            ):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"soak did not finish within {args.timeout}s: {info}")
            if args.progress:
                print(
                    f"\r{time.monotonic() - began:6.1f}s published={published} "
                    f"finished={sum(s.position for s in info.shards)} used_memory={mem['used_memory']}",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(0.5)
        elapsed = time.monotonic() - began
        if args.progress:
            print(file=sys.stderr)
        bad = [p.exitcode for p in producers if p.exitcode != 0]
        if bad:
            raise SystemExit(f"a producer failed: exit codes {bad}")
        stop.set()
        for p in workers:
            p.join(30)
        dead_before_discard = sum(s.dead for s in info.shards)
        for shard in range(args.shards):
            client.group_discard(T, N, S, shard, G)
        # retention trims as publishing goes on, up to what the group finished by then;
        # once everything is finished, apply it once more (a publisher would, too)
        client.stream_trim(T, N, S)
        final = client.group_describe(T, N, S, G)
        assert all(s.position == s.tail and s.dead == 0 and s.in_flight == 0 and s.owed == 0 for s in final.shards)
        lengths = [int(raw.xlen(k["log"])) for k in client.group_keys(T, N, S, G).values()]
        # producer states are fields of each shard's meta hash, pruned once past their idle
        # time by the publish of a producer new to the shard (lua/publish.lua): wait for
        # the idle time, publish one record to each shard through a new producer, count
        producer_keys = sum(1 for _ in raw.scan_iter(match="felix:*:producer:*", count=1000))
        time.sleep(args.producer_idle_ms / 1000 + 1.5)
        states_before = _producer_states(raw, client, args.shards)
        pruner = client.idempotent_producer()
        for shard in range(args.shards):
            pruner.publish(T, N, S, b"P prune", shard=shard)
        states_after = _producer_states(raw, client, args.shards)
        time.sleep(0.5)
        with contextlib.suppress(redis.ResponseError):
            raw.memory_purge()
        end_mem, end_keys = memory(raw), key_usage(raw)
        trimmed = sum(lengths) < sum(s.tail for s in final.shards)
        manual: dict[str, Any] | None = None
        if args.xtrim_after and not trimmed and args.retention:
            # Retention did not trim: trim the (fully finished) logs by hand to the same
            # length, to see the memory a trimming retention would leave.
            for k in client.group_keys(T, N, S, G).values():
                raw.xtrim(k["log"], maxlen=args.retention, approximate=False)
            with contextlib.suppress(redis.ResponseError):
                raw.memory_purge()
            time.sleep(0.5)
            manual = {"memory": memory(raw), "keys": key_usage(raw)}
            manual["used_memory_delta"] = manual["memory"]["used_memory"] - start_mem["used_memory"]
        summary = {
            "jobs": args.jobs,
            "records": sum(s.tail for s in final.shards),
            "shards": args.shards,
            "workers": args.workers,
            "producers": args.producers,
            "batch": args.batch,
            "poll": args.poll,
            "retention_max_len": args.retention,
            "seconds": round(elapsed, 1),
            "jobs_per_second": round(args.jobs / elapsed),
            "acked": counts[0],
            "nacked": counts[1],
            "dead_lettered": counts[2],
            "dead_letters_discarded": dead_before_discard,
            "position_samples": samples,
            "log_lengths": lengths,
            "retention_trimmed": trimmed,
            "producer_keys_left": producer_keys,
            "producer_states_before_pruning": states_before,
            "producer_states_left": states_after,
            "memory_empty": empty,
            "memory_start": start_mem,
            "memory_peak": peak,
            "memory_end": end_mem,
            "used_memory_delta": end_mem["used_memory"] - start_mem["used_memory"],
            "dataset_delta": end_mem["used_memory_dataset"] - start_mem["used_memory_dataset"],
            "group_state_bytes_start": start_keys["group_state_bytes"],
            "group_state_bytes_end": end_keys["group_state_bytes"],
            "group_per_record_keys_end": end_keys["group_per_record_keys"],
            "keys_start": start_keys,
            "keys_end": end_keys,
            "after_manual_xtrim": manual,
            "redis": raw.info("server")["redis_version"],
        }
        client.close()
        raw.close()
        return summary
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        if server is not None:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=4, help="worker processes")
    ap.add_argument("--producers", type=int, default=2, help="producer processes")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1000, help="payloads per publish")
    ap.add_argument("--poll", type=int, default=1000, help="records per poll")
    ap.add_argument("--retention", type=int, default=10_000, help="retention_max_len (records per shard)")
    ap.add_argument("--producer-every", type=int, default=50, help="a new producer id every N batches")
    ap.add_argument("--producer-idle-ms", type=int, default=5000, help="FELIX_PRODUCER_IDLE_MS of the producers")
    ap.add_argument("--fail-rate", type=float, default=0.001, help="share of jobs nacked once")
    ap.add_argument("--poison-rate", type=float, default=0.0001, help="share of jobs dead-lettered")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--redis-url", default=None, help="use this Redis (FLUSHED) instead of a private one")
    ap.add_argument(
        "--bound",
        type=int,
        default=64 * 1024,
        help="fail (exit 1) if the group state grew by more than this many bytes",
    )
    ap.add_argument(
        "--xtrim-after",
        action="store_true",
        help="if retention did not trim, XTRIM the finished logs to --retention at the end and "
        "measure again (simulates a trimming retention)",
    )
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    summary = run(args)
    print(json.dumps(summary, indent=2))
    grew = summary["group_state_bytes_end"] - summary["group_state_bytes_start"]
    if grew > args.bound or summary["group_per_record_keys_end"]:
        print(
            f"soak: group state grew by {grew} bytes ({summary['group_per_record_keys_end']} per-record keys left)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
