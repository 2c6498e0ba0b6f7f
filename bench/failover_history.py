"""Failover trials checked by history (tests/support/history.py): what each consistency loses.

    python bench/failover_history.py --trials 10

Runs ``--trials`` trials of every (consistency x fault) on a private Sentinel topology
on 127.0.0.1 (a primary, 2 replicas, 3 sentinels; a stream of 2 shards, replication 3;
four client threads that publish, poll, ack, nack and drop, each on its own client
made before the fault): ``kill`` SIGKILLs the primary (it stays dead), ``pause``
SIGSTOPs it until the sentinels promoted a replica, waits half a second and SIGCONTs
it (the sentinels demote it to a replica some seconds later). After each trial the
group is drained and the history is checked. Prints one line per trial and then the
table of docs/operations.md ("Failover: what each consistency loses, measured").

Recovery is per client thread: from the fault until a publish and a poll invoked
after it had both returned ok on that thread's client.

Every process is stopped after each trial; nothing touches the Redis on 6379.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.history import Cell, run_trial, table  # noqa: E402


def code_version() -> str:
    """The commit, and a digest of felix_redis/ and lua/ when they differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--", "felix_redis", "lua")
    if not dirty:
        return commit
    digest = hashlib.sha256()
    for path in sorted([*ROOT.glob("felix_redis/**/*.py"), *ROOT.glob("lua/**/*.lua")]):
        digest.update(path.read_bytes())
    return f"{commit} + uncommitted changes in felix_redis/ or lua/ (sha256 {digest.hexdigest()[:12]})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="trials per (consistency, fault) (default 3)")
    parser.add_argument("--consistency", default="leader,quorum", help="comma-separated (default leader,quorum)")
    parser.add_argument("--faults", default="kill,pause", help="comma-separated: kill, pause (default both)")
    parser.add_argument("--seed", type=int, default=100, help="seed of the first trial (default 100)")
    parser.add_argument("--url-query", default="", help="appended to the clients' URL, e.g. '?socket_timeout=5'")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="redis-server option for every data server (repeatable), e.g. "
                             "--server-arg=--min-replicas-to-write --server-arg=1")
    parser.add_argument("--keep-logs", type=Path, help="copy every trial's server and sentinel logs under this "
                                                        "directory (one subdirectory per trial)")
    parser.add_argument("--json", type=Path, help="write every trial's numbers here")
    parser.add_argument("--verbose", action="store_true", help="print the slow and failed calls around each fault")
    args = parser.parse_args(argv)

    started = time.monotonic()
    version = code_version()
    print(f"code: {version}", flush=True)
    cells: dict[tuple[str, str], Cell] = {}
    rows = []
    for consistency in args.consistency.split(","):
        for fault in args.faults.split(","):
            cell = cells.setdefault((consistency, fault), Cell())
            for i in range(args.trials):
                seed = args.seed + i
                logs = str(args.keep_logs / f"{consistency}-{fault}-{seed}") if args.keep_logs else None
                result = run_trial(consistency, fault, seed=seed, url_query=args.url_query,
                                   server_args=args.server_arg, keep_logs=logs)
                cell.add(result)
                print(result.line(), flush=True)
                for note in result.notes:
                    print(f"    note: {note}", flush=True)
                for leak in result.leaked[:5]:
                    print(f"    leaked: {leak}", flush=True)
                if args.verbose:
                    for line in result.timeline():
                        print(f"    {line}", flush=True)
                violations = result.report.violations()
                for anomaly in violations[:10]:
                    print(f"    VIOLATION {anomaly}", flush=True)
                rows.append({
                    "consistency": consistency, "fault": fault, "seed": seed,
                    "acknowledged": result.report.acknowledged, "lost": result.report.lost,
                    "missing": result.report.missing, "unknown": result.report.unknown,
                    "unknown_landed": result.report.unknown_landed,
                    "violations": [str(a) for a in violations],
                    "explained": dict(result.report.kinds(True)),
                    "recovery": result.recovery, "failover_after": result.failover_after,
                    "resumed_after": result.resumed_after, "demoted_after": result.demoted_after,
                    "isolated_records": result.isolated_records,
                    "isolated_acknowledged": len(result.isolated_acknowledged),
                    "missing_by_phase": dict(result.missing_by_phase),
                    "missing_last_after_resume": result.missing_last_after_resume,
                    "errors": dict(result.errors), "leaked": result.leaked, "stuck": result.stuck,
                    "notes": result.notes, "duration": result.duration,
                })
    took = time.monotonic() - started
    command = "python bench/failover_history.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if code_version() != version:
        version += f"; changed during the run, now {code_version()}"
    print(f"\n{command}\ncode: {version}\n{took / 60:.1f} minutes\n")
    print(table(cells))
    if args.json:
        args.json.write_text(json.dumps({"command": command, "code": version, "seconds": took, "trials": rows},
                                        indent=1))
    return 1 if any(r["violations"] or r["stuck"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
