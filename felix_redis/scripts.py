"""Load the Lua scripts of ``lua/``: includes, the prelude, and the error epilogue.

A script file is the body of one atomic operation. Lines ``--- @include "name"`` pull in
``lua/includes/name.lua`` (each at most once, dependencies first); the prelude
(``includes/prelude.lua``) always comes first. The body runs inside ``main()`` under
``pcall`` so that errors raised by ``fail()`` become clean ``FELIX_<CODE>`` error replies
on Redis and on fakeredis alike.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Generator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

from felix_redis.errors import NotInstalled

__all__ = [
    "READ_ONLY",
    "Library",
    "LuaSource",
    "Runner",
    "ScriptError",
    "library",
    "load",
    "load_all",
    "lua_dir",
    "other_libraries",
    "prune_steps",
    "script_names",
]

_INCLUDE_RE = re.compile(r'^---\s*@include\s+"([A-Za-z0-9_/]+)"\s*$')
_PRELUDE = "prelude"

#: Turns main()'s outcome into the reply: errors raised by fail() (and Redis errors)
#: become clean error replies, on Redis and on fakeredis alike. (Named apart from the
#: includes' functions: lua/includes/acks.lua has a finish of its own.)
_REPLY = """
local function reply_of(ok, result)
  if ok then return result end
  if type(result) == 'table' then
    if result.felix then return redis.error_reply(result.felix) end
    if result.err then return redis.error_reply(result.err) end
  end
  return redis.error_reply(tostring(result))
end
"""

_EPILOGUE = _REPLY + "return reply_of(pcall(main))\n"


#: Scripts that never write: as functions they carry the ``no-writes`` flag, so they run
#: where a write would be refused (maxmemory reached), as they do through EVALSHA.
READ_ONLY = frozenset({"stream_read", "stream_info", "group_describe", "group_dead_letters", "schedule_due"})


class ScriptError(Exception):
    """A script or include is missing, circular or included twice in one file."""


@dataclass(frozen=True)
class LuaSource:
    name: str
    body: str  # the script file as written
    source: str  # what is sent to Redis (EVAL)
    includes: tuple[str, ...]
    head: str = ""  # the prelude and includes, as in source
    main: str = ""  # the body without its include lines, as in source


@dataclass(frozen=True)
class Library:
    """Every script as one Redis function library (``FUNCTION LOAD``, then ``FCALL``).

    A function library is compiled once when loaded, so a call runs only the script's
    body; an EVAL script builds its includes' closures anew on every call. The name
    carries a digest of the code, so clients of different versions load side by side."""

    name: str
    code: str
    functions: dict[str, str]  # script name -> function name


def lua_dir() -> Path:
    """The ``lua/`` folder: inside the installed package, or at the source tree's top."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "lua", here.parent / "lua"):
        if (candidate / "includes" / f"{_PRELUDE}.lua").is_file():
            return candidate
    raise ScriptError(f"no lua/ folder found next to {here}")


def _directives(text: str, where: str) -> tuple[list[str], str]:
    """Include names in order of appearance, and the text without those lines."""
    names: list[str] = []
    kept: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        match = _INCLUDE_RE.match(line.strip())
        if match is None:
            if "@include" in line and line.lstrip().startswith("---"):
                raise ScriptError(f"{where}:{number}: malformed include line: {line.strip()}")
            kept.append(line)
            continue
        name = match.group(1)
        if name in names:
            raise ScriptError(f"{where}:{number}: {name!r} is included twice")
        names.append(name)
    return names, "\n".join(kept) + "\n"


def _resolve(root: Path, name: str, stack: tuple[str, ...], done: dict[str, str]) -> None:
    """Adds include ``name`` and, before it, everything it includes, to ``done``."""
    if name in done:
        return
    if name in stack:
        chain = " -> ".join((*stack, name))
        raise ScriptError(f"circular include: {chain}")
    path = root / "includes" / f"{name}.lua"
    if not path.is_file():
        where = stack[-1] if stack else "?"
        raise ScriptError(f"{where}: include {name!r} not found at {path}")
    names, text = _directives(path.read_text(), str(path))
    for dep in names:
        _resolve(root, dep, (*stack, name), done)
    done[name] = text


def load(name: str, root: Path | None = None) -> LuaSource:
    """The full source of script ``name`` (``lua/<name>.lua``)."""
    root = root or lua_dir()
    path = root / f"{name}.lua"
    if not path.is_file():
        raise ScriptError(f"script {name!r} not found at {path}")
    body = path.read_text()
    names, text = _directives(body, str(path))
    done: dict[str, str] = {}
    _resolve(root, _PRELUDE, (name,), done)
    for dep in names:
        if dep == _PRELUDE:
            raise ScriptError(f"{path}: the prelude is included automatically")
        _resolve(root, dep, (name,), done)
    parts = [f"-- felix-redis script: {name}"]
    parts += [f"-- include: {inc}\n{src}" for inc, src in done.items()]
    head = "\n".join(parts)
    source = f"{head}\nlocal function main()\n{text}end\n{_EPILOGUE}"
    return LuaSource(name, body, source, tuple(done), head, text)


def script_names(root: Path | None = None) -> list[str]:
    root = root or lua_dir()
    return sorted(p.stem for p in root.glob("*.lua"))


@cache
def load_all() -> dict[str, LuaSource]:
    """Every script of the installed ``lua/`` folder, by name."""
    return {name: load(name) for name in script_names()}


@cache
def library() -> Library:
    """Every script of the installed ``lua/`` folder as one function library.

    Each script becomes a function ``<library>_<script>``. Its includes and body are
    built by a factory on the function's first call (the standard libraries are not
    reachable while a library loads), and kept: later calls only run the body. KEYS and
    ARGV, globals to an EVAL script, are the library's locals, set by each call (a
    script never yields, so calls cannot interleave)."""
    scripts = load_all()
    digest = hashlib.sha1("\0".join(s.source for s in scripts.values()).encode()).hexdigest()[:12]
    name = f"felix_{digest}"
    parts = [f"#!lua name={name}", "-- felix-redis: the scripts of lua/ as functions", "local KEYS, ARGV", _REPLY]
    functions = {}
    for script, src in scripts.items():
        fn = f"{name}_{script}"
        functions[script] = fn
        flags = ", flags = {'no-writes'}" if script in READ_ONLY else ""
        parts.append(
            f"do\n"
            f"local main\n"
            f"local function factory()\n{src.head}\nlocal function main()\n{src.main}end\nreturn main\nend\n"
            f"redis.register_function{{function_name = '{fn}', callback = function(keys, args)\n"
            f"  KEYS, ARGV = keys, args\n"
            f"  if not main then main = factory() end\n"
            f"  return reply_of(pcall(main))\n"
            f"end{flags}}}\n"
            f"end"
        )
    return Library(name, "\n".join(parts) + "\n", functions)


#: Library names felix-redis loads: ``felix_`` and 12 hex digits of the code's digest.
_LIBRARY_NAME = re.compile(r"felix_[0-9a-f]{12}")


def other_libraries(listing: Any, current: str) -> list[str]:
    """Names of felix-redis function libraries in a ``FUNCTION LIST`` reply (RESP2: flat
    name/value lists; RESP3: maps) other than ``current``. Libraries whose names are not
    exactly ``felix_<12 hex digits>`` belong to someone else and are never listed."""
    names = []
    for entry in listing or []:
        fields = entry if isinstance(entry, dict) else dict(zip(entry[::2], entry[1::2], strict=False))
        name = fields.get(b"library_name", fields.get("library_name"))
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if isinstance(name, str) and _LIBRARY_NAME.fullmatch(name) and name != current:
            names.append(name)
    return sorted(names)


def prune_steps(current: str, targets: list[dict[str, Any]]) -> Generator[tuple[tuple[str, ...], dict[str, Any]],
                                                                         Any, list[str]]:
    """The commands that delete the felix-redis libraries other than ``current`` on each
    target (redis-py ``execute_command`` keyword arguments: a Cluster node, or none):
    yields (command, target), receives each reply; returns the names deleted."""
    removed: set[str] = set()
    for target in targets:
        listing = yield ("FUNCTION LIST", "LIBRARYNAME", "felix_*"), target
        for name in other_libraries(listing, current):
            yield ("FUNCTION DELETE", name), target
            removed.add(name)
    return sorted(removed)


class Runner:
    """How one client runs the scripts: ``FCALL`` of the library's functions, else
    ``EVALSHA``. The drivers send :meth:`command`, load what :meth:`missing` replies ask
    for with :meth:`load`, and run a call again when :meth:`switch_to_evalsha` switched
    it over.

    A client starts with functions (``functions=True``) and falls back to EVALSHA for
    the rest of its life when the server has no functions (fakeredis) or the user may not
    ``FCALL`` (a user of its own making with ``+evalsha``). A role user may ``FCALL`` but
    neither load a library nor run scripts of its own: where the library is missing, it
    gets :class:`NotInstalled` (docs/security.md)."""

    def __init__(self, functions: bool = True) -> None:
        self.functions = functions
        self.library = library()
        self.sources = load_all()
        self.shas = {name: hashlib.sha1(src.source.encode()).hexdigest() for name, src in self.sources.items()}

    def command(self, name: str, keys: Any, args: Any) -> tuple[Any, ...]:
        """The command that runs script ``name``."""
        if self.functions:
            return ("FCALL", self.library.functions[name], len(keys), *keys, *args)
        return ("EVALSHA", self.shas[name], len(keys), *keys, *args)

    def missing(self, reply: Any) -> bool:
        """True when a reply says the call did not run: the server does not hold the
        script (NOSCRIPT) or the function (a restart without persistence, a new node,
        SCRIPT FLUSH or FUNCTION FLUSH)."""
        if isinstance(reply, NoScriptError):
            return True
        return isinstance(reply, ResponseError) and str(reply).startswith("Function not found")

    def load(self, name: str) -> tuple[str, ...]:
        """The command that loads what script ``name`` needs on a server. The command
        name is one string, as redis-py's own ``function_load``/``script_load`` send it,
        so that Redis Cluster clients route it to every primary."""
        if self.functions:
            return ("FUNCTION LOAD", "REPLACE", self.library.code)
        return ("SCRIPT LOAD", self.sources[name].source)

    def switch_to_evalsha(self, error: Any) -> bool:
        """After ``FCALL`` or ``FUNCTION LOAD`` failed with ``error``: when the error says
        the server has no functions or the user may not ``FCALL``, switches this client
        to EVALSHA for good and returns True (the call did not run: send it again);
        False for any other error.

        Raises :class:`NotInstalled` when ``FUNCTION LOAD`` was refused by ACL: the
        library is missing and this user may not install it. Roles run the library's
        functions only (no ``EVALSHA``, no ``SCRIPT LOAD``: a user's own Lua could stall
        the server), so there is nothing to fall back to."""
        if not self.functions or not isinstance(error, ResponseError):
            return False
        text = str(error).lower()
        if isinstance(error, NoPermissionError) and "'function|load'" in text:
            raise NotInstalled(
                f"the felix-redis function library {self.library.name} is not installed on this server, and this "
                "Redis user may not install it: an administrator runs `felixctl install` (or "
                "client.load_library()) once per server and after every upgrade (docs/security.md)")
        # only a refusal of FCALL itself: a refused key ("access one of the keys") says
        # nothing about FCALL, and switching then would leave a role user (no EVALSHA)
        # refused for good
        if self.refused_fcall(error) or "unknown command" in text or "unknown subcommand" in text:
            self.functions = False
            return True
        return False

    @staticmethod
    def refused_fcall(error: Any) -> bool:
        """Whether ``error`` is ACL refusing FCALL itself (Redis and Valkey name the
        command in quotes; a user name in Valkey's text cannot fake the quotes)."""
        return isinstance(error, NoPermissionError) and "'fcall'" in str(error).lower()
