"""The waiting room: an inventory-aware, fair queue in front of hot deals.
See docs/waiting-room.md and gate/room/service.py."""

from __future__ import annotations

import argparse
import hashlib
import logging
from typing import TYPE_CHECKING, Any

from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gate.base.errors import not_found
from gate.extensions import Extension
from gate.room import openapi as room_openapi
from gate.room.admission import RoomAdmission
from gate.room.console_panel import RoomPanel
from gate.room.edge_lane import QueueLane, TicketEdge, join_body
from gate.room.gatekeeper import RoomGates
from gate.room.gates import CODES_BODY_MAX_BYTES, JoinPasses
from gate.room.page import BuyerPage
from gate.room.retire import RoomRetirer
from gate.room.service import Room
from gate.room.tokens import AdmissionTokens
from gate.room.wire import Wire
from gate.stock.room_config import load_room_settings
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
)

for (_path, _method), _operation in room_openapi.operations().items():
    openapi.add_operation(_path, _method, _operation)
MAX_ID = 2**63 - 1


def _scripts() -> dict[str, Script]:
    found: dict[str, Script] = {}
    for name in SCRIPTS:
        path = lua_dir() / f"{name}.lua"
        if not path.is_file():
            raise ScriptMissing(f"Lua script {path} is missing; refusing to start")
        source = path.read_text(encoding="utf-8")
        found[name] = Script(name, source, hashlib.sha1(source.encode("utf-8")).hexdigest())
    return found


def _deal_id(request: Request) -> int:
    deal_id = int(request.path_params["deal_id"])
    if not 1 <= deal_id <= MAX_ID:
        raise not_found("deal")
    return deal_id


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
    room = Room(settings, gate.db, gate.mirror, gate.runner, tokens, wire, gate.unknown_deals)
    # Access codes and challenges (gate/room/gates.py), keyed like admission tokens.
    passes = JoinPasses(gate.settings.admission_secret)
    gatekeeper = RoomGates(gate.db, gate.mirror, gate.runner, passes)
    # One process at a time deletes retired rooms' keys (gate/room/retire.py).
    retirer = RoomRetirer(
        gate.redis,
        gate.runner,
        WorkLease(gate.runner, "room-retire", gate.settings.background_lease_seconds),
    )

    async def join(request: Request) -> Response:
        user_id = gate.buyer_auth.user_id(request.headers.get("authorization"))
        deal_id = _deal_id(request)
        passed = passes.parse(deal_id, user_id, await join_body(request.receive))
        created, body = await room.ticket(deal_id, user_id, "join", passed)
        return json_response(body, 201 if created else 200)

    async def read(request: Request) -> Response:
        user_id = gate.buyer_auth.user_id(request.headers.get("authorization"))
        _, body = await room.ticket(_deal_id(request), user_id, "read")
        return json_response(body)

    async def fairness(request: Request) -> Response:
        # Public: the draw's commitment, and once revealed its seed and participants.
        return json_response(await room.fairness(_deal_id(request)))

    async def configure(request: Request) -> Response:
        gate.admin_auth.check(request.headers.get("authorization"))
        deal_id = _deal_id(request)
        body = await read_json(request, gate.settings.body_max_bytes)
        await room.configure(deal_id, body)
        if isinstance(body, dict) and body.get("access") == "codes":
            # The codes may have been retired from Redis with an earlier room.
            await gatekeeper.load_codes(deal_id)
        return json_response(await gate.deals.admin_view(deal_id))

    async def challenge(request: Request) -> Response:
        user_id = gate.buyer_auth.user_id(request.headers.get("authorization"))
        return json_response(await gatekeeper.challenge(_deal_id(request), user_id))

    async def access_codes(request: Request) -> Response:
        gate.admin_auth.check(request.headers.get("authorization"))
        deal_id = _deal_id(request)
        body = await read_json(request, CODES_BODY_MAX_BYTES)
        return json_response(await gatekeeper.add_codes(deal_id, body))

    deal = "/v1/deals/{deal_id:id}"
    queue = [
        Route(deal + "/queue", join, methods=["POST"]),
        Route(deal + "/queue", read, methods=["GET"]),
    ]
    return Extension(
        name="room",
        routes=[
            *queue,
            Route(deal + "/queue/fairness", fairness, methods=["GET"]),
            Route("/v1/admin/deals/{deal_id:id}/waiting-room", configure, methods=["PUT"]),
            Route(deal + "/queue/challenge", challenge, methods=["GET"]),
            Route("/v1/admin/deals/{deal_id:id}/access-codes", access_codes, methods=["POST"]),
            *BuyerPage(gate.deals).routes(),
        ],
        workers=[room.run, retirer.run],
        on_stop=[wire.aclose],
        inner_middleware=[
            Middleware(QueueLane, room=room, auth=gate.buyer_auth, routes=queue, passes=passes)
        ],
        edge=[TicketEdge(room, gate.buyer_auth, join, passes) for join in (True, False)],
        # The runner loads every script it holds at start-up (ScriptRunner.load).
        scripts=_scripts(),
        before_sync=[room.before_sync, gatekeeper.before_sync],
        admission=RoomAdmission(tokens, gate.runner),
        console_panels=[RoomPanel(gate, room)],
    )


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    """The room has no command of its own: `gate check` reports its counters."""
