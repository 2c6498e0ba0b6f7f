"""Scale and server-cost figures of issue 8, on a private redis-server:

- drain rate (one client, poll 64 acking the previous batch) behind a 10,000 and a 1,000,000 backlog;
- Redis memory per waiting job against a raw stream entry with the same payload, and the
  group memory left per finished job;
- Redis CPU per job (INFO commandstats, usec per job) against raw XREADGROUP + XACK, and
  beside them the least a poll script can do (XRANGE into Lua and back, nothing else);
- the cost of a poll with 100,000 dead letters and 10,000 records in flight elsewhere,
  next to raw XREADGROUP + XACK with 10,000 entries pending elsewhere; and, to tell how
  it grows with the number in flight, with 10,000 against 100 in flight elsewhere (both
  hold the group's position back, so both remember later acks as done runs).

Figures that compare server times measure their parts in alternating steps (a few
dozen polls each, the server time of each step read from INFO commandstats before and
after it), so that other load on the machine falls on every part alike.

    python bench/scale.py [--backlog 1000000] [--out bench/results/scale.json]

Prints one JSON document. Every figure is measured in this run; nothing is assumed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import felix_redis
from bench.instructions import FLOOR_LIBRARY
from bench.report import emit
from felix_redis.testing.server import RedisServer

T, N = "scale", "bench"
PAYLOAD = b"x" * 64


def publish(client: felix_redis.Client, stream: str, count: int) -> None:
    for start in range(0, count, 5000):
        client.publish_batch(T, N, stream, [PAYLOAD] * min(5000, count - start), shard=0)


def drain_rate(client: felix_redis.Client, stream: str, jobs: int, separate: bool = False) -> float:
    """Jobs/s for polling and acking ``jobs`` records, 64 at a time: each batch's acks
    ride on the next poll (``ack=``), or, ``separate``, go in a ``group_ack_many`` call
    of their own."""
    done = 0
    records: list[felix_redis.Record] = []
    start = time.perf_counter()
    while done < jobs:
        if separate:
            records = client.group_poll(T, N, stream, 0, "g", max_records=min(64, jobs - done))
            client.group_ack_many(T, N, stream, 0, "g", records)
        else:
            records = client.group_poll(T, N, stream, 0, "g", max_records=min(64, jobs - done), ack=records)
        done += len(records)
    if records and not separate:
        client.group_ack_many(T, N, stream, 0, "g", records)
    return jobs / (time.perf_counter() - start)


SCRIPTS = ("fcall", "evalsha")  # felix-redis scripts: functions, else EVALSHA
RAW = ("xreadgroup", "xack")


def server_usec(raw: redis.Redis, commands: tuple[str, ...]) -> float:
    """Server time (usec, INFO commandstats) spent so far in ``commands``."""
    stats = raw.info("commandstats")
    return float(sum(stats.get(f"cmdstat_{cmd}", {}).get("usec", 0) for cmd in commands))


def alternate(raw: redis.Redis, parts: dict[str, tuple[tuple[str, ...], Callable[[], int]]],
              rounds: int) -> dict[str, tuple[float, int]]:
    """Runs the parts' steps in turn, ``rounds`` times, so that load on the shared
    machine falls on all of them alike; returns each part's server time (usec, the
    commands it names) and the jobs its steps reported."""
    spent = {name: [0.0, 0] for name in parts}
    for _ in range(rounds):
        for name, (commands, step) in parts.items():
            before = server_usec(raw, commands)
            jobs = step()
            spent[name][0] += server_usec(raw, commands) - before
            spent[name][1] += jobs
    return {name: (usec, jobs) for name, (usec, jobs) in spent.items()}


def felix_steps(client: felix_redis.Client, stream: str, group: str, batch: int, polls: int,
                separate: bool = False, last: list[Any] | None = None) -> Callable[[], int]:
    """A step: ``polls`` polls of ``batch`` records, each acking the previous batch
    (``separate``: acking its own batch in a call of its own); returns the jobs polled.
    ``last`` holds the batch still to ack between steps."""
    last = [] if last is None else last

    def step() -> int:
        done = 0
        for _ in range(polls):
            if separate:
                records = client.group_poll(T, N, stream, 0, group, max_records=batch)
                client.group_ack_many(T, N, stream, 0, group, records)
            else:
                last[:] = client.group_poll(T, N, stream, 0, group, max_records=batch, ack=last)
                records = last
            done += len(records)
        return done

    return step


def raw_steps(raw: redis.Redis, key: str, batch: int, polls: int) -> Callable[[], int]:
    """A step: ``polls`` times XREADGROUP COUNT ``batch`` + XACK of what it read."""
    def step() -> int:
        done = 0
        for _ in range(polls):
            reply = raw.xreadgroup("g", "c", {key: ">"}, count=batch)
            ids = [entry[0] for entry in reply[0][1]] if reply else []
            if ids:
                raw.xack(key, "g", *ids)
            done += len(ids)
        return done

    return step


def least_steps(raw: redis.Redis, key: str, batch: int, polls: int) -> Callable[[], int]:
    """A step: ``polls`` calls of the least a poll script can do (bench/instructions.py's
    ``felixbench_least_poll``: ``XRANGE`` of ``batch`` entries of ``key`` returned as
    ``group_poll`` returns plain records, no lease, check nor ack), each from where the
    last one ended; returns the entries returned."""
    cursor = ["-"]

    def step() -> int:
        done = 0
        for _ in range(polls):
            reply = raw.fcall("felixbench_least_poll", 1, key, cursor[0], batch)
            got = int(reply[4])
            if got:
                cursor[0] = "(" + reply[5 + 2 * (got - 1)].decode()
            done += got
        return done

    return step


def measure(backlog: int, small: int = 10_000, jobs: int = 100_000, dead: int = 100_000, held: int = 10_000,
            polls: int = 5000, few: int = 100) -> dict[str, Any]:
    """The figures, for a ``backlog`` against a ``small`` one; memory and CPU over ``jobs``
    records; poll cost with ``dead`` dead letters and ``held`` records in flight, over
    ``polls`` polls (the defaults are the issue's; the test suite runs tiny ones)."""
    out: dict[str, Any] = {"redis": None}
    with RedisServer() as server:
        raw = redis.Redis.from_url(server.url)
        out["redis"] = raw.info("server")["redis_version"]
        client = felix_redis.connect(server.url)
        measure_jobs = min(20_000, jobs // 5 * 5)

        # drain rate behind a small and a large backlog: both streams exist at once and
        # are drained in alternating chunks, so load on the shared machine falls on both
        rounds, chunk = 5, measure_jobs // 5
        sizes = {"backlog_10k": small + measure_jobs + 2_000, "backlog_large": backlog + measure_jobs + 2_000}
        for name, size in sizes.items():
            client.stream_create(T, N, name)
            client.group_create(T, N, name, "g")
            publish(client, name, size)
            drain_rate(client, name, 2_000)  # warm up
        spent = dict.fromkeys(sizes, 0.0)
        for _ in range(rounds):
            for name in sizes:
                spent[name] += chunk / drain_rate(client, name, chunk)
        rates = {name: round(rounds * chunk / spent[name]) for name in sizes}
        for name in sizes:
            client.stream_delete(T, N, name)
        out["drain_rate_10k_backlog"] = rates["backlog_10k"]
        out["drain_rate_large_backlog"] = rates["backlog_large"]
        out["small_backlog"] = small
        out["large_backlog"] = backlog
        out["large_over_small"] = round(rates["backlog_large"] / rates["backlog_10k"], 3)

        # memory per waiting job: felix log vs a raw stream of the same payloads
        client.stream_create(T, N, "mem")
        client.group_create(T, N, "mem", "g")
        publish(client, "mem", jobs)
        pipe = raw.pipeline(transaction=False)
        for i in range(jobs):
            pipe.xadd("raw:mem", {"p": PAYLOAD})
            if i % 5000 == 4999:
                pipe.execute()
        pipe.execute()
        keys = client.group_keys(T, N, "mem", "g")[0]
        felix_log = int(raw.memory_usage(keys["log"], samples=0) or 0)
        raw_log = int(raw.memory_usage("raw:mem", samples=0) or 0)
        group_keys = [k for role, k in keys.items() if role not in ("meta", "log", "groups")]

        def group_bytes() -> int:
            return sum(int(raw.memory_usage(k, samples=0) or 0) for k in group_keys if raw.exists(k))

        before = group_bytes()
        out["bytes_per_waiting_job"] = round(felix_log / jobs, 1)
        out["raw_bytes_per_entry"] = round(raw_log / jobs, 1)
        out["waiting_job_over_raw_entry"] = round(felix_log / raw_log, 3)

        # server CPU per job: felix poll+ack vs raw XREADGROUP COUNT 64 + XACK, in
        # alternating steps of 20 batches; the acks ride on the polls (the fast path),
        # and for comparison (group g2) go in calls of their own
        client.group_create(T, N, "mem", "g2", start="earliest")
        raw.xgroup_create("raw:mem", "g", id="0")
        rounds = max(1, jobs // (64 * 20) - 2)
        unacked: list[Any] = []
        # (and the least poll script over the same raw entries: what handing records out
        # through Lua costs in server time, whatever else a poll does)
        raw.function_load(FLOOR_LIBRARY, replace=True)
        cpu = alternate(raw, {
            "felix": (SCRIPTS, felix_steps(client, "mem", "g", 64, 20, last=unacked)),
            "separate": (SCRIPTS, felix_steps(client, "mem", "g2", 64, 20, separate=True)),
            "raw": (RAW, raw_steps(raw, "raw:mem", 64, 20)),
            "least": (SCRIPTS, least_steps(raw, "raw:mem", 64, 20)),
        }, rounds)
        felix_usec, separate_usec, raw_usec, least_usec = (
            cpu[k][0] / cpu[k][1] for k in ("felix", "separate", "raw", "least"))
        out["cpu_jobs_per_part"] = cpu["felix"][1]
        # the rest of g, and its last batch's acks: the group must keep nothing of them
        client.group_ack_many(T, N, "mem", 0, "g", unacked)
        drain_rate(client, "mem", jobs - cpu["felix"][1])
        out["group_bytes_left_per_finished_job"] = round((group_bytes() - before) / jobs, 3)
        out["redis_usec_per_job"] = round(felix_usec, 3)
        out["raw_redis_usec_per_job"] = round(raw_usec, 3)
        out["redis_cpu_over_raw"] = round(felix_usec / raw_usec, 2)
        out["least_poll_script_usec_per_job"] = round(least_usec, 3)
        out["least_poll_script_over_raw"] = round(least_usec / raw_usec, 2)
        out["redis_usec_per_job_separate_acks"] = round(separate_usec, 3)
        out["redis_cpu_over_raw_separate_acks"] = round(separate_usec / raw_usec, 2)

        # poll cost with many dead letters and many records in flight elsewhere, against
        # the same poll on a stream without them, and (to tell the two apart) with only
        # the dead letters and with only the records in flight; raw Streams likewise
        # (entries pending for another consumer: its PEL, like felix's leases, is a
        # sorted index). All parts are measured in alternating steps of polls // 50 polls
        # (5,000 polls by default: with 1,000 the ratios scattered by 15 % and more between
        # runs on a 2-core virtual machine).
        steps = 50 if polls >= 50 else 1
        shapes = {"plain": (0, 0), "cost": (dead, held), "dead_only": (dead, 0), "held_only": (0, held),
                  "held_few": (0, min(few, held))}
        for stream, (dead_n, held_n) in shapes.items():
            client.stream_create(T, N, stream)
            # leases that outlive the run: the records held in flight must not lapse
            # (and, at max_attempts=1, turn into dead letters) while it is measured
            client.group_create(T, N, stream, "g", max_attempts=1, visibility_timeout_ms=3_600_000)
            publish(client, stream, dead_n + held_n + polls * 16 + 16)
            done = 0
            while done < dead_n:  # dead letters: a nack at max_attempts=1 dead-letters
                records = client.group_poll(T, N, stream, 0, "g", max_records=min(1000, dead_n - done))
                for r in records:
                    client.group_nack(T, N, stream, 0, "g", r)
                done += len(records)
            kept = 0
            while kept < held_n:  # in flight under other leases
                kept += len(client.group_poll(T, N, stream, 0, "g", max_records=min(1000, held_n - kept)))
        info = client.group_describe(T, N, "cost", "g").shards[0]
        out["dead_letters"] = info.dead
        out["in_flight_elsewhere"] = info.in_flight
        pipe = raw.pipeline(transaction=False)
        for key in ("raw:cost", "raw:plain"):
            for _ in range(polls * 16 + 16 + (held if key == "raw:cost" else 0)):
                pipe.xadd(key, {"p": PAYLOAD})
        pipe.execute()
        for key in ("raw:cost", "raw:plain"):
            raw.xgroup_create(key, "g", id="0")
        raw.xreadgroup("g", "other", {"raw:cost": ">"}, count=held)
        parts: dict[str, tuple[tuple[str, ...], Callable[[], int]]] = {
            name: (SCRIPTS, felix_steps(client, name, "g", 16, polls // steps)) for name in shapes}
        parts["raw_plain"] = (RAW, raw_steps(raw, "raw:plain", 16, polls // steps))
        parts["raw_loaded"] = (RAW, raw_steps(raw, "raw:cost", 16, polls // steps))
        cost = alternate(raw, parts, steps)
        per_poll = {name: usec / polls for name, (usec, _jobs) in cost.items()}
        out["poll_ack_usec_plain"] = round(per_poll["plain"], 1)
        out["poll_ack_usec_with_dead_and_in_flight"] = round(per_poll["cost"], 1)
        out["poll_cost_ratio"] = round(per_poll["cost"] / per_poll["plain"], 2)
        out["poll_cost_ratio_dead_only"] = round(per_poll["dead_only"] / per_poll["plain"], 2)
        out["poll_cost_ratio_in_flight_only"] = round(per_poll["held_only"] / per_poll["plain"], 2)
        out["in_flight_few"] = min(few, held)
        out["poll_cost_ratio_in_flight_few"] = round(per_poll["held_few"] / per_poll["plain"], 2)
        out["poll_cost_ratio_in_flight_over_few"] = round(per_poll["held_only"] / per_poll["held_few"], 2)
        out["raw_poll_ack_usec_plain"] = round(per_poll["raw_plain"], 2)
        out["raw_poll_ack_usec_with_pending"] = round(per_poll["raw_loaded"], 2)
        out["raw_poll_cost_ratio"] = round(per_poll["raw_loaded"] / per_poll["raw_plain"], 2)
        client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backlog", type=int, default=1_000_000, help="size of the large backlog")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    emit(measure(args.backlog), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
