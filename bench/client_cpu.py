"""The client's own CPU per single publish, with the server's part taken out.

A round trip to Redis costs ~100 usec here and varies by several usec from run to run,
so a change of one or two usec in the client's Python code cannot be seen in
``bench/roundtrip.py``. This measures that code alone: a private redis-server warms the
caches (stream settings), then each client's ``_execute`` (the one place a driver sends
an op) is replaced by one that answers a publish at once with a canned reply, and the
publish calls are timed in a loop. Measured: ``Client.publish`` (a producer borrowed
from the pool), ``IdempotentProducer.publish``, ``Client.publish`` of a client made with
``idempotent_publish=False``, and the asyncio client's ``publish``; usec per call, the
median of ``--rounds`` rounds of ``--calls`` calls.

To compare two revisions, run the same file in a worktree of each:

    git worktree add /tmp/before <rev> && cp bench/client_cpu.py /tmp/before/bench/
    python /tmp/before/bench/client_cpu.py; python bench/client_cpu.py

    python bench/client_cpu.py [--calls 20000] [--rounds 7]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import felix_redis
import felix_redis.asyncio as felix_aio
from felix_redis.testing.server import RedisServer

T, N, S = "cpu", "bench", "jobs"
REPLY = [1, 1, 0, 0, None]  # what the publish script answers: offset, count, ...


def canned(op: Any) -> Any:
    return REPLY


async def canned_async(op: Any) -> Any:
    return REPLY


def per_call_usec(run: Any, calls: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run(calls)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return round(statistics.median(times), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    out: dict[str, Any] = {"calls": args.calls, "rounds": args.rounds}
    with RedisServer() as server:
        url = server.url
        client = felix_redis.connect(url)
        client.stream_create(T, N, S, shards=1)
        plain = felix_redis.connect(url, idempotent_publish=False)
        producer = client.idempotent_producer()
        for c in (client, plain):
            c.publish(T, N, S, b"warm")  # caches the settings
        producer.publish(T, N, S, b"warm")
        for c in (client, plain):
            c._execute = canned  # type: ignore[method-assign]

        def publishes(pub: Any) -> Any:
            def run(n: int) -> None:
                for _ in range(n):
                    pub(T, N, S, b"payload!")
            return run

        out["publish_usec"] = per_call_usec(publishes(client.publish), args.calls, args.rounds)
        out["producer_publish_usec"] = per_call_usec(publishes(producer.publish), args.calls, args.rounds)
        out["publish_plain_usec"] = per_call_usec(publishes(plain.publish), args.calls, args.rounds)

        async def run_async() -> float:
            aclient = felix_aio.connect(url)
            await aclient.publish(T, N, S, b"warm")
            aclient._execute = canned_async  # type: ignore[method-assign]
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                for _ in range(args.calls):
                    await aclient.publish(T, N, S, b"payload!")
                times.append((time.perf_counter() - start) / args.calls * 1e6)
            await aclient.close()
            return round(statistics.median(times), 3)

        out["async_publish_usec"] = asyncio.run(run_async())
        for c in (client, plain):
            c.close()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
