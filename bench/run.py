"""``python -m bench``: start a private redis-server, run the systems, report.

See docs/benchmarks.md for the method and the latest numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench import report
from bench.core import Config
from bench.driver import Outcome, merge, run_system
from bench.systems import FLOOR, SYSTEMS

DEFAULT_OUT = "bench/results/latest.json"
DEFAULT_CHART = "docs/bench.png"
SMOKE_SYSTEMS = "raw,felix"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument(
        "--systems",
        default="all",
        help=f"comma list or 'all' (default); known: {','.join(SYSTEMS)}",
    )
    p.add_argument("--jobs", type=int, default=20_000, help="no-op jobs per scenario")
    p.add_argument("--repeat", type=int, default=3, help="rounds; the best one is reported")
    p.add_argument(
        "--concurrency",
        type=int,
        default=16,
        help="jobs in flight per worker process (batch size, prefetch, threads)",
    )
    p.add_argument("--batch", type=int, default=100, help="records per pipelined/batch publish")
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds allowed for one enqueue, fill or drain",
    )
    p.add_argument("--latency-samples", type=int, default=500)
    p.add_argument(
        "--latency-budget",
        type=float,
        default=15.0,
        help="seconds allowed for one latency scenario",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help=f"tiny numbers (200 jobs, 1 round, systems {SMOKE_SYSTEMS} unless given)",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON results file")
    p.add_argument("--chart", default=DEFAULT_CHART, help="PNG chart file, or 'none'")
    p.add_argument("--keep-logs", action="store_true", help="keep worker logs (path printed)")
    args = p.parse_args(argv)
    if args.smoke:
        explicit = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        defaults = {
            "--jobs": ("jobs", 200),
            "--repeat": ("repeat", 1),
            "--latency-samples": ("latency_samples", 20),
            "--latency-budget": ("latency_budget", 5.0),
            "--timeout": ("timeout", 30.0),
            "--systems": ("systems", SMOKE_SYSTEMS),
        }
        for flag, (attr, value) in defaults.items():
            if flag not in explicit:
                setattr(args, attr, value)
    return args


def select(spec: str) -> list[str]:
    """System names from ``--systems``; the floor always runs first."""
    names = list(SYSTEMS) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown system(s): {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    return [FLOOR] + [n for n in names if n != FLOOR]


def machine(redis_version: str) -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "redis": redis_version,
    }


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    args = parse_args(given)
    names = select(args.systems)
    from felix_redis.testing.server import RedisServer

    log_dir = tempfile.mkdtemp(prefix="felix-bench-logs-")
    started = time.monotonic()
    load_before = os.getloadavg()
    with RedisServer() as server:
        import redis

        with redis.Redis.from_url(server.url) as r:
            redis_version = str(r.info("server")["redis_version"])
        progress(f"private redis-server {redis_version} at {server.url}")
        cfg = Config(
            redis_url=server.url,
            jobs=args.jobs,
            concurrency=args.concurrency,
            timeout_s=args.timeout,
            latency_samples=args.latency_samples,
            latency_budget_s=args.latency_budget,
            batch=args.batch,
            run_id=f"felixbench-{uuid.uuid4().hex[:8]}",
            log_dir=log_dir,
        )
        # Round-robin, so that a change in the machine's load hits every system alike.
        rounds: dict[str, list[list[Outcome]]] = {name: [] for name in names}
        for rep in range(args.repeat):
            for name in names:
                done = rounds[name]
                if done and all(o.status == "unavailable" and not o.scenario for o in done[0]):
                    continue
                done.append(run_system(name, cfg, progress, f"round {rep + 1}/{args.repeat}"))
        outcomes = [o for name in names for o in merge(rounds[name])]
    rows = report.summarize(outcomes)
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench", shlex.join(given)]).strip(),
        "machine": machine(redis_version),
        "jobs": args.jobs,
        "repeat": args.repeat,
        "concurrency": args.concurrency,
        "batch": args.batch,
        "latency_samples": args.latency_samples,
        "systems": names,
        "wall_s": round(time.monotonic() - started, 1),
        # Other work on the machine skews every number; this says how busy it was.
        "loadavg_1_5_15": {"start": load_before, "end": os.getloadavg()},
    }
    print(report.table(rows))
    out = Path(args.out)
    report.write_json(out, meta, rows)
    progress(f"wrote {out}")
    if args.chart != "none" and report.chart(Path(args.chart), meta, rows):
        progress(f"wrote {args.chart}")
    if args.keep_logs:
        progress(f"worker logs in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
