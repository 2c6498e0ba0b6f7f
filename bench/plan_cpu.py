"""The client's own Python per poll, without the server's time (issue 23): each way of
consuming polls ``--polls`` times while the client's ``_execute`` answers at once with
a reply captured from a real 16-record poll (and 1 for each ack a call carries).

What is left is the plan's and the driver's work per poll (arguments, the sharded
group's rounds, parsing the records, wrapping them, queuing the acks), not the socket's
or Redis': the floor of what a poll costs this process. Ways (one 1-shard stream):

- ``poll-ack``: ``client.group_poll(..., max_records=16, wait=1.0, ack=<previous batch>)``;
- ``sharded``: ``group_sharded(...).poll(16, wait=1.0, ack=<previous batch>)``;
- ``readme``: the README's loop, ``poll(16, wait=1.0)`` then ``ack(item, wait=False)``
  per item.

    python bench/plan_cpu.py [--polls 20000] [--rounds 3] [--out FILE]

Prints one JSON document: usec of client CPU (``time.process_time()``) per poll and per
record, the median over the rounds.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import felix_redis
from bench.report import emit
from bench.runtime_cpu import G, N, T, fill
from felix_redis.plans import Batch, Eval
from felix_redis.testing.server import RedisServer

WAYS = ("poll-ack", "sharded", "readme")
STREAM = "plan-cpu"


def canned(client: felix_redis.Client) -> None:
    """Makes ``client`` answer every poll with a reply captured from a real one."""
    captured: list[Any] = []
    real = client._execute_once

    def capture(op: Any) -> Any:
        reply = real(op)
        captured.append(reply)
        return reply

    client._execute_once = capture  # type: ignore[method-assign]
    prev = client.group_poll(T, N, STREAM, 0, G, max_records=16, wait=1.0)
    client.group_poll(T, N, STREAM, 0, G, max_records=16, wait=1.0, ack=prev)
    reply = captured[-1]
    assert int(reply[4]) == 16, "the captured poll must hand out 16 records"

    def answer(op: Any) -> Any:
        if type(op) is Batch:
            return [answer(e) for e in op.ops]
        if type(op) is Eval and op.script == "group_ack":
            return [1] * len(op.args)
        return reply

    client._execute_once = answer  # type: ignore[method-assign]


def run(way: str, client: felix_redis.Client, polls: int) -> float:
    """Client CPU seconds for ``polls`` polls of ``way``."""
    group = client.group_sharded(T, N, STREAM, G)
    items: list[Any] = []
    cpu = time.process_time()
    if way == "poll-ack":
        for _ in range(polls):
            items = client.group_poll(T, N, STREAM, 0, G, max_records=16, wait=1.0, ack=items)
    elif way == "sharded":
        for _ in range(polls):
            items = group.poll(16, wait=1.0, ack=items)
    else:
        for _ in range(polls):
            for item in group.poll(16, wait=1.0):
                group.ack(item, wait=False)
    cpu = time.process_time() - cpu
    group.close()
    return cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--polls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    per_poll: dict[str, list[float]] = {w: [] for w in WAYS}
    with RedisServer() as server:
        client = felix_redis.connect(server.url)
        fill(client, STREAM, 64, 1)
        canned(client)
        for _ in range(args.rounds):
            for way in WAYS:
                per_poll[way].append(round(run(way, client, args.polls) / args.polls * 1e6, 2))
        client.close()
    emit({
        "bench": "plan_cpu", "command": " ".join(sys.argv), "polls": args.polls, "records_per_poll": 16,
        "ways": {w: {"usec_per_poll": statistics.median(v), "usec_per_record": round(statistics.median(v) / 16, 3),
                     "rounds_usec_per_poll": v} for w, v in per_poll.items()},
    }, args.out)


if __name__ == "__main__":
    main()
