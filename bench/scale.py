"""Scale and server-cost figures of issue 8, on a private redis-server:

- drain rate (one client, poll 64 acking the previous batch) behind a 10,000 and a 1,000,000 backlog;
- Redis memory per waiting job against a raw stream entry with the same payload, and the
  group memory left per finished job;
- Redis CPU per job (INFO commandstats, usec per job) against raw XREADGROUP + XACK;
- the cost of a poll with 100,000 dead letters and 10,000 records in flight elsewhere,
  next to raw XREADGROUP + XACK with 10,000 entries pending elsewhere.

    python bench/scale.py [--backlog 1000000] [--out bench/results/scale.json]

Prints one JSON document. Every figure is measured in this run; nothing is assumed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import felix_redis
from bench.report import emit
from felix_redis.testing.server import RedisServer

T, N = "scale", "bench"
PAYLOAD = b"x" * 64


def publish(client: felix_redis.Client, stream: str, count: int) -> None:
    for start in range(0, count, 5000):
        client.publish_batch(T, N, stream, [PAYLOAD] * min(5000, count - start), shard=0)


def drain_rate(client: felix_redis.Client, stream: str, jobs: int, separate: bool = False) -> float:
    """Jobs/s for polling and acking ``jobs`` records, 64 at a time: each batch's acks
    ride on the next poll (``ack=``), or, ``separate``, go in a ``group_ack_many`` call
    of their own."""
    done = 0
    records: list[felix_redis.Record] = []
    start = time.perf_counter()
    while done < jobs:
        if separate:
            records = client.group_poll(T, N, stream, 0, "g", max_records=min(64, jobs - done))
            client.group_ack_many(T, N, stream, 0, "g", records)
        else:
            records = client.group_poll(T, N, stream, 0, "g", max_records=min(64, jobs - done), ack=records)
        done += len(records)
    if records and not separate:
        client.group_ack_many(T, N, stream, 0, "g", records)
    return jobs / (time.perf_counter() - start)


def script_usec(raw: redis.Redis) -> float:
    """Server time (usec) in felix-redis scripts: functions (FCALL) or EVALSHA."""
    stats = raw.info("commandstats")
    return float(sum(stats.get(f"cmdstat_{cmd}", {}).get("usec", 0) for cmd in ("fcall", "evalsha")))


def measure(backlog: int) -> dict[str, Any]:
    out: dict[str, Any] = {"redis": None}
    with RedisServer() as server:
        raw = redis.Redis.from_url(server.url)
        out["redis"] = raw.info("server")["redis_version"]
        client = felix_redis.connect(server.url)
        measure_jobs = 20_000

        # drain rate behind a small and a large backlog: both streams exist at once and
        # are drained in alternating chunks, so load on the shared machine falls on both
        rounds, chunk = 5, measure_jobs // 5
        sizes = {"backlog_10k": 10_000 + measure_jobs + 2_000, "backlog_large": backlog + measure_jobs + 2_000}
        for name, size in sizes.items():
            client.stream_create(T, N, name)
            client.group_create(T, N, name, "g")
            publish(client, name, size)
            drain_rate(client, name, 2_000)  # warm up
        spent = dict.fromkeys(sizes, 0.0)
        for _ in range(rounds):
            for name in sizes:
                spent[name] += chunk / drain_rate(client, name, chunk)
        rates = {name: round(rounds * chunk / spent[name]) for name in sizes}
        for name in sizes:
            client.stream_delete(T, N, name)
        out["drain_rate_10k_backlog"] = rates["backlog_10k"]
        out["drain_rate_large_backlog"] = rates["backlog_large"]
        out["large_backlog"] = backlog
        out["large_over_small"] = round(rates["backlog_large"] / rates["backlog_10k"], 3)

        # memory per waiting job: felix log vs a raw stream of the same payloads
        jobs = 100_000
        client.stream_create(T, N, "mem")
        client.group_create(T, N, "mem", "g")
        publish(client, "mem", jobs)
        pipe = raw.pipeline(transaction=False)
        for i in range(jobs):
            pipe.xadd("raw:mem", {"p": PAYLOAD})
            if i % 5000 == 4999:
                pipe.execute()
        pipe.execute()
        keys = client.group_keys(T, N, "mem", "g")[0]
        felix_log = int(raw.memory_usage(keys["log"], samples=0) or 0)
        raw_log = int(raw.memory_usage("raw:mem", samples=0) or 0)
        group_keys = [k for role, k in keys.items() if role not in ("meta", "log", "groups")]

        def group_bytes() -> int:
            return sum(int(raw.memory_usage(k, samples=0) or 0) for k in group_keys if raw.exists(k))

        before = group_bytes()
        out["bytes_per_waiting_job"] = round(felix_log / jobs, 1)
        out["raw_bytes_per_entry"] = round(raw_log / jobs, 1)
        out["waiting_job_over_raw_entry"] = round(felix_log / raw_log, 3)

        # server CPU per job: felix poll+ack vs raw XREADGROUP COUNT 64 + XACK; the acks
        # ride on the polls (the fast path), and for comparison in calls of their own
        raw.config_resetstat()
        drain_rate(client, "mem", jobs)
        felix_usec = script_usec(raw) / jobs
        out["group_bytes_left_per_finished_job"] = round((group_bytes() - before) / jobs, 3)
        client.group_create(T, N, "mem", "g2", start="earliest")
        raw.config_resetstat()
        done = 0
        while done < jobs:
            records = client.group_poll(T, N, "mem", 0, "g2", max_records=64)
            client.group_ack_many(T, N, "mem", 0, "g2", records)
            done += len(records)
        separate_usec = script_usec(raw) / jobs
        raw.xgroup_create("raw:mem", "g", id="0")
        raw.config_resetstat()
        done = 0
        while done < jobs:
            reply = raw.xreadgroup("g", "c", {"raw:mem": ">"}, count=64)
            ids = [entry[0] for entry in reply[0][1]]
            raw.xack("raw:mem", "g", *ids)
            done += len(ids)
        stats = raw.info("commandstats")
        raw_usec = (stats["cmdstat_xreadgroup"]["usec"] + stats["cmdstat_xack"]["usec"]) / jobs
        out["redis_usec_per_job"] = round(felix_usec, 3)
        out["raw_redis_usec_per_job"] = round(raw_usec, 3)
        out["redis_cpu_over_raw"] = round(felix_usec / raw_usec, 2)
        out["redis_usec_per_job_separate_acks"] = round(separate_usec, 3)
        out["redis_cpu_over_raw_separate_acks"] = round(separate_usec / raw_usec, 2)

        # poll cost with many dead letters and many records in flight elsewhere
        client.stream_create(T, N, "cost")
        client.group_create(T, N, "cost", "g", max_attempts=1)

        def poll_usec(samples: int = 200) -> float:
            raw.config_resetstat()
            records: list[felix_redis.Record] = []
            for _ in range(samples):
                records = client.group_poll(T, N, "cost", 0, "g", max_records=16, ack=records)
            usec = script_usec(raw) / samples
            client.group_ack_many(T, N, "cost", 0, "g", records)
            return usec

        publish(client, "cost", 200 * 16)
        out["poll_ack_usec_plain"] = round(poll_usec(), 1)
        publish(client, "cost", 100_000 + 10_000 + 200 * 16)
        done = 0
        while done < 100_000:  # 100,000 dead letters: a nack at max_attempts=1 dead-letters
            records = client.group_poll(T, N, "cost", 0, "g", max_records=min(1000, 100_000 - done))
            for r in records:
                client.group_nack(T, N, "cost", 0, "g", r)
            done += len(records)
        held = 0
        while held < 10_000:  # 10,000 in flight under other leases
            held += len(client.group_poll(T, N, "cost", 0, "g", max_records=1000))
        info = client.group_describe(T, N, "cost", "g").shards[0]
        out["dead_letters"] = info.dead
        out["in_flight_elsewhere"] = info.in_flight
        out["poll_ack_usec_with_dead_and_in_flight"] = round(poll_usec(), 1)
        out["poll_cost_ratio"] = round(out["poll_ack_usec_with_dead_and_in_flight"] / out["poll_ack_usec_plain"], 2)

        # the same for raw Streams: XREADGROUP COUNT 16 + XACK, then with 10,000 entries
        # pending for another consumer (its PEL, like felix's leases, is a sorted index)
        pipe = raw.pipeline(transaction=False)
        for _ in range(2 * 200 * 16 + 10_000):
            pipe.xadd("raw:cost", {"p": PAYLOAD})
        pipe.execute()
        raw.xgroup_create("raw:cost", "g", id="0")

        def raw_poll_usec(samples: int = 200) -> float:
            raw.config_resetstat()
            for _ in range(samples):
                reply = raw.xreadgroup("g", "c", {"raw:cost": ">"}, count=16)
                raw.xack("raw:cost", "g", *[entry[0] for entry in reply[0][1]])
            stats = raw.info("commandstats")
            return float(stats["cmdstat_xreadgroup"]["usec"] + stats["cmdstat_xack"]["usec"]) / samples

        plain = raw_poll_usec()
        raw.xreadgroup("g", "other", {"raw:cost": ">"}, count=10_000)
        out["raw_poll_ack_usec_plain"] = round(plain, 2)
        out["raw_poll_ack_usec_with_pending"] = round(raw_poll_usec(), 2)
        out["raw_poll_cost_ratio"] = round(out["raw_poll_ack_usec_with_pending"] / plain, 2)
        client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backlog", type=int, default=1_000_000, help="size of the large backlog")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    emit(measure(args.backlog), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
