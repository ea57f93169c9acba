"""A small TCP fault proxy to put between an S3 client and a (local) S3 server in tests.

``FaultProxy(port)`` listens on ``127.0.0.1`` (a free port) and forwards every connection to
``127.0.0.1:port``; what tests can do with it: docs/storage.md ("Fault injection for tests").
Threads: one accept thread, two pump threads per connection; :meth:`stop` closes everything
and joins with a deadline. Loopback only.
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

_ERRORS = {
    "503": (b"503 Slow Down", b"SlowDown", b"Please reduce your request rate."),
    "500": (b"500 Internal Server Error", b"InternalError", b"We encountered an internal error."),
}


@dataclass
class HttpFault:
    action: str
    """``503``, ``500`` or ``reset``."""
    every: int
    """Fault every ``every``-th matching request."""
    match: str = ""
    """Regex searched in the request line (``PUT /bucket/key?partNumber=2 HTTP/1.1``)."""
    seen: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.action not in ("503", "500", "reset"):
            raise ValueError(f"unknown HTTP fault {self.action!r}")


class _Closed(Exception):
    pass


def _close_quietly(sock: socket.socket, reset: bool = False) -> None:
    """Close ``sock``; ``reset``: with a TCP RST (zero linger) instead of a FIN."""
    with contextlib.suppress(OSError):
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    def __init__(self, upstream_port: int, *, http: bool = False, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.http = http
        self.http_faults: list[HttpFault] = []
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self.bytes_up = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()
        self._rate: float | None = None
        self._reset_at: int | None = None
        self._socks: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._accepter = threading.Thread(target=self._accept_loop, name="fault-proxy-accept", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ control
    def start(self) -> FaultProxy:
        self._accepter.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._running.set()
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            _close_quietly(s, reset=True)
        deadline = time.monotonic() + timeout
        for t in [self._accepter, *self._threads]:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stall(self) -> None:
        self._running.clear()
        with self._lock:
            self.injected["stall"] += 1

    def unstall(self) -> None:
        self._running.set()

    def set_rate(self, bytes_per_s: float | None) -> None:
        self._rate = bytes_per_s

    def reset_after(self, nbytes: int) -> None:
        with self._lock:
            self._reset_at = self.bytes_up + nbytes

    def add_http_fault(self, action: str, every: int, match: str = "") -> HttpFault:
        if not self.http:
            raise ValueError("HTTP faults need FaultProxy(..., http=True)")
        f = HttpFault(action, every, match)
        self.http_faults.append(f)
        return f

    # ------------------------------------------------------------------ plumbing
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _close_quietly(client, reset=True)  # the server is down: the client sees a reset, as it would
                continue
            for s in (client, upstream):
                s.settimeout(0.2)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks.update((client, upstream))
                up = threading.Thread(target=self._pump_up, args=(client, upstream), daemon=True)
                down = threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True)
                self._threads = [t for t in self._threads if t.is_alive()] + [up, down]
            up.start()
            down.start()

    def _close(self, *socks: socket.socket, reset: bool = False) -> None:
        for s in socks:
            with self._lock:
                self._socks.discard(s)
            _close_quietly(s, reset)

    def _recv(self, sock: socket.socket) -> bytes:
        while not self._stop.is_set():
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError as e:
                raise _Closed() from e
            if not data:
                raise _Closed()
            return data
        raise _Closed()

    def _send(self, sock: socket.socket, data: bytes, upward: bool, peers: tuple[socket.socket, ...]) -> None:
        while not self._running.is_set():
            if self._stop.is_set():
                raise _Closed()
            self._running.wait(0.05)
        if upward:
            with self._lock:
                self.bytes_up += len(data)
                hit = self._reset_at is not None and self.bytes_up >= self._reset_at
                if hit:
                    self._reset_at = None
                    self.injected["reset"] += 1
            if hit:
                self._close(*peers, reset=True)
                raise _Closed()
        rate = self._rate
        view = memoryview(data)
        while view:
            piece = view[:16384] if rate else view
            if rate:
                time.sleep(len(piece) / rate)
            try:
                n = sock.send(piece)
            except TimeoutError:
                if self._stop.is_set():
                    raise _Closed() from None
                continue
            except OSError as e:
                raise _Closed() from e
            view = view[n:]

    def _pump(self, src: socket.socket, dst: socket.socket, upward: bool) -> None:
        try:
            while True:
                self._send(dst, self._recv(src), upward, (src, dst))
        except _Closed:
            pass
        finally:
            self._close(src, dst)

    # ------------------------------------------------------------------ HTTP-aware upward pump
    def _pump_up(self, client: socket.socket, upstream: socket.socket) -> None:
        if not self.http:
            self._pump(client, upstream, True)
            return
        buf = b""
        peers = (client, upstream)
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    buf += self._recv(client)
                head, buf = buf.split(b"\r\n\r\n", 1)
                head += b"\r\n\r\n"
                line = head.split(b"\r\n", 1)[0].decode("latin-1")
                headers = {}
                for h in head.split(b"\r\n")[1:]:
                    if b":" in h:
                        k, v = h.split(b":", 1)
                        headers[k.strip().lower()] = v.strip().lower()
                action = self._choose(line)
                if action == "reset":
                    self._close(*peers, reset=True)
                    return
                if action in _ERRORS:
                    self._answer_error(client, upstream, action, headers, buf, line.startswith("HEAD "))
                    return
                self._send(upstream, head, True, peers)
                buf = self._forward_body(client, upstream, headers, buf, peers)
        except _Closed:
            pass
        finally:
            self._close(*peers)

    def _choose(self, line: str) -> str:
        with self._lock:
            self.requests += 1
            for f in self.http_faults:
                if f.match and not re.search(f.match, line):
                    continue
                f.seen += 1
                if f.seen % f.every == 0:
                    self.injected[f.action] += 1
                    return f.action
        return ""

    def _answer_error(self, client, upstream, action: str, headers: dict, buf: bytes, head_only: bool) -> None:
        length = int(headers.get(b"content-length", b"0") or 0)
        if b"100-continue" not in headers.get(b"expect", b"") and b"chunked" not in headers.get(
            b"transfer-encoding", b""
        ):
            while len(buf) < length:  # take the body off the wire so the client reads our answer
                buf += self._recv(client)
        status, code, message = _ERRORS[action]
        body = b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>" + code + b"</Code><Message>" + message + b"</Message></Error>"
        resp = (
            b"HTTP/1.1 " + status + b"\r\nContent-Type: application/xml\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + (b"" if head_only else body)
        )
        try:
            client.settimeout(2.0)
            client.sendall(resp)
            client.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self._close(upstream)
        time.sleep(0.05)  # let the client read the answer before the socket goes away
        self._close(client)

    def _forward_body(self, client, upstream, headers: dict, buf: bytes, peers) -> bytes:
        """Forward one request body; returns bytes already read that belong to the next request."""
        if b"chunked" in headers.get(b"transfer-encoding", b""):
            while True:
                while b"\r\n" not in buf:
                    buf += self._recv(client)
                size_line, rest = buf.split(b"\r\n", 1)
                size = int(size_line.split(b";")[0], 16)
                need = size + 2 if size else 0
                self._send(upstream, size_line + b"\r\n", True, peers)
                buf = rest
                if size == 0:
                    while b"\r\n\r\n" not in b"\r\n" + buf:
                        buf += self._recv(client)
                    trailer, buf = (b"\r\n" + buf).split(b"\r\n\r\n", 1)
                    self._send(upstream, trailer[2:] + b"\r\n\r\n" if trailer[2:] else b"\r\n", True, peers)
                    return buf
                while len(buf) < need:
                    buf += self._recv(client)
                self._send(upstream, buf[:need], True, peers)
                buf = buf[need:]
        left = int(headers.get(b"content-length", b"0") or 0)
        while left > 0:
            if not buf:
                buf = self._recv(client)
            piece, buf = buf[:left], buf[left:]
            self._send(upstream, piece, True, peers)
            left -= len(piece)
        return buf
