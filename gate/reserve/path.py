"""The reservation path: one Redis admission, one authoritative database transaction,
assembled by `ReservationPath` from one object per job.

    take(request's fields) ─ the endpoint's one call
      ├─ sold out for this buyer (SoldOutCache) ──────────> the kept 409, now
      ├─ a limiter refusal remembered (RateLimits) ───────> the kept 429, now
      ├─ a deal in queue mode, at the edge ──> QueuedCall: admission sent, settled by
      │                                        a callback on its reply (202)
      └─ reserve(request), a coroutine
           ├─ in-flight cap ──full──> 503
           ├─ the deal's Redis breaker open ──> NoRedisPolicy
           └─ Admitter: lua/admit.lua (the global limiter in the same pipeline; a
              deal Redis lacks loaded; a partitioned deal partition by partition)
                ├─ refused (sold out, not active, replay, limits…) ──> answered,
                │  no database work (Replays for a replay or a lost record)
                └─ admitted: units taken in Redis, admission token recorded
                     ├─ sync ──> Committer: gate_reserve(_group) ──> 201
                     │           (unknown outcome: Recovery)
                     └─ queue mode ──> QueueDispatch ──> 202

Compensation gives units back only if it is the call that removes the token, so the
request, a retry and the janitor can never give back the same units twice.

The parts, each in its own module, none reaching into another's names:

    ReservationPath (here): near-caches, cap, breaker, lease retry, the answer's way
      ├─ Breakers (breaker.py) ─ RateLimits (refusals.py) ─ SoldOutCache (soldout.py)
      ├─ Admitter (admission.py): admit, load, give back
      ├─ Committer (commit.py): the transaction, group commit (groups.py), confirm
      ├─ Recovery (recovery.py): a commit whose outcome is unknown
      ├─ Replays (replays.py): the database's answer for an idempotency key
      ├─ NoRedisPolicy (no_redis.py): Redis failing
      └─ QueueDispatch (queued.py): queue mode, through the QueuePort (ports.py)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any

from gate.base.alloc import normalise_alloc
from gate.base.codes import AdmitCode
from gate.base.errors import Encoded, Problem, from_admit, overloaded
from gate.base.limits import client_ip
from gate.base.settings import Settings
from gate.inventory.mirror import Mirror
from gate.inventory.unknown_deals import UnknownDeals
from gate.reserve.admission import Admitter
from gate.reserve.breaker import Breakers
from gate.reserve.buyer_keys import BuyerKeys
from gate.reserve.commit import Committer
from gate.reserve.giveback import GiveBacks
from gate.reserve.no_redis import NoRedisPolicy
from gate.reserve.ports import AdmissionPort, QueuePort
from gate.reserve.queued import QueueDispatch
from gate.reserve.recovery import Recovery
from gate.reserve.refusals import RateLimits
from gate.reserve.replays import Replays
from gate.reserve.request import (
    MAX_QUANTITY,
    QUEUED,
    SOLD_OUT,
    SYNC,
    Admission,
    Attempt,
    QueuedCall,
    Reserved,
    ReserveRequest,
    admission_of,
    consumed,
)
from gate.reserve.soldout import SoldOutCache
from gate.store.db import Database
from gate.store.process_lease import Lease, LeaseLapsed

log = logging.getLogger("gate.reservations")


# What `take` answers: the kept encoding of a near-cache's refusal (a 409 SOLD_OUT or a
# 429 RATE_LIMITED), a queue-mode admission to settle on its reply, or the coroutine
# that answers.
Taken = Encoded | QueuedCall | Coroutine[Any, Any, Reserved]


class ReservationPath:
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
        self.soldout = soldout
        # The process's liveness lease: each admission token names it, and each
        # reservation transaction runs only on a connection recorded under it.
        self.lease = lease
        # The waiting room's admissions (spent by admit.lua; restored for a retry).
        self.admission = admission
        self.breakers = Breakers(settings, mirror.runner)
        self.limits = RateLimits(settings)
        # Admissions this process will never commit whose units could not be given
        # back at once (Redis failing mid-call): returned once Redis answers.
        self.givebacks = GiveBacks(mirror, settings.inflight_max_seconds)
        self.buyer_keys = BuyerKeys(db)
        self.replays = Replays(db, self.buyer_keys)
        self.admitter = Admitter(
            mirror,
            self.breakers,
            self.limits,
            self.givebacks,
            unknown_deals or UnknownDeals(mirror.redis, db),
            lease,
            admission,
            queue,
            limits_fail_open=settings.limits_fail_open,
        )
        self.recovery = Recovery(db, self.admitter, self.givebacks)
        self.committer = Committer(
            settings,
            db,
            mirror,
            lease,
            self.breakers,
            self.admitter,
            self.recovery,
            self.replays,
            self.buyer_keys,
        )
        self.no_redis = NoRedisPolicy(
            settings,
            db,
            mirror,
            self.breakers,
            self.limits,
            self.committer,
            self.recovery,
            self.replays,
            self.buyer_keys,
        )
        # Queue mode: an admitted reservation of a deal in queue mode is handed to the
        # deal's queue instead of the database.
        self.queue = QueueDispatch(queue, self.admitter, self.replays) if queue else None
        # Reservations past the near-caches and not answered yet (the in-flight cap).
        self.in_flight = 0
        # The deals' partition counts this process knows (Mirror.parts).
        self._parts = mirror.parts
        # Bound once, not per request: what settles a QueuedCall; a queue-mode view
        # and replay asked on each reservation when the area is there.
        self._settle_bound = self._settle
        self._known = queue.modes.known if queue else None
        self._queue_replay = queue.replay if queue else None

    def take(
        self,
        deal_id: int,
        user_id: int,
        quantity: int,
        idempotency_key: str,
        device: str | None,
        admission_token: str | None,
        client: tuple[str, int] | None,
        forwarded_for: str | None,
        instance: str,
        *,
        on_reply: bool = False,
    ) -> Taken:
        """A valid reservation request, as the endpoint read it: the near-caches'
        kept answer now (most of a sale's requests end here: no request object, no
        exception, no coroutine), else `reserve`'s coroutine, or, `on_reply` (the
        edge), a deal's queue-mode admission sent now for the caller to settle in a
        callback on its reply (`QueuedCall.settle`), with no task. The fields come
        one by one rather than as a request object: most calls end before one is
        worth making (docs/hotpath.md, lever 7). `client`: the socket peer;
        `forwarded_for`: the X-Forwarded-For header, believed only from a peer in
        GATE_TRUSTED_PROXIES (`client_ip`)."""
        # Never to an admitted buyer (a waiting room's Admission-Token): the room let
        # them in because units came back, which this cache may not know yet.
        if admission_token is None and self.soldout.sold_out_for(deal_id, user_id, quantity):
            return SOLD_OUT.encoded(instance)
        settings = self.settings
        ip = client_ip(
            client[0] if client else None,
            forwarded_for,
            settings.trusted_proxies,
            settings.limit_ip_v6_prefix,
        )
        early = self.limits.answer(deal_id, user_id, ip, device, instance)
        if early is not None:
            return early
        req = ReserveRequest(
            deal_id, user_id, quantity, idempotency_key, ip, device, admission_token
        )
        if on_reply and self._known is not None:
            call = self.start_queued(req)
            if call is not None:
                return call
        return self.reserve(req)

    async def reserve(self, req: ReserveRequest) -> Reserved:
        """A valid request past the near-caches (`take`), or the operator's retry of a
        queue dead letter (`gate queue retry`), which they never answer."""
        assert 1 <= req.quantity <= MAX_QUANTITY, "quantity is validated before the gate"
        if self.in_flight >= self.settings.reservation_inflight_max:
            raise overloaded("Too many reservations in progress; retry shortly.")
        self.in_flight += 1
        try:
            with self.breakers.for_deal(req.deal_id).call() as allowed:
                if not allowed:
                    return await self.no_redis.reserve(req)
                try:
                    return await self._reserve(req)
                except LeaseLapsed:
                    return await self._after_lapse(req)
                except Problem as problem:
                    if problem.code == "OVERLOADED":
                        # A 503 after the admission spent the buyer's admission (the
                        # database failed, its units were given back): the retry may
                        # use it again (within the room's bound: lua/room_restore.lua).
                        await self._admission_back(req)
                    raise
        finally:
            self.in_flight -= 1

    async def _admission_back(self, req: ReserveRequest) -> None:
        if self.admission is not None and req.admission_token:
            await self.admission.restore(req.deal_id, req.user_id, req.admission_token)

    async def aclose(self) -> None:
        await self.buyer_keys.aclose()
        await self.committer.aclose()

    async def _after_lapse(self, req: ReserveRequest) -> Reserved:
        """Its token named a lease found lapsed (Redis flushed or failed over, the
        process stalled) and was given back before anything was sent: once more
        under a fresh lease."""
        assert self.lease is not None
        try:
            await self.lease.ensure()
        except Exception as exc:
            log.warning("process lease not replaced: %r", exc)
            raise overloaded("Database unavailable; retry shortly.") from None
        if self.admission is not None and req.admission_token:
            # The first try spent the buyer's waiting-room admission and bought
            # nothing: the same request may use it again.
            await self.admission.restore(req.deal_id, req.user_id, req.admission_token)
        try:
            return await self._reserve(req)
        except LeaseLapsed:
            raise overloaded("Database unavailable; retry shortly.") from None

    def start_queued(self, req: ReserveRequest) -> QueuedCall | None:
        """What `reserve` does for a deal in queue mode, on its common way only, with
        no coroutine. None (nothing sent) where `reserve` must answer: a deal not
        known to be in queue mode or of several partitions, the global limiter on
        (its refusal may have to unqueue), the in-flight cap reached, the breaker not
        closed."""
        assert self._known is not None
        if (
            self._known(req.deal_id) is not True
            or self._parts.get(req.deal_id) != 1
            or self.settings.limit_global
            or self.in_flight >= self.settings.reservation_inflight_max
            or self.breakers.for_deal(req.deal_id).state != "closed"
        ):
            return None
        att = self.admitter.attempt(req, True)
        admit = self.admitter.send(att)
        self.in_flight += 1
        return QueuedCall(att, admit, self._settle_bound)

    def _settle(self, call: QueuedCall) -> Reserved | Awaitable[Reserved]:
        """A queue-mode admission's reply is in: the 202 (queued, its index written,
        the deal's price known), else the coroutine that answers as `reserve` would
        from here (a refusal, a replay, a full queue, a deal Redis lost). A failed
        call raises its 503 as `Admitter.admit` does."""
        att = call.attempt
        fut = call.admit
        exc = asyncio.CancelledError() if fut.cancelled() else fut.exception()
        if exc is not None:
            self.in_flight -= 1
            if att.index is not None:
                att.index.add_done_callback(consumed)
            raise self.admitter.failed(att.req.deal_id, exc)
        self.breakers.for_deal(att.req.deal_id).success()
        reply = fut.result()
        assert self.queue is not None
        queued = self.queue.queued_now(att, reply)
        if queued is not None:
            self.in_flight -= 1
            return queued
        return self._settle_later(att, admission_of(reply))

    async def _settle_later(self, att: Attempt, adm: Admission) -> Reserved:
        if adm.code == AdmitCode.NOT_LOADED:
            # Nothing was admitted or queued: the whole way, which loads the deal.
            self.in_flight -= 1
            assert self.queue is not None
            self.queue.not_queued(att, adm.code)
            return await self.reserve(att.req)
        try:
            return await self._answer(att, adm)
        finally:
            self.in_flight -= 1

    async def _reserve(self, req: ReserveRequest) -> Reserved:
        parts = self._parts.get(req.deal_id)
        if parts is None:
            parts = await self.admitter.read_partitions(req.deal_id)
        if parts > 1:
            return await self._partitioned(req, parts)
        known = self._known(req.deal_id) if self._known is not None else False
        att = self.admitter.attempt(req, known)
        adm = await self.admitter.admit(att)
        if adm.code == AdmitCode.NOT_LOADED:
            return await self._not_loaded(att)
        return await self._answer(att, adm)

    async def _partitioned(self, req: ReserveRequest, parts: int) -> Reserved:
        att, adm = await self.admitter.admit_partitioned(req, parts)
        return await self._answer(att, adm)

    async def _not_loaded(self, att: Attempt) -> Reserved:
        """Redis lacks the deal (nothing was admitted or queued): an unknown deal id
        (a flood of random ones, say) answered 404 before any load, else the deal
        loaded and admitted again."""
        deal_id = att.req.deal_id
        await self.admitter.load_unless_unknown(deal_id)
        parts = self._parts.get(deal_id, 1)
        if parts > 1:
            # The load showed a partitioned deal.
            return await self._partitioned(att.req, parts)
        adm = await self.admitter.admit(att)
        if adm.code == AdmitCode.NOT_LOADED:
            raise overloaded("Deal state is being rebuilt; retry shortly.")
        return await self._answer(att, adm)

    def _answer(self, att: Attempt, adm: Admission) -> Awaitable[Reserved]:
        """What follows the admission: its refusal answered, or the reservation
        committed or queued: the awaitable of the part that answers, so that the
        commit is awaited straight from `_reserve`, with no coroutine between."""
        if adm.code != AdmitCode.OK:
            return self._refused(att, adm)
        if adm.global_retry_ms is not None:
            return self._over_global_limit(att, adm.global_retry_ms)
        mode = att.mode
        if mode is SYNC:
            return self.committer.commit(att, normalise_alloc(adm.detail))
        assert self.queue is not None
        if mode is QUEUED:
            return self.queue.accept(att, adm.known_buyer)
        return self._unsure(att, adm)

    async def _refused(self, att: Attempt, adm: Admission) -> Reserved:
        """The admission refused: answered without the database, but for a replay."""
        code = adm.code
        req = att.req
        if att.mode is QUEUED:
            assert self.queue is not None
            self.queue.not_queued(att, code)  # nothing was queued (a full queue: 503)
        if code == AdmitCode.REPLAY:
            return await self.replays.of_order(adm.detail, req.user_id, att.fp)
        if code == AdmitCode.IN_PROGRESS and self._queue_replay is not None:
            # A replay of a request that waits in its deal's queue: 202 again.
            queued = await self._queue_replay(req.deal_id, adm.detail)
            if queued is not None:
                return Reserved(queued, replayed=True, queued=True)
        # A refusal of a known buyer may hide a replay whose Redis record was lost:
        # the database is asked. Not for a rate limit: a 429 is a "later", never a
        # final answer, and asking the database there would put a query behind every
        # click of a buyer hammering over their limit.
        if adm.known_buyer and code != AdmitCode.RATE_LIMITED:
            existing = await self.replays.hidden(req, att.fp)
            if existing is not None:
                return existing
        if code == AdmitCode.SOLD_OUT and adm.detail == "0":
            self.soldout.observe(req.deal_id, adm.buyers, att.parts)
        if code == AdmitCode.RATE_LIMITED:
            scope, wait_ms = adm.detail.split("|")
            raise self.limits.refused(req, scope, int(wait_ms), att.sent)
        raise from_admit(code, adm.detail)

    async def _over_global_limit(self, att: Attempt, retry_ms: int) -> Reserved:
        """The global limiter ran in the same pipeline and refused what the admission
        let by: given back before anything reaches the database."""
        if att.mode is QUEUED:
            assert self.queue is not None
            # Queued already: rejected first, so that no consumer commits it (one
            # already committing it wins: then the request is queued).
            if not await self.queue.unqueue(att, "RATE_LIMITED"):
                return await self.queue.queued(att)
        await self.admitter.give_back(att)
        await self._admission_back(att.req)
        raise self.limits.refused(att.req, "global", retry_ms, att.sent)

    async def _unsure(self, att: Attempt, adm: Admission) -> Reserved:
        """A deal newer than this process's view of the modes, admitted as sync:
        queued by a second call if it is in queue mode after all, else committed."""
        assert self.queue is not None
        alloc = normalise_alloc(adm.detail)
        if await self.queue.is_queue(att.req.deal_id):
            return await self.queue.enqueue(att, alloc, adm.known_buyer)
        return await self.committer.commit(att, alloc)
