"""Load the Lua scripts of ``lua/``: includes, the prelude, and the error epilogue.

A script file is the body of one atomic operation. Lines ``--- @include "name"`` pull in
``lua/includes/name.lua`` (each at most once, dependencies first); the prelude
(``includes/prelude.lua``) always comes first. The body runs inside ``main()`` under
``pcall`` so that errors raised by ``fail()`` become clean ``FELIX_<CODE>`` error replies
on Redis and on fakeredis alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

__all__ = ["LuaSource", "ScriptError", "load", "load_all", "lua_dir", "script_names"]

_INCLUDE_RE = re.compile(r'^---\s*@include\s+"([A-Za-z0-9_/]+)"\s*$')
_PRELUDE = "prelude"

_EPILOGUE = """
local ok, result = pcall(main)
if ok then return result end
if type(result) == 'table' then
  if result.felix then return redis.error_reply(result.felix) end
  if result.err then return redis.error_reply(result.err) end
end
return redis.error_reply(tostring(result))
"""


class ScriptError(Exception):
    """A script or include is missing, circular or included twice in one file."""


@dataclass(frozen=True)
class LuaSource:
    name: str
    body: str  # the script file as written
    source: str  # what is sent to Redis
    includes: tuple[str, ...]


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
    parts.append(f"local function main()\n{text}end\n{_EPILOGUE}")
    return LuaSource(name, body, "\n".join(parts), tuple(done))


def script_names(root: Path | None = None) -> list[str]:
    root = root or lua_dir()
    return sorted(p.stem for p in root.glob("*.lua"))


@cache
def load_all() -> dict[str, LuaSource]:
    """Every script of the installed ``lua/`` folder, by name."""
    return {name: load(name) for name in script_names()}
