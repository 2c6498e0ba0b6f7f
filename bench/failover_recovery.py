"""Recovery times per fault, from repeated runs of the failover matrix.

Runs ``tests/test_failover_matrix.py`` ``--trials`` times (each run: every fault on a
fresh deployment, every public operation on the same client objects) and reads, per
fault and run, what the test records: seconds from the fault to the promotion (for the
standalone restart: to the server answering again), to the first publish that
succeeded on the same client, and to the last library operation done. Prints a table
of median and max per fault, and one JSON document with every figure.

    python bench/failover_recovery.py [--trials 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ("promotion_s", "first_publish_s", "library_done_s")


def one_run() -> dict[str, dict[str, float]]:
    """{fault: {figure: seconds}} of one run of the matrix (a failed fault is left out)."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "matrix.xml"
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
             "tests/test_failover_matrix.py"],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, timeout=1800, check=False,
        )
        out: dict[str, dict[str, float]] = {}
        for case in ET.parse(junit).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                continue
            fault = case.get("name", "").split("[", 1)[-1].rstrip("]")
            props = {p.get("name"): p.get("value") for p in case.iter("property")}
            out[fault] = {name: float(props[name]) for name in FIGURES if props.get(name) is not None}
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    runs: list[dict[str, dict[str, float]]] = []
    started = time.monotonic()
    for trial in range(args.trials):
        runs.append(one_run())
        print(f"run {trial + 1}/{args.trials}: {len(runs[-1])} faults passed", file=sys.stderr, flush=True)
    faults = sorted({f for run in runs for f in run})
    table: dict[str, Any] = {}
    print("| fault | runs | promotion (median / max) | first publish | every library operation done |")
    print("| --- | --- | --- | --- | --- |")
    for fault in faults:
        seen = [run[fault] for run in runs if fault in run]
        row: dict[str, Any] = {"runs": len(seen)}
        cells = []
        for figure in FIGURES:
            values = [s[figure] for s in seen if figure in s]
            row[figure] = {"median": statistics.median(values), "max": max(values), "all": values}
            cells.append(f"{statistics.median(values):.2f} s / {max(values):.2f} s")
        table[fault] = row
        print(f"| {fault} | {len(seen)} of {args.trials} | " + " | ".join(cells) + " |")
    doc = {"trials": args.trials, "seconds": round(time.monotonic() - started), "faults": table}
    text = json.dumps(doc, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
