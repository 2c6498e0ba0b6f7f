"""What every felixctl command shares: the connection context, the options declared
once, error handling, confirmation and output formatting.

Commands parse their arguments, call one :class:`felix_redis.Client` method (or a few)
and print; nothing here talks to Redis directly.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import re
import select
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, Any, TypeVar
from urllib.parse import unquote, urlsplit

import click
import redis.exceptions

import felix_redis
from felix_redis import Claim, FelixError, Record, parse_claim
from felix_redis.connection import env_password, read_url_file
from felix_redis.constants import DEFAULT_URL, ENV_URL, ENV_URL_FILE
from felix_redis.errors import InvalidArgument, redact_url

F = TypeVar("F", bound=Callable[..., Any])

ENV_TENANT = "FELIX_TENANT"
ENV_NAMESPACE = "FELIX_NAMESPACE"
#: Error lines are cut here (redis-py can put whole connection reprs into a message).
MAX_ERROR_CHARS = 300


# -- errors


class OperationError(click.ClickException):
    """An operation failed: exit 1 with one ``felixctl: error: ...`` line on stderr."""

    exit_code = 1

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"felixctl: error: {one_line(self.format_message())}", file=file, err=file is None)


def visible(text: str) -> str:
    """``text`` with every character that is not printable escaped as Python writes it
    (``\\n``, ``\\t``, ``\\x1b``, ``\\x9b``, ``\\u202e``): control characters (C0, DEL, C1),
    line and paragraph separators and format characters. What felixctl prints of names,
    keys and reasons read from Redis goes through it, so none can move the cursor,
    recolour the terminal or forge a row."""
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode("ascii") for ch in text
    )


def one_line(message: str) -> str:
    """``message`` with line breaks and other control characters escaped (:func:`visible`),
    so an error is always exactly one line (a name or payload in it may hold any character)."""
    return visible(message)


def hide_password(message: str, url: str | None) -> str:
    """``message`` with the password of ``url``, ``$FELIX_REDIS_PASSWORD`` and the
    password of any URL in it masked."""
    message = redact_url(message)
    secrets = [env_password()]
    if url:
        with contextlib.suppress(ValueError):
            netloc = urlsplit(url).netloc
            if "@" in netloc:
                secrets.append(unquote(netloc.rsplit("@", 1)[0].partition(":")[2]))
    for secret in secrets:
        if secret:
            message = message.replace(secret, "***")
    return message


def choose_url(ctx: click.Context, redis_url: str | None, redis_url_file: str | None) -> Ctl:
    """A Ctl with the URL felixctl uses: ``--redis-url`` or ``--redis-url-file`` given on
    the command line (not both); else ``$FELIX_REDIS_URL``, else ``$FELIX_REDIS_URL_FILE``;
    else neither (the library's default). Tenant and namespace come from ``ctx.params``."""
    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE

    if given("redis_url") and given("redis_url_file"):
        raise click.UsageError("give --redis-url or --redis-url-file, not both", ctx)
    tenant, namespace = ctx.params["tenant"], ctx.params["namespace"]
    if redis_url and not given("redis_url_file"):
        return Ctl(redis_url, tenant, namespace)
    source = "--redis-url-file" if given("redis_url_file") else f"${ENV_URL_FILE}"
    return Ctl(None, tenant, namespace, url_file=redis_url_file or None, url_file_source=source)


def as_operation_error(exc: BaseException, url: str | None) -> OperationError | None:
    """The OperationError an expected failure becomes, or None for anything else."""
    shown = redact_url(url or DEFAULT_URL)
    if isinstance(exc, FelixError):
        text = str(exc) or type(exc).__name__
    elif isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        text = f"cannot reach Redis at {shown}: {exc}"
    elif isinstance(exc, redis.exceptions.RedisError):
        text = f"Redis at {shown} answered with an error: {exc}"
    elif isinstance(exc, OSError) and not isinstance(exc, BrokenPipeError):
        text = f"{exc.strerror or exc} (Redis URL {shown})"
    else:
        return None
    text = hide_password(" ".join(text.split()), url)
    if len(text) > MAX_ERROR_CHARS and "?" in shown:
        # long query options (TLS file paths) would push the reason past the cut
        text = text.replace(shown, shown.split("?", 1)[0] + "?...")
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + "..."
    return OperationError(text)


# -- context


class Ctl:
    """The global options and a client made on first use. A URL file is read on the
    first use of :attr:`url` (so ``--help`` works without it); its contents are never
    printed."""

    def __init__(self, url: str | None, tenant: str, namespace: str, *, url_file: str | None = None,
                 url_file_source: str = "--redis-url-file") -> None:
        self._url = url
        self._url_file = url_file
        self._url_file_source = url_file_source
        self.tenant = tenant
        self.namespace = namespace
        self._client: felix_redis.Client | None = None

    @property
    def url(self) -> str | None:
        """The URL given (None: the library's default); reads the URL file on first use."""
        if self._url_file is not None:
            try:
                self._url = read_url_file(self._url_file, source=self._url_file_source)
            except InvalidArgument as exc:
                raise click.BadParameter(str(exc), param_hint=self._url_file_source) from None
            self._url_file = None
        return self._url

    @property
    def known_url(self) -> str | None:
        """The URL if known already, without reading a file (for error messages)."""
        return self._url

    def __repr__(self) -> str:
        shown = redact_url(self._url) if self._url else None
        return f"Ctl(url={shown!r}, tenant={self.tenant!r}, namespace={self.namespace!r})"

    @property
    def client(self) -> felix_redis.Client:
        if self._client is None:
            self._client = felix_redis.connect(self.url)
        return self._client

    def where(self, stream: str) -> tuple[str, str, str]:
        return self.tenant, self.namespace, stream

    def path(self, stream: str) -> str:
        return f"{self.tenant}/{self.namespace}/{stream}"

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None


pass_ctl = click.make_pass_decorator(Ctl)


# -- options declared once


def url_option(help: str, *, show_envvar: bool = False) -> Callable[[F], F]:
    """``--redis-url URL`` (``$FELIX_REDIS_URL``)."""
    return click.option("--redis-url", envvar=ENV_URL, show_envvar=show_envvar, default=None, metavar="URL",
                        help=help)


def tenant_option(help: str, *, show_envvar: bool = False, show_default: bool = True) -> Callable[[F], F]:
    """``--tenant NAME`` (``$FELIX_TENANT``, else ``default``); ``show_default=False`` when
    ``help`` says the default itself."""
    return click.option("--tenant", envvar=ENV_TENANT, show_envvar=show_envvar, default="default",
                        show_default=show_default, help=help)


def namespace_option(help: str, *, show_envvar: bool = False, show_default: bool = True) -> Callable[[F], F]:
    """``--namespace NAME`` (``$FELIX_NAMESPACE``, else ``default``); ``show_default=False``
    when ``help`` says the default itself."""
    return click.option("--namespace", envvar=ENV_NAMESPACE, show_envvar=show_envvar, default="default",
                        show_default=show_default, help=help)

stream_argument = click.argument("stream")
group_argument = click.argument("group")


def output_option(*formats: str) -> Callable[[F], F]:
    """``-o/--output`` with ``text`` and the given machine formats."""
    choices = ["text", *(formats or ("json",))]
    return click.option(
        "-o", "--output", type=click.Choice(choices), default="text", show_default=True,
        help="Output format; json prints one JSON document.",
    )


def shard_option(help: str) -> Callable[[F], F]:
    return click.option("--shard", type=click.IntRange(min=0), default=None, help=help)


yes_option = click.option(
    "-y", "--yes", is_flag=True, help="Do not ask for confirmation (only asked at a terminal)."
)

claims_argument = click.argument("claims", nargs=-1, required=True, metavar="CLAIM...")


def examples(*lines: str, note: str = "") -> str:
    """An epilog listing example command lines, kept as written by click."""
    body = "\n".join(f"  {line}" for line in lines)
    text = f"\b\nExamples:\n{body}"
    return f"{text}\n\n{note}" if note else text


# -- claims


def parse_claims(texts: Iterable[str], *, attempts_required: bool = True) -> list[Claim]:
    """Every claim parsed up front, so a malformed one fails before anything is done."""
    return [parse_claim(t, attempts_required=attempts_required) for t in texts]


def by_shard(claims: Sequence[Claim]) -> dict[int, list[Claim]]:
    grouped: dict[int, list[Claim]] = {}
    for claim in claims:
        grouped.setdefault(claim.shard, []).append(claim)
    return grouped


class ClaimRunner:
    """Runs one operation per claim (or per shard's claims) and keeps going past a
    failure; :meth:`finish` prints one ``felixctl: error:`` line for all failures and
    exits 1. Before anything runs, :meth:`check` refuses an unknown stream or group and
    a claim of a shard the stream does not have, so those change nothing."""

    def __init__(self, url: str | None) -> None:
        self.url = url
        self.failed = 0
        self.total = 0
        self.errors: list[str] = []

    def check(self, ctl: Any, stream: str, group: str, claims: Sequence[Claim]) -> None:
        """Fails (nothing done) on an unknown stream or group, or a claim's shard out of range."""
        shards = len(ctl.client.group_describe(*ctl.where(stream), group).shards)
        for claim in claims:
            if not 0 <= claim.shard < shards:
                raise OperationError(
                    f"{claim}: shard {claim.shard} does not exist (stream {ctl.path(stream)} has "
                    f"{shards} shard{'s' if shards != 1 else ''}); nothing was done"
                )

    def refuse(self, label: str, message: str, counted: bool = False) -> None:
        """Remembers a claim that failed on its own (``counted``: :meth:`each` counted it
        already) for :meth:`finish`; the others go on."""
        if not counted:
            self.total += 1
        self.failed += 1
        self.errors.append(f"{label}: {message}")

    @contextlib.contextmanager
    def each(self, label: str, count: int = 1) -> Iterator[None]:
        """Runs the block for the claim(s) ``label`` (``count`` of them); a FelixError is
        remembered for :meth:`finish`, not raised."""
        self.total += count
        try:
            yield
        except FelixError as exc:
            self.failed += count
            error = as_operation_error(exc, self.url)
            assert error is not None
            if not isinstance(exc, felix_redis.ConnectionFailed):
                self.errors.append(f"{label}: {error.message}")
            elif not self.errors:
                raise
            else:
                # the rest cannot be tried: stop, still naming what failed before
                self.errors.append(f"{label}: {error.message}; stopped there")
                self.finish()

    def finish(self) -> None:
        if not self.errors:
            return
        if self.total == self.failed == 1:
            raise OperationError(self.errors[0])
        raise OperationError(f"{self.failed} of {self.total} failed: " + "; ".join(self.errors))


# -- confirmation


def at_terminal() -> bool:
    """Whether a person may be there to answer: stdin is a terminal."""
    return sys.stdin.isatty()


def confirm(question: str, *, yes: bool, what: str) -> None:
    """Asks ``question`` on stderr when a person is at a terminal, unless ``yes``. Run
    from a script (stdin not a terminal: CI, cron, a pipe) the command goes ahead as
    written, unless an answer is already waiting on stdin (``echo n | felixctl ...``):
    then that answer decides. Nothing waits for an answer that will not come."""
    if yes:
        return
    if at_terminal():
        if not click.confirm(question, default=False, err=True):
            raise OperationError(f"{what} not confirmed; nothing was changed")
        return
    answer = _waiting_line(sys.stdin)
    if answer is not None and answer.strip().lower() not in ("y", "yes"):
        raise OperationError(f"{what} not confirmed (stdin answered {answer.strip()[:20]!r}); nothing was changed")


def _waiting_line(stdin: IO[str]) -> str | None:
    """A line already written to a non-terminal stdin, without waiting for one (None:
    nothing there yet, or at end of file)."""
    try:
        fd = stdin.fileno()
    except (OSError, ValueError, io.UnsupportedOperation):
        fd = None  # an in-memory stream (click's test runner): reading it never blocks
    if fd is not None:
        try:
            ready, _, _ = select.select([fd], [], [], 0)
        except (OSError, ValueError):
            return None
        if not ready:
            return None
    line = stdin.readline()
    return line if line.strip() else None


# -- library warnings


class _StderrWarnings(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"felixctl: warning: {record.getMessage()}", err=True)


@contextlib.contextmanager
def warnings_on_stderr(logger: str = "felix_redis") -> Iterator[None]:
    """Warnings the library logs meanwhile, as ``felixctl: warning: ...`` lines on stderr."""
    target = logging.getLogger(logger)
    handler = _StderrWarnings(logging.WARNING)
    propagate = target.propagate
    target.addHandler(handler)
    target.propagate = False
    try:
        yield
    finally:
        target.removeHandler(handler)
        target.propagate = propagate


# -- output


_ESCAPES = {ord("\\"): b"\\\\", ord("\n"): b"\\n", ord("\t"): b"\\t", ord("\r"): b"\\r"}
#: Bytes that make a payload be written escaped: C0 controls but tab, and DEL.
_CONTROL_BYTES = frozenset(range(0x20)) - {ord("\t")} | {0x7F}


def _is_control(ch: str) -> bool:
    """A C0 (but tab), DEL or C1 control: as a character, or as a byte that is no UTF-8
    (a surrogate escape)."""
    code = ord(ch)
    return (code < 0x20 and ch != "\t") or 0x7F <= code <= 0x9F or 0xDC80 <= code <= 0xDC9F


def escape_payload(payload: bytes) -> bytes:
    """The payload on one line, never a control character in it. Without a control
    character (but tab) it is the payload itself, backslashes and tabs included (a line
    splits at its first tab into the claim and the payload): JSON and text come out as
    they were published. A payload holding a line break or another control character
    (C0, DEL, C1: ESC would reach the terminal) is written escaped instead: backslash,
    newline, tab and carriage return as ``\\\\``, ``\\n``, ``\\t`` and ``\\r``, another
    control byte as ``\\xHH`` and a C1 character as ``\\u00HH``."""
    if not _CONTROL_BYTES.intersection(payload) and not _has_c1(payload):
        return payload
    out = bytearray()
    for ch in payload.decode("utf-8", "surrogateescape"):
        code = ord(ch)
        if code in _ESCAPES:
            out += _ESCAPES[code]
        elif 0xDC80 <= code <= 0xDCFF:  # a byte that is no UTF-8
            byte = code - 0xDC00
            out += b"\\x%02x" % byte if byte <= 0x9F else bytes((byte,))
        elif _is_control(ch):
            out += b"\\x%02x" % code if code < 0x80 else b"\\u%04x" % code
        else:
            out += ch.encode("utf-8")
    return bytes(out)


def _has_c1(payload: bytes) -> bool:
    """Holds a C1 control: UTF-8's ``\\xc2\\x80``..``\\xc2\\x9f`` or such a byte alone."""
    if not any(0x80 <= byte <= 0x9F for byte in payload):
        return False
    return any(_is_control(ch) for ch in payload.decode("utf-8", "surrogateescape"))


def emit_line(prefix: str, payload: bytes) -> None:
    """``prefix<TAB>payload`` on stdout, the payload escaped only if it holds a control
    character but tab (:func:`escape_payload`)."""
    click.echo(visible(prefix).encode() + b"\t" + escape_payload(payload) + b"\n", nl=False)


def payload_json(payload: bytes) -> dict[str, str]:
    """``{"payload": text}`` for UTF-8 payloads, ``{"payload_base64": ...}`` otherwise."""
    try:
        return {"payload": payload.decode("utf-8")}
    except UnicodeDecodeError:
        return {"payload_base64": base64.b64encode(payload).decode("ascii")}


def record_json(record: Record, *, with_claim: bool) -> dict[str, Any]:
    data: dict[str, Any] = {"shard": record.shard, "offset": record.offset}
    if with_claim:
        data["attempts"] = record.attempts
        data["claim"] = record.claim
    data["key"] = record.key
    data["published_at"] = record.published_at.isoformat(timespec="milliseconds")
    deliver, expires = record.deliver_at, record.expires_at
    data["deliver_at"] = None if deliver is None else deliver.isoformat(timespec="milliseconds")
    data["expires_at"] = None if expires is None else expires.isoformat(timespec="milliseconds")
    data["headers"] = record.headers
    data.update(payload_json(record.payload))
    return data


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)?")


def parse_duration(text: str, what: str) -> float:
    """'30s', '5m', '2h', '1d', '250ms' or a plain number of seconds, as seconds."""
    m = _DURATION.fullmatch(text.strip())
    if not m:
        raise click.BadParameter(f"{text!r} is not a duration such as 30s, 5m, 2h, 1d or 250ms", param_hint=what)
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def parse_rate(text: str) -> tuple[int, float] | None:
    """'100/1s' (COUNT/DURATION; '100/s' is 100 a second) as (count, per_seconds); 'none'
    or '0' removes a limit (None)."""
    if text.strip().lower() in ("none", "off", "0"):
        return None
    count, sep, per = text.strip().partition("/")
    if not sep or not count.isdigit():
        raise click.BadParameter(f"{text!r} is not a rate limit COUNT/DURATION such as 100/1s or 10/m",
                                 param_hint="--rate-limit")
    if per in _UNITS:
        per = "1" + per
    return int(count), parse_duration(per, "--rate-limit")


def parse_headers(pairs: Sequence[str]) -> dict[str, str] | None:
    """--header name=value options as a dict (None for none)."""
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{pair!r} is not name=value", param_hint="--header")
        out[name] = value
    return out or None


def emit_json(document: Any, *, compact: bool = False) -> None:
    if compact:
        click.echo(json.dumps(document, ensure_ascii=False, separators=(",", ":")))
    else:
        click.echo(json.dumps(document, ensure_ascii=False, indent=2))


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], *, right: Iterable[int] = ()) -> str:
    """Rows in aligned columns; the columns in ``right`` are right-aligned. Cells are
    :func:`visible`: a tab or line break in one cannot make a column or a row."""
    cells = [[str(h) for h in headers]] + [[visible(str(c)) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    align_right = set(right)
    lines = []
    for row in cells:
        parts = [c.rjust(w) if i in align_right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def human_ms(ms: int | None) -> str:
    """``850ms``, ``12.3s``, ``4m05s``, ``2h03m``; ``-`` for None."""
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f}s"
    seconds = ms // 1000
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def parse_start(ctx: click.Context, param: click.Parameter, value: str) -> str | int:
    """``earliest``, ``latest`` or an offset (an integer >= 0); a click option callback."""
    text = str(value).strip().lower()
    if text in ("earliest", "latest"):
        return text
    if text.isdigit():
        return int(text)
    raise click.BadParameter(f"{value!r} is not earliest, latest or an offset (an integer >= 0)", ctx, param)


def start_option(help: str) -> Callable[[F], F]:
    """``--from earliest|latest|OFFSET``."""
    return click.option("--from", "start", default="earliest", show_default=True, metavar="earliest|latest|OFFSET",
                        callback=parse_start, help=help)
