"""/metrics on a listener of its own (GATE_METRICS_ADDR), off the buyers' port.

The public port faces the internet; the metrics name every route, deal and
dependency state, and rendering them costs CPU an attacker could ask for at will.
Outside GATE_ENV=dev the public port therefore has no /metrics (404, as any unknown
path); the scrape goes to GATE_METRICS_ADDR (unset: 127.0.0.1 at `gate serve`'s
--port + 10000, gate/base/settings.py `metrics_address`; `off`: none). With
GATE_ENV=dev the public port keeps /metrics too (gate/api/app.py).

Who serves it, so that one scrape shows the whole gate as /metrics always did:

    gate serve --workers 1        uvicorn runs the worker in the `gate` process:
      the worker's lifespan        the listener is a thread of that process, reading
      (gate/api/app.py) starts it      its in-process registry
    gate serve --workers N>1      the workers write their values to the
      the supervising parent       multi-process files (gate/base/metrics.py); the parent
      (gate/cli/__init__.py run_server)     starts the listener before the workers and merges
      starts it                    every worker's files per scrape; the workers get
                                   GATE_METRICS_ADDR=off

The parent rather than one of the workers: it exists once, outlives any worker the
supervisor restarts (no port to hand over, no scrape lost to a restart) and answers
no buyer, so merging the files costs the buyers' event loops nothing. With one
worker there is no other process; the render runs on a thread of the listener, so
the event loop waits for it at most one interpreter switch interval (5 ms) at a time.
The loop adds its own tallies (gate/base/metrics.py) first, in a callback on the loop:
they are written by the loop's thread alone.

Slow clients cannot stop scrapes. The listener is an event loop of its own (a
thread), where a connection that sends nothing costs a few hundred bytes, not a
thread:

    accept -> CONNECTIONS_MAX open already? the oldest one still sending its head is
              closed for it (none: the new one is)
           -> the request head, at most HEAD_MAX_BYTES, complete within
              HEAD_DEADLINE_SECONDS of the accept (a byte now and then does not extend
              it), else the connection is closed unanswered
           -> GET /metrics: rendered on one of RENDERS_MAX threads, answered, closed;
              the whole connection, answer included, ends within
              CONNECTION_DEADLINE_SECONDS of the accept
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from gate.base.errors import Problem, not_found
from gate.base.metrics import CONTENT_TYPE, METRICS, render_files

log = logging.getLogger("gate.metrics")

CONNECTIONS_MAX = 32
HEAD_DEADLINE_SECONDS = 2.0
HEAD_MAX_BYTES = 8192
CONNECTION_DEADLINE_SECONDS = 10.0
RENDERS_MAX = 2
BACKLOG = 64
# How long a scrape waits for the event loop to add its tallies before rendering
# without them (a loop that busy is what the scrape should show, late or not).
FLUSH_WAIT_SECONDS = 1.0
PATH = "/metrics"
_ALLOWED = (b"GET", b"HEAD")


def listen_socket(address: tuple[str, int]) -> socket.socket:
    """A listening socket on `address` ("host" with a colon: IPv6); OSError when the
    address cannot be bound (in use, not this host's)."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _answer(status: int, reason: str, content_type: str, body: bytes, head_only: bool) -> bytes:
    head = (
        f"HTTP/1.0 {status} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode("latin-1")
    return head if head_only else head + body


def _problem(problem: Problem, path: str, head_only: bool) -> bytes:
    status, headers, body = problem.encoded(path)
    content_type = dict(headers)[b"content-type"].decode("latin-1")
    return _answer(status, problem.title, content_type, body, head_only)


class _Connection(asyncio.Protocol):
    """One scrape: its head within the deadline, then the answer, then closed."""

    def __init__(self, listener: MetricsListener) -> None:
        self.listener = listener
        self.reading = True
        self._head = bytearray()
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._end = 0.0  # the loop's time the connection must have ended by

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(HEAD_DEADLINE_SECONDS, self.abort)
        # The whole connection's deadline, counted from the accept as well.
        self._end = loop.time() + CONNECTION_DEADLINE_SECONDS
        self.listener.opened(self)

    def data_received(self, data: bytes) -> None:
        if not self.reading:
            return
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            end = self._head.find(b"\n\n")
        if end < 0:
            if len(self._head) > HEAD_MAX_BYTES:
                self.abort()
            return
        self.reading = False
        assert self._transport is not None and self._timer is not None
        self._transport.pause_reading()
        self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(self._end, self.abort)
        self._request(bytes(self._head[:end]).split(b"\n", 1)[0].rstrip(b"\r"))

    def _request(self, line: bytes) -> None:
        parts = line.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            self.send(_answer(400, "Bad Request", "text/plain", b"bad request line\n", False))
            return
        method, target = parts[0], parts[1].decode("latin-1")
        path = target.split("?", 1)[0]
        head_only = method == b"HEAD"
        if method not in _ALLOWED:
            refused = Problem("METHOD_NOT_ALLOWED", "Only GET and HEAD are served here.")
            self.send(_problem(refused, path, False))
        elif path != PATH:
            self.send(_problem(not_found("route"), path, head_only))
        else:
            self.listener.render(self, head_only)

    def send(self, answer: bytes) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.write(answer)
            # Closed once written (the connection's deadline still applies).
            transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.listener.closed(self)


class MetricsListener:
    """The listener on (host, port), served by a thread of its own until `stop()`."""

    def __init__(self, address: tuple[str, int], render: Callable[[], bytes]) -> None:
        # Binds now: a port in use fails start-up with the OSError.
        self._sock = listen_socket(address)
        self._render = render
        self._connections: dict[_Connection, None] = {}
        self._renders = ThreadPoolExecutor(RENDERS_MAX, thread_name_prefix="gate-metrics-render")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gate-metrics", daemon=True)

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def start(self) -> MetricsListener:
        self._thread.start()
        self._started.wait()
        host, port = self._sock.getsockname()[:2]
        log.info("metrics on http://%s:%d%s", host, port, PATH)
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(loop.stop)
            self._thread.join(CONNECTION_DEADLINE_SECONDS)
        self._renders.shutdown(wait=False, cancel_futures=True)
        self._sock.close()

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            server = loop.run_until_complete(
                loop.create_server(lambda: _Connection(self), sock=self._sock)
            )
        except BaseException:
            loop.close()
            raise
        finally:
            self._started.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for conn in list(self._connections):
                conn.abort()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    # -- called on the listener's loop ---------------------------------------------------

    def opened(self, conn: _Connection) -> None:
        if len(self._connections) >= CONNECTIONS_MAX:
            # The oldest connection still sending its head makes room (a scrape's head
            # comes in one packet); with none, the new one is turned away.
            oldest = next((c for c in self._connections if c.reading), None)
            if oldest is None:
                conn.abort()
                return
            oldest.abort()
            self._connections.pop(oldest, None)
        self._connections[conn] = None

    def closed(self, conn: _Connection) -> None:
        self._connections.pop(conn, None)

    def render(self, conn: _Connection, head_only: bool) -> None:
        assert self._loop is not None
        try:
            done = self._loop.run_in_executor(self._renders, self._render)
        except RuntimeError:  # stopping
            conn.abort()
            return

        def answer(future: asyncio.Future[bytes]) -> None:
            if future.cancelled():
                conn.abort()
                return
            exc = future.exception()
            if exc is not None:
                log.error("rendering the metrics failed", exc_info=exc)
                body = b"rendering the metrics failed\n"
                conn.send(_answer(500, "Internal Server Error", "text/plain", body, head_only))
                return
            conn.send(_answer(200, "OK", CONTENT_TYPE, future.result(), head_only))

        done.add_done_callback(answer)


def loop_render(loop: asyncio.AbstractEventLoop) -> Callable[[], bytes]:
    """The render of a single-process gate, called on a thread of the listener: the
    loop adds its tallies, then the registry is rendered here."""

    def render() -> bytes:
        flushed = threading.Event()

        def flush() -> None:
            try:
                METRICS.flush()
            finally:
                flushed.set()

        with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to add
            loop.call_soon_threadsafe(flush)
            flushed.wait(FLUSH_WAIT_SECONDS)
        return METRICS.render(flush=False)

    return render


def files_render(path: str) -> Callable[[], bytes]:
    """The render of the supervising parent: every worker's files merged."""
    return lambda: render_files(path)
