"""The orders' endpoints: the buyer's order view (ASGI and edge) and cancel."""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import Response

from gate.api.common import _gate
from gate.base.errors import Encoded, Problem, RawResponse, overloaded
from gate.inventory import orders
from gate.runtime import Gate
from gate.store.db import DbUnavailable
from gate.web.edge import EdgeRequest, EdgeRoute
from gate.web.http_io import (
    json_answer,
    json_response,
)

ORDER_ROUTE = "/v1/orders/{order_id}"


ORDER_PREFIX = b"/v1/orders/"


_ORDER_ID = re.compile(orders.ORDER_ID_RE.pattern.encode("ascii"))


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
        # Not in the database: perhaps waiting in a queue (gate/queuemode/).
        queued = await gate.queue.view(order_id, user_id) if gate.queue else None
        if problem.code != "NOT_FOUND" or queued is None:
            raise
        return json_answer(queued)
    except DbUnavailable:
        raise overloaded("Database unavailable; retry shortly.") from None
    return json_answer(order.view())


class OrderViewEdge(EdgeRoute):
    """GET /v1/orders/{id} at the edge (gate/web/edge.py): a buyer's poll of an order,
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
        # Not in the database: perhaps waiting in a queue (gate/queuemode/).
        cancelled = await gate.queue.cancel(order_id, user_id) if gate.queue else None
        if problem.code != "NOT_FOUND" or cancelled is None:
            raise
        return json_response(cancelled)
    # Units came back: this process must not keep answering "sold out" from memory.
    gate.soldout.forget(order.deal_id)
    return json_response(order.view())
