"""POST /v1/payments/{provider}/webhook.

Order of work, each step bounded: read at most `webhook_body_max_bytes`; the
provider's adapter (gate/payments/adapters.py) verifies the raw bytes (401, nothing
recorded) and reads them into the gate's event (400); an adapter whose events need a
fact the webhook does not carry completes them (Alipay: a refund's own amount, asked
of its API; no answer is a 503 and the provider redelivers); record and apply the
event in one transaction; only then the adapter's own acknowledgement (JSON, Alipay's plain
`success`, ...); then the follow-ups a late payment or a waiting refund needs. A
follow-up that fails leaves its event recorded as 'late' or 'waiting' for the
recovery loop, and the answer is still 2xx: the event is durable, and a redelivery
would change nothing. A {provider} other than the configured one is 404.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from starlette.types import Receive, Scope, Send

from gate.base import tracing
from gate.base.errors import Encoded, Problem, invalid, not_found, overloaded
from gate.base.validate import digits
from gate.payments.adapters import WebhookVerifier, verifier_completion
from gate.payments.codes import METRIC_OUTCOME, EventCode
from gate.payments.machine import GroupCommitter, PaymentMachine
from gate.payments.metrics import CALLBACK_DELAY, CALLBACKS
from gate.payments.provider import EventInvalid, ProviderError
from gate.payments.signing import WebhookRejected
from gate.store.db import DbUnavailable
from gate.web.http_io import send_answer

log = logging.getLogger("gate.payments.webhook")

_OUTCOMES = ("applied", "duplicate", "ignored", "quarantined", "rejected")


def _headers(scope: Scope, wanted: dict[bytes, str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for raw_name, raw_value in scope["headers"]:
        name = wanted.get(raw_name.lower())
        if name is not None and name not in found:
            found[name] = raw_value.decode("latin-1")
    return found


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
    """The endpoint as a plain ASGI application, handed its requests by the app's
    fast lane (gate/api/app.py) past Starlette's exception middleware and router: the
    headers read in one pass, the body straight from `receive`, every answer sent
    from its encoding. Callbacks are the second hottest path of a sale."""

    def __init__(
        self,
        provider: str,
        verifier: WebhookVerifier,
        machine: PaymentMachine,
        body_max_bytes: int,
        dedup_max: int,
        kick: Callable[[], None],
    ) -> None:
        self.provider = provider
        self.verifier = verifier
        # The raw (lower-case, as ASGI servers give them) names this endpoint reads,
        # found in one pass over the request's header list instead of one per name.
        self.wanted = {
            name.lower().encode(): name.lower()
            for name in (*verifier.header_names, "content-length")
        }
        self.machine = machine
        self.body_max_bytes = body_max_bytes
        self.recent = RecentEvents(dedup_max)
        self.complete = verifier_completion(verifier)
        self.groups = GroupCommitter(machine, provider)
        self.kick = kick
        self.span_attributes = {"gate.payment.provider": provider}
        # Labelled children looked up once: a lookup per callback showed in profiles.
        self.counted = {outcome: CALLBACKS.labels(provider, outcome) for outcome in _OUTCOMES}

    def _reject(self, problem: Problem) -> Problem:
        self.counted["rejected"].inc()
        return problem

    async def _read(self, receive: Receive, length: str | None) -> bytes:
        if length is not None and digits(length, self.body_max_bytes) is None:
            raise self._reject(
                Problem("PAYLOAD_TOO_LARGE", f"At most {self.body_max_bytes} bytes.")
            )
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise self._reject(invalid("The client went away before sending the body."))
            body.extend(message.get("body", b""))
            if len(body) > self.body_max_bytes:
                raise self._reject(
                    Problem("PAYLOAD_TOO_LARGE", f"At most {self.body_max_bytes} bytes.")
                )
            if not message.get("more_body", False):
                return bytes(body)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            # Traced: the callback's processing, a span under the request's.
            with tracing.span("payment callback", attributes=self.span_attributes):
                answer = await self.handle(scope, receive)
        except Problem as problem:
            answer = problem.encoded(scope["path"])
        except DbUnavailable:
            answer = overloaded("Database unavailable; retry shortly.").encoded(scope["path"])
        await send_answer(send, answer)

    async def handle(self, scope: Scope, receive: Receive) -> Encoded:
        if scope["path_params"]["provider"] != self.provider:
            raise not_found("payment provider")
        headers = _headers(scope, self.wanted)
        body = await self._read(receive, headers.get("content-length"))
        now = time.time()
        try:
            event = self.verifier.parse(headers, body, now)
        except WebhookRejected as exc:
            raise self._reject(Problem("UNAUTHORIZED", f"Webhook rejected: {exc}.")) from None
        except EventInvalid as exc:
            raise self._reject(invalid(f"Unreadable event: {exc}.")) from None
        if event.event_id in self.recent:
            self.counted["duplicate"].inc()
            return self.verifier.acknowledge("duplicate")
        if self.complete is not None:
            try:
                event = await self.complete(event)
            except ProviderError as exc:
                # The provider redelivers; the reason stays in the log, not the answer.
                log.warning("event %s: not completed by the provider: %s", event.event_id, exc)
                raise overloaded("The provider did not confirm the event; retry later.") from None
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
        return self.verifier.acknowledge(applied.outcome)
