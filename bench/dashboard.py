"""The dashboard's cost: the overview over many streams, and round trips per stream page.

One private ``redis-server`` holds ``--streams`` streams of ``--shards`` shards, each with
``--groups`` groups and a few records (some in flight, one dead letter per group). The
dashboard (``felix_redis.dashboard.create_app``) runs in this process under uvicorn;
httpx asks it over loopback HTTP, as a browser would:

- **overview, cold**: ``GET /`` when nothing was sampled yet (a full sweep: every
  stream and group described, concurrently), then **warm** (the sampled sweep);
- **stream page** and **group page**: the round trips their Redis reads take (counted
  in the AsyncClient: one per command or pipelined batch sent) for ``--shards`` and for
  ``4 * --shards`` shards: pipelined describes keep them constant in the shard count.

    python bench/dashboard.py [--streams 1000] [--groups 3] [--shards 4] [--out FILE]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import uvicorn

import felix_redis
from bench.report import emit
from felix_redis.asyncio import AsyncClient
from felix_redis.dashboard import create_app
from felix_redis.testing.server import RedisServer, free_port

T, N = "bench", "dash"


def fill(client: felix_redis.Client, streams: int, groups: int, shards: int, prefix: str = "s") -> None:
    for i in range(streams):
        name = f"{prefix}{i:04d}"
        client.stream_create(T, N, name, shards=shards)
        for g in range(groups):
            client.group_create(T, N, name, f"g{g}")
        for shard in range(shards):
            client.publish_batch(T, N, name, [b"x" * 32] * 2, shard=shard)
        got = client.group_poll(T, N, name, 0, "g0", max_records=2)
        client.group_dead_letter(T, N, name, 0, "g0", got[0].claim, reason="bench")


class Counting:
    """Counts the round trips the AsyncClient sends (a Batch is one)."""

    def __init__(self) -> None:
        self.count = 0
        self._original = AsyncClient._execute_once

    def __enter__(self) -> Counting:
        original = self._original
        counter = self

        async def counted(client: AsyncClient, op: Any) -> Any:
            counter.count += 1
            return await original(client, op)
        AsyncClient._execute_once = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        AsyncClient._execute_once = self._original  # type: ignore[method-assign]


def serve(url: str) -> tuple[uvicorn.Server, threading.Thread, str]:
    # a long sampling interval: the sampler does not run during the timings
    app = create_app(url, interval=300)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{server.config.port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out: dict[str, Any] = {"streams": args.streams, "groups": args.groups, "shards": args.shards}
    with RedisServer() as redis_server:
        client = felix_redis.connect(redis_server.url)
        started = time.perf_counter()
        fill(client, args.streams, args.groups, args.shards)
        fill(client, 1, args.groups, 4 * args.shards, prefix="wide")
        out["fill_s"] = round(time.perf_counter() - started, 1)
        colds, warms = [], []
        for _ in range(args.rounds):
            server, thread, base = serve(redis_server.url)
            with httpx.Client(base_url=base, timeout=60) as http:
                t0 = time.perf_counter()
                page = http.get("/")
                colds.append(time.perf_counter() - t0)
                assert page.status_code == 200 and page.text.count("<tr data-group=") == args.streams * args.groups \
                    + args.groups, "the overview does not show every group"
                t0 = time.perf_counter()
                assert http.get("/").status_code == 200
                warms.append(time.perf_counter() - t0)
                trips: dict[str, int] = {}
                for label, stream in (("narrow", "s0000"), ("wide", "wide0000")):
                    for kind, path in (("stream_page", f"/streams/{T}/{N}/{stream}"),
                                       ("group_page", f"/streams/{T}/{N}/{stream}/groups/g0"),
                                       ("dead_letters_page", f"/streams/{T}/{N}/{stream}/groups/g0/dead-letters")):
                        http.get(path)  # caches warm (settings, roles)
                        with Counting() as counting:
                            assert http.get(path).status_code == 200
                        trips[f"{kind}_{label}"] = counting.count
            server.should_exit = True
            thread.join(10)
        out["overview_cold_s"] = round(statistics.median(colds), 3)
        out["overview_warm_s"] = round(statistics.median(warms), 3)
        out["overview_cold_all_s"] = [round(x, 3) for x in colds]
        out["round_trips"] = trips
        out["round_trips_note"] = (f"narrow: {args.shards} shards, wide: {4 * args.shards} shards; the "
                                   "dead-letters page reads the listed records in the same kind of pipeline")
        client.close()
    emit(out, args.out)


if __name__ == "__main__":
    main()
