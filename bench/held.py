"""What records finished behind a held-back one cost a poll, on a private redis-server.

While one record holds a group's position back, every later record acked must be
remembered as finished until the position passes it. This measures the server time of
``group_poll(16, ack=the previous batch)`` in four groups, in alternating steps (as
bench/scale.py does): none held back; 10,000 records held back; 10,000 held back
behind ``--finished`` records already finished above them; 100 held back behind as
many. Each figure is the server time per poll (INFO commandstats) and its ratio to the
group with none held back.

    python bench/held.py [--finished 200000] [--rounds 200] [--out FILE]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import felix_redis
from bench.report import emit
from bench.scale import SCRIPTS, N, T, alternate, felix_steps, publish
from felix_redis.testing.server import RedisServer

POLLS_PER_STEP = 20


def measure(finished: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"redis": None, "finished": finished, "rounds": rounds}
    shapes = {"none": (0, 0), "held_10000": (10_000, 0), "held_10000_behind_finished": (10_000, finished),
              "held_100_behind_finished": (100, finished)}
    with RedisServer() as server:
        raw = redis.Redis.from_url(server.url)
        out["redis"] = raw.info("server")["redis_version"]
        client = felix_redis.connect(server.url)
        for stream, (held, done) in shapes.items():
            client.stream_create(T, N, stream)
            # leases that outlive the run: held records must not lapse while it is measured
            client.group_create(T, N, stream, "g", visibility_timeout_ms=3_600_000)
            publish(client, stream, held + done + rounds * POLLS_PER_STEP * 16 + 16)
            kept = 0
            while kept < held:
                kept += len(client.group_poll(T, N, stream, 0, "g", max_records=min(1000, held - kept)))
            acked = 0
            while acked < done:
                records = client.group_poll(T, N, stream, 0, "g", max_records=min(1000, done - acked))
                client.group_ack_many(T, N, stream, 0, "g", records)
                acked += len(records)
        parts = {name: (SCRIPTS, felix_steps(client, name, "g", 16, POLLS_PER_STEP)) for name in shapes}
        cost = alternate(raw, parts, rounds)
        polls = rounds * POLLS_PER_STEP
        base = cost["none"][0] / polls
        for name, (usec, _jobs) in cost.items():
            out[name] = {"usec_per_poll": round(usec / polls, 1), "over_none": round(usec / polls / base, 3)}
        client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--finished", type=int, default=200_000, help="records finished above the held ones")
    parser.add_argument("--rounds", type=int, default=200, help="alternating steps of 20 polls per group")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    emit(measure(args.finished, args.rounds), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
