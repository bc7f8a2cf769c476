"""The request log line and request metrics, for every HTTP request: the request
middleware (`RequestObserver`) records the requests that reach the ASGI application,
and the edge (gate/web/edge.py) records the ones it answers itself with the same
`RequestRecorder`.

The request middleware is a pure ASGI middleware (no BaseHTTPMiddleware: that one
spawns a task and copies the body per request): it takes or makes the request id,
opens the request's log context, echoes the id in `X-Request-Id`, and once the
answer is sent records gate_http_requests_total / gate_http_request_seconds under
the route's path template (never the raw path: ids would make a series per order)
and writes one log line. With traces on (gate/base/tracing.py) it opens the request's
server span (`begin_asgi`) and ends it once the answer is sent; with the access log on
(GATE_ACCESS_LOG, gate/base/access_log.py) every request's line is queued for its
writer thread here, the edge's too.
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gate.base import logs, tracing
from gate.base.access_log import AccessLog
from gate.base.metrics import METRICS, CounterTally, HistogramTally

log = logging.getLogger("gate.request")

UNMATCHED_ROUTE = "unmatched"
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
REQUEST_ID_HEADER = b"x-request-id"
REQUEST_LOG_MODES = ("all", "errors", "off")


def route_label(path: str) -> str:
    """A route's path template without converters: "/v1/deals/{deal_id:int}" →
    "/v1/deals/{deal_id}"."""
    parts = []
    for piece in path.split("/"):
        if piece.startswith("{") and piece.endswith("}"):
            piece = "{" + piece[1:-1].split(":", 1)[0] + "}"
        parts.append(piece)
    return "/".join(parts)


class RequestRecorder:
    """The request metrics and log line of one answered request (the request
    middleware's, and the edge's for the requests it answers, gate/web/edge.py)."""

    def __init__(self, log_mode: str = "all", access: AccessLog | None = None) -> None:
        if log_mode not in REQUEST_LOG_MODES:
            raise ValueError(f"log_mode must be one of {REQUEST_LOG_MODES}")
        self.access = access
        self.log_all = log_mode == "all"
        self.log_errors = log_mode in ("all", "errors")
        # Caches keep the per-request cost to dictionary lookups: prometheus-client's
        # labels() (a lock and a tuple build) runs once per series.
        self._counters: dict[tuple[str, str, int], CounterTally] = {}
        self._timers: dict[str, HistogramTally] = {}

    def record(self, route: str, method: str, status: int, elapsed: float) -> None:
        if method not in KNOWN_METHODS:
            method = "OTHER"
        key = (route, method, status)
        counter = self._counters.get(key)
        if counter is None:
            series = METRICS.http_requests.labels(route, method, str(status))
            counter = METRICS.counter_tally(series)
            self._counters[key] = counter
        counter.inc()
        timer = self._timers.get(route)
        if timer is None:
            timer = METRICS.histogram_tally(METRICS.http_request_seconds.labels(route))
            self._timers[route] = timer
        timer.observe(elapsed)
        if (self.log_all or (self.log_errors and status >= 500)) and log.isEnabledFor(logging.INFO):
            logs.write_line(
                log,
                f"{method} {route} {status}",
                {
                    "method": method,
                    "route": route,
                    "status": status,
                    "duration_ms": round(elapsed * 1000.0, 3),
                },
            )
        access = self.access
        if access is not None:
            ctx = logs.current.get()
            access.put(
                method,
                route,
                status,
                elapsed,
                ctx.request_id if ctx is not None else "",
                tracing.trace_id(ctx) if tracing.ENABLED else None,
            )


class RequestObserver:
    """Request id, request metrics and the request log line, for every HTTP request
    that reaches the ASGI application (the edge does the same for its own)."""

    def __init__(self, app: ASGIApp, *, recorder: RequestRecorder | None = None) -> None:
        self.app = app
        self.recorder = recorder or RequestRecorder()
        # Label resolution runs once per route.
        self._labels: dict[int, str] = {}

    def _route(self, scope: Scope) -> str:
        route = scope.get("route")
        if route is None:
            return UNMATCHED_ROUTE
        label = self._labels.get(id(route))
        if label is None:
            label = route_label(getattr(route, "path", "") or UNMATCHED_ROUTE)
            self._labels[id(route)] = label
        return label

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        rid = None
        for name, value in scope["headers"]:
            if name == REQUEST_ID_HEADER:
                rid = logs.sane_request_id(value)
                break
        if rid is None:
            rid = logs.new_request_id()
        ctx = logs.begin_request(rid, started)
        if tracing.ENABLED:
            tracing.begin_asgi(ctx, scope)
        rid_header = (REQUEST_ID_HEADER, rid.encode("ascii"))
        status = 500  # until a response starts: an error escaped, or the client left

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                # The message is made for this one send (send_answer, Starlette's
                # responses); its header list may be kept by its maker, so a new list.
                message["headers"] = [*message.get("headers", ()), rid_header]
            await send(message)

        # The context is not reset on the way out: the request's task ends with the
        # request, and the 500 handler outside this middleware logs in it afterwards.
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = self._route(scope)
            self.recorder.record(route, scope["method"], status, time.perf_counter() - started)
            if tracing.ENABLED:
                tracing.finish(ctx, scope["method"], route, status)
