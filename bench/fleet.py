"""Fleets (issue 23): what Redis does per published record while K idle workers
long-poll one group. One private redis-server, a stream of ``--shards`` shards (1 by
default); for each K:

- K threads each loop ``group_poll(..., max_records=1, wait=2.0, ack=<what it got>)``
  (``--mode poll``) or each their own
  ``group_sharded(...).poll(1, wait=2.0)`` acking what it got (``--mode sharded``);
- once every thread waits, ``--publishes`` records are published ``--gap-s`` apart:
  script calls (``FCALL``/``EVALSHA``, the publishes' own included), ``XREAD`` calls and
  commands per published record, from ``INFO commandstats``, and whether every record
  was handed out (the records go to the shards in turn);
- then ``--idle-s`` quiet seconds: script calls and commands per second, per poller;
  and the script calls per record beyond that idle rate (what the records cost, less
  the polls every waiter makes when its wait ends, which the publishing window holds too).
  Each thread has its own client (a worker process of its own).

    python bench/fleet.py [--pollers 10,100,500] [--mode poll|sharded] [--shards 1] [--publishes 20]
                          [--gap-s 0.25] [--idle-s 4] [--wait-s 2] [--out FILE]

Prints one JSON document (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import felix_redis
from bench.report import emit
from felix_redis.testing.server import RedisServer

T, N, G = "bench", "fleet", "workers"


def counts(raw: Any) -> dict[str, int]:
    """Calls so far: all commands, script calls, XREAD, XREADGROUP and BZPOPMIN (the
    followers' wait on the group's bell)."""
    stats = raw.info("commandstats")

    def calls(*names: str) -> int:
        return sum(int(stats.get(f"cmdstat_{n}", {}).get("calls", 0)) for n in names)

    return {"commands": sum(int(v["calls"]) for v in stats.values()), "scripts": calls("fcall", "evalsha", "eval"),
            "xread": calls("xread"), "xreadgroup": calls("xreadgroup"), "bzpopmin": calls("bzpopmin")}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] - (1 if k == "commands" else 0) for k in after}  # less the INFO itself


def fleet(pollers: int, mode: str, publishes: int, gap_s: float, idle_s: float, url: str, raw: Any,
          stream: str, wait_s: float = 2.0, shards: int = 1) -> dict[str, Any]:
    if shards > 1 and mode == "poll":
        raise ValueError("--mode poll long-polls shard 0 only: use --mode sharded with --shards above 1")
    client = felix_redis.connect(url)
    client.stream_create(T, N, stream, shards=shards)
    client.group_create(T, N, stream, G)
    stop = threading.Event()
    got: list[tuple[int, int]] = []  # (shard, offset)
    lock = threading.Lock()
    waiting = threading.Semaphore(0)

    # each poller its own client, as each worker of a fleet is a process of its own (a
    # client shared by hundreds of blocked threads runs out of its pool's connections)
    clients = [felix_redis.connect(url) for _ in range(pollers)]

    def loop_poll(c: felix_redis.Client) -> None:
        held: list[Any] = []
        waiting.release()
        while not stop.is_set():
            held = c.group_poll(T, N, stream, 0, G, max_records=1, wait=wait_s, ack=held)
            with lock:
                got.extend((0, r.offset) for r in held)
        if held:
            c.group_ack_many(T, N, stream, 0, G, held)

    def loop_sharded(c: felix_redis.Client) -> None:
        group = c.group_sharded(T, N, stream, G)
        waiting.release()
        while not stop.is_set():
            for item in group.poll(1, wait=wait_s):
                with lock:
                    got.append((item.shard, item.record.offset))
                group.ack(item, wait=False)
        group.close()

    threads = [threading.Thread(target=loop_poll if mode == "poll" else loop_sharded, args=(c,), daemon=True)
               for c in clients]
    for t in threads:
        t.start()
    for _ in threads:
        waiting.acquire()
    time.sleep(wait_s + 0.5)  # every poller is in a wait, past its first one
    before = counts(raw)
    started = time.monotonic()
    for i in range(publishes):
        client.publish(T, N, stream, f"job-{i}", shard=i % shards)
        time.sleep(gap_s)
    time.sleep(0.5)
    after = counts(raw)
    window_s = time.monotonic() - started
    busy = delta(after, before)
    time.sleep(wait_s)  # the acks ride on the pollers' next polls
    before = counts(raw)
    time.sleep(idle_s)
    quiet = delta(counts(raw), before)
    stop.set()
    for t in threads:
        t.join(wait_s * 2 + 5)
    for c in clients:
        c.close()
    client.close()
    return {
        "pollers": pollers,
        "mode": mode,
        "shards": shards,
        "wait_s": wait_s,
        "handed_out": len(set(got)),
        "published": publishes,
        "script_calls_per_record": round(busy["scripts"] / publishes, 2),
        "script_calls_per_record_beyond_idle": round((busy["scripts"] - quiet["scripts"] / idle_s * window_s)
                                                     / publishes, 2),
        "xread_per_record": round(busy["xread"] / publishes, 2),
        "xreadgroup_per_record": round(busy["xreadgroup"] / publishes, 2),
        "bzpopmin_per_record": round(busy["bzpopmin"] / publishes, 2),
        "commands_per_record": round(busy["commands"] / publishes, 2),
        "idle_script_calls_per_s": round(quiet["scripts"] / idle_s, 2),
        # client-sent calls (script calls, blocking reads and waits on the bell; not the
        # commands the scripts run inside) per poller per wait period
        "idle_calls_per_wait_per_poller": round(sum(quiet[k] for k in ("scripts", "xread", "xreadgroup", "bzpopmin"))
                                                / idle_s * wait_s / pollers, 3),
        "idle_commands_per_s_per_poller": round(quiet["commands"] / idle_s / pollers, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pollers", default="10,100,500")
    parser.add_argument("--mode", choices=("poll", "sharded"), default="poll")
    parser.add_argument("--shards", type=int, default=1, help="the stream's shards (above 1: --mode sharded)")
    parser.add_argument("--publishes", type=int, default=20)
    parser.add_argument("--gap-s", type=float, default=0.25)
    parser.add_argument("--idle-s", type=float, default=4.0)
    parser.add_argument("--wait-s", type=float, default=2.0,
                        help="each poll's wait (longer than the publishing window: no wait ends inside it)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    with RedisServer(extra=("--maxclients", "2000")) as server:
        url = f"redis://127.0.0.1:{server.port}"
        import redis

        raw = redis.Redis(port=server.port)
        for i, k in enumerate(int(x) for x in args.pollers.split(",")):
            rows.append(fleet(k, args.mode, args.publishes, args.gap_s, args.idle_s, url, raw, f"s{i}",
                              args.wait_s, args.shards))
            print(rows[-1], file=sys.stderr)
        raw.close()
    emit({"bench": "fleet", "command": " ".join(sys.argv), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
