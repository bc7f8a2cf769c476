"""The waiting room of a deal (docs/waiting-room.md).

    buyer ── POST /v1/deals/{id}/queue ──> room_ticket.lua (join) ──> ticket
          ── GET  /v1/deals/{id}/queue ──> room_ticket.lua (read) ──> ticket
                                               (+ a signed admission token once admitted;
                                                a waiting ticket's chance from the table
                                                this process holds: gate/room/estimate.py)
    every gate process, every GATE_ROOM_INTERVAL_MS:
          room loop ──> room_advance.lua per room: lapse, then admit on Redis time
                        within the rate, the stock bound and the sale window
    buyer ── POST /v1/deals/{id}/reservations + Admission-Token
          ──> lua/admit.lua checks the admission and spends it with the units

All of a room's live state is in Redis, in the deal's slot; its configuration is on
the deal row and copied to Redis before the deal's state is (Mirror.before_sync),
so a Redis flush can never leave a loaded deal without its room. A deal Redis lacks
is loaded through the room's one guard (gate/room/routes.py DealGuard).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

import orjson
from redis.exceptions import NoScriptError, ResponseError

from gate.base.codes import RoomCode
from gate.base.errors import Problem, from_room, not_found, overloaded
from gate.base.singleflight import SingleFlight
from gate.inventory.mirror import Mirror
from gate.inventory.room_config import RoomConfig, RoomSettings, parse_room
from gate.inventory.unknown_deals import UnknownDeals
from gate.room import fairness, metrics, retire
from gate.room.estimate import Tables
from gate.room.gates import NO_PASS, JoinPass, redis_fields
from gate.room.routes import DealGuard, NotLoaded
from gate.room.tokens import AdmissionTokens
from gate.room.wire import Command, Wire
from gate.store.db import Database
from gate.store.keys import ROOMS, deal_keys
from gate.store.scripts import REDIS_ERRORS, ScriptRunner, error_kind

log = logging.getLogger("gate.room")

# A ticket's state by room_ticket.lua's code (0-3); a higher code is a refusal.
STATE_NAMES = ("waiting", "admitted", "sold_out", "closed")
# A waiting ticket whose chance is below the room's unlikely_below: still in line.
UNLIKELY = "unlikely"
WAITING, ADMITTED, CLOSED = int(RoomCode.WAITING), int(RoomCode.ADMITTED), int(RoomCode.CLOSED)
# The refusals of a join with a code that count in gate_room_code_failures_total.
CODE_FAILURES = {
    int(RoomCode.ACCESS_CODE_INVALID): "invalid",
    int(RoomCode.ACCESS_CODE_USED): "used",
    int(RoomCode.CODE_ATTEMPTS_LIMITED): "rate_limited",
}
# The room loop re-reads every room's configuration from the database this often
# (a flushed Redis gets its rooms back even if no buyer asks), and the gauges.
REFRESH_SECONDS = 5.0
GAUGES_SECONDS = 1.0
ROOMS_MAX = 10_000
KEYS_CACHE_MAX = 10_000
# Decoded messages to waiters by their JSON (a room has one at a time).
MESSAGES_MAX = 1024
# room_advance.lua reports a sale over (code 3) this long after ends_at: at once;
# the tickets then read "closed" until the room is retired (gate/room/retire.py).
RETAIN_AFTER_END_MS = 0


# "YYYY-MM-DDTHH:MM:SS" by epoch second: a ticket's timestamps are formatted from
# this (datetime's way cost a tenth of a poll); joins crowd into few seconds.
_ISO_SECONDS: dict[int, str] = {}
ISO_SECONDS_MAX = 4096


def iso_ms(ms: int) -> str | None:
    """Redis milliseconds as the API's ISO 8601 UTC timestamps (gate.base.clock.iso's
    format: microseconds and a Z)."""
    if ms <= 0:
        return None
    second, milli = divmod(ms, 1000)
    head = _ISO_SECONDS.get(second)
    if head is None:
        if len(_ISO_SECONDS) >= ISO_SECONDS_MAX:
            _ISO_SECONDS.clear()
        head = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _ISO_SECONDS[second] = head
    return f"{head}.{milli:03d}000Z"


def _fairness_fields(room: RoomConfig, seed: bytes | None) -> dict[str, str]:
    """The room hash's fields for the draw and the message (lua/room_ticket.lua)."""
    fields = {
        "method": room.method,
        "msg": orjson.dumps(room.message.view()).decode() if room.message else "",
    }
    if seed is not None:
        fields["seed"] = seed.hex()
    return fields


def ticket_failed(deal_id: int, exc: BaseException) -> Problem:
    """A ticket's call failed (Redis down, timed out, a script error): counted,
    logged, and answered 503."""
    REDIS_ERRORS.labels(error_kind(exc)).inc()
    log.warning("room ticket failed for deal %s: %r", deal_id, exc)
    return overloaded("Waiting room unavailable; retry shortly.")


def _ticket_keys(deal_id: int) -> tuple[str, ...]:
    """room_ticket.lua's KEYS for a deal."""
    k = deal_keys(deal_id)
    return (
        k.room,
        k.room_queue,
        k.room_tickets,
        k.room_admitted,
        k.meta,
        fairness.draw_key(deal_id),
        k.room_codes,
        k.room_left,
    )


def _pass_args(passed: JoinPass) -> bytes:
    """A join's gate arguments in RESP: the code's hash, the challenge, the client's
    address ("" each when absent)."""
    code, proof, address = passed.code_hash, passed.challenge, passed.address
    return b"$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
        len(code),
        code,
        len(proof),
        proof,
        len(address),
        address,
    )


class Room:
    def __init__(
        self,
        settings: RoomSettings,
        db: Database,
        mirror: Mirror,
        runner: ScriptRunner,
        tokens: AdmissionTokens,
        wire: Wire,
        guard: DealGuard | None = None,
    ) -> None:
        self.settings = settings
        self.db = db
        self.mirror = mirror
        self.redis = mirror.redis
        self.runner = runner
        self.tokens = tokens
        self.wire = wire
        # A deal Redis lacks is loaded through the guard: unknown deal ids answered 404
        # without the database, as reservations and deal views are, and one load per
        # deal at a time (gate/room/routes.py).
        self.guard = guard or DealGuard(UnknownDeals(mirror.redis, db), mirror)
        # deal -> room_ticket.lua's commands (join, read), packed once
        self._prefixes: dict[int, tuple[Command, Command]] = {}
        # deal -> the room's draw seed (fixed for the deal's life: kept once known)
        self._seeds: dict[int, fairness.Drawer] = {}
        self._learning: SingleFlight[int, None] = SingleFlight()
        self._messages: dict[str, Any] = {"": None}
        self._ticket_ids = fairness.TicketIds()
        # Each deal's chance table, as the estimate loop last wrote it.
        self.tables = Tables(mirror.redis)

    # -- buyers -----------------------------------------------------------------------

    async def ticket(
        self, deal_id: int, user_id: int, mode: str, passed: JoinPass = NO_PASS
    ) -> tuple[bool, dict[str, Any]]:
        """Join ("join") or read ("read") a ticket: (created, body). `passed`: what the
        join's body proved (gate/room/gates.py). A deal Redis lacks is loaded through
        the guard and asked again (nothing ran: the script answered NOT_LOADED)."""
        join = mode == "join"
        return await self.guard.run(deal_id, lambda: self._ticket(deal_id, user_id, join, passed))

    async def _ticket(
        self, deal_id: int, user_id: int, join: bool, passed: JoinPass
    ) -> tuple[bool, dict[str, Any]]:
        if join and deal_id not in self._seeds:
            # The deal's first join in this process: an unknown id ends here, before
            # its room's seed is looked for.
            await self.guard.check(deal_id)
            await self._learn_seed(deal_id)
        if self.tables.fresh(deal_id):
            reply = await self._ticket_call(deal_id, user_id, join, passed)
        else:
            # The chance's table, at most once a second per deal, alongside the call.
            reply, _ = await asyncio.gather(
                self._ticket_call(deal_id, user_id, join, passed), self.tables.ensure(deal_id)
            )
        if reply[0] == RoomCode.NOT_LOADED:
            raise NotLoaded(deal_id)
        return self.settle(deal_id, user_id, reply)

    def has_seed(self, deal_id: int) -> bool:
        """Whether a join can be sent at once (the edge's test; else `ticket`)."""
        return deal_id in self._seeds

    async def _learn_seed(self, deal_id: int) -> None:
        """The room's seed from Redis, once per deal: concurrent first joins share
        the look-up (and so go out together, in one call, when it is answered)."""
        try:
            await self._learning.run(deal_id, lambda: self._read_seed(deal_id))
        except Exception as exc:
            raise ticket_failed(deal_id, exc) from None

    async def _read_seed(self, deal_id: int) -> None:
        raw = await self.redis.hget(deal_keys(deal_id).room, "seed")
        if raw:
            if len(self._seeds) >= KEYS_CACHE_MAX:
                self._seeds.clear()
            self._seeds[deal_id] = fairness.Drawer(bytes.fromhex(str(raw)))

    def _new_ticket(self, deal_id: int) -> tuple[int, str]:
        """A join's draw score and new ticket id; (0, "") without the room's seed
        (room_ticket.lua then answers NOT_LOADED to a buyer without a ticket)."""
        drawer = self._seeds.get(deal_id)
        if drawer is None:
            return 0, ""
        ticket_id = self._ticket_ids.new()
        return drawer.score(ticket_id), ticket_id

    def start_ticket(
        self, deal_id: int, user_id: int, join: bool, passed: JoinPass = NO_PASS
    ) -> asyncio.Future[Any]:
        """The buyer's part of room_ticket.lua, sent with this loop turn's others; the
        future is its reply as the wire hands it over (a list, an error object, or
        the connection's failure). `ticket` awaits it; the edge settles it in a
        callback (gate/room/edge_lane.py), with no task."""
        if self.runner.cluster:
            return self._cluster_ticket(deal_id, join, user_id, passed)
        user = b"%d" % user_id
        if join:
            # Only a first join uses them (the script decides); made for every join.
            drawn, ticket_id = self._new_ticket(deal_id)
            score, tid = b"%d" % drawn, ticket_id.encode()
            member = b"$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
                len(user),
                user,
                len(score),
                score,
                len(tid),
                tid,
            )
            member += _pass_args(passed)
        else:
            member = b"$%d\r\n%s\r\n" % (len(user), user)
        return self.wire.call(self._prefix(deal_id, join), member)

    def _cluster_ticket(
        self, deal_id: int, join: bool, user_id: int, passed: JoinPass
    ) -> asyncio.Future[Any]:
        """On Redis Cluster the deal's keys live on the node that owns its slot, which
        the wire's one connection does not know: the call goes through the script
        runner (routed by slot, redirects and NOSCRIPT handled there), one buyer per
        call, and its future resolves to the buyer's part as the wire's does."""
        keys = _ticket_keys(deal_id)
        floor, ceiling = self.settings.poll_min_ms, self.settings.poll_max_ms
        attempts = self.settings.code_attempts_per_minute
        args: tuple[Any, ...] = ("join" if join else "read", floor, ceiling, attempts, user_id)
        if join:
            args += (
                *self._new_ticket(deal_id),
                passed.code_hash,
                passed.challenge,
                passed.address,
            )
        inner = self.runner.call("room_ticket", keys, args)
        out: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def unwrap(f: asyncio.Future[Any]) -> None:
            if out.done():
                return
            if f.cancelled():
                out.cancel()
            elif (exc := f.exception()) is not None:
                out.set_exception(exc)
            else:
                reply = f.result()
                ok = type(reply) is list and len(reply) == 1
                out.set_result(reply[0] if ok else ResponseError(f"room_ticket: {reply!r}"))

        inner.add_done_callback(unwrap)
        return out

    def settle(self, deal_id: int, user_id: int, reply: list[Any]) -> tuple[bool, dict[str, Any]]:
        """(created, body) of a ticket's reply; a refusal raises its Problem. Not for
        NOT_LOADED (its caller loads the deal and asks again)."""
        code: int = reply[0]
        if code > CLOSED:
            failure = CODE_FAILURES.get(code)
            if failure is not None:
                metrics.CODE_FAILURES.labels(failure).inc()
            raise from_room(RoomCode(code), str(reply[1]) if len(reply) > 1 else "")
        # hiredis hands the script's integers over as ints: nothing to convert.
        _, created, position, joined_ms, avail, seq, expires_ms, advice, aps, to_start = reply[:10]
        ticket_id, message = reply[10], reply[11]
        waiting = code == WAITING
        found: dict[str, object] | None = None
        state = STATE_NAMES[code]
        if waiting:
            self.tables.kick(deal_id)
            found, unlikely = self.tables.chance(deal_id, position, avail)
            if unlikely:
                state = UNLIKELY
        token = None
        if code == ADMITTED:
            token = self.tokens.mint(deal_id, user_id, seq, expires_ms)
        body = {
            "deal_id": deal_id,
            "state": state,
            "position": position if waiting else None,
            "joined_at": iso_ms(joined_ms),
            # ceil(to_start / 1000) + ceil(position / aps), in integers.
            "eta_seconds": -(-to_start // 1000) - (-position // (aps if aps > 0 else 1))
            if waiting
            else None,
            "poll_after_ms": advice,
            "available_hint": avail,
            "admission_token": token,
            "admission_expires_at": iso_ms(expires_ms) if token else None,
            "ticket_id": ticket_id or None,
            "message": self._message(message),
            "chance": found,
            # The sale paused (gate/inventory/pause.py): the ticket keeps its place.
            "paused": len(reply) > 12 and reply[12] == 1,
        }
        return created == 1, body

    def _message(self, raw: Any) -> Any:
        """The room's message to waiters, from its JSON on the room's hash."""
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        found = self._messages.get(text, self)
        if found is self:
            if len(self._messages) >= MESSAGES_MAX:
                self._messages = {"": None}
            found = self._messages[text] = orjson.loads(text)
        return found

    def _prefix(self, deal_id: int, join: bool) -> Command:
        """room_ticket.lua's command for this deal up to the buyers, packed once."""
        packed = self._prefixes.get(deal_id)
        if packed is None:
            if len(self._prefixes) >= KEYS_CACHE_MAX:
                self._prefixes.clear()
            keys = _ticket_keys(deal_id)
            sha = self.runner.scripts["room_ticket"].sha
            floor, ceiling = str(self.settings.poll_min_ms), str(self.settings.poll_max_ms)
            attempts = str(self.settings.code_attempts_per_minute)
            packed = (
                # join: per buyer the user id, its draw score and ticket id, the
                # access code's hash, the verified challenge and the client's
                # address; read: the id.
                Command(sha, keys, ("join", floor, ceiling, attempts), 6),
                Command(sha, keys, ("read", floor, ceiling, attempts), 1),
            )
            self._prefixes[deal_id] = packed
        return packed[0] if join else packed[1]

    async def _ticket_call(
        self, deal_id: int, user_id: int, join: bool, passed: JoinPass
    ) -> list[Any]:
        try:
            reply: Any = await self.start_ticket(deal_id, user_id, join, passed)
            if type(reply) is not list:
                if isinstance(reply, NoScriptError):
                    # Redis lost its scripts (a restart): nothing ran; load and call again.
                    await self.runner.load()
                    reply = await self.start_ticket(deal_id, user_id, join, passed)
                if isinstance(reply, Exception):
                    raise reply
        except Exception as exc:
            raise ticket_failed(deal_id, exc) from None
        return cast(list[Any], reply)

    # -- admin ------------------------------------------------------------------------

    async def configure(self, deal_id: int, body: Any) -> None:
        """PUT /v1/admin/deals/{id}/waiting-room: the object, or null to remove."""
        room = parse_room(body)
        column = room.to_column() if room else None
        # The page's logo is kept apart from the room's JSON (db/080_room_logo.sql).
        logo = room.logo_column() if room else None

        async def attempt() -> int | None:
            async with self.db.connection() as conn, conn.cursor() as cur:
                await cur.execute("START TRANSACTION")
                # A deal of several partitions has no room (docs/scale-out.md): its
                # admissions live in one partition's slot, its buyers in P.
                await cur.execute(
                    "UPDATE deals SET waiting_room = %s, room_logo = %s, updated_at = NOW(6),"
                    " version = version + 1 WHERE id = %s AND (partitions = 1 OR %s IS NULL)",
                    (column, logo, deal_id, column),
                )
                changed = cur.rowcount == 1
                # Under the row's lock: the version of this change, not of a later one.
                await cur.execute("SELECT version, partitions FROM deals WHERE id = %s", (deal_id,))
                row = await cur.fetchone()
                await cur.execute("COMMIT")
            if row is None:
                raise not_found("deal")
            if not changed and room is not None and int(row[1]) > 1:
                raise Problem(
                    "CONFLICT", "A deal of several partitions cannot have a waiting room."
                )
            return int(row[0]) if changed else None

        version = await self.db.retrying(attempt)
        if version is None:
            return
        seed = await self.seed(deal_id) if room is not None else None
        # Every process reads the room's configuration from Redis on every call.
        await self.publish(deal_id, version, room, seed)

    async def seed(self, deal_id: int, known: bytes | None = None) -> bytes:
        """The deal's draw seed, made the first time the deal has a room and never
        changed after (its commitment is public from then on)."""
        if known is not None:
            return bytes(known)
        await self.db.execute(
            # UNHEX: aiomysql's escaping of bytes is broken; hex is plain ASCII.
            "UPDATE deals SET room_seed = UNHEX(%s) WHERE id = %s AND room_seed IS NULL",
            (fairness.new_seed().hex(), deal_id),
        )
        row = await self.db.fetchone("SELECT room_seed FROM deals WHERE id = %s", (deal_id,))
        if row is None or row[0] is None:
            raise not_found("deal")
        return bytes(row[0])

    async def publish(
        self, deal_id: int, version: int, room: RoomConfig | None, seed: bytes | None = None
    ) -> bool:
        """Copy a room's configuration (and its seed) to Redis, where the scripts read
        it, unless Redis holds one of a newer `version` of the deal's row
        (lua/room_publish.lua); returns whether it was copied."""
        keys = deal_keys(deal_id)
        unset: list[str] = []
        if room is None:
            mapping: dict[str, str | int] = {"on": "0"}
        else:
            mapping = {
                "on": "1",
                "aps": room.admit_per_second,
                "ttl_ms": room.admission_ttl_seconds * 1000,
                "pq_ms": room.prequeue_seconds * 1000,
                # "auto": aps is the cap; the decision's fields come from the
                # estimate loop (gate/room/estimate.py).
                "auto": "1" if room.auto else "0",
                "unl": repr(room.unlikely_below),
            }
            gate_fields, unset = redis_fields(room)
            mapping.update(_fairness_fields(room, seed))
            mapping.update(gate_fields)
        pairs = [item for field in mapping.items() for item in field]
        written, was_on = await self.runner.call(
            "room_publish", (keys.room,), (version, len(mapping), *pairs, *unset)
        )
        if not int(written):
            return False
        if room is not None:
            await self.redis.sadd(ROOMS, deal_id)
            return True
        if str(was_on) == "1":
            # Its tickets, queue and admissions are dead now: deleted by the retire
            # loop (gate/room/retire.py) within its interval.
            await retire.schedule(self.redis, deal_id)
        await self.redis.srem(ROOMS, deal_id)
        return True

    async def before_sync(self, deal_id: int, mode: str) -> None:
        """Mirror hook: the room's configuration reaches Redis before the deal's state
        does (a load after a flush, a rebuild). Not on resync passes (every second for
        every active deal): the room loop republishes open rooms every few seconds."""
        if mode == "resync":
            return
        row = await self.db.fetchone(
            "SELECT waiting_room, room_seed, version FROM deals WHERE id = %s", (deal_id,)
        )
        if row is None:
            return
        await self._publish_row(deal_id, row[0], row[1], int(row[2]))

    async def _publish_row(self, deal_id: int, raw: Any, seed: bytes | None, version: int) -> None:
        room = RoomConfig.from_column(raw)
        seed = await self.seed(deal_id, seed) if room else None
        await self.publish(deal_id, version, room, seed)

    # -- the room loop ------------------------------------------------------------------

    async def advance(self, deal_id: int) -> tuple[int, int]:
        """One room_advance.lua step for a deal: (admitted, lapsed)."""
        keys = deal_keys(deal_id)
        code, admitted, lapsed, waits = await self.runner.call(
            "room_advance",
            (*keys.room_state, keys.meta, keys.room_ring),
            (
                repr(self.settings.admission_ratio),
                self.settings.admit_batch_max,
                self.settings.lapse_batch_max,
                RETAIN_AFTER_END_MS,
            ),
        )
        if int(code) == 1:
            # The deal's state is absent (a flush): load it, the room comes with it.
            try:
                await self.guard.load(deal_id)
            except Problem as problem:
                log.info("deal %s of a room not loaded: %s", deal_id, problem.detail)
            return 0, 0
        if int(code) == 2:
            await self.redis.srem(ROOMS, deal_id)
            return 0, 0
        if int(code) == 3:
            # The sale is over: nothing more to admit. Its keys are deleted by the
            # retire loop once the admission TTL has passed too (gate/room/retire.py).
            await retire.schedule(self.redis, deal_id)
            await self.redis.srem(ROOMS, deal_id)
            log.info("deal %s: sale over, waiting room to be retired", deal_id)
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
            "SELECT id, waiting_room, room_seed, version FROM deals"
            " WHERE waiting_room IS NOT NULL AND (ends_at IS NULL OR ends_at > NOW(6))"
            " ORDER BY id DESC LIMIT %s",
            (ROOMS_MAX,),
        )
        for deal_id, raw, seed, version in rows:
            await self._publish_row(int(deal_id), raw, seed, int(version))
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
