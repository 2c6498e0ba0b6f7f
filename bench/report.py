"""Turn outcomes into rows: best of N, ratio to the floor, a table, JSON and a chart.

``python -m bench.report RESULTS.json`` prints a saved run as a Markdown table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.core import percentile
from bench.driver import Outcome
from bench.systems import FLOOR

Row = dict[str, Any]


def summarize(outcomes: list[Outcome]) -> list[Row]:
    """One JSON-ready row per (system, scenario), with the best round and its ratio."""
    rows = [_row(o) for o in outcomes]
    floors = {r["scenario"]: r for r in rows if r["system"] == FLOOR and r["status"] == "ok"}
    for row in rows:
        floor = floors.get(row["floor"])
        row["ratio"] = None
        if row["status"] == "ok" and row.get("paired_floor_rate"):
            row["ratio"] = round(row["rate"] / row["paired_floor_rate"], 3)
            continue
        if row["status"] != "ok" or floor is None:
            continue
        if row["kind"] == "latency":
            row["ratio"] = round(row["p50_ms"] / floor["p50_ms"], 3) if floor["p50_ms"] else None
        else:
            row["ratio"] = round(row["rate"] / floor["rate"], 3) if floor["rate"] else None
    return rows


def _row(o: Outcome) -> Row:
    row: Row = {
        "system": o.system,
        "scenario": o.scenario,
        "group": o.group,
        "kind": o.kind,
        "floor": o.floor,
        "status": o.status if o.samples or o.status != "ok" else "failed",
        "reason": o.reason or ("" if o.samples or o.status != "ok" else "no sample"),
        "rounds": len(o.samples),
    }
    if not o.samples:
        return row
    if o.kind == "latency":
        runs = [
            {
                "samples": s.jobs,
                "p50_ms": round(percentile(s.latencies_ms, 0.5), 3),
                "p99_ms": round(percentile(s.latencies_ms, 0.99), 3),
            }
            for s in o.samples
        ]
        best = min(runs, key=lambda r: r["p50_ms"])
        row.update(best)
    else:
        runs = [{"jobs": s.jobs, "seconds": round(s.seconds, 4), "rate": round(s.rate, 1), **s.info} for s in o.samples]
        best = max(runs, key=lambda r: r["rate"])
        row.update(jobs=best["jobs"], seconds=best["seconds"], rate=best["rate"])
        if best.get("paired_floor_rate"):
            # measured beside its own floor (bench/systems/felix.py, measure_paired)
            row["paired_floor_rate"] = best["paired_floor_rate"]
    row["runs"] = runs
    return row


def _cells(r: Row) -> tuple[str, str, str]:
    """Value, ratio and note of one row, as printed."""
    ratio = "" if r.get("ratio") is None else f"{r['ratio']:.3f}x"
    if r["status"] != "ok":
        return "-", ratio, f"{r['status']}: {r['reason']}"
    if r["kind"] == "latency":
        return (
            f"p50 {r['p50_ms']:.2f} ms",
            ratio,
            f"p99 {r['p99_ms']:.2f} ms, {r['samples']} samples",
        )
    note = f"best of {r['rounds']}" + (f"; {r['reason']}" if r["reason"] else "")
    if r.get("paired_floor_rate"):
        note += f"; ratio to XADD in the same slices ({r['paired_floor_rate']:,.0f}/s)"
    return f"{r['rate']:,.0f}", ratio, note


def table(rows: list[Row]) -> str:
    """A fixed-width text table: system, scenario, rate/s (or latency), ratio to floor."""
    lines = [("system", "scenario", "rate/s", "ratio", "note")]
    lines += [(r["system"], r["scenario"] or "-", *_cells(r)) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    out = []
    for i, line in enumerate(lines):
        cells = [line[0].ljust(widths[0]), line[1].ljust(widths[1])]
        cells += [line[2].rjust(widths[2]), line[3].rjust(widths[3]), line[4][:120]]
        out.append("  ".join(cells).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths) + "  ----")
    return "\n".join(out)


def markdown(rows: list[Row]) -> str:
    """The same table as Markdown, for docs/benchmarks.md."""
    out = ["| system | scenario | rate/s | ratio to floor | note |", "|---|---|---:|---:|---|"]
    for r in rows:
        value, ratio, note = _cells(r)
        note = note.replace("|", "/")
        out.append(f"| {r['system']} | {r['scenario'] or '-'} | {value} | {ratio} | {note} |")
    return "\n".join(out)


def emit(result: dict[str, Any], out: str | None) -> None:
    """Prints a standalone measurement (bench/scale.py, bench/instructions.py) as JSON,
    and writes it to ``out`` too when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def write_json(path: Path, meta: dict[str, Any], rows: list[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")


PANELS = (
    ("enqueue", "enqueue (jobs/s)"),
    ("drain-1p", "drain, 1 worker process (jobs/s)"),
    ("drain-2p", "drain, 2 worker processes (jobs/s)"),
    ("latency", "publish-to-handler latency, p50 (labelled) and p99 (light grey), ms"),
)


def _label(row: Row) -> str:
    """``system``, plus the scenario when it is a variant of the panel's scenario."""
    scenario = row["scenario"]
    return row["system"] if scenario == row["group"] else f"{row['system']} ({scenario})"


def _color(row: Row) -> str:
    if row["system"] == FLOOR:
        return "#888888"
    return "#d62728" if row["system"].startswith("felix") else "#1f77b4"


def chart(path: Path, meta: dict[str, Any], rows: list[Row]) -> bool:
    """Draw the PNG chart (2 x 2 panels, log scale); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib not installed, no chart drawn", file=sys.stderr)
        return False
    ok = [r for r in rows if r["status"] == "ok"]
    panels = [(g, t, [r for r in ok if r["group"] == g]) for g, t in PANELS]
    if not any(items for _, _, items in panels):
        return False
    tallest = max(len(items) for _, _, items in panels)
    fig, axes = plt.subplots(2, 2, figsize=(13, max(5.0, 0.5 * tallest + 1.5)), squeeze=False)
    for ax, (group, title, items) in zip(axes.flat, panels, strict=True):
        ax.set_title(title, fontsize=9)
        if not items:
            ax.set_axis_off()
            continue
        ys = list(range(len(items)))
        if group == "latency":
            p50 = [r["p50_ms"] for r in items]
            p99 = [r["p99_ms"] for r in items]
            ax.barh([y - 0.2 for y in ys], p50, 0.4, color=[_color(r) for r in items])
            ax.barh([y + 0.2 for y in ys], p99, 0.4, color="#cccccc")
            values, fmt = p50, "{:.2f} ms"
        else:
            values, fmt = [r["rate"] for r in items], "{:,.0f}/s"
            ax.barh(ys, values, color=[_color(r) for r in items])
        for y, v in zip(ys, values, strict=True):
            ax.annotate(fmt.format(v), (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=6)
        ax.set_xscale("log")
        ax.set_xlim(min(values) / 3, max(values) * 5)
        ax.set_yticks(ys)
        ax.set_yticklabels([_label(r) for r in items], fontsize=7)
        ax.invert_yaxis()
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    machine = meta["machine"]
    fig.suptitle(
        f"felix-redis (red) vs raw Redis Streams (grey) and peers (blue): {meta['jobs']:,} no-op "
        f"jobs, best of {meta['repeat']}; {meta['date'][:10]}, {machine['nproc']} cores, "
        f"Redis {machine['redis']}; log scale",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    """Print a saved results file as Markdown; ``--chart PNG`` redraws its chart."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.report", description=main.__doc__)
    p.add_argument("results", help="a JSON file written by python -m bench")
    p.add_argument("--chart", help="also draw the chart to this PNG")
    args = p.parse_args(argv)
    data = json.loads(Path(args.results).read_text())
    print(markdown(data["results"]))
    if args.chart:
        chart(Path(args.chart), data["meta"], data["results"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
