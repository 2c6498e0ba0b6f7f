"""What server time costs a single call's round trip, on a private redis-server:

- one ``XADD`` through redis-py's ``execute_command`` (what an application does, and
  issue 8's floor), the same ``XADD`` sent on a connection kept out of redis-py's pool
  (``send_command`` + ``read_response``, as felix-redis's lane sends its script calls:
  what that saves, apart from the server's work), one felix-redis ``publish`` (the
  client's default, with its producer sequence), one ``publish`` of a client made with
  ``idempotent_publish=False`` (no producer state), one idempotent producer's
  ``publish_keyed``, and the plain publish function called bare with redis-py's
  ``fcall`` (through the pool, no felix-redis client code around it);
- the asyncio client's ``publish`` beside redis.asyncio's ``XADD`` (both awaited one
  after the other on one event loop);
- a function that only spins ``N`` Lua iterations, for a few ``N``: the round trip as
  server time grows, with nothing else changing.

For each: the median round trip (usec, over alternating rounds, so that load on the
machine falls on all of them alike) and the server time per call (usec, INFO
commandstats). The single-publish target of issue 8 (0.9x ``XADD``) is a question of
how much server time a publish may take; this answers it.

    python bench/roundtrip.py [--calls 2000] [--rounds 7] [--out FILE]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import felix_redis
import felix_redis.asyncio as felix_aio
from bench.report import emit
from felix_redis import scripts
from felix_redis.testing.server import RedisServer

T, N, S = "roundtrip", "bench", "jobs"
PAYLOAD = b"x" * 8
SPINS = (0, 2_000, 5_000, 10_000)
SPIN_LIBRARY = ("#!lua name=felixbench_spin\n"
                "redis.register_function('felixbench_spin', function(keys, args)\n"
                "  local x = 0\n  for i = 1, tonumber(args[1]) do x = x + i end\n  return x\nend)")


def repeat(call: Callable[[], Any]) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in range(n):
            call()
    return run


def measure(calls: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"redis": None, "calls": calls, "rounds": rounds}
    with RedisServer() as server:
        raw = redis.Redis.from_url(server.url)
        out["redis"] = raw.info("server")["redis_version"]
        client = felix_redis.connect(server.url)
        plain = felix_redis.connect(server.url, idempotent_publish=False)
        client.stream_create(T, N, S)
        client.publish(T, N, S, PAYLOAD)  # loads the library
        producer = client.idempotent_producer()
        keys = iter(range(10**9))
        raw.function_load(SPIN_LIBRARY, replace=True)
        name = client.core.name(T, N, S)
        meta, log, conf = name.publish_keys(0)
        publish_fn = scripts.library().functions["publish"]

        def bare_publish() -> None:
            # a plain publish (no producer): the script and the round trip, no client code
            raw.fcall(publish_fn, 3, meta, log, conf, "", "", 0, 3_600_000, "", "", "", PAYLOAD)

        def spin(n: int) -> Callable[[], None]:
            return lambda: raw.fcall("felixbench_spin", 0, n)

        kept = raw.connection_pool.get_connection()

        def xadd_kept() -> None:
            kept.send_command("XADD", "raw", "*", "p", PAYLOAD)
            kept.read_response()

        parts: dict[str, tuple[str, Callable[[], None]]] = {
            "xadd": ("xadd", lambda: raw.xadd("raw", {"p": PAYLOAD})),
            "xadd_kept_connection": ("xadd", xadd_kept),
            "publish": ("fcall", lambda: client.publish(T, N, S, PAYLOAD)),
            "publish_plain": ("fcall", lambda: plain.publish(T, N, S, PAYLOAD)),
            "producer_publish_keyed": ("fcall", lambda: producer.publish_keyed(T, N, S, f"k{next(keys)}", PAYLOAD)),
            "bare_publish_fcall": ("fcall", bare_publish),
            **{f"spin_{n}": ("fcall", spin(n)) for n in SPINS},
        }
        # the asyncio client and redis.asyncio, on one event loop kept for all rounds:
        # a part runs its calls inside the loop (one run_until_complete per part and round)
        loop = asyncio.new_event_loop()
        araw = aioredis.Redis.from_url(server.url)
        aclient = felix_aio.connect(server.url)

        def in_loop(make: Callable[[], Awaitable[Any]]) -> Callable[[int], None]:
            async def many(n: int) -> None:
                for _ in range(n):
                    await make()
            return lambda n: loop.run_until_complete(many(n))

        loop.run_until_complete(aclient.publish(T, N, S, PAYLOAD))
        runs: dict[str, tuple[str, Callable[[int], None]]] = {
            key: (command, repeat(call)) for key, (command, call) in parts.items()}
        runs["async_xadd"] = ("xadd", in_loop(lambda: araw.xadd("raw", {"p": PAYLOAD})))
        runs["async_publish"] = ("fcall", in_loop(lambda: aclient.publish(T, N, S, PAYLOAD)))
        times: dict[str, list[float]] = {k: [] for k in runs}
        server_us: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(rounds):
            for key, (command, run) in runs.items():
                raw.config_resetstat()
                start = time.perf_counter()
                run(calls)
                times[key].append((time.perf_counter() - start) / calls * 1e6)
                stats = raw.info("commandstats")[f"cmdstat_{command}"]
                server_us[key].append(float(stats["usec"]) / calls)
        for key in runs:
            out[key] = {
                "round_trip_usec": round(statistics.median(times[key]), 1),
                "server_usec": round(statistics.median(server_us[key]), 2),
            }
        out["publish_over_xadd_rate"] = round(out["xadd"]["round_trip_usec"] / out["publish"]["round_trip_usec"], 3)
        out["publish_over_xadd_kept_connection_rate"] = round(
            out["xadd_kept_connection"]["round_trip_usec"] / out["publish"]["round_trip_usec"], 3)
        # idempotence's cost: how much slower than a publish without producer state
        for key in ("publish", "producer_publish_keyed"):
            out[f"{key}_slower_than_plain"] = round(
                out[key]["round_trip_usec"] / out["publish_plain"]["round_trip_usec"] - 1, 3)
        out["async_publish_over_async_xadd_rate"] = round(
            out["async_xadd"]["round_trip_usec"] / out["async_publish"]["round_trip_usec"], 3)
        loop.run_until_complete(aclient.close())
        loop.run_until_complete(araw.aclose())
        loop.close()
        raw.connection_pool.release(kept)
        plain.close()
        client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="calls per part and round")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (the median is reported)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    emit(measure(args.calls, args.rounds), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
