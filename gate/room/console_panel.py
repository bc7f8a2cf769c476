"""The waiting room's panel of the live console (docs/console.md, "Waiting room").

console snapshot (at most once a second per process)
    --> RoomPanel.fields(shown deal ids): one Redis pipeline for all of them
          the room hash   on, aps, admitted, lapsed, pow_min, pow_max, msg, and an
                          auto room's decision: arate, areason, adetail
          the queue       ZCARD (tickets waiting)
          the admissions  HLEN (given, neither spent nor lapsed)
          the deal's meta avail (the units the challenge is priced against)
    --> per deal whose room is on: "waiting_room" {waiting, admitted_per_second,
        lapses, unspent, admit_per_second, auto, challenge_bits, message}; admitted/s
        is the room's admitted counter against this process's previous snapshot

POST /console/api/deals/{id}/room_message {"message": {"text", "level"} | null}
    --> parse_message (the admin API's rule: 400 on bad input, nothing changed)
    --> one transaction: the deal's room configuration with the new message, within
        the admin API's bound on the whole room (`fitting`: 400 otherwise, nothing
        changed), and a ledger note (reason room_message) naming the operator's session
    --> Room.publish: the room's Redis hash, which every ticket read shows from
        then on (the room loop republishes it within its refresh if Redis failed)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson

from gate.base import validate
from gate.base.errors import Problem, invalid, not_found
from gate.extensions import ConsoleAction
from gate.inventory.deals import ledger_note
from gate.inventory.room_config import RoomConfig, fitting, parse_message
from gate.room.gates import challenge_bits
from gate.room.service import Room
from gate.store.keys import deal_keys
from gate.store.resp import text

if TYPE_CHECKING:
    from gate.runtime import Gate

log = logging.getLogger("gate.room")

ROOM_FIELDS = (
    "on",
    "aps",
    "admitted",
    "lapsed",
    "pow_min",
    "pow_max",
    "msg",
    "auto",
    "arate",
    "areason",
    "adetail",
)
# Commands per deal in the snapshot's pipeline: HMGET, ZCARD, HLEN, HGET.
COMMANDS_PER_DEAL = 4
MESSAGE_REASON = "room_message"


def _int(value: Any) -> int:
    return int(text(value)) if value not in (None, "", b"") else 0


def _auto(auto: Any, rate: Any, reason: Any, detail: Any) -> dict[str, Any] | None:
    """An "auto" room's last decision (gate/room/estimate.py): the rate chosen, why,
    and its numbers; None for a fixed rate ("rate" None before the first decision)."""
    if auto is None or text(auto) != "1":
        return None
    return {
        "rate": _int(rate) if rate is not None else None,
        "reason": text(reason) if reason is not None else None,
        "detail": orjson.loads(text(detail)) if detail else None,
    }


def _message(raw: Any) -> Any:
    """The room hash's msg field: "" (none) or the message's JSON."""
    found = text(raw) if raw is not None else ""
    return orjson.loads(found) if found else None


class RoomPanel:
    def __init__(self, gate: Gate, room: Room) -> None:
        self.gate = gate
        self.room = room
        # deal -> (monotonic time, the room's admitted counter) of the previous snapshot
        self._previous: dict[int, tuple[float, int]] = {}
        self.actions: Mapping[str, ConsoleAction] = {MESSAGE_REASON: self.set_message}

    # -- the snapshot -------------------------------------------------------------------

    async def fields(self, deal_ids: list[int]) -> dict[int, dict[str, Any]]:
        if not deal_ids:
            return {}
        pipe = self.gate.redis.pipeline(transaction=False)
        for deal_id in deal_ids:
            keys = deal_keys(deal_id)
            pipe.hmget(keys.room, list(ROOM_FIELDS))
            pipe.zcard(keys.room_queue)
            pipe.hlen(keys.room_admitted)
            pipe.hget(keys.meta, "avail")
        answers = await pipe.execute()
        now = time.monotonic()
        previous, self._previous = self._previous, {}
        out: dict[int, dict[str, Any]] = {}
        for i, deal_id in enumerate(deal_ids):
            first = COMMANDS_PER_DEAL * i
            room, waiting, unspent, avail = answers[first : first + COMMANDS_PER_DEAL]
            on, aps, admitted, lapsed, pow_min, pow_max, msg, auto, arate, reason, detail = room
            if on is None or text(on) != "1":
                continue
            admitted_total = _int(admitted)
            self._previous[deal_id] = (now, admitted_total)
            rate = None
            before = previous.get(deal_id)
            # A counter that went down was reset (the room's keys retired and made again).
            if before is not None and admitted_total >= before[1] and now > before[0]:
                rate = round((admitted_total - before[1]) / (now - before[0]), 2)
            bits = None
            if pow_min is not None:
                # As lua/room_challenge.lua reads the bounds and the demand.
                low = _int(pow_min)
                high = low if pow_max is None else _int(pow_max)
                bits = challenge_bits(low, high, int(waiting), max(0, _int(avail)))
            out[deal_id] = {
                "waiting_room": {
                    "waiting": int(waiting),
                    "admitted_per_second": rate,
                    "admitted": admitted_total,
                    "lapses": _int(lapsed),
                    "unspent": int(unspent),
                    "admit_per_second": _int(aps),
                    "auto": _auto(auto, arate, reason, detail),
                    "challenge_bits": bits,
                    "message": _message(msg),
                }
            }
        return out

    # -- the message ----------------------------------------------------------------------

    async def set_message(self, deal_id: int, body: Any, actor: str) -> dict[str, Any]:
        """The room's message to its waiters: {"message": {"text", "level"}} or
        {"message": null} to remove it."""
        body = validate.obj(body)
        validate.no_unknown(body, {"message"})
        if "message" not in body:
            raise invalid("'message' is required (null removes the message).")
        message = parse_message(body["message"])
        note = f"message: {message.level}: {message.text}" if message else "message removed"

        async def attempt() -> tuple[RoomConfig, bytes | None, int]:
            async with self.gate.db.connection() as conn, conn.cursor() as cur:
                await cur.execute("START TRANSACTION")
                await cur.execute(
                    "SELECT waiting_room, room_seed, version FROM deals WHERE id = %s FOR UPDATE",
                    (deal_id,),
                )
                row = await cur.fetchone()
                if row is None:
                    await cur.execute("ROLLBACK")
                    raise not_found("deal")
                room = RoomConfig.from_column(row[0])
                if room is None:
                    await cur.execute("ROLLBACK")
                    raise Problem("CONFLICT", "The deal has no waiting room.")
                try:
                    # The admin API's bound on the whole room (its column) too.
                    changed = fitting(dataclasses.replace(room, message=message))
                except Problem:
                    await cur.execute("ROLLBACK")
                    raise
                await cur.execute(
                    "UPDATE deals SET waiting_room = %s, updated_at = NOW(6),"
                    " version = version + 1 WHERE id = %s",
                    (changed.to_column(), deal_id),
                )
                await ledger_note(cur, deal_id, MESSAGE_REASON, actor, note)
                await cur.execute("COMMIT")
                return changed, None if row[1] is None else bytes(row[1]), int(row[2]) + 1

        changed, seed, version = await self.gate.db.retrying(attempt)
        try:
            seed = await self.room.seed(deal_id, seed)
            await self.room.publish(deal_id, version, changed, seed)
        except Exception as exc:
            # Committed: the room loop copies every open room to Redis within its refresh.
            log.warning("deal %s: room message stored, Redis deferred: %r", deal_id, exc)
        return await self.gate.deals.admin_view(deal_id)
