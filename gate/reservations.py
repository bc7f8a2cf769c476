"""The reservation path: one Redis admission, one authoritative database transaction.

    in-flight cap ──full──> 503
    admit (Lua; the global limiter in the same pipeline)
        ├─ rejected (sold out, not active, replay, limits…) ──> answer, no database work
        └─ OK: units taken in Redis, admission token recorded
    CALL gate_reserve (one round trip, one short transaction, on the reservations'
    share of the pool), or, when several reservations of the deal are admitted while
    the database is busy with the previous ones, CALL gate_reserve_group for all of
    them in one transaction (gate/groups.py)
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
import functools
import hashlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pymysql

from gate import orders
from gate.alloc import normalise_alloc
from gate.breaker import CLOSED, HALF_OPEN, Breaker
from gate.buyer_keys import BuyerKeys
from gate.clock import iso
from gate.codes import AdmitCode, DbCode, LimitCode
from gate.db import Database, DbUnavailable, OutcomeUnknown
from gate.errors import Encoded, Problem, from_admit, from_db, not_found, overloaded
from gate.giveback import GiveBacks
from gate.groups import Item, ReservationGroups, reservation_call
from gate.keys import GLOBAL_LIMIT, DealKeys, deal_keys, home_partition, partition_keys
from gate.lease import Lease, LeaseLapsed
from gate.limits import LimitSpec, rate_limited
from gate.metrics import METRICS, CounterTally
from gate.mirror import Mirror, QueueArgs
from gate.settings import Settings
from gate.soldout import SoldOutCache
from gate.unknown_deals import UnknownDeals

if TYPE_CHECKING:
    from gate.queue.service import QueueService

log = logging.getLogger("gate.reservations")

MAX_QUANTITY = 1_000_000


def sold_out() -> Problem:
    return Problem("SOLD_OUT", "The deal is sold out.", extra={"remaining_hint": 0}, cacheable=True)


# Only ever encoded, never raised (raising one instance again and again would chain
# its tracebacks).
SOLD_OUT = sold_out()


RATE_LIMITED = METRICS.rate_limited
# Rate-limited refusals per scope as tallies (one per scope and process): a refusal
# answered from the near-cache must not pay prometheus-client's lock, and under
# several workers a write to the shared files, which its sold-out sibling does not.
_LIMITED_TALLIES: dict[str, CounterTally] = {}
SCOPED_LIMITS = ("deal", "user", "ip", "device")
SCOPE_NAMES = (*SCOPED_LIMITS, "global")
GLOBAL_INDEX = len(SCOPED_LIMITS)
# A request without X-Device-Id is not device-limited (README): it has no device to
# count against, and one shared "no device" bucket would limit all such buyers of a
# deal together.
DEVICE_INDEX = SCOPED_LIMITS.index("device")
REFUSALS_MAX = 100_000
LIMITED_ANSWERS_MAX = 4096


class Refusals:
    """The limiters' near-cache: what Redis refused, remembered in this process
    until the refusal's own end, so that a client hammering over its limit is
    answered 429 without a Redis round trip (issue #3: a limiter rejection must cost
    no more than a sold-out one).

    Exact for the limits: a GCRA limiter that refuses "retry after w ms" keeps
    refusing for w ms whatever any process does (its theoretical arrival time only
    grows, and a refused request changes nothing), and the end is counted from the
    moment the call was *sent*, before Redis read its clock. What is approximate is
    only which answer such a client gets meanwhile: Redis answers a replay, a sold-out
    deal or an ended sale before its limiters, this cache answers 429 for up to the
    remaining wait; the retry after Retry-After gets the other answer.
    """

    def __init__(self, scoped: tuple[LimitSpec | None, ...], global_on: bool) -> None:
        self.scopes = tuple(i for i, spec in enumerate(scoped) if spec)
        self.global_on = global_on
        self._until: dict[tuple[int, int, Any], float] = {}

    def _keys(
        self, deal_id: int, user_id: int, ip: str, device: str | None
    ) -> list[tuple[int, int, Any]]:
        idents = (None, user_id, ip, device)
        keys = [
            (deal_id, i, idents[i]) for i in self.scopes if i != DEVICE_INDEX or device is not None
        ]
        if self.global_on:
            keys.append((0, GLOBAL_INDEX, None))
        return keys

    def check(
        self, deal_id: int, user_id: int, ip: str, device: str | None
    ) -> tuple[str, int] | None:
        """(scope, milliseconds still to wait) when a remembered refusal holds.
        On every reservation: plain look-ups, no key list built."""
        until_of = self._until
        if not until_of:
            return None
        for i in self.scopes:
            if i == DEVICE_INDEX and device is None:
                continue
            key = (deal_id, i, (None, user_id, ip, device)[i])
            until = until_of.get(key)
            if until is not None:
                left = until - time.monotonic()
                if left > 0:
                    return SCOPE_NAMES[i], math.ceil(left * 1000)
                del until_of[key]
        if self.global_on:
            key = (0, GLOBAL_INDEX, None)
            until = until_of.get(key)
            if until is not None:
                left = until - time.monotonic()
                if left > 0:
                    return "global", math.ceil(left * 1000)
                del until_of[key]
        return None

    def remember(self, req: ReserveRequest, scope: str, wait_ms: int, sent: float) -> None:
        if len(self._until) >= REFUSALS_MAX:
            now = time.monotonic()
            self._until = {k: v for k, v in self._until.items() if v > now}
            if len(self._until) >= REFUSALS_MAX:
                self._until.clear()
        index = SCOPE_NAMES.index(scope)
        for key in self._keys(req.deal_id, req.user_id, req.ip, req.device):
            if key[1] == index:
                self._until[key] = sent + wait_ms / 1000


@dataclass(frozen=True)
class ReserveRequest:
    deal_id: int
    user_id: int
    quantity: int
    idempotency_key: str
    ip: str
    device: str | None
    # The Admission-Token header of a deal with a waiting room (gate/room/).
    admission_token: str | None = None
    # The operator's re-submission of a queue dead letter (`gate queue retry`): the
    # request that died spent the buyer's admission, so none is asked or spent. Never
    # set from a buyer's request.
    operator_retry: bool = False


# lua/admit.lua ARGV[17] for `ReserveRequest.operator_retry` (a header never maps to it).
OPERATOR_ADMISSION = "*"
# Open breakers whose time is up are probed this often without waiting for a call
# (`probe_breakers`), at most this many per round.
BREAKER_PROBE_SECONDS = 1.0
BREAKERS_PROBED_MAX = 1000
# Queue mode: how long an admission of a buyer admitted before waits for the database
# to say whether it is a replay whose Redis record was lost (`_lost_replay`).
LOST_REPLAY_WAIT_SECONDS = 0.5


def _no_admission(deal_id: int, user_id: int, header: str | None) -> str:
    """Without the waiting room installed no token is ever valid."""
    return "" if header is None else "-"


@dataclass(frozen=True)
class Admission:
    """What the admission (and the global limiter beside it) answered."""

    code: AdmitCode
    detail: str
    # The user was admitted to this deal before: a refusal may hide a replay whose
    # Redis record was lost, so the database is asked.
    known_buyer: bool = False
    # Size of the deal's buyers set on a sold-out answer (-1: unknown), for the
    # near-cache.
    buyers: int = -1
    # The global limiter refused: retry after this many ms.
    global_retry_ms: int | None = None


@dataclass(frozen=True)
class Reserved:
    body: dict[str, Any]
    replayed: bool
    # Answered 202: the request waits in its deal's queue (docs/queue-mode.md).
    queued: bool = False


def admission_of(reply: list[Any], global_retry_ms: int | None = None) -> Admission:
    """lua/admit.lua's reply: {code, detail[, buyers, known buyer]}."""
    return Admission(
        code=AdmitCode(int(reply[0])),
        detail=str(reply[1]),
        buyers=int(reply[2]) if len(reply) > 2 else -1,
        known_buyer=len(reply) > 3 and int(reply[3]) == 1,
        global_retry_ms=global_retry_ms,
    )


def _consumed(fut: asyncio.Future[Any]) -> None:
    """A call whose outcome no longer matters: its failure retrieved, not logged."""
    if not fut.cancelled():
        fut.exception()


@dataclass(frozen=True, slots=True)
class QueuedCall:
    """An admission of a deal in queue mode started at the edge (`start_queued`):
    what settles it once its reply is in (`settle_queued`)."""

    keys: DealKeys
    fp: str
    token: str
    sent: float
    owner: str
    index: asyncio.Future[Any] | None  # None: the admission writes the order's index
    admit: asyncio.Future[Any]


@functools.lru_cache(maxsize=4096)
def fingerprint(deal_id: int, quantity: int) -> str:
    """What makes two requests with one idempotency key "the same request"."""
    return hashlib.sha256(f"reserve:{deal_id}:{quantity}".encode()).hexdigest()[:32]


def _limiter_args(specs: tuple[LimitSpec | None, ...]) -> list[int]:
    args: list[int] = []
    for spec in specs:
        args.extend((spec.emission_ms, spec.burst) if spec else (0, 0))
    return args


class Reservations:
    def __init__(
        self,
        settings: Settings,
        db: Database,
        mirror: Mirror,
        soldout: SoldOutCache,
        unknown_deals: UnknownDeals | None = None,
        lease: Lease | None = None,
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
        # On Redis Cluster one breaker per node (gate/scripts.py node_of): a failing
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
        # (deal, user, Admission-Token header) -> what lua/admit.lua is told; the
        # waiting room (gate/room/) installs its token check here.
        self.admission_arg: Callable[[int, int, str | None], str] = _no_admission
        # Gives back the admission a reservation spent when that reservation is tried
        # once more after its lease was found lapsed (see reserve); the room installs it.
        self.admission_restore: Callable[[ReserveRequest], Awaitable[None]] | None = None
        # Queue mode (gate/queue/), set by its area: an admitted reservation of a deal
        # in queue mode is handed to the deal's queue instead of the database.
        self.queue: QueueService | None = None
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
                    if self.admission_restore is not None and req.admission_token:
                        # The first try spent the buyer's waiting-room admission
                        # and bought nothing: the same request may use it again.
                        await self.admission_restore(req)
                    try:
                        return await self._reserve(req)
                    except LeaseLapsed:
                        raise overloaded("Database unavailable; retry shortly.") from None
        finally:
            self._inflight -= 1

    # -- queue mode at the edge: no task for a 202 -------------------------------------

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

    async def _load(self, deal_id: int) -> bool:
        """Load a deal Redis lacks; False when the database has no such deal."""
        try:
            return await self.mirror.load(deal_id)
        except Exception as exc:
            # The database or Redis failed while the deal was being loaded.
            log.warning("deal %s not loaded into Redis: %r", deal_id, exc)
            raise overloaded("Deal state unavailable; retry shortly.") from None

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
            OPERATOR_ADMISSION
            if req.operator_retry
            else self.admission_arg(req.deal_id, req.user_id, req.admission_token),
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

    async def _without_redis(self, req: ReserveRequest) -> Reserved:
        """Redis is failing (the breaker is open)."""
        retry = self.breaker_for(req.deal_id).retry_after_seconds()
        if self.settings.redis_down_policy != "database":
            raise overloaded("Reservations are paused while admission recovers.", retry)
        if self._any_limit and not self.settings.limits_fail_open:
            raise overloaded("Rate limits unavailable; reservations paused.", retry)
        if self._direct_slots.locked():
            raise overloaded("Database fallback at capacity; retry shortly.", retry)
        async with self._direct_slots:
            # A deal's waiting room lives in Redis: without Redis no admission can be
            # checked or spent, so such a deal is paused rather than opened to all.
            try:
                room = await self.db.fetchone(
                    "SELECT waiting_room IS NOT NULL FROM deals WHERE id = %s", (req.deal_id,)
                )
            except (DbUnavailable, pymysql.err.MySQLError, TimeoutError):
                raise overloaded("Database unavailable; retry shortly.") from None
            if room is not None and int(room[0]) == 1:
                raise overloaded("Reservations are paused while admission recovers.", retry)
            fp = fingerprint(req.deal_id, req.quantity)
            token = orders.new_id()
            # No Redis allocation: a random bucket, and the procedure falls over to
            # the others. The resync loop brings Redis back once it answers. A
            # partitioned deal's procedure falls over within the bucket's partition
            # only: each partition in turn (the buyer's first), while it says sold out.
            parts = self.mirror.parts.get(req.deal_id, 1)
            nb = self.mirror.bucket_count_of(req.deal_id) if parts > 1 else None
            home = home_partition(req.user_id, parts)
            tries = parts if nb is not None else 1
            for i in range(tries):
                bucket = random.getrandbits(16)
                if nb is not None:
                    k = (home + i) % parts
                    bucket = k + parts * random.randrange((nb - k + parts - 1) // parts)
                item = self._item(token, req, fp, bucket, None)
                try:
                    row = await self._transaction(req.deal_id, item, f"{bucket}:{req.quantity}")
                except OutcomeUnknown as exc:
                    row = await self._resolve_unknown(
                        exc, deal_keys(req.deal_id), req, token, redis=False
                    )
                except (DbUnavailable, pymysql.err.MySQLError, TimeoutError):
                    raise overloaded("Database unavailable; retry shortly.") from None
                if DbCode(int(row[0])) != DbCode.SOLD_OUT:
                    break
            db_code = DbCode(int(row[0]))
            if db_code == DbCode.OK:
                self.buyer_keys.forget(req.user_id)
                return Reserved(self._body(token, req, row), replayed=False)
            if db_code == DbCode.DUPLICATE:
                return await self._existing(req, fp)
            # gate_reserve checks the window, stock and quota before it meets the key:
            # a replay (or a mismatch) gets its own answer, whatever the deal's state.
            existing = await self._existing_or_none(req, fp)
            if existing is not None:
                return existing
            raise from_db(db_code)

    async def _lost_replay(
        self, keys: DealKeys, req: ReserveRequest, fp: str, token: str, queued: bool
    ) -> Reserved | None:
        """Queue mode: Redis admitted a buyer it had admitted to the deal before, with a
        key it holds no record of. Sync mode's transaction would meet the key in the
        database (DUPLICATE: the replay answered); a 202 would hand the buyer a second
        order id whose commit can only fail. So the database is asked first (at most
        one read per buyer per BUYER_KEYS_SECONDS, `BuyerKeys`), for at most
        LOST_REPLAY_WAIT_SECONDS: a replay whose record Redis lost (a flush, a
        failover) is taken back (unqueued, its units given back) and answered with
        the order, as in sync mode; a key used with another request is a 422. A
        database that does not answer in time leaves the 202 (queue mode accepts
        through database trouble; a consumer then meets DUPLICATE)."""
        # Shielded: a read cut short by the wait would cost its connection.
        asked = asyncio.ensure_future(self._replayed(req, fp))
        asked.add_done_callback(_consumed)  # also when nobody waits for it any more
        try:
            existing = await asyncio.wait_for(asyncio.shield(asked), LOST_REPLAY_WAIT_SECONDS)
        except TimeoutError:
            return None
        except Problem as problem:
            if problem.code != "IDEMPOTENCY_MISMATCH":
                return None  # the database is unavailable: queued, as without the check
            await self._take_back(keys, req, token, queued)
            raise
        except Exception as exc:
            log.warning("reservation %s: replay not checked: %r", token, exc)
            return None
        if existing is None:
            return None
        await self._take_back(keys, req, token, queued)
        return existing

    async def _replayed(self, req: ReserveRequest, fp: str) -> Reserved | None:
        if not await self.buyer_keys.may_hold(req.user_id, req.idempotency_key):
            return None
        return await self._existing_or_none(req, fp)

    async def _take_back(
        self, keys: DealKeys, req: ReserveRequest, token: str, queued: bool
    ) -> None:
        """An admission that must not be queued after all: rejected first if queued (a
        consumer already committing it meets DUPLICATE and gives the units back
        itself), then its units given back."""
        if queued:
            assert self.queue is not None
            try:
                rejected = await self.queue.unqueue(req.deal_id, token, "DUPLICATE")
            except Exception as exc:
                log.warning("queued reservation %s not rejected: %r", token, exc)
                return  # a consumer meets it: DUPLICATE, given back there
            if not rejected:
                return
        await self._compensate(keys, req, token)

    async def _queued(
        self, req: ReserveRequest, token: str, index: asyncio.Future[Any] | None
    ) -> Reserved:
        """Queue mode: the admission queued the request (202); `index`, the call that
        wrote the order's index beside it (None: the admission wrote it)."""
        assert self.queue is not None
        try:
            if index is not None:
                await index
        except Exception as exc:
            # Queued, but its order could not be found by id: rejected at once if no
            # consumer has taken it yet (then given back), else answered as queued.
            log.warning("reservation %s queued without its index: %r", token, exc)
            try:
                rejected = await self.queue.unqueue(req.deal_id, token, "OVERLOADED")
            except Exception:
                rejected = False  # the consumers settle it; the order reads once committed
            if rejected:
                await self._compensate(deal_keys(req.deal_id), req, token)
                raise overloaded("Admission service unavailable; retry shortly.") from None
        body = self.queue.queued(req.deal_id, token, req.quantity)
        if body is None:
            body = await self.queue.queued_first(req.deal_id, token, req.quantity)
        return Reserved(body, replayed=False, queued=True)

    async def _enqueue(
        self, keys: DealKeys, req: ReserveRequest, fp: str, token: str, alloc: str
    ) -> Reserved:
        """Queue mode, a deal newer than this process's last read of the modes: the
        request was admitted as sync; a second call queues it (202)."""
        assert self.queue is not None
        try:
            body = await self.queue.enqueue(
                req.deal_id, token, req.user_id, req.quantity, alloc, req.idempotency_key, fp
            )
        except Exception as exc:
            # Not queued (the script never ran, or ran: then the token is in the queue
            # and the consumers settle it; compensate acts only if it is not).
            log.warning("reservation %s not queued: %r", token, exc)
            body = None
        if body is None:
            await self._compensate(keys, req, token)
            raise overloaded("The deal's queue is full; retry shortly.")
        return Reserved(body, replayed=False, queued=True)

    def _item(
        self, token: str, req: ReserveRequest, fp: str, bucket: int, owner: str | None
    ) -> Item:
        """The request's database part, due within the reservation's deadline from now."""
        deadline = asyncio.get_running_loop().time() + self.timeout_seconds
        return Item(
            token, req.user_id, req.quantity, bucket, req.idempotency_key, fp, deadline, owner
        )

    async def aclose(self) -> None:
        await self.buyer_keys.aclose()
        if self.groups is not None:
            await self.groups.aclose()

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

    async def _resolve_unknown(
        self,
        exc: OutcomeUnknown,
        keys: DealKeys,
        req: ReserveRequest,
        token: str,
        *,
        redis: bool,
    ) -> tuple[Any, ...]:
        """The connection broke mid-transaction: find out whether it committed."""
        log.warning("reservation %s: outcome unknown (%r); resolving", token, exc.cause)
        try:
            if exc.thread_id is not None and exc.connected_at is not None:
                age = asyncio.get_running_loop().time() - exc.connected_at
                if not await self.db.wait_thread_gone(exc.thread_id, age, node=exc.node):
                    raise TimeoutError("the server thread did not end in time")
            order = await orders.get(self.db, token)
        except Exception as lookup_exc:
            # Cannot tell yet. This process looks again once the database answers
            # (gate/giveback.py), and the janitor in any case; neither gives units back
            # for a committed order.
            METRICS.unknown_outcomes.labels("deferred").inc()
            log.warning("reservation %s unresolved, resolved later: %r", token, lookup_exc)
            if redis and exc.thread_id is not None and exc.connected_at is not None:
                self.givebacks.add_unresolved(
                    keys,
                    req.user_id,
                    req.idempotency_key,
                    token,
                    exc.thread_id,
                    exc.connected_at,
                    exc.node,
                )
            raise overloaded("Database unavailable; retry shortly.") from None
        if order is None:
            METRICS.unknown_outcomes.labels("rolled_back").inc()
            if redis:
                await self._compensate(keys, req, token)
            raise overloaded("Database connection lost; the reservation was not made.")
        METRICS.unknown_outcomes.labels("committed").inc()
        return (
            int(DbCode.OK),
            order.alloc,
            order.expires_at,
            order.created_at,
            order.unit_price,
            order.currency,
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
