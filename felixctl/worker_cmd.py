"""``felixctl worker`` (run a handler over a group) and ``felixctl metrics`` (a Prometheus
exporter for every group). Both take the connection, tenant and namespace from the
main group's context when there is one, else from their own options."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import click

from felix_redis import FelixError
from felix_redis._runtime import is_async_handler
from felix_redis.constants import DEFAULT_GRACE_S, DEFAULT_POLL_WAIT_S
from felix_redis.worker import Backoff
from felixctl.common import (
    Ctl,
    OperationError,
    as_operation_error,
    examples,
    namespace_option,
    tenant_option,
    url_option,
)

__all__ = ["metrics", "worker"]

#: tenant, namespace, stream (or streams in priority order), group
Where = tuple[str, str, str | list[str], str]

_BACKOFF = Backoff()


def _ctl(ctx: click.Context, redis_url: str | None, tenant: str, namespace: str) -> Ctl:
    """The connection and scope the command works in: its own options given on its
    command line win; then the main group's (``felixctl --tenant acme worker ...``);
    then the environment and the defaults."""
    main = ctx.find_object(Ctl)

    def pick(param: str, own: Any, attribute: str) -> Any:
        if main is None or ctx.get_parameter_source(param) == click.core.ParameterSource.COMMANDLINE:
            return own
        value = getattr(main, attribute)
        return own if value is None else value

    return Ctl(pick("redis_url", redis_url, "url"), pick("tenant", tenant, "tenant"),
               pick("namespace", namespace, "namespace"))


def connection_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--redis-url/--tenant/--namespace, for use outside the main group too."""
    fn = namespace_option("Namespace (default: felixctl's --namespace, else $FELIX_NAMESPACE, else 'default').",
                          show_default=False)(fn)
    fn = tenant_option("Tenant (default: felixctl's --tenant, else $FELIX_TENANT, else 'default').",
                       show_default=False)(fn)
    return url_option("Redis URL (default: felixctl's --redis-url, else $FELIX_REDIS_URL).")(fn)


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise click.BadParameter(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def exposure_warning(bound_host: str, bound_port: int, option: str) -> str | None:
    """What to say when metrics are served beyond this machine: any address but a
    loopback one (``:PORT`` and ``0.0.0.0`` are every interface). The metrics name
    tenants, streams and groups, and /metrics has no authentication."""
    try:
        if ipaddress.ip_address(bound_host).is_loopback:
            return None
    except ValueError:
        pass
    where = "every interface" if bound_host in ("0.0.0.0", "::") else bound_host
    return (f"serving metrics on {where} (port {bound_port}), without authentication: whoever reaches "
            f"this port reads the tenant, stream and group names and counts; give {option} "
            f"127.0.0.1:{bound_port} to serve this machine only")


def _setup_logging(level: str) -> None:
    """The worker's own loggers at ``level``; everything else at INFO or above."""
    chosen = logging.getLevelName(level.upper())
    logging.basicConfig(level=max(chosen, logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("felix_redis").setLevel(chosen)


@click.command(epilog=examples(
    "felixctl --tenant acme --namespace prod worker jobs workers myapp.tasks:handle --concurrency 8",
    "felixctl worker jobs workers myapp.tasks:handle --burst          # exit once the queue is drained",
    "felixctl worker jobs workers myapp.tasks:handle --metrics-listen 127.0.0.1:9109",
    "felixctl worker urgent,default,bulk workers myapp.tasks:handle                 # strict priority order",
    "felixctl worker urgent,default,bulk workers myapp.tasks:handle --weights 6,3,1 # shares while all are busy",
    note="MODULE is imported from the current directory too. See docs/worker.md.",
))
@click.argument("stream", metavar="STREAM[,STREAM...]")
@click.argument("group")
@click.argument("handler", metavar="MODULE:FUNCTION")
@click.option("-c", "--concurrency", type=click.IntRange(1, 10_000), default=1, show_default=True,
              help="Most records in flight (threads, or tasks for an async handler).")
@click.option("--consumer", default=None, help="A stable consumer name; a restart takes back its own records.")
@click.option("--shards", default=None, metavar="LIST", help="Poll only these shards, e.g. 0,2,5-7 (default: all; "
              "one stream only).")
@click.option("--weights", default=None, metavar="LIST",
              help="With several streams: one whole-number weight each, e.g. 6,3,1; hand-outs follow them while all "
              "streams are busy (default: strict order, a stream gets only what those before it could not fill).")
@click.option("--burst", is_flag=True, help="Exit once nothing is due and nothing is in flight.")
@click.option("--prefetch", type=click.IntRange(0, 10_000), default=0, show_default=True,
              help="Records one poll fetches in a round trip (0: the free slots); those beyond the free slots "
              "wait, leased, for the next ones, and are released at shutdown.")
@click.option("--grace", "grace_s", type=click.FloatRange(0), default=DEFAULT_GRACE_S, show_default=True,
              help="Seconds running handlers may finish after SIGTERM/SIGINT.")
@click.option("--hard-limit", "hard_limit_s", type=click.FloatRange(0, min_open=True), default=None,
              help="Stop extending the lease of a handler running this many seconds (async: cancel it).")
@click.option("--poll-wait", "poll_wait_s", type=click.FloatRange(0, min_open=True), default=DEFAULT_POLL_WAIT_S,
              show_default=True, help="Seconds one poll waits for records.")
@click.option("--backoff-base", type=click.FloatRange(0), default=_BACKOFF.base_s, show_default=True,
              help="First retry delay, seconds.")
@click.option("--backoff-factor", type=click.FloatRange(1), default=_BACKOFF.factor, show_default=True,
              help="Growth of the retry delay per attempt.")
@click.option("--backoff-max", type=click.FloatRange(0), default=_BACKOFF.max_s, show_default=True,
              help="Largest retry delay, seconds.")
@click.option("--backoff-jitter", type=click.FloatRange(0, 1), default=_BACKOFF.jitter, show_default=True,
              help="Retry delays are shortened by up to this fraction at random.")
@click.option("--metrics-listen", default=None, metavar="HOST:PORT",
              help="Serve this worker's Prometheus metrics here.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              default="INFO", show_default=True, help="DEBUG logs one line per acked job too.")
@connection_options
@click.pass_context
def worker(
    ctx: click.Context, stream: str, group: str, handler: str, concurrency: int, consumer: str | None,
    shards: str | None, weights: str | None, burst: bool, prefetch: int, grace_s: float, hard_limit_s: float | None,
    poll_wait_s: float,
    backoff_base: float, backoff_factor: float, backoff_max: float, backoff_jitter: float,
    metrics_listen: str | None, log_level: str, redis_url: str | None, tenant: str, namespace: str,
) -> None:
    """Run MODULE:FUNCTION for every record of GROUP on STREAM (or on several streams,
    comma-separated, in priority order).

    The function gets a felix_redis.Record. Returning acks the record; raising
    felix_redis.worker.Retry(after=s) retries after s seconds; raising Fatal dead-letters
    it at once; any other exception retries after an exponential backoff, and the last
    allowed attempt ends as a dead letter. An `async def` runs on an asyncio worker.
    SIGTERM or SIGINT stops gracefully (exit 0); a second one exits at once.
    """
    from felix_redis.worker import import_handler, parse_shards

    ctl = _ctl(ctx, redis_url, tenant, namespace)
    _setup_logging(log_level)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = import_handler(handler)
    except (ImportError, AttributeError, ValueError) as exc:
        raise click.BadParameter(f"cannot import {handler}: {exc}", param_hint="MODULE:FUNCTION") from None
    streams: str | list[str] = stream.split(",") if "," in stream else stream
    try:
        shard_list = parse_shards(shards) if shards is not None else None
        weight_list = None if weights is None else _weights(weights, len(streams) if isinstance(streams, list) else 1)
        backoff = Backoff(backoff_base, backoff_factor, backoff_max, backoff_jitter)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    options: dict[str, Any] = dict(
        weights=weight_list,
        concurrency=concurrency, consumer=consumer, shards=shard_list, backoff=backoff, poll_wait_s=poll_wait_s,
        grace_s=grace_s, hard_limit_s=hard_limit_s, burst=burst, prefetch=prefetch,
        metrics=_worker_metrics(metrics_listen),
    )
    where = (ctl.tenant, ctl.namespace, streams, group)
    try:
        if is_async_handler(fn):
            asyncio.run(_run_async(ctl.url, where, fn, options))
        else:
            _run_sync(ctl.url, where, fn, options)
    except (FelixError, ValueError) as exc:
        raise as_operation_error(exc, ctl.known_url) or OperationError(" ".join(str(exc).split())) from None


def _weights(text: str, streams: int) -> list[int]:
    """``--weights 6,3,1``: one whole number per stream (the worker checks their range)."""
    parts = text.split(",")
    if not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--weights takes whole numbers separated by commas, e.g. 6,3,1; got {text!r}")
    if len(parts) != streams:
        raise ValueError(f"--weights needs one weight per stream: {streams} stream(s), {len(parts)} weight(s)")
    return [int(p) for p in parts]


def _worker_metrics(listen: str | None) -> Any:
    if listen is None:
        return None
    try:
        from prometheus_client import start_http_server

        from felix_redis.metrics import default_worker_metrics
    except ImportError:
        raise OperationError("--metrics-listen needs prometheus-client (pip install 'felix-redis[metrics]')") from None
    host, port = _listen(listen)
    try:
        server, _thread = start_http_server(port, host)
    except OSError as exc:
        raise OperationError(f"cannot listen on {listen}: {exc}") from None
    bound_host, bound_port = server.server_address[:2]
    log = logging.getLogger("felix_redis.worker")
    log.info("serving worker metrics on http://%s:%s/metrics", bound_host, bound_port)
    warning = exposure_warning(str(bound_host), int(bound_port), "--metrics-listen")
    if warning:
        log.warning("%s", warning)
    return default_worker_metrics()


def _run_sync(url: str | None, where: Where, fn: Any, options: dict[str, Any]) -> None:
    import felix_redis
    from felix_redis.worker import Worker

    with felix_redis.connect(url) as client:
        Worker(client, *where, fn, **options).run()


async def _run_async(url: str | None, where: Where, fn: Any, options: dict[str, Any]) -> None:
    from felix_redis.aioworker import AsyncWorker
    from felix_redis.asyncio import connect

    async with connect(url) as client:
        await AsyncWorker(client, *where, fn, **options).run()


@click.command(epilog=examples(
    "felixctl metrics                                  # on 127.0.0.1:9108, every stream",
    "felixctl --tenant acme metrics --scope tenant --listen 127.0.0.1:9200",
    "felixctl metrics --listen 127.0.0.1:0             # any free port, printed as HOST:PORT",
    note="Prints the HOST:PORT it serves /metrics on, one line on stdout. See docs/worker.md.",
))
@click.option("--listen", default="127.0.0.1:9108", show_default=True, metavar="HOST:PORT",
              help="Where to serve /metrics (port 0: any free port, printed on start). ':PORT' or "
              "0.0.0.0:PORT serves every interface, with a warning: /metrics has no authentication.")
@click.option("--scope", type=click.Choice(["all", "tenant", "namespace"]), default="all", show_default=True,
              help="Export every stream, those of the tenant, or those of the tenant and namespace.")
@connection_options
@click.pass_context
def metrics(ctx: click.Context, listen: str, scope: str, redis_url: str | None, tenant: str, namespace: str) -> None:
    """Serve Prometheus metrics of every group: per stream, group and shard the unfinished
    records (the number to alert on), the lag, pending, scheduled, owed, in-flight and
    dead-letter counts, the position and the age of the oldest unfinished record. Redis
    is read at each scrape. Stops on SIGTERM/SIGINT."""
    try:
        from felix_redis.metrics import serve
    except ImportError:
        raise OperationError("the exporter needs prometheus-client (pip install 'felix-redis[metrics]')") from None
    ctl = _ctl(ctx, redis_url, tenant, namespace)
    host, port = _listen(listen)
    stop = threading.Event()
    try:
        server, _registry = serve(
            ctl.client, host, port,
            tenant=ctl.tenant if scope != "all" else None,
            namespace=ctl.namespace if scope == "namespace" else None,
        )
    except OSError as exc:
        raise OperationError(f"cannot listen on {listen}: {exc}") from None
    bound_host, bound_port = server.server_address[:2]
    warning = exposure_warning(bound_host, bound_port, "--listen")
    if warning:
        click.echo(f"felixctl: warning: {warning}", err=True)
    # the handlers first: whoever read the address may stop the exporter at once
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        click.echo(f"{bound_host}:{bound_port}")  # once, for people and for scripts (port 0)
        sys.stdout.flush()
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.shutdown()
        ctl.close()


@click.group()
def _standalone() -> None:
    """The worker commands without the rest of felixctl."""


_standalone.add_command(worker)
_standalone.add_command(metrics)

if __name__ == "__main__":
    _standalone(prog_name="felixctl")
