"""Operations: request metrics and request log lines, pool sampling, /openapi.json
(issue #7).

The request middleware is a pure ASGI middleware (no BaseHTTPMiddleware: that one
spawns a task and copies the body per request): it takes or makes the request id,
opens the request's log context, echoes the id in `X-Request-Id`, and once the
answer is sent records gate_http_requests_total / gate_http_request_seconds under
the route's path template (never the raw path: ids would make a series per order)
and writes one log line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gate.base import logs
from gate.base.metrics import (
    METRICS,
    TALLY_FLUSH_SECONDS,
    CounterTally,
    HistogramTally,
    forget_dead_processes,
    process_stopping,
)
from gate.base.settings import SettingsError, env_float
from gate.extensions import Extension
from gate.store.resp import parse_redis_url
from gate.web import openapi

if TYPE_CHECKING:
    from gate.base.settings import Settings
    from gate.runtime import Gate

log = logging.getLogger("gate.request")
ops_log = logging.getLogger("gate.ops")

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

    def __init__(self, log_mode: str = "all") -> None:
        if log_mode not in REQUEST_LOG_MODES:
            raise ValueError(f"log_mode must be one of {REQUEST_LOG_MODES}")
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
        logs.begin_request(rid)
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
            self.recorder.record(
                self._route(scope), scope["method"], status, time.perf_counter() - started
            )


class PoolSampler:
    """Copies the database pool's occupancy into gauges, in every process.

    prometheus-client cannot call a function at scrape time in multi-process mode (the
    scrape may be answered by another worker), so each process samples its own pool
    on a short interval.
    """

    def __init__(self, gate: Gate, interval_seconds: float) -> None:
        self.gate = gate
        self.interval_seconds = interval_seconds

    def run_once(self) -> None:
        pool = self.gate.db.pool
        if pool is None:
            return
        METRICS.db_pool_in_use.set(pool.size - pool.freesize)
        # aiomysql keeps the waiters of `acquire()` on its condition; there is no
        # public count. Read defensively so an aiomysql upgrade cannot break serving.
        cond = getattr(pool, "_cond", None)
        waiters = getattr(cond, "_waiters", None)
        if waiters is not None:
            METRICS.db_pool_waiting.set(len(waiters))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once()
            except Exception:
                ops_log.exception("sampling the database pool failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_seconds)


async def flush_tallies(stop: asyncio.Event, interval_seconds: float = TALLY_FLUSH_SECONDS) -> None:
    """Adds this process's metric tallies (gate/base/metrics.py) to the metrics every
    interval, so that under several workers a scrape, which reads the shared files,
    is at most that late."""
    while not stop.is_set():
        try:
            METRICS.flush()
        except Exception:
            ops_log.exception("flushing the metric tallies failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_seconds)


def _secrets(settings: Settings) -> list[str]:
    found = [
        settings.jwt_secret.reveal(),
        settings.admin_token.reveal(),
        settings.admission_secret.reveal(),
    ]
    for secret in settings.webhook_secrets:
        found.append(secret.reveal())
        found.append(secret.reveal().removeprefix("whsec_"))
    found.append(settings.mysql.password.reveal())
    raw_password = urlsplit(settings.redis_url).password
    if raw_password:
        # As written in the URL (percent-encoded) …
        found.append(raw_password)
    redis_password = parse_redis_url(settings.redis_url).password
    if redis_password:
        # … and as redis-py uses it (decoded; also when given as ?password=).
        found.append(redis_password)
    api_key = os.environ.get("GATE_PAYMENT_API_KEY", "").strip()
    if api_key:
        found.append(api_key)
    return found


def request_log_mode(env: Any) -> str:
    mode = str(env.get("GATE_REQUEST_LOG", "all") or "all").strip().lower()
    if mode not in REQUEST_LOG_MODES:
        raise SettingsError(f"GATE_REQUEST_LOG must be one of {', '.join(REQUEST_LOG_MODES)}")
    return mode


def install(gate: Gate) -> Extension:
    env = gate.settings.environ
    log_mode = request_log_mode(env)
    sample_seconds = env_float(env, "GATE_METRICS_SAMPLE_SECONDS", 1.0, 0.05, 60.0)
    logs.redact_secrets(_secrets(gate.settings))
    rendered: list[bytes] = []

    async def openapi_json(request: Request) -> Response:
        # Rendered on first use, once every area has installed (and described its
        # own endpoints with openapi.add_operation), whatever the installation order.
        if not rendered:
            rendered.append(openapi.render())
        return Response(rendered[0], media_type="application/json")

    sampler = PoolSampler(gate, sample_seconds)
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    async def start() -> None:
        dead = forget_dead_processes()
        if dead:
            ops_log.info("dropped live gauges of ended workers", extra={"pids": dead})
        stop.clear()
        loop = asyncio.get_running_loop()
        tasks.append(loop.create_task(sampler.run(stop)))
        tasks.append(loop.create_task(flush_tallies(stop)))

    async def finish() -> None:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        tasks.clear()
        process_stopping()

    recorder = RequestRecorder(log_mode)
    return Extension(
        name="ops",
        routes=[Route("/openapi.json", openapi_json, methods=["GET"])],
        middleware=[Middleware(RequestObserver, recorder=recorder)],
        recorder=recorder,
        on_start=[start],
        on_stop=[finish],
    )


def cmd_openapi(args: argparse.Namespace) -> int:
    sys.stdout.write(openapi.render(indent=True).decode() + "\n")
    return 0


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    """Add this area's `gate` subcommands."""
    s = sub.add_parser("openapi", help="print the OpenAPI document of the HTTP API")
    s.set_defaults(fn=cmd_openapi)
