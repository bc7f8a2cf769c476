"""The sandbox's adapter: Standard Webhooks callbacks, the contract's JSON events.

    POST /v1/payments/sandbox/webhook
      webhook-id / webhook-timestamp / webhook-signature  (signing.verify, ±300 s,
      any of GATE_WEBHOOK_SECRET's keys)  ->  provider.parse_event(body)
      answered {"received": true, "outcome": ...} once recorded

Its API (http_provider.SandboxProvider) is called only when GATE_PAYMENT_PROVIDER_URL
is set; without it the gate still takes callbacks and payments answer 503.
"""

from __future__ import annotations

from collections.abc import Mapping

from gate.base.errors import Encoded
from gate.payments.adapters import Adapter, AdapterContext
from gate.payments.provider import ProviderEvent, parse_event
from gate.payments.providers.http import SandboxProvider
from gate.payments.signing import HEADERS, decode_secrets, verify
from gate.web.http_io import json_answer

OUTCOMES = ("applied", "duplicate", "ignored", "quarantined", "late", "waiting")


def json_acknowledgements() -> dict[str, Encoded]:
    """{"received": true, "outcome": ...} per outcome, encoded once."""
    return {o: json_answer({"received": True, "outcome": o}) for o in OUTCOMES}


class StandardWebhook:
    header_names: tuple[str, ...] = HEADERS

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = keys
        self._answers = json_acknowledgements()

    def parse(self, headers: Mapping[str, str], body: bytes, now: float) -> ProviderEvent:
        verify(self.keys, headers, body, now)
        return parse_event(body)

    def acknowledge(self, outcome: str) -> Encoded:
        # The header list is copied: the request middleware appends its X-Request-Id.
        status, headers, body = self._answers.get(outcome) or json_answer(
            {"received": True, "outcome": outcome}
        )
        return status, list(headers), body


def build(context: AdapterContext) -> Adapter:
    keys = decode_secrets(context.webhook_secrets)
    payment = context.payment
    provider = SandboxProvider(payment, keys) if payment.provider_url else None
    return Adapter(name=context.name, webhook=StandardWebhook(keys), provider=provider)
