"""The payment worker: everything that talks to the provider after a transition.

Each pass, bounded by `worker_batch_max` per kind:
  * recovery: events left 'late' (their settlement did not run) and refunds left
    'waiting' whose payment is known now;
  * refunds the gate owes: asked of the provider with a stable idempotency key,
    retried with backoff until the provider confirms; a confirmation in the answer
    is applied like the webhook it stands for;
  * authorizations: captured while the order is AUTHORIZED by them and its hold
    has at least `capture_margin_seconds` left (checked by the database's clock in
    the same statement that claims the capture), voided once their order ended
    any other way.
Claims are conditional updates that push `next_*_at` forward, so several gates
can run the worker: only the claimant calls the provider, and a claimant that dies
is replaced when its lease runs out. The provider is never called inside a
transaction.
"""

from __future__ import annotations

import asyncio
import logging

from gate.base.backoff import Backoff
from gate.inventory.mirror import Mirror
from gate.payments import store
from gate.payments.config import PaymentSettings
from gate.payments.late import settle_late
from gate.payments.machine import PaymentMachine
from gate.payments.metrics import REFUND_BACKLOG
from gate.payments.provider import (
    Payment,
    Provider,
    ProviderError,
    ProviderRejected,
    synthetic_payment_event,
    synthetic_refund_event,
)
from gate.store.db import Database

log = logging.getLogger("gate.payments.worker")

# A claimed action's next attempt: 2^attempts seconds (at most 2^20), at least the
# action lease, at most GATE_PAYMENT_BACKOFF_MAX_SECONDS (`PaymentWorker._backoff`).
ACTION_BACKOFF = Backoff(base_seconds=1.0, cap_seconds=2.0**20, jitter=0.0)


def refund_key(provider: str, payment_id: str, generation: int) -> str:
    return f"refund-{provider}-{payment_id}-{generation}"


def capture_key(payment_id: str) -> str:
    return f"capture-{payment_id}"


def void_key(payment_id: str) -> str:
    return f"void-{payment_id}"


class PaymentWorker:
    def __init__(
        self,
        db: Database,
        mirror: Mirror,
        machine: PaymentMachine,
        provider: Provider | None,
        settings: PaymentSettings,
        actor: str,
    ) -> None:
        self.db = db
        self.mirror = mirror
        self.machine = machine
        self.provider = provider
        self.settings = settings
        self.name = settings.provider
        self.actor = actor
        self._wake = asyncio.Event()

    def kick(self) -> None:
        """Run the next pass now (a capture or refund became due)."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            done = 0
            try:
                done = await self.run_once()
            except Exception:
                log.exception("payment worker pass failed")
            if done >= self.settings.worker_batch_max:
                continue
            self._wake.clear()
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
            try:
                await asyncio.wait(
                    waits,
                    timeout=self.settings.worker_interval_seconds,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                for w in waits:
                    w.cancel()

    async def run_once(self) -> int:
        done = await self.recover()
        if self.provider is not None:
            done += await self.refunds(self.provider)
            done += await self.authorizations(self.provider)
        REFUND_BACKLOG.set(await store.refund_backlog(self.db))
        return done

    # -- recovery -----------------------------------------------------------------

    async def recover(self) -> int:
        batch = self.settings.worker_batch_max
        after = self.settings.recovery_after_seconds
        late = await store.late_events(self.db, self.name, after, batch)
        for event_id, order_id in late:
            await settle_late(self.db, self.mirror, self.name, str(event_id), self.actor)
            await self.machine.reprocess_waiting(self.name, str(order_id))
        waiting = await store.waiting_orders(self.db, self.name, after, batch)
        for (order_id,) in waiting:
            await self.machine.reprocess_waiting(self.name, str(order_id))
        return len(late) + len(waiting)

    # -- refunds ------------------------------------------------------------------

    def _backoff(self, attempts: int) -> float:
        return min(
            self.settings.backoff_max_seconds,
            max(self.settings.action_lease_seconds, ACTION_BACKOFF.delay_seconds(attempts + 1)),
        )

    async def refunds(self, provider: Provider) -> int:
        rows = await store.due_refunds(self.db, self.name, self.settings.worker_batch_max)
        done = 0
        for refund_row_id, payment_id, amount, generation, attempts in rows:
            claimed = await store.claim_refund(
                self.db, self._backoff(int(attempts)), refund_row_id, generation
            )
            if claimed != 1:
                continue
            key = refund_key(self.name, str(payment_id), int(generation))
            try:
                refund = await provider.refund(str(payment_id), int(amount), key)
            except ProviderError as exc:
                log.warning("refund of %s: %s; retried later", payment_id, exc)
                await store.refund_error(self.db, str(exc)[:255], refund_row_id)
                continue
            await store.refund_submitted(self.db, refund.refund_id, refund_row_id, generation)
            event = synthetic_refund_event(self.name, refund, "refund")
            if event is not None:
                await self.machine.apply(self.name, event)
            done += 1
        return done

    # -- authorizations -------------------------------------------------------------

    async def authorizations(self, provider: Provider) -> int:
        margin = self.settings.capture_margin_seconds
        rows = await store.due_authorizations(self.db, self.name, self.settings.worker_batch_max)
        done = 0
        for payment_id, amount, attempts, status, order_payment in rows:
            payment_id = str(payment_id)
            lease = self._backoff(int(attempts))
            if status == "AUTHORIZED" and order_payment == payment_id:
                claimed = await store.claim_capture(self.db, lease, self.name, payment_id, margin)
                if claimed != 1:
                    # The hold is too close to its end to capture safely: leave it to
                    # the sweeper, after which the authorization is voided.
                    await self._postpone(payment_id)
                    continue
                await self._act(provider, "capture", payment_id, int(amount))
            elif status == "PENDING_PAYMENT":
                # Authorized after the hold's deadline: void once the order has ended.
                await self._postpone(payment_id)
                continue
            else:
                claimed = await store.claim_void(self.db, lease, self.name, payment_id)
                if claimed != 1:
                    continue
                await self._act(provider, "void", payment_id, int(amount))
            done += 1
        return done

    async def _postpone(self, payment_id: str) -> None:
        await store.postpone_action(self.db, self.name, payment_id)

    async def _act(self, provider: Provider, action: str, payment_id: str, amount: int) -> None:
        payment: Payment | None
        try:
            if action == "capture":
                payment = await provider.capture(payment_id, amount, capture_key(payment_id))
            else:
                payment = await provider.void(payment_id, void_key(payment_id))
        except ProviderRejected as exc:
            # The payment moved on at the provider (captured, voided, expired): learn
            # where it is and apply that.
            log.warning("%s of %s refused: %s", action, payment_id, exc)
            try:
                payment = await provider.get_payment(payment_id)
            except ProviderError:
                payment = None
        except ProviderError as exc:
            log.warning("%s of %s: %s; retried later", action, payment_id, exc)
            await store.action_error(self.db, str(exc)[:255], self.name, payment_id)
            return
        if payment is not None:
            await self.machine.apply(self.name, synthetic_payment_event(self.name, payment, action))
