"""``felixctl dashboard``: the web dashboard (felix_redis.dashboard; docs/dashboard.md)."""

from __future__ import annotations

import signal
import sys

import click

from felix_redis.errors import InvalidArgument
from felixctl.common import Ctl, examples, pass_ctl

ENV_TOKEN = "FELIX_DASHBOARD_TOKEN"


@click.command(epilog=examples(
    "felixctl dashboard                                   # http://127.0.0.1:8421/",
    "felixctl dashboard --read-only --port 9000",
    "FELIX_DASHBOARD_TOKEN=$(cat token) felixctl dashboard --host 0.0.0.0",
    "felixctl --tenant acme dashboard --stream jobs --stream reports",
    note="Shows the streams and groups this Redis user may see; redrive and discard only where its ACL role "
    "allows (group.manage). A non-loopback --host needs --token; every request must then carry it "
    "(Authorization: Bearer TOKEN, or the session cookie the sign-in page sets). Needs the dashboard extra: "
    "pip install 'felix-redis[dashboard]'. See docs/dashboard.md.",
))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8421, show_default=True, help="Port to listen on.")
@click.option("--read-only", is_flag=True, help="Show only: every action (POST) answers 403.")
@click.option("--token", envvar=ENV_TOKEN, show_envvar=True, default=None, metavar="TOKEN",
              help="Require this token on every request (needed off loopback). Prefer the environment variable: "
              "a command line shows in ps.")
@click.option("--stream", "streams", multiple=True, metavar="STREAM",
              help="Show only this stream of the tenant and namespace (repeatable): for a Redis user that may not "
              "list streams. Default: every stream the user may list.")
@click.option("--interval", type=click.FloatRange(1, 300), default=5.0, show_default=True, metavar="SECONDS",
              help="How often the groups are sampled (charts, live numbers).")
@pass_ctl
def dashboard(ctl: Ctl, host: str, port: int, read_only: bool, token: str | None, streams: tuple[str, ...],
              interval: float) -> None:
    """Serve the web dashboard until Ctrl-C or SIGTERM."""
    try:
        import uvicorn

        from felix_redis.dashboard import check_bind, create_app
    except ImportError as exc:
        raise click.ClickException(
            f"the dashboard needs its extra ({exc.name} is missing): pip install 'felix-redis[dashboard]'") from None
    try:
        check_bind(host, token)
    except InvalidArgument as exc:
        raise click.UsageError(str(exc)) from None
    where = [ctl.where(s) for s in streams] or None
    app = create_app(ctl.url, read_only=read_only, token=token, host=host, tenant=ctl.tenant, streams=where,
                     interval=interval)
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"felixctl: dashboard on http://{shown}:{port}/" + (" (read-only)" if read_only else "")
               + (" (token required)" if token else ""), err=True)
    # uvicorn stops gracefully on SIGTERM, then raises it again: exit 0 then, as the worker does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on")
