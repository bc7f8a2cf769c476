"""Payment provider adapters: which provider the gate talks to is configuration.

    GATE_PAYMENT_PROVIDER=stripe
        |
        v
    load_adapter(env, ...) --import--> gate.payments.providers.stripe.build(context)
        |                                 reads and checks its GATE_STRIPE_* settings
        |                                 (SettingsError naming the variable: exit 2)
        v
    Adapter(name, webhook, provider)
        |            |          `-- Provider (provider.py): sessions, capture, void,
        |            |              refund, transactions (reconciliation); None when the
        |            |              adapter has no API to call (the sandbox without a URL)
        |            `-- WebhookVerifier: raw request -> ProviderEvent, and the adapter's
        |                own acknowledgement once the event is durably recorded
        `-- the provider name: the webhook path's {provider} and the rows' `provider`

An adapter module exposes `build(context: AdapterContext) -> Adapter`. The registry
below names the module of each provider; a provider whose module is absent from this
build is refused at start-up like a bad setting. See docs/payments.md ("Providers").
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gate.base.errors import Encoded
from gate.base.settings import Secret, SettingsError
from gate.payments.config import PROVIDER_NAMES, SANDBOX_LABEL_RE, PaymentSettings
from gate.payments.provider import Provider, ProviderEvent

# Provider name -> the module that builds its adapter.
ADAPTER_MODULES = {
    "sandbox": "gate.payments.providers.sandbox",
    "stripe": "gate.payments.providers.stripe",
    "alipay": "gate.payments.providers.alipay",
    "wechatpay": "gate.payments.providers.wechatpay",
}
assert tuple(ADAPTER_MODULES) == PROVIDER_NAMES
# The request headers any adapter may read, at most this many (lower-case).
WEBHOOK_HEADERS_MAX = 16


class WebhookVerifier(Protocol):
    """Turns one raw webhook request into the gate's event and answers it.

    `parse` verifies before it reads: it raises signing.WebhookRejected (answered
    401 problem+json, nothing recorded) for a request the provider did not send or
    that is stale, provider.EventInvalid (400, nothing recorded) for a verified body
    the adapter cannot read. Facts that disagree with the order (amount, currency,
    merchant) are not refused here: the event is recorded and quarantined.
    """

    # The lower-case request headers `parse` is given (the endpoint reads only these).
    header_names: tuple[str, ...]

    def parse(self, headers: Mapping[str, str], body: bytes, now: float) -> ProviderEvent: ...

    def acknowledge(self, outcome: str) -> Encoded:
        """The 2xx answer, sent only after the event was committed. `outcome` is one of
        applied, duplicate, ignored, quarantined, late, waiting."""
        ...


# An adapter's optional second step, `async complete(event) -> event`: fills in
# from the provider's API a fact its webhook does not carry, after verification and
# before the event is recorded (provider.ProviderError: not recorded, answered 503
# so the provider redelivers).
Completion = Callable[[ProviderEvent], Awaitable[ProviderEvent]]


def verifier_completion(verifier: WebhookVerifier) -> Completion | None:
    complete = getattr(verifier, "complete", None)
    return complete if callable(complete) else None


@dataclass(frozen=True)
class AdapterContext:
    """What an adapter may read to build itself."""

    name: str  # the configured provider name (GATE_PAYMENT_PROVIDER)
    env: Mapping[str, str]
    payment: PaymentSettings  # timeouts, retries, callback and return URLs
    is_dev: bool
    # GATE_WEBHOOK_SECRET's entries: the sandbox's (Standard Webhooks) keys.
    webhook_secrets: tuple[Secret, ...]


@dataclass(frozen=True)
class Adapter:
    name: str
    webhook: WebhookVerifier
    # The provider's API; None: not configured, payments answer 503 and wait.
    provider: Provider | None

    def __post_init__(self) -> None:
        if len(self.webhook.header_names) > WEBHOOK_HEADERS_MAX:
            raise ValueError("an adapter reads at most 16 webhook headers")


class AdapterBuilder(Protocol):
    def __call__(self, context: AdapterContext) -> Adapter: ...


def adapter_module(name: str) -> str:
    """The module of provider `name`; SettingsError for a name no adapter has."""
    if SANDBOX_LABEL_RE.fullmatch(name):
        return ADAPTER_MODULES["sandbox"]
    module = ADAPTER_MODULES.get(name)
    if module is None:
        raise SettingsError(
            f"GATE_PAYMENT_PROVIDER must be one of {', '.join(PROVIDER_NAMES)}, got {name!r}"
        )
    return module


def load_adapter(
    env: Mapping[str, str],
    payment: PaymentSettings,
    *,
    is_dev: bool,
    webhook_secrets: tuple[Secret, ...],
) -> Adapter:
    """The configured provider's adapter, its settings checked (no I/O)."""
    module_name = adapter_module(payment.provider)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise SettingsError(
            f"GATE_PAYMENT_PROVIDER={payment.provider}: this build has no such adapter"
        ) from None
    build: AdapterBuilder = module.build
    return build(
        AdapterContext(
            name=payment.provider,
            env=env,
            payment=payment,
            is_dev=is_dev,
            webhook_secrets=webhook_secrets,
        )
    )


def require(env: Mapping[str, str], name: str, provider: str) -> str:
    """A setting the provider cannot run without (stripped), or SettingsError naming it."""
    value = env.get(name, "").strip()
    if not value:
        raise SettingsError(f"{name} is required with GATE_PAYMENT_PROVIDER={provider}")
    return value
