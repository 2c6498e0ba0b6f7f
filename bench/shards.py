"""Many shards (issue 26): what a sharded group's drain and its idle long-polls cost as
the shard count grows. One private redis-server; for each shard count K:

- **drain**: ``--records`` no-op records spread evenly over K shards, drained by one
  client with ``group_sharded(...).poll(16, ack=<previous batch>)``: jobs/s, and Redis
  commands (all of them, and script calls) per job from ``INFO commandstats``;
- **empty poll**: the commands and script calls one ``poll(16)`` of the empty group costs;
- **idle**: ``--pollers`` threads each long-polling the empty group
  (``poll(16, wait=2.0)``) for ``--idle-s`` seconds: script calls and commands per second
  per poller.

    python bench/shards.py [--shards 1,4,16,64] [--records 16000] [--pollers 10] [--idle-s 6] [--out FILE]

Prints one JSON document (the baseline the many-shards work is measured against).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import felix_redis
from bench.report import emit
from felix_redis.testing.server import RedisServer

T, N, G = "bench", "shards", "workers"
PAYLOAD = b"x" * 16


def counts(raw: Any) -> tuple[int, int]:
    """(all commands, script calls) the server ran so far."""
    stats = raw.info("commandstats")
    total = sum(int(v["calls"]) for v in stats.values())
    scripts = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("fcall", "evalsha", "eval"))
    return total, scripts


def measure(shards: int, records: int, pollers: int, idle_s: float, url: str, raw: Any) -> dict[str, Any]:
    client = felix_redis.connect(url)
    stream = f"k{shards}"
    client.stream_create(T, N, stream, shards=shards)
    client.group_create(T, N, stream, G)
    per = records // shards
    for shard in range(shards):
        for start in range(0, per, 1000):
            client.publish_batch(T, N, stream, [PAYLOAD] * min(1000, per - start), shard=shard)
    group = client.group_sharded(T, N, stream, G)
    before, started = counts(raw), time.perf_counter()
    done, batch = 0, []
    while done < per * shards:
        batch = group.poll(16, ack=batch)
        done += len(batch)
    group.ack_many(batch)
    took = time.perf_counter() - started
    after = counts(raw)
    jobs = per * shards
    out: dict[str, Any] = {
        "shards": shards, "jobs": jobs, "drain_jobs_per_s": round(jobs / took),
        "commands_per_job": round((after[0] - before[0]) / jobs, 2),
        "script_calls_per_job": round((after[1] - before[1]) / jobs, 3),
    }
    group.poll(16)  # settle caches
    before = counts(raw)
    for _ in range(20):
        assert group.poll(16) == []
    after = counts(raw)
    out["commands_per_empty_poll"] = round((after[0] - before[0]) / 20 - 1, 1)  # less the INFO itself
    out["script_calls_per_empty_poll"] = round((after[1] - before[1]) / 20, 1)

    stop = threading.Event()

    def idle() -> None:
        c = felix_redis.connect(url)
        g = c.group_sharded(T, N, stream, G)
        while not stop.is_set():
            g.poll(16, wait=2.0)
        c.close()
    threads = [threading.Thread(target=idle, daemon=True) for _ in range(pollers)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # every poller is in its first wait
    before = counts(raw)
    time.sleep(idle_s)
    after = counts(raw)
    stop.set()
    for t in threads:
        t.join(5)
    out["idle_commands_per_s_per_poller"] = round((after[0] - before[0] - 1) / idle_s / pollers, 1)
    out["idle_script_calls_per_s_per_poller"] = round((after[1] - before[1]) / idle_s / pollers, 1)
    client.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", default="1,4,16,64")
    parser.add_argument("--records", type=int, default=16_000)
    parser.add_argument("--pollers", type=int, default=10)
    parser.add_argument("--idle-s", type=float, default=6.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    with RedisServer() as server:
        raw = felix_redis.connect(server.url).redis
        for k in (int(x) for x in args.shards.split(",")):
            raw.config_resetstat()
            rows.append(measure(k, args.records, args.pollers, args.idle_s, server.url, raw))
            print(json.dumps(rows[-1]), file=sys.stderr)
    emit({"records": args.records, "pollers": args.pollers, "idle_s": args.idle_s, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
