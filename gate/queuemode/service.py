"""Queue mode's request side: which deals sell through the queue, enqueueing an
admitted request, and what a queued order reads (docs/queue-mode.md).

    POST reservation ──> admit.lua (unchanged: every refusal answered at once)
        └─ OK, deal in queue mode ──> enqueue.lua: XADD to {d:ID}:q, token leaves the
           janitor's in-flight times (it stays in the in-flight hash: its units count
           as in flight), status "Q" ──> 202 QUEUED, Location /v1/orders/{id}
           └─ queue full (GATE_QUEUE_DEPTH_MAX) ──> compensate ──> 503
    replay of the key while queued (admit: IN_PROGRESS, naming its token) ──> 202, the queued body
    GET /v1/orders/{id}: the status key first, where it answers exactly (not taken
        yet: QUEUED; rejected: REJECTED), so polls of a queue stay off the database;
        else the database; else the status key again (QUEUED while being committed)
    cancel of a queued order: queue_cancel.lua "Q" -> "X|CANCELLED", compensate

Which deals are in queue mode is read from the database by every process at most
`GATE_QUEUE_MODE_REFRESH_SECONDS` apart (`ModeCache.run`), so a switch is followed
everywhere within that time; the process that switched follows at once. After each
refresh the deals this process queued to are announced again (`reannounce`), so that
a Redis that lost `gate:q:deals` has them back for the consumers within a refresh.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from gate.base.errors import Problem, overloaded
from gate.base.metrics import METRICS
from gate.inventory import orders
from gate.queuemode import store
from gate.store.keys import QUEUE_DEALS, QueueKeys, deal_keys, queue_keys, queue_order_index
from gate.store.resp import text

if TYPE_CHECKING:
    from gate.base.settings import Settings
    from gate.runtime import Gate

log = logging.getLogger("gate.queue")

# Deals in queue mode one process remembers (more are read as sync: bounded).
QUEUE_DEALS_MAX = 10_000
MODES = ("sync", "queue")

QUEUED = METRICS.counter(
    "gate_queue_enqueued_total", "Reservations answered 202 QUEUED (queue mode).", ["deal"]
)
QUEUE_FULL = METRICS.counter(
    "gate_queue_full_total",
    "Admitted reservations refused 503 because the deal's queue was at GATE_QUEUE_DEPTH_MAX.",
    ["deal"],
)


@dataclass(frozen=True)
class QueueSettings:
    attempts_max: int
    depth_max: int
    batch_max: int
    claim_idle_seconds: float
    retry_base_seconds: float
    mode_refresh_seconds: float
    status_ttl_seconds: int
    consumers_in_serve: bool
    drains: int
    linger_seconds: float

    @classmethod
    def from_env(cls, settings: Settings) -> QueueSettings:
        from gate.base.settings import SettingsError, env_bool, env_float, env_int
        from gate.reserve.groups import GROUP_MAX_LIMIT

        env = settings.environ
        # Default: past any commit's deadline (the reservation database timeout).
        default_claim = max(5.0, settings.reservation_db_timeout_seconds + 1.0)
        claim = env_float(env, "GATE_QUEUE_CLAIM_IDLE_SECONDS", default_claim, 0.5, 600.0)
        if claim <= settings.reservation_db_timeout_seconds:
            # A live consumer's commit must be over before another may take its entry.
            raise SettingsError(
                "GATE_QUEUE_CLAIM_IDLE_SECONDS must exceed GATE_RESERVATION_DB_TIMEOUT_SECONDS"
                f" ({settings.reservation_db_timeout_seconds:g})"
            )
        return cls(
            attempts_max=env_int(env, "GATE_QUEUE_ATTEMPTS_MAX", 5, 1, 100),
            depth_max=env_int(env, "GATE_QUEUE_DEPTH_MAX", 100_000, 1, 10_000_000),
            batch_max=env_int(env, "GATE_QUEUE_BATCH_MAX", 256, 1, GROUP_MAX_LIMIT),
            claim_idle_seconds=claim,
            retry_base_seconds=env_float(env, "GATE_QUEUE_RETRY_BASE_SECONDS", 0.2, 0.01, 60.0),
            mode_refresh_seconds=env_float(env, "GATE_QUEUE_MODE_REFRESH_SECONDS", 1.0, 0.05, 2.0),
            status_ttl_seconds=env_int(
                env, "GATE_QUEUE_STATUS_TTL_SECONDS", 86_400, 60, 30 * 86_400
            ),
            consumers_in_serve=env_bool(env, "GATE_QUEUE_CONSUMERS", True),
            drains=env_int(env, "GATE_QUEUE_DRAINS", 2, 1, 8),
            linger_seconds=env_float(env, "GATE_QUEUE_LINGER_SECONDS", 0.1, 0.0, 2.0),
        )


class ModeCache:
    """The ids of the deals in queue mode, as this process last read them. A deal
    newer than that read (created since, perhaps in queue mode) is asked once."""

    def __init__(self, gate: Gate, refresh_seconds: float) -> None:
        self.gate = gate
        self.refresh_seconds = refresh_seconds
        self.queued: frozenset[int] = frozenset()
        self.max_id = 0  # the highest deal id the last read saw
        self._reads: dict[int, asyncio.Future[None]] = {}
        # Run by `run()` after each refresh (QueueService.reannounce).
        self.after_refresh: Callable[[], Awaitable[None]] | None = None

    def known(self, deal_id: int) -> bool | None:
        """Whether the deal is in queue mode, without a wait; None for a deal newer
        than the last read (`is_queue` asks the database)."""
        if deal_id > self.max_id:
            return None
        return deal_id in self.queued

    async def is_queue(self, deal_id: int) -> bool:
        if deal_id > self.max_id:
            # One read per new deal however many requests wait for it.
            reading = self._reads.get(deal_id)
            if reading is None:
                reading = self._reads[deal_id] = asyncio.ensure_future(self._read(deal_id))
                reading.add_done_callback(lambda _: self._reads.pop(deal_id, None))
            await asyncio.shield(reading)
        return deal_id in self.queued

    async def _read(self, deal_id: int) -> None:
        row = await store.deal_mode(self.gate.db, deal_id)
        if row is not None:
            self.max_id = max(self.max_id, deal_id)
            self.set(deal_id, str(row[0]))

    async def run_once(self) -> None:
        # One statement, so one read view: the highest id and the deals in queue mode
        # agree. (Read apart, a deal created in queue mode between the two reads was
        # below the highest id but not in queue mode: sold synchronously until the
        # next refresh.)
        rows = await store.mode_snapshot(self.gate.db, QUEUE_DEALS_MAX)
        self.queued = frozenset(int(v) for kind, v in rows if int(kind) == 1)
        self.max_id = max((int(v) for kind, v in rows if int(kind) == 0), default=0)

    def set(self, deal_id: int, mode: str) -> None:
        self.queued = self.queued | {deal_id} if mode == "queue" else self.queued - {deal_id}

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.run_once()
            except Exception as exc:
                # Keep the last known modes: a database blip must not flip deals.
                log.warning("deal modes not refreshed: %r", exc)
            if self.after_refresh is not None:
                try:
                    await self.after_refresh()
                except Exception as exc:
                    log.warning("after the deal modes' refresh: %r", exc)
            try:
                await asyncio.wait_for(stop.wait(), self.refresh_seconds)
            except TimeoutError:
                pass


def _consume(fut: asyncio.Future[Any]) -> None:
    """A call nobody waits for: its failure is only logged."""
    if not fut.cancelled() and fut.exception() is not None:
        log.info("queue index not dropped: %r", fut.exception())


def queued_body(
    order_id: str, deal_id: int, quantity: int, unit_price: int, currency: str
) -> dict[str, Any]:
    return {
        "order_id": order_id,
        "status": "QUEUED",
        "deal_id": deal_id,
        "quantity": quantity,
        "unit_price": unit_price,
        "amount": unit_price * quantity,
        "currency": currency,
    }


def rejected_body(order_id: str, deal_id: int, reason: str) -> dict[str, Any]:
    return {"order_id": order_id, "status": "REJECTED", "deal_id": deal_id, "reason": reason}


class QueueService:
    def __init__(self, gate: Gate, settings: QueueSettings) -> None:
        self.gate = gate
        self.settings = settings
        self.modes = ModeCache(gate, settings.mode_refresh_seconds)
        self.status_ttl_ms = settings.status_ttl_seconds * 1000
        self._prices: dict[int, tuple[int, str]] = {}
        self._announced: set[int] = set()
        self._price_reads: dict[int, asyncio.Future[tuple[int, str]]] = {}
        self._admit_args = (settings.depth_max, self.status_ttl_ms)
        # Per deal: its queue keys and its metric child (bounded like _prices).
        self._queue_keys: dict[int, QueueKeys] = {}
        self._queued_counters: dict[int, Any] = {}
        # Set by every enqueue: this process's idle consumer starts a pass at once.
        self.wake = asyncio.Event()
        self.modes.after_refresh = self.reannounce

    async def _price(self, deal_id: int) -> tuple[int, str]:
        known = self._prices.get(deal_id)
        if known is not None:
            return known
        # One read per deal however many requests wait for it.
        reading = self._price_reads.get(deal_id)
        if reading is None:
            reading = self._price_reads[deal_id] = asyncio.ensure_future(self._read_price(deal_id))
            reading.add_done_callback(lambda _: self._price_reads.pop(deal_id, None))
        return await asyncio.shield(reading)

    async def _read_price(self, deal_id: int) -> tuple[int, str]:
        known = self._prices.get(deal_id)
        if known is None:
            row = await store.deal_price(self.gate.db, deal_id)
            assert row is not None, "an admitted deal exists"
            known = (int(row[0]), str(row[1]))
            if len(self._prices) >= QUEUE_DEALS_MAX:
                self._prices.clear()
            self._prices[deal_id] = known
        return known

    # -- the admission's own queueing (lua/admit.lua's queue branch) -----------------

    @property
    def index_in_admission(self) -> bool:
        """On one Redis the admission writes the order's index itself (one call); on
        Redis Cluster the index lives in another slot."""
        return not self.gate.runner.cluster

    def admission(
        self, deal_id: int, token: str, user_id: int
    ) -> tuple[tuple[tuple[str, ...], tuple[Any, ...]], asyncio.Future[Any] | None]:
        """What lua/admit.lua needs to queue the request, for an admission of a deal in
        queue mode, and the call that writes the order's index (None: the admission
        writes it). On one Redis the admission writes the index itself; on Redis
        Cluster the index lives in another slot, so it is a call of its own, sent
        first in the same loop turn (a crash between leaves an index to nothing,
        never a queued order without one)."""
        qk = self._queue_keys.get(deal_id)
        if qk is None:
            if len(self._queue_keys) >= QUEUE_DEALS_MAX:
                self._queue_keys.clear()
            qk = self._queue_keys[deal_id] = queue_keys(deal_id)
        owner = f"{deal_id}|{user_id}"
        if self.index_in_admission:
            keys = (qk.stream, qk.status(token), queue_order_index(token))
            return (keys, (*self._admit_args, owner)), None
        index = self.gate.runner.call(
            "queue_index", (queue_order_index(token),), (owner, self.status_ttl_ms)
        )
        return ((qk.stream, qk.status(token)), self._admit_args), index

    def drop_index(self, token: str, index: asyncio.Future[Any] | None) -> None:
        """The admission queued nothing: an index written by a call of its own goes
        (sent with the next pipeline, not waited for; it would expire anyway)."""
        if index is None:
            return  # the admission writes it only when it queues
        index.add_done_callback(_consume)
        drop = self.gate.runner.call("queue_index", (queue_order_index(token),), ("", 0))
        drop.add_done_callback(_consume)

    def full(self, deal_id: int) -> None:
        QUEUE_FULL.labels(str(deal_id)).inc()

    async def unqueue(self, deal_id: int, token: str, reason: str) -> bool:
        """Reject a request the admission queued (the caller then gives its units
        back); False when a consumer is committing it already."""
        code, _detail = await self.gate.runner.call(
            "queue_cancel", (queue_keys(deal_id).status(token),), (self.status_ttl_ms, reason)
        )
        return int(code) != 1

    def queued(self, deal_id: int, token: str, quantity: int) -> dict[str, Any] | None:
        """The 202 body of a request the admission queued; None on the deal's first
        (its price not read yet, its queue not announced): `queued_first`."""
        price = self._prices.get(deal_id)
        counter = self._queued_counters.get(deal_id)
        if price is None or counter is None:
            return None
        counter.inc()
        self.wake.set()
        return queued_body(token, deal_id, quantity, *price)

    async def queued_first(self, deal_id: int, token: str, quantity: int) -> dict[str, Any]:
        price = await self._price(deal_id)
        try:
            await self._announce(deal_id)
        except Exception as exc:
            # Queued all the same: the next request of the deal announces it.
            log.warning("deal %s queue not announced: %r", deal_id, exc)
        if len(self._queued_counters) >= QUEUE_DEALS_MAX:
            self._queued_counters.clear()
        counter = self._queued_counters[deal_id] = QUEUED.labels(str(deal_id))
        counter.inc()
        self.wake.set()
        return queued_body(token, deal_id, quantity, *price)

    async def reannounce(self) -> None:
        """Every GATE_QUEUE_MODE_REFRESH_SECONDS: the deals this process announced that
        are still in queue mode, announced again in one call. A Redis that lost the set
        (flushed, failed over to a copy without it) has the deals of the requests queued
        since back within a refresh, so the consumers find their queues without a
        restart; otherwise a no-op write."""
        live = self._announced & self.modes.queued
        if live:
            await self.gate.redis.sadd(QUEUE_DEALS, *(str(d) for d in sorted(live)))

    async def _announce(self, deal_id: int) -> None:
        if deal_id not in self._announced and len(self._announced) < QUEUE_DEALS_MAX:
            # Once per deal and process (the consumers walk this set, never shrunk),
            # by the first request only: the others do not wait for it.
            self._announced.add(deal_id)
            try:
                await self.gate.redis.sadd(QUEUE_DEALS, str(deal_id))
            except Exception:
                self._announced.discard(deal_id)
                raise

    # -- the second call (a deal newer than the last read of the modes) ---------------

    async def enqueue(
        self,
        deal_id: int,
        token: str,
        user_id: int,
        quantity: int,
        alloc: str,
        idempotency_key: str,
        fp: str,
    ) -> dict[str, Any] | None:
        """The 202 body; None when the token is gone or the queue is full (the
        caller compensates and answers 503)."""
        qk = queue_keys(deal_id)
        keys = deal_keys(deal_id)
        price = await self._price(deal_id)
        await self._announce(deal_id)
        # The index first, in the same pipeline (the runner sends one loop turn's calls
        # in order): a crash between leaves an index to nothing (404), never a queued
        # order without one.
        index = self.gate.runner.call(
            "queue_index",
            (queue_order_index(token),),
            (f"{deal_id}|{user_id}", self.status_ttl_ms),
        )
        if self.gate.runner.cluster:
            # On Redis Cluster the index's slot is on another node: the two calls would
            # travel on two connections, unordered. The index is written first.
            await index
        enqueue = self.gate.runner.call(
            "enqueue",
            (keys.inflight, keys.inflight_times, qk.stream, qk.status(token)),
            (
                token,
                self.settings.depth_max,
                self.status_ttl_ms,
                user_id,
                quantity,
                alloc,
                idempotency_key,
                fp,
            ),
        )
        _, (code, _entry) = await asyncio.gather(index, enqueue)
        if int(code) != 0:
            if int(code) == 2:
                QUEUE_FULL.labels(str(deal_id)).inc()
            return None
        QUEUED.labels(str(deal_id)).inc()
        self.wake.set()
        return queued_body(token, deal_id, quantity, *price)

    async def replay(self, deal_id: int, token: str) -> dict[str, Any] | None:
        """A replay of a key whose request is still in progress (the admission named
        its token): the 202 body if it waits in the queue, None otherwise (a
        synchronous request still running, or one that left the queue meanwhile)."""
        if not token:
            return None
        status, record = await self._peek(deal_id, token)
        if status is None or status[0] not in "QC" or record is None:
            return None
        return await self._queued_view(token, deal_id, record)

    async def _peek(self, deal_id: int, token: str) -> tuple[str | None, Any]:
        """(status, in-flight record) of a queued request, each None when absent: one
        script call through the runner (lua/queue_peek.lua)."""
        status, record = await self.gate.runner.call(
            "queue_peek", (queue_keys(deal_id).status(token), deal_keys(deal_id).inflight), (token,)
        )
        return (text(status) if status else None), (record or None)

    async def _queued_view(self, token: str, deal_id: int, record: Any) -> dict[str, Any]:
        quantity = int(text(record).split("|")[2])
        return queued_body(token, deal_id, quantity, *await self._price(deal_id))

    async def _locate(self, order_id: str, user_id: int) -> tuple[int, str, Any] | None:
        """(deal id, status, in-flight record or None) of the buyer's queued order, if
        this Redis knows it: two script calls through the runner (the index and the
        deal's keys are in different slots), each far cheaper than a redis-py command."""
        if not orders.valid_order_id(order_id):
            return None
        index = await self.gate.runner.call("queue_locate", (queue_order_index(order_id),), ())
        if not index:
            return None
        deal, owner = text(index).split("|")
        if int(owner) != user_id:
            return None  # another buyer's order is indistinguishable from none
        deal_id = int(deal)
        status, record = await self._peek(deal_id, order_id)
        if status is None:
            return None
        return deal_id, status, record

    async def view_before_database(self, order_id: str, user_id: int) -> dict[str, Any] | None:
        """GET /v1/orders/{id}, asked before the database: what Redis alone answers
        exactly. A request still waiting (status "Q": no consumer has taken it, so no
        database can hold it) reads QUEUED, a rejected one ("X|CODE", final) REJECTED,
        so a crowd polling its queued orders never reaches the database. Anything else
        (taken and being committed, committed, another buyer's, unknown, Redis
        unreachable) is None: the database's way, then `view`."""
        try:
            found = await self._locate(order_id, user_id)
            if found is None:
                return None
            deal_id, status, record = found
            if status.startswith("X|"):
                return rejected_body(order_id, deal_id, status[2:])
            if not status.startswith("Q|") or record is None:
                return None
            return await self._queued_view(order_id, deal_id, record)
        except Exception as exc:
            # Redis unreachable, or the deal's price not readable (the database): the
            # database's way, which answers 503 if it cannot answer either.
            log.debug("order %s: no early view (%r)", order_id, exc)
            return None

    async def view(self, order_id: str, user_id: int) -> dict[str, Any] | None:
        """GET /v1/orders/{id} for an order the database did not hold when asked."""
        try:
            return await self._view(order_id, user_id)
        except (RedisError, OSError, TimeoutError):
            raise overloaded("Order state unavailable; retry shortly.") from None

    async def _view(self, order_id: str, user_id: int) -> dict[str, Any] | None:
        found = await self._locate(order_id, user_id)
        if found is None:
            return await self._committed_meanwhile(order_id, user_id)
        deal_id, status, record = found
        if status.startswith("X|"):
            return rejected_body(order_id, deal_id, status[2:])
        if record is None:
            return await self._committed_meanwhile(order_id, user_id)
        return await self._queued_view(order_id, deal_id, record)

    async def _committed_meanwhile(self, order_id: str, user_id: int) -> dict[str, Any] | None:
        """A queued order committed between the caller's database read and the status
        read (the consumer deletes the status once committed): the database again."""
        if not await self.gate.runner.call("queue_locate", (queue_order_index(order_id),), ()):
            return None
        order = await orders.get_for_buyer(self.gate.db, order_id, user_id)
        return order.view()

    async def cancel(self, order_id: str, user_id: int) -> dict[str, Any] | None:
        """Cancel a queued order: None when this Redis holds no such queued order."""
        try:
            return await self._cancel(order_id, user_id)
        except (RedisError, OSError, TimeoutError):
            raise overloaded("Order state unavailable; retry shortly.") from None

    async def _cancel(self, order_id: str, user_id: int) -> dict[str, Any] | None:
        found = await self._locate(order_id, user_id)
        if found is None:
            return None
        deal_id, status, record = found
        keys = deal_keys(deal_id)
        if status.startswith("X|") or record is None:
            raise Problem(
                "CONFLICT",
                "Order is REJECTED; only a queued or PENDING_PAYMENT order can be cancelled.",
                extra={"status": "REJECTED"},
            )
        parts = text(record).split("|")
        code, _detail = await self.gate.runner.call(
            "queue_cancel", (queue_keys(deal_id).status(order_id),), (self.status_ttl_ms,)
        )
        if int(code) == 1:
            raise overloaded("The order is being committed; retry shortly.")
        if int(code) != 0:
            raise Problem(
                "CONFLICT",
                "Order is REJECTED; only a queued or PENDING_PAYMENT order can be cancelled.",
                extra={"status": "REJECTED"},
            )
        # Only the call that removes the token gives units back (a consumer that meets
        # the entry later calls it again: a no-op).
        await self.gate.mirror.compensate(keys, user_id, parts[5], order_id)
        self.gate.soldout.forget(deal_id)
        return rejected_body(order_id, deal_id, "CANCELLED")
