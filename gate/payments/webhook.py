"""POST /v1/payments/{provider}/webhook.

Order of work, each step bounded: read at most `webhook_body_max_bytes`; verify the
signature on the raw bytes (401, nothing recorded); parse (400); record and apply
the event in one transaction (the 2xx is sent only after it committed); then the
follow-ups a late payment or a waiting refund needs. A follow-up that fails leaves
its event recorded as 'late' or 'waiting' for the recovery loop, and the answer is
still 2xx: the event is durable, and a redelivery would change nothing.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gate.errors import Problem, invalid, not_found
from gate.http import json_response
from gate.payments.codes import METRIC_OUTCOME, EventCode
from gate.payments.machine import GroupCommitter, PaymentMachine
from gate.payments.metrics import CALLBACK_DELAY, CALLBACKS
from gate.payments.provider import EventInvalid, parse_event
from gate.payments.signing import WebhookRejected, verify

log = logging.getLogger("gate.payments.webhook")

HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")
# The raw (lower-case, as ASGI servers give them) names this endpoint reads, found in
# one pass over the request's header list instead of one scan per name.
_WANTED = {name.encode(): name for name in (*HEADERS, "content-length")}
_OUTCOMES = ("applied", "duplicate", "ignored", "quarantined", "rejected")


def _headers(request: Request) -> dict[str, str]:
    found: dict[str, str] = {}
    for raw_name, raw_value in request.scope["headers"]:
        name = _WANTED.get(raw_name.lower())
        if name is not None and name not in found:
            found[name] = raw_value.decode("latin-1")
    return found


def _answer(outcome: str) -> Response:
    # The few bodies this endpoint sends, serialised once.
    return Response(_BODIES[outcome], media_type="application/json")


_BODIES = {
    outcome: orjson.dumps({"received": True, "outcome": outcome})
    for outcome in ("applied", "duplicate", "ignored", "quarantined", "late", "waiting")
}


class RecentEvents:
    """Event ids this process saw committed, so a redelivery is answered without a
    database round trip. Bounded; losing it only costs that round trip."""

    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self._seen: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, event_id: object) -> bool:
        return event_id in self._seen

    def add(self, event_id: str) -> None:
        if self.max_items <= 0:
            return
        self._seen[event_id] = None
        if len(self._seen) > self.max_items:
            for _ in range(max(1, self.max_items // 8)):
                self._seen.popitem(last=False)


class WebhookEndpoint:
    def __init__(
        self,
        provider: str,
        keys: Sequence[bytes],
        machine: PaymentMachine,
        body_max_bytes: int,
        dedup_max: int,
        kick: Callable[[], None],
    ) -> None:
        self.provider = provider
        self.keys = tuple(keys)
        self.machine = machine
        self.body_max_bytes = body_max_bytes
        self.recent = RecentEvents(dedup_max)
        self.groups = GroupCommitter(machine, provider)
        self.kick = kick
        # Labelled children looked up once: a lookup per callback showed in profiles.
        self.counted = {outcome: CALLBACKS.labels(provider, outcome) for outcome in _OUTCOMES}

    def _reject(self, problem: Problem) -> Problem:
        self.counted["rejected"].inc()
        return problem

    async def _read(self, request: Request, length: str | None) -> bytes:
        if length is not None and (not length.isdigit() or int(length) > self.body_max_bytes):
            raise self._reject(
                Problem("PAYLOAD_TOO_LARGE", f"At most {self.body_max_bytes} bytes.")
            )
        body = bytearray()
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > self.body_max_bytes:
                raise self._reject(
                    Problem("PAYLOAD_TOO_LARGE", f"At most {self.body_max_bytes} bytes.")
                )
        return bytes(body)

    async def handle(self, request: Request) -> Response:
        if request.path_params["provider"] != self.provider:
            raise not_found("payment provider")
        headers = _headers(request)
        body = await self._read(request, headers.get("content-length"))
        now = time.time()
        try:
            verify(self.keys, headers, body, now)
        except WebhookRejected as exc:
            raise self._reject(Problem("UNAUTHORIZED", f"Webhook rejected: {exc}.")) from None
        try:
            event = parse_event(body)
        except EventInvalid as exc:
            raise self._reject(invalid(f"Unreadable event: {exc}.")) from None
        if event.event_id in self.recent:
            self.counted["duplicate"].inc()
            return _answer("duplicate")
        if event.created is not None:
            CALLBACK_DELAY.observe(max(0.0, now - event.created))
        applied = await self.groups.submit(event)
        self.recent.add(event.event_id)
        self.counted[METRIC_OUTCOME[applied.code]].inc()
        if applied.code == EventCode.LATE or applied.waiting:
            try:
                await self.machine.follow_up(self.provider, event.order_id, event.event_id, applied)
            except Exception:
                log.exception("event %s: follow-up deferred to the recovery loop", event.event_id)
        if applied.code in (EventCode.APPLIED, EventCode.LATE):
            # Captures, voids and refunds are the worker's, out of this request's path.
            self.kick()
        if applied.outcome in _BODIES:
            return _answer(applied.outcome)
        return json_response({"received": True, "outcome": applied.outcome})
