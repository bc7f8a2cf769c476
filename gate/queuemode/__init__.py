"""Queue mode (docs/queue-mode.md): accept at Redis speed, commit in the
background, switch per deal live.

    PUT /v1/admin/deals/{id}/mode {"mode": "queue"|"sync"} ──> deals.mode ──> every
        process follows within GATE_QUEUE_MODE_REFRESH_SECONDS (ModeCache)
    reservation of a queue-mode deal ──> admit.lua ──> enqueue.lua ──> 202 QUEUED
        (gate/queuemode/service.py)
    consumers in `gate serve` ──> gate_reserve_group ──> confirm / compensate
        (gate/queuemode/consumer.py)
    gate queue status | dead-letters | retry (gate/queuemode/cli.py)

The area plugs into the core through its Extension (gate/reserve/ports.py): the
QueuePort the reservation path hands an admitted reservation of a queue-mode deal to
(and asks about a replay of a queued key), the QueuedOrders the order view and cancel
ask about an order the database does not hold yet; and the deals' `mode` field.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gate.base import validate
from gate.base.errors import Problem, invalid, not_found
from gate.extensions import Extension, Worker
from gate.queuemode import store
from gate.queuemode.console_panel import QueuePanel
from gate.queuemode.consumer import QueueConsumer
from gate.queuemode.service import MODES, QueueService, QueueSettings
from gate.web.http_io import json_response, read_json

if TYPE_CHECKING:
    from gate.runtime import Gate


async def admin_set_mode(request: Request, service: QueueService) -> Response:
    gate: Gate = request.app.state.gate
    gate.admin_auth.check(request.headers.get("authorization"))
    deal_id: int = request.path_params["deal_id"]
    if not 1 <= deal_id <= validate.MAX_ID:
        raise not_found("deal")
    body = validate.obj(await read_json(request, gate.settings.body_max_bytes))
    validate.no_unknown(body, {"mode"})
    mode = validate.string(body, "mode", 8)
    if mode not in MODES:
        raise invalid("'mode' must be 'sync' or 'queue'.")
    if mode == "queue":
        # A deal of several partitions is sold synchronously (docs/scale-out.md).
        row = await store.deal_partitions(gate.db, deal_id)
        if row is not None and int(row[0]) > 1:
            raise Problem("CONFLICT", "A deal of several partitions cannot use queue mode.")
    await store.set_mode(gate.db, deal_id, mode)
    view = await gate.deals.admin_view(deal_id)  # 404 for an unknown deal
    service.modes.set(deal_id, mode)
    return json_response({**view, "mode": mode})


def install(gate: Gate) -> Extension:
    settings = QueueSettings.from_env(gate.settings)
    service = QueueService(gate, settings)
    consumer = QueueConsumer(gate, settings, service)

    async def set_mode(request: Request) -> Response:
        return await admin_set_mode(request, service)

    workers: list[Worker] = [service.modes.run]
    if settings.consumers_in_serve:
        workers.append(consumer.run)
    return Extension(
        name="queue",
        routes=[
            Route("/v1/admin/deals/{deal_id:id}/mode", set_mode, methods=["PUT"]),
        ],
        workers=workers,
        on_start=[service.modes.run_once],
        queue=service,
        queued_orders=service,
        console_panels=[QueuePanel(gate)],
    )


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    from gate.queuemode.cli import add_commands as add

    add(sub)
