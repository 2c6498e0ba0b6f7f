"""The runtimes' own cost per job (issue 23): what the client process spends, in CPU
time, to drain a job through each way of consuming, and the drain rate.

One private redis-server; each round publishes ``--records`` no-op records to a 1-shard
stream (``--shards`` to change it) and drains them with, in turn:

- ``poll-ack``: ``client.group_poll(..., max_records=16, ack=<previous batch>)`` (on a
  1-shard stream only);
- ``readme``: the README's loop, ``group_sharded(..., prefetch=64).poll(16, wait=...)``
  then ``group.ack(item, wait=False)`` per item; ``readme-plain`` the same without
  prefetch;
- ``worker``: ``felix_redis.Worker`` with ``--concurrency`` handler threads, no-op handler;
- ``async-worker``: ``felix_redis.aioworker.AsyncWorker``, the same.

Per way: jobs/s and client CPU per job (``time.process_time()`` of this process, which
runs the drain and nothing else meanwhile), from the start (a worker's included) to the
last job handled (and, for the polling loops, acked), the median over ``--rounds``
rounds (the ways alternate within a round).

    python bench/runtime_cpu.py [--records 40000] [--rounds 3] [--concurrency 16] [--shards 1] [--out FILE]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import felix_redis
import felix_redis.asyncio as felix_aio
from bench.report import emit
from felix_redis.aioworker import AsyncWorker
from felix_redis.testing.server import RedisServer

T, N, G = "bench", "runtime", "workers"
PAYLOAD = b"x" * 64
WAYS = ("poll-ack", "readme", "readme-plain", "worker", "async-worker")


def fill(client: felix_redis.Client, stream: str, records: int, shards: int) -> None:
    client.stream_create(T, N, stream, shards=shards)
    client.group_create(T, N, stream, G)
    per = records // shards
    for shard in range(shards):
        for start in range(0, per, 1000):
            client.publish_batch(T, N, stream, [PAYLOAD] * min(1000, per - start), shard=shard)


#: (perf_counter, process_time) when the last job was handled: a drain's end, before
#: the way's own shutdown (a worker's stop waits out its long poll)
END: list[tuple[float, float]] = []


def mark_end() -> None:
    END.append((time.perf_counter(), time.process_time()))


def poll_ack(client: felix_redis.Client, stream: str, records: int, concurrency: int) -> None:
    done, prev = 0, []  # type: tuple[int, list[Any]]
    while done < records:
        prev = client.group_poll(T, N, stream, 0, G, max_records=16, wait=1.0, ack=prev)
        done += len(prev)
    client.group_ack_many(T, N, stream, 0, G, prev)
    mark_end()


def readme(client: felix_redis.Client, stream: str, records: int, concurrency: int, prefetch: int = 64) -> None:
    group = client.group_sharded(T, N, stream, G, prefetch=prefetch)
    done = 0
    while done < records:
        for item in group.poll(16, wait=1.0):
            done += 1
            group.ack(item, wait=False)
    group.flush()
    mark_end()
    group.close()


def readme_plain(client: felix_redis.Client, stream: str, records: int, concurrency: int) -> None:
    readme(client, stream, records, concurrency, prefetch=0)


def worker(client: felix_redis.Client, stream: str, records: int, concurrency: int) -> None:
    lock, done, finished = threading.Lock(), [0], threading.Event()

    def handler(record: Any) -> None:
        with lock:
            done[0] += 1
            if done[0] == records:
                mark_end()
                finished.set()

    runtime = felix_redis.Worker(client, T, N, stream, G, handler, concurrency=concurrency, poll_wait_s=1.0,
                                 handle_signals=False)
    thread = threading.Thread(target=runtime.run)
    thread.start()
    finished.wait(300)
    runtime.stop()
    thread.join(30)


def async_worker(url: str, stream: str, records: int, concurrency: int) -> None:
    async def main() -> None:
        client = await felix_aio.connect(url)
        done, finished = [0], asyncio.Event()

        async def handler(record: Any) -> None:
            done[0] += 1
            if done[0] == records:
                mark_end()
                finished.set()

        runtime = AsyncWorker(client, T, N, stream, G, handler, concurrency=concurrency, poll_wait_s=1.0,
                              handle_signals=False)
        task = asyncio.create_task(runtime.run())
        await asyncio.wait_for(finished.wait(), 300)
        runtime.stop()
        await task
        await client.close()

    asyncio.run(main())


def measure(way: str, url: str, stream: str, records: int, concurrency: int, shards: int) -> tuple[float, float]:
    """(jobs/s, client CPU usec per job) of one drain."""
    client = felix_redis.connect(url)
    fill(client, stream, records, shards)
    run: Callable[[], None]
    if way == "async-worker":
        def run() -> None:
            async_worker(url, stream, records, concurrency)
    else:
        fn = {"poll-ack": poll_ack, "readme": readme, "readme-plain": readme_plain, "worker": worker}[way]

        def run() -> None:
            fn(client, stream, records, concurrency)
    END.clear()
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    wall, cpu = END[0][0] - wall, END[0][1] - cpu
    client.close()
    return records / wall, cpu / records * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=40_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    ways = [w for w in args.ways.split(",") if w != "poll-ack" or args.shards == 1]
    rates: dict[str, list[float]] = {w: [] for w in ways}
    cpus: dict[str, list[float]] = {w: [] for w in ways}
    with RedisServer() as server:
        for rnd in range(args.rounds):
            for way in ways:
                rate, cpu = measure(way, server.url, f"{way}-{rnd}", args.records, args.concurrency, args.shards)
                rates[way].append(round(rate))
                cpus[way].append(round(cpu, 2))
                print(way, round(rate), round(cpu, 2), file=sys.stderr)
    emit({
        "bench": "runtime_cpu", "command": " ".join(sys.argv), "records": args.records, "shards": args.shards,
        "concurrency": args.concurrency,
        "ways": {w: {"jobs_per_s": statistics.median(rates[w]), "client_cpu_usec_per_job": statistics.median(cpus[w]),
                     "rounds_jobs_per_s": rates[w], "rounds_cpu_usec": cpus[w]} for w in ways},
    }, args.out)


if __name__ == "__main__":
    main()
