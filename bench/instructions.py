"""Server cost in CPU instructions: redis-server under valgrind's callgrind.

Counts the instructions redis-server executes (user space: command parsing, the scripts,
replies) for the same work done by felix-redis and by raw Redis Streams commands:

- a drain batch: ``group_poll(max_records=B, ack=the previous batch)`` (and, for
  comparison, ``group_poll`` + ``group_ack_many`` as two calls) against
  ``XREADGROUP COUNT B`` + ``XACK``, for each B given;
- one ``publish`` against one ``XADD``; beside them a plain publish (a client made with
  ``idempotent_publish=False``), an empty function call, and a function doing only what
  a publish with dense offsets must (role check, ``HMGET`` of the tail, ``TIME``,
  ``XADD``, ``HSET`` of the tail): what any publish script costs at the least;
- beside each drain batch, the least a poll script can do: ``XRANGE`` of B entries
  returned as ``group_poll`` returns records, with no lease, check nor ack (what
  handing records out through Lua costs, whatever else the script does);
- with ``--due ENTRIES``: ``group_poll(16, ack=...)`` handing out delayed records the
  group passed over, once due (from the due index), against the same poll on plain
  records, counted in alternating steps;
- with ``--scheduled N``: ``group_poll(16, ack=...)`` of plain records beside N delayed
  records not yet due (passed over), against the same poll with none;
- with ``--held N``: ``group_poll(16, ack=...)`` while N records stay in flight below the
  group's position (the acks of later records are then remembered in its done runs),
  against the same poll on a group with none held and with the fewest given, counted
  in alternating steps in one server.

Unlike timings, instruction counts repeat exactly for the same binary and inputs,
whatever else the machine is doing, so they show what a change to a script costs or
saves. They are not time: cache misses and the network are not in them (bench/scale.py
measures server time, the main harness throughput).

    python bench/instructions.py [--batch 16 --batch 64] [--batches 100] [--held 100] [--due 20]
        [--scheduled 100000] [--out FILE] [--keep DIR]

Needs ``valgrind`` and ``redis-server`` on PATH. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import felix_redis
from bench.report import emit

T, N, S, G, G2 = "bench", "bench", "jobs", "g", "g2"
PAYLOAD = b"x" * 64
#: The least a publish script can do (KEYS: meta hash, log stream; ARGV: payload), an
#: empty function (what the script call itself costs), and the least a poll script can
#: do (KEYS: a log stream; ARGV: the first entry ID to read, COUNT): read the entries
#: with XRANGE and return them as group_poll does plain records on their first
#: delivery (entry ID, payload each), with no lease, check nor ack: what handing records
#: out through Lua costs.
FLOOR_LIBRARY = """#!lua name=felixbench_floor
redis.register_function('felixbench_empty', function(keys, args) return 1 end)
redis.register_function('felixbench_least_poll', function(keys, args)
  local es = redis.call('XRANGE', keys[1], args[1], '+', 'COUNT', args[2])
  local out, o = {0, -1, 0, 0, #es}, 5
  for i = 1, #es do
    local e = es[i]
    out[o + 1], out[o + 2] = e[1], e[2][2]
    o = o + 2
  end
  return out
end)
redis.register_function('felixbench_publish', function(keys, args)
  if redis.acl_check_cmd then redis.acl_check_cmd('EVALSHA', '0', '1', keys[1] .. ':cap') end
  local m = redis.call('HMGET', keys[1], 'tail', 'max_payload', 'created', 'first')
  local t = redis.call('TIME')
  local ms = t[1] .. string.sub(t[2], 1, 3)
  redis.call('XADD', keys[2], m[1] .. '-' .. ms, 'p', args[1])
  redis.call('HSET', keys[1], 'tail', string.format('%d', tonumber(m[1]) + 1))
  return {tonumber(m[1]), 1, ms, 0, m[4]}
end)
"""


class Callgrind:
    """A redis-server under callgrind whose counting is switched on around each part."""

    def __init__(self, workdir: str, keep: str | None = None) -> None:
        self.keep = keep
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.out = os.path.join(workdir, "callgrind.out")
        self.proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={self.out}",
             "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 60
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server under valgrind did not start") from None
                time.sleep(0.2)

    def _ctl(self, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(self.proc.pid)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)

    def count(self, work: Callable[[], None], name: str) -> int:
        """Instructions redis-server executed while ``work`` ran; with ``keep``, the
        callgrind dump is kept there as ``NAME.callgrind`` (for ``callgrind_annotate``)."""
        before = set(glob.glob(self.out + "*"))
        self._ctl("-z")
        self._ctl("-i", "on")
        work()
        self._ctl("-i", "off")
        self._ctl("-d")
        deadline = time.monotonic() + 30
        while not (new := set(glob.glob(self.out + "*")) - before):
            if time.monotonic() > deadline:
                raise RuntimeError("callgrind wrote no dump")
            time.sleep(0.1)
        total = 0
        for path in new:
            for line in Path(path).read_text().splitlines():
                if line.startswith(("summary:", "totals:")):
                    total = max(total, int(line.split()[1]))
            if self.keep:
                shutil.move(path, os.path.join(self.keep, f"{name}.callgrind"))
            else:
                os.remove(path)
        return total

    def stop(self) -> None:
        with suppress(redis.RedisError):
            redis.Redis.from_url(self.url).shutdown(nosave=True)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def repeat(work: Callable[[], Any], times: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(times):
            work()
    return run


@contextmanager
def server(keep: str | None = None) -> Iterator[Callgrind]:
    with tempfile.TemporaryDirectory(prefix="felix-callgrind-") as workdir:
        cg = Callgrind(workdir, keep)
        try:
            yield cg
        finally:
            cg.stop()


def held_back_counts(cg: Callgrind, client: Any, held_back: tuple[int, ...], rounds: int,
                     steps: int = 5) -> dict[str, Any]:
    """``group_poll(16, ack=the previous batch)`` on groups that hold 0 and each ``n`` of
    ``held_back`` records in flight below their position (polled first, under hour-long
    leases), counted in alternating steps of ``rounds // steps`` polls each, so that
    every group is counted in the same server state (heap, Lua's collector)."""
    sizes = (0, *held_back)
    steps = max(1, min(steps, rounds))
    per_step = max(1, rounds // steps)
    for n in sizes:
        stream = f"held_{n}"
        client.stream_create(T, N, stream)
        client.group_create(T, N, stream, G, visibility_timeout_ms=3_600_000)
        total = n + 16 * (per_step * steps + 10)
        for start in range(0, total, 5000):
            client.publish_batch(T, N, stream, [PAYLOAD] * min(5000, total - start), shard=0)
        kept = 0
        while kept < n:
            kept += len(client.group_poll(T, N, stream, 0, G, max_records=min(1000, n - kept)))
    counts = alternating_polls(cg, client, tuple(f"held_{n}" for n in sizes), steps, per_step)
    per_batch = dict(zip(sizes, counts, strict=True))
    out: dict[str, Any] = {"held_back_none": {"felix_per_batch": round(per_batch[0])}}
    fewest = min(held_back)
    for n in held_back:
        out[f"held_back_{n}"] = {
            "felix_per_batch": round(per_batch[n]),
            "over_none_held": round(per_batch[n] / per_batch[0], 3),
            f"over_{fewest}_held": round(per_batch[n] / per_batch[fewest], 3),
        }
    return out


def alternating_polls(cg: Callgrind, client: Any, streams: tuple[str, ...], steps: int,
                      per_step: int) -> list[float]:
    """Instructions per ``group_poll(16, ack=the previous batch)`` of group G on shard 0
    of each of ``streams``, counted in ``steps`` alternating steps of ``per_step`` polls
    (after 5 uncounted ones each); every poll must hand out 16 records."""
    last: dict[str, list[Any]] = {stream: [] for stream in streams}

    def batch(stream: str) -> Callable[[], None]:
        def run() -> None:
            last[stream][:] = client.group_poll(T, N, stream, 0, G, max_records=16, ack=last[stream])
            if len(last[stream]) != 16:
                raise RuntimeError(f"{stream}: a poll handed out {len(last[stream])} records, not 16")
        return run

    for stream in streams:
        for _ in range(5):
            batch(stream)()
    counted = dict.fromkeys(streams, 0)
    for _ in range(steps):
        for stream in streams:
            counted[stream] += cg.count(repeat(batch(stream), per_step), f"poll_16_{stream}")
    return [counted[stream] / (per_step * steps) for stream in streams]


def due_counts(cg: Callgrind, client: Any, rounds: int, entries: int, steps: int = 5) -> dict[str, Any]:
    """``group_poll(16, ack=the previous batch)`` handing out delayed records the group
    passed over while they were not due (from the due index, written as ``entries``
    batches, each sharing a due time), against the same poll on plain records, counted
    in alternating steps of ``rounds // steps`` polls each."""
    steps = max(1, min(steps, rounds))
    per_step = max(1, rounds // steps)
    total = 16 * (per_step * steps + 10)
    for stream in ("due-plain", "due-passed"):
        client.stream_create(T, N, stream)
        client.group_create(T, N, stream, G)
    client.publish_batch(T, N, "due-plain", [PAYLOAD] * total, shard=0)
    size = -(-total // entries)
    for start in range(0, total, size):
        client.publish_batch(T, N, "due-passed", [PAYLOAD] * min(size, total - start), shard=0, delay=2.0)
    passed_at = time.monotonic()
    if client.group_poll(T, N, "due-passed", 0, G, max_records=10_000):
        raise RuntimeError("a delayed record was handed out before it was due")
    if client.group_describe(T, N, "due-passed", G).shards[0].scheduled != total:
        raise RuntimeError("the group did not pass over every delayed record")
    time.sleep(max(0.0, passed_at + 2.3 - time.monotonic()))
    plain, passed = alternating_polls(cg, client, ("due-plain", "due-passed"), steps, per_step)
    return {"due_passed_over": {"index_entries": entries, "plain_per_batch": round(plain),
                                "passed_over_per_batch": round(passed), "over_plain": round(passed / plain, 3)}}


def scheduled_counts(cg: Callgrind, client: Any, rounds: int, scheduled: int, steps: int = 5) -> dict[str, Any]:
    """``group_poll(16, ack=the previous batch)`` of plain records on a shard that also
    holds ``scheduled`` delayed records not yet due (due over the next hour, in batches of
    100 sharing a due time; the group passed over them), against the same poll on a
    shard with none, counted in alternating steps of ``rounds // steps`` polls each."""
    steps = max(1, min(steps, rounds))
    per_step = max(1, rounds // steps)
    for stream in ("sched-none", "sched-held"):
        client.stream_create(T, N, stream)
        client.group_create(T, N, stream, G)
    for start in range(0, scheduled, 100):
        client.publish_batch(T, N, "sched-held", [PAYLOAD] * min(100, scheduled - start), shard=0,
                             delay=3600 + 3600 * start / scheduled)
    for _ in range(1 + scheduled // 10_000):
        if client.group_poll(T, N, "sched-held", 0, G, max_records=10_000):
            raise RuntimeError("a delayed record was handed out before it was due")
    state = client.group_describe(T, N, "sched-held", G).shards[0]
    if state.pending or state.scheduled != scheduled:
        raise RuntimeError(f"the group did not pass over the delayed records: {state}")
    total = 16 * (per_step * steps + 10)
    for stream in ("sched-none", "sched-held"):
        client.publish_batch(T, N, stream, [PAYLOAD] * total, shard=0)
    none, held = alternating_polls(cg, client, ("sched-none", "sched-held"), steps, per_step)
    return {"poll_with_scheduled": {"scheduled": scheduled, "none_per_batch": round(none),
                                    "scheduled_per_batch": round(held), "over_none": round(held / none, 3)}}


def measure(batches: list[int], rounds: int, functions: bool = True, held_back: tuple[int, ...] = (),
            keep: str | None = None, due_entries: int = 0, scheduled: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {"redis": None, "batches": rounds, "scripts": "FCALL" if functions else "EVALSHA"}
    with server(keep) as cg:
        raw = redis.Redis.from_url(cg.url)
        out["redis"] = raw.info("server")["redis_version"]
        raw.function_load(FLOOR_LIBRARY, replace=True)
        client = felix_redis.connect(cg.url)
        runner = getattr(client, "_runner", None)  # clients before the function library have none
        if runner is not None:
            runner.functions = functions
        else:
            out["scripts"] = "EVALSHA"
        for b in batches:
            stream = f"s{b}"
            client.stream_create(T, N, stream)
            client.group_create(T, N, stream, G)
            client.group_create(T, N, stream, G2)
            total = b * (rounds + 10)
            for start in range(0, total, 5000):
                client.publish_batch(T, N, stream, [PAYLOAD] * min(5000, total - start), shard=0)
            pipe = raw.pipeline(transaction=False)
            for _ in range(total):
                pipe.xadd(f"raw{b}", {"p": PAYLOAD})
            pipe.execute()
            raw.xgroup_create(f"raw{b}", "g", id="0")

            held: list[Any] = []

            def felix_batch(b: int = b, stream: str = stream, held: list[Any] = held) -> None:
                # the acks of the previous batch ride on this poll (one call per batch)
                held[:] = client.group_poll(T, N, stream, 0, G, max_records=b, ack=held)

            def felix_separate(b: int = b, stream: str = stream) -> None:
                # a group of its own: the other's held batch would keep its position back
                records = client.group_poll(T, N, stream, 0, G2, max_records=b)
                client.group_ack_many(T, N, stream, 0, G2, records)

            def raw_batch(b: int = b) -> None:
                reply = raw.xreadgroup("g", "c", {f"raw{b}": ">"}, count=b)
                raw.xack(f"raw{b}", "g", *[entry_id for entry_id, _ in reply[0][1]])

            cursor = ["-"]

            def least_poll(b: int = b, cursor: list[str] = cursor) -> None:
                # the raw stream's entries have the log's shape (one field p); read on from
                # the last one returned (XREADGROUP's reads do not consume them)
                reply = raw.fcall("felixbench_least_poll", 1, f"raw{b}", cursor[0], b)
                cursor[0] = "(" + reply[5 + 2 * (int(reply[4]) - 1)].decode()

            for _ in range(5):  # warm: scripts loaded, keys created
                felix_separate()
                felix_batch()
                raw_batch()
                least_poll()
            felix = cg.count(repeat(felix_batch, rounds), f"poll_{b}") / rounds
            separate = cg.count(repeat(felix_separate, rounds), f"poll_then_ack_{b}") / rounds
            floor = cg.count(repeat(raw_batch, rounds), f"raw_xreadgroup_xack_{b}") / rounds
            least = cg.count(repeat(least_poll, rounds), f"least_poll_{b}") / rounds
            client.group_ack_many(T, N, stream, 0, G, held)
            out[f"drain_batch_{b}"] = {
                "felix_per_batch": round(felix), "raw_per_batch": round(floor),
                "felix_per_job": round(felix / b), "raw_per_job": round(floor / b),
                "felix_over_raw": round(felix / floor, 2),
                "felix_separate_acks_per_batch": round(separate),
                "felix_separate_acks_over_raw": round(separate / floor, 2),
                "least_poll_script_per_batch": round(least), "least_poll_script_per_job": round(least / b),
                "least_poll_script_over_raw": round(least / floor, 2),
            }
        if held_back:
            out.update(held_back_counts(cg, client, held_back, rounds))
        if due_entries:
            out.update(due_counts(cg, client, rounds, due_entries))
        if scheduled:
            out.update(scheduled_counts(cg, client, rounds, scheduled))
        client.stream_create(T, N, "pub")
        publishes = rounds * 3
        felix = cg.count(repeat(lambda: client.publish(T, N, "pub", PAYLOAD), publishes), "publish")
        floor = cg.count(repeat(lambda: raw.xadd("rawpub", {"p": PAYLOAD}), publishes), "raw_xadd")
        plain_client = felix_redis.connect(cg.url, idempotent_publish=False)
        plain_client.publish(T, N, "pub", PAYLOAD)  # settings cached before counting
        plain = cg.count(repeat(lambda: plain_client.publish(T, N, "pub", PAYLOAD), publishes), "publish_plain")
        plain_client.close()
        raw.hset("{floor}:meta", mapping={"tail": 0, "max_payload": 1 << 20, "created": 1, "first": 0})
        for _ in range(5):  # warm: the new library's first calls are not what is counted
            raw.fcall("felixbench_empty", 0)
            raw.fcall("felixbench_publish", 2, "{floor}:meta", "{floor}:log", PAYLOAD)
        # the least of three counts: these calls allocate so little that a step of Lua's
        # collector, paying for garbage earlier parts left, can outweigh them
        empty = min(cg.count(repeat(lambda: raw.fcall("felixbench_empty", 0), publishes), "empty_function")
                    for _ in range(3))
        least = min(cg.count(repeat(lambda: raw.fcall("felixbench_publish", 2, "{floor}:meta", "{floor}:log",
                                                      PAYLOAD), publishes), "least_publish_script")
                    for _ in range(3))
        out["publish"] = {
            "felix_per_call": round(felix / publishes), "raw_per_call": round(floor / publishes),
            "felix_over_raw": round(felix / floor, 2),
            "felix_plain_per_call": round(plain / publishes),
            "empty_function_per_call": round(empty / publishes),
            "least_publish_script_per_call": round(least / publishes),
        }
        client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, action="append", help="records per poll (repeatable; 16 and 64)")
    parser.add_argument("--batches", type=int, default=100, help="batches counted per figure")
    parser.add_argument("--evalsha", action="store_true", help="run the scripts by EVALSHA, not as functions")
    parser.add_argument("--held", type=int, action="append", default=[],
                        help="also count poll(16, ack=...) with this many records in flight below the "
                             "position (repeatable; compared with none held and with the fewest given)")
    parser.add_argument("--due", type=int, default=0, metavar="ENTRIES",
                        help="also count poll(16, ack=...) handing out delayed records the group passed over, "
                             "now due (published as ENTRIES batches, each sharing a due time), against plain ones")
    parser.add_argument("--scheduled", type=int, default=0, metavar="N",
                        help="also count poll(16, ack=...) of plain records beside N delayed records not yet due, "
                             "against the same poll with none")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--keep", metavar="DIR", default=None,
                        help="keep each part's callgrind dump in DIR (NAME.callgrind, for callgrind_annotate; a "
                             "redis-server built with symbols first on PATH names Lua's and Redis's functions)")
    args = parser.parse_args(argv)
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    for tool in ("valgrind", "callgrind_control", "redis-server"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not on PATH")
    emit(measure(args.batch or [16, 64], args.batches, functions=not args.evalsha, held_back=tuple(args.held),
                 keep=args.keep, due_entries=args.due, scheduled=args.scheduled), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
