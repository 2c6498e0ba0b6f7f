"""``felixctl schedule`` (set, list and delete recurring schedules) and ``felixctl
scheduler`` (tick them until stopped). docs/schedules.md."""

from __future__ import annotations

import base64
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import click

from felix_redis import FelixError, NotFound, PermissionDenied
from felix_redis.schedules import Schedule
from felixctl.common import (
    Ctl,
    emit_json,
    examples,
    output_option,
    parse_duration,
    parse_headers,
    pass_ctl,
    stream_argument,
    table,
    visible,
)

__all__ = ["schedule", "scheduler"]

log = logging.getLogger("felixctl.scheduler")

def _stdin_payload() -> bytes:
    """All of stdin, with one trailing newline dropped (as pub reads '-')."""
    data: bytes = sys.stdin.buffer.read()
    if data.endswith(b"\r\n"):
        return data[:-2]
    return data[:-1] if data.endswith(b"\n") else data


def _when(s: Schedule) -> str:
    if s.cron is not None:
        return f"{s.cron} ({s.timezone})"
    every = s.every or 0
    return f"every {every:g}s"


def _time(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat(timespec="seconds")


def schedule_json(s: Schedule) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": s.name, "cron": s.cron, "every": s.every, "timezone": s.timezone,
        "next_at": _time(s.next_at), "last_at": _time(s.last_at), "last_offset": s.last_offset,
        "shard": s.shard, "key": s.key, "headers": s.headers,
    }
    try:
        data["payload"] = s.payload.decode("utf-8")
    except UnicodeDecodeError:
        data["payload_base64"] = base64.b64encode(s.payload).decode("ascii")
    return data


@click.group(epilog=examples(
    "felixctl schedule set jobs nightly --cron '0 3 * * *' --tz Europe/Zurich '{\"task\":\"report\"}'",
    "felixctl schedule list jobs",
    "felixctl schedule delete jobs nightly",
    note="A ticker publishes what is due: every worker of the stream, or `felixctl scheduler`.",
))
def schedule() -> None:
    """Recurring schedules: a payload published on a cron expression or every N seconds."""


@schedule.command("set", epilog=examples(
    "felixctl schedule set jobs nightly --cron '0 3 * * *' --tz Europe/Zurich '{\"task\":\"report\"}'",
    "felixctl schedule set jobs heartbeat --every 30s ping",
    "felixctl schedule set jobs invoices --cron '0 9 1 * *' --key billing --header kind=invoice run",
    "echo '{\"task\":\"sync\"}' | felixctl schedule set jobs sync --every 5m -",
    note="The first due time is the first one after now: nothing is published at once. A schedule of "
    "that name is replaced (and starts over). A local time the zone skips (spring forward) does not "
    "fire; one it repeats (fall back) fires once.",
))
@stream_argument
@click.argument("name")
@click.argument("payload")
@click.option("--cron", default=None, metavar="EXPR",
              help="A 5-field cron expression (minute hour day-of-month month day-of-week), in --tz.")
@click.option("--every", default=None, metavar="PERIOD", help="A period: seconds (>= 1), or 30s, 5m, 2h, 1d.")
@click.option("--tz", "timezone", default="UTC", show_default=True, metavar="ZONE",
              help="The IANA time zone --cron is read in, e.g. Europe/Zurich.")
@click.option("--key", default=None, help="The records' key (their shard: crc32(key) % shards).")
@click.option("--header", "headers", multiple=True, metavar="NAME=VALUE",
              help="A header of the records (repeatable); names are 1..128 characters of A-Za-z0-9._-.")
@pass_ctl
def set_(ctl: Ctl, stream: str, name: str, payload: str, cron: str | None, every: str | None, timezone: str,
         key: str | None, headers: tuple[str, ...]) -> None:
    """Publish PAYLOAD to STREAM on a schedule NAME ('-' reads PAYLOAD from stdin).

    Give exactly one of --cron and --every."""
    if (cron is None) == (every is None):
        raise click.UsageError("give exactly one of --cron and --every")
    period = parse_duration(every, "--every") if every is not None else None
    data = _stdin_payload() if payload == "-" else os.fsencode(payload)
    ctl.client.schedule_set(*ctl.where(stream), name, data, cron=cron, every=period, timezone=timezone,
                            key=key, headers=parse_headers(headers))
    found = [s for s in ctl.client.schedule_list(*ctl.where(stream)) if s.name == name]
    nxt = _time(found[0].next_at) if found else None
    click.echo(visible(f"schedule {name} set on {ctl.path(stream)}; next at {nxt or 'never'}"))


@schedule.command("list", epilog=examples("felixctl schedule list jobs", "felixctl schedule list jobs -o json"))
@stream_argument
@output_option()
@pass_ctl
def list_(ctl: Ctl, stream: str, output: str) -> None:
    """List STREAM's schedules: when each is due next, and the last one published."""
    found = ctl.client.schedule_list(*ctl.where(stream))
    if output == "json":
        emit_json([schedule_json(s) for s in found])
        return
    rows = [(s.name, _when(s), _time(s.next_at) or "never", _time(s.last_at) or "-",
             "-" if s.last_offset is None else f"{s.shard}:{s.last_offset}", s.key or "-") for s in found]
    click.echo(table(["NAME", "WHEN", "NEXT", "LAST", "LAST RECORD", "KEY"], rows))


@schedule.command("delete", epilog=examples("felixctl schedule delete jobs nightly"))
@stream_argument
@click.argument("name")
@pass_ctl
def delete(ctl: Ctl, stream: str, name: str) -> None:
    """Delete schedule NAME of STREAM (exit 1 when there is none)."""
    ctl.client.schedule_delete(*ctl.where(stream), name)
    click.echo(visible(f"schedule {name} deleted from {ctl.path(stream)}"))


#: How often ``felixctl scheduler`` reads the list of streams again.
RELIST_S = 30.0


class Scheduler:
    """Ticks the schedules of some streams, each about once per ``interval``, until
    :meth:`stop`; a tick under way is finished first."""

    def __init__(self, ctl: Ctl, streams: Sequence[str], interval: float) -> None:
        self.ctl = ctl
        self.only = list(streams)
        self.interval = interval
        self.stopping = threading.Event()
        self.signal: int | None = None
        self.off: set[tuple[str, str, str]] = set()

    def stop(self, signum: int, _frame: object = None) -> None:
        self.signal = signum
        self.stopping.set()
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal acts at once
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)

    def streams(self) -> list[tuple[str, str, str]]:
        client = self.ctl.client
        if self.only:
            return [self.ctl.where(s) for s in self.only]
        try:
            return client.stream_list()
        except PermissionDenied:  # a tenant's user may read its own registry only
            return client.stream_list(self.ctl.tenant)

    def run(self) -> None:
        listed_at, streams = 0.0, []
        while not self.stopping.is_set():
            if time.monotonic() - listed_at >= RELIST_S:
                streams, listed_at = self.streams(), time.monotonic()
                log.info("ticking the schedules of %d stream(s)", len(streams))
            started = time.monotonic()
            for where in streams:
                if self.stopping.is_set():
                    break
                self.tick(where)
            self.stopping.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def tick(self, where: tuple[str, str, str]) -> None:
        if where in self.off:
            return
        path = "/".join(where)
        try:
            published = self.ctl.client.schedule_tick(*where)
        except (PermissionDenied, NotFound) as exc:
            self.off.add(where)
            log.warning("not ticking %s: %s", path, exc)
            return
        except FelixError as exc:
            log.error("tick of %s failed: %s", path, exc)
            return
        for p in published:
            click.echo(f"{visible(path)}\t{p.shard}:{p.offset}")
        if published:
            sys.stdout.flush()


@click.command(epilog=examples(
    "felixctl scheduler                                  # every stream this Redis user may see",
    "felixctl --tenant acme --namespace prod scheduler --stream jobs --stream reports",
    note="Prints STREAM<TAB>SHARD:OFFSET per record published. SIGTERM stops after the tick under way "
    "(exit 0); Ctrl-C too, with exit 130. Workers tick the streams they consume anyway: run this where "
    "no worker does. See docs/schedules.md.",
))
@click.option("--stream", "streams", multiple=True, metavar="STREAM",
              help="Tick only this stream of the tenant and namespace (repeatable). Default: every stream the "
              "Redis user may list (all tenants, else felixctl's --tenant), read again every 30 s.")
@click.option("--interval", type=click.FloatRange(0.1, 3600), default=1.0, show_default=True,
              metavar="SECONDS", help="How often each stream is ticked.")
@pass_ctl
def scheduler(ctl: Ctl, streams: tuple[str, ...], interval: float) -> None:
    """Publish what the schedules have due, until SIGTERM or SIGINT.

    Any number of schedulers (and workers) may run at once: each due time is published
    once."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="felixctl: scheduler: %(message)s")
    run = Scheduler(ctl, streams, interval)
    previous = {sig: signal.signal(sig, run.stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        run.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if run.signal == signal.SIGINT:
        raise click.exceptions.Exit(130)  # felixctl.cli.INTERRUPTED: Ctrl-C, as for every command
