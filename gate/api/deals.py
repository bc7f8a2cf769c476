"""The deals' endpoints: the buyer's deal view (ASGI and edge) and the admin's."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gate.api.common import MAX_ID, _deal_id, _gate
from gate.base import validate
from gate.base.errors import Encoded, RawResponse, invalid, not_found, overloaded
from gate.inventory.pause import pause, pause_body, resume, resume_body
from gate.inventory.room_config import ROOM_BODY_MAX_BYTES
from gate.runtime import Gate
from gate.store.db import DbUnavailable
from gate.web.edge import EdgeRequest, EdgeRoute
from gate.web.http_io import (
    json_answer,
    json_response,
    read_json,
)

DEAL_ROUTE = "/v1/deals/{deal_id}"


async def deal_view(request: Request) -> Response:
    return RawResponse(*await _deal_answer(_gate(request), _deal_id(request)))


async def _deal_answer(gate: Gate, deal_id: int) -> Encoded:
    """GET /v1/deals/{id}'s answer, on the ASGI route and at the edge alike."""
    try:
        return json_answer(await gate.deals.public_view(deal_id))
    except DbUnavailable:
        raise overloaded("Database unavailable; retry shortly.") from None


class DealViewEdge(EdgeRoute):
    """GET /v1/deals/{id} at the edge (gate/web/edge.py): the buyer's view of a deal,
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


def _admin(request: Request) -> Gate:
    gate = _gate(request)
    gate.admin_auth.check(request.headers.get("authorization"))
    return gate


async def admin_create_deal(request: Request) -> Response:
    gate = _admin(request)
    # A deal's waiting room may carry its page's logo (32 KiB): a larger bound.
    body = await read_json(request, max(gate.settings.body_max_bytes, ROOM_BODY_MAX_BYTES))
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


async def admin_pause(request: Request) -> Response:
    gate = _admin(request)
    deal_id = _deal_id(request)
    reason = pause_body(await read_json(request, gate.settings.body_max_bytes))
    return json_response(await pause(gate.db, gate.mirror, deal_id, reason=reason, actor="admin"))


async def admin_resume(request: Request) -> Response:
    gate = _admin(request)
    deal_id = _deal_id(request)
    note = resume_body(await read_json(request, gate.settings.body_max_bytes))
    return json_response(await resume(gate.db, gate.mirror, deal_id, actor="admin", note=note))


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
