"""The dashboard's web app (Starlette): server-rendered pages that read without
JavaScript, a small script that refreshes them in place and sends the actions, and the
JSON API of the contract. docs/dashboard.md explains it.

Security (docs/dashboard.md, "Security"):

* Bound to loopback unless told otherwise; :func:`check_bind` refuses another address
  without a token.
* With a token, every request carries it (``Authorization: Bearer T``) or the session
  cookie the login form sets: an HMAC of the token, never the token itself, HttpOnly,
  SameSite=Strict. Tokens are compared in constant time.
* Without a token (loopback only), requests must name a loopback host in ``Host``: a
  foreign page cannot reach the dashboard by pointing its own name at 127.0.0.1.
* Actions are JSON POSTs only (``Content-Type: application/json``): a foreign page can
  send neither that nor the token, and a form post is refused. A cross-origin
  ``Origin`` is refused too. ``--read-only`` answers every POST with 403.
* Redis decides the rest: the dashboard acts with the credentials it was given.
* Jinja2 escapes everything from Redis; nothing secret is rendered or logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime, timezone
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

import felix_redis
from felix_redis.asyncio import AsyncClient
from felix_redis.dashboard.board import SERIES, Board, Where, error_text, preview
from felix_redis.errors import ConnectionFailed, FelixError, InvalidArgument, NotFound, PermissionDenied
from felix_redis.keys import check_name
from felix_redis.models import DeadLetter, GroupInfo, Record, StreamInfo, parse_claim

COOKIE = "felix_dashboard"
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
#: The default age (seconds) past which the oldest unfinished record is flagged.
DEFAULT_WARN_S = 300.0
#: Largest JSON body an action takes, and largest sign-in form.
MAX_BODY = 1 << 20
MAX_FORM = 8192
DIGITS = re.compile(r"[0-9]+")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """InvalidArgument unless the address is loopback or a token protects it."""
    if not is_loopback(host) and not token:
        raise InvalidArgument(
            f"--host {host} is not a loopback address: give --token (every request must then carry it), or bind "
            "to 127.0.0.1 and reach the dashboard through an SSH tunnel or a reverse proxy")
    if token is not None and (not token.isascii() or not token.isprintable() or not token
                              or any(c.isspace() for c in token)):
        raise InvalidArgument("--token must be printable ASCII characters without spaces (e.g. the output of "
                              "python -c 'import secrets; print(secrets.token_urlsafe())')")


class Json(JSONResponse):
    """JSON whose strings from Redis may hold surrogates (bytes that are not UTF-8,
    decoded with surrogateescape): written as \\uXXXX escapes, never a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def status_of(exc: BaseException) -> int:
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, NotFound):
        return 404
    if isinstance(exc, PermissionDenied):
        return 403
    if isinstance(exc, ConnectionFailed | OSError):
        return 503
    if isinstance(exc, FelixError):
        return 400
    return 500


def fmt_age(ms: int | None) -> str:
    if ms is None:
        return "-"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{s / 60:.1f} min"
    if s < 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def fmt_time(at: datetime | float | None) -> str:
    if at is None:
        return "-"
    if not isinstance(at, datetime):
        at = datetime.fromtimestamp(at, timezone.utc)
    return at.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def fmt_num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def chart_svg(points: list[tuple[float, float]], width: int = 320, height: int = 90) -> dict[str, Any]:
    """A line chart's SVG coordinates (the template draws it): no chart library, no JS."""
    if not points:
        return {"empty": True, "width": width, "height": height}
    t0, t1 = points[0][0], points[-1][0]
    top = max(v for _, v in points)
    span_t, span_v = (t1 - t0) or 1.0, top or 1.0
    pad = 4
    coords = " ".join(
        f"{pad + (t - t0) / span_t * (width - 2 * pad):.1f},{height - pad - v / span_v * (height - 2 * pad):.1f}"
        for t, v in points)
    return {"empty": False, "width": width, "height": height, "coords": coords, "top": top,
            "last": points[-1][1], "span": fmt_age(int((t1 - t0) * 1000)), "samples": len(points)}


def _group_json(info: GroupInfo) -> dict[str, Any]:
    from felixctl.groups import group_json
    return group_json(info)


def _stream_json(info: StreamInfo) -> dict[str, Any]:
    from felixctl.streams import stream_json
    return stream_json(info)


def _record_json(record: Record) -> dict[str, Any]:
    from felixctl.common import record_json
    return record_json(record, with_claim=False)


class Dashboard:
    """The app's state: the Board, the options, the templates."""

    def __init__(self, board: Board, *, read_only: bool = False, token: str | None = None,
                 host: str = "127.0.0.1", close_client: bool = False) -> None:
        self.board = board
        self.read_only = read_only
        self.token = token
        self.host = host
        self.close_client = close_client
        self.session = (hmac.new(token.encode(), b"felix-dashboard-session", hashlib.sha256).hexdigest()
                        if token else None)
        self.env = Environment(loader=PackageLoader("felix_redis.dashboard", "templates"),
                               autoescape=select_autoescape(default=True, default_for_string=True))
        self.env.globals.update(fmt_age=fmt_age, fmt_time=fmt_time, fmt_num=fmt_num, quote=quote,
                                version=felix_redis.__version__, read_only=read_only)
        self.env.filters["q"] = lambda s: quote(str(s), safe="")

    # -- access

    def authorized(self, request: Request) -> bool:
        if self.token is None:
            return True
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer ") and hmac.compare_digest(header[7:].strip().encode(),
                                                                          self.token.encode()):
            return True
        cookie = request.cookies.get(COOKIE, "")
        return bool(cookie) and self.session is not None and hmac.compare_digest(cookie.encode(),
                                                                                   self.session.encode())

    def host_allowed(self, request: Request) -> bool:
        """Without a token: only a loopback Host (or the address it was bound to)."""
        if self.token is not None:
            return True
        host = request.headers.get("host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return is_loopback(name) or name == self.host

    # -- rendering

    def page(self, request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        fragment = request.headers.get("x-felix-fragment") == "1"
        html = self.env.get_template(template).render(
            request=request, fragment=fragment, interval=self.board.interval, **context)
        # a key or header decoded with surrogateescape (not UTF-8) shows as \\udcff, not a 500
        return HTMLResponse(html.encode("utf-8", "backslashreplace"), status, headers=SECURITY_HEADERS)


SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _where(request: Request) -> Where:
    p = request.path_params
    for key, what in (("tenant", "tenant"), ("namespace", "namespace"), ("stream", "stream")):
        try:
            check_name(p[key], what)
        except InvalidArgument as exc:
            raise ApiError(404, str(exc)) from None
    return p["tenant"], p["namespace"], p["stream"]


def _group(request: Request) -> str:
    try:
        check_name(request.path_params["group"], "group")
    except InvalidArgument as exc:
        raise ApiError(404, str(exc)) from None
    return str(request.path_params["group"])


def _int_param(request: Request, name: str, default: int | None, low: int = 0) -> int | None:
    text = request.query_params.get(name)
    if text is None or text == "":
        return default
    if not DIGITS.fullmatch(text) or len(text) > 19 or int(text) < low:
        raise ApiError(400, f"query parameter {name} must be a whole number >= {low}, got {text[:40]!r}")
    return int(text)


def _warn_s(request: Request) -> float:
    text = request.query_params.get("warn")
    if not text:
        return DEFAULT_WARN_S
    try:
        value = float(text)
    except ValueError:
        raise ApiError(400, f"query parameter warn must be seconds, got {text[:40]!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ApiError(400, f"query parameter warn must be seconds > 0, got {text[:40]!r}")
    return value


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (400) past ``limit`` bytes without reading the rest."""
    declared = request.headers.get("content-length", "")
    if DIGITS.fullmatch(declared) and int(declared) > limit:
        raise ApiError(400, f"the body is larger than {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(400, f"the body is larger than {limit} bytes")
    return bytes(body)


async def _action_body(request: Request) -> list[tuple[int, int]] | None:
    """The (shard, offset)s a redrive/discard body names, or None for ``{"all": true}``."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise ApiError(400, "actions take a JSON body with Content-Type: application/json")
    raw = await read_body(request, MAX_BODY)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ApiError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict) or set(body) - {"records", "all"}:
        raise ApiError(400, 'the body must be {"records": ["SHARD:OFFSET", ...]} or {"all": true}')
    if ("records" in body) == ("all" in body):
        raise ApiError(400, 'give either "records" or "all", not both and not neither')
    if "all" in body:
        if body["all"] is not True:
            raise ApiError(400, '"all" must be true')
        return None
    records = body["records"]
    if not isinstance(records, list) or not records:
        raise ApiError(400, '"records" must be a non-empty list of "SHARD:OFFSET" strings')
    if len(records) > 10_000:
        raise ApiError(400, '"records" holds more than 10000 claims; use {"all": true} or several requests')
    out = []
    for text in records:
        try:
            claim = parse_claim(text, attempts_required=False)
        except InvalidArgument as exc:
            raise ApiError(400, f"records: {exc}") from None
        out.append((claim.shard, claim.offset))
    return list(dict.fromkeys(out))


def build(dash: Dashboard) -> Starlette:
    board = dash.board

    def api(handler: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                return Json(await handler(request), headers={"Cache-Control": "no-store"})
            except (FelixError, OSError, ApiError) as exc:
                return Json({"error": error_text(exc)}, status_of(exc), headers={"Cache-Control": "no-store"})
        return endpoint

    def html(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except (FelixError, OSError, ApiError) as exc:
                return dash.page(request, "error.html", status_of(exc), error=error_text(exc),
                                 code=status_of(exc))
        return endpoint

    # -- JSON API

    async def api_streams(request: Request) -> Any:
        found = await board.streams()
        infos = await asyncio.gather(*(board.stream(w) for w in found), return_exceptions=True)
        out: list[dict[str, Any]] = []
        for (t, n, s), info in zip(found, infos, strict=True):
            if isinstance(info, NotFound):
                continue  # deleted while listed
            if isinstance(info, BaseException):
                out.append({"tenant": t, "namespace": n, "stream": s, "kind": None, "shards": None,
                            "error": error_text(info)})
                continue
            out.append({"tenant": t, "namespace": n, "stream": s, "kind": info.kind, "shards": info.shards,
                        "retention_max_len": info.retention_max_len, "retention_max_age": info.retention_max_age})
        return out

    async def api_stream(request: Request) -> Any:
        return _stream_json(await board.stream(_where(request)))

    async def api_group(request: Request) -> Any:
        return _group_json(await board.group(_where(request), _group(request)))

    async def dead_letters(request: Request) -> tuple[Where, str, str | None, list[tuple[DeadLetter, Record | None]],
                                                       int]:
        """The path's stream and group, the reason filter, the dead letters and their count."""
        where, group = _where(request), _group(request)
        reason = request.query_params.get("reason") or None
        letters, total = await board.dead_letters(where, group, reason=reason)
        return where, group, reason, letters, total

    async def api_dead(request: Request) -> Any:
        *_, letters, total = await dead_letters(request)
        out = []
        for d, record in letters:
            doc: dict[str, Any] = {"shard": d.shard, "offset": d.offset, "record": d.claim, "attempts": d.attempts,
                                   "reason": d.reason, "dead_at": d.dead_at.isoformat(timespec="milliseconds")}
            if record is not None:
                text, is_hex, cut = preview(record.payload)
                doc.update({"payload_preview": text, "payload_hex": is_hex, "payload_cut": cut,
                            "payload_size": len(record.payload), "headers": record.headers})
            else:
                doc.update({"payload_preview": None, "trimmed": True})
            out.append(doc)
        return out if total == len(out) else {"dead_letters": out, "total": total}

    def action(verb: str) -> Callable[[Request], Awaitable[Any]]:
        done = {"redrive": "redriven", "discard": "discarded"}[verb]

        async def act(request: Request) -> Any:
            if dash.read_only:
                raise ApiError(403, "this dashboard is read-only (--read-only)")
            where, group = _where(request), _group(request)
            claims = await _action_body(request)
            return {done: await board.settle(where, group, verb, claims)}
        return act

    async def api_records(request: Request) -> Any:
        where = _where(request)
        shard = _int_param(request, "shard", 0)
        info, records, start = await board.records(where, shard or 0, _int_param(request, "from", None))
        return {"shard": shard, "from": start, "first": info.firsts[shard or 0], "tail": info.tails[shard or 0],
                "records": [_record_json(r) for r in records]}

    async def health(request: Request) -> Any:
        await board.probe()
        return {"ok": True}

    # -- pages

    async def overview(request: Request) -> Response:
        warn = _warn_s(request)
        snap = await board.overview()
        groups = []
        for row in snap.rows:
            for g in row.groups:
                groups.append((row, g))

        def badness(pair: tuple[Any, Any]) -> tuple[int, float, int]:
            info = pair[1].info
            if info is None:
                return (0, 0.0, 0)
            return (1, -(info.oldest_unfinished_age_ms or 0), -(info.unfinished + info.dead))
        groups.sort(key=badness)
        return dash.page(request, "overview.html", snap=snap, groups=groups, warn_s=warn,
                         warn_query=urlencode({"warn": warn}) if warn != DEFAULT_WARN_S else "",
                         age=time.time() - snap.at)

    async def stream_page(request: Request) -> Response:
        where = _where(request)
        info, groups = await board.stream_groups(where)
        rows = [(g, r, None) if isinstance(r, GroupInfo) else (g, None, error_text(r)) for g, r in groups.items()]
        return dash.page(request, "stream.html", where=where, info=info, rows=rows)

    async def group_page(request: Request) -> Response:
        where, group = _where(request), _group(request)
        info = await board.group(where, group)
        consumers, manage = await asyncio.gather(board.consumers(where, group), board.may_manage(where, group))
        history = board.history(where, group)
        charts = [(name, chart_svg(history.points(name) if history else [])) for name in SERIES]
        return dash.page(request, "group.html", where=where, group=group, info=info, charts=charts,
                         consumers=consumers, manage=manage and not dash.read_only, warn_s=_warn_s(request))

    async def dead_page(request: Request) -> Response:
        where, group, reason, letters, total = await dead_letters(request)
        rows = [(d, record, None if record is None else preview(record.payload)) for d, record in letters]
        manage = await board.may_manage(where, group) and not dash.read_only
        reasons = sorted({d.reason for d, _ in letters})
        return dash.page(request, "dead.html", where=where, group=group, rows=rows, total=total, reason=reason,
                         reasons=reasons, manage=manage)

    async def records_page(request: Request) -> Response:
        where = _where(request)
        shard = _int_param(request, "shard", 0) or 0
        info, records, start = await board.records(where, shard, _int_param(request, "from", None))
        rows = [(r, preview(r.payload)) for r in records]
        return dash.page(request, "records.html", where=where, info=info, shard=shard, rows=rows, start=start,
                         page=len(records) or 50)

    async def login(request: Request) -> Response:
        if request.method == "GET":
            return dash.page(request, "login.html", 200, next=_safe_next(request.query_params.get("next")))
        try:
            raw = (await read_body(request, MAX_FORM)).decode("utf-8", "replace")
        except ApiError:
            return dash.page(request, "login.html", 400, next="/", failed=True)
        form = parse_qs(raw, keep_blank_values=True)  # the sign-in form only (no python-multipart needed)
        given = (form.get("token") or [""])[0]
        target = _safe_next((form.get("next") or ["/"])[0])
        if dash.token is None or not hmac.compare_digest(given.encode(), dash.token.encode()):
            return dash.page(request, "login.html", 403, next=target, failed=True)
        response = RedirectResponse(target, 303)
        response.set_cookie(COOKIE, dash.session or "", httponly=True, samesite="strict",
                            secure=request.url.scheme == "https", path="/")
        return response

    routes = [
        Route("/", html(overview)),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/healthz", api(health)),
        Route("/api/streams", api(api_streams)),
        Route("/api/streams/{tenant}/{namespace}/{stream}", api(api_stream)),
        Route("/api/streams/{tenant}/{namespace}/{stream}/records", api(api_records)),
        Route("/api/streams/{tenant}/{namespace}/{stream}/groups/{group}", api(api_group)),
        Route("/api/streams/{tenant}/{namespace}/{stream}/groups/{group}/dead-letters", api(api_dead)),
        Route("/api/streams/{tenant}/{namespace}/{stream}/groups/{group}/redrive", api(action("redrive")),
              methods=["POST"]),
        Route("/api/streams/{tenant}/{namespace}/{stream}/groups/{group}/discard", api(action("discard")),
              methods=["POST"]),
        Route("/streams/{tenant}/{namespace}/{stream}", html(stream_page)),
        Route("/streams/{tenant}/{namespace}/{stream}/records", html(records_page)),
        Route("/streams/{tenant}/{namespace}/{stream}/groups/{group}", html(group_page)),
        Route("/streams/{tenant}/{namespace}/{stream}/groups/{group}/dead-letters", html(dead_page)),
        Mount("/static", StaticFiles(directory=str(resources.files("felix_redis.dashboard") / "static")),
              name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sampler = asyncio.ensure_future(board.sample_forever())
        try:
            yield
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            if dash.close_client:
                await board.client.close()

    async def not_routed(request: Request, exc: Exception) -> Response:
        code = getattr(exc, "status_code", 404)
        text = "no such endpoint" if code == 404 else f"method {request.method} not allowed here"
        if request.url.path.startswith("/api/"):
            return Json({"error": text}, code)
        return dash.page(request, "error.html", code, error=text, code=code)

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_routed, 405: not_routed})
    app.add_middleware(Guard, dash=dash)
    return app


def _safe_next(target: str | None) -> str:
    """A redirect target on this site only."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


class Guard:
    """Host, token, method and origin checks before any route runs (pure ASGI)."""

    def __init__(self, app: Any, dash: Dashboard) -> None:
        self.app = app
        self.dash = dash

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        dash = self.dash
        path = scope["path"]
        api = path.startswith("/api/") or path == "/healthz"
        refusal: tuple[int, str] | None = None
        if not dash.host_allowed(request):
            refusal = (403, "the Host header names no loopback address; without --token the dashboard answers "
                            "only to localhost")
        elif request.method == "POST" and path != "/login":
            origin = request.headers.get("origin")
            if origin is not None and origin.split("://", 1)[-1] != request.headers.get("host"):
                refusal = (403, "cross-origin request refused")
        if refusal is None and not dash.authorized(request) and path != "/login" and not path.startswith("/static/"):
            if api or request.method != "GET":
                refusal = (403, "this dashboard needs its token: send Authorization: Bearer TOKEN")
            else:
                response: Response = RedirectResponse("/login?" + urlencode({"next": _safe_next(
                    path + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else ""))}),
                    303)
                await response(scope, receive, send)
                return
        if refusal is not None:
            status, message = refusal
            if api or request.method != "GET":
                response = JSONResponse({"error": message}, status)
            else:
                response = HTMLResponse(f"<!doctype html><title>felix-redis</title><p>{message}</p>", status)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(
    client: AsyncClient | str | None = None, *, read_only: bool = False, token: str | None = None,
    host: str = "127.0.0.1", tenant: str = "default", streams: Sequence[Where] | None = None,
    interval: float = 5.0, history_s: float = 3600.0,
) -> Starlette:
    """The dashboard as an ASGI app over ``client`` (an AsyncClient, or a URL to connect
    to; the app then closes it on shutdown). ``host`` is the address it is served on
    (:func:`check_bind` is the caller's to run)."""
    check_bind(host, token)
    close = not isinstance(client, AsyncClient)
    if not isinstance(client, AsyncClient):
        client = felix_redis.asyncio.connect(client)
    board = Board(client, tenant=tenant, streams=streams, interval=interval, history_s=history_s)
    return build(Dashboard(board, read_only=read_only, token=token, host=host, close_client=close))
