"""/metrics on a listener of its own (GATE_METRICS_ADDR), off the buyers' port.

The public port faces the internet; the metrics name every route, deal and
dependency state, and rendering them costs CPU an attacker could ask for at will.
Outside GATE_ENV=dev the public port therefore has no /metrics (404, as any unknown
path); the scrape goes to GATE_METRICS_ADDR (default 127.0.0.1:9100, `off`: none).
With GATE_ENV=dev the public port keeps /metrics too (gate/api/app.py).

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
worker there is no other process; the render runs on the listener's thread, so the
event loop waits for it at most one interpreter switch interval (5 ms) at a time.
The loop adds its own tallies (gate/base/metrics.py) first, in a callback on the loop:
they are written by the loop's thread alone.

Bounds: at most CONNECTIONS_MAX scrapes at once (more are closed at once), each
connection's reads time out after READ_TIMEOUT_SECONDS, the request head is bounded
by the standard library's (64 KiB line, 100 fields), one request per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gate.base.errors import not_found
from gate.base.metrics import CONTENT_TYPE, METRICS, render_files

log = logging.getLogger("gate.metrics")

CONNECTIONS_MAX = 8
READ_TIMEOUT_SECONDS = 10.0
# How long a scrape waits for the event loop to add its tallies before rendering
# without them (a loop that busy is what the scrape should show, late or not).
FLUSH_WAIT_SECONDS = 1.0
PATH = "/metrics"


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = READ_TIMEOUT_SECONDS
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path != PATH:
            status, headers, body = not_found("route").encoded(path)
            content_type = dict(headers)[b"content-type"].decode("latin-1")
            self._answer(status, content_type, body)
            return
        try:
            body = self.server.render()
        except Exception:
            log.exception("rendering the metrics failed")
            self._answer(500, "text/plain; charset=utf-8", b"rendering the metrics failed\n")
            return
        self._answer(200, CONTENT_TYPE, body)

    def _answer(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """No line per scrape (the standard library writes one to stderr)."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], render: Callable[[], bytes]) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.render = render
        self._slots = threading.BoundedSemaphore(CONNECTIONS_MAX)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MetricsListener:
    """The listener on (host, port), served by a daemon thread until `stop()`."""

    def __init__(self, address: tuple[str, int], render: Callable[[], bytes]) -> None:
        # Binds now: a port in use fails start-up with the OSError.
        self._server = _Server(address, render)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="gate-metrics", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> MetricsListener:
        self._thread.start()
        host, port = self._server.server_address[:2]
        log.info("metrics on http://%s:%d%s", host, port, PATH)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(READ_TIMEOUT_SECONDS)
        self._server.server_close()


def loop_render(loop: asyncio.AbstractEventLoop) -> Callable[[], bytes]:
    """The render of a single-process gate, called on the listener's thread: the
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
