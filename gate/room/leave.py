"""Leaving a deal's waiting room (docs/waiting-room.md, "Leaving the line").

    buyer ── DELETE /v1/deals/{id}/queue ──> DealRoutes (the room's one deal guard)
          ──> room_leave.lua, one call:
                waiting / sold out ──> queue entry and ticket gone: those behind move up
                admitted           ──> the admission given back (its slot returns to the
                                       room's bound), the ticket gone
                left already       ──> nothing (idempotent)              all three: 204
                no ticket, or a closed one ───────────────────────────── 404 NOT_IN_QUEUE
          a later join ──> room_ticket.lua: a new ticket at the back

A deal Redis lacks raises NotLoaded: the guard (gate/room/routes.py) loads it (an
unknown id is 404 without the database) and calls once more.
"""

from __future__ import annotations

import logging

from gate.base.codes import RoomCode
from gate.base.errors import from_room
from gate.room import metrics
from gate.room.routes import NotLoaded
from gate.room.service import ticket_failed
from gate.store.keys import deal_keys
from gate.store.scripts import ScriptRunner

log = logging.getLogger("gate.room")

LEFT, LEFT_BEFORE = 0, 1


def _leave_keys(deal_id: int) -> tuple[str, ...]:
    """room_leave.lua's KEYS for a deal."""
    k = deal_keys(deal_id)
    return (
        k.room,
        k.room_queue,
        k.room_tickets,
        k.room_admitted,
        k.room_expiry,
        k.meta,
        k.room_left,
    )


class Leaving:
    """DELETE /v1/deals/{id}/queue: the buyer's ticket and place given up."""

    def __init__(self, runner: ScriptRunner) -> None:
        self.runner = runner

    async def leave(self, deal_id: int, user_id: int) -> bool:
        """The buyer leaves the line: True when this call removed a ticket, False when
        the buyer had left already; NOT_IN_QUEUE (404) without a ticket to leave."""
        try:
            reply = await self.runner.call("room_leave", _leave_keys(deal_id), (user_id,))
        except Exception as exc:
            # Redis down or slow: 503 OVERLOADED, counted and logged as a ticket's is.
            raise ticket_failed(deal_id, exc) from None
        code = int(reply[0])
        if code == RoomCode.NOT_LOADED:
            raise NotLoaded(deal_id)
        if code == LEFT_BEFORE:
            return False
        if code != LEFT:
            raise from_room(RoomCode(code))
        label = str(deal_id)
        metrics.LEFT.labels(label).inc()
        if int(reply[1]):
            metrics.GIVEN_BACK.labels(label).inc()
        return True
