"""What a crash of the Redis process loses under AOF, on private redis-servers.

Redis writes its AOF buffer to the file before it answers, so a killed process keeps
every write it answered: except under ``appendfsync everysec`` while a background
fsync of the file runs. Then Redis holds its writes back (up to 2 s) and answers the
commands anyway; a crash in that window loses writes that were acknowledged. Each
trial counts with INCR on one connection while another thread keeps the disk busy
(writes and fsyncs a scratch file in the server's directory, so the AOF's fsyncs are
slow), SIGKILLs the server, starts it again on its AOF and reads the counter back:
``lost`` is the last answered count less the count it came back with. Three ways:

- ``everysec_during_fsync``: once ``INFO persistence`` shows a background fsync
  pending, 3 more INCRs answered, then the kill at once;
- ``everysec_between_fsyncs``: the same, but the kill waits until it shows none
  (``RedisServer.kill(between_fsyncs=True)``, what tests/test_failover.py does);
- ``always``: ``appendfsync always`` (the write and the fsync precede the answer),
  killed after the same warm-up.

    python bench/aof_loss.py [--trials 6] [--max-s 20] [--out FILE]

Prints one JSON document. An ``everysec`` trial that saw no fsync pending within
``--max-s`` is counted in ``no_fsync_seen`` (a fast disk, a tmpfs) and not killed.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import emit
from felix_redis.testing.server import RedisServer

WAYS = ("everysec_during_fsync", "everysec_between_fsyncs", "always")
WARM_COUNT = 2000  # INCRs before a trial may kill (an fsync has had time to start)
SCRATCH_MB = 64  # written and fsynced again and again while a trial runs


def busy_disk(directory: str, stop: threading.Event) -> None:
    """Writes and fsyncs a scratch file until ``stop``, so fsyncs of the AOF are slow."""
    path = Path(directory) / "scratch"
    block = b"\0" * (1 << 20)
    try:
        while not stop.is_set():
            with path.open("wb") as f:
                for _ in range(SCRATCH_MB):
                    if stop.is_set():
                        break
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
    finally:
        path.unlink(missing_ok=True)


def fsync_pending(conn: redis.Redis) -> bool:
    return int(conn.info("persistence").get("aof_pending_bio_fsync", 0)) != 0


def trial(way: str, max_s: float) -> dict[str, Any]:
    """One kill and restart; ``lost`` answered INCRs, or ``seen: False`` when an
    ``everysec`` trial saw no fsync pending in time (no kill)."""
    fsync = "always" if way == "always" else "everysec"
    server = RedisServer(persistence=True, extra=["--appendonly", "yes", "--appendfsync", fsync, "--save", ""])
    stop = threading.Event()
    disk = threading.Thread(target=busy_disk, args=(server.dir, stop), daemon=True)
    try:
        server.start()
        conn = redis.Redis.from_url(server.url)
        disk.start()
        answered = 0
        deadline = time.monotonic() + max_s
        seen = way == "always"
        while time.monotonic() < deadline:
            answered = int(conn.incr("count"))
            if answered < WARM_COUNT:
                continue
            if not seen and fsync_pending(conn):
                for _ in range(3):
                    answered = int(conn.incr("count"))
                seen = True
            if seen:
                break
        if not seen:
            return {"seen": False}
        server.kill(between_fsyncs=way == "everysec_between_fsyncs")
        conn.close()
        stop.set()
        disk.join()
        server.stop(cleanup=False)
        server.start()
        back = int(redis.Redis.from_url(server.url).get("count") or 0)
        return {"seen": True, "answered": answered, "back": back, "lost": answered - back}
    finally:
        stop.set()
        if disk.is_alive():
            disk.join()
        server.stop()


def measure(trials: int, max_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"trials": trials, "max_s": max_s}
    with RedisServer() as probe:
        out["redis"] = redis.Redis.from_url(probe.url).info("server")["redis_version"]
    for way in WAYS:
        runs = [trial(way, max_s) for _ in range(trials)]
        killed = [r for r in runs if r["seen"]]
        out[way] = {
            "killed": len(killed),
            "no_fsync_seen": len(runs) - len(killed),
            "trials_that_lost_writes": sum(r["lost"] > 0 for r in killed),
            "lost_per_trial": [r["lost"] for r in killed],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=6, help="kills of each way")
    parser.add_argument("--max-s", type=float, default=20.0, help="longest a trial waits for an fsync pending")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    emit(measure(args.trials, args.max_s), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
