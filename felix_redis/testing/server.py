"""Start and stop private ``redis-server`` processes on free loopback ports.

Used by the test suite, the demo and the topology launcher. Every server runs in its
own temporary directory, binds to 127.0.0.1 only and is stopped (SIGTERM, then
SIGKILL) by :meth:`RedisServer.stop` or when the context manager exits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

__all__ = ["RedisServer", "free_port", "redis_server_binary"]


def redis_server_binary() -> str | None:
    """Path of a ``redis-server`` (or ``valkey-server``) binary, or None."""
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One private ``redis-server`` on a loopback port.

    ``extra`` is a list of ``redis-server`` command-line options
    (``["--appendonly", "yes"]``). ``dir`` keeps data across :meth:`restart`.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        extra: Sequence[str] = (),
        binary: str | None = None,
        dir: str | None = None,
        persistence: bool = False,
        startup_timeout_s: float = 10.0,
    ) -> None:
        found = binary or redis_server_binary()
        if found is None:
            raise FileNotFoundError("no redis-server binary on PATH")
        self.binary = found
        self.port = port or free_port()
        self.extra = list(extra)
        self.persistence = persistence
        self.startup_timeout_s = startup_timeout_s
        self._own_dir = dir is None
        self.dir = dir or tempfile.mkdtemp(prefix="felix-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def logfile(self) -> Path:
        return Path(self.dir) / "redis.log"

    def command(self) -> list[str]:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", self.dir,
            "--logfile", str(self.logfile),
            "--daemonize", "no",
            "--protected-mode", "no",
        ]
        if not self.persistence:
            args += ["--save", "", "--appendonly", "no"]
        return args + self.extra

    def start(self) -> RedisServer:
        if self.process is not None and self.process.poll() is None:
            return self
        self.process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.wait_ready()
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                log = self.logfile.read_text() if self.logfile.exists() else ""
                raise RuntimeError(
                    f"redis-server on port {self.port} exited with "
                    f"{self.process.returncode}: {err.strip()} {log[-2000:]}"
                )
            if self._ping():
                return
            time.sleep(0.02)
        raise TimeoutError(f"redis-server on port {self.port} did not answer PING in time")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                data = sock.recv(64)
        except OSError:
            return False
        # A server still loading its data set answers -LOADING.
        return data.startswith(b"+PONG") or data.startswith(b"-NOAUTH")

    def kill(self) -> None:
        """SIGKILL: a crash, no shutdown save."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self, *, cleanup: bool = True) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()
        self.process = None
        if cleanup and self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def restart(self, *, hard: bool = False) -> None:
        """Stop (SIGKILL when ``hard``) and start again on the same port and dir."""
        if hard:
            self.kill()
        self.stop(cleanup=False)
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __del__(self) -> None:
        # may run at interpreter shutdown, when modules are half torn down
        process = getattr(self, "process", None)
        if process is None:
            return
        try:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        except Exception:
            pass


@contextlib.contextmanager
def running(**kwargs: object) -> Iterator[RedisServer]:
    """``with running() as server:`` a private server for the block."""
    server = RedisServer(**kwargs)  # type: ignore[arg-type]
    server.start()
    try:
        yield server
    finally:
        server.stop()
