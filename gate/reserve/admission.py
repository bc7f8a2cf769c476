"""The admission in Redis (`Admitter`): a request's Attempt made, lua/admit.lua run
for it, the global limiter in the same pipeline, a deal Redis lacks loaded first, a
partitioned deal asked partition by partition, and the units given back when the
reservation will never be committed.

    attempt(request) ──> Attempt: order id (the in-flight token), keys, start bucket
    send(attempt) ──> Mirror.admit ──> lua/admit.lua (pipelined with the turn's calls)
    admit(attempt) = send + the global limiter ──> Admission
        └─ the call failed (it may have run) ──> the breaker counts it, the units go
           back once Redis answers (GiveBacks), 503
    admit_partitioned(request): the buyer's home partition, then the next ones while
        each says SOLD_OUT
    load(deal): a deal Redis lacks ("not loaded") loaded from the database
    give_back(attempt) ──> lua/compensate.lua: only the call that removes the token
        gives back, so the request, a retry and the janitor never give twice
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

from gate.base.codes import AdmitCode, LimitCode
from gate.base.errors import Problem, not_found, overloaded
from gate.base.metrics import METRICS
from gate.inventory import orders
from gate.inventory.mirror import Mirror
from gate.inventory.unknown_deals import UnknownDeals
from gate.reserve.breaker import Breakers
from gate.reserve.giveback import GiveBacks
from gate.reserve.ports import AdmissionPort, QueuePort
from gate.reserve.refusals import RateLimits
from gate.reserve.request import (
    QUEUED,
    SYNC,
    UNSURE,
    Admission,
    Attempt,
    ReserveRequest,
    admission_of,
    fingerprint,
)
from gate.store.keys import GLOBAL_LIMIT, deal_keys, home_partition, partition_keys
from gate.store.process_lease import Lease

log = logging.getLogger("gate.reservations")


# lua/admit.lua ARGV[17] for `ReserveRequest.operator_retry` (a header never maps to it).
OPERATOR_ADMISSION = "*"


# The global limiter's refusal when its call failed and limits do not fail open.
GLOBAL_FAILED_RETRY_MS = 1000


def no_admission(header: str | None) -> str:
    """Without the waiting room installed no token is ever valid."""
    return "" if header is None else "-"


class Admitter:
    def __init__(
        self,
        mirror: Mirror,
        breakers: Breakers,
        limits: RateLimits,
        givebacks: GiveBacks,
        unknown_deals: UnknownDeals,
        lease: Lease | None,
        admission: AdmissionPort | None,
        queue: QueuePort | None,
        *,
        limits_fail_open: bool,
    ) -> None:
        self.mirror = mirror
        # The process's liveness lease: each admission token names its owner.
        self.lease = lease
        self.breakers = breakers
        self.limits = limits
        self.givebacks = givebacks
        self.unknown_deals = unknown_deals
        # The waiting room's token check (lua/admit.lua is told what the buyer's
        # Admission-Token header is worth); without the room no token is ever valid.
        self.admission = admission
        # Queue mode: what lua/admit.lua needs to queue an admitted request as well.
        self.queue = queue
        self.limits_fail_open = limits_fail_open

    def attempt(self, req: ReserveRequest, known: bool | None) -> Attempt:
        """The request's attempt at a deal of one partition: its order id (also the
        admission's in-flight token), its start bucket, the lease its token names.
        `known`: the deal is in queue mode (True: the admission queues the request
        too), sync (False), or newer than this process's view of the modes (None)."""
        deal_id = req.deal_id
        token = orders.new_id()
        # Read once: the marker and the transaction must name the same owner.
        owner = self.lease.owner if self.lease is not None else ""
        mode = QUEUED if known else SYNC if known is False else UNSURE
        queue_args = index = None
        if known:
            # Queue mode (docs/queue-mode.md): the admission queues the request in its
            # own call and writes the order's index (on Redis Cluster the index is a
            # call of its own, in the same pipeline).
            assert self.queue is not None
            queue_args, index = self.queue.admission(deal_id, token, req.user_id)
        return Attempt(
            req,
            deal_keys(deal_id),
            fingerprint(deal_id, req.quantity),
            token,
            random.getrandbits(30),
            time.monotonic(),
            owner,
            mode,
            queue_args,
            index,
        )

    def send(self, att: Attempt) -> asyncio.Future[Any]:
        """The admission's call, queued for this loop turn's pipeline."""
        req = att.req
        keys = att.keys
        return self.mirror.admit(
            keys,
            req.user_id,
            req.quantity,
            att.fp,
            att.token,
            att.start,
            req.idempotency_key,
            keys.limiters(req.user_id, req.ip, req.device),
            self.limits.args if req.device is not None else self.limits.args_no_device,
            att.owner,
            OPERATOR_ADMISSION if req.operator_retry else self._admission_arg(req),
            att.queue_args,
        )

    def _admission_arg(self, req: ReserveRequest) -> str:
        """What lua/admit.lua is told of the request's Admission-Token header."""
        if self.admission is None:
            return no_admission(req.admission_token)
        return self.admission.arg(req.deal_id, req.user_id, req.admission_token)

    def failed(self, deal_id: int, exc: BaseException) -> Problem:
        """The admission's call failed (it may have run): the breaker counts it, 503."""
        breaker = self.breakers.for_deal(deal_id)
        breaker.failure()
        log.warning("admission failed for deal %s: %r", deal_id, exc)
        return overloaded(
            "Admission service unavailable; retry shortly.", breaker.retry_after_seconds()
        )

    async def admit(self, att: Attempt, global_limit: bool = True) -> Admission:
        """Run the admission (and the global limiter in the same pipeline)."""
        admit = self.send(att)
        spec = self.limits.global_spec
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
            if att.queue_args is None:
                # Perhaps it ran: its units go back once Redis answers, since this
                # token is never sent to the database. A queued one may be committed
                # by a consumer: the janitor judges it.
                self._give_back_later(att)
            raise self.failed(att.req.deal_id, exc) from None
        self.breakers.for_deal(att.req.deal_id).success()
        refused: int | None = None
        if limit is not None:
            try:
                limit_code, limit_detail = await limit
                if LimitCode(int(limit_code)) == LimitCode.RATE_LIMITED:
                    refused = int(limit_detail)
            except Exception as exc:
                log.warning("global limiter failed: %r", exc)
                if not self.limits_fail_open:
                    refused = GLOBAL_FAILED_RETRY_MS
        return admission_of(reply, refused)

    async def admit_partitioned(self, req: ReserveRequest, parts: int) -> tuple[Attempt, Admission]:
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
        nb = self.mirror.bucket_count_of(req.deal_id)
        left = 0
        buyers = 0
        known = False
        global_retry_ms: int | None = None
        for i in range(parts):
            k = (home + i) % parts
            # A start bucket the partition owns (admit.lua walks from it, skipping
            # empty fields: the other partitions' buckets are 0 here).
            start = (
                k + parts * random.randrange((nb - k + parts - 1) // parts)
                if nb is not None
                else random.getrandbits(30)
            )
            keys = partition_keys(req.deal_id, k)
            att = Attempt(req, keys, fp, token, start, sent, owner, SYNC, None, None, parts)
            # The global limiter judges the request once, beside its first admission.
            adm = await self.admit(att, global_limit=i == 0)
            if i == 0:
                global_retry_ms = adm.global_retry_ms
            if adm.code == AdmitCode.NOT_LOADED:
                await self.load(req.deal_id)
                adm = await self.admit_loaded(att)
            if adm.code != AdmitCode.SOLD_OUT:
                if adm.global_retry_ms != global_retry_ms:
                    adm = Admission(
                        adm.code, adm.detail, adm.known_buyer, adm.buyers, global_retry_ms
                    )
                return att, adm
            left += int(adm.detail or 0)
            known = known or adm.known_buyer
            buyers = -1 if adm.buyers < 0 or buyers < 0 else buyers + adm.buyers
        # Every partition refused: the deal's answer, with the units left in all.
        return att, Admission(AdmitCode.SOLD_OUT, str(left), known, buyers, global_retry_ms)

    async def admit_loaded(self, att: Attempt) -> Admission:
        """The admission again, once the deal was loaded (the global limiter judged
        the request the first time)."""
        adm = await self.admit(att, global_limit=False)
        if adm.code == AdmitCode.NOT_LOADED:
            raise overloaded("Deal state is being rebuilt; retry shortly.")
        return adm

    async def _loaded(self, deal_id: int) -> bool:
        """Load a deal Redis lacks; False when the database has no such deal."""
        try:
            return await self.mirror.load(deal_id)
        except Exception as exc:
            # The database or Redis failed while the deal was being loaded.
            log.warning("deal %s not loaded into Redis: %r", deal_id, exc)
            raise overloaded("Deal state unavailable; retry shortly.") from None

    async def load(self, deal_id: int) -> None:
        """Load a deal Redis lacks; 404 when the database has no such deal."""
        if not await self._loaded(deal_id):
            raise not_found("deal")

    async def load_unless_unknown(self, deal_id: int) -> None:
        """`load`, the memory of unknown deal ids asked first: a flood of random ids
        is answered before any snapshot or load."""
        unknown = self.unknown_deals
        generation = await unknown.generation()
        if unknown.unknown(deal_id, generation):
            raise not_found("deal")
        if not await self._loaded(deal_id):
            await unknown.learn(deal_id, generation)
            raise not_found("deal")

    async def read_partitions(self, deal_id: int) -> int:
        """The deal's partition count, read from Redis (this process has none yet)."""
        try:
            return await self.mirror.partitions_hint(deal_id)
        except Exception as exc:
            breaker = self.breakers.for_deal(deal_id)
            breaker.failure()
            log.warning("deal %s partitions not read: %r", deal_id, exc)
            raise overloaded(
                "Admission service unavailable; retry shortly.", breaker.retry_after_seconds()
            ) from None

    async def give_back(self, att: Attempt) -> None:
        """The admission's units back in Redis (lua/compensate.lua), or later if Redis
        fails now (GiveBacks)."""
        req = att.req
        try:
            if await self.mirror.compensate(att.keys, req.user_id, req.idempotency_key, att.token):
                METRICS.compensations.inc()
        except Exception as exc:
            self.breakers.for_deal(req.deal_id).failure()
            self._give_back_later(att)
            log.warning("compensation of %s deferred: %r", att.token, exc)

    def _give_back_later(self, att: Attempt) -> None:
        self.givebacks.add(att.keys, att.req.user_id, att.req.idempotency_key, att.token)
