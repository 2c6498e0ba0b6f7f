"""Delayed records: memory, poll cost and hand-out rate, as ratios to plain records.

Every figure comes from one private ``redis-server`` in one run, as a ratio to the same
work on plain records (no delay, expiry or headers):

- **memory**: ``used_memory`` (less the clients' buffers) per waiting delayed record (due over the next hour, the
  group's scan already passed over them) against per waiting plain record (published,
  never delivered); the delayed records' share includes the log fields ``d``, the shard's
  due index and whatever the group keeps;
- **memory, one by one**: the same, for records published one call each, the delayed
  ones as densely due as the issue's 1,000,000 over an hour; with ``--sizes``, again for
  each of those payload sizes (a stream's log is a chain of listpack nodes of up to 4 KiB
  whose allocation Redis rounds up to the allocator's next size class when the node is
  closed: at some payload sizes the last entry of every node tips it into the 5 KiB class,
  for delayed and plain records alike, which is worth about 1,024 bytes / entries per
  node, so one payload size alone does not tell what the ``d`` field costs);
- **poll with scheduled**: the drain rate of plain records (``group_poll(16, ack=the
  previous batch)``) on a shard that also holds ``--scheduled`` delayed records not yet
  due, against the same drain on a shard with none;
- **due drain**: the drain rate of records that were delayed and came due, against the
  drain of plain records: records the group passed over while they were not due (handed
  out from the due index) and records its scan met only once due.

    python bench/delays.py [--records 100000] [--scheduled 100000] [--drain 20000]
        [--sizes 16:256:8 --size-records 20000] [--out FILE]

The issue's figures ask for 1,000,000 waiting delayed records (``--records 1000000``
takes a few minutes and about 1 GiB). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import felix_redis
from felix_redis.testing.server import RedisServer

T, N = "bench", "bench"
PAYLOAD = b"x" * 64
BATCH = 1000


def used_memory(client: felix_redis.Client) -> int:
    """``used_memory`` less the clients' buffers: the connections' query and reply
    buffers grow with a large reply (a poll of 10,000) and shrink later, when Redis'
    cron gets to them, which is not memory of the records (it once made 2,000 plain
    records measure as -420 bytes each)."""
    info = client.redis.info("memory")
    return int(info["used_memory"]) - int(info.get("mem_clients_normal", 0)) - int(info.get("mem_clients_slaves", 0))


def publish_many(client: felix_redis.Client, stream: str, count: int, **extras: Any) -> None:
    for start in range(0, count, BATCH):
        n = min(BATCH, count - start)
        client.publish_batch(T, N, stream, [PAYLOAD] * n, shard=0, **extras)


def publish_spread(client: felix_redis.Client, stream: str, count: int, over_s: float) -> None:
    """``count`` delayed records, their due times spread evenly over ``over_s`` seconds
    from an hour on (batches of 100 share a due time)."""
    for start in range(0, count, 100):
        n = min(100, count - start)
        client.publish_batch(T, N, stream, [PAYLOAD] * n, shard=0, delay=3600 + over_s * start / count)


def drain(client: felix_redis.Client, stream: str, group: str, want: int, limit_s: float = 120.0) -> float:
    """Polls 16 at a time, acking each batch with the next poll, until ``want`` records
    were handed out; returns records per second."""
    got, ack, started = 0, None, time.perf_counter()
    while got < want and time.perf_counter() - started < limit_s:
        records = client.group_poll(T, N, stream, 0, group, max_records=16, ack=ack)
        got += len(records)
        ack = records
    if ack:
        client.group_ack_many(T, N, stream, 0, group, ack)
    took = time.perf_counter() - started
    if got < want:
        raise RuntimeError(f"drained {got} of {want} records of {stream} in {took:.0f}s")
    return got / took


def median_ratio(these: list[float], plain: list[float]) -> float:
    """The median over the rounds of this round's rate against the plain rate of the same
    round (measured next to each other): steadier than best against best on a machine
    whose speed changes from minute to minute."""
    return round(statistics.median(t / p for t, p in zip(these, plain, strict=True)), 3)


def memory_ratio(client: felix_redis.Client, records: int) -> dict[str, Any]:
    client.stream_create(T, N, "mem-plain", shards=1)
    client.stream_create(T, N, "mem-delayed", shards=1)
    client.group_create(T, N, "mem-plain", "g")
    client.group_create(T, N, "mem-delayed", "g")
    gc.collect()
    before = used_memory(client)
    publish_many(client, "mem-plain", records)
    plain = (used_memory(client) - before) / records
    before = used_memory(client)
    publish_spread(client, "mem-delayed", records, 3600.0)
    # the group passes over them all (a poll hands out nothing: none is due)
    passed = 0
    while passed < 100:
        if client.group_poll(T, N, "mem-delayed", 0, "g", max_records=10_000):
            raise RuntimeError("a delayed record was handed out before it was due")
        info = client.group_describe(T, N, "mem-delayed", "g").shards[0]
        if info.pending == 0:
            break
        passed += 1
    delayed = (used_memory(client) - before) / records
    info = client.group_describe(T, N, "mem-delayed", "g").shards[0]
    return {"records": records, "plain_bytes_per_record": round(plain, 1),
            "delayed_bytes_per_record": round(delayed, 1), "ratio": round(delayed / plain, 3),
            "scheduled": info.scheduled, "pending": info.pending}


def memory_singles(client: felix_redis.Client, records: int, payload: bytes = PAYLOAD,
                   name: str = "one") -> dict[str, Any]:
    """Memory per record published one by one (a call each), delayed records due over
    records / 1,000,000 hours from an hour on (the density of the issue's 1,000,000 due
    over an hour: about 28 due in each 100 ms bucket of the due index), against plain
    records published one by one."""
    plain_s, delayed_s = f"{name}-plain-{len(payload)}", f"{name}-delayed-{len(payload)}"
    for stream in (plain_s, delayed_s):
        client.stream_create(T, N, stream, shards=1)
        client.group_create(T, N, stream, "g")
    gc.collect()
    before = used_memory(client)
    for _ in range(records):
        client.publish(T, N, plain_s, payload, shard=0)
    plain = (used_memory(client) - before) / records
    span = 3600.0 * records / 1_000_000
    before = used_memory(client)
    for i in range(records):
        client.publish(T, N, delayed_s, payload, shard=0, delay=3600 + span * i / records)
    if client.group_poll(T, N, delayed_s, 0, "g", max_records=10_000):
        raise RuntimeError("a delayed record was handed out before it was due")
    delayed = (used_memory(client) - before) / records
    info = client.group_describe(T, N, delayed_s, "g").shards[0]
    return {"records": records, "payload_bytes": len(payload), "due_over_s": span,
            "plain_bytes_per_record": round(plain, 1), "delayed_bytes_per_record": round(delayed, 1),
            "ratio": round(delayed / plain, 3), "scheduled": info.scheduled}


def memory_sizes(client: felix_redis.Client, records: int, sizes: list[int]) -> dict[str, Any]:
    """memory_singles for each payload size of sizes (records each): the ratio's median,
    its range, and how many sizes keep it at or below 1.5x."""
    each = [memory_singles(client, records, b"x" * size, "size") for size in sizes]
    ratios = [e["ratio"] for e in each]
    extra = [e["delayed_bytes_per_record"] - e["plain_bytes_per_record"] for e in each]
    return {"records": records, "sizes": sizes, "median_ratio": round(statistics.median(ratios), 3),
            "min_ratio": min(ratios), "max_ratio": max(ratios),
            "sizes_at_or_below_1_5x": sum(r <= 1.5 for r in ratios),
            "median_extra_bytes_per_record": round(statistics.median(extra), 1),
            "each": [{k: e[k] for k in ("payload_bytes", "plain_bytes_per_record", "delayed_bytes_per_record",
                                        "ratio")} for e in each]}


def size_range(text: str) -> list[int]:
    """'16:256:8' (first, last, step) or '64,100' as a list of payload sizes."""
    if ":" in text:
        first, last, step = (int(x) for x in text.split(":"))
        return list(range(first, last + 1, step))
    return [int(x) for x in text.split(",")]


def poll_with_scheduled(client: felix_redis.Client, scheduled: int, jobs: int, rounds: int) -> dict[str, Any]:
    for stream in ("poll-none", "poll-sched"):
        client.stream_create(T, N, stream, shards=1)
        client.group_create(T, N, stream, "g")
    publish_spread(client, "poll-sched", scheduled, 3600.0)
    client.group_poll(T, N, "poll-sched", 0, "g", max_records=10_000)
    while client.group_describe(T, N, "poll-sched", "g").shards[0].pending:
        client.group_poll(T, N, "poll-sched", 0, "g", max_records=10_000)
    rates: dict[str, list[float]] = {"poll-none": [], "poll-sched": []}
    for _ in range(rounds):  # alternating, so that machine noise falls on both alike
        for stream in rates:
            publish_many(client, stream, jobs)
            rates[stream].append(drain(client, stream, "g", jobs))
    none, sched = max(rates["poll-none"]), max(rates["poll-sched"])
    return {"scheduled": scheduled, "jobs": jobs, "rounds": rounds, "plain_drain_per_s": round(none),
            "with_scheduled_drain_per_s": round(sched),
            "ratio": median_ratio(rates["poll-sched"], rates["poll-none"])}


def due_drain(client: felix_redis.Client, jobs: int, rounds: int) -> dict[str, Any]:
    """Records published with a delay of 2 s, drained once due: passed over by the group
    while not due (its scan went by them; it hands them out from the due index), and met
    by the scan only once due (the group had not got to them); against plain records."""
    rates: dict[str, list[float]] = {"plain": [], "passed": [], "met": []}
    delay = 2.0
    for r in range(rounds):  # the three alternate, so that machine noise falls on all alike
        streams = {kind: f"drain-{kind}-{r}" for kind in rates}
        for stream in streams.values():
            client.stream_create(T, N, stream, shards=1)
            client.group_create(T, N, stream, "g")
        publish_many(client, streams["plain"], jobs)
        rates["plain"].append(drain(client, streams["plain"], "g", jobs))
        publish_many(client, streams["passed"], jobs, delay=delay)
        publish_many(client, streams["met"], jobs, delay=delay)
        published = time.monotonic()
        # the group of "passed" goes by them all while they are not due (one poll scans
        # up to 4 x 10,000 + 4,096 records; more: the reply says poll again)
        for _ in range(1 + jobs // 40_000):
            if client.group_poll(T, N, streams["passed"], 0, "g", max_records=10_000):
                raise RuntimeError("a delayed record was handed out before it was due")
        state = client.group_describe(T, N, streams["passed"], "g").shards[0]
        if state.pending or state.scheduled != jobs:
            raise RuntimeError(f"the group did not pass over the delayed records: {state}")
        time.sleep(max(0.0, delay + 0.2 - (time.monotonic() - published)))
        rates["passed"].append(drain(client, streams["passed"], "g", jobs))
        rates["met"].append(drain(client, streams["met"], "g", jobs))
    plain, passed, met = (max(rates[kind]) for kind in ("plain", "passed", "met"))
    return {"jobs": jobs, "rounds": rounds, "plain_drain_per_s": round(plain),
            "passed_over_drain_per_s": round(passed),
            "passed_over_ratio": median_ratio(rates["passed"], rates["plain"]),
            "met_by_scan_drain_per_s": round(met), "met_by_scan_ratio": median_ratio(rates["met"], rates["plain"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000, help="waiting records for the memory ratio")
    parser.add_argument("--single-records", type=int, default=100_000,
                        help="records published one by one for the second memory ratio")
    parser.add_argument("--scheduled", type=int, default=100_000, help="delayed records held while draining")
    parser.add_argument("--drain", type=int, default=20_000, help="records per drain")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds; a ratio is the median over them of each round's ratio (rates: the best)")
    parser.add_argument("--sizes", type=size_range, default=None,
                        help="payload sizes for memory one by one at each size: FIRST:LAST:STEP or A,B,...")
    parser.add_argument("--size-records", type=int, default=20_000,
                        help="records published one by one per payload size of --sizes")
    parser.add_argument("--out", default=None, help="also write the JSON document here")
    args = parser.parse_args(argv)
    with RedisServer(extra=["--save", "", "--appendonly", "no"]) as server:
        client = felix_redis.connect(server.url)
        try:
            doc = {
                "server": client.redis.info("server")["redis_version"],
                "memory": memory_ratio(client, args.records),
                "memory_one_by_one": memory_singles(client, args.single_records),
                **({"memory_one_by_one_sizes": memory_sizes(client, args.size_records, args.sizes)}
                   if args.sizes else {}),
                "poll_with_scheduled": poll_with_scheduled(client, args.scheduled, args.drain, args.rounds),
                "due_drain": due_drain(client, args.drain, args.rounds),
            }
        finally:
            client.close()
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
