"""Give-backs: units this process knows it will never commit, returned to Redis as
soon as Redis answers again, rather than after the janitor's `inflight_max_seconds`.

    the admission call fails (a timeout, a lost connection, a failover mid-call)
        └─ perhaps it ran: the token may hold units in Redis, and this process never
           sends that token to the database ──> add(token)
    the compensation after a database refusal fails ──> add(token)

    run(): every GIVEBACK_INTERVAL_SECONDS ──> run_once(): lua/compensate.lua for up to
        GIVEBACK_BATCH tokens. The script acts only while the token's in-flight marker
        is there, so racing the janitor (or finding nothing: the admission never ran)
        is harmless.
        ├─ Redis answered ──> done (given back, or nothing was there)
        └─ Redis still failing ──> kept for the next pass; once older than
           `inflight_max_seconds` dropped: the janitor's age rule has it by then

Never for an admission that also queued the request (queue mode): a consumer may
commit its stream entry, so its units are not this process's to give back.

The same loop finishes the reservations whose transaction's outcome is unknown (the
connection broke mid-call) and whose look-up failed too (the database unreachable):

    add_unresolved(token, server thread) ──> run_once(), once the database answers:
        the thread ended (killed if need be: gate/store/db.py wait_thread_gone)
        ──> the order looked up ──> none: never will be ──> give back (above)
                                └─ committed: left to the janitor, which confirms
                                   committed markers within seconds
    still unreachable ──> kept for the next pass, dropped after
        `inflight_max_seconds` (the janitor's age rule)

Without this a SIGKILLed or failed-over Redis primary left the units of every
admission answered 503 mid-failover unbuyable for 30 s: the deal read sold out while
units were in nobody's hands.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TypeVar

from gate.base.metrics import METRICS
from gate.inventory import orders
from gate.inventory.mirror import Mirror
from gate.store.keys import DealKeys

log = logging.getLogger("gate.giveback")

GIVEBACKS_MAX = 10_000  # pending per process; beyond, the janitor's age rule alone
GIVEBACK_BATCH = 256  # compensations sent per pass
GIVEBACK_INTERVAL_SECONDS = 0.2
UNRESOLVED_BATCH = 16  # unknown outcomes looked up per pass (database work each)
THREAD_GONE_WAIT_SECONDS = 1.0  # per unknown outcome and pass

GIVEBACKS = METRICS.counter(
    "gate_givebacks_total",
    "Admissions this process will never commit whose give-back failed at first, by"
    " outcome (given_back: units returned; nothing: no marker was there; expired: left"
    " to the janitor; dropped: too many pending; committed: an unknown outcome that"
    " had committed after all).",
    ["outcome"],
)


@dataclass(frozen=True)
class GiveBack:
    keys: DealKeys
    user_id: int
    idempotency_key: str
    token: str
    added: float  # time.monotonic()


@dataclass(frozen=True)
class Unresolved:
    """A reservation whose transaction broke mid-call and could not be looked up."""

    give: GiveBack
    thread_id: int
    connected_at: float  # event-loop time its connection was opened
    node: str | None = None  # the server that issued thread_id (Database.node_of)

    @property
    def added(self) -> float:
        return self.give.added


E = TypeVar("E", GiveBack, Unresolved)


class GiveBacks:
    def __init__(self, mirror: Mirror, expire_seconds: float) -> None:
        self.mirror = mirror
        self.expire_seconds = expire_seconds
        self._pending: dict[str, GiveBack] = {}
        self._unresolved: dict[str, Unresolved] = {}

    def __len__(self) -> int:
        return len(self._pending) + len(self._unresolved)

    def add_unresolved(
        self,
        keys: DealKeys,
        user_id: int,
        idempotency_key: str,
        token: str,
        thread_id: int,
        connected_at: float,
        node: str | None = None,
    ) -> None:
        if token in self._unresolved:
            return
        if len(self._unresolved) >= GIVEBACKS_MAX:
            GIVEBACKS.labels("dropped").inc()
            return
        give = GiveBack(keys, user_id, idempotency_key, token, time.monotonic())
        self._unresolved[token] = Unresolved(give, thread_id, connected_at, node)

    def add(self, keys: DealKeys, user_id: int, idempotency_key: str, token: str) -> None:
        if token in self._pending:
            return
        if len(self._pending) >= GIVEBACKS_MAX:
            GIVEBACKS.labels("dropped").inc()
            return
        self._pending[token] = GiveBack(keys, user_id, idempotency_key, token, time.monotonic())

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self._pending or self._unresolved:
                try:
                    await self.run_once()
                except Exception as exc:  # never let the loop die
                    log.warning("give-back pass failed: %r", exc)
            try:
                await asyncio.wait_for(stop.wait(), GIVEBACK_INTERVAL_SECONDS)
            except TimeoutError:
                pass

    async def run_once(self) -> int:
        """One pass: unknown outcomes looked up, then at most GIVEBACK_BATCH tokens
        given back; the number given back."""
        if self._unresolved:
            await self._resolve_some()
        batch = self._due(self._pending, GIVEBACK_BATCH)
        if not batch:
            return 0
        results = await asyncio.gather(
            *(self.mirror.compensate(e.keys, e.user_id, e.idempotency_key, e.token) for e in batch),
            return_exceptions=True,
        )
        given = 0
        for entry, result in zip(batch, results, strict=True):
            if isinstance(result, BaseException):
                continue  # Redis still failing: the next pass
            del self._pending[entry.token]
            if result:
                given += 1
                METRICS.compensations.inc()
                GIVEBACKS.labels("given_back").inc()
            else:
                GIVEBACKS.labels("nothing").inc()
        if given:
            log.info("gave back the units of %d admission(s) that will never commit", given)
        return given

    def _due(self, entries: dict[str, E], limit: int) -> list[E]:
        """Up to `limit` entries, in the order added; those older than
        `expire_seconds` dropped (the janitor's age rule has them)."""
        now = time.monotonic()
        batch: list[E] = []
        for token, entry in list(entries.items()):
            if now - entry.added > self.expire_seconds:
                del entries[token]
                GIVEBACKS.labels("expired").inc()
                continue
            batch.append(entry)
            if len(batch) >= limit:
                break
        return batch

    async def _resolve_some(self) -> None:
        batch = self._due(self._unresolved, UNRESOLVED_BATCH)
        db = self.mirror.db
        loop = asyncio.get_running_loop()
        for entry in batch:
            try:
                age = loop.time() - entry.connected_at
                if not await db.wait_thread_gone(
                    entry.thread_id, age, THREAD_GONE_WAIT_SECONDS, entry.node
                ):
                    continue
                order = await orders.get(db, entry.give.token)
            except Exception as exc:
                # The database still does not answer: the next pass.
                log.debug("unknown outcome of %s not resolved yet: %r", entry.give.token, exc)
                return
            del self._unresolved[entry.give.token]
            if order is None:
                # Rolled back, and its thread is gone: it never commits.
                g = entry.give
                self.add(g.keys, g.user_id, g.idempotency_key, g.token)
            else:
                GIVEBACKS.labels("committed").inc()
