"""The delivery loop: every `gate serve` process sends, sharing the work through the
database's claims.

    run() ──> run_once() again and again:
      1. record what finished (one transaction for the batch: attempts, states,
         endpoint health) ── an endpoint that answered 410 is disabled
      2. the enabled endpoints (their secrets opened once, cached)
      3. free slots: per endpoint min(GATE_WEBHOOK_ENDPOINT_CONCURRENCY, a fair share of
         GATE_WEBHOOK_CONCURRENCY), minus its attempts in flight here
      4. claim that many due deliveries per endpoint (FOR UPDATE SKIP LOCKED; each
         claimed for the timeout + 5 s under a token of this pass)
      5. one task per claimed delivery: Sender.deliver ──> Outcome ──> decided:
           2xx ────────────────> delivered
           410 ────────────────> the endpoint disabled; the delivery waits for it
           anything else ──────> the next step of GATE_WEBHOOK_RETRY_SCHEDULE
                                 (jittered; Retry-After honoured up to the step), or
                                 failed after the last
    The loop waits for an attempt to finish, a kick (the fan-out made deliveries in
    this process) or GATE_WEBHOOK_INTERVAL_SECONDS.

A slow or dead endpoint holds at most its own slots (each attempt bounded by the
timeout); the others' slots and the database are never held for it: no connection
or lock is kept across an HTTP call. A process killed mid-attempt leaves claims that
lapse: the deliveries are sent again (at least once), the lost attempt recorded as
interrupted.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from datetime import UTC, datetime

from gate.webhooks.config import WebhookSettings
from gate.webhooks.metrics import ATTEMPT_SECONDS, ATTEMPTS, DELIVERY_LAG, DISABLED, FAILED
from gate.webhooks.model import Claimed, Endpoint, Recorded
from gate.webhooks.sender import Outcome, Sender
from gate.webhooks.store import WebhookStore
from gate.webhooks.vault import NoKey, Vault, VaultError

log = logging.getLogger("gate.webhooks")

# Finished attempts kept for recording while the database is unreachable (their
# claims lapse and they are sent again anyway: the bound only limits memory).
RESULTS_MAX = 10_000
# On stop, how long attempts in flight may still take.
STOP_GRACE_SECONDS = 2.0
# After an attempt finishes, the loop waits this long for others before recording.
GATHER_SECONDS = 0.005


class KeyCache:
    """Each endpoint's HMAC keys, opened from their sealed form once per change."""

    def __init__(self, vault: Vault) -> None:
        self.vault = vault
        self._keys: dict[str, tuple[tuple[str, str | None, bool], tuple[bytes, ...]]] = {}

    def keys(self, endpoint: Endpoint) -> tuple[bytes, ...]:
        version = (endpoint.secret, endpoint.previous_secret, endpoint.previous_active)
        hit = self._keys.get(endpoint.id)
        if hit is not None and hit[0] == version:
            return hit[1]
        keys = [self.vault.signing_key(endpoint.id, endpoint.secret)]
        if endpoint.previous_active and endpoint.previous_secret:
            keys.append(self.vault.signing_key(endpoint.id, endpoint.previous_secret))
        if len(self._keys) > 4096:
            self._keys.clear()
        self._keys[endpoint.id] = (version, tuple(keys))
        return tuple(keys)


class Dispatcher:
    def __init__(
        self, store: WebhookStore, sender: Sender, vault: Vault, settings: WebhookSettings
    ) -> None:
        self.store = store
        self.sender = sender
        self.settings = settings
        self.keys = KeyCache(vault)
        self.in_flight: dict[str, int] = {}
        self.finished: list[Recorded] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._unsigned_logged: set[str] = set()
        # Endpoints whose last claim came back full: more is likely waiting.
        self._full: set[str] = set()

    def kick(self) -> None:
        self._wake.set()

    @property
    def busy(self) -> int:
        return sum(self.in_flight.values())

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                claimed = 0
                try:
                    claimed = await self.run_once()
                except Exception:
                    log.exception("webhook delivery pass failed")
                if claimed and self.busy < self.settings.concurrency:
                    # More may be due: claim again at once.
                    await asyncio.sleep(0)
                    continue
                await self._pause(stop)
        finally:
            await self._drain()

    async def _pause(self, stop: asyncio.Event) -> None:
        self._wake.clear()
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(
                waits, timeout=self.settings.interval_seconds, return_when="FIRST_COMPLETED"
            )
        finally:
            for w in waits:
                w.cancel()
        if self._wake.is_set() and not stop.is_set():
            await asyncio.sleep(GATHER_SECONDS)

    async def _drain(self) -> None:
        """On stop: attempts in flight get STOP_GRACE_SECONDS to finish and be recorded
        (a stopping gate must not wait a slow receiver's full timeout); the rest are
        cancelled, and sent again once their claims lapse."""
        if self._tasks:
            grace = min(self.settings.timeout_seconds, STOP_GRACE_SECONDS)
            _, late = await asyncio.wait(set(self._tasks), timeout=grace)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        try:
            await self._record()
        except Exception as exc:
            log.warning("webhook outcomes not recorded on stop (%r); they are sent again", exc)
        await self.sender.close()

    async def run_once(self) -> int:
        """Record what finished, claim and start what is due; the number claimed."""
        await self._record()
        endpoints = {e.id: e for e in await self.store.endpoints(enabled_only=True)}
        if not endpoints:
            return 0
        wants = self._free_slots(list(endpoints))
        if not wants:
            return 0
        token = secrets.token_hex(8)
        claimed, lapsed = await self.store.claim(wants, self.settings.claim_seconds, token)
        got: dict[str, int] = {}
        for c in claimed:
            got[c.endpoint_id] = got.get(c.endpoint_id, 0) + 1
        self._full = {e for e, n in wants.items() if got.get(e, 0) >= n}
        if lapsed:
            log.info("webhooks: %d deliveries sent again after their sender stopped", len(lapsed))
        for c in claimed:
            self.in_flight[c.endpoint_id] = self.in_flight.get(c.endpoint_id, 0) + 1
            task = asyncio.get_running_loop().create_task(
                self._attempt(c, endpoints[c.endpoint_id])
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return len(claimed)

    def _free_slots(self, endpoint_ids: list[str]) -> dict[str, int]:
        """Slots to claim per endpoint. The total is shared evenly among the endpoints
        with work (in flight here, or whose last claim came back full), so a dead
        endpoint cannot take every slot and a busy one is not held to a share of
        endpoints that have nothing to send; each of those is asked for one."""
        total_free = self.settings.concurrency - self.busy
        if total_free <= 0:
            return {}
        busy = [e for e in endpoint_ids if e in self.in_flight or e in self._full]
        share = max(1, self.settings.concurrency // max(1, len(busy)))
        cap = min(self.settings.endpoint_concurrency, share)
        wants: dict[str, int] = {}
        for endpoint_id in endpoint_ids:
            # One slot for an endpoint that had nothing last time: found full, it
            # counts among the busy ones from the next pass on.
            room = cap - self.in_flight.get(endpoint_id, 0) if endpoint_id in busy else 1
            free = min(room, total_free)
            if free > 0:
                wants[endpoint_id] = free
                total_free -= free
            if total_free <= 0:
                break
        return wants

    async def _attempt(self, claimed: Claimed, endpoint: Endpoint) -> None:
        try:
            try:
                keys = self.keys.keys(endpoint)
            except (VaultError, NoKey) as exc:
                outcome = _unsigned(exc)
                if endpoint.id not in self._unsigned_logged:
                    self._unsigned_logged.add(endpoint.id)
                    log.error("webhook endpoint %s cannot be signed for: %s", endpoint.id, exc)
            else:
                outcome = await self.sender.deliver(
                    endpoint.url, claimed.event_id, claimed.body, keys
                )
            ATTEMPTS.labels(outcome.kind).inc()
            ATTEMPT_SECONDS.observe(outcome.duration_ms / 1000)
            if len(self.finished) < RESULTS_MAX:
                self.finished.append(self.decide(claimed, outcome))
        except Exception:
            log.exception("webhook attempt of delivery %s failed", claimed.delivery_id)
        finally:
            left = self.in_flight.get(claimed.endpoint_id, 1) - 1
            if left > 0:
                self.in_flight[claimed.endpoint_id] = left
            else:
                self.in_flight.pop(claimed.endpoint_id, None)
            self._wake.set()

    def decide(self, claimed: Claimed, outcome: Outcome) -> Recorded:
        def recorded(state: str, delay_seconds: float = 0.0) -> Recorded:
            return Recorded(
                claimed,
                outcome.started_at,
                outcome.duration_ms,
                outcome.http_status,
                outcome.error,
                state,
                delay_seconds,
                gone=outcome.kind == "gone",
            )

        if outcome.delivered:
            lag = time.time() - claimed.event_created_at.replace(tzinfo=UTC).timestamp()
            DELIVERY_LAG.observe(max(0.0, lag))
            return recorded("delivered")
        delay = self.settings.schedule.delay_seconds(claimed.attempt, outcome.retry_after_seconds)
        if delay is None:
            FAILED.inc()
            return recorded("failed")
        return recorded("retry", delay)

    async def _record(self) -> None:
        if not self.finished:
            return
        batch, self.finished = self.finished, []
        try:
            gone = await self.store.db.retrying(lambda: self.store.record(batch))
        except Exception:
            # Kept for the next pass (bounded); their claims may lapse meanwhile.
            self.finished = (batch + self.finished)[:RESULTS_MAX]
            raise
        for endpoint_id in gone:
            DISABLED.labels("gone").inc()
            log.warning("webhook endpoint %s answered 410 Gone: disabled", endpoint_id)


def _unsigned(exc: Exception) -> Outcome:
    reason = str(exc) if isinstance(exc, VaultError) else "GATE_WEBHOOK_ENCRYPTION_KEY is not set"
    now = datetime.now(UTC).replace(tzinfo=None)
    return Outcome(now, 0, None, f"not sent: {reason}", None, "error")
