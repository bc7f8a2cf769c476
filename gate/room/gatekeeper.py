"""The Redis and database side of a room's gates (gate/room/gates.py has the flow):
the admin's access codes, their copy into Redis, and the challenge a buyer asks for.

    POST .../access-codes ──> the admin's codes, or codes made here ({"generate": n})
                          ──> room_access_codes (INSERT IGNORE, one transaction)
                          ──> {d:ID}:rcodes HSETNX (a bound code stays bound)
    a deal's load (after a flush, a rebuild), a room set with access "codes"
                          ──> load_codes: the table's codes back into Redis
    GET .../queue/challenge ──> room_challenge.lua ──> bits ──> a signed challenge
                                (a deal Redis lacks: NotLoaded, loaded by the route's
                                guard, gate/room/routes.py)
"""

from __future__ import annotations

import logging
from typing import Any

from gate.base.codes import RoomCode
from gate.base.errors import from_room, not_found
from gate.inventory.mirror import Mirror
from gate.inventory.room_config import RoomConfig
from gate.room.gates import (
    CODES_PER_DEAL_MAX,
    JoinPasses,
    challenge_bits,
    parse_codes,
    too_many_codes,
)
from gate.room.routes import NotLoaded
from gate.room.service import iso_ms, ticket_failed
from gate.store.db import Database
from gate.store.keys import deal_keys
from gate.store.scripts import ScriptRunner

log = logging.getLogger("gate.room")

# Codes copied into Redis per command (load_codes).
LOAD_BATCH = 10_000


class RoomGates:
    def __init__(
        self, db: Database, mirror: Mirror, runner: ScriptRunner, passes: JoinPasses
    ) -> None:
        self.db = db
        self.mirror = mirror
        self.redis = mirror.redis
        self.runner = runner
        self.passes = passes

    async def add_codes(self, deal_id: int, body: Any) -> dict[str, Any]:
        """POST /v1/admin/deals/{id}/access-codes: {"added", "total"}, and "codes" (the
        only copy there is: they are stored hashed) when the gate made them."""
        codes, generated = parse_codes(body)
        hashes = [self.passes.code_hash(code) for code in codes]
        async with self.db.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            await cur.execute("SELECT id FROM deals WHERE id = %s FOR UPDATE", (deal_id,))
            if await cur.fetchone() is None:
                await cur.execute("ROLLBACK")
                raise not_found("deal")
            await cur.execute(
                "SELECT COUNT(*) FROM room_access_codes WHERE deal_id = %s", (deal_id,)
            )
            before = int((await cur.fetchone())[0])
            if before + len(hashes) > CODES_PER_DEAL_MAX:
                await cur.execute("ROLLBACK")
                raise too_many_codes()
            await cur.executemany(
                "INSERT IGNORE INTO room_access_codes (deal_id, code_hash) VALUES (%s, %s)",
                [(deal_id, h) for h in hashes],
            )
            await cur.execute(
                "SELECT COUNT(*) FROM room_access_codes WHERE deal_id = %s", (deal_id,)
            )
            total = int((await cur.fetchone())[0])
            await cur.execute("COMMIT")
        try:
            await self._copy(deal_id, hashes)
        except Exception as exc:
            # The table has them: the same call again copies them (HSETNX).
            raise ticket_failed(deal_id, exc) from None
        answer: dict[str, Any] = {"added": total - before, "total": total}
        if generated:
            answer["codes"] = codes
        return answer

    async def _copy(self, deal_id: int, hashes: list[str]) -> None:
        """Codes into the deal's Redis hash, unbound unless Redis knows them bound."""
        key = deal_keys(deal_id).room_codes
        for i in range(0, len(hashes), LOAD_BATCH):
            pipe = self.redis.pipeline(transaction=False)
            for h in hashes[i : i + LOAD_BATCH]:
                pipe.hsetnx(key, h, "")
            await pipe.execute()

    async def load_codes(self, deal_id: int) -> int:
        """The table's codes of a deal back into Redis (a flush, a room set again after
        its keys were retired), in batches; returns how many."""
        count, after = 0, ""
        while True:
            rows = await self.db.fetchall(
                "SELECT code_hash FROM room_access_codes WHERE deal_id = %s AND code_hash > %s"
                " ORDER BY code_hash LIMIT %s",
                (deal_id, after, LOAD_BATCH),
            )
            if not rows:
                return count
            hashes = [str(r[0]) for r in rows]
            await self._copy(deal_id, hashes)
            count += len(hashes)
            after = hashes[-1]
            if len(rows) < LOAD_BATCH:
                return count

    async def before_sync(self, deal_id: int, mode: str) -> None:
        """Mirror hook (after the room's own): an invite-only room's codes come back
        with the deal (a load after a flush, a rebuild), never on resync passes."""
        if mode == "resync":
            return
        row = await self.db.fetchone("SELECT waiting_room FROM deals WHERE id = %s", (deal_id,))
        room = RoomConfig.from_column(row[0]) if row else None
        if room is not None and room.access == "codes":
            await self.load_codes(deal_id)

    async def challenge(self, deal_id: int, user_id: int) -> dict[str, Any]:
        """GET /v1/deals/{id}/queue/challenge: a challenge priced by the room's demand."""
        reply = await self._demand(deal_id)
        if reply[0] == RoomCode.NOT_LOADED:
            raise NotLoaded(deal_id)
        if reply[0] != 0:
            raise from_room(RoomCode(int(reply[0])))
        _, low, high, waiting, available = (int(v) for v in reply)
        bits = challenge_bits(low, high, waiting, available)
        challenge, expires_ms = self.passes.mint(deal_id, user_id, bits)
        return {"challenge": challenge, "bits": bits, "expires_at": iso_ms(expires_ms)}

    async def _demand(self, deal_id: int) -> list[Any]:
        k = deal_keys(deal_id)
        try:
            reply: list[Any] = await self.runner.call(
                "room_challenge", (k.room, k.room_queue, k.meta), ()
            )
        except Exception as exc:
            # Redis down or slow: 503 OVERLOADED, counted and logged as a ticket's is.
            raise ticket_failed(deal_id, exc) from None
        return reply
