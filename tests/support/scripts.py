"""Crafted script calls for tests: a script run as it is, past every client-side check."""

from __future__ import annotations

from typing import Any

from felix_redis.client import Client
from felix_redis.plans import Eval


def run_script(client: Client, name: str, keys: list[Any], args: list[Any]) -> Any:
    """Script ``name`` with exactly these keys and args, as the server's FCALL (or
    EVALSHA) gets them: no plan, no argument check, redis-py errors untranslated."""
    return client._eval(Eval(name, keys, args, name))
