"""The waiting room: an inventory-aware, fair queue in front of hot deals.
See docs/waiting-room.md and gate/room/service.py."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
from typing import TYPE_CHECKING, Any

from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gate.extensions import Extension
from gate.inventory.room_config import ROOM_BODY_MAX_BYTES, load_room_settings
from gate.room import openapi as room_openapi
from gate.room.admission import RoomAdmission
from gate.room.console_panel import RoomPanel
from gate.room.edge_lane import ClientAddresses, QueueLane, TicketEdge, join_body
from gate.room.estimate import Estimator
from gate.room.estimate import run as run_estimates
from gate.room.fairness_doc import FairnessDocs, page_query
from gate.room.gatekeeper import RoomGates
from gate.room.gates import CODES_BODY_MAX_BYTES, JoinPasses
from gate.room.leave import Leaving
from gate.room.page import BuyerPage
from gate.room.retire import RoomRetirer
from gate.room.routes import DealGuard, DealRoutes
from gate.room.service import Room
from gate.room.tokens import AdmissionTokens
from gate.room.wire import Wire
from gate.store.scripts import Script, ScriptMissing, lua_dir
from gate.store.work_lease import WorkLease
from gate.web import openapi
from gate.web.http_io import json_response, read_json

if TYPE_CHECKING:
    from gate.runtime import Gate

log = logging.getLogger("gate.room")

SCRIPTS = (
    "room_ticket",
    "room_advance",
    "room_restore",
    "room_retire",
    "room_retire_done",
    "room_fairness",
    "room_challenge",
    "room_publish",
    "room_leave",
)

for (_path, _method), _operation in room_openapi.operations().items():
    openapi.add_operation(_path, _method, _operation)


def _scripts() -> dict[str, Script]:
    found: dict[str, Script] = {}
    for name in SCRIPTS:
        path = lua_dir() / f"{name}.lua"
        if not path.is_file():
            raise ScriptMissing(f"Lua script {path} is missing; refusing to start")
        source = path.read_text(encoding="utf-8")
        found[name] = Script(name, source, hashlib.sha1(source.encode("utf-8")).hexdigest())
    return found


def install(gate: Gate) -> Extension:
    settings = load_room_settings(gate.settings.environ)
    tokens = AdmissionTokens(gate.settings.admission_secret)
    # The room's script calls on a connection of their own (gate/room/wire.py).
    wire = Wire(
        gate.settings.redis_url,
        gate.settings.redis_timeout_seconds,
        gate.settings.redis_pipeline_max,
        gate.settings.redis_flush_every,
    )
    # The one way a room request loads a deal Redis lacks (gate/room/routes.py).
    guard = DealGuard(gate.unknown_deals, gate.mirror)
    room = Room(settings, gate.db, gate.mirror, gate.runner, tokens, wire, guard)
    # Access codes and challenges (gate/room/gates.py), keyed like admission tokens.
    passes = JoinPasses(gate.settings.admission_secret)
    gatekeeper = RoomGates(gate.db, gate.mirror, gate.runner, passes)
    documents = FairnessDocs(gate.runner, gate.redis, settings.fairness_limit)
    # One process at a time deletes retired rooms' keys (gate/room/retire.py).
    retirer = RoomRetirer(
        gate.redis,
        gate.runner,
        WorkLease(gate.runner, "room-retire", gate.settings.background_lease_seconds),
    )
    # One process at a time estimates each room's chance and automatic rate
    # (gate/room/estimate.py); every process publishes its database health.
    estimator = Estimator(
        gate.redis,
        WorkLease(gate.runner, "room-estimate", gate.settings.background_lease_seconds),
        settings.auto_commit_p99_ms,
    )

    async def estimate(stop: asyncio.Event) -> None:
        await run_estimates(estimator, stop)

    addresses = ClientAddresses(gate.settings.trusted_proxies, gate.settings.limit_ip_v6_prefix)

    def address_of(request: Request) -> str:
        peer = request.client.host if request.client else None
        return addresses.of(peer, request.headers.get("x-forwarded-for"))

    async def join(request: Request, deal_id: int) -> Response:
        user_id = gate.buyer_auth.user_id(request.headers.get("authorization"))
        # Kept: the guard may call this handler again (gate/room/routes.py).
        body = getattr(request.state, "join_body", None)
        if body is None:
            body = request.state.join_body = await join_body(request.receive)
        passed = passes.parse(deal_id, user_id, body)
        if passed.code_hash:
            passed = passed.at(address_of(request))
        created, answer = await room.ticket(deal_id, user_id, "join", passed)
        return json_response(answer, 201 if created else 200)

    async def read(request: Request, deal_id: int) -> Response:
        user_id = gate.buyer_auth.user_id(request.headers.get("authorization"))
        _, body = await room.ticket(deal_id, user_id, "read")
        return json_response(body)

    leaving = Leaving(gate.runner)

    async def leave(request: Request, deal_id: int) -> Response:
        # Leave the line: 204 whether this call or an earlier one left it.
        user_id = gate.buyer_auth.user_id(request.headers.get("authorization"))
        await leaving.leave(deal_id, user_id)
        return Response(status_code=204)

    async def fairness(request: Request, deal_id: int) -> Response:
        # Public: the draw's commitment, and once revealed its seed and participants,
        # in pages (gate/room/fairness_doc.py).
        after, limit = page_query(request.query_params)
        await documents.take(deal_id, address_of(request))
        doc = await documents.current(deal_id)
        headers = request.headers
        return documents.answer(
            doc, after, limit, headers.get("if-none-match"), headers.get("accept-encoding")
        )

    async def configure(request: Request, deal_id: int) -> Response:
        gate.admin_auth.check(request.headers.get("authorization"))
        # A room's page may carry a logo of 32 KiB: a larger bound than other bodies.
        body = await read_json(request, max(gate.settings.body_max_bytes, ROOM_BODY_MAX_BYTES))
        await room.configure(deal_id, body)
        if isinstance(body, dict) and body.get("access") == "codes":
            # The codes may have been retired from Redis with an earlier room.
            await gatekeeper.load_codes(deal_id)
        return json_response(await gate.deals.admin_view(deal_id))

    async def challenge(request: Request, deal_id: int) -> Response:
        user_id = gate.buyer_auth.user_id(request.headers.get("authorization"))
        return json_response(await gatekeeper.challenge(deal_id, user_id))

    async def access_codes(request: Request, deal_id: int) -> Response:
        gate.admin_auth.check(request.headers.get("authorization"))
        body = await read_json(request, CODES_BODY_MAX_BYTES)
        return json_response(await gatekeeper.add_codes(deal_id, body))

    # Every route that names a deal, through the one registration that puts it
    # behind the deal guard.
    deals = DealRoutes(guard)
    deal = "/v1/deals/{deal_id:id}"
    queue: list[Route] = [
        deals.add(deal + "/queue", join, ["POST"]),
        deals.add(deal + "/queue", read, ["GET"]),
    ]
    deals.add(deal + "/queue", leave, ["DELETE"])
    deals.add(deal + "/queue/fairness", fairness, ["GET"])
    deals.add("/v1/admin/deals/{deal_id:id}/waiting-room", configure, ["PUT"])
    deals.add(deal + "/queue/challenge", challenge, ["GET"])
    deals.add("/v1/admin/deals/{deal_id:id}/access-codes", access_codes, ["POST"])
    page = BuyerPage(gate.deals, gate.db)
    page.add_routes(deals)
    return Extension(
        name="room",
        routes=[*deals.routes, *page.static_routes()],
        workers=[room.run, retirer.run, estimate],
        on_stop=[wire.aclose],
        inner_middleware=[
            Middleware(
                QueueLane,
                room=room,
                auth=gate.buyer_auth,
                routes=queue,
                passes=passes,
                addresses=addresses,
            )
        ],
        edge=[TicketEdge(room, gate.buyer_auth, join, passes, addresses) for join in (True, False)],
        # The runner loads every script it holds at start-up (ScriptRunner.load).
        scripts=_scripts(),
        before_sync=[room.before_sync, gatekeeper.before_sync],
        admission=RoomAdmission(tokens, gate.runner, settings.admission_ratio),
        console_panels=[RoomPanel(gate, room)],
    )


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    """The room has no command of its own: `gate check` reports its counters."""
