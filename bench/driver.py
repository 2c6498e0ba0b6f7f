"""Run every scenario of one system in its own process group, reporting as it goes.

The runner starts one driver process per system. The driver calls ``os.setsid()`` so
the runner can kill it together with its worker processes when it stops answering:
a stuck peer becomes a failed row, never a hung run.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from bench.core import CTX, BenchFailure, Config, Sample, Unavailable, kill_group, system_class

Event = tuple[Any, ...]


@dataclass
class Outcome:
    """Everything measured for one (system, scenario)."""

    system: str
    scenario: str
    group: str = ""
    kind: str = "rate"
    floor: str = ""
    status: str = "ok"
    reason: str = ""
    samples: list[Sample] = field(default_factory=list)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())[:400]


def _drive(name: str, cfg: Config, out: Connection) -> None:
    """Driver process body: set up, run every scenario once, clean up."""
    os.setsid()
    try:
        system = system_class(name)(cfg)
        system.setup()
    except Exception as exc:
        out.send(("unavailable", "", _reason(exc)))
        return
    try:
        scenarios = system.scenarios()
        out.send(("plan", [(s.name, s.group, s.kind, s.floor_name) for s in scenarios]))
        for scenario in scenarios:
            out.send(("start", scenario.name))
            try:
                system.reset()
                sample = scenario.run()
            except Unavailable as exc:
                out.send(("unavailable", scenario.name, _reason(exc)))
            except (BenchFailure, Exception) as exc:
                if not isinstance(exc, BenchFailure):
                    traceback.print_exc()
                out.send(("failed", scenario.name, _reason(exc)))
            else:
                out.send(("sample", scenario.name, asdict(sample)))
        system.reset()
    finally:
        try:
            system.close()
        except Exception:
            traceback.print_exc()
        out.send(("end",))


def run_system(name: str, cfg: Config, progress: Callable[[str], None], label: str = "") -> list[Outcome]:
    """One round of one system in a driver process: one :class:`Outcome` per scenario."""
    recv, send = CTX.Pipe(duplex=False)
    proc = CTX.Process(target=_drive, args=(name, cfg, send), name=f"bench-{name}")
    proc.start()
    send.close()
    pid = proc.pid
    assert pid is not None
    outcomes: dict[str, Outcome] = {}
    current = ""
    started = time.monotonic()
    # Each message comes within one fill + one timed run + worker start-up.
    patience = cfg.timeout_s * 3 + 60
    try:
        while True:
            if not recv.poll(patience):
                raise BenchFailure(f"driver silent for {patience:.0f}s, killed")
            try:
                event: Event = recv.recv()
            except EOFError:
                raise BenchFailure(f"driver exited with {proc.exitcode}") from None
            kind = event[0]
            if kind == "end":
                break
            if kind == "plan":
                for scen, group, skind, floor in event[1]:
                    outcomes[scen] = Outcome(name, scen, group, skind, floor)
            elif kind == "start":
                current = event[1]
                progress(f"{name} {current} ({label})" if label else f"{name} {current}")
                started = time.monotonic()
            elif kind == "sample":
                sample = Sample(**event[2])
                outcomes[event[1]].samples.append(sample)
                progress(f"{name} {event[1]}: {describe(sample)} in {time.monotonic() - started:.1f}s")
            elif kind in ("unavailable", "failed"):
                status = kind
                if not event[1]:
                    progress(f"{name}: {status}: {event[2]}")
                    return [Outcome(name, "", status=status, reason=event[2])]
                outcome = outcomes[event[1]]
                outcome.status, outcome.reason = status, event[2]
                progress(f"{name} {event[1]}: {status}: {event[2]}")
    except BenchFailure as exc:
        kill_group(pid)
        progress(f"{name}: {exc}")
        for outcome in outcomes.values():
            if outcome.scenario == current or not outcome.samples:
                outcome.status, outcome.reason = "failed", _reason(exc)
        if not outcomes:
            return [Outcome(name, "", status="failed", reason=_reason(exc))]
    finally:
        proc.join(10)
        if proc.is_alive():
            kill_group(pid)
            proc.join(5)
        recv.close()
    return list(outcomes.values())


def merge(rounds: list[list[Outcome]]) -> list[Outcome]:
    """Join the rounds of one system: samples add up; a row is ok if any round measured it."""
    merged: dict[str, Outcome] = {}
    for outcomes in rounds:
        for o in outcomes:
            into = merged.setdefault(o.scenario, Outcome(o.system, o.scenario, o.group, o.kind, o.floor, o.status))
            into.samples += o.samples
            if o.status != "ok":
                into.status, into.reason = o.status, o.reason
    if len(merged) > 1:
        merged.pop("", None)
    for o in merged.values():
        if o.status != "ok" and o.samples:
            o.status, o.reason = "ok", f"some rounds {o.status}: {o.reason}"
    return list(merged.values())


def describe(sample: Sample) -> str:
    """One short line for the progress log."""
    if sample.latencies_ms:
        from bench.core import percentile

        p50 = percentile(sample.latencies_ms, 0.5)
        p99 = percentile(sample.latencies_ms, 0.99)
        return f"p50 {p50:.2f} ms, p99 {p99:.2f} ms ({sample.jobs} samples)"
    return f"{sample.rate:,.0f}/s"
