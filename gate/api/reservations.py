"""POST /v1/deals/{id}/reservations: the ASGI endpoint (`Reserve`, in the fast lane) and
the edge's (`ReserveEdge`, answered by the HTTP protocol itself), one reservation
path behind both (gate/reserve/).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from functools import partial
from typing import Any

from starlette.types import Receive, Scope, Send

from gate.api.common import MAX_ID
from gate.base import validate
from gate.base.errors import Encoded, Problem, not_found, overloaded
from gate.base.limits import client_ip, device_id
from gate.base.metrics import METRICS, CounterTally
from gate.reserve.request import MAX_QUANTITY, QueuedCall, Reserved, ReserveRequest
from gate.runtime import Gate
from gate.store.db import DbUnavailable
from gate.web.edge import INTERNAL, EdgeRequest, EdgeRoute
from gate.web.http_io import (
    json_answer,
    json_body,
    receive_json,
    send_answer,
)

log = logging.getLogger("gate.app")


RESERVATION_FIELDS = {"quantity"}


RESERVE_ROUTE = "/v1/deals/{deal_id}/reservations"


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
    """POST /v1/deals/{id}/reservations at the edge (gate/web/edge.py): the same answers
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
