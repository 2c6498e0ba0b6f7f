"""Exceptions, and the one table that maps script error codes to them.

Scripts fail with ``redis.error_reply('FELIX_<CODE> <message>')``; :func:`from_response`
turns that into the matching :class:`FelixError` subclass.
"""

from __future__ import annotations

import re

__all__ = [
    "ConnectionFailed",
    "FelixError",
    "GroupExists",
    "InvalidArgument",
    "MalformedClaims",
    "NotDelivered",
    "NotFound",
    "NotInstalled",
    "NotReplicated",
    "OutcomeUnknown",
    "PermissionDenied",
    "SequenceError",
    "StaleClaim",
    "StreamExists",
    "WrongKeyType",
    "from_response",
    "redact_url",
]


class FelixError(Exception):
    """Base class of every error felix-redis raises on purpose."""


class NotFound(FelixError):
    """The stream, group, shard or record does not exist."""


class NotDelivered(NotFound):
    """An ack named records never delivered to the group (``group_ack_many``, a sharded
    group's ``ack_many``); every other record of the call was settled all the same.
    ``outcomes``: one per record given, in order: True acked now, False finished
    already, None not settled (for a sharded ``ack_many``: by shard, each shard's in
    the order given). ``records``: the ``SHARD:OFFSET`` never delivered."""

    def __init__(self, message: str, outcomes: list[bool | None], records: list[str]) -> None:
        super().__init__(message)
        self.outcomes = outcomes
        self.records = records


class GroupExists(FelixError):
    """``group_create`` for a group that exists already."""


class StreamExists(FelixError):
    """``stream_create`` for a stream that exists with different settings."""


class StaleClaim(FelixError):
    """The claim is no longer current: its lease lapsed, it was redelivered or finished."""


class InvalidArgument(FelixError, ValueError):
    """Bad input: a name, claim, number or payload that cannot be accepted."""


class MalformedClaims(InvalidArgument):
    """``group_ack_many`` named records it cannot read (a malformed claim, another
    shard's record, a bad offset); every other record of the call was settled all the
    same. ``outcomes`` as :class:`NotDelivered`'s (None: not settled: malformed, or
    never delivered); ``records``: the references refused, as given."""

    def __init__(self, message: str, outcomes: list[bool | None], records: list[str]) -> None:
        super().__init__(message)
        self.outcomes = outcomes
        self.records = records


class SequenceError(InvalidArgument):
    """An idempotent publish whose sequence is older than, or not next to, the last one."""


class WrongKeyType(FelixError):
    """A key felix-redis owns holds another Redis type (something else wrote it)."""


class NotReplicated(FelixError):
    """The write was applied on the primary but too few replicas confirmed it in time,
    so it may not survive a failover."""


class PermissionDenied(FelixError):
    """The Redis user lacks the role this operation needs."""


class NotInstalled(PermissionDenied):
    """The server lacks this version's function library and this Redis user may not
    install it (roles call the library's functions, ``FCALL``, and nothing else): an
    administrator runs ``felixctl install`` (docs/security.md)."""


class Conflict(FelixError):
    """Internal: a script saw the state change under it; the caller reads again and retries."""


class ConnectionFailed(FelixError, ConnectionError):
    """Redis could not be reached; the message names the server (never the password).

    ``unsent`` is True when the call certainly did not run: no connection could be made,
    or the server refused it before running it (a replica, a failover or restart under
    way, a slot that moved). Such a call may be sent again whatever it does. ``final``:
    trying again cannot help (no sentinel of the URL has ever answered this client), so
    the client does not wait out its retry budget."""

    def __init__(self, message: str = "", *, unsent: bool = False, final: bool = False) -> None:
        super().__init__(message)
        self.unsent = unsent
        self.final = final


class OutcomeUnknown(ConnectionFailed):
    """The connection was lost after a call that is not safe to repeat was sent: it may
    or may not have taken effect, and the client did not send it again. Look (describe,
    read) before repeating it."""


_CODES: dict[str, type[FelixError]] = {
    "NOT_FOUND": NotFound,
    "GROUP_EXISTS": GroupExists,
    "STREAM_EXISTS": StreamExists,
    "STALE_CLAIM": StaleClaim,
    "INVALID": InvalidArgument,
    "SEQUENCE": SequenceError,
    "WRONGTYPE": WrongKeyType,
    "NOPERM": PermissionDenied,
    "NOT_REPLICATED": NotReplicated,
    "CONFLICT": Conflict,
}

_FELIX_RE = re.compile(r"FELIX_([A-Z_]+) (.*)", re.S)
#: How ACL refusals begin once redis-py dropped their NOPERM code: Redis 7.0's words, then
#: Valkey 8's (which names the user: "User NAME has no permissions to run ...").
_ACL_REFUSALS = ("this user has no permissions", "No permissions to access", "ACL failure in script")


def from_response(message: str) -> FelixError | None:
    """The FelixError a script error message stands for, or None if it is not ours."""
    match = _FELIX_RE.search(message)
    if match is not None:
        cls = _CODES.get(match.group(1), FelixError)
        return cls(match.group(2).strip())
    if message.startswith("WRONGTYPE"):
        return WrongKeyType(message)
    if message.startswith("NOPERM") or "NOPERM" in message[:40]:
        return PermissionDenied(message)
    if message.startswith(_ACL_REFUSALS) or "user executing the script can't" in message or (
            message.startswith("User ") and " has no permissions to " in message):
        # ACL refusals: redis-py drops the NOPERM code; inside a script Redis 7.0 words it so
        return PermissionDenied(f"{message} (Redis ACL: this user holds no felix-redis role that covers "
                                "these keys or this command; see docs/security.md)")
    return None


#: ``//user:PASSWORD@`` in a URL; the password runs to the last ``@`` of the URL token, so
#: an unencoded ``@`` or ``/`` in it is masked too (masking a little too much is the safe
#: side); or, holding no ``/``, to the last ``@`` of the line, so an unencoded space is too.
_USERINFO_RE = re.compile(r"(//[^:/@\s?#]*:)([^\s?#]*|[^\n\r?#/]*)(@)")
#: ``password=``, ``sentinel_password=``, ``ssl_password=`` ... in a query string.
_QUERY_PASSWORD_RE = re.compile(r"([?&][A-Za-z_]*password=)([^&\s#'\"]*)", re.IGNORECASE)
#: A whole text that is one URL: ``scheme://``, on one line.
_ONE_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\n\r]*")
#: In one URL: ``//user:PASSWORD@``, the password running to the last ``@`` before the query,
#: whatever it holds; and every ``...password=`` query value, up to the next ``&``.
_URL_USERINFO_RE = re.compile(r"(//[^:/@?#]*:)([^?#]*)(@)")
_URL_QUERY_PASSWORD_RE = re.compile(r"([?&][A-Za-z_]*password=)([^&#]*)", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` (or a message holding URLs) with every password replaced by ``***``: the
    one in ``user:password@`` and any ``...password=`` query option (any case). Given one
    URL alone, unencoded spaces, ``@`` and ``/`` in a password are masked too; in a longer
    message a password runs to the next space unless it holds no ``/``."""
    if _ONE_URL_RE.fullmatch(url):
        return _URL_QUERY_PASSWORD_RE.sub(r"\1***", _URL_USERINFO_RE.sub(r"\1***\3", url))
    return _QUERY_PASSWORD_RE.sub(r"\1***", _USERINFO_RE.sub(r"\1***\3", url))
