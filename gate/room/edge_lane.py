"""The queue's fast lanes: joins and polls answered at the edge (`TicketEdge`,
gate/web/edge.py) when the request comes whole, else as plain ASGI, past Starlette's
exception middleware and router (`QueueLane`; gate/api/app.py's FastLane does the same
for reservations). Polling is most of a room's traffic, so it must cost
no more than a sold-out answer. The routes stay registered with Starlette too (the OpenAPI
check, a mounted app); the lanes only answer first, and both answer alike
(`_ticket_answer`)."""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any

from redis.exceptions import NoScriptError
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gate.base.codes import RoomCode
from gate.base.errors import Encoded, Problem, not_found, overloaded
from gate.base.limits import Network, client_ip
from gate.room.gates import NO_PASS, JoinPass, JoinPasses
from gate.room.service import Room, ticket_failed
from gate.store.db import DbUnavailable
from gate.web.auth import BuyerAuth
from gate.web.edge import INTERNAL, EdgeRequest, EdgeRoute
from gate.web.http_io import json_answer, send_answer

log = logging.getLogger("gate.room")

MAX_ID = 2**63 - 1
PREFIX, SUFFIX = "/v1/deals/", "/queue"
ROUTE_LABEL = "/v1/deals/{deal_id}/queue"
PREFIX_LEN, SUFFIX_LEN = len(PREFIX), len(SUFFIX)
# Up to 18 digits are below MAX_ID (gate/web/http_io.py IdConvertor does the same).
SHORT_ID_DIGITS = 18
# A join's body ({"access_code", "challenge", "nonce"}) is well under this.
JOIN_BODY_MAX_BYTES = 4096


class ClientAddresses:
    """The client address a join's failed access codes are counted by: the IP
    limiter's (the peer, or behind GATE_TRUSTED_PROXIES the forwarded address; an
    IPv6 client as its /GATE_LIMIT_IP_V6_PREFIX network)."""

    __slots__ = ("trusted", "v6_prefix")

    def __init__(self, trusted: tuple[Network, ...], v6_prefix: int) -> None:
        self.trusted = trusted
        self.v6_prefix = v6_prefix

    def of(self, peer: str | None, forwarded_for: str | None) -> str:
        return client_ip(peer, forwarded_for, self.trusted, self.v6_prefix)


def _scope_address(addresses: ClientAddresses, scope: Scope) -> str:
    client = scope.get("client")
    forwarded = None
    for name, value in scope["headers"]:
        if name == b"x-forwarded-for":
            forwarded = value.decode("latin-1")
            break
    return addresses.of(client[0] if client else None, forwarded)


class QueueLane:
    def __init__(
        self,
        app: ASGIApp,
        *,
        room: Room,
        auth: BuyerAuth,
        routes: list[Route],
        passes: JoinPasses,
        addresses: ClientAddresses,
    ) -> None:
        self.app = app
        self.room = room
        self.auth = auth
        self.passes = passes
        self.addresses = addresses
        # method -> route ("POST": join, "GET": read)
        self.routes = {m: r for r in routes for m in (r.methods or ()) if m != "HEAD"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            route = self.routes.get(scope["method"])
            path = scope["path"]
            if route is not None and path.endswith("/queue"):
                digits = path[PREFIX_LEN:-SUFFIX_LEN]
                if (
                    path.startswith(PREFIX)
                    and 0 < len(digits) <= SHORT_ID_DIGITS
                    and digits.isdigit()
                    and digits.isascii()
                ):
                    # /v1/deals/<up to 18 ASCII digits>/queue: what the route's regex
                    # and converter would give, without them.
                    deal_id = int(digits)
                else:
                    match = route.path_regex.match(path)
                    if match is None:
                        await self.app(scope, receive, send)
                        return
                    # The route's own converter: bounded digits, never int() of 4,400.
                    deal_id = route.param_convertors["deal_id"].convert(match["deal_id"])
                scope["route"] = route
                scope["endpoint"] = route.endpoint
                scope["path_params"] = {"deal_id": deal_id}
                await self._answer(scope, receive, send, scope["method"] == "POST")
                return
        await self.app(scope, receive, send)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, join: bool) -> None:
        path = scope["path"]
        authorization: Any = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        try:
            user_id = self.auth.user_id(authorization)
            deal_id: int = scope["path_params"]["deal_id"]
            if not 1 <= deal_id <= MAX_ID:
                raise not_found("deal")
            passed = NO_PASS
            if join:
                passed = self.passes.parse(deal_id, user_id, await join_body(receive))
                if passed.code_hash:
                    passed = passed.at(_scope_address(self.addresses, scope))
        except Problem as problem:
            await send_answer(send, problem.encoded(path))
            return
        answer = await _ticket_answer(self.room, deal_id, user_id, join, path, passed)
        await send_answer(send, answer)


async def join_body(receive: Receive) -> bytes:
    """A join's body, at most JOIN_BODY_MAX_BYTES (413 past it)."""
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return body
        body += bytes(message.get("body", b""))
        if len(body) > JOIN_BODY_MAX_BYTES:
            raise Problem(
                "PAYLOAD_TOO_LARGE", f"The body must be at most {JOIN_BODY_MAX_BYTES} bytes."
            )
        if not message.get("more_body", False):
            return body


async def _ticket_answer(
    room: Room, deal_id: int, user_id: int, join: bool, path: str, passed: JoinPass = NO_PASS
) -> Encoded:
    try:
        created, body = await room.ticket(deal_id, user_id, "join" if join else "read", passed)
    except Problem as problem:
        return problem.encoded(path)
    except DbUnavailable:
        return overloaded("Database unavailable; retry shortly.").encoded(path)
    return json_answer(body, 201 if created else 200)


class TicketEdge(EdgeRoute):
    """A join (POST) or a read (GET) of a ticket at the edge: the buyer and the id
    checked before anything is sent, then the buyer's part of the ticket's script
    call (gate/room/wire.py) settled by a callback on its reply, with no task or
    coroutine (what a task's two steps cost was a tenth of a join):

        handle ──> Room.start_ticket ──> future ──(reply)──> _settled ──> answer
                                          a deal Redis lacks (NOT_LOADED) or lost
                                          scripts (NOSCRIPT): nothing ran; the
                                          request goes the coroutine's way
                                          (`_ticket_answer`), which loads and asks
                                          again

    The connection stays open until the answer is written, so a graceful shutdown
    waits for it as for a task; the wire's timeout bounds the wait."""

    __slots__ = ("addresses", "auth", "join", "passes", "room")

    def __init__(
        self,
        room: Room,
        auth: BuyerAuth,
        join: bool,
        passes: JoinPasses,
        addresses: ClientAddresses,
    ) -> None:
        super().__init__(b"POST" if join else b"GET", PREFIX.encode(), SUFFIX.encode(), ROUTE_LABEL)
        self.room = room
        self.auth = auth
        self.join = join
        self.passes = passes
        self.addresses = addresses

    def handle(self, req: EdgeRequest) -> None:
        user_id = self.auth.user_id(req.header(b"authorization"))
        if not 1 <= req.id <= MAX_ID:
            raise not_found("deal")
        # A join's gates: a bad challenge is refused here, before Redis (gates.py).
        passed = self.passes.parse(req.id, user_id, req.body) if self.join else NO_PASS
        if passed.code_hash:
            passed = passed.at(self._address(req))
        if self.join and not self.room.has_seed(req.id):
            # The room's seed is learned once per deal and process (Room.ticket).
            req.run(_ticket_answer(self.room, req.id, user_id, True, req.path, passed))
            return
        fut = self.room.start_ticket(req.id, user_id, self.join, passed)
        fut.add_done_callback(partial(self._settled, req, user_id, passed), context=req.context)

    def _address(self, req: EdgeRequest) -> str:
        return self.addresses.of(
            req.client[0] if req.client else None, req.header(b"x-forwarded-for")
        )

    def _settled(
        self, req: EdgeRequest, user_id: int, passed: JoinPass, fut: asyncio.Future[Any]
    ) -> None:
        try:
            # The wire fails its futures, never cancels them; a cancelled one is
            # answered all the same (every edge request gets exactly one answer).
            exc = asyncio.CancelledError() if fut.cancelled() else fut.exception()
            if exc is not None:
                raise ticket_failed(req.id, exc)
            reply = fut.result()
            if type(reply) is not list or reply[0] == RoomCode.NOT_LOADED:
                if isinstance(reply, Exception) and not isinstance(reply, NoScriptError):
                    raise ticket_failed(req.id, reply)
                req.run(_ticket_answer(self.room, req.id, user_id, self.join, req.path, passed))
                return
            created, body = self.room.settle(req.id, user_id, reply)
            req.answer(json_answer(body, 201 if created else 200))
        except Problem as problem:
            req.answer(problem.encoded(req.path))
        except Exception:
            log.exception("unhandled error on %s %s", req.method, req.path)
            req.answer(INTERNAL.encoded(req.path))
