"""The HTTP application: routes, error mapping, lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gate import apidocs, logs, orders, validate
from gate.db import Database, DbUnavailable
from gate.edge import INTERNAL, Edge, EdgeRequest, EdgeRoute
from gate.errors import Encoded, Problem, RawResponse, invalid, not_found, overloaded
from gate.guard import BODY_METHODS, UNGUARDED_PATHS, BodyReceive, Guard
from gate.http import (
    exact_paths,
    json_answer,
    json_body,
    json_response,
    read_json,
    receive_json,
    send_answer,
)
from gate.limits import client_ip, device_id
from gate.logs import configure
from gate.metrics import CONTENT_TYPE, METRICS, CounterTally
from gate.metrics_listener import MetricsListener, loop_render
from gate.ops import RequestRecorder
from gate.reservations import MAX_QUANTITY, QueuedCall, Reserved, ReserveRequest
from gate.runtime import Gate
from gate.settings import Settings, load_settings

log = logging.getLogger("gate.app")

MAX_ID = validate.MAX_ID
READY_TIMEOUT_SECONDS = 1.0
# /readyz answers from a database probe at most this old: a flood of readiness checks
# costs the database one statement a second per process (issue #12).
READY_DB_PROBE_SECONDS = 1.0
RESERVATION_FIELDS = {"quantity"}
RESERVE_ROUTE = "/v1/deals/{deal_id}/reservations"
DEAL_ROUTE = "/v1/deals/{deal_id}"
ORDER_ROUTE = "/v1/orders/{order_id}"
ORDER_PREFIX = b"/v1/orders/"
_ORDER_ID = re.compile(orders.ORDER_ID_RE.pattern.encode("ascii"))


def _gate(request: Request) -> Gate:
    gate: Gate = request.app.state.gate
    return gate


# The "id" path convertor (bounded digits) is registered by gate.http, which every
# area imports before it builds its routes.


def _deal_id(request: Request) -> int:
    deal_id: int = request.path_params["deal_id"]
    if not 1 <= deal_id <= MAX_ID:
        raise not_found("deal")
    return deal_id


# -- operations ----------------------------------------------------------------------


async def healthz(request: Request) -> Response:
    return json_response({"status": "ok"})


class DatabaseProbe:
    """The database part of /readyz: one `SELECT 1`, its verdict ("ok" or why not)
    kept for `ttl_seconds` and shared by every readiness check meanwhile (those that
    arrive while it runs wait for it), so that readiness checks cannot put load on
    the database."""

    def __init__(self, db: Database, ttl_seconds: float = READY_DB_PROBE_SECONDS) -> None:
        self.db = db
        self.ttl_seconds = ttl_seconds
        self._verdict: tuple[float, str] | None = None  # (valid until, verdict)
        self._running: asyncio.Task[str] | None = None

    async def verdict(self) -> str:
        kept = self._verdict
        if kept is not None and kept[0] > time.monotonic():
            return kept[1]
        if self._running is None:
            self._running = asyncio.get_running_loop().create_task(self._probe())
        return await asyncio.shield(self._running)

    async def _probe(self) -> str:
        sent = time.monotonic()
        try:
            await asyncio.wait_for(self.db.fetchone("SELECT 1"), READY_TIMEOUT_SECONDS)
            verdict = "ok"
        except Exception as exc:
            verdict = f"unavailable: {type(exc).__name__}"
        finally:
            self._running = None
        self._verdict = (sent + self.ttl_seconds, verdict)
        return verdict


async def readyz(request: Request) -> Response:
    """Ready when Redis and the database answer; the body also reports degraded
    states (an open circuit, a saturated pool) that do not stop the gate serving.
    Redis is pinged on every call; the database verdict is at most a second old
    (DatabaseProbe)."""
    gate = _gate(request)
    checks: dict[str, str] = {}
    try:
        await asyncio.wait_for(gate.redis.ping(), READY_TIMEOUT_SECONDS)
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = f"unavailable: {type(exc).__name__}"
    probe: DatabaseProbe = request.app.state.db_probe
    checks["database"] = await probe.verdict()
    pool = gate.db.pool_stats()
    details: dict[str, Any] = {
        "redis_circuit": gate.reservations.circuit_state,
        "db_pool": pool,
        # The node this process writes to (gate/dbwriter.py), and each node's verdict
        # when GATE_MYSQL_URL names several.
        "db_writer": gate.db.node,
        "db_nodes": gate.db.selector.status()
        if gate.settings.mysql.clustered and gate.db.selector is not None
        else {},
    }
    degraded = gate.reservations.circuit_state != "closed" or (
        pool["reservation_in_use"] >= pool["reservation_max"]
    )
    if all(v == "ok" for v in checks.values()):
        status = "degraded" if degraded else "ready"
        return json_response({"status": status, "checks": checks, **details})
    return Problem(
        "OVERLOADED", "A dependency is unavailable.", extra={"checks": checks, **details}
    ).response()


async def metrics(request: Request) -> Response:
    """/metrics on the public port, with GATE_ENV=dev only (elsewhere the metrics
    listener serves it, gate/metrics_listener.py). The loop adds its tallies, a
    thread renders: the loop is not held for the whole render."""
    METRICS.flush()
    body = await asyncio.to_thread(METRICS.render, flush=False)
    return Response(body, media_type=CONTENT_TYPE)


# -- buyers --------------------------------------------------------------------------


async def deal_view(request: Request) -> Response:
    return RawResponse(*await _deal_answer(_gate(request), _deal_id(request)))


async def _deal_answer(gate: Gate, deal_id: int) -> Encoded:
    """GET /v1/deals/{id}'s answer, on the ASGI route and at the edge alike."""
    try:
        return json_answer(await gate.deals.public_view(deal_id))
    except DbUnavailable:
        raise overloaded("Database unavailable; retry shortly.") from None


class DealViewEdge(EdgeRoute):
    """GET /v1/deals/{id} at the edge (gate/edge.py): the buyer's view of a deal,
    which a crowd refreshes while it waits for the sale, past Starlette's middleware
    and router (what was most of its cost: docs/hotpath.md lever 56); the same answer
    as `deal_view`, made by `_deal_answer`, in a task (the view may read Redis and,
    once per deal and process, the database)."""

    __slots__ = ("gate",)

    def __init__(self, gate: Gate) -> None:
        super().__init__(b"GET", b"/v1/deals/", b"", DEAL_ROUTE)
        self.gate = gate

    def handle(self, req: EdgeRequest) -> None:
        if not 1 <= req.id <= MAX_ID:
            raise not_found("deal")
        req.run(_deal_answer(self.gate, req.id))


_RESERVE_HEADERS = frozenset(
    (
        b"authorization",
        b"idempotency-key",
        b"x-device-id",
        b"content-type",
        b"content-length",
        b"x-forwarded-for",
        b"admission-token",
    )
)
_OUTCOMES: dict[str, CounterTally] = {}
# Every admitted reservation's latency, as a tally (see _count): under several workers
# an observation written to the shared files costs more than a sold-out answer.
_LATENCY = METRICS.histogram_tally(METRICS.reservation_latency)
_REPLAYED = {"Idempotent-Replayed": "true"}


def _count(outcome: str) -> None:
    counter = _OUTCOMES.get(outcome)
    if counter is None:
        counter = _OUTCOMES[outcome] = METRICS.counter_tally(METRICS.reservations.labels(outcome))
    counter.inc()


def _checked_headers(
    gate: Gate, headers: dict[bytes, str], deal_id: int
) -> tuple[int, str, str | None]:
    """A reservation's buyer, Idempotency-Key and device, checked in the order every
    answer depends on (an unauthenticated request learns nothing about the deal)."""
    user_id = gate.buyer_auth.user_id(headers.get(b"authorization"))
    if not 1 <= deal_id <= MAX_ID:
        raise not_found("deal")
    key = validate.idempotency_key(headers.get(b"idempotency-key"))
    validate.admission_token(headers.get(b"admission-token"))
    return user_id, key, device_id(headers.get(b"x-device-id"))


def _prepared(
    gate: Gate,
    headers: dict[bytes, str],
    deal_id: int,
    checked: tuple[int, str, str | None],
    body: dict[str, Any],
    path: str,
    client: tuple[str, int] | None,
) -> Encoded | ReserveRequest:
    """A valid reservation's request for the gate, or the near-caches' answer to it
    (most of a sale's requests end here, without an exception or a coroutine)."""
    user_id, key, device = checked
    if len(body) != 1:
        # The body is {"quantity": n} and nothing else (the OpenAPI schema's
        # additionalProperties: false): a field the fingerprint would not cover must
        # not ride along with an idempotency key.
        validate.no_unknown(body, RESERVATION_FIELDS)
    quantity = validate.integer(body, "quantity", 1, MAX_QUANTITY)
    early = gate.reservations.sold_out_answer(deal_id, user_id, quantity, path)
    if early is not None:
        _count("SOLD_OUT")
        return early
    ip = client_ip(
        client[0] if client else None,
        headers.get(b"x-forwarded-for"),
        gate.settings.trusted_proxies,
        gate.settings.limit_ip_v6_prefix,
    )
    early = gate.reservations.limited_answer(deal_id, user_id, ip, device, path)
    if early is not None:
        _count("RATE_LIMITED")
        return early
    return ReserveRequest(
        deal_id, user_id, quantity, key, ip, device, headers.get(b"admission-token")
    )


async def _reserved(gate: Gate, req: ReserveRequest, path: str, started: float) -> Encoded:
    """The answer to a reservation the near-caches let through.

    Answers made before the admission (invalid requests, the near-caches' "sold out"
    and "rate limited") are counted by outcome but not timed in the reservation
    histogram: they take microseconds, the request histogram of the route has them,
    and under a sold-out flood they would bury the latency of the reservations that
    did reach Redis and the database, which is what the latency alert watches."""
    return await _answered(gate.reservations.reserve(req), path, started)


async def _answered(work: Awaitable[Reserved], path: str, started: float) -> Encoded:
    try:
        result = await work
    except Problem as problem:
        return _refused(problem, path, started)
    except DbUnavailable:
        _count("OVERLOADED")
        return overloaded("Database unavailable; retry shortly.").encoded(path)
    return _reserved_answer(result, started)


def _refused(problem: Problem, path: str, started: float) -> Encoded:
    _count(problem.code)
    _LATENCY.observe(time.perf_counter() - started)
    return problem.encoded(path)


def _reserved_answer(result: Reserved, started: float) -> Encoded:
    _LATENCY.observe(time.perf_counter() - started)
    if result.queued:
        _count("queued")
        location = {"location": f"/v1/orders/{result.body['order_id']}"}
        return json_answer(result.body, 202, location)
    if result.replayed:
        _count("replayed")
        return json_answer(result.body, 200, _REPLAYED)
    _count("created")
    return json_answer(result.body, 201)


class Reserve:
    """POST /v1/deals/{id}/reservations, the hot path, as a plain ASGI application for
    what the edge (ReserveEdge) hands over: one pass over the headers, the body read
    straight from `receive`, problems answered right here (not through Starlette's
    exception middleware) from their kept encodings, the answer sent without a
    Response object."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gate: Gate = scope["app"].state.gate
        started = time.perf_counter()
        headers = {k: v.decode("latin-1") for k, v in scope["headers"] if k in _RESERVE_HEADERS}
        deal_id = scope["path_params"]["deal_id"]
        path = scope["path"]
        try:
            checked = _checked_headers(gate, headers, deal_id)
            body = await receive_json(
                receive,
                gate.settings.body_max_bytes,
                headers.get(b"content-type", ""),
                headers.get(b"content-length"),
            )
            prepared = _prepared(
                gate, headers, deal_id, checked, validate.obj(body), path, scope.get("client")
            )
        except Problem as problem:
            _count(problem.code)
            await send_answer(send, problem.encoded(path))
            return
        if type(prepared) is ReserveRequest:
            await send_answer(send, await _reserved(gate, prepared, path, started))
        else:
            await send_answer(send, prepared)  # type: ignore[arg-type]


class ReserveEdge(EdgeRoute):
    """POST /v1/deals/{id}/reservations at the edge (gate/edge.py): the same answers
    as `Reserve`, made by the same functions; a sold-out or rate-limited answer, and
    every invalid request, written before any task or coroutine is made."""

    __slots__ = ("gate",)

    def __init__(self, gate: Gate) -> None:
        super().__init__(b"POST", b"/v1/deals/", b"/reservations", RESERVE_ROUTE)
        self.gate = gate

    def handle(self, req: EdgeRequest) -> None:
        gate = self.gate
        headers = req.headers_in(_RESERVE_HEADERS)
        try:
            checked = _checked_headers(gate, headers, req.id)
            body = json_body(
                req.body,
                gate.settings.body_max_bytes,
                headers.get(b"content-type", ""),
                headers.get(b"content-length"),
            )
            prepared = _prepared(
                gate, headers, req.id, checked, validate.obj(body), req.path, req.client
            )
        except Problem as problem:
            _count(problem.code)
            req.answer(problem.encoded(req.path))
            return
        if type(prepared) is not ReserveRequest:
            req.answer(prepared)  # type: ignore[arg-type]
            return
        call = gate.reservations.start_queued(prepared)
        if call is None:
            req.run(_reserved(gate, prepared, req.path, req.started))
            return
        call.admit.add_done_callback(
            partial(self._settled, req, prepared, call), context=req.context
        )

    def _settled(
        self, req: EdgeRequest, prepared: ReserveRequest, call: QueuedCall, _: object
    ) -> None:
        """A queue-mode admission's reply is in (`Reservations.settle_queued`): the 202
        written now, or the rest of the way in a task."""
        try:
            outcome = self.gate.reservations.settle_queued(prepared, call)
            if type(outcome) is Reserved:
                req.answer(_reserved_answer(outcome, req.started))
            else:
                req.run(_answered(outcome, req.path, req.started))  # type: ignore[arg-type]
        except Problem as problem:
            req.answer(_refused(problem, req.path, req.started))
        except Exception:
            log.exception("unhandled error on %s %s", req.method, req.path)
            req.answer(INTERNAL.encoded(req.path))


# Route names taken by the fast lane when present (the webhook comes with payments).
FAST_LANE_ROUTES = ("reserve", "webhook")


class FastLane:
    """The innermost middleware: the HTTP guard's two checks for every request (see
    gate/guard.py: the concurrency bound, the body deadline), then the hot POST
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
        self.guard = guard  # shared with the edge (gate/edge.py)
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


async def order_view(request: Request) -> Response:
    gate = _gate(request)
    user_id = gate.buyer_auth.user_id(request.headers.get("authorization"))
    return RawResponse(*await _order_answer(gate, request.path_params["order_id"], user_id))


async def _order_answer(gate: Gate, order_id: str, user_id: int) -> Encoded:
    """GET /v1/orders/{id}'s answer, on the ASGI route and at the edge alike."""
    if gate.queue is not None:
        # A queued order's polls are answered by Redis where it knows the answer.
        early = await gate.queue.view_before_database(order_id, user_id)
        if early is not None:
            return json_answer(early)
    try:
        order = await orders.get_for_buyer(gate.db, order_id, user_id)
    except Problem as problem:
        # Not in the database: perhaps waiting in a queue (gate/queue/).
        queued = await gate.queue.view(order_id, user_id) if gate.queue else None
        if problem.code != "NOT_FOUND" or queued is None:
            raise
        return json_answer(queued)
    except DbUnavailable:
        raise overloaded("Database unavailable; retry shortly.") from None
    return json_answer(order.view())


class OrderViewEdge(EdgeRoute):
    """GET /v1/orders/{id} at the edge (gate/edge.py): a buyer's poll of an order,
    which a crowd in queue mode repeats until its order is committed; the same
    answer as `order_view`, made by `_order_answer`, in a task. Only an id spelled
    as the gate makes them (26 Crockford base-32 digits) is taken here; any other
    goes to the ASGI route, which answers it (404)."""

    __slots__ = ("gate",)

    def __init__(self, gate: Gate) -> None:
        super().__init__(b"GET", ORDER_PREFIX, b"", ORDER_ROUTE)
        self.gate = gate

    def key_of(self, middle: bytes) -> int | None:
        return 0 if _ORDER_ID.fullmatch(middle) else None

    def handle(self, req: EdgeRequest) -> None:
        user_id = self.gate.buyer_auth.user_id(req.header(b"authorization"))
        order_id = req.path[len(ORDER_PREFIX) :]
        req.run(_order_answer(self.gate, order_id, user_id))


async def order_cancel(request: Request) -> Response:
    gate = _gate(request)
    user_id = gate.buyer_auth.user_id(request.headers.get("authorization"))
    order_id = request.path_params["order_id"]
    try:
        order = await orders.cancel(gate.db, gate.mirror, order_id, user_id)
    except Problem as problem:
        # Not in the database: perhaps waiting in a queue (gate/queue/).
        cancelled = await gate.queue.cancel(order_id, user_id) if gate.queue else None
        if problem.code != "NOT_FOUND" or cancelled is None:
            raise
        return json_response(cancelled)
    # Units came back: this process must not keep answering "sold out" from memory.
    gate.soldout.forget(order.deal_id)
    return json_response(order.view())


# -- admin ---------------------------------------------------------------------------


def _admin(request: Request) -> Gate:
    gate = _gate(request)
    gate.admin_auth.check(request.headers.get("authorization"))
    return gate


async def admin_create_deal(request: Request) -> Response:
    gate = _admin(request)
    body = await read_json(request, gate.settings.body_max_bytes)
    return json_response(await gate.deals.create(body), 201)


async def admin_deal(request: Request) -> Response:
    gate = _admin(request)
    return json_response(await gate.deals.admin_view(_deal_id(request)))


async def admin_adjust_stock(request: Request) -> Response:
    gate = _admin(request)
    deal_id = _deal_id(request)
    body = await read_json(request, gate.settings.body_max_bytes)
    view = await gate.deals.adjust_stock(deal_id, body)
    gate.soldout.forget(deal_id)
    return json_response(view)


async def admin_rebucket(request: Request) -> Response:
    gate = _admin(request)
    deal_id = _deal_id(request)
    body = await read_json(request, gate.settings.body_max_bytes)
    view = await gate.deals.rebucket(deal_id, body)
    gate.soldout.forget(deal_id)
    return json_response(view)


async def admin_set_window(request: Request) -> Response:
    gate = _admin(request)
    deal_id = _deal_id(request)
    body = await read_json(request, gate.settings.body_max_bytes)
    view = await gate.deals.set_window(deal_id, body)
    gate.soldout.forget(deal_id)
    return json_response(view)


def _query_int(request: Request, name: str, lo: int, hi: int, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    value = validate.digits(raw, hi)
    if value is None or value < lo:
        raise invalid(f"Query parameter '{name}' must be an integer between {lo} and {hi}.")
    return value


async def admin_ledger(request: Request) -> Response:
    gate = _admin(request)
    deal_id = _deal_id(request)
    after = _query_int(request, "after", 0, MAX_ID, 0)
    limit = _query_int(request, "limit", 1, 1000, 100)
    return json_response(await gate.deals.ledger(deal_id, after, limit))


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
        # the workers GATE_METRICS_ADDR=off; see gate/metrics_listener.py). Bound
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
        all_routes.extend(apidocs.routes())
    middleware = []
    inner = []
    for ext in gate.extensions:
        all_routes.extend(ext.routes)
        middleware.extend(ext.middleware)
        inner.extend(ext.inner_middleware)
    exact_paths(all_routes)
    lanes = [r for r in all_routes if isinstance(r, Route) and r.name in FAST_LANE_ROUTES]
    assert any(r.name == "reserve" for r in lanes), "the reservation route is missing"
    # One HTTP guard (gate/guard.py) for the fast lane and the edge: one bound on the
    # requests this worker holds, wherever they are answered.
    guard = Guard(
        concurrency_max=settings.http_concurrency_max,
        body_timeout_seconds=settings.body_timeout_seconds,
    )
    middleware.append(Middleware(FastLane, routes=lanes, guard=guard))
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
    # What gate.edge.EdgeProtocol answers itself (gate serve's protocol).
    app.state.edge = Edge(
        edge_routes, guard, recorder or RequestRecorder(), settings.body_max_bytes
    )
    return app


def create_app() -> Starlette:
    """uvicorn factory: every worker process reads the settings once."""
    settings = load_settings()
    configure(settings.log_level)
    return build_app(settings)
