"""A TCP proxy between a client and Redis that loses the connection where a test says.

Faults are armed one at a time and fire on the first request (a RESP command) that
matches a predicate on its arguments:

- ``before``: the connection is cut when the request arrives; Redis never sees it.
- ``after``: the request reaches Redis and Redis answers; the connection is cut before
  the answer is passed on (the call took effect, its reply was lost).
- ``mid``: as ``after``, but half of the answer is passed on first.
- ``error``: the request is not forwarded; the client gets the error reply the fault
  carries (e.g. ``-LOADING ...``: a server refusing the call before running it).

:meth:`FaultProxy.refuse` cuts every open connection and refuses new ones (nothing
listens on the port) for a while: calls made then cannot be sent at all.

Everything runs on 127.0.0.1 in daemon threads; every loop is bounded by a timeout or a
stop flag, and :meth:`FaultProxy.close` (or the context manager) stops it all.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

MODES = ("before", "after", "mid", "error")

Match = Callable[[list[bytes]], bool]


class Incomplete(Exception):
    """The buffer does not hold a whole RESP value yet."""


def _line(buf: bytes | bytearray, pos: int) -> tuple[bytes, int]:
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise Incomplete
    return bytes(buf[pos:end]), end + 2


def parse_value(buf: bytes | bytearray, pos: int = 0) -> tuple[Any, int]:
    """One RESP2/RESP3 value at ``pos``: (value, position after it). Raises Incomplete.
    Aggregates come back as lists of their elements; simple values as their bytes."""
    if pos >= len(buf):
        raise Incomplete
    kind = buf[pos:pos + 1]
    head, pos = _line(buf, pos + 1)
    if kind in (b"$", b"=", b"!"):  # bulk string, verbatim string, bulk error
        n = int(head)
        if n < 0:
            return None, pos
        if len(buf) < pos + n + 2:
            raise Incomplete
        return bytes(buf[pos:pos + n]), pos + n + 2
    if kind in (b"*", b"~", b">", b"%", b"|"):  # array, set, push, map, attribute
        n = int(head)
        if n < 0:
            return None, pos
        items = []
        for _ in range(n * (2 if kind in (b"%", b"|") else 1)):
            item, pos = parse_value(buf, pos)
            items.append(item)
        if kind == b"|":  # an attribute precedes the value it describes
            _, pos = parse_value(buf, pos)
        return items, pos
    if kind in (b"+", b"-", b":", b"_", b",", b"#", b"("):
        return head, pos
    raise ValueError(f"not a RESP value: {bytes(buf[pos - len(head) - 3:pos])!r}")


@dataclass
class Fault:
    """One armed fault; ``fired`` holds the arguments of the request it fired on."""

    mode: str
    match: Match
    error: bytes = b"-LOADING Redis is loading the dataset in memory"
    skip: int = 0  # let this many matching requests through first
    times: int = 1  # fire on this many matching requests (then it is disarmed)
    fired: list[list[bytes]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


class _Pipe:
    """One client connection and its upstream connection, served by one thread."""

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = socket.create_connection(proxy.upstream, timeout=5)
        self.upstream.settimeout(None)
        self.client.setblocking(False)
        self.upstream.setblocking(False)
        self.requests = bytearray()  # client bytes not yet parsed
        self.replies = bytearray()  # upstream bytes not yet parsed
        self.forwarded = 0  # requests passed upstream
        self.answered = 0  # replies passed (or withheld) downstream
        #: after/mid: the index of the request whose reply is withheld, and the fault
        self.withhold: tuple[int, Fault] | None = None
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self.run, name="faultproxy-pipe", daemon=True)

    def cut(self) -> None:
        """Closes both sides (from any thread); the pipe's thread ends."""
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.closed.set()

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            sel.register(self.client, selectors.EVENT_READ, "client")
            sel.register(self.upstream, selectors.EVENT_READ, "upstream")
            while not self.closed.is_set() and not self.proxy.stopping.is_set():
                for key, _ in sel.select(timeout=0.1):
                    side = key.data
                    try:
                        data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        return
                    if side == "client":
                        if self.withhold is None and not self.on_requests(data):
                            return
                    elif not self.on_replies(data):
                        return
        finally:
            sel.close()
            self.cut()
            for sock in (self.client, self.upstream):
                with contextlib.suppress(OSError):
                    sock.close()
            self.proxy.forget(self)

    def send(self, sock: socket.socket, data: bytes) -> None:
        sock.setblocking(True)
        sock.settimeout(5)
        try:
            sock.sendall(data)
        finally:
            sock.setblocking(False)

    def on_requests(self, data: bytes) -> bool:
        """Forwards the whole requests in the buffer, unless one matches an armed fault;
        False when the connection is to be cut now."""
        self.requests += data
        pos = start = 0
        while True:
            try:
                args, end = parse_value(self.requests, pos)
            except Incomplete:
                break
            fault = self.proxy.take_fault(args if isinstance(args, list) else [])
            if fault is None:
                self.forwarded += 1  # sent below, with the others in the buffer
                pos = end
                continue
            if pos > start:  # the requests before it go on
                self.send(self.upstream, bytes(self.requests[start:pos]))
            fault.fired.append(args)
            if fault.mode == "before":
                fault.done.set()
                return False
            if fault.mode == "error":
                # the replies to the requests before it come first, then the refusal
                self.flush_replies_until(self.forwarded)
                self.send(self.client, fault.error + b"\r\n")
                fault.done.set()
                start = pos = end
                continue
            self.send(self.upstream, bytes(self.requests[pos:end]))
            self.withhold = (self.forwarded, fault)
            self.forwarded += 1
            del self.requests[:end]  # what follows is dropped: the connection is cut soon
            return True
        if pos > start:
            self.send(self.upstream, bytes(self.requests[start:pos]))
        del self.requests[:pos]
        return True

    def flush_replies_until(self, upto: int) -> None:
        """Reads and forwards replies until ``upto`` requests were answered (5 s at most)."""
        deadline = time.monotonic() + 5
        while self.answered < upto:
            if time.monotonic() > deadline:
                raise TimeoutError("faultproxy: Redis did not answer in 5 s")
            try:
                data = self.upstream.recv(65536)
            except BlockingIOError:
                time.sleep(0.002)
                continue
            if not data:
                return
            self.replies += data
            self.pass_replies(limit=upto)

    def pass_replies(self, limit: int | None = None) -> bool:
        """Forwards the whole replies in the buffer; at the withheld one, does what its
        fault says and returns False (cut the connection)."""
        pos = 0
        while limit is None or self.answered < limit:
            try:
                _, end = parse_value(self.replies, pos)
            except Incomplete:
                break
            if self.withhold is not None and self.answered == self.withhold[0]:
                fault = self.withhold[1]
                if pos:
                    self.send(self.client, bytes(self.replies[:pos]))
                if fault.mode == "mid":
                    reply = bytes(self.replies[pos:end])
                    self.send(self.client, reply[: max(1, len(reply) // 2)])
                    time.sleep(0.02)  # let the half reach the client before the cut
                fault.done.set()
                return False
            self.answered += 1
            pos = end
        if pos:
            self.send(self.client, bytes(self.replies[:pos]))
            del self.replies[:pos]
        return True

    def on_replies(self, data: bytes) -> bool:
        self.replies += data
        return self.pass_replies()


class FaultProxy:
    """``with FaultProxy(redis_port) as proxy:`` a proxy on ``proxy.port`` (see the
    module's docstring)."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._pipes: set[_Pipe] = set()
        #: every request that arrived, in order (its arguments)
        self.requests: list[list[bytes]] = []
        self.accepted = 0
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self.port = 0
        self._listen()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    # -- faults

    def arm(self, mode: str, match: Match, *, skip: int = 0, times: int = 1, error: bytes | None = None) -> Fault:
        """Arms a fault for the first ``times`` requests ``match`` accepts (after
        ``skip`` matching ones went through)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        fault = Fault(mode, match, skip=skip, times=times)
        if error is not None:
            fault.error = error
        with self._lock:
            self._faults.append(fault)
        return fault

    def disarm(self) -> None:
        with self._lock:
            self._faults.clear()

    def take_fault(self, args: list[bytes]) -> Fault | None:
        with self._lock:
            self.requests.append(args)
            for fault in self._faults:
                if fault.match(args):
                    if fault.skip:
                        fault.skip -= 1
                        return None
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults.remove(fault)
                    return fault
        return None

    def seen(self, match: Match) -> int:
        """How many requests ``match`` accepts arrived so far (forwarded or not)."""
        with self._lock:
            return sum(1 for args in self.requests if match(args))

    def cut_all(self) -> None:
        """Cuts every open connection (each client sees its connection closed)."""
        with self._lock:
            pipes = list(self._pipes)
        for pipe in pipes:
            pipe.cut()
        deadline = time.monotonic() + 5
        for pipe in pipes:
            pipe.thread.join(max(0.0, deadline - time.monotonic()))

    @contextlib.contextmanager
    def refusing(self) -> Any:
        """Within the block every open connection is cut and nothing listens on the
        port (a connect is refused); the port listens again when the block ends."""
        self._unlisten()
        self.cut_all()
        try:
            yield
        finally:
            self._listen(self.port)

    def refuse(self, seconds: float) -> threading.Thread:
        """Cuts every connection and refuses new ones for ``seconds`` from now (a
        thread listens again then; join it to wait for that)."""
        self._unlisten()
        self.cut_all()

        def later() -> None:
            time.sleep(seconds)
            if not self.stopping.is_set():
                self._listen(self.port)

        thread = threading.Thread(target=later, name="faultproxy-relisten", daemon=True)
        thread.start()
        return thread

    # -- plumbing

    def _listen(self, port: int = 0) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(64)
        sock.settimeout(0.05)
        self.port = sock.getsockname()[1]
        self._listener = sock
        self._acceptor = threading.Thread(target=self._accept, args=(sock,), name="faultproxy-accept", daemon=True)
        self._acceptor.start()

    def _unlisten(self) -> None:
        sock, thread = self._listener, self._acceptor
        self._listener = self._acceptor = None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() under way
            sock.close()
        if thread is not None:
            thread.join(5)

    def _accept(self, listener: socket.socket) -> None:
        while not self.stopping.is_set() and self._listener is listener:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                pipe = _Pipe(self, conn)
            except OSError:
                conn.close()  # Redis is down: so is the proxy's side
                continue
            with self._lock:
                self._pipes.add(pipe)
                self.accepted += 1
            pipe.thread.start()

    def forget(self, pipe: _Pipe) -> None:
        with self._lock:
            self._pipes.discard(pipe)

    def close(self) -> None:
        self.stopping.set()
        self._unlisten()
        self.cut_all()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def script_call(function_names: dict[str, str], shas: dict[str, str], script: str,
                where: Callable[[list[bytes]], bool] | None = None) -> Match:
    """A predicate for the requests that run ``script`` (FCALL of its function or
    EVALSHA of its SHA), and that ``where`` accepts (given the whole request)."""
    names = {function_names[script].encode(), shas[script].encode()}

    def match(args: list[bytes]) -> bool:
        if len(args) < 2 or args[0].upper() not in (b"FCALL", b"EVALSHA") or args[1] not in names:
            return False
        return where is None or where(args)

    return match
