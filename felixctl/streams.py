"""``felixctl stream``: create, describe, list and delete streams."""

from __future__ import annotations

from typing import Any

import click

from felix_redis.constants import CONSISTENCY_LEVELS, KINDS, RETENTION_MODES
from felix_redis.models import StreamInfo
from felixctl.common import (
    Ctl,
    confirm,
    emit_json,
    examples,
    output_option,
    pass_ctl,
    stream_argument,
    table,
    visible,
    warnings_on_stderr,
    yes_option,
)


@click.group(epilog=examples("felixctl stream create jobs --kind queue --shards 4", "felixctl stream list"))
def stream() -> None:
    """Create, describe, list and delete streams."""


@stream.command(
    "create",
    epilog=examples(
        "felixctl stream create jobs --kind queue --shards 4",
        "felixctl stream create audit --kind stream --retention-max-len 100000",
        "felixctl stream create payments --replication 3 --consistency quorum   # a primary with 2+ replicas",
    ),
)
@stream_argument
@click.option("--kind", type=click.Choice(KINDS), default="queue", show_default=True,
              help="Both are read through groups and by `felixctl sub`; they differ in retention. queue: "
              "--retention-mode decides (safe: never trims what a group has not finished); stream: the "
              "limits always win, as in bounded mode.")
@click.option("--shards", type=click.IntRange(min=1), default=1, show_default=True, help="Number of shards.")
@click.option("--replication", type=click.IntRange(min=1), default=1, show_default=True,
              help="Copies of every write, the primary included.")
@click.option("--consistency", type=click.Choice(CONSISTENCY_LEVELS), default="leader", show_default=True,
              help="leader: acknowledged by the primary; quorum/all: also WAIT for replicas.")
@click.option("--retention-max-len", type=click.IntRange(min=1), default=None, metavar="RECORDS",
              help="Keep at most this many records per shard.")
@click.option("--retention-max-age", type=click.IntRange(min=1), default=None, metavar="SECONDS",
              help="Drop records older than this.")
@click.option("--retention-mode", type=click.Choice(RETENTION_MODES), default="safe", show_default=True,
              help="safe: a queue never trims a record a group has not finished; bounded: the limits win "
              "and groups count the records they lose.")
@click.option("--max-payload", type=click.IntRange(min=1), default=None, metavar="BYTES",
              help="Largest payload accepted (default 1 MiB).")
@click.option("--force", is_flag=True,
              help="Create it even if a shard's primary has fewer copies than --replication now "
              "(e.g. a replica is being rebuilt); writes on a quorum/all stream fail until enough are back.")
@pass_ctl
def create(
    ctl: Ctl, stream: str, kind: str, shards: int, replication: int, consistency: str,
    retention_max_len: int | None, retention_max_age: int | None, retention_mode: str, max_payload: int | None,
    force: bool,
) -> None:
    """Create STREAM (a no-op if it exists with the same settings).

    --replication N is refused when a shard's primary has fewer than N copies now
    (itself and its connected replicas), unless --force."""
    with warnings_on_stderr():
        created = ctl.client.stream_create(
            *ctl.where(stream), kind=kind, shards=shards, replication=replication, consistency=consistency,
            retention_max_len=retention_max_len, retention_max_age=retention_max_age, max_payload=max_payload,
            retention_mode=retention_mode, force=force,
        )
    state = "created" if created else "exists already with the same settings"
    click.echo(f"stream {ctl.path(stream)} {state} ({kind}, {shards} shard{'s' if shards != 1 else ''})")


def stream_json(info: StreamInfo) -> dict[str, Any]:
    return {
        "tenant": info.tenant, "namespace": info.namespace, "stream": info.stream, "kind": info.kind,
        "shards": info.shards, "replication": info.replication, "consistency": info.consistency,
        "retention_max_len": info.retention_max_len, "retention_max_age": info.retention_max_age,
        "retention_mode": info.retention_mode, "max_payload": info.max_payload,
        "created_at": info.created_at.isoformat(timespec="seconds"),
        "groups": info.groups,
        "shard_states": [
            {"shard": s, "first": first, "tail": tail, "records": tail - first, "tag": tag, "slot": slot,
             **({"node": info.nodes[s]} if info.nodes is not None else {})}
            for s, (first, tail, tag, slot) in enumerate(zip(info.firsts, info.tails, info.tags, info.slots,
                                                             strict=True))
        ],
    }


@stream.command("describe", epilog=examples("felixctl stream describe jobs", "felixctl stream describe jobs -o json"))
@stream_argument
@output_option()
@pass_ctl
def describe(ctl: Ctl, stream: str, output: str) -> None:
    """Show STREAM's settings, groups and, per shard, the first and next offset (on a
    Redis Cluster also its hash slot and the node serving it)."""
    info = ctl.client.stream_describe(*ctl.where(stream))
    if output == "json":
        emit_json(stream_json(info))
        return
    retention = []
    if info.retention_max_len:
        retention.append(f"at most {info.retention_max_len} records per shard")
    if info.retention_max_age:
        retention.append(f"at most {info.retention_max_age} s old")
    facts = [
        ("stream", f"{info.tenant}/{info.namespace}/{info.stream}"),
        ("kind", info.kind),
        ("shards", str(info.shards)),
        ("replication", f"{info.replication} (consistency {info.consistency})"),
        ("retention", (", ".join(retention) + f" ({info.retention_mode})") if retention else "none"),
        ("max payload", f"{info.max_payload} bytes"),
        ("created", info.created_at.isoformat(timespec="seconds")),
        ("groups", ", ".join(info.groups) or "-"),
    ]
    width = max(len(k) for k, _ in facts)
    for k, v in facts:
        click.echo(f"{k.ljust(width)}  {visible(str(v))}")
    click.echo()
    rows: list[tuple[Any, ...]] = [
        (s, first, tail, tail - first) for s, (first, tail) in enumerate(zip(info.firsts, info.tails, strict=True))]
    if info.nodes is None:
        click.echo(table(["SHARD", "FIRST", "TAIL", "RECORDS"], rows, right=range(4)))
        return
    # Redis Cluster: where each shard lives now
    rows = [(*row, slot, node) for row, slot, node in zip(rows, info.slots, info.nodes, strict=True)]
    click.echo(table(["SHARD", "FIRST", "TAIL", "RECORDS", "SLOT", "NODE"], rows, right=range(5)))


@stream.command("list", epilog=examples("felixctl stream list", "felixctl stream list --all -o json"))
@click.option("--all", "everywhere", is_flag=True,
              help="Every tenant and namespace, printed as tenant/namespace/stream.")
@output_option()
@pass_ctl
def list_(ctl: Ctl, everywhere: bool, output: str) -> None:
    """List the streams of the tenant and namespace (or all of them)."""
    found = ctl.client.stream_list() if everywhere else ctl.client.stream_list(ctl.tenant, ctl.namespace)
    if output == "json":
        emit_json([{"tenant": t, "namespace": n, "stream": s} for t, n, s in found])
        return
    for t, n, s in found:
        click.echo(visible(f"{t}/{n}/{s}" if everywhere else s))


@stream.command("delete", epilog=examples("felixctl stream delete jobs --yes"))
@stream_argument
@yes_option
@pass_ctl
def delete(ctl: Ctl, stream: str, yes: bool) -> None:
    """Delete STREAM with all its records and groups."""
    confirm(f"Delete stream {ctl.path(stream)} with all its records and groups?", yes=yes, what="stream delete")
    ctl.client.stream_delete(*ctl.where(stream))
    click.echo(f"stream {ctl.path(stream)} deleted")


@stream.command("trim", epilog=examples("felixctl stream trim jobs"))
@stream_argument
@pass_ctl
def trim(ctl: Ctl, stream: str) -> None:
    """Apply STREAM's retention now (publishing also trims as the log grows)."""
    trimmed = ctl.client.stream_trim(*ctl.where(stream))
    click.echo(f"stream {ctl.path(stream)}: {trimmed} record{'s' if trimmed != 1 else ''} trimmed")
