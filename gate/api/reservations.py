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
from gate.base.limits import device_id
from gate.base.metrics import METRICS, CounterTally
from gate.reserve.path import Taken
from gate.reserve.request import MAX_QUANTITY, QueuedCall, Reserved
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


# The near-caches answer with a kept encoding of one of these (ReservationPath.take).
_NEAR_CACHE_OUTCOMES = {409: "SOLD_OUT", 429: "RATE_LIMITED"}


def _count(outcome: str) -> None:
    counter = _OUTCOMES.get(outcome)
    if counter is None:
        counter = _OUTCOMES[outcome] = METRICS.counter_tally(METRICS.reservations.labels(outcome))
    counter.inc()


def _checked_headers(
    gate: Gate, headers: dict[bytes, str], deal_id: int
) -> tuple[int, str, str | None, str | None]:
    """A reservation's buyer, Idempotency-Key, device and Admission-Token, checked in
    the order every answer depends on (an unauthenticated request learns nothing
    about the deal)."""
    user_id = gate.buyer_auth.user_id(headers.get(b"authorization"))
    if not 1 <= deal_id <= MAX_ID:
        raise not_found("deal")
    key = validate.idempotency_key(headers.get(b"idempotency-key"))
    admission_token = headers.get(b"admission-token")
    validate.admission_token(admission_token)
    return user_id, key, device_id(headers.get(b"x-device-id")), admission_token


def _taken(
    gate: Gate,
    headers: dict[bytes, str],
    deal_id: int,
    checked: tuple[int, str, str | None, str | None],
    body: dict[str, Any],
    path: str,
    client: tuple[str, int] | None,
    on_reply: bool,
) -> Taken:
    """A valid reservation handed to the reservation path, in one call: the
    near-caches' kept answer (most of a sale's requests end there, without an
    exception or a coroutine), or the way to the answer (`ReservationPath.take`)."""
    user_id, key, device, admission_token = checked
    if len(body) != 1:
        # The body is {"quantity": n} and nothing else (the OpenAPI schema's
        # additionalProperties: false): a field the fingerprint would not cover must
        # not ride along with an idempotency key.
        validate.no_unknown(body, RESERVATION_FIELDS)
    quantity = validate.integer(body, "quantity", 1, MAX_QUANTITY)
    return gate.reservations.take(
        deal_id,
        user_id,
        quantity,
        key,
        device,
        admission_token,
        client,
        headers.get(b"x-forwarded-for"),
        path,
        on_reply=on_reply,
    )


async def _answered(work: Awaitable[Reserved], path: str, started: float) -> Encoded:
    """The answer to a reservation the near-caches let through.

    Answers made before the admission (invalid requests, the near-caches' "sold out"
    and "rate limited") are counted by outcome but not timed in the reservation
    histogram: they take microseconds, the request histogram of the route has them,
    and under a sold-out flood they would bury the latency of the reservations that
    did reach Redis and the database, which is what the latency alert watches."""
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
            taken = _taken(
                gate,
                headers,
                deal_id,
                checked,
                validate.obj(body),
                path,
                scope.get("client"),
                on_reply=False,
            )
        except Problem as problem:
            _count(problem.code)
            await send_answer(send, problem.encoded(path))
            return
        if isinstance(taken, tuple):
            _count(_NEAR_CACHE_OUTCOMES[taken[0]])
            await send_answer(send, taken)
        else:
            assert not isinstance(taken, QueuedCall), "asked without on_reply"
            await send_answer(send, await _answered(taken, path, started))


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
            taken = _taken(
                gate,
                headers,
                req.id,
                checked,
                validate.obj(body),
                req.path,
                req.client,
                on_reply=True,
            )
        except Problem as problem:
            _count(problem.code)
            req.answer(problem.encoded(req.path))
            return
        if isinstance(taken, tuple):
            _count(_NEAR_CACHE_OUTCOMES[taken[0]])
            req.answer(taken)
        elif isinstance(taken, QueuedCall):
            taken.admit.add_done_callback(partial(_settled, req, taken), context=req.context)
        else:
            req.run(_answered(taken, req.path, req.started))


def _settled(req: EdgeRequest, call: QueuedCall, _: object) -> None:
    """A queue-mode admission's reply is in (`QueuedCall.settle`): the 202 written now,
    or the rest of the way in a task."""
    try:
        outcome = call.settle()
        if isinstance(outcome, Reserved):
            req.answer(_reserved_answer(outcome, req.started))
        else:
            req.run(_answered(outcome, req.path, req.started))
    except Problem as problem:
        req.answer(_refused(problem, req.path, req.started))
    except Exception:
        log.exception("unhandled error on %s %s", req.method, req.path)
        req.answer(INTERNAL.encoded(req.path))
