"""The access log (`GATE_ACCESS_LOG=1`): one JSON line per request, written off the
event loop.

    a request answered (gate/web/recorder.py `RequestRecorder.record`, for the edge
    and the ASGI middleware alike) ──> `put`: one tuple appended to a bounded deque
        ACCESS_LOG_QUEUE_MAX lines already waiting ──> dropped and counted
        (gate_access_log_dropped_total): the loop never waits for the log
    the writer thread, every WRITE_INTERVAL_SECONDS (or at once while lines wait) ──>
        up to WRITE_BATCH_MAX lines formatted (orjson, secrets redacted as every line
        is) and written to stderr in one write, under the log handler's lock, so they
        never interleave with other lines

The line: `ts`, `level`, `logger` ("gate.access"), `msg`, `method`, `route` (the
route's template, never the raw path), `status`, `duration_ms`, `request_id`, and
`trace_id` when the request was traced (gate/base/tracing.py).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import orjson

from gate.base import logs
from gate.base.metrics import METRICS

log = logging.getLogger("gate.access")

ACCESS_LOG_QUEUE_MAX = 65_536
WRITE_BATCH_MAX = 4_096
WRITE_INTERVAL_SECONDS = 0.05

DROPPED = METRICS.counter(
    "gate_access_log_dropped_total",
    "Access log lines dropped because the writer thread was that far behind (GATE_ACCESS_LOG).",
)

_Line = tuple[float, str, str, int, float, str, "str | None"]


class AccessLog:
    """The bounded queue and its writer thread (started by `start`, drained by `stop`)."""

    def __init__(self, queue_max: int = ACCESS_LOG_QUEUE_MAX) -> None:
        self.queue_max = queue_max
        # deque's append and popleft are atomic: the loop appends, the thread pops.
        self._lines: collections.deque[_Line] = collections.deque()
        self._dropped = METRICS.counter_tally(DROPPED)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def put(
        self,
        method: str,
        route: str,
        status: int,
        elapsed: float,
        request_id: str,
        trace_id: str | None,
    ) -> None:
        lines = self._lines
        if len(lines) >= self.queue_max:
            self._dropped.inc()
            return
        lines.append((time.time(), method, route, status, elapsed, request_id, trace_id))

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gate-access-log", daemon=True)
        self._thread.start()

    def stop(self, timeout_seconds: float = 2.0) -> None:
        """Write what is queued, then end the thread (bounded)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_seconds)
        else:
            self.write_pending()

    def _run(self) -> None:
        while True:
            if not self.write_pending():
                if self._stop.is_set():
                    return
                self._stop.wait(WRITE_INTERVAL_SECONDS)

    def write_pending(self) -> int:
        """Write up to WRITE_BATCH_MAX queued lines; how many."""
        lines = self._lines
        batch: list[_Line] = []
        while lines and len(batch) < WRITE_BATCH_MAX:
            batch.append(lines.popleft())
        if not batch:
            return 0
        try:
            self._write(batch)
        except Exception:
            log.exception("access log: %d line(s) not written", len(batch))
        return len(batch)

    @staticmethod
    def _fields(line: _Line) -> dict[str, Any]:
        _, method, route, status, elapsed, request_id, trace_id = line
        fields: dict[str, Any] = {
            "method": method,
            "route": route,
            "status": status,
            "duration_ms": round(elapsed * 1000.0, 3),
            "request_id": request_id,
        }
        if trace_id is not None:
            fields["trace_id"] = trace_id
        return fields

    def _write(self, batch: list[_Line]) -> None:
        handler = logs.json_handler()
        if handler is None:
            # Not the JSON handler (tests, embedding): through logging, still off the loop.
            for line in batch:
                log.info(f"{line[1]} {line[2]} {line[3]}", extra=self._fields(line))
            return
        out = []
        for line in batch:
            entry: dict[str, Any] = {
                "ts": logs.timestamp(line[0]),
                "level": "info",
                "logger": log.name,
                "msg": f"{line[1]} {line[2]} {line[3]}",
            }
            entry.update(self._fields(line))
            out.append(logs.redact(orjson.dumps(entry).decode()))
        text = "\n".join(out) + "\n"
        handler.acquire()
        try:
            handler.stream.write(text)
            handler.stream.flush()
        finally:
            handler.release()
