"""HTTP/1.1 over a plain socket, for the tests that need to control the bytes and
their timing (tests/web/test_guard.py, tests/web/test_edge.py): answers read off one
connection in order, Content-Length framed, an interim 100 Continue skipped."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import orjson

TIMEOUT_SECONDS = 20.0


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool = False  # the server closed the connection after a Connection: close

    def json(self) -> dict[str, object]:
        doc = orjson.loads(self.body)
        assert isinstance(doc, dict)
        return doc

    def problem(self) -> dict[str, object]:
        assert self.headers["content-type"] == "application/problem+json", self.headers
        doc = self.json()
        assert doc["status"] == self.status
        return doc


def connect(port: int, timeout_seconds: float = TIMEOUT_SECONDS) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_seconds)
    sock.settimeout(timeout_seconds)
    return sock


class Reader:
    """The answers of one connection, in order."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _more(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def answer(self) -> Answer:
        """The next final answer (an interim 100 Continue is skipped); after one that
        says Connection: close, whether the server then closed the connection."""
        while True:
            answer = self._next()
            if answer.status != 100:
                break
        if answer.headers.get("connection", "").lower() == "close":
            answer.closed = self.closed()
        return answer

    def _next(self) -> Answer:
        while b"\r\n\r\n" not in self.buf:
            assert self._more(), f"connection closed before an answer: {self.buf!r}"
        raw_head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        status_line, *lines = raw_head.decode("latin-1").split("\r\n")
        headers: dict[str, str] = {}
        for line in lines:
            name, value = line.split(":", 1)
            assert name.strip().lower() not in headers, f"header {name} twice"
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        while len(self.buf) < length:
            assert self._more(), "connection closed mid-body"
        body, self.buf = self.buf[:length], self.buf[length:]
        return Answer(int(status_line.split()[1]), headers, body)

    def closed(self) -> bool:
        """The server closed the connection (nothing more after the answers read)."""
        return self.buf == b"" and not self._more()


def read_answer(sock: socket.socket) -> Answer:
    return Reader(sock).answer()


def trickle(sock: socket.socket, body: bytes, pause_seconds: float, max_seconds: float) -> int:
    """Send all but the last byte of `body` a byte at a time, `pause_seconds` apart,
    until the server answers (or `max_seconds` pass); the bytes sent. The socket is
    left blocking, with `max_seconds` as its timeout."""
    sock.setblocking(False)
    sent = 0
    deadline = time.monotonic() + max_seconds
    try:
        while sent < len(body) - 1 and time.monotonic() < deadline:
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break  # the server answered
            except BlockingIOError:
                pass
            try:
                sock.send(body[sent : sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
            time.sleep(pause_seconds)
    finally:
        sock.setblocking(True)
        sock.settimeout(max_seconds)
    return sent
