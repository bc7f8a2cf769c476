"""Provider reconciliation: the provider's books against the gate's.

Callbacks get lost, arrive twice, or never come; an operator refunds by hand; a
provider has a bad day. A pass reads the provider's transaction listing over a time
window (paged, bounded) and the gate's payments, refunds, orders and payment events
over the same window, and handles each divergence:

  paid_not_applied      paid at the provider, pending / expired / cancelled here:
                        applied through the state machine as the callback would have
                        been (late-payment rules included)                -> repaired
  second_payment        another successful payment for an order already paid: the
                        second-payment path refunds it                    -> refunded
  amount_mismatch       amount or currency differs from the order: quarantined, never
                        PAID                                              -> flagged
  unknown_order         a payment naming no order of this gate            -> flagged
  paid_without_payment  PAID here, no successful payment at the provider  -> flagged
  refund_stuck          a refund the gate asked for has not settled: retried through
                        the refund path with its stable key    -> repaired or flagged
  missing_event         any other provider fact the gate never heard of (an
                        authorization, a failure, a settled or declined refund, a
                        refund the gate did not ask for)       -> repaired or flagged
  duplicate_event       one fact recorded under several provider event ids -> reported

Every fact is applied as a synthetic event with the deterministic id the worker uses
for API answers (`api:{payment or refund}:{status}`), so the same fact learnt from a
late callback, the worker or another pass applies once. Flagged and reported findings
write one outbox row each (topic `payment.reconcile_flagged`) under an event id
derived from the finding: the row tells consumers, and its unique key is how the next
pass knows the finding is not new. Nothing is ever un-paid or deleted.

A pass holds a named database lock, so the loops of several gate processes and a
`gate reconcile` command never work at once.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

import orjson
import pymysql

from gate.base.metrics import METRICS
from gate.payments import store
from gate.payments.codes import EventCode
from gate.payments.config import ReconcileSettings
from gate.payments.machine import Applied, PaymentMachine
from gate.payments.provider import (
    Payment,
    Provider,
    ProviderError,
    Refund,
    Transaction,
    synthetic_payment_event,
    synthetic_refund_event,
)
from gate.payments.reconcile_report import Finding, ReconcileUnavailable, Report
from gate.payments.window import attach_order_window
from gate.payments.workers import PaymentWorker
from gate.store.db import Database, errno_of

log = logging.getLogger("gate.payments.reconcile")

SOURCE = "reconcile"
FLAG_TOPIC = "payment.reconcile_flagged"
# Rows per `IN (...)` list: keeps each statement small whatever the window holds.
CHUNK = 500
CLI_LOCK_WAIT_SECONDS = 30
DUPLICATE_KEY = 1062
ID_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"

PAYMENT_FACTS = {
    "succeeded": "payment.succeeded",
    "authorized": "payment.authorized",
    "failed": "payment.failed",
    "voided": "authorization.voided",
}
# How far a payment has come; the gate's row reflects the provider's when it is at
# least as far (a voided authorization never becomes anything else).
PAYMENT_RANK = {"failed": 0, "authorized": 1, "succeeded": 2, "voided": 2}
QUARANTINE_KINDS = {
    "amount_mismatch": "amount_mismatch",
    "currency_mismatch": "amount_mismatch",
    "payment_changed": "amount_mismatch",
    "payment_amount_changed": "amount_mismatch",
    # A known payment named for another order (gate_payment_event_in_tx): flagged like
    # an unknown order.
    "payment_order_changed": "unknown_order",
    "unknown_order": "unknown_order",
    "no_payment_id": "unknown_order",
}

FINDINGS = METRICS.counter(
    "gate_reconcile_findings_total",
    "New reconciliation findings by divergence kind and outcome"
    " (repaired, refunded, refund_scheduled, flagged, reported, deferred).",
    ["kind", "outcome"],
)
RUNS = METRICS.counter(
    "gate_reconcile_runs_total",
    "Reconciliation passes by result (ok, flagged, incomplete, unavailable).",
    ["result"],
)
OPEN = METRICS.gauge(
    "gate_reconcile_open",
    "Flagged reconciliation findings still open after the last pass (need an operator).",
)
LAST_RUN = METRICS.gauge(
    "gate_reconcile_last_run_timestamp_seconds",
    "Unix time at which the last reconciliation pass finished (whatever its result).",
)


def marker_id(provider: str, kind: str, subject: str) -> str:
    """A stable 26-character outbox event id for one finding. It starts with 'R',
    which no ULID does (their first character is at most 7), so it never collides
    with the ids of ordinary outbox rows."""
    digest = hashlib.sha256(f"reconcile:{provider}:{kind}:{subject}".encode()).digest()
    text = base64.b32encode(digest).decode().rstrip("=")
    std = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
    return "R" + "".join(ID_ALPHABET[std.index(c)] for c in text[:25])


def lock_name(scope: str, provider: str) -> str:
    # GET_LOCK names are server-wide and at most 64 characters: the database name
    # keeps gates of different databases on one server apart.
    return "gate_reconcile:" + hashlib.sha256(f"{scope}:{provider}".encode()).hexdigest()[:40]


def chunks(items: Sequence[str]) -> Iterable[Sequence[str]]:
    for i in range(0, len(items), CHUNK):
        yield items[i : i + CHUNK]


@dataclass
class GatePayment:
    status: str
    order_id: str | None


@dataclass
class GateRefund:
    id: int
    status: str
    provider_refund_id: str | None


@dataclass
class KnownEvent:
    type: str
    refund_id: str | None
    outcome: str
    detail: str | None


@dataclass
class Books:
    """What the gate holds for the payments of one listing."""

    payments: dict[str, GatePayment] = field(default_factory=dict)
    refunds: dict[str, GateRefund] = field(default_factory=dict)
    events: dict[str, list[KnownEvent]] = field(default_factory=dict)

    def fact_known(self, payment_id: str, fact: str, refund_id: str | None) -> KnownEvent | None:
        """The recorded event of this fact (a quarantined one first), if any."""
        found = [
            e
            for e in self.events.get(payment_id, [])
            if e.type == fact and (refund_id is None or e.refund_id == refund_id)
        ]
        found.sort(key=lambda e: e.outcome != "quarantined")
        return found[0] if found else None


class Reconciler:
    def __init__(
        self,
        db: Database,
        machine: PaymentMachine,
        worker: PaymentWorker,
        provider: Provider,
        settings: ReconcileSettings,
        lock_scope: str,
    ) -> None:
        self.db = db
        self.machine = machine
        self.worker = worker
        self.provider = provider
        self.settings = settings
        self.name = provider.name
        self.lock = lock_name(lock_scope, self.name)
        # Providers without a listing API (Alipay, WeChat Pay) query the orders of
        # the window one by one: they read which orders from the gate's sessions.
        attach_order_window(provider, db)

    # -- the loop -------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Inside `gate serve`: a pass every interval, the first one interval after
        start-up (a restart of many processes does not hit the provider at once).
        Jittered, so that several processes spread out; the lock lets one of them
        work at a time."""
        while True:
            pause = self.settings.interval_seconds * random.uniform(0.9, 1.1)
            try:
                await asyncio.wait_for(stop.wait(), timeout=pause)
                return
            except TimeoutError:
                pass
            try:
                await self.run_once()
            except Exception:
                log.exception("reconciliation pass failed")

    async def run_once(self, lock_wait_seconds: int = 0) -> Report | None:
        """One pass under the lock; None when another pass holds it."""
        async with self.db.connection() as conn, conn.cursor() as cur:
            if not await store.try_lock(cur, self.lock, lock_wait_seconds):
                return None
            try:
                report = await self._pass()
            finally:
                await store.release_lock(cur, self.lock)
        self._publish(report)
        return report

    def _publish(self, report: Report) -> None:
        report.finished_at = time.time()
        RUNS.labels(report.result).inc()
        OPEN.set(sum(1 for f in report.findings if f.needs_operator))
        LAST_RUN.set(report.finished_at)
        for f in report.findings:
            if not f.new:
                continue
            FINDINGS.labels(f.kind, f.outcome).inc()
            level = logging.WARNING if f.needs_operator else logging.INFO
            log.log(level, "reconciliation finding", extra={"provider": self.name, **asdict(f)})
        summary = report.as_dict()
        log.log(
            logging.WARNING if report.result != "ok" else logging.INFO,
            "reconciliation pass",
            extra={
                "provider": self.name,
                "result": summary["result"],
                "error": report.error,
                "transactions": report.transactions,
                "actions": report.actions,
                "new": summary["new"],
                "open": summary["open"],
            },
        )

    # -- one pass -------------------------------------------------------------------

    async def _pass(self) -> Report:
        report = Report(self.name, self.settings.window_seconds, self.settings.grace_seconds)
        try:
            listing = await self._listing(report)
            await self._provider_payments(report, listing)
            await self._provider_refunds(report, listing)
            await self._paid_without_payment(report, listing)
            await self._stuck_refunds(report, listing)
            await self._duplicates(report)
        except ReconcileUnavailable as exc:
            report.error = str(exc)
        return report

    def _budget(self, report: Report) -> bool:
        """Count one action; False once the pass has used its share."""
        if report.actions >= self.settings.actions_max:
            report.budget_spent = True
            return False
        report.actions += 1
        return True

    async def _listing(self, report: Report) -> list[Transaction]:
        """The provider's transactions of the window, older than the grace period."""
        now = time.time()
        since = int(now - self.settings.window_seconds)
        until = now - self.settings.grace_seconds
        items: list[Transaction] = []
        cursor: str | None = None
        while True:
            if report.pages >= self.settings.pages_max:
                report.complete = False
                break
            try:
                page = await self.provider.transactions(cursor, self.settings.page_size, since)
            except ProviderError as exc:
                raise ReconcileUnavailable(f"transaction listing: {exc}") from exc
            report.pages += 1
            report.transactions += len(page.items)
            # Young ones are left for a later pass. Not a stop: a provider may list
            # newest first (Stripe), so an older transaction can follow a young one.
            items.extend(t for t in page.items if t.created <= until)
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        return items

    async def _books(self, payment_ids: Sequence[str]) -> Books:
        books = Books()
        for part in chunks(sorted(set(payment_ids))):
            rows = await store.payments_of(self.db, self.name, part)
            for pid, status, order_id in rows:
                books.payments[str(pid)] = GatePayment(str(status), order_id)
            rows = await store.refunds_of(self.db, self.name, part)
            for pid, rid, status, provider_refund_id in rows:
                books.refunds[str(pid)] = GateRefund(int(rid), str(status), provider_refund_id)
            rows = await store.events_of(self.db, self.name, part)
            for pid, etype, refund_id, outcome, detail in rows:
                books.events.setdefault(str(pid), []).append(
                    KnownEvent(str(etype), refund_id, str(outcome), detail)
                )
        return books

    async def _order_status(self, order_id: str | None) -> str | None:
        if order_id is None:
            return None
        row = await store.order_status(self.db, order_id)
        return str(row[0]) if row else None

    async def _mark(self, finding: Finding, subject: str) -> Finding:
        """Record a flagged or reported finding once; `new` says whether this pass did."""
        event_id = marker_id(self.name, finding.kind, subject)
        finding.new = False
        if await store.outbox_has(self.db, event_id):
            return finding
        payload = orjson.dumps({"provider": self.name, **asdict(finding), "new": True}).decode()
        aggregate = (finding.order_id or finding.payment_id or subject)[:64]
        try:
            await store.flag_row(self.db, event_id, FLAG_TOPIC, aggregate, payload)
        except pymysql.err.IntegrityError as exc:
            # Another pass recorded it a moment ago (the lock makes this rare).
            if errno_of(exc) != DUPLICATE_KEY:
                raise
            return finding
        finding.new = True
        return finding

    async def _flag(self, report: Report, finding: Finding, subject: str) -> None:
        await self._mark(finding, subject)
        report.findings.append(finding)

    # -- provider payments ----------------------------------------------------------

    async def _provider_payments(self, report: Report, listing: list[Transaction]) -> None:
        payments = [t for t in listing if t.kind == "payment"]
        books = await self._books([t.payment_id for t in payments])
        # What the provider has given back per payment (an operator may have refunded
        # a flagged payment by hand: that resolves it).
        refunded: dict[str, int] = {}
        for t in listing:
            if t.kind == "refund" and t.status == "succeeded":
                refunded[t.payment_id] = refunded.get(t.payment_id, 0) + t.amount
        scheduled: list[Finding] = []
        for t in payments:
            fact = PAYMENT_FACTS.get(t.status)
            if fact is None:
                continue
            mine = books.payments.get(t.id)
            if mine is not None and PAYMENT_RANK[mine.status] >= PAYMENT_RANK[t.status]:
                continue
            base = Finding(
                "missing_event", "repaired", t.order_id, t.id, None, t.amount, t.currency
            )
            known = books.fact_known(t.id, fact, None)
            if known is not None:
                # Recorded already (its callback came): only a quarantine is open, until
                # the money went back at the provider (an operator's resolution).
                if known.outcome == "quarantined" and refunded.get(t.id, 0) < t.amount:
                    kind = QUARANTINE_KINDS.get(known.detail or "", "missing_event")
                    await self._flag(
                        report,
                        replace(base, kind=kind, outcome="flagged", detail=known.detail),
                        t.id,
                    )
                continue
            if mine is None and refunded.get(t.id, 0) >= t.amount > 0:
                continue  # returned at the provider before the gate ever held it
            if not self._budget(report):
                report.findings.append(replace(base, outcome="deferred", detail=fact))
                continue
            before = await self._order_status(t.order_id)
            payment = Payment(t.id, t.order_id, t.amount, t.currency, t.status)
            applied = await self.machine.apply(
                self.name, synthetic_payment_event(self.name, payment, SOURCE)
            )
            finding = await self._classify(report, base, applied, t, before)
            if finding is not None and finding.outcome == "refund_scheduled":
                scheduled.append(finding)
        if scheduled:
            await self._refund_now(scheduled)
            report.scheduled.update(str(f.payment_id) for f in scheduled)

    async def _classify(
        self, report: Report, base: Finding, applied: Applied, t: Transaction, before: str | None
    ) -> Finding | None:
        if applied.code == EventCode.DUPLICATE:
            return None  # applied meanwhile by a callback or another pass
        if applied.code == EventCode.QUARANTINED:
            kind = QUARANTINE_KINDS.get(applied.detail or "", "missing_event")
            finding = replace(base, kind=kind, outcome="flagged", detail=applied.detail)
            await self._flag(report, finding, t.id)
            return finding
        after = await self._order_status(t.order_id)
        transition = f"{before} -> {after}"
        # Whether the money goes back says which path the payment took: the
        # second-payment path, or a late payment the deal had no units left for.
        refund = await store.refund_reason(self.db, self.name, t.id)
        if t.status != "succeeded" or applied.code == EventCode.IGNORED:
            finding = replace(base, detail=f"{PAYMENT_FACTS[t.status]}: {transition}")
        elif refund is not None and refund[0] == "second_payment":
            finding = replace(base, kind="second_payment", outcome="refund_scheduled")
        elif refund is not None:
            finding = replace(
                base, kind="paid_not_applied", outcome="refund_scheduled", detail=transition
            )
        else:
            late = "late, stock re-taken: " if applied.code == EventCode.LATE else ""
            finding = replace(base, kind="paid_not_applied", detail=f"{late}{transition}")
        report.findings.append(finding)
        return finding

    async def _retry(self, payment_ids: Sequence[str]) -> None:
        """Ask the provider for these payments' refunds now, through the worker's
        refund path: the current generation's idempotency key, so a refund the
        provider already has comes back as it is and is never made twice."""
        for part in chunks(payment_ids):
            await store.refunds_due_now(self.db, self.name, part)
        await self.worker.refunds(self.provider)

    async def _refund_now(self, scheduled: list[Finding]) -> None:
        """Refunds the pass just caused go out now; the worker finishes any that do
        not settle."""
        await self._retry([str(f.payment_id) for f in scheduled])
        for finding in scheduled:
            row = await store.refund_status(self.db, self.name, finding.payment_id)
            if row and row[0] == "succeeded":
                finding.outcome = "refunded"

    # -- provider refunds -----------------------------------------------------------

    async def _provider_refunds(self, report: Report, listing: list[Transaction]) -> None:
        refunds = [t for t in listing if t.kind == "refund" and t.status != "pending"]
        if not refunds:
            return
        books = await self._books([t.payment_id for t in refunds])
        declined: list[str] = []
        for t in refunds:
            fact = f"refund.{t.status}"
            base = Finding(
                "missing_event", "repaired", t.order_id, t.payment_id, t.id, t.amount, t.currency
            )
            known = books.fact_known(t.payment_id, fact, t.id)
            if known is not None:
                if known.outcome == "quarantined":
                    await self._flag(
                        report, replace(base, outcome="flagged", detail=known.detail), t.id
                    )
                continue
            mine = books.refunds.get(t.payment_id)
            ours = mine is not None and mine.provider_refund_id in (None, t.id)
            if mine is not None and mine.status == "succeeded" and mine.provider_refund_id == t.id:
                continue
            if t.status == "failed" and not (ours and mine and mine.status != "succeeded"):
                continue  # an earlier generation, or a declined refund that moved nothing
            payment = books.payments.get(t.payment_id)
            if payment is None or payment.status != "succeeded":
                continue  # money back on a payment the gate never took: nothing to undo
            if not self._budget(report):
                report.findings.append(replace(base, outcome="deferred", detail=fact))
                continue
            refund = Refund(t.id, t.payment_id, t.order_id, t.amount, t.currency, t.status)
            event = synthetic_refund_event(self.name, refund, SOURCE)
            assert event is not None, "settled refunds only"
            applied = await self.machine.apply(self.name, event)
            if applied.code == EventCode.DUPLICATE:
                continue
            if applied.code == EventCode.QUARANTINED:
                await self._flag(
                    report, replace(base, outcome="flagged", detail=applied.detail), t.id
                )
            elif applied.code == EventCode.WAITING:
                report.findings.append(replace(base, outcome="deferred", detail="waiting"))
            else:
                if t.status == "failed":
                    declined.append(t.payment_id)
                report.findings.append(replace(base, detail=f"{fact}: {applied.detail}"))
        if declined:
            # A declined refund moved to its next generation: ask again now.
            await self._retry(declined)

    # -- PAID here, nothing at the provider ------------------------------------------

    async def _paid_without_payment(self, report: Report, listing: list[Transaction]) -> None:
        captured = {t.id for t in listing if t.kind == "payment" and t.status == "succeeded"}
        listed = {t.id: t.status for t in listing if t.kind == "payment"}
        # Every way to PAID goes through an applied payment.succeeded (a callback, an
        # API answer, a late settlement): its event row is the index into the window.
        rows = await store.paid_in_window(
            self.db,
            self.name,
            self.settings.window_seconds,
            self.settings.grace_seconds,
            self.settings.pages_max * self.settings.page_size,
        )
        for order_id, payment_id, paid, currency in rows:
            report.paid_checked += 1
            pid = str(payment_id)
            if pid in captured:
                continue
            status = listed.get(pid)
            if status is None:
                # Created before the window (an old authorization captured lately):
                # ask for it directly.
                if not self._budget(report):
                    report.findings.append(
                        Finding(
                            "paid_without_payment",
                            "deferred",
                            str(order_id),
                            pid,
                            None,
                            int(paid),
                            currency,
                            "not looked up: the pass's action budget is spent",
                        )
                    )
                    continue
                try:
                    found = await self.provider.get_payment(pid)
                except ProviderError as exc:
                    raise ReconcileUnavailable(f"payment {pid}: {exc}") from exc
                status = found.status if found is not None else None
                if status == "succeeded":
                    continue
            detail = "unknown at the provider" if status is None else f"provider says {status}"
            finding = Finding(
                "paid_without_payment",
                "flagged",
                str(order_id),
                pid,
                None,
                int(paid),
                currency,
                detail,
            )
            await self._flag(report, finding, f"{order_id}:{pid}")

    # -- refunds that do not settle ----------------------------------------------------

    async def _stuck_refunds(self, report: Report, listing: list[Transaction]) -> None:
        at_provider = {t.id: t.status for t in listing if t.kind == "refund"}
        rows = await store.stuck_refunds(
            self.db,
            self.name,
            self.settings.refund_stuck_seconds,
            # One more than the budget allows: whether any is left over.
            max(0, self.settings.actions_max - report.actions) + 1,
        )
        rows = [r for r in rows if str(r[1]) not in report.scheduled]
        room = max(0, self.settings.actions_max - report.actions)
        if len(rows) > room:
            report.budget_spent = True
            rows = rows[:room]
        if not rows:
            return
        report.refunds_checked += len(rows)
        report.actions += len(rows)
        ids = [int(r[0]) for r in rows]
        await self._retry([str(r[1]) for r in rows])
        after = {int(r[0]): r[1:] for r in await store.refunds_by_id(self.db, ids)}
        for rid, payment_id, order_id, amount, currency, generation in rows:
            status, gen_now, provider_refund_id, last_error = after[int(rid)]
            finding = Finding(
                "refund_stuck",
                "repaired",
                order_id,
                str(payment_id),
                provider_refund_id,
                int(amount),
                currency,
            )
            if status == "succeeded":
                finding.detail = "settled on retry"
                report.findings.append(finding)
                continue
            where = at_provider.get(str(provider_refund_id)) if provider_refund_id else None
            if where is not None:
                finding.detail = f"{where} at the provider after retry (generation {gen_now})"
            else:
                finding.detail = f"not accepted by the provider: {last_error or 'no answer'}"
            finding.outcome = "flagged"
            await self._flag(report, finding, f"{payment_id}:{generation}")

    # -- one fact under several event ids -------------------------------------------------

    async def _duplicates(self, report: Report) -> None:
        rows = await store.duplicate_events(
            self.db,
            self.name,
            self.settings.window_seconds,
            self.settings.grace_seconds,
            self.settings.actions_max,
        )
        seen: set[tuple[str, str, str]] = set()
        for order_id, payment_id, etype, refund_id, amount, currency in rows:
            key = (str(payment_id), str(etype), str(refund_id or ""))
            if key in seen:
                continue
            seen.add(key)
            finding = Finding(
                "duplicate_event",
                "reported",
                order_id,
                str(payment_id),
                refund_id,
                None if amount is None else int(amount),
                currency,
                f"{etype} recorded under several event ids; applied once",
            )
            await self._mark(finding, ":".join(key))
            if finding.new:
                report.findings.append(finding)
