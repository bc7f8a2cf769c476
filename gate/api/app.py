"""The HTTP application: routes, error mapping, lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gate.api.deals import (
    DealViewEdge,
    admin_adjust_stock,
    admin_create_deal,
    admin_deal,
    admin_ledger,
    admin_pause,
    admin_rebucket,
    admin_resume,
    admin_set_window,
    deal_view,
)
from gate.api.health import (
    DatabaseProbe,
    healthz,
    metrics,
    readyz,
)
from gate.api.orders import (
    OrderViewEdge,
    order_cancel,
    order_view,
)
from gate.api.reservations import (
    Reserve,
    ReserveEdge,
)
from gate.base import logs
from gate.base.errors import Problem, not_found, overloaded
from gate.base.logs import configure
from gate.base.settings import Settings, load_settings
from gate.extensions import area_modules
from gate.runtime import Gate
from gate.store.db import DbUnavailable
from gate.web import docs_page
from gate.web.admin_guard import AdminAttempts, AdminGuard
from gate.web.edge import Edge, EdgeRoute
from gate.web.guard import BODY_METHODS, UNGUARDED_PATHS, BodyReceive, Guard
from gate.web.http_io import (
    exact_paths,
    send_answer,
)
from gate.web.metrics_listener import MetricsListener, loop_render
from gate.web.recorder import RequestRecorder

log = logging.getLogger("gate.app")

# The areas' modules load with the app, not only when a gate is built: an area adds
# its endpoints to the OpenAPI document as its module loads (gate/room/openapi.py),
# and the document is the same whoever asks first.
area_modules()


# The "id" path convertor (bounded digits) is registered by gate.web.http_io, which every
# area imports before it builds its routes.


# -- operations ----------------------------------------------------------------------


# -- buyers --------------------------------------------------------------------------


# Route names taken by the fast lane when present (the webhook comes with payments).
FAST_LANE_ROUTES = ("reserve", "webhook")


class FastLane:
    """The innermost middleware: the HTTP guard's two checks for every request (see
    gate/web/guard.py: the concurrency bound, the body deadline), then the hot POST
    routes (reservations, payment callbacks), plain ASGI applications, straight to
    their endpoints, past Starlette's exception middleware (which builds a Request
    for every request) and router (a regex per route), setting what the router would
    have set (the route, for the request metrics' label, and the path parameters).
    The request middleware still wraps it (its metrics and X-Request-Id cover the
    guard's answers), and an unexpected error still reaches the server-error
    handler; the endpoints answer their own problems. Everything else, a mounted
    app (root_path) included, goes the usual way.

    The guard is here, not a middleware of its own: one ASGI layer less on every
    request, which the sold-out rejection, a few microseconds long, notices."""

    def __init__(self, app: ASGIApp, routes: Sequence[Route], *, guard: Guard) -> None:
        self.app = app
        self.routes = tuple(routes)
        self.guard = guard  # shared with the edge (gate/web/edge.py)
        for route in self.routes:
            assert route.methods == {"POST"}, f"{route.path}: the fast lane is for POST routes"
            assert not inspect.isfunction(route.endpoint), f"{route.path}: not an ASGI endpoint"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNGUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        guard = self.guard
        if guard.in_flight >= guard.concurrency_max:
            await send_answer(send, guard.busy.encoded(scope["path"]))
            return
        guard.in_flight += 1
        try:
            method = scope["method"]
            if method in BODY_METHODS:
                receive = guard.body_receive(receive)
            if method == "POST" and not scope.get("root_path"):
                path = scope["path"]
                for route in self.routes:
                    match = route.path_regex.fullmatch(path)
                    if match is not None:
                        convert = route.param_convertors
                        scope["route"] = route
                        scope["endpoint"] = route.endpoint
                        scope["path_params"] = {
                            k: convert[k].convert(v) for k, v in match.groupdict().items()
                        }
                        await route.endpoint(scope, receive, send)
                        return
            await self.app(scope, receive, send)
        finally:
            guard.in_flight -= 1
            if type(receive) is BodyReceive:
                receive.close()


# -- admin ---------------------------------------------------------------------------


# -- errors --------------------------------------------------------------------------


async def _problem(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Problem)
    return exc.response(request.url.path)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return not_found("route").response(request.url.path)
    if exc.status_code == 405:
        # RFC 9110 § 15.5.6: a 405 lists the route's methods (the router's Allow).
        allow = {k: v for k, v in (exc.headers or {}).items() if k.lower() == "allow"}
        return Problem(
            "METHOD_NOT_ALLOWED", "Method not allowed on this route.", headers=allow
        ).response(request.url.path)
    return Problem("INVALID_REQUEST", str(exc.detail), status=exc.status_code).response()


async def _db_unavailable(request: Request, exc: Exception) -> Response:
    return overloaded("Database unavailable; retry shortly.").response(request.url.path)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    # Starlette answers from outside the request middleware, which adds X-Request-Id
    # to every other answer; the request's log context is still set here.
    ctx = logs.current.get()
    headers = {"X-Request-Id": ctx.request_id} if ctx is not None else None
    return Problem("INTERNAL", "Internal error.", headers=headers).response(request.url.path)


Handler = Callable[[Request], Awaitable[Response]]


def routes(*, public_metrics: bool = False) -> list[BaseRoute]:
    """The core's routes; /metrics among them only with `public_metrics` (dev)."""
    deal = "/v1/deals/{deal_id:id}"
    order = "/v1/orders/{order_id:str}"
    admin_deal_path = "/v1/admin/deals/{deal_id:id}"
    # The router tries routes in order: the hot path first.
    metrics_route = [Route("/metrics", metrics, methods=["GET"])] if public_metrics else []
    return [
        Route(deal + "/reservations", Reserve(), methods=["POST"], name="reserve"),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        *metrics_route,
        Route(deal, deal_view, methods=["GET"]),
        Route(order, order_view, methods=["GET"]),
        Route(order + "/cancel", order_cancel, methods=["POST"]),
        Route("/v1/admin/deals", admin_create_deal, methods=["POST"]),
        Route(admin_deal_path, admin_deal, methods=["GET"]),
        Route(admin_deal_path + "/stock", admin_adjust_stock, methods=["POST"]),
        Route(admin_deal_path + "/buckets", admin_rebucket, methods=["PUT"]),
        Route(admin_deal_path + "/window", admin_set_window, methods=["PUT"]),
        Route(admin_deal_path + "/pause", admin_pause, methods=["POST"]),
        Route(admin_deal_path + "/resume", admin_resume, methods=["POST"]),
        Route(admin_deal_path + "/ledger", admin_ledger, methods=["GET"]),
    ]


def tune_gc(gen0_threshold: int) -> None:
    """Python's cyclic garbage collector for a serving process, once it has started.

    With Python's default (a young collection every 700 net allocations of container
    objects) a request that waits for Redis or the database keeps its futures, task
    and dicts alive across loop turns, so collections come every few dozen requests,
    each promoting the requests in flight, and the older generations' collections
    then walk every object the process holds. Measured (docs/hotpath.md, lever 37):
    16-22 µs of a waiting-room join's 70-100 µs of gate CPU went to the collector;
    a sold-out answer, done within one step, paid almost none. Freezing what
    start-up made (never garbage) and waiting for `gen0_threshold` allocations
    leaves the collector almost idle; reference counting still frees nearly
    everything at once, and cyclic garbage is still collected, later (a young
    collection examines at most that many objects). 0 changes nothing."""
    if gen0_threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)


def build_app(settings: Settings, *, background: bool | None = None) -> Starlette:
    # Constructing the gate does no I/O; the lifespan starts it.
    gate = Gate(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # This process's own metrics listener: set only where this worker is the
        # whole gate (several workers: the supervising parent serves it and gives
        # the workers GATE_METRICS_ADDR=off; see gate/web/metrics_listener.py). Bound
        # first, so that a port in use fails start-up before any work starts.
        listener = None
        if settings.metrics_addr is not None:
            host, port = settings.metrics_addr
            try:
                listener = MetricsListener(
                    settings.metrics_addr, loop_render(asyncio.get_running_loop())
                ).start()
            except OSError as exc:
                log.error("cannot listen on GATE_METRICS_ADDR %s:%d: %s", host, port, exc)
                raise
        try:
            await gate.start(background=background)
            tune_gc(settings.gc_gen0_threshold)
            try:
                yield
            finally:
                await gate.stop()
        finally:
            if listener is not None:
                await asyncio.to_thread(listener.stop)

    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        Problem: _problem,
        HTTPException: _http_error,
        DbUnavailable: _db_unavailable,
        Exception: _unexpected,
    }
    all_routes = routes(public_metrics=settings.is_dev)
    if settings.docs:
        all_routes.extend(docs_page.routes())
    middleware = []
    inner = []
    for ext in gate.extensions:
        all_routes.extend(ext.routes)
        middleware.extend(ext.middleware)
        inner.extend(ext.inner_middleware)
    exact_paths(all_routes)
    lanes = [r for r in all_routes if isinstance(r, Route) and r.name in FAST_LANE_ROUTES]
    assert any(r.name == "reserve" for r in lanes), "the reservation route is missing"
    # One HTTP guard (gate/web/guard.py) for the fast lane and the edge: one bound on the
    # requests this worker holds, wherever they are answered.
    guard = Guard(
        concurrency_max=settings.http_concurrency_max,
        body_timeout_seconds=settings.body_timeout_seconds,
    )
    middleware.append(Middleware(FastLane, routes=lanes, guard=guard))
    # Attempts at the admin token counted per client address, for every admin route
    # (gate/web/admin_guard.py); inside the HTTP guard, outside the routes.
    middleware.append(
        Middleware(
            AdminGuard,
            attempts=AdminAttempts(gate.redis),
            auth=gate.admin_auth,
            trusted=settings.trusted_proxies,
            v6_prefix=settings.limit_ip_v6_prefix,
        )
    )
    middleware.extend(inner)
    app = Starlette(
        routes=all_routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers=handlers,
    )
    app.state.gate = gate
    app.state.db_probe = DatabaseProbe(gate.db)
    recorder = next((ext.recorder for ext in gate.extensions if ext.recorder), None)
    edge_routes: list[EdgeRoute] = [ReserveEdge(gate), DealViewEdge(gate), OrderViewEdge(gate)]
    for ext in gate.extensions:
        edge_routes.extend(ext.edge)
    # What gate.web.edge.EdgeProtocol answers itself (gate serve's protocol).
    app.state.edge = Edge(
        edge_routes, guard, recorder or RequestRecorder(), settings.body_max_bytes
    )
    return app


def create_app() -> Starlette:
    """uvicorn factory: every worker process reads the settings once."""
    settings = load_settings()
    configure(settings.log_level)
    return build_app(settings)
