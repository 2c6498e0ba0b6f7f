"""``felixctl group``: consumer groups, polling, settling claims and dead letters."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, TypeVar

import click

from felix_redis import GroupInfo, Record
from felix_redis.errors import FelixError, NotDelivered
from felix_redis.keys import GROUP_ROLES, SHARD_ROLES
from felix_redis.models import parse_claim
from felixctl.common import (
    ClaimRunner,
    Ctl,
    OperationError,
    by_shard,
    claims_argument,
    confirm,
    emit_json,
    emit_line,
    examples,
    group_argument,
    human_ms,
    output_option,
    parse_claims,
    parse_rate,
    pass_ctl,
    record_json,
    shard_option,
    start_option,
    stream_argument,
    table,
    visible,
    yes_option,
)
from felixctl.records import ESCAPE_NOTE

F = TypeVar("F", bound=Callable[..., Any])
VISIBILITY_HELP = "How long a poll's lease lasts"
MAX_ATTEMPTS_HELP = "Deliveries before a record becomes a dead letter"


def visibility_option(help: str) -> Callable[[F], F]:
    return click.option("--visibility-timeout-ms", type=click.IntRange(min=1), default=None, metavar="MS", help=help)


def max_attempts_option(help: str) -> Callable[[F], F]:
    return click.option("--max-attempts", type=click.IntRange(min=1), default=None, metavar="N", help=help)


RATE_HELP = ("At most COUNT hand-outs per DURATION on each shard, whoever polls (100/1s, 10/m, 5/250ms)")


def rate_option(help: str) -> Callable[[F], F]:
    return click.option("--rate-limit", "rate_limit", default=None, metavar="COUNT/DURATION", help=help)


def rate_text(rate: tuple[int, float] | None) -> str:
    return "none" if rate is None else f"{rate[0]}/{rate[1]:g}s"


@click.group(short_help="Consumer groups: poll, settle claims, dead letters.", epilog=examples(
    "felixctl group create jobs workers --from earliest",
    "felixctl group poll jobs workers --max 5 --wait-ms 5000",
    "felixctl group ack jobs workers 0:15:1",
    "felixctl group describe jobs workers",
))
def group() -> None:
    """Consumer groups: create them, poll and settle records, manage dead letters."""


# -- lifecycle


@group.command("create", epilog=examples(
    "felixctl group create jobs workers --from earliest",
    "felixctl group create orders workers-1 --from latest --visibility-timeout-ms 60000 --max-attempts 3",
    "felixctl group create emails senders --rate-limit 100/1s",
    note="Creating a group that exists already fails with exit status 1.",
))
@stream_argument
@group_argument
@start_option("First record the group hands out: earliest, latest (the next published) or an offset.")
@visibility_option(f"{VISIBILITY_HELP} (default $FELIX_GROUP_VISIBILITY_TIMEOUT_MS or 30000).")
@max_attempts_option(f"{MAX_ATTEMPTS_HELP} (default $FELIX_GROUP_MAX_ATTEMPTS or 5).")
@rate_option(f"{RATE_HELP} (default: no limit).")
@pass_ctl
def create(
    ctl: Ctl, stream: str, group: str, start: str | int, visibility_timeout_ms: int | None,
    max_attempts: int | None, rate_limit: str | None,
) -> None:
    """Create a group (on every shard of STREAM)."""
    ctl.client.group_create(
        *ctl.where(stream), group, start=start, visibility_timeout_ms=visibility_timeout_ms,
        max_attempts=max_attempts, rate_limit=None if rate_limit is None else parse_rate(rate_limit),
    )
    click.echo(visible(f"group {group} created on {ctl.path(stream)} from {start}"))


@group.command("configure", epilog=examples(
    "felixctl group configure jobs workers --visibility-timeout-ms 120000",
    "felixctl group configure jobs workers --max-attempts 10",
    "felixctl group configure jobs workers --rate-limit 100/1s",
    "felixctl group configure jobs workers --rate-limit none",
))
@stream_argument
@group_argument
@visibility_option(f"{VISIBILITY_HELP} (unchanged when not given).")
@max_attempts_option(f"{MAX_ATTEMPTS_HELP} (unchanged when not given).")
@rate_option(f"{RATE_HELP}; 'none' removes the limit (unchanged when not given).")
@pass_ctl
def configure(
    ctl: Ctl, stream: str, group: str, visibility_timeout_ms: int | None, max_attempts: int | None,
    rate_limit: str | None,
) -> None:
    """Change the visibility timeout, attempt bound or rate limit.

    The new values apply to later polls.
    """
    if visibility_timeout_ms is None and max_attempts is None and rate_limit is None:
        raise click.UsageError(
            "nothing to change: give --visibility-timeout-ms, --max-attempts and/or --rate-limit")
    extra: dict[str, Any] = {} if rate_limit is None else {"rate_limit": parse_rate(rate_limit)}
    ctl.client.group_configure(
        *ctl.where(stream), group, visibility_timeout_ms=visibility_timeout_ms, max_attempts=max_attempts, **extra
    )
    info = ctl.client.group_describe(*ctl.where(stream), group)
    click.echo(visible(
        f"group {group} on {ctl.path(stream)}: visibility timeout {info.visibility_timeout_ms} ms, "
        f"max attempts {info.max_attempts}, rate limit {rate_text(info.rate_limit)}"
    ))


@group.command("list", epilog=examples("felixctl group list jobs", "felixctl group list jobs -o json"))
@stream_argument
@output_option()
@pass_ctl
def list_(ctl: Ctl, stream: str, output: str) -> None:
    """List the groups of STREAM."""
    groups = ctl.client.group_list(*ctl.where(stream))
    if output == "json":
        emit_json(groups)
        return
    for name in groups:
        click.echo(visible(name))


@group.command("delete", epilog=examples("felixctl group delete jobs workers --yes"))
@stream_argument
@group_argument
@yes_option
@pass_ctl
def delete(ctl: Ctl, stream: str, group: str, yes: bool) -> None:
    """Delete a group (the records stay in the log).

    Its position, leases and dead letters are gone afterwards.
    """
    confirm(f"Delete group {group} of {ctl.path(stream)} with its position and dead letters?",
            yes=yes, what="group delete")
    ctl.client.group_delete(*ctl.where(stream), group)
    click.echo(visible(f"group {group} deleted from {ctl.path(stream)}"))


def group_json(info: GroupInfo) -> dict[str, Any]:
    return {
        "tenant": info.tenant, "namespace": info.namespace, "stream": info.stream, "group": info.group,
        "visibility_timeout_ms": info.visibility_timeout_ms, "max_attempts": info.max_attempts,
        "unfinished": info.unfinished, "lag": info.lag, "pending": info.pending, "in_flight": info.in_flight,
        "owed": info.owed, "dead": info.dead, "trimmed": info.trimmed, "scheduled": info.scheduled,
        "oldest_unfinished_age_ms": info.oldest_unfinished_age_ms,
        "rate_limit": None if info.rate_limit is None else {
            "count": info.rate_limit[0], "per_seconds": info.rate_limit[1]},
        "shards": [dataclasses.asdict(s) for s in info.shards],
    }


DESCRIBE_HEADERS = ["SHARD", "POSITION", "TAIL", "LAG", "UNFINISHED", "PENDING", "IN-FLIGHT", "OWED", "DEAD",
                    "OLDEST-UNFINISHED"]


def describe_text(info: GroupInfo) -> str:
    """The aligned per-shard table ``group describe`` prints (the demo prints it too);
    a TRIMMED column when retention removed records before the group finished them."""
    trimmed = info.trimmed > 0
    scheduled = info.scheduled > 0
    rows: list[list[object]] = [
        [s.shard, s.position, s.tail, s.lag, s.unfinished, s.pending, *([s.scheduled] if scheduled else []),
         s.in_flight, s.owed, s.dead, *([s.trimmed] if trimmed else []), human_ms(s.oldest_unfinished_age_ms)]
        for s in info.shards
    ]
    if len(info.shards) > 1:
        rows.append(["all", "", sum(s.tail for s in info.shards), info.lag, info.unfinished, info.pending,
                     *([info.scheduled] if scheduled else []), info.in_flight, info.owed, info.dead,
                     *([info.trimmed] if trimmed else []), human_ms(info.oldest_unfinished_age_ms)])
    headers = (DESCRIBE_HEADERS[:6] + (["SCHEDULED"] if scheduled else []) + DESCRIBE_HEADERS[6:-1]
               + (["TRIMMED"] if trimmed else []) + DESCRIBE_HEADERS[-1:])
    head = (
        f"group {info.group} on {info.tenant}/{info.namespace}/{info.stream}: visibility timeout "
        f"{info.visibility_timeout_ms} ms, max attempts {info.max_attempts}"
        + ("" if info.rate_limit is None else f", rate limit {rate_text(info.rate_limit)} per shard")
    )
    return visible(head) + "\n" + table(headers, rows, right=range(len(headers)))


@group.command("describe", epilog=examples(
    "felixctl group describe jobs workers",
    "felixctl group describe jobs workers -o json",
    "felixctl group describe jobs workers --watch 2     # refresh every 2 s until Ctrl-C",
    note="Per shard: POSITION is the first unfinished offset, TAIL the next offset to be published, LAG = TAIL"
    " - POSITION (finished records above a held-back position count too), UNFINISHED = PENDING + IN-"
    "FLIGHT + OWED + SCHEDULED (what is left to do: alert on it and on OLDEST-UNFINISHED), PENDING the "
    "records never delivered, IN-FLIGHT those under a lease, OWED those waiting for redelivery (nacked, "
    "lapsed, redriven, or delayed ones that came due), DEAD the dead letters, TRIMMED (shown when not 0) "
    "records retention removed before the group finished them, SCHEDULED (shown when not 0) delayed "
    "records not yet due. --watch stops on Ctrl-C with exit status 130.",
))
@stream_argument
@group_argument
@output_option()
@click.option("--watch", "watch_s", type=click.FloatRange(min=0.1), default=None, is_flag=False, flag_value=1.0,
              metavar="[SECONDS]", help="Refresh the table in place every SECONDS (default 1) until Ctrl-C.")
@click.option("--count", type=click.IntRange(min=1), default=None,
              help="With --watch: stop after this many refreshes.")
@pass_ctl
def describe(ctl: Ctl, stream: str, group: str, output: str, watch_s: float | None, count: int | None) -> None:
    """Show the group's state on every shard.

    Columns: position, tail, lag, unfinished, pending, in-flight, owed, dead (trimmed
    when not 0) and the age of the oldest unfinished record.
    """
    if count is not None and watch_s is None:
        raise click.UsageError("--count goes with --watch (it says how many refreshes to show)")
    if watch_s is None:
        info = ctl.client.group_describe(*ctl.where(stream), group)
        if output == "json":
            emit_json(group_json(info))
        else:
            click.echo(describe_text(info))
        return
    if output == "json":
        raise click.UsageError("--watch refreshes a table; use it without -o json")
    refreshes = 0
    # Ctrl-C ends it with exit 130, as it ends every felixctl command (felixctl/cli.py)
    while count is None or refreshes < count:
        info = ctl.client.group_describe(*ctl.where(stream), group)
        # home the cursor and clear the screen, then draw: the table is refreshed in place
        click.echo("\x1b[H\x1b[2J" if sys.stdout.isatty() else "", nl=False)
        click.echo(visible(f"{ctl.path(stream)} group {group}, every {watch_s:g} s (Ctrl-C to stop)") + "\n")
        click.echo(describe_text(info))
        refreshes += 1
        if count is None or refreshes < count:
            time.sleep(watch_s)


@group.command("keys", epilog=examples(
    "felixctl group keys jobs workers",
    "redis-cli XLEN \"$(felixctl group keys jobs workers --role log --shard 0)\"",
    note="--role prints one key per shard: give --shard to get the one key a Redis command takes.",
))
@stream_argument
@group_argument
@shard_option("Only this shard's keys.")
@click.option("--role", type=click.Choice([*SHARD_ROLES, "groups", *GROUP_ROLES, "due"]), default=None,
              help="Print only the key(s) of this role, one per line, without the table.")
@output_option()
@pass_ctl
def keys(ctl: Ctl, stream: str, group: str, shard: int | None, role: str | None, output: str) -> None:
    """Print the Redis keys of a group, for redis-cli.

    The keys belong to felix-redis: read them, never write them.
    """
    info = ctl.client.stream_describe(*ctl.where(stream))
    if group not in info.groups:
        raise OperationError(f"group {group} on stream {ctl.path(stream)} does not exist")
    shard_keys = ctl.client.group_keys(*ctl.where(stream), group, shard)
    rows = [(s, r, k) for s, roles in shard_keys.items() for r, k in roles.items()]
    if role is not None:
        rows = [row for row in rows if row[1] == role]
    if output == "json":
        emit_json([{"shard": s, "role": r, "key": k} for s, r, k in rows])
    elif role is not None:
        for _s, _r, k in rows:
            click.echo(visible(k))
    else:
        click.echo(table(["SHARD", "ROLE", "KEY"], rows))


# -- polling


@group.command("poll", epilog=examples(
    "felixctl group poll jobs workers",
    "felixctl group poll jobs workers --max 5 --wait-ms 5000",
    "felixctl group poll jobs workers --shard 0 --consumer w-7 --reclaim",
    note="Prints CLAIM<TAB>payload per record, CLAIM being SHARD:OFFSET:ATTEMPTS; nothing (and exit 0) "
    "when nothing is due. " + ESCAPE_NOTE,
))
@stream_argument
@group_argument
@click.option("--max", "max_records", type=click.IntRange(1, 10_000), default=1, show_default=True,
              help="Most records to take.")
@click.option("--wait-ms", type=click.IntRange(min=0), default=0, show_default=True,
              help="Long-poll: wait this long for a record when nothing is due.")
@shard_option("Poll only this shard (default: all shards in turn).")
@click.option("--consumer", default=None, metavar="NAME", help="Poll as this named consumer.")
@click.option("--reclaim", is_flag=True, help="With --consumer: take back its in-flight records now (attempts + 1).")
@output_option()
@pass_ctl
def poll(
    ctl: Ctl, stream: str, group: str, max_records: int, wait_ms: int, shard: int | None,
    consumer: str | None, reclaim: bool, output: str,
) -> None:
    """Take records under a lease.

    Up to --max records, due redeliveries first, then new ones in offset order.
    """
    if reclaim and consumer is None:
        raise click.UsageError("--reclaim needs --consumer NAME")
    wait = wait_ms / 1000 if wait_ms else None
    client, where = ctl.client, ctl.where(stream)
    records: list[Record]
    if shard is not None:
        if consumer is None:
            records = client.group_poll(*where, shard, group, max_records=max_records, wait=wait)
        else:
            records = client.group_poll_as(*where, shard, group, consumer=consumer, reclaim=reclaim,
                                           max_records=max_records, wait=wait)
    else:
        items = client.group_sharded(*where, group, consumer=consumer, reclaim=reclaim).poll(max_records, wait)
        records = [item.record for item in items]
    if output == "json":
        emit_json([record_json(r, with_claim=True) for r in records])
        return
    for record in records:
        emit_line(record.claim, record.payload)


# -- settling claims


@group.command("ack", epilog=examples(
    "felixctl group ack jobs workers 0:15:1",
    "felixctl group ack jobs workers 0:15:1 1:7:2",
    note="Each claim is settled on its own: a bad one (malformed, never delivered, of a shard the stream "
    "does not have) is reported and does not stop the others; exit 1 when any failed.",
))
@stream_argument
@group_argument
@claims_argument
@pass_ctl
def ack(ctl: Ctl, stream: str, group: str, claims: tuple[str, ...]) -> None:
    """Finish records.

    CLAIM is SHARD:OFFSET:ATTEMPTS as poll printed it (SHARD:OFFSET works too).
    """
    runner = ClaimRunner(ctl.url)
    shards = len(ctl.client.group_describe(*ctl.where(stream), group).shards)  # unknown stream or group: nothing done
    parsed = []
    for text in claims:
        try:
            claim = parse_claim(text, attempts_required=False)
        except FelixError as exc:  # malformed: reported, the others go on
            runner.refuse(visible(text), str(exc))
            continue
        if not 0 <= claim.shard < shards:
            runner.refuse(str(claim), f"shard {claim.shard} does not exist (stream {ctl.path(stream)} has "
                                      f"{shards} shard{'s' if shards != 1 else ''})")
            continue
        parsed.append(claim)
    for shard, group_claims in by_shard(parsed).items():
        outcomes: list[bool | None] = []
        with runner.each(" ".join(str(c) for c in group_claims), len(group_claims)):
            try:
                outcomes = list(ctl.client.group_ack_many(
                    *ctl.where(stream), shard, group, [c.offset for c in group_claims]))
            except NotDelivered as exc:
                # the others were settled: report each claim, count only the undelivered as failed
                outcomes = exc.outcomes
                for claim, outcome in zip(group_claims, outcomes, strict=True):
                    if outcome is None:
                        runner.refuse(str(claim), f"record {claim.offset} has not been delivered to this group",
                                      counted=True)
        for claim, outcome in zip(group_claims, outcomes, strict=False):
            if outcome is not None:
                click.echo(f"acked {claim}" if outcome else f"{claim} was finished already")
    runner.finish()


@group.command("nack", epilog=examples(
    "felixctl group nack jobs workers 0:15:1",
    "felixctl group nack jobs workers 0:15:1 --delay-ms 30000",
))
@stream_argument
@group_argument
@claims_argument
@click.option("--delay-ms", type=click.IntRange(min=0), default=0, show_default=True,
              help="Redeliver no sooner than this.")
@pass_ctl
def nack(ctl: Ctl, stream: str, group: str, claims: tuple[str, ...], delay_ms: int) -> None:
    """Hand records back for redelivery.

    A record whose deliveries reached max attempts becomes a dead letter instead.
    """
    parsed = parse_claims(claims)
    runner = ClaimRunner(ctl.url)
    runner.check(ctl, stream, group, parsed)
    for claim in parsed:
        with runner.each(str(claim)):
            dead = ctl.client.group_nack(*ctl.where(stream), claim.shard, group, str(claim), delay=delay_ms / 1000)
            if dead:
                click.echo(f"{claim} reached max attempts and is now a dead letter")
            else:
                click.echo(f"nacked {claim}" + (f", redelivered in {delay_ms} ms or later" if delay_ms else ""))
    runner.finish()


@group.command("extend", epilog=examples(
    "felixctl group extend jobs workers 0:15:1",
    "felixctl group extend jobs workers 0:15:1 --by-ms 120000",
))
@stream_argument
@group_argument
@claims_argument
@click.option("--by-ms", type=click.IntRange(min=1), default=None, metavar="MS",
              help="Lease ends this long from now (default: the group's visibility timeout).")
@pass_ctl
def extend(ctl: Ctl, stream: str, group: str, claims: tuple[str, ...], by_ms: int | None) -> None:
    """Extend leases, for slow work."""
    parsed = parse_claims(claims)
    runner = ClaimRunner(ctl.url)
    runner.check(ctl, stream, group, parsed)
    by = None if by_ms is None else by_ms / 1000
    for claim in parsed:
        with runner.each(str(claim)):
            until = ctl.client.group_extend(*ctl.where(stream), claim.shard, group, str(claim), by=by)
            when = datetime.fromtimestamp(until / 1000, tz=timezone.utc).isoformat(timespec="milliseconds")
            click.echo(f"extended {claim} until {when}")
    runner.finish()


@group.command("dead-letter", epilog=examples('felixctl group dead-letter jobs workers 0:15:1 --reason "bad card"'))
@stream_argument
@group_argument
@claims_argument
@click.option("--reason", default="", help="Why, kept with the dead letter.")
@pass_ctl
def dead_letter(ctl: Ctl, stream: str, group: str, claims: tuple[str, ...], reason: str) -> None:
    """Make records dead letters now.

    The records stay in the log; redrive makes them owed again.
    """
    parsed = parse_claims(claims)
    runner = ClaimRunner(ctl.url)
    runner.check(ctl, stream, group, parsed)
    for claim in parsed:
        with runner.each(str(claim)):
            ctl.client.group_dead_letter(*ctl.where(stream), claim.shard, group, str(claim), reason=reason)
            click.echo(f"dead-lettered {claim}")
    runner.finish()


# -- dead letters


def _shards(ctl: Ctl, stream: str, shard: int | None) -> list[int]:
    if shard is not None:
        return [shard]
    return list(range(ctl.client.stream_describe(*ctl.where(stream)).shards))


@group.command("dead-letters", epilog=examples(
    "felixctl group dead-letters jobs workers",
    "felixctl group dead-letters jobs workers --payloads -o json",
    note="Text output escapes control characters in reasons (a tab or line break as \\t or \\n), so each dead "
    "letter is one row; -o json gives the exact reasons.",
))
@stream_argument
@group_argument
@shard_option("Only this shard.")
@click.option("--payloads", is_flag=True, help="Also read each record from the log (escaped like poll).")
@output_option()
@pass_ctl
def dead_letters(ctl: Ctl, stream: str, group: str, shard: int | None, payloads: bool, output: str) -> None:
    """List dead letters: SHARD:OFFSET, attempts, when, why."""
    letters = []
    for s in _shards(ctl, stream, shard):
        letters += ctl.client.group_dead_letters(*ctl.where(stream), s, group)
    found: dict[tuple[int, int], Record] = {}
    if payloads:
        for d in letters:
            read = ctl.client.read(*ctl.where(stream), d.shard, d.offset, 1)
            if read and read[0].offset == d.offset:
                found[(d.shard, d.offset)] = read[0]
    if output == "json":
        docs = []
        for d in letters:
            doc: dict[str, Any] = {
                "shard": d.shard, "offset": d.offset, "attempts": d.attempts, "reason": d.reason,
                "dead_at": d.dead_at.isoformat(timespec="milliseconds"),
            }
            if payloads:
                record = found.get((d.shard, d.offset))
                doc.update(record_json(record, with_claim=False) if record else {"payload": None})
            docs.append(doc)
        emit_json(docs)
        return
    if not letters:
        click.echo("no dead letters")
        return
    rows = [[d.claim, d.attempts, d.dead_at.isoformat(timespec="seconds"), d.reason or "-"] for d in letters]
    click.echo(table(["RECORD", "ATTEMPTS", "DEAD-AT", "REASON"], rows, right=[1]))
    if payloads:
        for d in letters:
            record = found.get((d.shard, d.offset))
            if record is None:
                click.echo(f"{d.claim}\t(trimmed from the log)")
            else:
                emit_line(d.claim, record.payload)


def _settle_dead(
    ctl: Ctl, stream: str, group: str, records: tuple[str, ...], everything: bool, shard: int | None,
    yes: bool, verb: str,
) -> None:
    """redrive/discard: the given SHARD:OFFSETs, or every dead letter after confirmation."""
    if everything == bool(records):
        raise click.UsageError("give SHARD:OFFSET arguments or --all (not both)")
    if shard is not None and not everything:
        raise click.UsageError("--shard goes with --all")
    client, where = ctl.client, ctl.where(stream)
    act = client.group_redrive if verb == "redrive" else client.group_discard
    done = {"redrive": "redriven", "discard": "discarded"}[verb]
    total = 0
    if everything:
        shards = _shards(ctl, stream, shard)
        client.group_describe(*where, group)  # unknown group: fail before asking
        scope = f"shard {shard}" if shard is not None else "all shards"
        confirm(f"{verb.capitalize()} every dead letter of group {group} on {ctl.path(stream)} ({scope})?",
                yes=yes, what=f"{verb} --all")
        for s in shards:
            total += act(*where, s, group, None)
        click.echo(f"{done} {total} dead letter{'s' if total != 1 else ''}")
        return
    parsed = parse_claims(records, attempts_required=False)
    runner = ClaimRunner(ctl.url)
    runner.check(ctl, stream, group, parsed)
    for s, claims in by_shard(parsed).items():
        # one script per shard: all of a shard's offsets, or none of them
        with runner.each(f"shard {s}", len(claims)):
            total += act(*where, s, group, [c.offset for c in claims])
    if runner.failed < runner.total:  # on failure alone, only the error line
        click.echo(f"{done} {total} dead letter{'s' if total != 1 else ''}")
    runner.finish()


def _dead_letter_command(verb: str, help: str) -> click.Command:
    """``group redrive`` or ``group discard``: the same arguments, the same checks."""

    @group.command(verb, help=help, epilog=examples(
        f"felixctl group {verb} jobs workers 0:15",
        f"felixctl group {verb} jobs workers --all --yes",
        note="--all asks a person at a terminal for confirmation; run from a script it goes ahead.",
    ))
    @stream_argument
    @group_argument
    @click.argument("records", nargs=-1, metavar="[SHARD:OFFSET]...")
    @click.option("--all", "everything", is_flag=True, help="Every dead letter (asks for confirmation at a terminal).")
    @shard_option("With --all: only this shard.")
    @yes_option
    @pass_ctl
    def command(
        ctl: Ctl, stream: str, group: str, records: tuple[str, ...], everything: bool, shard: int | None, yes: bool
    ) -> None:
        _settle_dead(ctl, stream, group, records, everything, shard, yes, verb)

    return command


redrive = _dead_letter_command(
    "redrive", "Make dead letters owed again (attempts restart).\n\nRun it after the bug is fixed.")
discard = _dead_letter_command("discard", "Drop dead letters for good (the records stay in the log).")
