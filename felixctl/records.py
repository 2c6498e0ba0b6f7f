"""``felixctl pub`` and ``felixctl sub``: write records, replay and tail the log."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from dataclasses import dataclass, field
from datetime import datetime
from typing import IO, Any

import click

from felix_redis import FelixError, Published
from felixctl.common import (
    Ctl,
    OperationError,
    emit_json,
    emit_line,
    examples,
    output_option,
    parse_duration,
    parse_headers,
    pass_ctl,
    record_json,
    shard_option,
    start_option,
    stream_argument,
)

ESCAPE_NOTE = (
    "Payloads are printed as they are; one holding a line break or another control character (tab aside) "
    "is written escaped (backslash, newline, tab and carriage return as \\\\, \\n, \\t and \\r, other "
    "control bytes as \\xHH, C1 characters as \\u00HH) so that every record stays on one line and no "
    "payload can steer the terminal. -o json gives the exact payloads."
)


def read_stdin_payload() -> bytes:
    """All of stdin, with one trailing newline dropped."""
    data: bytes = sys.stdin.buffer.read()
    if data.endswith(b"\r\n"):
        return data[:-2]
    return data[:-1] if data.endswith(b"\n") else data


@click.command(
    "pub",
    short_help="Publish a record (or one per line of a file).",
    epilog=examples(
        "felixctl pub jobs '{\"order\":42,\"task\":\"send-receipt\"}'",
        "echo hello | felixctl pub jobs -",
        "felixctl pub jobs --key order-42 'charge-card'",
        "felixctl pub jobs --file tasks.txt",
        "felixctl pub jobs --delay 5m 'send-reminder'",
        "felixctl pub jobs --at 2026-12-24T18:00:00Z --expires-in 1h --header trace=abc 'open-gifts'",
        note="Prints SHARD:OFFSET of the record. With --file, a summary per shard. --delay, --at, "
        "--expires-in and --header apply to every record of the call.",
    ),
)
@stream_argument
@click.argument("payload", required=False)
@click.option("--key", default=None, help="Record key; routes to shard crc32(key) % shards unless --shard is given.")
@shard_option("Publish to this shard (default: by --key, else round-robin).")
@click.option("--file", "file", type=click.File("rb"), default=None, metavar="FILE",
              help="Publish one record per line of FILE ('-' for stdin).")
@click.option("--batch-size", type=click.IntRange(1, 10_000), default=500, show_default=True,
              help="With --file: lines per atomic batch (one batch lands on one shard).")
@click.option("--delay", default=None, metavar="DURATION",
              help="No group hands the record out before this long from now (30s, 5m, 2h, 1d; server clock).")
@click.option("--at", "at", default=None, metavar="TIME",
              help="No group hands the record out before TIME (ISO 8601 with a zone, e.g. 2026-12-24T18:00:00Z).")
@click.option("--expires-in", default=None, metavar="DURATION",
              help="Never handed out after this long from now: a group dead-letters it (reason expired).")
@click.option("--header", "headers", multiple=True, metavar="NAME=VALUE",
              help="A record header (repeatable); names are 1..128 characters of A-Za-z0-9._-.")
@pass_ctl
def pub(
    ctl: Ctl, stream: str, payload: str | None, key: str | None, shard: int | None,
    file: IO[bytes] | None, batch_size: int, delay: str | None, at: str | None, expires_in: str | None,
    headers: tuple[str, ...],
) -> None:
    """Publish PAYLOAD to STREAM ('-' reads it from stdin, one trailing newline dropped)."""
    timing = publish_options(delay, at, expires_in, headers)
    if file is not None:
        if payload is not None:
            raise click.UsageError("give either PAYLOAD or --file, not both")
        publish_file(ctl, stream, file, key, shard, batch_size, timing)
        return
    if payload is None:
        raise click.UsageError("missing PAYLOAD (or '-' for stdin, or --file FILE)")
    data = read_stdin_payload() if payload == "-" else os.fsencode(payload)
    published = ctl.client.publish(*ctl.where(stream), data, shard=shard, key=key, **timing)
    click.echo(f"{published.shard}:{published.offset}")


def publish_options(delay: str | None, at: str | None, expires_in: str | None,
                    headers: tuple[str, ...]) -> dict[str, Any]:
    """The publish keywords of pub's --delay, --at, --expires-in and --header."""
    if delay is not None and at is not None:
        raise click.UsageError("give either --delay or --at, not both")
    out: dict[str, Any] = {}
    if delay is not None:
        out["delay"] = parse_duration(delay, "--delay")
    if at is not None:
        text = at.strip()
        try:
            when = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
        except ValueError:
            raise click.BadParameter(f"{at!r} is not an ISO 8601 time such as 2026-12-24T18:00:00Z",
                                     param_hint="--at") from None
        if when.tzinfo is None:
            raise click.BadParameter(f"{at!r} has no time zone: add Z or an offset such as +01:00",
                                     param_hint="--at")
        out["deliver_at"] = when
    if expires_in is not None:
        out["expires_in"] = parse_duration(expires_in, "--expires-in")
    parsed = parse_headers(headers)
    if parsed is not None:
        out["headers"] = parsed
    return out


@dataclass
class FileSummary:
    """What a --file publish has done so far, per shard."""

    records: int = 0
    batches: int = 0
    ranges: dict[int, tuple[int, int]] = field(default_factory=dict)

    def add(self, published: list[Published]) -> None:
        self.records += len(published)
        self.batches += 1
        for p in published:
            first, _last = self.ranges.get(p.shard, (p.offset, p.offset))
            self.ranges[p.shard] = (min(first, p.offset), p.offset)

    def describe(self) -> str:
        parts = [f"shard {s} offsets {a}..{b}" for s, (a, b) in sorted(self.ranges.items())]
        head = f"published {self.records} record{'s' if self.records != 1 else ''}"
        if not self.records:
            return f"{head}: the file is empty"
        return f"{head} in {self.batches} atomic batch{'es' if self.batches != 1 else ''}: " + ", ".join(parts)


def _file_size(file: IO[bytes]) -> int | None:
    try:
        st = os.fstat(file.fileno())
    except (OSError, ValueError, AttributeError):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def publish_file(
    ctl: Ctl, stream: str, file: IO[bytes], key: str | None, shard: int | None, batch_size: int,
    timing: dict[str, Any],
) -> None:
    """One record per line, ``batch_size`` lines per publish_batch call."""
    summary = FileSummary()
    size = _file_size(file)
    err = sys.stderr
    name = getattr(file, "name", "-")
    line_no = 0

    def flush(batch: list[bytes]) -> None:
        try:
            summary.add(ctl.client.publish_batch(*ctl.where(stream), batch, shard=shard, key=key, **timing))
        except FelixError as exc:
            raise OperationError(
                f"{exc} (published {summary.records} records before this; "
                f"the first line not published is line {line_no - len(batch) + 1})"
            ) from None

    # progress for a person watching; nothing at all in a log or a pipe (click's bar
    # would still print its label there)
    bar: Any = (click.progressbar(length=size or 0, label=f"publishing {name}", file=err, show_eta=False,
                                  show_percent=bool(size)) if _is_terminal(err) else contextlib.nullcontext())
    with bar as progress:
        batch: list[bytes] = []
        for raw in file:
            line_no += 1
            if progress is not None:
                progress.update(len(raw))
            line = raw[:-1] if raw.endswith(b"\n") else raw
            batch.append(line[:-1] if line.endswith(b"\r") else line)
            if len(batch) >= batch_size:
                flush(batch)
                batch = []
        if batch:
            flush(batch)
    click.echo(summary.describe())


@click.command(
    "sub",
    short_help="Replay or tail a stream's log.",
    epilog=examples(
        "felixctl sub jobs                      # replay every shard from its first record",
        "felixctl sub jobs --from latest -f     # print new records as they arrive",
        "felixctl sub jobs --shard 2 --from 100 --max 10",
        note="Prints SHARD:OFFSET<TAB>payload per record. " + ESCAPE_NOTE,
    ),
)
@stream_argument
@start_option("Where to start in every shard read.")
@shard_option("Read only this shard (default: all, one after the other).")
@click.option("-f", "--follow", is_flag=True, help="Keep reading new records until interrupted.")
@click.option("--max", "limit", type=click.IntRange(min=1), default=None, help="Stop after this many records.")
@output_option("json", "jsonl")
@pass_ctl
def sub(
    ctl: Ctl, stream: str, start: str | int, shard: int | None, follow: bool, limit: int | None, output: str,
) -> None:
    """Replay STREAM's log, and with --follow tail it (no group: nothing is acked).

    Records of one shard come in offset order. --follow blocks in Redis until new
    records arrive. -o json prints one JSON array (not with --follow); -o jsonl one JSON
    object per line.
    """
    if follow and output == "json":
        raise click.UsageError("--follow streams records: use -o jsonl instead of -o json")
    shards = None if shard is None else [shard]
    subscription = ctl.client.subscribe(*ctl.where(stream), start=start, shards=shards, batch=500)
    collected: list[dict[str, Any]] = []
    count = 0
    try:
        while limit is None or count < limit:
            records = subscription.poll(block=5.0 if follow else 0)
            if not records and not follow:
                break
            for record in records[: None if limit is None else limit - count]:
                if output == "text":
                    emit_line(f"{record.shard}:{record.offset}", record.payload)
                elif output == "jsonl":
                    emit_json(record_json(record, with_claim=False), compact=True)
                else:
                    collected.append(record_json(record, with_claim=False))
                count += 1
    except KeyboardInterrupt:
        raise click.exceptions.Exit(130) from None
    if output == "json":
        emit_json(collected)
