"""The ``felixctl`` command group: global options, central error handling, entry point."""

from __future__ import annotations

from typing import Any

import click

import felix_redis
from felix_redis.constants import ENV_URL_FILE
from felixctl.common import (
    Ctl,
    as_operation_error,
    choose_url,
    examples,
    namespace_option,
    tenant_option,
    url_option,
)

#: The exit status after Ctrl-C: 128 + SIGINT, as a shell reports a process it interrupted.
INTERRUPTED = 130


class FelixctlGroup(click.Group):
    """The root group: turns expected failures anywhere below it into exit 1 with one
    ``felixctl: error: ...`` line, never a traceback; and Ctrl-C (SIGINT) into exit 130,
    the shell's convention (128 + 2), whichever command it stops (click alone says
    ``Aborted!`` and exits 1)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise click.exceptions.Exit(INTERRUPTED) from None
        except Exception as exc:
            ctl = ctx.find_object(Ctl)
            error = as_operation_error(exc, ctl.known_url if ctl else None)
            if error is None:
                raise
            raise error from None


@click.group(
    cls=FelixctlGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=examples(
        "felixctl demo",
        "felixctl stream create jobs --kind queue --shards 4",
        "felixctl group create jobs workers --from earliest",
        "felixctl pub jobs '{\"order\":42,\"task\":\"send-receipt\"}'",
        "felixctl group poll jobs workers --max 5 --wait-ms 5000",
        "felixctl group ack jobs workers 0:15:1",
        note="Exit status: 0 on success, 1 when an operation fails (one 'felixctl: error: ...' line "
        "on stderr), 2 on a usage error, 130 when Ctrl-C interrupts a command (worker and metrics: 0, "
        "SIGINT is how they stop).",
    ),
)
@url_option(
    "redis://, rediss://, unix://, redis+sentinel://h:26379/service/db, redis+cluster://h:7000 or "
    "memory:// (in this process only). Default: redis://localhost:6379/0. A password missing from the URL "
    "is taken from $FELIX_REDIS_PASSWORD.",
    show_envvar=True,
)
@click.option(
    "--redis-url-file", envvar=ENV_URL_FILE, show_envvar=True, default=None, metavar="PATH",
    help="Read the Redis URL from this file (e.g. a mounted secret), keeping the password off the command "
    "line. Not together with --redis-url; $FELIX_REDIS_URL wins over $FELIX_REDIS_URL_FILE.",
)
@tenant_option("Tenant of the streams addressed.", show_envvar=True)
@namespace_option("Namespace of the streams addressed.", show_envvar=True)
@click.version_option(felix_redis.__version__, "-V", "--version", prog_name="felixctl",
                      message="%(prog)s %(version)s (felix-redis)")
@click.pass_context
def cli(ctx: click.Context, redis_url: str | None, redis_url_file: str | None, tenant: str,
        namespace: str) -> None:
    """Administer felix-redis streams, consumer groups and records.

    A stream is a sharded durable log on Redis; a group hands its records out to
    workers under a lease. Claims look like SHARD:OFFSET:ATTEMPTS (0:15:1).
    """
    ctl = choose_url(ctx, redis_url, redis_url_file)
    ctx.obj = ctl
    ctx.call_on_close(ctl.close)


def _register() -> None:
    from felixctl.acl import acl, install
    from felixctl.dashboard_cmd import dashboard
    from felixctl.demo import demo
    from felixctl.groups import group
    from felixctl.records import pub, sub
    from felixctl.schedules import schedule, scheduler
    from felixctl.streams import stream
    from felixctl.worker_cmd import metrics, worker

    for command in (stream, group, pub, sub, worker, metrics, demo, acl, install, schedule, scheduler, dashboard):
        cli.add_command(command)


_register()


def main() -> None:
    """Console entry point."""
    cli.main(prog_name="felixctl")
