"""Many shards (issue 26): what a sharded group's drain and its idle long-polls cost as
the shard count grows. One private redis-server; for each shard count K:

- **drain**: ``--records`` no-op records spread evenly over K shards, drained by one
  client with ``group_sharded(...).poll(16, ack=<previous batch>)``: jobs/s, and Redis
  commands (all of them, those scripts run included, and script calls) per job from
  ``INFO commandstats``;
- **empty poll**: the commands and script calls one ``poll(16)`` of the empty group costs;
- **idle**: ``--pollers`` threads each long-polling the empty group
  (``poll(16, wait=2.0)``) for ``--idle-s`` seconds: script calls and commands per second
  per poller.

    python bench/shards.py [--shards 1,4,16,64] [--records 16000] [--rounds 3] [--pollers 10] [--idle-s 6]
                           [--out FILE]

The drains run ``--rounds`` times, interleaved across the shard counts; each row gives
the median (and every round's figure) and ``drain_vs_1_shard``, the ratio of its median
to the 1-shard median of the same run. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def drain(shards: int, records: int, url: str, raw: Any, stream: str) -> dict[str, Any]:
    """One drain of ``records`` spread evenly over ``shards`` shards by one client."""
    client = felix_redis.connect(url)
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
    client.close()
    return {"jobs_per_s": done / took, "commands_per_job": (after[0] - before[0] - 1) / done,
            "script_calls_per_job": (after[1] - before[1]) / done}


def idle_costs(shards: int, pollers: int, idle_s: float, url: str, raw: Any, stream: str) -> dict[str, Any]:
    """What an empty poll of the drained group costs, and what idle long-pollers cost."""
    client = felix_redis.connect(url)
    group = client.group_sharded(T, N, stream, G)
    group.poll(16)  # settle caches (and learn every shard idle)
    group.poll(16)  # (and the connection its looks take)
    before = counts(raw)
    for _ in range(20):
        assert group.poll(16) == []
    after = counts(raw)
    out: dict[str, Any] = {
        "commands_per_empty_poll": round((after[0] - before[0] - 1) / 20, 2),  # less the INFO itself
        "script_calls_per_empty_poll": round((after[1] - before[1]) / 20, 2),
    }
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
    out["idle_commands_per_s_per_poller"] = round((after[0] - before[0] - 1) / idle_s / pollers, 2)
    out["idle_script_calls_per_s_per_poller"] = round((after[1] - before[1]) / idle_s / pollers, 2)
    client.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", default="1,4,16,64")
    parser.add_argument("--records", type=int, default=16_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pollers", type=int, default=10)
    parser.add_argument("--idle-s", type=float, default=6.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    counts_ = [int(x) for x in args.shards.split(",")]
    drains: dict[int, list[dict[str, Any]]] = {k: [] for k in counts_}
    with RedisServer() as server:
        raw = felix_redis.connect(server.url).redis
        # the drains interleaved (every shard count once per round), so that a slow
        # moment of the machine does not fall on one count only
        for r in range(args.rounds):
            for k in counts_:
                drains[k].append(drain(k, args.records, server.url, raw, f"k{k}r{r}"))
                print(json.dumps({"shards": k, "round": r, "jobs_per_s": round(drains[k][-1]["jobs_per_s"])}),
                      file=sys.stderr)
        rows = []
        for k in counts_:
            rates = sorted(d["jobs_per_s"] for d in drains[k])
            row: dict[str, Any] = {
                "shards": k, "jobs": args.records // k * k, "drain_jobs_per_s": round(statistics.median(rates)),
                "drain_jobs_per_s_all": [round(x) for x in rates],
                "commands_per_job": round(statistics.median(d["commands_per_job"] for d in drains[k]), 2),
                "script_calls_per_job": round(statistics.median(d["script_calls_per_job"] for d in drains[k]), 3),
            }
            row.update(idle_costs(k, args.pollers, args.idle_s, server.url, raw, f"k{k}r0"))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    if 1 in drains:
        one = next(r["drain_jobs_per_s"] for r in rows if r["shards"] == 1)
        for row in rows:
            row["drain_vs_1_shard"] = round(row["drain_jobs_per_s"] / one, 2)
    emit({"records": args.records, "rounds": args.rounds, "pollers": args.pollers, "idle_s": args.idle_s,
          "rows": rows}, args.out)


if __name__ == "__main__":
    main()
