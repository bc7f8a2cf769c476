"""The reservation path: one Redis admission, one authoritative database transaction.

    in-flight cap ──full──> 503
    admit (Lua; the global limiter in the same pipeline)
        ├─ rejected (sold out, not active, replay, limits…) ──> answer, no database work
        └─ OK: units taken in Redis, admission token recorded
    CALL gate_reserve (one round trip, one short transaction, on the reservations'
    share of the pool), or, when several reservations of the deal are admitted while
    the database is busy with the previous ones, CALL gate_reserve_group for all of
    them in one transaction (gate/reserve/groups.py)
        ├─ committed ──────────> confirm token ──> 201
        ├─ refused (sold out in the database, quota, duplicate key…) ──> compensate
        ├─ failed (database busy or down, statement error) ──> compensate ──> 503
        └─ unknown (connection lost mid-commit) ──> make sure the server thread has
           ended, look the order up by id ──> confirm or compensate

Compensation gives units back only if it is the call that removes the token, so the
request, a retry and the janitor can never give back the same units twice.

When Redis is failing, a circuit breaker stops calling it; reservations then answer
503 (policy "reject", the default: the database is never stampeded) or go straight
to the database behind a small per-process cap (policy "database").
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable
from typing import Any

import pymysql

from gate.base.alloc import normalise_alloc
from gate.base.codes import AdmitCode, DbCode
from gate.base.errors import Encoded, from_admit, from_db, not_found, overloaded
from gate.reserve.no_redis import NoRedisPolicy
from gate.reserve.queued import QueueDispatch
from gate.reserve.request import (
    MAX_QUANTITY,
    SOLD_OUT,
    Admission,
    QueuedCall,
    Reserved,
    ReserveRequest,
    _consumed,
    admission_of,
    fingerprint,
)
from gate.stock import orders
from gate.stock.mirror import QueueArgs
from gate.store.db import DbUnavailable, OutcomeUnknown
from gate.store.keys import DealKeys, deal_keys, home_partition, partition_keys
from gate.store.process_lease import LeaseLapsed

log = logging.getLogger("gate.reservations")


class Reservations(QueueDispatch, NoRedisPolicy):
    def sold_out_answer(
        self, deal_id: int, user_id: int, quantity: int, instance: str
    ) -> Encoded | None:
        """The near-cache's answer, ready for the wire, asked by the endpoint as soon as
        the request is valid, before anything else is built for it (most of a sale's
        requests end here; no exception is raised for them). `reserve` does not ask
        again."""
        if self.soldout.sold_out_for(deal_id, user_id, quantity):
            return SOLD_OUT.encoded(instance)
        return None

    def limited_answer(
        self, deal_id: int, user_id: int, ip: str, device: str | None, instance: str
    ) -> Encoded | None:
        """The answer of a limiter refusal this process remembers (Refusals), ready for
        the wire, asked by the endpoint right after sold_out_answer. `reserve` does not
        ask again."""
        if self._any_limit:
            refused = self.refusals.check(deal_id, user_id, ip, device)
            if refused is not None:
                return self._limited_made(*refused).encoded(instance)
        return None

    async def reserve(self, req: ReserveRequest) -> Reserved:
        """A valid request the near-caches let through (sold_out_answer,
        limited_answer)."""
        assert 1 <= req.quantity <= MAX_QUANTITY, "quantity is validated before the gate"
        if self._inflight >= self.settings.reservation_inflight_max:
            raise overloaded("Too many reservations in progress; retry shortly.")
        self._inflight += 1
        try:
            with self.breaker_for(req.deal_id).call() as allowed:
                if not allowed:
                    return await self._without_redis(req)
                try:
                    return await self._reserve(req)
                except LeaseLapsed:
                    # Its token named a lease found lapsed (Redis flushed or failed over,
                    # the process stalled) and was given back before anything was sent:
                    # once more under a fresh lease.
                    assert self.lease is not None
                    try:
                        await self.lease.ensure()
                    except Exception as exc:
                        log.warning("process lease not replaced: %r", exc)
                        raise overloaded("Database unavailable; retry shortly.") from None
                    if self.admission is not None and req.admission_token:
                        # The first try spent the buyer's waiting-room admission
                        # and bought nothing: the same request may use it again.
                        await self.admission.restore(req.deal_id, req.user_id, req.admission_token)
                    try:
                        return await self._reserve(req)
                    except LeaseLapsed:
                        raise overloaded("Database unavailable; retry shortly.") from None
        finally:
            self._inflight -= 1

    def start_queued(self, req: ReserveRequest) -> QueuedCall | None:
        """The admission of a reservation of a deal in queue mode, sent now, for the
        edge to settle in a callback on its reply (`settle_queued`), with no task or
        coroutine: what `reserve` does for such a deal, on its common way only. None
        (nothing sent) where `reserve` must answer: a deal not known to be in queue
        mode or of several partitions, the global limiter on (its refusal may have to
        unqueue), the breaker not closed, the in-flight cap reached."""
        queue = self.queue
        if (
            queue is None
            or queue.modes.known(req.deal_id) is not True
            or self.mirror.parts.get(req.deal_id) != 1
            or self.settings.limit_global
            or self._inflight >= self.settings.reservation_inflight_max
            or self.breaker_for(req.deal_id).state != "closed"
        ):
            return None
        keys = deal_keys(req.deal_id)
        fp = fingerprint(req.deal_id, req.quantity)
        token = orders.new_id()
        owner = self.lease.owner if self.lease is not None else ""
        sent = time.monotonic()
        queue_args, index = queue.admission(req.deal_id, token, req.user_id)
        admit = self._admit_call(keys, req, fp, token, random.getrandbits(30), owner, queue_args)
        self._inflight += 1
        return QueuedCall(keys, fp, token, sent, owner, index, admit)

    def settle_queued(
        self, req: ReserveRequest, call: QueuedCall
    ) -> Reserved | Awaitable[Reserved]:
        """The admission's reply is in: the 202 (queued, its index written, the deal's
        price known), else the coroutine that answers as `reserve` would from here (a
        refusal, a replay, a full queue, a deal Redis lost). A failed call raises its
        503 as `_admit` does."""
        fut = call.admit
        exc = asyncio.CancelledError() if fut.cancelled() else fut.exception()
        if exc is not None:
            self._inflight -= 1
            if call.index is not None:
                call.index.add_done_callback(_consumed)
            raise self._admit_failed(call.keys, exc)
        self.breaker_for(req.deal_id).success()
        reply = fut.result()
        code = AdmitCode(int(reply[0]))
        index = call.index
        if (
            code == AdmitCode.OK
            and reply[3] == 0  # a buyer admitted before goes the task's way (`_lost_replay`)
            and (
                index is None
                or (index.done() and not index.cancelled() and index.exception() is None)
            )
        ):
            assert self.queue is not None
            body = self.queue.queued(req.deal_id, call.token, req.quantity)
            if body is not None:
                self._inflight -= 1
                return Reserved(body, replayed=False, queued=True)
        return self._queued_later(req, call, admission_of(reply))

    async def _queued_later(
        self, req: ReserveRequest, call: QueuedCall, adm: Admission
    ) -> Reserved:
        if adm.code == AdmitCode.NOT_LOADED:
            # Nothing was admitted or queued: the whole way, which loads the deal.
            self._inflight -= 1
            assert self.queue is not None
            self.queue.drop_index(call.token, call.index)
            return await self.reserve(req)
        try:
            return await self._answer(
                call.keys, req, call.fp, call.token, adm, call.sent, call.owner, True, call.index
            )
        finally:
            self._inflight -= 1

    async def _reserve(self, req: ReserveRequest) -> Reserved:
        parts = self.mirror.parts.get(req.deal_id)
        if parts is None:
            try:
                parts = await self.mirror.partitions_hint(req.deal_id)
            except Exception as exc:
                breaker = self.breaker_for(req.deal_id)
                breaker.failure()
                log.warning("deal %s partitions not read: %r", req.deal_id, exc)
                raise overloaded(
                    "Admission service unavailable; retry shortly.",
                    breaker.retry_after_seconds(),
                ) from None
        if parts > 1:
            return await self._reserve_partitioned(req, parts)
        keys = deal_keys(req.deal_id)
        fp = fingerprint(req.deal_id, req.quantity)
        token = orders.new_id()
        start = random.getrandbits(30)

        sent = time.monotonic()
        # Read once: the marker and the transaction must name the same owner.
        owner = self.lease.owner if self.lease is not None else ""
        # Queue mode (docs/queue-mode.md): the admission queues the request in its own
        # call and writes the order's index (on Redis Cluster the index is a call of
        # its own, in the same pipeline).
        # The mode is known without a wait for every deal up to the last read of the
        # modes; a newer deal is admitted as sync and, if it is in queue mode after
        # all, queued by a second call (`_enqueue`).
        queue = self.queue
        mode = queue.modes.known(req.deal_id) if queue is not None else False
        queue_args: QueueArgs | None = None
        index: asyncio.Future[Any] | None = None
        if mode:
            assert queue is not None
            queue_args, index = queue.admission(req.deal_id, token, req.user_id)
        adm = await self._admit(keys, req, fp, token, start, owner, queue_args)
        if adm.code == AdmitCode.NOT_LOADED:
            # An unknown deal id (a flood of random ones, say) is answered before any
            # snapshot or load.
            generation = await self.unknown_deals.generation()
            if self.unknown_deals.unknown(req.deal_id, generation):
                raise not_found("deal")
            if not await self._load(req.deal_id):
                await self.unknown_deals.learn(req.deal_id, generation)
                raise not_found("deal")
            if self.mirror.parts.get(req.deal_id, 1) > 1:
                # The load showed a partitioned deal (nothing was admitted above).
                return await self._reserve_partitioned(req, self.mirror.parts[req.deal_id])
            adm = await self._admit(keys, req, fp, token, start, owner, queue_args)
            if adm.code == AdmitCode.NOT_LOADED:
                raise overloaded("Deal state is being rebuilt; retry shortly.")
        return await self._answer(keys, req, fp, token, adm, sent, owner, mode, index)

    async def _reserve_partitioned(self, req: ReserveRequest, parts: int) -> Reserved:
        """A deal of P > 1 partitions (docs/scale-out.md, "Deal partitions"): the buyer's
        home partition first (their idempotency record, quota and limiter cells are
        there as long as it has stock), then, only when it answers SOLD_OUT, the next
        partitions in order. Each admission is the same lua/admit.lua on that
        partition's keys; the database stays the judge of quota and keys across
        partitions (a buyer who fell over is known to another partition's Redis only
        from then on). The deal is sold out when every partition said so."""
        fp = fingerprint(req.deal_id, req.quantity)
        token = orders.new_id()
        sent = time.monotonic()
        owner = self.lease.owner if self.lease is not None else ""
        home = home_partition(req.user_id, parts)
        left = 0
        buyers = 0
        known = False
        global_retry_ms: int | None = None
        adm: Admission | None = None
        keys = partition_keys(req.deal_id, home)
        nb = self.mirror.bucket_count_of(req.deal_id)
        for i in range(parts):
            k = (home + i) % parts
            keys = partition_keys(req.deal_id, k)
            # A start bucket the partition owns (admit.lua walks from it, skipping
            # empty fields: the other partitions' buckets are 0 here).
            start = (
                k + parts * random.randrange((nb - k + parts - 1) // parts)
                if nb is not None
                else random.getrandbits(30)
            )
            # The global limiter judges the request once, beside its first admission.
            adm = await self._admit(keys, req, fp, token, start, owner, None, global_limit=i == 0)
            if i == 0:
                global_retry_ms = adm.global_retry_ms
            if adm.code == AdmitCode.NOT_LOADED:
                if not await self._load(req.deal_id):
                    raise not_found("deal")
                adm = await self._admit(
                    keys, req, fp, token, start, owner, None, global_limit=False
                )
                if adm.code == AdmitCode.NOT_LOADED:
                    raise overloaded("Deal state is being rebuilt; retry shortly.")
            if adm.code != AdmitCode.SOLD_OUT:
                break
            left += int(adm.detail or 0)
            known = known or adm.known_buyer
            buyers = -1 if adm.buyers < 0 or buyers < 0 else buyers + adm.buyers
        assert adm is not None
        if adm.code == AdmitCode.SOLD_OUT:
            # Every partition refused: the deal's answer, with the units left in all.
            adm = Admission(AdmitCode.SOLD_OUT, str(left), known, buyers, global_retry_ms)
        elif adm.global_retry_ms != global_retry_ms:
            adm = Admission(adm.code, adm.detail, adm.known_buyer, adm.buyers, global_retry_ms)
        return await self._answer(keys, req, fp, token, adm, sent, owner, False, None, parts)

    async def _answer(
        self,
        keys: DealKeys,
        req: ReserveRequest,
        fp: str,
        token: str,
        adm: Admission,
        sent: float,
        owner: str,
        mode: bool | None,
        index: asyncio.Future[Any] | None,
        parts: int = 1,
    ) -> Reserved:
        """What follows the admission: its refusal answered, or its transaction run."""
        queue = self.queue
        # mode True: the admission queued the request if it admitted it.
        if mode and adm.code != AdmitCode.OK:
            assert queue is not None
            queue.drop_index(token, index)  # nothing was queued
            if adm.code == AdmitCode.QUEUE_FULL:
                queue.full(req.deal_id)
                raise overloaded("The deal's queue is full; retry shortly.")
        if adm.code == AdmitCode.REPLAY:
            return await self._replay(adm.detail, req.user_id, fp)
        if adm.code == AdmitCode.IN_PROGRESS and self.queue is not None:
            # A replay of a request that waits in its deal's queue: 202 again.
            queued = await self.queue.replay(req.deal_id, adm.detail)
            if queued is not None:
                return Reserved(queued, replayed=True, queued=True)
        if adm.code != AdmitCode.OK:
            # A refusal of a known buyer may hide a replay whose Redis record was lost:
            # the database is asked. Not for a rate limit: a 429 is a "later", never a
            # final answer, and asking the database there would put a query behind every
            # click of a buyer hammering over their limit.
            # The buyer's keys are remembered briefly (BuyerKeys): a buyer re-clicking
            # with fresh keys at their limit does not cost a query each time.
            if (
                adm.known_buyer
                and adm.code != AdmitCode.RATE_LIMITED
                and await self.buyer_keys.may_hold(req.user_id, req.idempotency_key)
            ):
                existing = await self._existing_or_none(req, fp)
                if existing is not None:
                    return existing
            if adm.code == AdmitCode.SOLD_OUT and adm.detail == "0":
                self.soldout.observe(req.deal_id, adm.buyers, parts)
            if adm.code == AdmitCode.RATE_LIMITED:
                scope, wait_ms = adm.detail.split("|")
                self.refusals.remember(req, scope, int(wait_ms), sent)
                raise self._limited(scope, int(wait_ms))
            raise from_admit(adm.code, adm.detail)
        if adm.global_retry_ms is not None:
            # The global limiter ran in the same pipeline; if it refused, give back
            # what the admission took before anything reaches the database.
            if mode:
                assert queue is not None
                # Queued already: rejected first, so that no consumer commits it (one
                # already committing it wins: then the request is queued).
                try:
                    rejected = await queue.unqueue(req.deal_id, token, "RATE_LIMITED")
                except Exception as exc:
                    log.warning("queued reservation %s not rejected: %r", token, exc)
                    rejected = False  # it stays queued: the consumers commit it
                if not rejected:
                    return await self._queued(req, token, index)
            await self._compensate(keys, req, token)
            self.refusals.remember(req, "global", adm.global_retry_ms, sent)
            raise self._limited("global", adm.global_retry_ms)

        if mode:
            if adm.known_buyer:
                if index is not None:
                    index.add_done_callback(_consumed)  # not awaited if taken back
                replay = await self._lost_replay(keys, req, fp, token, queued=True)
                if replay is not None:
                    return replay
            return await self._queued(req, token, index)
        alloc = normalise_alloc(adm.detail)
        if mode is None and await queue.modes.is_queue(req.deal_id):  # type: ignore[union-attr]
            if adm.known_buyer:
                replay = await self._lost_replay(keys, req, fp, token, queued=False)
                if replay is not None:
                    return replay
            return await self._enqueue(keys, req, fp, token, alloc)
        # An allocation over several buckets goes through gate_reserve with `alloc`;
        # the item's bucket (its first) is used only when it names one.
        item = self._item(token, req, fp, int(alloc.split(":", 1)[0]), owner)
        try:
            if self.groups is not None and "," not in alloc:
                row = await self.groups.reserve(req.deal_id, item)
            else:
                row = await self._transaction(req.deal_id, item, alloc)
        except OutcomeUnknown as exc:
            row = await self._resolve_unknown(exc, keys, req, token, redis=True)
        except Exception as exc:
            if not isinstance(exc, DbUnavailable | pymysql.err.MySQLError | TimeoutError):
                log.exception("reservation transaction failed unexpectedly")
            await self._compensate(keys, req, token)
            if isinstance(exc, LeaseLapsed):
                # A fresh instance: a group's items share theirs.
                raise LeaseLapsed(str(exc)) from None
            raise overloaded("Database unavailable; retry shortly.") from None

        db_code = DbCode(int(row[0]))
        if db_code == DbCode.OK:
            self.buyer_keys.forget(req.user_id)
            try:
                await self.mirror.confirm(
                    keys, req.user_id, req.idempotency_key, token, fp, str(row[1])
                )
                self.breaker_for(req.deal_id).success()
            except Exception as exc:
                # The order is committed; the janitor confirms the token later.
                self.breaker_for(req.deal_id).failure()
                log.warning("order %s committed but not confirmed in Redis: %r", token, exc)
            return Reserved(self._body(token, req, row), replayed=False)

        await self._compensate(keys, req, token)
        if db_code == DbCode.DUPLICATE:
            return await self._existing(req, fp)
        # Redis admitted what the database refuses: Redis lost something, perhaps this
        # key's record too, and gate_reserve checks stock and quota before it meets the
        # key. A replay gets its first answer, whatever the deal's state now.
        existing = await self._existing_or_none(req, fp)
        if existing is not None:
            return existing
        if db_code == DbCode.SOLD_OUT:
            log.info("deal %s: Redis admitted but the database is sold out", req.deal_id)
        raise from_db(db_code)
