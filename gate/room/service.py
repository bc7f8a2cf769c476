"""The waiting room of a deal (issue #13, docs/waiting-room.md).

    buyer ── POST /v1/deals/{id}/queue ──> room_ticket.lua (join) ──> ticket
          ── GET  /v1/deals/{id}/queue ──> room_ticket.lua (read) ──> ticket
                                               (+ a signed admission token once admitted)
    every gate process, every GATE_ROOM_INTERVAL_MS:
          room loop ──> room_advance.lua per room: lapse, then admit on Redis time
                        within the rate, the stock bound and the sale window
    buyer ── POST /v1/deals/{id}/reservations + Admission-Token
          ──> lua/admit.lua checks the admission and spends it with the units

All of a room's live state is in Redis, in the deal's slot; its configuration is on
the deal row and copied to Redis before the deal's state is (Mirror.before_sync),
so a Redis flush can never leave a loaded deal without its room.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from datetime import UTC, datetime
from typing import Any

from gate.clock import iso
from gate.codes import RoomCode
from gate.db import Database
from gate.errors import from_room, not_found, overloaded
from gate.keys import ROOMS, deal_keys
from gate.mirror import Mirror
from gate.room import metrics
from gate.room.config import RoomConfig, RoomSettings, parse_room
from gate.room.tokens import AdmissionTokens
from gate.scripts import ScriptRunner

log = logging.getLogger("gate.room")

PREQUEUE_SCORE_BITS = 50
STATES = {
    RoomCode.WAITING: "waiting",
    RoomCode.ADMITTED: "admitted",
    RoomCode.SOLD_OUT: "sold_out",
    RoomCode.CLOSED: "closed",
}
# The room loop re-reads every room's configuration from the database this often
# (a flushed Redis gets its rooms back even if no buyer asks), and the gauges.
REFRESH_SECONDS = 5.0
GAUGES_SECONDS = 1.0
ROOMS_MAX = 10_000
KEYS_CACHE_MAX = 10_000
# Tickets read "closed" for this long after ends_at; then the room loop drops them.
RETAIN_AFTER_END_MS = 3_600_000


def _iso_ms(ms: int) -> str | None:
    """Redis milliseconds as the API's ISO 8601 UTC timestamps."""
    if ms <= 0:
        return None
    return iso(datetime.fromtimestamp(ms / 1000, UTC).replace(tzinfo=None))


class Room:
    def __init__(
        self,
        settings: RoomSettings,
        db: Database,
        mirror: Mirror,
        runner: ScriptRunner,
        tokens: AdmissionTokens,
    ) -> None:
        self.settings = settings
        self.db = db
        self.mirror = mirror
        self.redis = mirror.redis
        self.runner = runner
        self.tokens = tokens
        # deal -> the KEYS of room_ticket.lua, built once per deal rather than per poll
        self._keys: dict[int, tuple[str, str, str, str, str]] = {}

    # -- buyers -----------------------------------------------------------------------

    async def ticket(self, deal_id: int, user_id: int, mode: str) -> tuple[bool, dict[str, Any]]:
        """Join ("join") or read ("read") a ticket: (created, body)."""
        reply = await self._ticket_call(deal_id, user_id, mode)
        if int(reply[0]) == RoomCode.NOT_LOADED:
            try:
                found = await self.mirror.load(deal_id)
            except Exception as exc:
                log.warning("deal %s not loaded into Redis: %r", deal_id, exc)
                raise overloaded("Deal state unavailable; retry shortly.") from None
            if not found:
                raise not_found("deal")
            reply = await self._ticket_call(deal_id, user_id, mode)
            if int(reply[0]) == RoomCode.NOT_LOADED:
                raise overloaded("Deal state is being rebuilt; retry shortly.")
        code = RoomCode(int(reply[0]))
        if code not in STATES:
            raise from_room(code, str(reply[1]) if len(reply) > 1 else "")
        created, position, joined_ms, avail, seq, expires_ms, advice, aps, to_start = (
            int(x) for x in reply[1:10]
        )
        token = None
        if code == RoomCode.ADMITTED:
            token = self.tokens.mint(deal_id, user_id, seq, expires_ms)
        body = {
            "deal_id": deal_id,
            "state": STATES[code],
            "position": position if code == RoomCode.WAITING else None,
            "joined_at": _iso_ms(joined_ms),
            "eta_seconds": (
                math.ceil(to_start / 1000) + math.ceil(position / max(1, aps))
                if code == RoomCode.WAITING
                else None
            ),
            "poll_after_ms": advice,
            "available_hint": avail,
            "admission_token": token,
            "admission_expires_at": _iso_ms(expires_ms) if token else None,
        }
        return created == 1, body

    async def _ticket_call(self, deal_id: int, user_id: int, mode: str) -> list[Any]:
        keys = self._keys.get(deal_id)
        if keys is None:
            if len(self._keys) >= KEYS_CACHE_MAX:
                self._keys.clear()
            k = deal_keys(deal_id)
            keys = (k.room, k.room_queue, k.room_tickets, k.room_admitted, k.meta)
            self._keys[deal_id] = keys
        try:
            reply: list[Any] = await self.runner.call(
                "room_ticket",
                keys,
                (
                    mode,
                    user_id,
                    # Only a join may use it; a read skips the system call.
                    secrets.randbits(PREQUEUE_SCORE_BITS) if mode == "join" else 0,
                    self.settings.poll_min_ms,
                    self.settings.poll_max_ms,
                ),
            )
        except Exception as exc:
            log.warning("room ticket failed for deal %s: %r", deal_id, exc)
            raise overloaded("Waiting room unavailable; retry shortly.") from None
        return reply

    # -- admin ------------------------------------------------------------------------

    async def configure(self, deal_id: int, body: Any) -> None:
        """PUT /v1/admin/deals/{id}/waiting-room: the object, or null to remove."""
        room = parse_room(body)
        async with self.db.connection() as conn, conn.cursor() as cur:
            await cur.execute(
                "UPDATE deals SET waiting_room = %s, updated_at = NOW(6), version = version + 1"
                " WHERE id = %s",
                (room.to_column() if room else None, deal_id),
            )
            if cur.rowcount != 1:
                await cur.execute("SELECT 1 FROM deals WHERE id = %s", (deal_id,))
                if await cur.fetchone() is None:
                    raise not_found("deal")
        # Every process reads the room's configuration from Redis on every call.
        await self.publish(deal_id, room)

    async def publish(self, deal_id: int, room: RoomConfig | None) -> None:
        """Copy a room's configuration to Redis, where the scripts read it."""
        keys = deal_keys(deal_id)
        if room is None:
            if await self.redis.hget(keys.room, "on") == "1":
                await self.redis.hset(keys.room, "on", "0")
            await self.redis.srem(ROOMS, deal_id)
            return
        await self.redis.hset(
            keys.room,
            mapping={
                "on": "1",
                "aps": room.admit_per_second,
                "ttl_ms": room.admission_ttl_seconds * 1000,
                "pq_ms": room.prequeue_seconds * 1000,
            },
        )
        await self.redis.sadd(ROOMS, deal_id)

    async def before_sync(self, deal_id: int, mode: str) -> None:
        """Mirror hook: the room's configuration reaches Redis before the deal's state
        does (a load after a flush, a rebuild). Not on resync passes (every second for
        every active deal): the room loop republishes open rooms every few seconds."""
        if mode == "resync":
            return
        row = await self.db.fetchone("SELECT waiting_room FROM deals WHERE id = %s", (deal_id,))
        if row is None:
            return
        await self.publish(deal_id, RoomConfig.from_column(row[0]))

    # -- the room loop ------------------------------------------------------------------

    async def advance(self, deal_id: int) -> tuple[int, int]:
        """One room_advance.lua step for a deal: (admitted, lapsed)."""
        keys = deal_keys(deal_id)
        code, admitted, lapsed, waits = await self.runner.call(
            "room_advance",
            (*keys.room_state, keys.meta),
            (
                repr(self.settings.admission_ratio),
                self.settings.admit_batch_max,
                self.settings.lapse_batch_max,
                RETAIN_AFTER_END_MS,
            ),
        )
        if int(code) == 1:
            # The deal's state is absent (a flush): load it, the room comes with it.
            await self.mirror.load(deal_id)
            return 0, 0
        if int(code) == 2:
            await self.redis.srem(ROOMS, deal_id)
            return 0, 0
        if int(code) == 3:
            # Long over: free the memory (UNLINK frees it off Redis's main thread).
            await self.redis.unlink(
                keys.room_queue,
                keys.room_tickets,
                keys.room_admitted,
                keys.room_expiry,
                keys.room_window,
            )
            await self.redis.srem(ROOMS, deal_id)
            log.info("deal %s: sale over, waiting room tickets dropped", deal_id)
            return 0, 0
        label = str(deal_id)
        if int(admitted):
            metrics.ADMITTED.labels(label).inc(int(admitted))
            hist = metrics.WAIT.labels(label)
            for wait_ms in str(waits).split(","):
                hist.observe(int(wait_ms) / 1000)
        if int(lapsed):
            metrics.LAPSED.labels(label).inc(int(lapsed))
        return int(admitted), int(lapsed)

    async def refresh(self) -> list[int]:
        """Every room of a deal whose sale has not ended, from the database to Redis."""
        rows = await self.db.fetchall(
            "SELECT id, waiting_room FROM deals WHERE waiting_room IS NOT NULL"
            " AND (ends_at IS NULL OR ends_at > NOW(6)) ORDER BY id DESC LIMIT %s",
            (ROOMS_MAX,),
        )
        for deal_id, raw in rows:
            await self.publish(int(deal_id), RoomConfig.from_column(raw))
        return [int(r[0]) for r in rows]

    async def gauges(self, deal_ids: list[int]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for deal_id in deal_ids:
            keys = deal_keys(deal_id)
            pipe.zcard(keys.room_queue)
            pipe.hlen(keys.room_admitted)
            pipe.hget(keys.room, "spent")
        values = await pipe.execute()
        for i, deal_id in enumerate(deal_ids):
            label = str(deal_id)
            waiting, unspent, spent = values[3 * i : 3 * i + 3]
            metrics.WAITING.labels(label).set(int(waiting))
            metrics.UNSPENT.labels(label).set(int(unspent))
            metrics.SPENT.labels(label).set(int(spent or 0))

    async def run_once(self) -> int:
        """Advance every room once; returns the admissions given."""
        given = 0
        raw = await self.redis.srandmember(ROOMS, ROOMS_MAX)
        for member in raw or []:
            admitted, _ = await self.advance(int(member))
            given += admitted
        return given

    async def run(self, stop: asyncio.Event) -> None:
        refreshed = gauged = 0.0
        rooms: list[int] = []
        while not stop.is_set():
            now = time.monotonic()
            try:
                if now - refreshed >= REFRESH_SECONDS:
                    rooms = await self.refresh()
                    refreshed = now
                await self.run_once()
                if now - gauged >= GAUGES_SECONDS and rooms:
                    await self.gauges(rooms)
                    gauged = now
            except Exception as exc:
                log.warning("room pass failed: %r", exc)
            try:
                await asyncio.wait_for(stop.wait(), self.settings.interval_seconds)
            except TimeoutError:
                pass
