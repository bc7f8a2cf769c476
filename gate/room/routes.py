"""One guard for every room route that names a deal (docs/waiting-room.md, "Cost").

    GET /v1/deals/{deal_id}/queue/challenge (any route added through DealRoutes)
      ── the id: 1 .. 2^63 - 1, else 404
      ── handler(request, deal_id)
            a script finds no state of the deal in Redis ──> raises NotLoaded
      ── DealGuard.load:
            the unknown-deal guard (gate/inventory/unknown_deals.py) ──> 404, no database,
                for an id the database is known not to hold (a flood of random ids)
            else Mirror.load: one load per deal id and process at a time, whoever asks
      ── handler(request, deal_id) once more (NotLoaded again: 503, being rebuilt)

A handler cannot load a deal any other way: the room's modules raise NotLoaded and
only this module loads (tests/room/test_room_guard.py holds both to that: every route
of the room that names a deal is a DealRoute, and no other room module calls
`mirror.load`). The joins and polls answered before the router (gate/room/edge_lane.py)
go through the same DealGuard (`Room.ticket`).

A handler that raises NotLoaded is called again: it must not have consumed what it
cannot read twice (the request body) before its script call, or keep it (Starlette's
`request.body()` does).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gate.base.errors import not_found, overloaded
from gate.inventory.mirror import Mirror
from gate.inventory.unknown_deals import UnknownDeals

log = logging.getLogger("gate.room")

MAX_ID = 2**63 - 1
T = TypeVar("T")
Handler = Callable[[Request, int], Awaitable[Response]]


class NotLoaded(Exception):
    """Redis holds no state for the deal: it must be loaded (through DealGuard)."""

    def __init__(self, deal_id: int) -> None:
        super().__init__(deal_id)
        self.deal_id = deal_id


class DealGuard:
    """The one way a room request loads a deal Redis lacks."""

    def __init__(self, unknown: UnknownDeals, mirror: Mirror) -> None:
        self.unknown = unknown
        self.mirror = mirror

    async def check(self, deal_id: int) -> None:
        """404 for an id the database is known not to hold: nothing else is asked."""
        generation = await self.unknown.generation()
        if self.unknown.unknown(deal_id, generation):
            raise not_found("deal")

    async def load(self, deal_id: int) -> None:
        """The deal into Redis, or 404 (without the database for a known-unknown id)."""
        try:
            found = await self.unknown.load(deal_id, self.mirror.load)
        except Exception as exc:
            log.warning("deal %s not loaded into Redis: %r", deal_id, exc)
            raise overloaded("Deal state unavailable; retry shortly.") from None
        if not found:
            raise not_found("deal")

    async def run(self, deal_id: int, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`; if it finds the deal not loaded, the load, then `call()` once more."""
        try:
            return await call()
        except NotLoaded:
            pass
        await self.load(deal_id)
        try:
            return await call()
        except NotLoaded:
            raise overloaded("Deal state is being rebuilt; retry shortly.") from None


def deal_id_of(request: Request) -> int:
    deal_id = int(request.path_params["deal_id"])
    if not 1 <= deal_id <= MAX_ID:
        raise not_found("deal")
    return deal_id


class DealRoute(Route):
    """A route whose handler takes the deal id and runs behind the DealGuard."""


class DealRoutes:
    """Where the room registers every route that names a deal (`{deal_id:id}`)."""

    def __init__(self, guard: DealGuard) -> None:
        self.guard = guard
        self.routes: list[DealRoute] = []

    def add(self, path: str, handler: Handler, methods: list[str]) -> DealRoute:
        if "{deal_id:id}" not in path:
            raise ValueError(f"{path}: a deal route names its deal as {{deal_id:id}}")
        guard = self.guard

        async def endpoint(request: Request) -> Response:
            deal_id = deal_id_of(request)
            return await guard.run(deal_id, lambda: handler(request, deal_id))

        endpoint.__name__ = getattr(handler, "__name__", "deal_route")
        endpoint.__doc__ = handler.__doc__
        route = DealRoute(path, endpoint, methods=methods)
        self.routes.append(route)
        return route
