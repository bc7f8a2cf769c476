"""What every part of the reservation path shares: its state, the Redis breakers and
their probes, the admission call, the database transaction and the answers read
back from the database. The parts stand on it:

    Reservations (gate/reserve/reservations.py): the request path
      ├─ QueueDispatch (gate/reserve/queued.py): a queue-mode deal's admission queued
      └─ NoRedisPolicy (gate/reserve/no_redis.py): Redis failing
           └─ Recovery (gate/reserve/recovery.py): outcomes not known
                └─ ReservationCore (here)
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable
from typing import Any

from gate.base.clock import iso
from gate.base.codes import LimitCode
from gate.base.errors import Problem, overloaded
from gate.base.limits import rate_limited
from gate.base.metrics import METRICS
from gate.base.settings import Settings
from gate.reserve.breaker import CLOSED, HALF_OPEN, Breaker
from gate.reserve.buyer_keys import BuyerKeys
from gate.reserve.giveback import GiveBacks
from gate.reserve.groups import Item, ReservationGroups, reservation_call
from gate.reserve.ports import AdmissionPort, QueuePort
from gate.reserve.refusals import (
    _LIMITED_TALLIES,
    DEVICE_INDEX,
    LIMITED_ANSWERS_MAX,
    RATE_LIMITED,
    SCOPED_LIMITS,
    Refusals,
    _limiter_args,
)
from gate.reserve.request import (
    OPERATOR_ADMISSION,
    Admission,
    Reserved,
    ReserveRequest,
    _no_admission,
    admission_of,
)
from gate.reserve.soldout import SoldOutCache
from gate.stock import orders
from gate.stock.mirror import Mirror, QueueArgs
from gate.stock.unknown_deals import UnknownDeals
from gate.store.db import Database
from gate.store.keys import GLOBAL_LIMIT, DealKeys, deal_keys
from gate.store.process_lease import Lease

log = logging.getLogger("gate.reservations")


# Open breakers whose time is up are probed this often without waiting for a call
# (`probe_breakers`), at most this many per round.
BREAKER_PROBE_SECONDS = 1.0


BREAKERS_PROBED_MAX = 1000


class ReservationCore:
    def __init__(
        self,
        settings: Settings,
        db: Database,
        mirror: Mirror,
        soldout: SoldOutCache,
        unknown_deals: UnknownDeals | None = None,
        lease: Lease | None = None,
        *,
        admission: AdmissionPort | None = None,
        queue: QueuePort | None = None,
    ) -> None:
        self.settings = settings
        self.db = db
        self.mirror = mirror
        self.soldout = soldout
        self.unknown_deals = unknown_deals or UnknownDeals(mirror.redis, db)
        self.buyer_keys = BuyerKeys(db)
        # The process's liveness lease: each admission token names it, and each
        # reservation transaction runs only on a connection recorded under it.
        self.lease = lease
        self.timeout_seconds = settings.reservation_db_timeout_seconds
        self.breaker = Breaker(
            "redis", settings.redis_breaker_failures_max, settings.redis_breaker_open_seconds
        )
        # On Redis Cluster one breaker per node (gate/store/scripts.py node_of): a failing
        # primary pauses only the deals whose slots it serves. Standalone: just one.
        self._breakers: dict[str, Breaker] = {}
        self.mirror.runner.slot_map_listeners.append(self._retire_breakers)
        self._scoped = (
            settings.limit_deal,
            settings.limit_user,
            settings.limit_ip,
            settings.limit_device,
        )
        self._scoped_args = _limiter_args(self._scoped)
        self._scoped_args_no_device = _limiter_args(
            tuple(None if i == DEVICE_INDEX else spec for i, spec in enumerate(self._scoped))
        )
        self._any_limit = any(self._scoped) or settings.limit_global is not None
        self.refusals = Refusals(self._scoped, settings.limit_global is not None)
        self._specs = dict(zip(SCOPED_LIMITS, self._scoped, strict=True))
        self._specs["global"] = settings.limit_global
        self._limited_answers: dict[tuple[str, int], Problem] = {}
        self._inflight = 0
        # The waiting room's token check (lua/admit.lua is told what the buyer's
        # Admission-Token header is worth); without the room no token is ever valid.
        self.admission = admission
        # Queue mode: an admitted reservation of a deal in queue mode is handed to the
        # deal's queue instead of the database.
        self.queue = queue
        self._direct_slots = asyncio.Semaphore(settings.redis_down_db_concurrency_max)
        # Admissions this process will never commit whose units could not be given
        # back at once (Redis failing mid-call): returned once Redis answers.
        self.givebacks = GiveBacks(mirror, settings.inflight_max_seconds)
        self.groups = (
            ReservationGroups(
                db,
                self._single,
                settings.reservation_group_max,
                settings.reservation_groups_in_flight_max,
                settings.db_reservation_acquire_seconds,
                lease,
            )
            if settings.reservation_group_max > 1
            else None
        )

    def breaker_for(self, deal_id: int) -> Breaker:
        """The breaker of the Redis node that serves the deal's slot."""
        name = self.mirror.runner.node_of(deal_keys(deal_id).meta)
        if name == "redis":
            return self.breaker
        breaker = self._breakers.get(name)
        if breaker is None:
            breaker = self._breakers[name] = Breaker(
                name,
                self.settings.redis_breaker_failures_max,
                self.settings.redis_breaker_open_seconds,
            )
        return breaker

    async def probe_breakers(self, stop: asyncio.Event) -> None:
        """Every BREAKER_PROBE_SECONDS, `probe_breakers_once` (every serving process:
        each has breakers of its own)."""
        while not stop.is_set():
            try:
                await self.probe_breakers_once()
            except Exception as exc:
                log.warning("breaker probe failed: %r", exc)
            try:
                await asyncio.wait_for(stop.wait(), BREAKER_PROBE_SECONDS)
            except TimeoutError:
                pass

    async def probe_breakers_once(self) -> int:
        """An open breaker is probed by the first call past its open time. A node no
        call reaches any more (its deals' sales are over) would keep it open for
        good, and /readyz "degraded", gate_circuit_open and its alert with it: after
        a Redis Cluster failover every node answers CLUSTERDOWN for a while, so
        breakers of nodes that never failed open too. So breakers whose open time is
        up are probed here as well, one Redis call each in a call's place
        (`ScriptRunner.probe`). How many it probed."""
        probed = 0
        for breaker in [self.breaker, *self._breakers.values()][:BREAKERS_PROBED_MAX]:
            if breaker.state == CLOSED:
                continue
            with breaker.call() as allowed:
                if not allowed or breaker.state != HALF_OPEN:
                    continue
                probed += 1
                if await self.mirror.runner.probe(breaker.name):
                    breaker.success()
                else:
                    breaker.failure()
        return probed

    def _retire_breakers(self, serving: frozenset[str]) -> None:
        """The slot map was read: the breakers of nodes that serve no slot any more
        (a primary that failed over) go, or /readyz and gate_circuit_open would report
        an open circuit for good. A node that serves again gets a new one."""
        for name in [n for n in self._breakers if n not in serving]:
            self._breakers.pop(name).retire()

    @property
    def circuit_state(self) -> str:
        """The worst state of the breakers ("closed" when all are)."""
        states = {self.breaker.state, *(b.state for b in self._breakers.values())}
        for state in ("open", "half_open"):
            if state in states:
                return state
        return "closed"

    async def aclose(self) -> None:
        await self.buyer_keys.aclose()
        if self.groups is not None:
            await self.groups.aclose()

    def _admission_arg(self, req: ReserveRequest) -> str:
        """What lua/admit.lua is told of the request's Admission-Token header."""
        if self.admission is None:
            return _no_admission(req.admission_token)
        return self.admission.arg(req.deal_id, req.user_id, req.admission_token)

    def _admit_call(
        self,
        keys: DealKeys,
        req: ReserveRequest,
        fp: str,
        token: str,
        start: int,
        owner: str,
        queued: QueueArgs | None,
    ) -> asyncio.Future[Any]:
        return self.mirror.admit(
            keys,
            req.user_id,
            req.quantity,
            fp,
            token,
            start,
            req.idempotency_key,
            keys.limiters(req.user_id, req.ip, req.device),
            self._scoped_args if req.device is not None else self._scoped_args_no_device,
            owner,
            OPERATOR_ADMISSION if req.operator_retry else self._admission_arg(req),
            queued,
        )

    def _admit_failed(self, keys: DealKeys, exc: BaseException) -> Problem:
        """The admission's call failed (it may have run): the breaker counts it, 503."""
        breaker = self.breaker_for(keys.deal_id)
        breaker.failure()
        log.warning("admission failed for deal %s: %r", keys.deal_id, exc)
        return overloaded(
            "Admission service unavailable; retry shortly.", breaker.retry_after_seconds()
        )

    async def _admit(
        self,
        keys: DealKeys,
        req: ReserveRequest,
        fp: str,
        token: str,
        start: int,
        owner: str,
        queued: QueueArgs | None = None,
        global_limit: bool = True,
    ) -> Admission:
        """Run the admission (and the global limiter in the same pipeline)."""
        admit = self._admit_call(keys, req, fp, token, start, owner, queued)
        spec = self.settings.limit_global
        limit = (
            self.mirror.runner.call("limit", (GLOBAL_LIMIT,), (spec.emission_ms, spec.burst))
            if spec and global_limit
            else None
        )
        try:
            reply = await admit
        except Exception as exc:
            # Never re-run a script that may have run: if the admission did happen,
            # its token is in Redis and the janitor gives the units back.
            if limit is not None:
                await asyncio.gather(limit, return_exceptions=True)
            if queued is None:
                # Perhaps it ran: its units go back once Redis answers, since this
                # token is never sent to the database. A queued one may be committed
                # by a consumer: the janitor judges it.
                self.givebacks.add(keys, req.user_id, req.idempotency_key, token)
            raise self._admit_failed(keys, exc) from None
        self.breaker_for(keys.deal_id).success()
        refused: int | None = None
        if limit is not None:
            try:
                limit_code, limit_detail = await limit
                if LimitCode(int(limit_code)) == LimitCode.RATE_LIMITED:
                    refused = int(limit_detail)
            except Exception as exc:
                log.warning("global limiter failed: %r", exc)
                if not self.settings.limits_fail_open:
                    refused = 1000
        return admission_of(reply, refused)

    def _limited_made(self, scope: str, wait_ms: int) -> Problem:
        """The refusal counted, and its answer: one per scope and whole second of wait,
        made once and only ever encoded (`_limited` copies it to raise)."""
        counter = _LIMITED_TALLIES.get(scope)
        if counter is None:
            counter = _LIMITED_TALLIES[scope] = METRICS.counter_tally(RATE_LIMITED.labels(scope))
        counter.inc()
        key = (scope, math.ceil(wait_ms / 1000))
        made = self._limited_answers.get(key)
        if made is None:
            if len(self._limited_answers) >= LIMITED_ANSWERS_MAX:
                self._limited_answers.clear()
            spec = self._specs[scope]
            assert spec is not None, f"limiter {scope} refused while off"
            # Its body and headers follow from the detail (scope, limit, wait): cacheable.
            made = rate_limited(scope, spec, wait_ms)
            made.cacheable = True
            self._limited_answers[key] = made
        return made

    def _limited(self, scope: str, wait_ms: int) -> Problem:
        made = self._limited_made(scope, wait_ms)
        return Problem(
            made.code,
            made.detail,
            retry_after_seconds=made.retry_after_seconds,
            headers=made.headers,
            extra=made.extra,
            cacheable=True,
        )

    async def _load(self, deal_id: int) -> bool:
        """Load a deal Redis lacks; False when the database has no such deal."""
        try:
            return await self.mirror.load(deal_id)
        except Exception as exc:
            # The database or Redis failed while the deal was being loaded.
            log.warning("deal %s not loaded into Redis: %r", deal_id, exc)
            raise overloaded("Deal state unavailable; retry shortly.") from None

    def _single(self, deal_id: int, item: Item) -> Awaitable[tuple[Any, ...]]:
        """One grouped item on its own (a group of one, or a group that fell back)."""
        return self._transaction(deal_id, item, f"{item.bucket}:{item.quantity}")

    async def _transaction(self, deal_id: int, item: Item, alloc: str) -> tuple[Any, ...]:
        """CALL gate_reserve, retried after deadlocks, within the item's deadline."""
        return await reservation_call(
            self.db,
            "CALL gate_reserve(%s, %s, %s, %s, %s, %s, %s, %s)",
            (
                item.token,
                deal_id,
                item.user_id,
                item.quantity,
                alloc,
                item.idempotency_key,
                item.fingerprint,
                f"user:{item.user_id}",
            ),
            item.deadline,
            1,
            self.lease,
            {item.owner} if item.owner else None,
        )

    async def _compensate(self, keys: DealKeys, req: ReserveRequest, token: str) -> None:
        try:
            if await self.mirror.compensate(keys, req.user_id, req.idempotency_key, token):
                METRICS.compensations.inc()
        except Exception as exc:
            self.breaker_for(keys.deal_id).failure()
            self.givebacks.add(keys, req.user_id, req.idempotency_key, token)
            log.warning("compensation of %s deferred: %r", token, exc)

    @staticmethod
    def _body(token: str, req: ReserveRequest, row: tuple[Any, ...]) -> dict[str, Any]:
        unit_price = int(row[4])
        return {
            "order_id": token,
            "status": "PENDING_PAYMENT",
            "deal_id": req.deal_id,
            "quantity": req.quantity,
            "unit_price": unit_price,
            "amount": unit_price * req.quantity,
            "currency": str(row[5]),
            "expires_at": iso(row[2]),
        }

    def _item(
        self, token: str, req: ReserveRequest, fp: str, bucket: int, owner: str | None
    ) -> Item:
        """The request's database part, due within the reservation's deadline from now."""
        deadline = asyncio.get_running_loop().time() + self.timeout_seconds
        return Item(
            token, req.user_id, req.quantity, bucket, req.idempotency_key, fp, deadline, owner
        )

    async def _existing_or_none(self, req: ReserveRequest, fp: str) -> Reserved | None:
        """The database's answer for this buyer's key, if it holds one."""
        try:
            existing = await orders.by_idempotency_key(self.db, req.user_id, req.idempotency_key)
        except Exception:
            raise overloaded("Database unavailable; retry shortly.") from None
        if existing is None:
            return None
        # The fingerprint names the deal: the key used on another deal is a mismatch.
        if existing.fingerprint != fp:
            raise Problem(
                "IDEMPOTENCY_MISMATCH",
                "This Idempotency-Key was used with a different request.",
            )
        return Reserved(existing.reservation_body(), replayed=True)

    async def _existing(self, req: ReserveRequest, fp: str) -> Reserved:
        """The database already holds this buyer's key: a replay or a mismatch."""
        existing = await self._existing_or_none(req, fp)
        if existing is None:
            raise Problem(
                "IDEMPOTENCY_IN_PROGRESS",
                "A request with this Idempotency-Key is still in progress.",
            )
        return existing

    async def _replay(self, order_id: str, user_id: int, fp: str) -> Reserved:
        try:
            order = await orders.get(self.db, order_id)
        except Exception:
            raise overloaded("Database unavailable; retry shortly.") from None
        if order is None or order.user_id != user_id or order.fingerprint != fp:
            # Redis remembers a request the database does not hold (a restored
            # database, say). The database is the truth: refuse rather than guess.
            raise overloaded("Idempotency record inconsistent; retry shortly.")
        return Reserved(order.reservation_body(), replayed=True)
